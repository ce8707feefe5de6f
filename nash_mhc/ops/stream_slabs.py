"""The stream collapse's sums in XLA on float32 slabs: the CPU's (and GPU's) form of what the collapse kernel
computes (:mod:`nash_mhc.ops.stream_collapse`), and the kernels' form where no tile fits."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def stream_stats(slabs: list[jax.Array], w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(raw = sum_j X_j W_j [T, C], ss = sum_j sum_d X_j² [T]) of the n float32 slabs X_j [T, D], in XLA: what the
    collapse kernel computes first, and the CPU's (and GPU's) form of it. The caller makes the slab list once and
    shares it with :func:`weighted_sum`, so the backward pass adds each stream's gradients slab by slab."""
    return sum(s @ w[j] for j, s in enumerate(slabs)), sum(jnp.sum(s * s, axis=-1) for s in slabs)


def weighted_sum(slabs: list[jax.Array], h: jax.Array) -> jax.Array:
    """u = sum_j h[:, j] X_j, float32 [T, D], of the n float32 slabs X_j [T, D] and h [T, n]."""
    return sum(h[:, j, None] * s for j, s in enumerate(slabs))


__all__ = ["stream_stats", "weighted_sum"]
