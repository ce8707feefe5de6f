"""Multiscale attention's block-wise downsampling as Pallas TPU kernels: x read once, no permutation.

For x [N, T, D] and the block's weights w [s, D], coarse token j of sequence n is

    y[n, j] = sum_o w[o] x[n, j s + o]                                                      kernel "forward"

and for the cotangent g [N, T / s, D] of y

    dx[n, j s + o] = w[o] g[n, j]            dw[o] = sum_{n, j} g[n, j] x[n, j s + o]       kernel "backward"

One call serves several levels at once (weights w_l [s_l, D], l = 1..L, one y_l each): the forward kernel reads
x once for all of them, the backward kernel reads x once and writes dx = sum_l dx_l once (float32 sums in the
levels' order, rounded once), where one call per level read x L times, wrote L fine-length dx and left XLA to add
them (:func:`downsample_levels_kernel`; the `1b` Nash-MHC step on v6e-8 has two coarse levels, docs/tpu.md).

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
backward; :func:`nash_mhc.ops.multiscale.downsample_levels` where the step is lowered for TPU); ``interpret=True``
runs them in Pallas' interpreter (CPU tests).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from nash_mhc.kernels.tpu.tpu_tiles import LANES
from nash_mhc.ops.dispatch import pallas_call
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


def kernel_costs(sequences: int, seq: int, dim: int, blocks: Sequence[int], rows: int, x_bytes: int,
                 w_bytes: int, g_bytes: int) -> tuple[pl.CostEstimate, pl.CostEstimate]:
    """(forward, backward) FLOPs and HBM bytes of one call on x [sequences, seq, dim] of itemsize ``x_bytes`` for
    the levels of block sizes ``blocks``.

    forward: a multiply and an add per element of x and level; reads x once and each level's w (w's column tile
    stays resident while the grid walks the sequences and row tiles under it), writes each y_l [.., seq / s_l,
    dim]. backward: per element of x and level a multiply-add (dw) and a multiply (dx), and an add per element
    for each level after the first (dx's sum); reads x, each w and g_l (itemsize ``g_bytes``), writes dx in x's
    dtype once and the float32 partial sums of each dw [sequences, seq / rows, s_l, dim]."""
    elems, levels = sequences * seq * dim, len(blocks)
    x, w = elems * x_bytes, sum(blocks) * dim * w_bytes
    coarse = sum(elems // block for block in blocks)
    forward = pl.CostEstimate(flops=2 * elems * levels, transcendentals=0, bytes_accessed=x + w + coarse * x_bytes)
    partials = sequences * (seq // rows) * sum(blocks) * dim * 4
    backward = pl.CostEstimate(flops=3 * elems * levels + elems * (levels - 1), transcendentals=0,
                               bytes_accessed=2 * x + w + coarse * g_bytes + partials)
    return forward, backward


# -------------------------------------------------------------------------------------------- kernels
def _forward_kernel(x_ref, *refs, levels):
    w_refs, y_refs, wide_ref = refs[:levels], refs[levels:2 * levels], refs[-1]
    wide_ref[...] = x_ref[...].astype(F32)
    for w_ref, y_ref in zip(w_refs, y_refs, strict=True):
        block, coarse = w_ref.shape[0], y_ref.shape[0]
        w = w_ref[...].astype(F32)
        total = wide_ref[pl.ds(0, coarse, stride=block), :] * w[0:1, :]
        for o in range(1, block):
            total = total + wide_ref[pl.ds(o, coarse, stride=block), :] * w[o:o + 1, :]
        y_ref[...] = total.astype(y_ref.dtype)


def _backward_kernel(x_ref, *refs, levels):
    w_refs, g_refs = refs[:levels], refs[levels:2 * levels]
    dx_ref, dw_refs, wide_ref = refs[2 * levels], refs[2 * levels + 1:3 * levels + 1], refs[-1]
    wide_ref[...] = x_ref[...].astype(F32)
    ws = [w_ref[...].astype(F32) for w_ref in w_refs]
    gs = [g_ref[...].astype(F32) for g_ref in g_refs]
    for w, g, dw_ref in zip(ws, gs, dw_refs, strict=True):  # every dw from x, before the scratch holds dx
        block, coarse = w.shape[0], g.shape[0]
        for o in range(block):
            dw_ref[o:o + 1, :] = jnp.sum(wide_ref[pl.ds(o, coarse, stride=block), :] * g, axis=0, keepdims=True)
    for level, (w, g) in enumerate(zip(ws, gs, strict=True)):  # dx = sum_l dx_l; the first level's offsets cover
        block, coarse = w.shape[0], g.shape[0]                  # every row
        for o in range(block):
            at = pl.ds(o, coarse, stride=block)
            part = g * w[o:o + 1, :]
            wide_ref[at, :] = part if level == 0 else wide_ref[at, :] + part
    dx_ref[...] = wide_ref[...].astype(dx_ref.dtype)


def _grid_specs(x: jax.Array, ws: Sequence[jax.Array], rows: int):
    """Grid (groups, column tiles, sequences, row tiles) for x [N, G, T, C] and each w [G, s, C], with the specs of
    x, of each level's coarse array and of each w: each tile of w is fetched once, as the sequences and row tiles
    under it run."""
    sequences, groups, seq, columns = x.shape
    grid = (groups, columns // LANES, sequences, seq // rows)
    fine = pl.BlockSpec((None, None, rows, LANES), lambda group, c, n, t: (n, group, t, c))
    coarse = [pl.BlockSpec((None, None, rows // w.shape[1], LANES), lambda group, c, n, t: (n, group, t, c))
              for w in ws]
    weights = [pl.BlockSpec((None, w.shape[1], LANES), lambda group, c, n, t: (group, 0, c)) for w in ws]
    return grid, fine, coarse, weights


def _params() -> pltpu.CompilerParams:
    return pltpu.CompilerParams(dimension_semantics=("parallel",) * 4)


def _costs(x, ws, g_bytes, rows):
    sequences, groups, seq, columns = x.shape
    return kernel_costs(sequences, seq, groups * columns, [w.shape[1] for w in ws], rows, x.dtype.itemsize,
                        ws[0].dtype.itemsize, g_bytes)


def _forward_shard(x, *ws, rows, interpret):
    sequences, groups, seq, columns = x.shape
    grid, fine, coarse, weights = _grid_specs(x, ws, rows)
    ys = pallas_call(
        functools.partial(_forward_kernel, levels=len(ws)), grid=grid, in_specs=[fine, *weights], out_specs=coarse,
        out_shape=[jax.ShapeDtypeStruct((sequences, groups, seq // w.shape[1], columns), x.dtype) for w in ws],
        scratch_shapes=[pltpu.VMEM((rows, LANES), F32)], cost_estimate=_costs(x, ws, x.dtype.itemsize, rows)[0],
        interpret=interpret, compiler_params=_params())(x, *ws)
    return tuple(ys)


def _backward_shard(x, *operands, rows, interpret):
    sequences, groups, seq, columns = x.shape
    levels = len(operands) // 2
    ws, gs = operands[:levels], operands[levels:]
    grid, fine, coarse, weights = _grid_specs(x, ws, rows)
    partials = [pl.BlockSpec((None, None, None, w.shape[1], LANES), lambda group, c, n, t: (n, t, group, 0, c))
                for w in ws]
    dx, *dws = pallas_call(
        functools.partial(_backward_kernel, levels=levels), grid=grid, in_specs=[fine, *weights, *coarse],
        out_specs=[fine, *partials],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype),
                   *(jax.ShapeDtypeStruct((sequences, seq // rows, groups, w.shape[1], columns), F32) for w in ws)],
        scratch_shapes=[pltpu.VMEM((rows, LANES), F32)], cost_estimate=_costs(x, ws, gs[0].dtype.itemsize, rows)[1],
        interpret=interpret, compiler_params=_params())(x, *ws, *gs)
    return (dx, *dws)


# ---------------------------------------------------------------------------------------------- public
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _downsample(x: jax.Array, ws: tuple[jax.Array, ...], rows: int, interpret: bool) -> tuple[jax.Array, ...]:
    run = functools.partial(_forward_shard, rows=rows, interpret=interpret)
    return per_shard(run, (SEQUENCES, *(WEIGHTS,) * len(ws)), (SEQUENCES,) * len(ws))(x, *ws)


def _downsample_forward(x, ws, rows, interpret):
    return _downsample(x, ws, rows, interpret), (x, ws)


def _downsample_backward(rows, interpret, residuals, gs):
    x, ws = residuals
    run = functools.partial(_backward_shard, rows=rows, interpret=interpret)
    levels = len(ws)
    dx, *partials = per_shard(run, (SEQUENCES, *(WEIGHTS,) * levels, *(SEQUENCES,) * levels),
                              (SEQUENCES, *(PARTIALS,) * levels))(x, *ws, *gs)
    return dx, tuple(jnp.sum(p, axis=(0, 1)).astype(w.dtype) for p, w in zip(partials, ws, strict=True))  # [G, s, C]


_downsample.defvjp(_downsample_forward, _downsample_backward)


def _checked_rows(seq: int, columns: int, blocks: Sequence[int], rows: int | None) -> int:
    rows = row_tile(seq, columns, math.lcm(*blocks)) if rows is None else rows
    if rows is None or seq % rows or any(rows % (TILE_ROWS * block) for block in blocks) or columns % LANES:
        raise ValueError(f"downsampling kernels need a row tile that divides seq = {seq} into whole groups of "
                         f"{TILE_ROWS} blocks of each of {tuple(blocks)} and columns = {columns} a multiple of "
                         f"{LANES}, got rows = {rows}")
    return rows


def downsample_levels_kernel(x: jax.Array, weights: Sequence[jax.Array], *, rows: int | None = None,
                             interpret: bool = False) -> tuple[jax.Array, ...]:
    """(y_l [*batch, seq / s_l, D] for each level's weights [s_l, D]) of x [*batch, seq, D] (module docstring), in
    x's dtype, by one call of the kernels, differentiable in x and every weight. ``rows``: positions per tile,
    default :func:`row_tile` for the blocks' least common multiple; ValueError where no tile fits (the caller's
    XLA form applies there)."""
    *batch, seq, dim = x.shape
    blocks = [w.shape[0] for w in weights]
    rows = _checked_rows(seq, dim, blocks, rows)
    ys = _downsample(x.reshape(-1, 1, seq, dim), tuple(w.reshape(1, w.shape[0], dim) for w in weights), rows,
                     interpret)
    return tuple(y.reshape(*batch, seq // block, dim) for y, block in zip(ys, blocks, strict=True))


def downsample_kernel(x: jax.Array, weights: jax.Array, *, rows: int | None = None, interpret: bool = False
                      ) -> jax.Array:
    """:func:`downsample_levels_kernel` of one level: y [*batch, seq / s, D] of x [*batch, seq, D] and weights
    [s, D]."""
    return downsample_levels_kernel(x, (weights,), rows=rows, interpret=interpret)[0]


def downsample_heads_levels_kernel(v: jax.Array, weights: Sequence[jax.Array], *, rows: int | None = None,
                                   interpret: bool = False) -> tuple[jax.Array, ...]:
    """:func:`downsample_levels_kernel` of v [*batch, seq, H, K] as [*batch, seq, H K], each y_l returned as
    [*batch, seq / s_l, H, K]: the kernels read v head-major ([N, H, seq, K]), each head's columns with its own
    columns of weights [s_l, H K]. K must be a multiple of 128."""
    *batch, seq, heads, head_dim = v.shape
    blocks = [w.shape[0] for w in weights]
    rows = _checked_rows(seq, head_dim, blocks, rows)
    head_major = jnp.swapaxes(v.reshape(-1, seq, heads, head_dim), 1, 2)
    ws = tuple(jnp.swapaxes(w.reshape(w.shape[0], heads, head_dim), 0, 1) for w in weights)
    ys = _downsample(head_major, ws, rows, interpret)
    return tuple(jnp.swapaxes(y, 1, 2).reshape(*batch, seq // block, heads, head_dim)
                 for y, block in zip(ys, blocks, strict=True))


def downsample_heads_kernel(v: jax.Array, weights: jax.Array, *, rows: int | None = None, interpret: bool = False
                            ) -> jax.Array:
    """:func:`downsample_heads_levels_kernel` of one level: [*batch, seq, H, K] → [*batch, seq / s, H, K]."""
    return downsample_heads_levels_kernel(v, (weights,), rows=rows, interpret=interpret)[0]


__all__ = ["LANES", "ROW_TILES", "TILE_ROWS", "downsample_heads_kernel", "downsample_heads_levels_kernel",
           "downsample_kernel", "downsample_levels_kernel", "kernel_costs", "row_tile"]
