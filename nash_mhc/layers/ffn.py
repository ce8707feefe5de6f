"""SwiGLU feed-forward network."""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
from beartype import beartype
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, jaxtyped

from nash_mhc.layers.init import EMBED_STD, normal, output_std
from nash_mhc.ops.swiglu import gated_silu
from nash_mhc.params import param
from nash_mhc.sharding import constrain_batch


class SwiGLU(eqx.Module):
    """down(silu(x W_gate) ⊙ (x W_up)); matmuls in the compute dtype, f32 parameters."""

    w_gate: Float[Array, "dim hidden"] = param("matmul", "embed", "mlp")
    w_up: Float[Array, "dim hidden"] = param("matmul", "embed", "mlp")
    w_down: Float[Array, "hidden dim"] = param("matmul", "mlp", "embed")
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
        return _swiglu(x.astype(dt), self.w_gate.astype(dt), self.w_up.astype(dt), self.w_down.astype(dt))


@functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.save_only_these_names("gate", "up"),
                   prevent_cse=False)
def _swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """The backward pass keeps x and the two [T, F] projections; silu and the product are recomputed.
    The projections and the output stay split over the batch axes (:func:`constrain_batch`)."""
    gate = checkpoint_name(constrain_batch(x @ w_gate), "gate")
    up = checkpoint_name(constrain_batch(x @ w_up), "up")
    return constrain_batch(gated_silu(gate, up) @ w_down)
