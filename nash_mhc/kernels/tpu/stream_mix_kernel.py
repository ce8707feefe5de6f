"""mHC's stream update as one Pallas TPU kernel, and its backward kernel: X' = H_res X + H_post (x) y, each stream
read and written once (:mod:`nash_mhc.ops.stream_mix` chooses between them and the XLA slab form).

    x [n, T, D], y [T, D], res [T, n·n] (H_res row-major), post [T, n] → [n, T, D]
    out[i, t] = sum_j h_res[t, i, j] x[j, t] + h_post[t, i] y[t]        (float32, rounded once to x's dtype)

Written in XLA over the n [T, D] slabs, the TPU compiler computes every output slab in its own fusion, each
reading all n input slabs, and then copies the n slabs into the stacked result: several times the cost of
reading x and y and writing the result once (compiler estimates, docs/results/tpu_estimate/README.md). The
kernel walks tiles of [n, tokens, D-columns] and computes all n outputs of a tile from one read of its n inputs
(:func:`nash_mhc.ops.stream_tiles.mix_tile`). Its backward kernel does the same for

    dx[j] = sum_i h_res[:, i, j] g[i]      dy = sum_i h_post[:, i] g[i]
    dh_res[:, i, j] = sum_d g[i] x[j]      dh_post[:, i] = sum_d g[i] y        (g: the output's cotangent)

accumulating the two coefficient gradients over the D-column tiles of a token tile (the grid's inner axis).

Each ``pallas_call`` declares its cost (:func:`kernel_costs`): the multiply-adds above and the HBM bytes of one
read of every operand and one write of every result (a coefficient tile's index does not change along the inner
axis, so Pallas fetches and writes it once per token tile). ``interpret=True`` runs them in Pallas' interpreter
(CPU tests).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from nash_mhc.ops.dispatch import pallas_call
from nash_mhc.ops.stream_tiles import F32, mix_tile, res_transpose, update_grads_tile

TOKEN_BLOCKS = (256, 128, 64, 32, 16)   # a token tile: a multiple of 16 sublanes (bfloat16 packs two per row)
COLUMN_BLOCKS = (512, 256, 128)         # a D-column tile: a multiple of the 128 lanes


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


# ------------------------------------------------------------------------------------------ pallas calls
def _specs(n: int, tm: int, td: int) -> tuple[pl.BlockSpec, pl.BlockSpec, pl.BlockSpec, pl.BlockSpec]:
    """Block specs of x-like [n, T, D], y-like [T, D], h_res [T, n·n] and h_post [T, n] on grid (token, column)."""
    return (pl.BlockSpec((n, tm, td), lambda t, d: (0, t, d)), pl.BlockSpec((tm, td), lambda t, d: (t, d)),
            pl.BlockSpec((tm, n * n), lambda t, d: (t, 0)), pl.BlockSpec((tm, n), lambda t, d: (t, 0)))


def _params(interpret: bool, inner: str) -> dict:
    return dict(interpret=interpret,
                compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", inner)))


def mix_forward_kernel(x, y, res, post, blocks, interpret):
    """X' [n, T, D] in x's dtype by the forward kernel on tiles ``blocks`` = (token tile, column tile) that divide
    (T, D): x [n, T, D], y [T, D], res [T, n·n] and post [T, n] (float32)."""
    n, tokens, dim = x.shape
    tm, td = blocks
    stream, slab, res_spec, post_spec = _specs(n, tm, td)
    return pallas_call(
        mix_kernel, grid=(tokens // tm, dim // td), in_specs=[stream, slab, res_spec, post_spec],
        out_specs=stream, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        cost_estimate=kernel_costs(n, tokens, dim, x.dtype.itemsize, y.dtype.itemsize).forward,
        **_params(interpret, "parallel"))(x, y, res, post)


def mix_backward_kernel(x, y, res, post, g, blocks, interpret, defer):
    """(dx, dy, dres, dpost) by the backward kernel on tiles ``blocks``, or (g, dy, dres, dpost) with ``defer``
    (dres, dpost float32)."""
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


__all__ = ["COLUMN_BLOCKS", "TOKEN_BLOCKS", "KernelCosts", "kernel_costs", "mix_backward_kernel", "mix_blocks",
           "mix_forward_kernel", "mix_kernel"]
