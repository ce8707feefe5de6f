"""RMSNorm with a learned gain, computed in float32."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from beartype import beartype
from jaxtyping import Array, Float, jaxtyped

from nash_mhc.params import param


class RMSNorm(eqx.Module):
    """y = x / sqrt(mean(x²) + eps) * weight over the last axis; statistics in float32, output in x's dtype."""

    weight: Float[Array, "dim"] = param("norm", "norm")
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, eps: float = 1e-6):
        self.weight = jnp.ones((dim,), jnp.float32)
        self.eps = eps

    @jaxtyped(typechecker=beartype)
    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        xf = x.astype(jnp.float32)
        inv = jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + self.eps)
        return (xf * inv * self.weight).astype(x.dtype)
