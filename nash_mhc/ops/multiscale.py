"""Causal strided downsampling and shifted upsampling between fine and coarse positions."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from beartype import beartype
from jaxtyping import Array, Bool, Float, jaxtyped

from nash_mhc.kernels.tpu.downsample_kernel import (
    downsample_heads_kernel,
    downsample_heads_levels_kernel,
    downsample_kernel,
    downsample_levels_kernel,
    row_tile,
)
from nash_mhc.kernels.tpu.upsample_kernel import upsample_kernel, upsample_row_tile
from nash_mhc.ops.dispatch import platform_dependent, platform_vjp, tpu_kernels

CHUNK = 128  # positions per chunk of the matmul forms (TPU): a multiple of every block size they serve


def num_blocks(seq_len: int, block: int) -> int:
    """Coarse tokens at block size ``block`` (a trailing partial block counts, it is never read)."""
    return -(-seq_len // block)


@jaxtyped(typechecker=beartype)
def downsample(x: Float[Array, "*batch seq dim"], weights: Float[Array, "block dim"]
               ) -> Float[Array, "*batch blocks dim"]:
    """Coarse token j = Σ_o weights[o] ⊙ x[j·s + o]: a depthwise strided conv with kernel = stride = s.

    It sees nothing outside its own block. A trailing partial block is zero-padded; its coarse token is
    never read by :func:`upsample_shifted`, so padding cannot leak into any output. Leading axes are batch.
    """
    *batch, seq, dim = x.shape
    block = weights.shape[0]
    blocks = num_blocks(seq, block)
    pad = blocks * block - seq
    if pad:
        x = jnp.concatenate([x, jnp.zeros((*batch, pad, dim), x.dtype)], axis=-2)
    weights = weights.astype(x.dtype)
    if row_tile(blocks * block, dim, block) is not None and block > 1:
        tpu = downsample_kernel  # strided loads of each block's positions (kernels.tpu.downsample_kernel)
    elif _chunked(blocks * block, block):
        tpu = _downsample_chunked
    else:
        return _downsample_xla(x, weights)
    return platform_vjp(tpu, _downsample_xla, name="downsample")(x, weights)


def _downsample_xla(x: jax.Array, weights: jax.Array) -> jax.Array:
    """:func:`downsample` of whole blocks in XLA: a reduction over the block's offsets, products and sum in float32
    (float64 for float64 x). The einsum "...bod,od->...bd" is a matmul batched over D: XLA CPU transposed x to
    D-major for it and for each of its gradients, 4-7 x the time of this form's forward + backward
    (docs/results/cpu_throughput/README.md)."""
    *batch, seq, dim = x.shape
    block = weights.shape[0]
    wide = jnp.promote_types(x.dtype, jnp.float32)
    blocked = x.reshape(*batch, seq // block, block, dim).astype(wide)
    return jnp.sum(blocked * weights.astype(wide), axis=-2).astype(x.dtype)


@jaxtyped(typechecker=beartype)
def downsample_heads(v: Float[Array, "*batch seq heads head_dim"], weights: Float[Array, "block features"]
                     ) -> Float[Array, "*batch blocks heads head_dim"]:
    """:func:`downsample` of the values v [*batch, seq, H, K] as [*batch, seq, H K], weights [s, H K].

    On TPU, where the head dim is a multiple of 128 and a tile fits, the kernels read v head-major
    (:func:`kernels.tpu.downsample_kernel.downsample_heads_kernel`), the layout the value projection has for flash
    attention; elsewhere it is :func:`downsample` of the reshaped values, the same numbers."""
    *batch, seq, heads, head_dim = v.shape
    block = weights.shape[0]

    if block == 1 or row_tile(seq, head_dim, block) is None:
        return downsample(v.reshape(*batch, seq, heads * head_dim), weights).reshape(*batch, -1, heads, head_dim)

    def xla(v: jax.Array, weights: jax.Array) -> jax.Array:
        return _downsample_xla(v.reshape(*batch, seq, heads * head_dim), weights).reshape(*batch, -1, heads, head_dim)
    return platform_vjp(downsample_heads_kernel, xla, name="downsample_heads")(v, weights.astype(v.dtype))


def _levels_tile(seq: int, dim: int, blocks: Sequence[int]) -> bool:
    """Whether one call of the levels' kernels serves ``blocks``: the step is lowered for TPU
    (:func:`nash_mhc.ops.dispatch.tpu_kernels`), more than one level, every block > 1 and a row tile that
    holds whole groups of every level's blocks."""
    return (len(blocks) > 1 and min(blocks) > 1 and tpu_kernels()
            and row_tile(seq, dim, math.lcm(*blocks)) is not None)


def downsample_levels(x: jax.Array, weights: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    """:func:`downsample` of x [*batch, seq, D] by each level's weights [s_l, D]: (y_l [*batch, seq / s_l, D], ...).

    Lowered for TPU where one row tile fits every level, a single call of the kernels
    (:func:`kernels.tpu.downsample_kernel.downsample_levels_kernel`): x read once forward and backward, dx written
    once; there its dx is the levels' float32 sum rounded once, where separate calls round each level's dx to x's
    dtype before XLA adds them. Elsewhere (CPU, GPU, the platform not settled at tracing) one :func:`downsample`
    per level, the same program as before."""
    *_, seq, dim = x.shape
    if _levels_tile(seq, dim, [w.shape[0] for w in weights]):
        return downsample_levels_kernel(x, tuple(w.astype(x.dtype) for w in weights))
    return tuple(downsample(x, w) for w in weights)


def downsample_heads_levels(v: jax.Array, weights: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    """:func:`downsample_heads` of v [*batch, seq, H, K] by each level's weights [s_l, H K], as
    :func:`downsample_levels` does it: one call of the head-major kernels lowered for TPU where a tile fits
    (:func:`nash_mhc.kernels.tpu.downsample_kernel.downsample_heads_levels_kernel`), else one call per level."""
    *_, seq, _, head_dim = v.shape
    if _levels_tile(seq, head_dim, [w.shape[0] for w in weights]):
        return downsample_heads_levels_kernel(v, tuple(w.astype(v.dtype) for w in weights))
    return tuple(downsample_heads(v, w) for w in weights)


def _chunked(seq: int, block: int) -> bool:
    """Whether the matmul forms apply: ``seq`` whole chunks of :data:`CHUNK` positions, each whole blocks."""
    return block > 1 and CHUNK % block == 0 and seq % CHUNK == 0


def _downsample_chunked(x: jax.Array, weights: jax.Array) -> jax.Array:
    """:func:`downsample` for TPUs: within each chunk of :data:`CHUNK` positions a permutation (a one-hot matmul,
    exact) groups the positions by their offset o in the block, so the weighted sum over o adds whole slabs.

    Summing over o in place reduces across the (8, 128) tile's sublanes, which the TPU compiler costs at ~12x the
    array's bandwidth time (docs/tpu.md). Products and sum in float32, like the XLA form's. The permutation is
    broadcast over the batch and chunks, so the matmul is batched over them and keeps D minor in both passes (an
    unbatched one came out with the positions minor and was copied back: docs/tpu.md).
    """
    *batch, seq, dim = x.shape
    block = weights.shape[0]
    per_chunk = CHUNK // block
    order = np.arange(CHUNK).reshape(per_chunk, block).T.reshape(-1)  # row o·(C/s) + j reads position j·s + o
    permutation = jnp.broadcast_to(jnp.asarray(np.eye(CHUNK)[order], x.dtype), (*batch, seq // CHUNK, CHUNK, CHUNK))
    grouped = jnp.einsum("...cpt,...ctd->...cpd", permutation, x.reshape(*batch, seq // CHUNK, CHUNK, dim),
                         precision=jax.lax.Precision.HIGHEST)
    grouped = grouped.reshape(*batch, seq // CHUNK, block, per_chunk, dim)
    total = sum(grouped[..., o, :, :].astype(jnp.float32) * weights[o].astype(jnp.float32) for o in range(block))
    return total.astype(x.dtype).reshape(*batch, seq // block, dim)


def available_mask(seq_len: int, block: int) -> np.ndarray:
    """bool[seq]: fine position i has a complete block at this scale, i.e. i + 1 >= block."""
    return np.arange(seq_len) + 1 >= block


def choice_mask(seq_len: int, block_sizes: tuple[int, ...]) -> np.ndarray:
    """bool[seq]: position i has at least two scales to aggregate (scale 0 and a complete block of scale 1).

    The positions that count in the aggregation's sparsity term; all False with a single scale.
    """
    if len(block_sizes) < 2:
        return np.zeros((seq_len,), bool)
    return available_mask(seq_len, block_sizes[1])


@jaxtyped(typechecker=beartype)
def renormalise(x: Float[Array, "*batch dim"], eps: float) -> Float[Array, "*batch dim"]:
    """x / sqrt(mean(x²) + eps) per token (statistics in float32, result in x's dtype), no learned gain.

    Applied to pooled coarse tokens: a block mean of s weakly correlated unit-RMS tokens has RMS ~ 1/sqrt(s),
    which would shrink coarse attention logits by ~1/s; renormalising gives them the fine scale's RMS.
    """
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps)).astype(x.dtype)


@jaxtyped(typechecker=beartype)
def upsample_shifted(y: Float[Array, "*batch blocks dim"], seq_len: int, block: int
                     ) -> tuple[Float[Array, "*batch seq dim"], Bool[Array, "seq"]]:
    """Fine position i reads coarse output ⌊(i+1)/s⌋ − 1, the last block complete at i.

    Implemented as a block repeat shifted right by s − 1 positions; the first s − 1 positions have no
    complete block, get zeros and ``available = False``. Leading axes are batch.
    """
    *batch, blocks, dim = y.shape
    if block == 1:
        return y[..., :seq_len, :], jnp.ones((seq_len,), bool)
    keep = seq_len - (block - 1)
    if keep <= 0:
        return jnp.zeros((*batch, seq_len, dim), y.dtype), jnp.zeros((seq_len,), bool)
    available = jnp.asarray(available_mask(seq_len, block))

    def xla(y: jax.Array) -> jax.Array:
        # a broadcast, not jnp.repeat: repeat's gather had a scatter-add as its gradient (XLA CPU)
        repeated = jnp.broadcast_to(y[..., None, :], (*batch, blocks, block, dim)).reshape(*batch, blocks * block, dim)
        return jnp.concatenate([jnp.zeros((*batch, block - 1, dim), y.dtype), repeated[..., :keep, :]], axis=-2)

    if blocks * block == seq_len and upsample_row_tile(seq_len, dim, block) is not None:
        tpu = functools.partial(upsample_kernel, block=block)  # strided stores of the outputs (the kernel)
    elif _chunked(seq_len, block) and blocks == seq_len // block:
        tpu = functools.partial(_upsample_chunked, block=block)
    else:
        return xla(y), available
    return platform_dependent(y, tpu=tpu, default=xla, name="upsample"), available


def _upsample_chunked(y: jax.Array, block: int) -> jax.Array:
    """:func:`upsample_shifted` for TPUs: each chunk of :data:`CHUNK` fine positions is a one-hot matmul (exact) of
    its own C/s coarse outputs and the previous chunk's last one, so the shift by s - 1 positions never moves a
    fine-length array across the (8, 128) tile's sublanes. Batched over the batch and chunks, like
    :func:`_downsample_chunked`'s, so its output and its gradient keep D minor."""
    *batch, blocks, dim = y.shape
    per_chunk, chunks = CHUNK // block, blocks * block // CHUNK
    own = y.reshape(*batch, chunks, per_chunk, dim)
    previous = jnp.concatenate([jnp.zeros((*batch, 1, 1, dim), y.dtype), own[..., :-1, -1:, :]], axis=-3)
    source = jnp.concatenate([previous, own], axis=-2)  # [..., chunks, 1 + C/s, D]: entry k is coarse block k - 1
    reads = (np.arange(CHUNK) + 1) // block  # fine position i of a chunk reads entry ⌊(i+1)/s⌋
    selection = jnp.broadcast_to(jnp.asarray(np.eye(per_chunk + 1)[reads], y.dtype),
                                 (*batch, chunks, CHUNK, per_chunk + 1))
    up = jnp.einsum("...cik,...ckd->...cid", selection, source, precision=jax.lax.Precision.HIGHEST)
    return up.reshape(*batch, chunks * CHUNK, dim)
