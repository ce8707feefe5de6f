"""Multiscale attention's block-wise downsampling as Pallas TPU kernels: x read once, no permutation.

For x [N, T, D] and the block's weights w [s, D], coarse token j of sequence n is

    y[n, j] = sum_o w[o] x[n, j s + o]                                                      kernel "forward"

and for the cotangent g [N, T / s, D] of y

    dx[n, j s + o] = w[o] g[n, j]            dw[o] = sum_{n, j} g[n, j] x[n, j s + o]       kernel "backward"

The kernels work on x [N, G, T, C] with weights [G, s, C] (D = G C): :func:`downsample_kernel` passes [N, 1, T, D];
:func:`downsample_heads_kernel` passes the values [B, T, H, K] as [B, H, T, K], the head-major layout the value
projection already has for flash attention, so no copy makes them row-major (in the `1b` step that copy was about
a third of what the row-major kernels saved).

Each kernel walks tiles of ``rows`` positions x 128 columns; a tile's s offsets are read with sublane-strided loads
(every s-th row from row o) from a float32 copy of the tile in VMEM (Mosaic strides only 32-bit data), and the
backward kernel writes dx the same way. Products and sums in float32, rounded once, like the XLA form of
:func:`nash_mhc.ops.multiscale.downsample`. In XLA, the TPU compiler reduced over the offsets across the (8, 128)
tile's sublanes or, in the chunked form, permuted the positions with a one-hot matmul at about 2.5 x its bandwidth
time (docs/tpu.md). The backward kernel writes dw as float32 partial sums per (sequence, row tile), which XLA adds.

Each ``pallas_call`` declares its cost (:func:`kernel_costs`); the kernels run on each device's sequences
(:func:`nash_mhc.sharding.per_shard`: batch over data x fsdp, positions and columns whole). They run on TPU only
(:func:`nash_mhc.ops.multiscale.downsample` dispatches with :func:`nash_mhc.ops.dispatch.platform_vjp`, forward and
backward); ``interpret=True`` runs them in Pallas' interpreter (CPU tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from nash_mhc.ops.tpu_tiles import LANES
from nash_mhc.sharding import per_shard

F32 = jnp.float32
ROW_TILES = (2048, 1024, 512, 256)  # positions per tile, largest first
TILE_ROWS = 16  # rows of a bfloat16 (16, 128) tile: a tile's coarse rows come in multiples of it
SEQUENCES, WEIGHTS = ("batch", "heads", "seq", "head_dim"), ("heads", "block", "head_dim")  # for per_shard
PARTIALS = ("batch", "seq", "heads", "block", "head_dim")


def row_tile(seq: int, dim: int, block: int) -> int | None:
    """The positions per tile for x [.., seq, dim] and blocks of ``block``: the largest of :data:`ROW_TILES` that
    divides ``seq`` and holds a multiple of :data:`TILE_ROWS` coarse tokens, or None where no tile fits (``dim``
    not a multiple of 128, or too short a sequence): the caller keeps its XLA form."""
    if block < 1 or dim % LANES:
        return None
    return next((rows for rows in ROW_TILES if seq % rows == 0 and rows % (TILE_ROWS * block) == 0), None)


def kernel_costs(sequences: int, seq: int, dim: int, block: int, rows: int, x_bytes: int, w_bytes: int,
                 g_bytes: int) -> tuple[pl.CostEstimate, pl.CostEstimate]:
    """(forward, backward) FLOPs and HBM bytes of one call on x [sequences, seq, dim] of itemsize ``x_bytes``.

    forward: a multiply and an add per element of x; reads x and w (w's column tile stays resident while the
    grid walks the sequences and row tiles under it), writes y [.., seq / block, dim]. backward: per element of
    x a multiply-add (dw) and a multiply (dx); reads x, w and g (itemsize ``g_bytes``), writes dx in x's dtype and
    the float32 partial sums of dw [sequences, seq / rows, block, dim]."""
    elems = sequences * seq * dim
    x, w, coarse = elems * x_bytes, block * dim * w_bytes, elems // block
    forward = pl.CostEstimate(flops=2 * elems, transcendentals=0, bytes_accessed=x + w + coarse * x_bytes)
    partials = sequences * (seq // rows) * block * dim * 4
    backward = pl.CostEstimate(flops=3 * elems, transcendentals=0,
                               bytes_accessed=2 * x + w + coarse * g_bytes + partials)
    return forward, backward


# -------------------------------------------------------------------------------------------- kernels
def _forward_kernel(x_ref, w_ref, y_ref, wide_ref):
    block, coarse = w_ref.shape[0], y_ref.shape[0]
    wide_ref[...] = x_ref[...].astype(F32)
    w = w_ref[...].astype(F32)
    total = wide_ref[pl.ds(0, coarse, stride=block), :] * w[0:1, :]
    for o in range(1, block):
        total = total + wide_ref[pl.ds(o, coarse, stride=block), :] * w[o:o + 1, :]
    y_ref[...] = total.astype(y_ref.dtype)


def _backward_kernel(x_ref, w_ref, g_ref, dx_ref, dw_ref, wide_ref):
    block, coarse = w_ref.shape[0], g_ref.shape[0]
    wide_ref[...] = x_ref[...].astype(F32)
    w, g = w_ref[...].astype(F32), g_ref[...].astype(F32)
    for o in range(block):
        at = pl.ds(o, coarse, stride=block)
        dw_ref[o:o + 1, :] = jnp.sum(wide_ref[at, :] * g, axis=0, keepdims=True)
        wide_ref[at, :] = g * w[o:o + 1, :]  # offset o's rows are read above before they are overwritten
    dx_ref[...] = wide_ref[...].astype(dx_ref.dtype)


def _grid_specs(x: jax.Array, w: jax.Array, rows: int):
    """Grid (groups, column tiles, sequences, row tiles) for x [N, G, T, C] and w [G, s, C]: each tile of w is
    fetched once, as the sequences and row tiles under it run."""
    sequences, groups, seq, columns = x.shape
    block = w.shape[1]
    grid = (groups, columns // LANES, sequences, seq // rows)
    fine = pl.BlockSpec((None, None, rows, LANES), lambda group, c, n, t: (n, group, t, c))
    coarse = pl.BlockSpec((None, None, rows // block, LANES), lambda group, c, n, t: (n, group, t, c))
    weights = pl.BlockSpec((None, block, LANES), lambda group, c, n, t: (group, 0, c))
    return grid, fine, coarse, weights


def _params() -> pltpu.CompilerParams:
    return pltpu.CompilerParams(dimension_semantics=("parallel",) * 4)


def _costs(x, w, g_bytes, rows):
    sequences, groups, seq, columns = x.shape
    return kernel_costs(sequences, seq, groups * columns, w.shape[1], rows, x.dtype.itemsize, w.dtype.itemsize,
                        g_bytes)


def _forward_shard(x, w, *, rows, interpret):
    sequences, groups, seq, columns = x.shape
    grid, fine, coarse, weights = _grid_specs(x, w, rows)
    return pl.pallas_call(
        _forward_kernel, grid=grid, in_specs=[fine, weights], out_specs=coarse,
        out_shape=jax.ShapeDtypeStruct((sequences, groups, seq // w.shape[1], columns), x.dtype),
        scratch_shapes=[pltpu.VMEM((rows, LANES), F32)], cost_estimate=_costs(x, w, x.dtype.itemsize, rows)[0],
        interpret=interpret, compiler_params=_params())(x, w)


def _backward_shard(x, w, g, *, rows, interpret):
    sequences, groups, seq, columns = x.shape
    block = w.shape[1]
    grid, fine, coarse, weights = _grid_specs(x, w, rows)
    partial = pl.BlockSpec((None, None, None, block, LANES), lambda group, c, n, t: (n, t, group, 0, c))
    return pl.pallas_call(
        _backward_kernel, grid=grid, in_specs=[fine, weights, coarse], out_specs=[fine, partial],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype),
                   jax.ShapeDtypeStruct((sequences, seq // rows, groups, block, columns), F32)],
        scratch_shapes=[pltpu.VMEM((rows, LANES), F32)], cost_estimate=_costs(x, w, g.dtype.itemsize, rows)[1],
        interpret=interpret, compiler_params=_params())(x, w, g)


# ---------------------------------------------------------------------------------------------- public
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _downsample(x: jax.Array, w: jax.Array, rows: int, interpret: bool) -> jax.Array:
    run = functools.partial(_forward_shard, rows=rows, interpret=interpret)
    return per_shard(run, (SEQUENCES, WEIGHTS), SEQUENCES)(x, w)


def _downsample_forward(x, w, rows, interpret):
    return _downsample(x, w, rows, interpret), (x, w)


def _downsample_backward(rows, interpret, residuals, g):
    x, w = residuals
    run = functools.partial(_backward_shard, rows=rows, interpret=interpret)
    dx, partials = per_shard(run, (SEQUENCES, WEIGHTS, SEQUENCES), (SEQUENCES, PARTIALS))(x, w, g)
    return dx, jnp.sum(partials, axis=(0, 1)).astype(w.dtype)  # [G, s, C]


_downsample.defvjp(_downsample_forward, _downsample_backward)


def _checked_rows(seq: int, columns: int, block: int, rows: int | None) -> int:
    rows = row_tile(seq, columns, block) if rows is None else rows
    if rows is None or seq % rows or rows % (TILE_ROWS * block) or columns % LANES:
        raise ValueError(f"downsampling kernels need a row tile that divides seq = {seq} into whole groups of "
                         f"{TILE_ROWS} blocks of {block} and columns = {columns} a multiple of {LANES}, got "
                         f"rows = {rows}")
    return rows


def downsample_kernel(x: jax.Array, weights: jax.Array, *, rows: int | None = None, interpret: bool = False
                      ) -> jax.Array:
    """y [*batch, seq / s, D] (module docstring) of x [*batch, seq, D] and weights [s, D], in x's dtype, by the
    kernels, differentiable in both. ``rows``: positions per tile, default :func:`row_tile`; ValueError where
    no tile fits (the caller's XLA form applies there)."""
    *batch, seq, dim = x.shape
    block = weights.shape[0]
    rows = _checked_rows(seq, dim, block, rows)
    y = _downsample(x.reshape(-1, 1, seq, dim), weights.reshape(1, block, dim), rows, interpret)
    return y.reshape(*batch, seq // block, dim)


def downsample_heads_kernel(v: jax.Array, weights: jax.Array, *, rows: int | None = None, interpret: bool = False
                            ) -> jax.Array:
    """:func:`downsample_kernel` of v [*batch, seq, H, K] as [*batch, seq, H K], returned as [*batch, seq / s, H, K]:
    the kernels read v head-major ([N, H, seq, K]), each head's columns with its own columns of weights [s, H K].
    K must be a multiple of 128."""
    *batch, seq, heads, head_dim = v.shape
    block = weights.shape[0]
    rows = _checked_rows(seq, head_dim, block, rows)
    head_major = jnp.swapaxes(v.reshape(-1, seq, heads, head_dim), 1, 2)
    w = jnp.swapaxes(weights.reshape(block, heads, head_dim), 0, 1)
    y = _downsample(head_major, w, rows, interpret)
    return jnp.swapaxes(y, 1, 2).reshape(*batch, seq // block, heads, head_dim)


__all__ = ["LANES", "ROW_TILES", "TILE_ROWS", "downsample_heads_kernel", "downsample_kernel", "kernel_costs",
           "row_tile"]
