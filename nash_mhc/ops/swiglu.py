"""SwiGLU's gate silu(gate) ⊙ up on the two [T, F] projections, with its TPU form's backward pass
(:class:`nash_mhc.layers.ffn.SwiGLU` calls :func:`gated_silu`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nash_mhc.ops.dispatch import platform_dependent


def gated_silu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) ⊙ up [T, F]. On TPU its backward pass writes d gate and d up once (:func:`gated_silu_tpu`), chosen
    for the step's platform (``dispatch.platform_dependent``, named ``gated_silu``); elsewhere JAX's autodiff."""
    return platform_dependent(gate, up, tpu=gated_silu_tpu, default=_gated_silu, name="gated_silu")


def _gated_silu(gate: jax.Array, up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate) * up


@jax.custom_vjp
def gated_silu_tpu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) ⊙ up whose backward pass computes d gate = g ⊙ up ⊙ σ(gate)(1 + gate(1 − σ(gate))) and
    d up = g ⊙ silu(gate) in float32, rounds each once to its operand's dtype and writes both out
    (``optimization_barrier``). Left to autodiff, TPU XLA fused that elementwise work into each of the matmul
    fusions consuming it (the FFN's input gradient and both weight gradients) and redid it per tile; written out,
    the `1b` plain + full step on v6e-8 is faster (compiler estimates, docs/results/tpu_estimate/README.md)."""
    return _gated_silu(gate, up)


def _gated_silu_fwd(gate: jax.Array, up: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return _gated_silu(gate, up), (gate, up)


def _gated_silu_bwd(residuals: tuple[jax.Array, jax.Array], g: jax.Array) -> tuple[jax.Array, jax.Array]:
    gate, up = residuals
    gate32, up32, g32 = (a.astype(jnp.float32) for a in (gate, up, g))
    sigmoid = jax.nn.sigmoid(gate32)
    d_gate = g32 * up32 * sigmoid * (1.0 + gate32 * (1.0 - sigmoid))
    d_up = g32 * gate32 * sigmoid
    return jax.lax.optimization_barrier((d_gate.astype(gate.dtype), d_up.astype(up.dtype)))


gated_silu_tpu.defvjp(_gated_silu_fwd, _gated_silu_bwd)


__all__ = ["gated_silu", "gated_silu_tpu"]
