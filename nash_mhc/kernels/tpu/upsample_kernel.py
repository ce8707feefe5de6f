"""Multiscale attention's shifted upsampling as Pallas TPU kernels: each coarse output written s times, no matmul.

For the coarse outputs y [N, T / s, D] (one per complete block of s positions), fine position i reads the last
block complete at i:

    up[n, i] = y[n, (i + 1) // s - 1]   (i >= s - 1),   0 for the first s - 1 positions      kernel "forward"

and for the cotangent g [N, T, D] of up, coarse output k gathers the s positions that read it:

    dy[n, k] = g[n, k s + s - 1] + sum_{o < s - 1} g[n, (k + 1) s + o]                        kernel "backward"

Each kernel walks tiles of ``rows`` fine positions x 128 columns. In a tile starting at t0, position t0 + m s + o
reads coarse row m of the tile for o = s - 1 and row m - 1 for o < s - 1 (row -1: the previous tile's last coarse
output, read as the last row of the previous 16 coarse rows; zero in the first tile), written with sublane-strided
stores into a float32 VMEM copy of the tile (Mosaic strides only 32-bit data and a 128-wide last dimension). The
backward kernel reads the strided rows the same way; its last coarse row also needs the next tile's first s - 1
positions, read as the next tile's first 16 rows (none after the last tile). Sums in float32, rounded once.

In XLA the TPU form was a one-hot matmul per chunk of 128 positions (:func:`nash_mhc.ops.multiscale.upsample_shifted`,
still used where no tile fits). Each ``pallas_call`` declares its cost (:func:`kernel_costs`); the kernels run on each
device's sequences (:func:`nash_mhc.sharding.per_shard`); ``interpret=True`` runs them in Pallas' interpreter.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from nash_mhc.kernels.tpu.downsample_kernel import LANES, TILE_ROWS, row_tile
from nash_mhc.ops.dispatch import pallas_call
from nash_mhc.sharding import per_shard

F32 = jnp.float32
EDGE = TILE_ROWS  # rows of the neighbouring tile read for the shift
SEQUENCES = ("batch", "seq", "features")  # for per_shard


def upsample_row_tile(seq: int, dim: int, block: int) -> int | None:
    """The fine positions per tile for up [.., seq, dim] (:func:`kernels.tpu.downsample_kernel.row_tile`), or None
    where the kernels do not apply: a block of 1 or of more than :data:`EDGE` + 1 (the backward kernel reads the
    next block's s - 1 positions from :data:`EDGE` rows), or no tile fits."""
    return row_tile(seq, dim, block) if 2 <= block <= EDGE + 1 else None


def kernel_costs(sequences: int, seq: int, dim: int, block: int, rows: int, y_bytes: int, g_bytes: int
                 ) -> tuple[pl.CostEstimate, pl.CostEstimate]:
    """(forward, backward) FLOPs and HBM bytes of one call for y [sequences, seq / block, dim] of itemsize
    ``y_bytes`` and up [sequences, seq, dim].

    forward: no arithmetic; reads y and, per tile, the previous :data:`EDGE` coarse rows, writes up in y's dtype.
    backward: s - 1 adds per coarse output (the sum of its s positions); reads g (itemsize ``g_bytes``) and, per
    tile, the next tile's first :data:`EDGE` rows, writes dy in g's dtype."""
    fine, coarse, tiles = sequences * seq * dim, sequences * seq // block * dim, sequences * (seq // rows)
    edge = tiles * EDGE * dim
    forward = pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=(coarse + edge + fine) * y_bytes)
    backward = pl.CostEstimate(flops=(block - 1) * coarse, transcendentals=0,
                               bytes_accessed=(fine + edge + coarse) * g_bytes)
    return forward, backward


# -------------------------------------------------------------------------------------------- kernels
def _forward_kernel(y_ref, before_ref, up_ref, wide_ref, *, block):
    coarse = y_ref.shape[0]
    y = y_ref[...].astype(F32)
    previous = jnp.where(pl.program_id(2) > 0, before_ref[EDGE - 1:EDGE, :].astype(F32), 0.0)  # [1, 128]
    row = lax.broadcasted_iota(jnp.int32, y.shape, 0)
    shifted = jnp.where(row == 0, previous, pltpu.roll(y, shift=1, axis=0))  # row m: coarse row m - 1
    for o in range(block - 1):
        wide_ref[pl.ds(o, coarse, stride=block), :] = shifted
    wide_ref[pl.ds(block - 1, coarse, stride=block), :] = y
    up_ref[...] = wide_ref[...].astype(up_ref.dtype)


def _backward_kernel(g_ref, after_ref, dy_ref, wide_ref, *, block):
    coarse = dy_ref.shape[0]
    wide_ref[...] = g_ref[...].astype(F32)
    own = wide_ref[pl.ds(block - 1, coarse, stride=block), :]  # position m s + s - 1 reads row m
    early = wide_ref[pl.ds(0, coarse, stride=block), :]  # positions m s + o, o < s - 1, read row m - 1
    for o in range(1, block - 1):
        early = early + wide_ref[pl.ds(o, coarse, stride=block), :]
    after = after_ref[...].astype(F32)
    first = jnp.sum(after[:block - 1, :], axis=0, keepdims=True)  # the next tile's m = 0 block reads our last row
    first = jnp.where(pl.program_id(2) < pl.num_programs(2) - 1, first, 0.0)
    row = lax.broadcasted_iota(jnp.int32, own.shape, 0)
    following = jnp.where(row == coarse - 1, first, pltpu.roll(early, shift=coarse - 1, axis=0))  # row m: early[m+1]
    dy_ref[...] = (own + following).astype(dy_ref.dtype)


def _specs(sequences: int, seq: int, dim: int, block: int, rows: int):
    """Grid (column tiles, sequences, row tiles) and the fine, coarse and neighbouring-edge block specs."""
    tiles, coarse_rows = seq // rows, rows // block
    grid = (dim // LANES, sequences, tiles)
    fine = pl.BlockSpec((None, rows, LANES), lambda c, n, t: (n, t, c))
    coarse = pl.BlockSpec((None, coarse_rows, LANES), lambda c, n, t: (n, t, c))
    # EDGE-row blocks: the coarse rows just before the tile's, the fine rows just after it; at the ends, where the
    # kernels ignore them, the sequence's last block (so no two steps in a row share a block: each is one fetch)
    before_last = seq // block // EDGE - 1
    before = pl.BlockSpec((None, EDGE, LANES),
                          lambda c, n, t: (n, jnp.where(t > 0, t * (coarse_rows // EDGE) - 1, before_last), c))
    last = seq // EDGE - 1
    after = pl.BlockSpec((None, EDGE, LANES), lambda c, n, t: (n, jnp.minimum((t + 1) * (rows // EDGE), last), c))
    return grid, fine, coarse, before, after


def _params() -> pltpu.CompilerParams:
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel"))


def _forward_shard(y, *, block, rows, interpret):
    sequences, blocks, dim = y.shape
    seq = blocks * block
    grid, fine, coarse, before, _ = _specs(sequences, seq, dim, block, rows)
    cost = kernel_costs(sequences, seq, dim, block, rows, y.dtype.itemsize, y.dtype.itemsize)[0]
    return pallas_call(
        functools.partial(_forward_kernel, block=block), grid=grid, in_specs=[coarse, before], out_specs=fine,
        out_shape=jax.ShapeDtypeStruct((sequences, seq, dim), y.dtype), scratch_shapes=[pltpu.VMEM((rows, LANES), F32)],
        cost_estimate=cost, interpret=interpret, compiler_params=_params())(y, y)


def _backward_shard(g, *, block, rows, interpret):
    sequences, seq, dim = g.shape
    grid, fine, coarse, _, after = _specs(sequences, seq, dim, block, rows)
    cost = kernel_costs(sequences, seq, dim, block, rows, g.dtype.itemsize, g.dtype.itemsize)[1]
    return pallas_call(
        functools.partial(_backward_kernel, block=block), grid=grid, in_specs=[fine, after], out_specs=coarse,
        out_shape=jax.ShapeDtypeStruct((sequences, seq // block, dim), g.dtype),
        scratch_shapes=[pltpu.VMEM((rows, LANES), F32)], cost_estimate=cost, interpret=interpret,
        compiler_params=_params())(g, g)


# ---------------------------------------------------------------------------------------------- public
@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _upsample(y: jax.Array, block: int, rows: int, interpret: bool) -> jax.Array:
    run = functools.partial(_forward_shard, block=block, rows=rows, interpret=interpret)
    return per_shard(run, (SEQUENCES,), SEQUENCES)(y)


def _upsample_forward(y, block, rows, interpret):
    return _upsample(y, block, rows, interpret), ()


def _upsample_backward(block, rows, interpret, residuals, g):
    del residuals  # linear: the pullback needs only g
    run = functools.partial(_backward_shard, block=block, rows=rows, interpret=interpret)
    return (per_shard(run, (SEQUENCES,), SEQUENCES)(g),)


_upsample.defvjp(_upsample_forward, _upsample_backward)


def upsample_kernel(y: jax.Array, block: int, *, rows: int | None = None, interpret: bool = False) -> jax.Array:
    """up [*batch, blocks · block, D] (module docstring) of y [*batch, blocks, D], in y's dtype, by the kernels,
    differentiable. ``rows``: fine positions per tile, default :func:`upsample_row_tile`; ValueError where none
    fits (the caller's XLA form applies there)."""
    *batch, blocks, dim = y.shape
    seq = blocks * block
    rows = upsample_row_tile(seq, dim, block) if rows is None else rows
    if not 2 <= block <= EDGE + 1 or rows is None or seq % rows or rows % (EDGE * block) or dim % LANES:
        raise ValueError(f"upsampling kernels need a block of 2 to {EDGE + 1} and a row tile that divides seq = {seq} "
                         f"into whole groups of {EDGE} blocks of {block}, dim = {dim} a multiple of {LANES}; got "
                         f"block = {block}, rows = {rows}")
    up = _upsample(y.reshape(-1, blocks, dim), block, rows, interpret)
    return up.reshape(*batch, seq, dim)


__all__ = ["EDGE", "kernel_costs", "upsample_kernel", "upsample_row_tile"]
