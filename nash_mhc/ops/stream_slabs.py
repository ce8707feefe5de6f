"""mHC's stream sums in XLA on the n [T, D] slabs: the CPU's (and GPU's) form of what the stream kernels compute
(the collapse's, :mod:`nash_mhc.ops.stream_collapse`; the update's, :mod:`nash_mhc.ops.stream_mix`; the streams'
sum, :mod:`nash_mhc.ops.stream_copies`), and the kernels' form where no tile fits."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from nash_mhc.ops.stream_tiles import F32, res_transpose


def stream_stats(slabs: list[jax.Array], w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(raw = sum_j X_j W_j [T, C], ss = sum_j sum_d X_j² [T]) of the n float32 slabs X_j [T, D], in XLA: what the
    collapse kernel computes first, and the CPU's (and GPU's) form of it. The caller makes the slab list once and
    shares it with :func:`weighted_sum`, so the backward pass adds each stream's gradients slab by slab."""
    return sum(s @ w[j] for j, s in enumerate(slabs)), sum(jnp.sum(s * s, axis=-1) for s in slabs)


def weighted_sum(slabs: list[jax.Array], h: jax.Array) -> jax.Array:
    """u = sum_j h[:, j] X_j, float32 [T, D], of the n float32 slabs X_j [T, D] and h [T, n]."""
    return sum(h[:, j, None] * s for j, s in enumerate(slabs))


def slab_sum(x: jax.Array) -> jax.Array:
    """x [n, ...] → sum_i x[i] in float32, added in order i = 0, 1, ..., n - 1."""
    return functools.reduce(jnp.add, (x[i].astype(F32) for i in range(1, x.shape[0])), x[0].astype(F32))


def mix_slabs(x, y, res, post):
    """The update X' = H_res X + H_post (x) y over the n [T, D] slabs in XLA (the CPU's and GPU's form of the stream
    update kernel's sums): x [n, T, D], y [T, D], res [T, n·n], post [T, n] → [n, T, D] in x's dtype."""
    n = x.shape[0]
    xs, y = [a.astype(F32) for a in x], y.astype(F32)
    out = [sum(res[:, i * n + j, None] * xs[j] for j in range(n)) + post[:, i, None] * y for i in range(n)]
    return jnp.stack(out).astype(x.dtype)


def mix_backward_slabs(x, y, res, post, g, defer=False):
    """(dx, dy, dres, dpost) of :func:`mix_slabs` from X''s cotangent g, the update kernel's backward sums in XLA:
    dx stacked once (autodiff of the slab form instead pads every stream's gradient to [n, T, D] and adds the n
    pads); g itself in dx's place for the deferred rule (``defer``)."""
    n = x.shape[0]
    xs, gs, y32 = [a.astype(F32) for a in x], [a.astype(F32) for a in g], y.astype(F32)
    dx = g if defer else jnp.stack([res_transpose(res, gs, j) for j in range(n)]).astype(x.dtype)
    dy = sum(post[:, i, None] * gs[i] for i in range(n)).astype(y.dtype)
    dres = jnp.stack([jnp.sum(gs[i] * xs[j], axis=-1) for i in range(n) for j in range(n)], axis=-1)
    dpost = jnp.stack([jnp.sum(gs[i] * y32, axis=-1) for i in range(n)], axis=-1)
    return dx, dy, dres, dpost


__all__ = ["mix_backward_slabs", "mix_slabs", "slab_sum", "stream_stats", "weighted_sum"]
