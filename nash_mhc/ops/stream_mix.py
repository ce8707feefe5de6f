"""mHC's stream update as one Pallas TPU kernel: X <- H_res X + H_post (x) y, each stream read and written once.

    stream_mix(x, y, h_res, h_post)    x [n, T, D], y [T, D], h_res [T, n, n], h_post [T, n] → [n, T, D]

    out[i, t] = sum_j h_res[t, i, j] x[j, t] + h_post[t, i] y[t]        (float32, rounded once to x's dtype)

Written in XLA over the n [T, D] slabs, the TPU compiler computes every output slab in its own fusion, each
reading all n input slabs, and then copies the n slabs into the stacked result: several times the cost of
reading x and y and writing the result once (compiler estimates, docs/results/tpu_estimate/README.md). The
kernel walks tiles of [n, tokens, D-columns] and computes all n outputs of a tile from one read of its n inputs.
Its backward kernel does the same for

    dx[j] = sum_i h_res[:, i, j] g[i]      dy = sum_i h_post[:, i] g[i]
    dh_res[:, i, j] = sum_d g[i] x[j]      dh_post[:, i] = sum_d g[i] y        (g: the output's cotangent)

accumulating the two coefficient gradients over the D-column tiles of a token tile (the grid's inner axis).

Each ``pallas_call`` declares its cost (:func:`kernel_costs`): the multiply-adds above and the HBM bytes of one
read of every operand and one write of every result (a coefficient tile's index does not change along the inner
axis, so Pallas fetches and writes it once per token tile). The kernels run on TPU only (:func:`nash_mhc.layers.
hyperconnection.HyperConnection.streams_major` dispatches with ``dispatch.platform_dependent``); ``interpret=True``
runs them in Pallas' interpreter (CPU tests). Elsewhere ``kernels=False`` computes the same sums and the same
backward rule in XLA over the n slabs: JAX's autodiff of the slab form padded each stream's gradient to
[n, T, D] and added the n pads, and on the CPU those pads were the largest item of the mix
(``benchmarks/cpu_profile.py --residual mhc``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from nash_mhc.ops.dispatch import pallas_call

F32 = jnp.float32
TOKEN_BLOCKS = (256, 128, 64, 32, 16)   # a token tile: a multiple of 16 sublanes (bfloat16 packs two per row)
COLUMN_BLOCKS = (512, 256, 128)         # a D-column tile: a multiple of the 128 lanes
# logical names of (x, y, h_res, h_post) and of the result, for nash_mhc.sharding.per_shard: tokens split over
# the batch axes, streams and features whole (the mix is per token)
SHARD_AXES = ((("streams", "tokens", "features"), ("tokens", "features"), ("tokens", "streams", "streams"),
               ("tokens", "streams")), ("streams", "tokens", "features"))


def mix_blocks(tokens: int, dim: int) -> tuple[int, int] | None:
    """(token tile, column tile) for x [n, tokens, dim]; the whole D when no column tile divides it; None when
    no token tile divides ``tokens`` (the XLA path runs instead)."""
    tm = next((b for b in TOKEN_BLOCKS if tokens % b == 0), None)
    if tm is None:
        return None
    return tm, next((b for b in COLUMN_BLOCKS if dim % b == 0), dim)


@dataclasses.dataclass(frozen=True)
class KernelCosts:
    """The declared cost of the forward and backward kernel for one call."""

    forward: pl.CostEstimate
    backward: pl.CostEstimate
    deferred_backward: pl.CostEstimate


def kernel_costs(streams: int, tokens: int, dim: int, x_bytes: int, y_bytes: int) -> KernelCosts:
    """FLOPs and HBM bytes of the two kernels, for x [n, T, D] of itemsize ``x_bytes`` and y of ``y_bytes``.

    Forward: n (n + 1) multiply-adds per token and column (2 FLOPs each); reads x, y, h_res and h_post, writes
    the result. Backward: dx (n² multiply-adds), dy (n), dh_res (n²) and dh_post (n); reads x, y, g, h_res and
    h_post, writes dx, dy, dh_res and dh_post. The deferred backward (``defer=True``): dy (n), dh_res (n²) and
    dh_post (n); reads x, y, g, h_res and h_post, writes dy, dh_res and dh_post (dx is g itself). Coefficients are
    float32."""
    n, elems = streams, tokens * dim
    stream = n * elems * x_bytes             # x, the result, g or dx: n slabs
    slab = elems * y_bytes                   # y or dy
    coefficients = tokens * (n * n + n) * 4  # h_res and h_post (or their gradients)
    forward = pl.CostEstimate(flops=2 * n * (n + 1) * elems, transcendentals=0,
                              bytes_accessed=2 * stream + slab + coefficients)
    backward = pl.CostEstimate(flops=4 * n * (n + 1) * elems, transcendentals=0,
                               bytes_accessed=3 * stream + 2 * slab + 2 * coefficients)
    deferred = pl.CostEstimate(flops=2 * n * (n + 2) * elems, transcendentals=0,
                               bytes_accessed=2 * stream + 2 * slab + 2 * coefficients)
    return KernelCosts(forward, backward, deferred)


# -------------------------------------------------------------------------------------------- kernels
def mix_kernel(x_ref, y_ref, res_ref, post_ref, out_ref):
    """One tile of the update: out[i] = sum_j res[:, i n + j] x[j] + post[:, i] y, float32, rounded once (also the
    first half of the collapse kernel that takes the update, :mod:`nash_mhc.kernels.tpu.stream_collapse_kernels`)."""
    n = x_ref.shape[0]
    out = mix_tile([x_ref[j].astype(F32) for j in range(n)], y_ref[...].astype(F32), res_ref[...], post_ref[...])
    for i in range(n):
        out_ref[i] = out[i].astype(out_ref.dtype)


def mix_tile(xs: list[jax.Array], y: jax.Array, res: jax.Array, post: jax.Array) -> list[jax.Array]:
    """The n updated streams of one tile, float32 before rounding: sum_j res[:, i n + j] xs[j] + post[:, i] y, from
    the n float32 tiles xs, y, res [tm, n·n] and post [tm, n]. The one definition of the update's sums in the
    kernels (the update, the collapse that makes it, and the collapse's backward that makes it again)."""
    n = len(xs)
    out = []
    for i in range(n):
        acc = res[:, i * n:i * n + 1] * xs[0]
        for j in range(1, n):
            acc = acc + res[:, i * n + j:i * n + j + 1] * xs[j]
        out.append(acc + post[:, i:i + 1] * y)
    return out


def res_transpose(res: jax.Array, gs: list[jax.Array], j: int, offset: int = 0) -> jax.Array:
    """sum_i H_res[:, i, j] g_i [T, D] (float32): stream j's cotangent through H_res X, from the n cotangents g_i
    [T, D] and H_res [T, n, n] held row-major as the n² columns of ``res`` from ``offset`` on. The one definition
    of H_resᵀ g, in the Pallas kernels (here and the collapse's dx) and their XLA forms."""
    n = len(gs)
    acc = res[:, offset + j:offset + j + 1] * gs[0]
    for i in range(1, n):
        k = offset + i * n + j
        acc = acc + res[:, k:k + 1] * gs[i]
    return acc


def _columns(columns: list[jax.Array]) -> jax.Array:
    """[tm, k] from k columns [tm, 1] (a lane select per column: no lane concatenation in the kernel)."""
    lane = lax.broadcasted_iota(jnp.int32, (columns[0].shape[0], len(columns)), 1)
    out = jnp.zeros(lane.shape, F32)
    for k, column in enumerate(columns):
        out = jnp.where(lane == k, column, out)
    return out


def _backward_kernel(x_ref, y_ref, res_ref, post_ref, g_ref, *out_refs):
    """Writes (dx, dy, dres, dpost), or (dy, dres, dpost) for the deferred rule."""
    dx_ref, (dy_ref, dres_ref, dpost_ref) = (out_refs[0], out_refs[1:]) if len(out_refs) == 4 else (None, out_refs)
    n = x_ref.shape[0]
    xs = [x_ref[j].astype(F32) for j in range(n)]
    gs = [g_ref[i].astype(F32) for i in range(n)]
    y = y_ref[...].astype(F32)
    res, post = res_ref[...], post_ref[...]
    for j in range(n if dx_ref is not None else 0):
        dx_ref[j] = res_transpose(res, gs, j).astype(dx_ref.dtype)
    dy, dres, dpost = update_grads_tile(xs, gs, y, post)
    dy_ref[...] = dy.astype(dy_ref.dtype)

    @pl.when(pl.program_id(1) == 0)
    def _start():
        dres_ref[...] = jnp.zeros(dres_ref.shape, F32)
        dpost_ref[...] = jnp.zeros(dpost_ref.shape, F32)

    dres_ref[...] += dres
    dpost_ref[...] += dpost


def update_grads_tile(xs: list[jax.Array], gs: list[jax.Array], y: jax.Array, post: jax.Array
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(dy [tm, td] before rounding, dh_res [tm, n·n], dh_post [tm, n]: this tile's column sums) of the update from
    the n float32 tiles of X and of the updated X's cotangent g, y and post [tm, n]."""
    n = len(xs)
    dy = post[:, 0:1] * gs[0]
    for i in range(1, n):
        dy = dy + post[:, i:i + 1] * gs[i]
    dres = _columns([jnp.sum(gs[i] * xs[j], axis=1, keepdims=True) for i in range(n) for j in range(n)])
    dpost = _columns([jnp.sum(gs[i] * y, axis=1, keepdims=True) for i in range(n)])
    return dy, dres, dpost


# ------------------------------------------------------------------------------------------ XLA forms
def mix_slabs(x, y, res, post):
    """The forward kernel's sums over the n [T, D] slabs in XLA (the CPU's and GPU's form): res [T, n·n]."""
    n = x.shape[0]
    xs, y = [a.astype(F32) for a in x], y.astype(F32)
    out = [sum(res[:, i * n + j, None] * xs[j] for j in range(n)) + post[:, i, None] * y for i in range(n)]
    return jnp.stack(out).astype(x.dtype)


def _backward_slabs(x, y, res, post, g, defer=False):
    """The backward kernel's sums in XLA: dx stacked once (autodiff of the slab form instead pads every stream's
    gradient to [n, T, D] and adds the n pads); g itself in dx's place for the deferred rule."""
    n = x.shape[0]
    xs, gs, y32 = [a.astype(F32) for a in x], [a.astype(F32) for a in g], y.astype(F32)
    dx = g if defer else jnp.stack([res_transpose(res, gs, j) for j in range(n)]).astype(x.dtype)
    dy = sum(post[:, i, None] * gs[i] for i in range(n)).astype(y.dtype)
    dres = jnp.stack([jnp.sum(gs[i] * xs[j], axis=-1) for i in range(n) for j in range(n)], axis=-1)
    dpost = jnp.stack([jnp.sum(gs[i] * y32, axis=-1) for i in range(n)], axis=-1)
    return dx, dy, dres, dpost


# ------------------------------------------------------------------------------------------ pallas calls
def _specs(n: int, tm: int, td: int) -> tuple[pl.BlockSpec, pl.BlockSpec, pl.BlockSpec, pl.BlockSpec]:
    """Block specs of x-like [n, T, D], y-like [T, D], h_res [T, n·n] and h_post [T, n] on grid (token, column)."""
    return (pl.BlockSpec((n, tm, td), lambda t, d: (0, t, d)), pl.BlockSpec((tm, td), lambda t, d: (t, d)),
            pl.BlockSpec((tm, n * n), lambda t, d: (t, 0)), pl.BlockSpec((tm, n), lambda t, d: (t, 0)))


def _params(interpret: bool, inner: str) -> dict:
    return dict(interpret=interpret,
                compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", inner)))


def _forward(x, y, res, post, blocks, interpret):
    if blocks is None:
        return mix_slabs(x, y, res, post)
    n, tokens, dim = x.shape
    tm, td = blocks
    stream, slab, res_spec, post_spec = _specs(n, tm, td)
    return pallas_call(
        mix_kernel, grid=(tokens // tm, dim // td), in_specs=[stream, slab, res_spec, post_spec],
        out_specs=stream, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        cost_estimate=kernel_costs(n, tokens, dim, x.dtype.itemsize, y.dtype.itemsize).forward,
        **_params(interpret, "parallel"))(x, y, res, post)


def mix_backward(x, y, res, post, g, blocks, interpret, defer):
    """(dx, dy, dres, dpost) by the backward kernel on tiles ``blocks``, or (g, dy, dres, dpost) with ``defer``; the
    XLA form where ``blocks`` is None."""
    if blocks is None:
        return _backward_slabs(x, y, res, post, g, defer)
    n, tokens, dim = x.shape
    tm, td = blocks
    stream, slab, res_spec, post_spec = _specs(n, tm, td)
    costs = kernel_costs(n, tokens, dim, x.dtype.itemsize, y.dtype.itemsize)
    outs = [(stream, x)] * (not defer) + [(slab, y), (res_spec, res), (post_spec, post)]  # res, post: float32
    grads = pallas_call(
        _backward_kernel, grid=(tokens // tm, dim // td), in_specs=[stream, slab, res_spec, post_spec, stream],
        out_specs=[spec for spec, _ in outs], out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for _, a in outs],
        cost_estimate=costs.deferred_backward if defer else costs.backward,
        **_params(interpret, "arbitrary"))(x, y, res, post, g)
    return (g, *grads) if defer else tuple(grads)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _mix(x, y, res, post, blocks, interpret, defer):
    return _forward(x, y, res, post, blocks, interpret)


def _mix_fwd(x, y, res, post, blocks, interpret, defer):
    return _forward(x, y, res, post, blocks, interpret), (x, y, res, post)


def _mix_bwd(blocks, interpret, defer, residuals, g):
    x, y, res, post = residuals
    return mix_backward(x, y, res, post, g.astype(x.dtype), blocks, interpret, defer)


_mix.defvjp(_mix_fwd, _mix_bwd)


def stream_mix(x: jax.Array, y: jax.Array, h_res: jax.Array, h_post: jax.Array, *,
               blocks: tuple[int, int] | None = None, interpret: bool = False, kernels: bool = True,
               defer: bool = False) -> jax.Array:
    """H_res X + H_post (x) y by the Pallas kernels: x [n, T, D] (any float dtype), y [T, D], h_res [T, n, n] and
    h_post [T, n] (float32) → [n, T, D] in x's dtype, computed in float32.

    ``blocks``: (token tile, column tile), default :func:`mix_blocks`; ValueError when they do not divide
    (T, D) or the token tile is not a multiple of 8. ``kernels=False``: the same sums and the same backward
    rule in XLA over the n slabs (any T, D; ``blocks`` ignored), the CPU's and GPU's form.

    ``defer=True``: the backward rule hands back the output's cotangent g itself as x's, for the consumer that
    made x to apply H_resᵀ (saves writing dx = H_resᵀ g and reading it back). Only for an x that is the pass-
    through X of :func:`nash_mhc.ops.stream_collapse.collapse_streams`, which does that; anywhere else x's
    gradient would be wrong."""
    n, tokens, dim = x.shape
    res = h_res.astype(F32).reshape(tokens, n * n)
    if not kernels:
        return _mix(x, y, res, h_post.astype(F32), None, interpret, defer)
    blocks = mix_blocks(tokens, dim) if blocks is None else blocks
    if blocks is None or tokens % blocks[0] or blocks[0] % 8 or dim % blocks[1]:
        raise ValueError(f"stream_mix needs tiles that divide (tokens, dim) = ({tokens}, {dim}) with a token tile "
                         f"that is a multiple of 8, got {blocks}")
    return _mix(x, y, res, h_post.astype(F32), blocks, interpret, defer)
