"""The Pallas TPU kernels of mHC's stream collapse (collapse, dh_pre, dx; :mod:`nash_mhc.ops.stream_collapse`'s
docstring), their tiles and declared costs, and the wrappers that run each on a shard's tokens (its slab form in XLA
where no tile fits)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from nash_mhc.kernels.tpu.stream_mix_kernel import TOKEN_BLOCKS, mix_blocks, mix_kernel
from nash_mhc.ops.dispatch import pallas_call, settled_device_kind
from nash_mhc.ops.rms_norm import rms_inverse, rms_norm, rms_norm_backward, rms_norm_backward_rows
from nash_mhc.ops.stream_slabs import mix_backward_slabs, mix_slabs, stream_stats, weighted_sum
from nash_mhc.ops.stream_tiles import F32, mix_tile, res_transpose, update_grads_tile

_NN = (((1,), (0,)), ((), ()))  # a @ b
_TN = (((0,), (0,)), ((), ()))  # aᵀ @ b
ROW_TILE_BYTES = 4 << 20  # the collapse kernel's token tile: at most this many bytes of float32 [n, tokens, D]
UPDATE_DX_TILE_BYTES = 1 << 20  # the dx kernel that runs the update's backward: float32 [n, tm, td] at most this
SMALL_VMEM_KINDS = ("TPU v2", "TPU v3", "TPU v4")  # 16 MiB of VMEM per core: the budgets above quartered


def _budget(nbytes: int) -> int:
    """A tile budget for the chip the kernels are lowered for (:func:`settled_device_kind`): a quarter on a chip of
    :data:`SMALL_VMEM_KINDS`, where at n = 4, D = 2048 the collapse needed 16.5 MiB at 64 rows and the one that
    makes the update 21 MiB (9-11 MiB of it the register allocator's spills, which grow with the rows)."""
    return nbytes // 4 if (settled_device_kind() or "").startswith(SMALL_VMEM_KINDS) else nbytes


@dataclasses.dataclass(frozen=True)
class KernelCosts:
    """The declared cost of the forward kernel (collapse) and the two backward kernels for one call."""

    collapse: pl.CostEstimate
    dh_pre: pl.CostEstimate
    dx: pl.CostEstimate


def kernel_costs(streams: int, tokens: int, dim: int, coeffs: int, x_bytes: int, blocks: tuple[int, int],
                 pre_rows: int = 2, norm: bool = False, update_bytes: int | None = None) -> KernelCosts:
    """FLOPs and HBM bytes of the kernels for X [n, T, D] of itemsize ``x_bytes`` (u and g too) and C
    coefficient columns, on tiles ``blocks`` = (token tile, column tile).

    collapse (token tiles of whole rows): per stream, token and column C multiply-adds of X_j W_j, one of X_j² and
    one of H_pre X_j; reads X, W and the float32 [``pre_rows``, n] H_pre operand (whole, once), writes raw
    (float32 [T, C]), ss (float32 [T, 1]) and u (X's dtype). H_pre per token: n + 1 transcendentals (an rsqrt
    and n sigmoids), its few multiply-adds not counted. ``norm``: the collapse also writes y = RMSNorm(u) (X's
    dtype) and its float32 [T, 1] statistic: per token and feature a multiply-add for the sum of squares and two
    multiplies, one rsqrt per token, reading the float32 [1, D] gain once.
    dh_pre: one multiply-add per stream, token and column; reads X and du, writes dH_pre (float32 [T, n]).
    ``norm``: dh_pre walks token tiles of whole rows (``blocks[0]``) and runs the norm's backward first: reads
    X, u, dy (X's dtype), inv (float32 [T, 1]) and the gain (float32 [1, D], once), writes du (X's dtype),
    dH_pre and each tile's partial gain gradient (float32 [1, D]); per token and feature 9 FLOPs more (x̂, dy · g,
    the mean's multiply-add, du's three, the gain gradient's multiply-add).
    dx: per stream, token and column 2 C multiply-adds (d_raw W_jᵀ, and X_jᵀ d_raw for dW), n for H_resᵀ g and two
    more (H_pre du, 2 d_ss X); reads X, g, du, the per-token scalars [T, n + 1 + n²] and d_raw [T, C] (float32) once
    per column tile (the grid walks the tokens innermost), W once; writes dX and dWᵀ (float32 [n, C, D], each
    column tile's block once, after the tokens' sum).
    ``update_bytes`` (the itemsize of the previous sublayer's output y, when the collapse kernel first makes that
    sublayer's stream update, ``collapse_streams(update=...)``): the collapse also reads the previous X (n slabs),
    y, H_res and H_post (float32 [T, n²], [T, n]) and writes the updated X, which it then reads from VMEM, not again
    from HBM; per token and feature n (n + 1) multiply-adds more (:func:`.stream_mix_kernel.kernel_costs`'
    forward). Its dx kernel reads the previous X in X's place and makes the updated X again on each tile (n (n + 1)
    multiply-adds per token and feature), then the update's deferred backward from the tile's rounded dX (n (n + 2):
    dy, dH_res, dH_post); it also reads y and H_res, H_post (float32, once per column tile) and writes dy and each
    column tile's part of dH_res and dH_post (float32 [T, n² + n] per column tile)."""
    n, elems = streams, tokens * dim
    column_tiles = dim // blocks[1]
    stream, slab = n * elems * x_bytes, elems * x_bytes
    collapse = pl.CostEstimate(flops=2 * (coeffs + 2) * n * elems, transcendentals=tokens * (n + 1),
                               bytes_accessed=stream + slab + n * dim * coeffs * 4 + pre_rows * n * 4
                               + tokens * (coeffs + 1) * 4)
    if norm:
        collapse = pl.CostEstimate(flops=collapse.flops + 4 * elems, transcendentals=collapse.transcendentals + tokens,
                                   bytes_accessed=collapse.bytes_accessed + slab + dim * 4 + tokens * 4)
    if update_bytes is not None:
        collapse = pl.CostEstimate(flops=collapse.flops + 2 * n * (n + 1) * elems,
                                   transcendentals=collapse.transcendentals,
                                   bytes_accessed=collapse.bytes_accessed + stream + elems * update_bytes
                                   + tokens * (n * n + n) * 4)
    # dh_pre: X, one [T, D] slab (du) and one float32 [T, n] (dH_pre written)
    dh_pre = pl.CostEstimate(flops=2 * n * elems, transcendentals=0, bytes_accessed=stream + slab + tokens * n * 4)
    if norm:
        dh_pre = pl.CostEstimate(flops=(2 * n + 9) * elems, transcendentals=0,
                                 bytes_accessed=stream + 3 * slab + tokens * 4 + dim * 4 + tokens * n * 4
                                 + tokens // blocks[0] * dim * 4)
    per_token = tokens * (n + 1 + n * n + coeffs) * 4
    dx = pl.CostEstimate(flops=2 * (2 * coeffs + n + 2) * n * elems, transcendentals=0,
                         bytes_accessed=3 * stream + slab + column_tiles * per_token + 2 * n * coeffs * dim * 4)
    if update_bytes is not None:  # the update made again (n (n + 1)), then its dy, dH_res, dH_post (n (n + 2))
        mixing = tokens * (n * n + n) * 4
        dx = pl.CostEstimate(flops=dx.flops + 2 * n * (2 * n + 3) * elems, transcendentals=0,
                             bytes_accessed=dx.bytes_accessed + 2 * elems * update_bytes + 2 * column_tiles * mixing)
    return KernelCosts(collapse, dh_pre, dx)


# -------------------------------------------------------------------------------------------- kernels
def _collapse_kernel(pre_weights, eps, x_ref, w_ref, p_ref, *refs):
    if eps is None:
        raw_ref, ss_ref, u_ref = refs
    else:
        gain_ref, raw_ref, ss_ref, u_ref, inv_ref, y_ref = refs
    n = x_ref.shape[0]
    raw, ss = jnp.zeros(raw_ref.shape, F32), jnp.zeros(ss_ref.shape, F32)
    for j in range(n):
        xj = x_ref[j].astype(F32)
        raw = raw + lax.dot_general(xj, w_ref[j], _NN, preferred_element_type=F32)
        ss = ss + jnp.sum(xj * xj, axis=1, keepdims=True)
    raw_ref[...] = raw
    ss_ref[...] = ss
    h = pre_weights(raw, ss, p_ref[...])  # [tm, n]: H_pre
    acc = h[:, 0:1] * x_ref[0].astype(F32)
    for j in range(1, n):
        acc = acc + h[:, j:j + 1] * x_ref[j].astype(F32)
    u = acc.astype(u_ref.dtype)
    u_ref[...] = u
    if eps is not None:  # the sublayer's RMSNorm of the rounded u, from the tile's whole rows
        inv = rms_inverse(u, eps)
        inv_ref[...] = inv
        y_ref[...] = rms_norm(u, gain_ref[...], eps, inv)


def _update_collapse_kernel(pre_weights, eps, x_ref, y_ref, res_ref, post_ref, w_ref, p_ref, *refs):
    """The previous sublayer's stream update X' = H_res X + H_post (x) y on a tile of whole rows (stream_mix's
    kernel), written once, then the collapse of X' (:func:`_collapse_kernel`) from that tile in VMEM."""
    gains = 0 if eps is None else 1
    gain, (xu_ref, *outs) = refs[:gains], refs[gains:]
    mix_kernel(x_ref, y_ref, res_ref, post_ref, xu_ref)
    _collapse_kernel(pre_weights, eps, xu_ref, w_ref, p_ref, *gain, *outs)


def _dh_pre_kernel(x_ref, du_ref, out_ref):
    partial = _stream_dots(x_ref, du_ref[...].astype(F32), out_ref.shape)

    @pl.when(pl.program_id(1) == 0)
    def _start():
        out_ref[...] = jnp.zeros(out_ref.shape, F32)

    out_ref[...] += partial


def _norm_dh_pre_kernel(x_ref, u_ref, dy_ref, inv_ref, gain_ref, du_ref, dh_ref, dgain_ref):
    """The sublayer's RMSNorm backward on a tile of whole rows (du from dy, and the tile's part of the gain's
    gradient), then dH_pre from the rounded du: du is written once and not read back."""
    du, dgain_ref[...] = rms_norm_backward_rows(u_ref[...], gain_ref[...], inv_ref[...], dy_ref[...])
    du = du.astype(du_ref.dtype)
    du_ref[...] = du
    dh_ref[...] = _stream_dots(x_ref, du.astype(F32), dh_ref.shape)


def _stream_dots(x_ref, du, shape):
    """[tm, n] float32: column j the row sums of X_j du over this tile's columns."""
    lane = lax.broadcasted_iota(jnp.int32, shape, 1)
    out = jnp.zeros(shape, F32)
    for j in range(x_ref.shape[0]):
        out = jnp.where(lane == j, jnp.sum(x_ref[j].astype(F32) * du, axis=1, keepdims=True), out)
    return out


def _dx_kernel(x_ref, g_ref, du_ref, scalars_ref, draw_ref, w_ref, dx_ref, dw_ref):
    _dx_tile([x_ref[j].astype(F32) for j in range(x_ref.shape[0])], g_ref, du_ref, scalars_ref, draw_ref, w_ref,
             dx_ref, dw_ref)


def _dx_tile(xs, g_ref, du_ref, scalars_ref, draw_ref, w_ref, dx_ref, dw_ref):
    """dX of one (token, column) tile from the n float32 tiles xs of X, written rounded and returned as float32;
    dW's tile summed over the token tiles (the grid's inner axis)."""
    n = len(xs)
    du = du_ref[...].astype(F32)
    scalars, draw = scalars_ref[...], draw_ref[...]  # [tm, n + 1 + n²]: H_pre, 2 d_ss, then H_res; [tm, C]
    gs = [g_ref[i].astype(F32) for i in range(n)]

    @pl.when(pl.program_id(1) == 0)
    def _start():
        dw_ref[...] = jnp.zeros(dw_ref.shape, F32)

    dx = []
    for j in range(n):
        acc = res_transpose(scalars, gs, j, n + 1) + scalars[:, j:j + 1] * du + scalars[:, n:n + 1] * xs[j]
        acc = acc + lax.dot_general(draw, w_ref[j], _NN, preferred_element_type=F32)
        dx.append(acc.astype(dx_ref.dtype))
        dx_ref[j] = dx[j]
        dw_ref[j] += lax.dot_general(draw, xs[j], _TN, preferred_element_type=F32)  # dW_jᵀ [C, td]
    return [a.astype(F32) for a in dx]


def _update_dx_kernel(x_ref, g_ref, du_ref, scalars_ref, draw_ref, w_ref, y_ref, res_ref, post_ref, dx_ref, dw_ref,
                      dy_ref, dres_ref, dpost_ref):
    """The collapse's dX for the updated X, made again on the tile from the previous X and y (the forward kernel's
    sums, rounded alike), then the update's deferred backward from that dX: dy, and this column tile's part of
    dH_res and dH_post (summed over the column tiles after the kernel)."""
    n = x_ref.shape[0]
    xs, y = [x_ref[j].astype(F32) for j in range(n)], y_ref[...].astype(F32)
    post = post_ref[...]
    updated = [a.astype(x_ref.dtype).astype(F32) for a in mix_tile(xs, y, res_ref[...], post)]
    gs = _dx_tile(updated, g_ref, du_ref, scalars_ref, draw_ref, w_ref, dx_ref, dw_ref)
    dy, dres_ref[...], dpost_ref[...] = update_grads_tile(xs, gs, y, post)
    dy_ref[...] = dy.astype(dy_ref.dtype)


# ------------------------------------------------------------------------------------------ pallas calls
def _tiles(blocks: tuple[int, int] | None, tokens: int, dim: int, kernels: bool) -> tuple[int, int] | None:
    """The tiles a kernel runs on: ``blocks``, else :func:`mix_blocks` of this shard's (T, D); None (the slab form
    in XLA) where none divides or ``kernels`` is False."""
    return (blocks or mix_blocks(tokens, dim)) if kernels else None


def _row_tile(blocks: tuple[int, int] | None, streams: int, tokens: int, dim: int,
              budget: int | None = None) -> int | None:
    """The collapse kernel's token tile (and the dx kernel's, on its column tile's ``dim``): ``blocks``' when given,
    else the largest of ``TOKEN_BLOCKS`` that divides this shard's tokens and keeps n x tile x D float32 within
    ``budget`` (default ``ROW_TILE_BYTES``; each a quarter on a chip with 16 MiB of VMEM, :func:`_budget`); None
    (the XLA form) if none. The kernel that also makes the
    previous update holds X and X' and takes half of ``ROW_TILE_BYTES`` (at 128 rows of n = 4, D = 2048 it needed
    17.4 MiB of VMEM, over v5e's 16 MiB scoped limit)."""
    if blocks is not None:
        return blocks[0]
    budget = _budget(ROW_TILE_BYTES if budget is None else budget)
    return next((b for b in TOKEN_BLOCKS if tokens % b == 0 and streams * b * dim * 4 <= budget), None)


def _collapse_rows(*operands, pre_weights, eps, update, blocks, interpret):
    """(raw = sum_j X_j W_j [T, C], ss = sum_j sum_d X_j² [T], u = sum_j H_pre[:, j] X_j [T, D] in X's dtype) from
    one read of X by the collapse kernel on token tiles of whole rows, and with ``eps`` (and the gain [D]) also
    inv [T, 1] and y = RMSNorm(u) (:mod:`nash_mhc.ops.rms_norm`); in XLA (the slab forms, H_pre by
    ``pre_weights``) where no tile fits this shard. ``operands``: (X, W, the H_pre operand[, gain]), with
    ``update`` (X, y, H_res [T, n²], H_post [T, n], W, ...): the kernel first makes the previous sublayer's update
    X' = H_res X + H_post (x) y, returned first, and collapses X'."""
    x, rest = operands[0], operands[1:]
    mixing, (w, operand, *gain) = (rest[:3], rest[3:]) if update else ((), rest)
    n, tokens, dim = x.shape
    coeffs = w.shape[2]
    tm = _row_tile(blocks, n, tokens, dim, ROW_TILE_BYTES // 2 if update else ROW_TILE_BYTES)
    if tm is None:
        if update:
            x = mix_slabs(x, *mixing)
        slabs = [a.astype(F32) for a in x]
        raw, ss = stream_stats(slabs, w)
        u = weighted_sum(slabs, pre_weights(raw, ss[:, None], operand)).astype(x.dtype)
        updated = (x,) if update else ()
        if eps is None:
            return *updated, raw, ss, u
        inv = rms_inverse(u, eps)
        return *updated, raw, ss, u, inv, rms_norm(u, gain[0], eps, inv)
    rows, whole = pl.BlockSpec((tm, dim), lambda t: (t, 0)), pl.BlockSpec((1, dim), lambda t: (0, 0))
    column, streams = pl.BlockSpec((tm, 1), lambda t: (t, 0)), pl.BlockSpec((n, tm, dim), lambda t: (0, t, 0))
    out_specs = [pl.BlockSpec((tm, coeffs), lambda t: (t, 0)), column, rows]
    out_shape = [jax.ShapeDtypeStruct((tokens, coeffs), F32), jax.ShapeDtypeStruct((tokens, 1), F32),
                 jax.ShapeDtypeStruct((tokens, dim), x.dtype)]
    if eps is not None:
        out_specs += [column, rows]
        out_shape += [jax.ShapeDtypeStruct((tokens, 1), F32), jax.ShapeDtypeStruct((tokens, dim), x.dtype)]
    in_specs = [pl.BlockSpec((n, dim, coeffs), lambda t: (0, 0, 0)), pl.BlockSpec(operand.shape, lambda t: (0, 0)),
                *[whole] * len(gain)]
    kernel = _collapse_kernel
    if update:
        kernel = _update_collapse_kernel
        in_specs = [rows, pl.BlockSpec((tm, n * n), lambda t: (t, 0)), pl.BlockSpec((tm, n), lambda t: (t, 0)),
                    *in_specs]
        out_specs, out_shape = [streams, *out_specs], [jax.ShapeDtypeStruct(x.shape, x.dtype), *out_shape]
    out = pallas_call(
        functools.partial(kernel, pre_weights, eps), grid=(tokens // tm,), in_specs=[streams, *in_specs],
        out_specs=out_specs, out_shape=out_shape,
        cost_estimate=kernel_costs(n, tokens, dim, coeffs, x.dtype.itemsize, (tm, dim), operand.shape[0],
                                   norm=eps is not None,
                                   update_bytes=mixing[0].dtype.itemsize if update else None).collapse,
        interpret=interpret, compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)))(
            x, *mixing, w, operand, *(g.reshape(1, dim) for g in gain))
    updated, out = (out[:1], out[1:]) if update else ((), out)
    return *updated, out[0], out[1][:, 0], *out[2:]


def _dh_pre(x, du, *, blocks, interpret, kernels=True):
    """dH_pre [T, n] float32; the slab form in XLA where no tile divides this shard's (T, D)."""
    n, tokens, dim = x.shape
    blocks = _tiles(blocks, tokens, dim, kernels)
    if blocks is None:
        return jnp.stack([jnp.sum(a.astype(F32) * du.astype(F32), axis=-1) for a in x], axis=-1)
    tm, td = blocks
    return pallas_call(
        _dh_pre_kernel, grid=(tokens // tm, dim // td),
        in_specs=[pl.BlockSpec((n, tm, td), lambda t, d: (0, t, d)), pl.BlockSpec((tm, td), lambda t, d: (t, d))],
        out_specs=pl.BlockSpec((tm, n), lambda t, d: (t, 0)), out_shape=jax.ShapeDtypeStruct((tokens, n), F32),
        cost_estimate=kernel_costs(n, tokens, dim, 0, x.dtype.itemsize, blocks).dh_pre, interpret=interpret,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")))(x, du)


def _norm_dh_pre(x, u, dy, inv, gain, *, blocks, interpret, kernels=True):
    """(du in X's dtype, dH_pre [T, n] float32, the gain's gradient [D] float32) of the sublayer's RMSNorm at u
    (statistic inv [T, 1], gain [D]) from y's cotangent dy: one kernel on token tiles of whole rows (the collapse
    kernel's, :func:`_row_tile`), or the norm's backward in XLA and :func:`_dh_pre` where none fits this shard."""
    n, tokens, dim = x.shape
    tm = _row_tile(blocks, n, tokens, dim) if kernels else None
    if tm is None:
        du, dgain = rms_norm_backward(u, gain, inv, dy)
        du = du.astype(x.dtype)
        return du, _dh_pre(x, du, blocks=blocks, interpret=interpret, kernels=kernels), dgain
    rows = pl.BlockSpec((tm, dim), lambda t: (t, 0))
    du, dh, dgain = pallas_call(
        _norm_dh_pre_kernel, grid=(tokens // tm,),
        in_specs=[pl.BlockSpec((n, tm, dim), lambda t: (0, t, 0)), rows, rows, pl.BlockSpec((tm, 1), lambda t: (t, 0)),
                  pl.BlockSpec((1, dim), lambda t: (0, 0))],
        out_specs=[rows, pl.BlockSpec((tm, n), lambda t: (t, 0)), pl.BlockSpec((None, 1, dim), lambda t: (t, 0, 0))],
        out_shape=[jax.ShapeDtypeStruct((tokens, dim), x.dtype), jax.ShapeDtypeStruct((tokens, n), F32),
                   jax.ShapeDtypeStruct((tokens // tm, 1, dim), F32)],
        cost_estimate=kernel_costs(n, tokens, dim, 0, x.dtype.itemsize, (tm, dim), norm=True).dh_pre,
        interpret=interpret, compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)))(
            x, u, dy, inv, gain.reshape(1, dim))
    return du, dh, jnp.sum(dgain, axis=(0, 1))


def _dx_tiles(blocks: tuple[int, int] | None, streams: int, tokens: int, dim: int, kernels: bool, update: bool
              ) -> tuple[int, int] | None:
    """The dx kernel's (token tile, column tile): :func:`_tiles`; when it also runs the update's backward (and no
    ``blocks`` are given) the token tile shrinks to the largest of ``TOKEN_BLOCKS`` that keeps n x tm x td float32
    within ``UPDATE_DX_TILE_BYTES``: with X_prev, y, dy and the mixing coefficients' tiles beside X's and dX's, (256,
    512) tiles of n = 4 needed 18.5 MiB of VMEM, over the 16 MiB scoped limit of v5e and v4 (`1b` did not compile
    there)."""
    tiles = _tiles(blocks, tokens, dim, kernels)
    if tiles is None or blocks is not None or not update:
        return tiles
    # tiles[0] divides tokens, so the smallest token tile does too: it stands in where even it is over the budget
    return _row_tile(None, streams, tokens, tiles[1], UPDATE_DX_TILE_BYTES) or TOKEN_BLOCKS[-1], tiles[1]


def _dx(x, g, du, scalars, draw, w_t, *update, blocks, interpret, kernels=True):
    """(dX [n, T, D], dW [n, D, C] float32 = X_jᵀ d_raw) on grid (column tile, token tile): W's column tile and
    dW's stay put while the tokens walk, dW summing over them. The kernel writes dWᵀ [n, C, D] (d_rawᵀ X_j: the
    transposed operand is the [tm, C] d_raw tile, not X's, and the block is lane-dense). The token axis is
    "arbitrary" (dW's sum runs along it), so a two-core chip (v4, v5p) splits only the column tiles. The slab form
    in XLA where no tile divides this shard's (T, D).

    ``update`` = (X_prev, y, H_res [T, n²], H_post) of the update X = H_res X_prev + H_post (x) y that made X: also
    that update's deferred backward from dX, (dy [T, D], dH_res [T, n²], dH_post [T, n]), in the same kernel
    (:func:`_update_dx_kernel`), which reads X_prev and y in X's place and makes X again on each tile, so neither X
    nor dX is read a second time; dH_res and dH_post come out per column tile and are summed here, in the column
    tiles' order. In XLA: the slab form on X, then stream_mix's deferred backward."""
    n, tokens, dim = x.shape
    blocks = _dx_tiles(blocks, n, tokens, dim, kernels, bool(update))
    coeffs = draw.shape[1]
    if blocks is None:
        du32, gs = du.astype(F32), [a.astype(F32) for a in g]
        dx = jnp.stack([res_transpose(scalars, gs, j, n + 1) + scalars[:, j:j + 1] * du32
                        + scalars[:, n:n + 1] * x[j].astype(F32) + draw @ w_t[j] for j in range(n)]).astype(x.dtype)
        # dW_j = X_jᵀ d_raw as (d_rawᵀ X_j)ᵀ from a materialised d_rawᵀ [C, T]: XLA CPU ran the product with
        # d_raw's C = 24 columns minor at ~25 GFLOP/s, the [C, D] one 2-3 x as fast (docs/results/cpu_throughput)
        draw_t = jax.lax.optimization_barrier(draw.T)
        dw = jnp.swapaxes(jnp.stack([draw_t @ x[j].astype(F32) for j in range(n)]), 1, 2)
        return dx, dw, *(mix_backward_slabs(*update, dx, defer=True)[1:] if update else ())
    tm, td = blocks
    stream, slab = pl.BlockSpec((n, tm, td), lambda d, t: (0, t, d)), pl.BlockSpec((tm, td), lambda d, t: (t, d))
    dw_spec = pl.BlockSpec((n, coeffs, td), lambda d, t: (0, 0, d))

    def per_token(k: int) -> pl.BlockSpec:
        return pl.BlockSpec((tm, k), lambda d, t: (t, 0))

    def per_column_tile(k: int) -> pl.BlockSpec:
        return pl.BlockSpec((None, tm, k), lambda d, t: (d, t, 0))
    kernel, operands = _dx_kernel, (x, g, du, scalars, draw, w_t)
    in_specs = [stream, stream, slab, per_token(n + 1 + n * n), per_token(coeffs), dw_spec]
    out_specs = [stream, dw_spec]
    out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((n, coeffs, dim), F32)]
    costs = kernel_costs(n, tokens, dim, coeffs, x.dtype.itemsize, blocks,
                         update_bytes=update[1].dtype.itemsize if update else None)
    if update:  # X_prev in X's place
        kernel, operands = _update_dx_kernel, (update[0], *operands[1:], *update[1:])
        in_specs += [slab, per_token(n * n), per_token(n)]
        out_specs += [slab, per_column_tile(n * n), per_column_tile(n)]
        out_shape += [jax.ShapeDtypeStruct(update[1].shape, update[1].dtype),
                      jax.ShapeDtypeStruct((dim // td, tokens, n * n), F32),
                      jax.ShapeDtypeStruct((dim // td, tokens, n), F32)]
    dx, dw_t, *mixing = pallas_call(
        kernel, grid=(dim // td, tokens // tm), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        cost_estimate=costs.dx, interpret=interpret,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")))(*operands)
    if update:
        mixing = (mixing[0], functools.reduce(jnp.add, mixing[1]), functools.reduce(jnp.add, mixing[2]))
    return dx, jnp.swapaxes(dw_t, 1, 2), *mixing


__all__ = ["F32", "ROW_TILE_BYTES", "SMALL_VMEM_KINDS", "UPDATE_DX_TILE_BYTES", "KernelCosts", "kernel_costs"]
