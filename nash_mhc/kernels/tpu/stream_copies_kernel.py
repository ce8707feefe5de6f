"""The Pallas TPU kernels of the residual streams' copies and sum at the ends of the layer stack
(:mod:`nash_mhc.ops.stream_copies` chooses between them and XLA's broadcast and slab additions).

    copies_kernel:  h [tokens, D] → X [n, tokens, D], X_i = h: each token tile of h read once and written n times
                    (declared cost: those bytes, no FLOPs)
    sum_kernel:     X [n, tokens, D] → sum_i X_i [tokens, D]: each token tile of the n slabs read once and their
                    float32 sum (:func:`nash_mhc.ops.stream_slabs.slab_sum`) written once, rounded to the result's
                    dtype (declared: those bytes, n - 1 additions per element)

Both walk (token tile, column tile) of :func:`nash_mhc.kernels.tpu.stream_mix_kernel.mix_blocks`; ``interpret=True``
runs them in Pallas' interpreter (CPU tests).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from nash_mhc.kernels.tpu.stream_mix_kernel import mix_blocks
from nash_mhc.kernels.tpu.tpu_tiles import LANES, SUBLANES
from nash_mhc.ops.dispatch import pallas_call
from nash_mhc.ops.stream_slabs import slab_sum


def copies_cost(tokens: int, dim: int, n: int, in_bytes: int, out_bytes: int) -> pl.CostEstimate:
    """The copy kernel's cost for h [tokens, dim] of itemsize ``in_bytes`` → X [n, tokens, dim] of ``out_bytes``:
    h read once and X written once, no arithmetic (a cast at most)."""
    return pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=tokens * dim * (in_bytes + n * out_bytes))


def sum_cost(tokens: int, dim: int, n: int, in_bytes: int, out_bytes: int) -> pl.CostEstimate:
    """The sum kernel's cost for X [n, tokens, dim] of itemsize ``in_bytes`` → [tokens, dim] of ``out_bytes``: X
    read once, the sum written once, n - 1 additions per element."""
    return pl.CostEstimate(flops=(n - 1) * tokens * dim, transcendentals=0,
                           bytes_accessed=tokens * dim * (n * in_bytes + out_bytes))


def _copies_kernel(h_ref, x_ref):
    tile = h_ref[...].astype(x_ref.dtype)
    for i in range(x_ref.shape[0]):
        x_ref[i] = tile


def _sum_kernel(x_ref, h_ref):
    h_ref[...] = slab_sum(x_ref[...]).astype(h_ref.dtype)


def _tiles(tokens: int, dim: int, blocks: tuple[int, int] | None, itemsize: int, what: str) -> tuple[int, int]:
    """(token tile, column tile): whole (8, 128) register tiles, 16 rows where a side is bfloat16 (two rows per
    sublane), or the whole D as the column tile."""
    blocks = mix_blocks(tokens, dim) if blocks is None else blocks
    rows = SUBLANES * 4 // itemsize
    if blocks is None or tokens % blocks[0] or blocks[0] % rows or dim % blocks[1] or \
            (blocks[1] % LANES and blocks[1] != dim):
        raise ValueError(f"{what} needs tiles that divide (tokens, dim) = ({tokens}, {dim}), a token tile that is "
                         f"a multiple of {rows} and a column tile that is a multiple of {LANES} or D, got {blocks}")
    return blocks


def _call(kernel, a: jax.Array, out_shape: jax.ShapeDtypeStruct, n: int, blocks: tuple[int, int],
          cost: pl.CostEstimate, interpret: bool) -> jax.Array:
    """One ``pallas_call`` over (token tiles, column tiles) of [tokens, D]; the [n, tokens, D] side (operand or
    result) keeps its n streams in one block."""
    tm, td = blocks

    def spec(ndim: int) -> pl.BlockSpec:
        return (pl.BlockSpec((tm, td), lambda t, c: (t, c)) if ndim == 2
                else pl.BlockSpec((n, tm, td), lambda t, c: (0, t, c)))
    return pallas_call(
        kernel, grid=(a.shape[-2] // tm, a.shape[-1] // td), in_specs=[spec(a.ndim)],
        out_specs=spec(len(out_shape.shape)), out_shape=out_shape, cost_estimate=cost, interpret=interpret,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")))(a)


def copies_kernel(h: jax.Array, n: int, dtype, *, blocks: tuple[int, int] | None = None,
                  interpret: bool = False) -> jax.Array:
    """h [tokens, D] → X [n, tokens, D] in ``dtype``, X_i = h, by one ``pallas_call``. ``blocks``: (token tile,
    column tile), default :func:`mix_blocks`; ValueError where they do not divide."""
    tokens, dim = h.shape
    blocks = _tiles(tokens, dim, blocks, min(h.dtype.itemsize, jnp.dtype(dtype).itemsize), "copies_kernel")
    cost = copies_cost(tokens, dim, n, h.dtype.itemsize, jnp.dtype(dtype).itemsize)
    return _call(_copies_kernel, h, jax.ShapeDtypeStruct((n, tokens, dim), dtype), n, blocks, cost, interpret)


def sum_kernel(x: jax.Array, dtype, *, blocks: tuple[int, int] | None = None, interpret: bool = False
               ) -> jax.Array:
    """X [n, tokens, D] → :func:`slab_sum` (float32) rounded to ``dtype``, [tokens, D], by one ``pallas_call``;
    ``blocks`` as :func:`copies_kernel`'s."""
    n, tokens, dim = x.shape
    blocks = _tiles(tokens, dim, blocks, min(x.dtype.itemsize, jnp.dtype(dtype).itemsize), "sum_kernel")
    cost = sum_cost(tokens, dim, n, x.dtype.itemsize, jnp.dtype(dtype).itemsize)
    return _call(_sum_kernel, x, jax.ShapeDtypeStruct((tokens, dim), dtype), n, blocks, cost, interpret)


__all__ = ["copies_cost", "copies_kernel", "sum_cost", "sum_kernel"]
