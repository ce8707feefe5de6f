"""Aggregation of the per-scale attention outputs at each position: nash, gate or convex."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from beartype import beartype
from jaxtyping import Array, Bool, Float, jaxtyped

from nash_mhc.config import SCALE0_PRIOR_WEIGHT
from nash_mhc.ops.aggregation import platform_nash_aggregate
from nash_mhc.ops.game import combine, gate_weights, normalised_entropy, prior_weights
from nash_mhc.params import param


class Aggregated(NamedTuple):
    """What one aggregation returns (leading axes: batch, then T positions).

    output: [..., T, D] sum_l w_l O_l (the first output's [B, T, H, K] where it is one).  weights: [..., T, L] (0 on
    unavailable scales).
    entropy: [..., T] normalised entropy of the weights (0 where fewer than 2 scales are available).
    residual: [..., T] max_l |w - BR(w)| of the Nash equilibrium (0 for the convex aggregation).
    """

    output: Float[Array, "..."]
    weights: Float[Array, "*batch seq scales"]
    entropy: Float[Array, "*batch seq"]
    residual: Float[Array, "*batch seq"]


def initial_prior(num_scales: int, weight: float = SCALE0_PRIOR_WEIGHT) -> jax.Array:
    """Prior logits b = (beta, 0, ..., 0) with softmax(b)_0 = ``weight`` where every scale is available (the
    coarse scales share the rest equally; ``ModelConfig.scale_prior``). The default, 0.99: the multiscale model
    starts as full attention (scale 0 alone) up to 1 % of each position's output, as mhc starts as the plain
    residual; ``weight`` 1 / num_scales gives b = 0 exactly (uniform over the available scales)."""
    if not 0.0 < weight < 1.0:
        raise ValueError(f"the prior weight of scale 0 must be in (0, 1), got {weight!r}")
    beta = 0.0 if math.isclose(weight * num_scales, 1.0) else math.log(weight * (num_scales - 1) / (1.0 - weight))
    return jnp.zeros((num_scales,), jnp.float32).at[0].set(beta)


class ScaleAggregation(eqx.Module):
    """Combine outputs O_l of the available scales at each position (:mod:`nash_mhc.ops.aggregation`).

    ``nash``: the scales' quantal-response equilibrium with learned prior logits b and temperature tau =
    exp(log_temperature) (init ``temperature``), solved to tolerance in at most ``num_iters`` Newton steps.
    ``gate``: softmax(b + W o(O)), input-dependent per position, W [L, L, D] zero-initialised (so it starts at the
    prior): the baseline for ``nash`` that learns from the same outputs without a game. ``convex``: softmax(b)
    alone, masked to the available scales (a constant per layer). b starts at :func:`initial_prior` (scale 0
    weighs ``scale0_weight`` where every scale is available). All rematerialise in the backward pass (only the
    outputs are kept). The outputs come as L separate [..., T, D] arrays, never stacked
    (:mod:`nash_mhc.ops.aggregation`); the first may be a multi-head output [B, T, H, K]: ``nash`` reads it as it
    is (its TPU kernels, head-major) and returns ``output`` in that shape, ``gate`` and ``convex`` reshape it to
    rows [B, T, D].
    """

    prior: Float[Array, "scales"] = param("coefficient", "scales", group="aggregation_prior")
    log_temperature: Float[Array, ""] | None = param("coefficient", group="nash_temperature")
    gate: Float[Array, "scales scales dim"] | None = param("coefficient", "scales", "scales", "embed",
                                                           group="aggregation_gate")
    mode: str = eqx.field(static=True)
    num_iters: int = eqx.field(static=True)

    def __init__(self, num_scales: int, mode: str, *, num_iters: int, temperature: float, dim: int,
                 scale0_weight: float = SCALE0_PRIOR_WEIGHT):
        self.prior = initial_prior(num_scales, scale0_weight)
        self.log_temperature = jnp.asarray(math.log(temperature), jnp.float32) if mode == "nash" else None
        self.gate = jnp.zeros((num_scales, num_scales, dim), jnp.float32) if mode == "gate" else None
        self.mode = mode
        self.num_iters = num_iters

    @property
    def temperature(self) -> Float[Array, "*layers"] | None:
        """The learned tau (per layer for a stacked module; None unless the aggregation is ``nash``)."""
        return None if self.log_temperature is None else jnp.exp(self.log_temperature)

    @jaxtyped(typechecker=beartype)
    def __call__(self, outputs: Sequence[Float[Array, "..."]], available: Bool[Array, "seq scales"]
                 ) -> Aggregated:
        if outputs[0].ndim == 4 and self.log_temperature is None:  # only the Nash kernels read [B, T, H, K]
            outputs = [outputs[0].reshape(outputs[-1].shape), *outputs[1:]]
        available = jnp.broadcast_to(available, (*outputs[-1].shape[:-1], len(outputs)))

        @functools.partial(jax.checkpoint, prevent_cse=False)
        def aggregate(outputs: list[jax.Array], params: tuple[jax.Array, jax.Array | None, jax.Array | None]
                      ) -> Aggregated:
            prior, log_temperature, gate = params
            if log_temperature is not None:  # TPU: the passes over the outputs in kernels.tpu.aggregation_kernels
                output, weights, residual = platform_nash_aggregate(outputs, available, prior,
                                                                    jnp.exp(log_temperature), num_iters=self.num_iters)
            else:
                weights = (gate_weights(outputs, available, prior, gate) if gate is not None
                           else prior_weights(prior, available))
                output, residual = combine(outputs, weights), jnp.zeros(outputs[0].shape[:-1], jnp.float32)
            return Aggregated(output, weights, normalised_entropy(weights, available), residual.astype(weights.dtype))

        return aggregate(list(outputs), (self.prior, self.log_temperature, self.gate))
