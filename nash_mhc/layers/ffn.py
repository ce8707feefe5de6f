"""SwiGLU feed-forward network."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from beartype import beartype
from jaxtyping import Array, Float, jaxtyped

from nash_mhc.layers.init import EMBED_STD, normal, output_std


class SwiGLU(eqx.Module):
    """down(silu(x W_gate) ⊙ (x W_up)); matmuls in the compute dtype, f32 parameters."""

    w_gate: Float[Array, "dim hidden"]
    w_up: Float[Array, "dim hidden"]
    w_down: Float[Array, "hidden dim"]
    dtype: str = eqx.field(static=True)

    def __init__(self, dim: int, hidden: int, *, num_layers: int, dtype: str, key: jax.Array):
        k1, k2, k3 = jax.random.split(key, 3)
        self.w_gate = normal(k1, (dim, hidden), EMBED_STD)
        self.w_up = normal(k2, (dim, hidden), EMBED_STD)
        self.w_down = normal(k3, (hidden, dim), output_std(num_layers))
        self.dtype = dtype

    @jaxtyped(typechecker=beartype)
    def __call__(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq dim"]:
        dt = jnp.dtype(self.dtype)
        x = x.astype(dt)
        gate = x @ self.w_gate.astype(dt)
        up = x @ self.w_up.astype(dt)
        return (jax.nn.silu(gate) * up) @ self.w_down.astype(dt)
