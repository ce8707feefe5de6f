"""RMSNorm as pure functions: the one definition that :class:`nash_mhc.layers.norm.RMSNorm` computes, and that
mHC's collapse kernel (:mod:`kernels.tpu.stream_collapse_kernels`) applies to u where it writes u, with the backward
pass that the collapse's custom VJP runs from the saved statistic.

For x [..., D] and weight [D], in float32: inv = 1 / sqrt(mean(x²) + eps) [..., 1], x̂ = x · inv, y = x̂ · weight
(in x's dtype). Backward, from dy: dweight = Σ_tokens dy · x̂, dx = inv · (dy · weight − x̂ · mean(dy · weight ·
x̂)) (in x's dtype). :func:`norm_barrier` writes a norm's output once on TPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nash_mhc.ops.dispatch import platform_dependent

F32 = jnp.float32


def rms_inverse(x: jax.Array, eps: float) -> jax.Array:
    """inv = 1 / sqrt(mean(x²) + eps) over the last axis, float32 [..., 1]."""
    xf = x.astype(F32)
    return jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, inv: jax.Array | None = None) -> jax.Array:
    """y = x · inv · weight in x's dtype (inv: :func:`rms_inverse`, computed here unless given)."""
    inv = rms_inverse(x, eps) if inv is None else inv
    return (x.astype(F32) * inv * weight).astype(x.dtype)


def rms_norm_backward(x: jax.Array, weight: jax.Array, inv: jax.Array, dy: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(dx in x's dtype, dweight float32 [D]) of :func:`rms_norm` at x with the forward pass's ``inv``."""
    dx, dweight = rms_norm_backward_rows(x.reshape(-1, x.shape[-1]), weight, inv.reshape(-1, 1),
                                         dy.reshape(-1, x.shape[-1]))
    return dx.reshape(x.shape), dweight[0]


def rms_norm_backward_rows(x: jax.Array, weight: jax.Array, inv: jax.Array, dy: jax.Array
                           ) -> tuple[jax.Array, jax.Array]:
    """:func:`rms_norm_backward` of rows x [T, D] (inv [T, 1]): dweight summed over them, float32 [1, D] (the
    form a TPU kernel computes on a tile of whole rows, ``nash_mhc.kernels.tpu.stream_collapse_kernels``)."""
    xhat = x.astype(F32) * inv
    dyw = dy.astype(F32) * weight
    dx = inv * (dyw - xhat * jnp.mean(dyw * xhat, axis=-1, keepdims=True))
    return dx.astype(x.dtype), jnp.sum(dy.astype(F32) * xhat, axis=0, keepdims=True)


def norm_barrier(y: jax.Array) -> jax.Array:
    """y itself, written out once on TPU (``lax.optimization_barrier``; CPU and GPU leave it to XLA, the same
    numbers), chosen for the step's platform (``dispatch.platform_dependent``, named ``norm_barrier``): what
    :class:`nash_mhc.layers.norm.RMSNorm` does with its output (why: its docstring)."""
    return platform_dependent(y, tpu=jax.lax.optimization_barrier, default=lambda y: y, name="norm_barrier")
