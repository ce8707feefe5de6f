"""RMSNorm with a learned gain, computed in float32."""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
from beartype import beartype
from jaxtyping import Array, Float, jaxtyped

from nash_mhc.ops.rms_norm import norm_barrier, rms_norm
from nash_mhc.params import param


class RMSNorm(eqx.Module):
    """y = x / sqrt(mean(x²) + eps) * weight over the last axis; statistics in float32, output in x's dtype.

    On TPU y is written out once (:func:`nash_mhc.ops.rms_norm.norm_barrier`; CPU and GPU leave it to XLA, the same
    numbers): fused into the projections that read it, the TPU compiler transposed the float32 input to the layout
    of their matmuls and kept the residual add apart from the output projection that makes x; written once, the
    `1b` plain + full step on v6e-8 is faster (compiler estimates, docs/results/tpu_estimate/README.md). A
    hyper-connection given its sublayer's norm applies it
    (:meth:`nash_mhc.layers.hyperconnection.HyperConnection.streams_major`): mhc's collapse kernel on TPU computes
    the same function (:func:`nash_mhc.ops.rms_norm.rms_norm`) where it writes u."""

    weight: Float[Array, "dim"] = param("norm", "norm")
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, eps: float = 1e-6):
        self.weight = jnp.ones((dim,), jnp.float32)
        self.eps = eps

    @jaxtyped(typechecker=beartype)
    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        return norm_barrier(rms_norm(x, self.weight, self.eps))
