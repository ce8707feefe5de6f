"""Causal strided downsampling and shifted upsampling between fine and coarse positions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from beartype import beartype
from jaxtyping import Array, Bool, Float, jaxtyped


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
    x = x.reshape(*batch, blocks, block, dim)
    return jnp.einsum("...bod,od->...bd", x, weights.astype(x.dtype))


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
    repeated = jnp.repeat(y, block, axis=-2, total_repeat_length=blocks * block)
    shifted = jnp.concatenate([jnp.zeros((*batch, block - 1, dim), y.dtype), repeated[..., :keep, :]], axis=-2)
    return shifted, jnp.asarray(available_mask(seq_len, block))
