"""Aggregation of the per-scale attention outputs at each position."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from beartype import beartype
from jaxtyping import Array, Bool, Float, jaxtyped

from nash_mhc.ops.aggregation import combine, nash_weights, normalised_entropy, prior_weights


class Aggregated(NamedTuple):
    """What one aggregation returns (leading axes: batch, then T positions).

    output: [..., T, D] sum_l w_l O_l.  weights: [..., T, L] (0 on unavailable scales).
    entropy: [..., T] normalised entropy of the weights (0 where fewer than 2 scales are available).
    residual: [..., T] max_l |w - BR(w)| of the Nash equilibrium (0 for the convex aggregation).
    """

    output: Float[Array, "*batch seq dim"]
    weights: Float[Array, "*batch seq scales"]
    entropy: Float[Array, "*batch seq"]
    residual: Float[Array, "*batch seq"]


class ScaleAggregation(eqx.Module):
    """Combine outputs O_l of the available scales at each position.

    ``nash``: the scales' quantal-response equilibrium (:func:`nash_mhc.ops.nash_weights`) with learned prior
    logits b (init 0: uniform) and a learned temperature tau = exp(log_temperature) (init
    ``temperature``), solved by ``num_iters`` best-response steps. ``convex``: softmax(b) alone, masked to
    the available scales. Both rematerialise in the backward pass (only the stacked outputs are kept).
    """

    prior: Float[Array, "scales"]
    log_temperature: Float[Array, ""] | None
    mode: str = eqx.field(static=True)
    num_iters: int = eqx.field(static=True)

    def __init__(self, num_scales: int, mode: str, *, num_iters: int, temperature: float):
        self.prior = jnp.zeros((num_scales,), jnp.float32)
        self.log_temperature = jnp.asarray(math.log(temperature), jnp.float32) if mode == "nash" else None
        self.mode = mode
        self.num_iters = num_iters

    @property
    def temperature(self) -> Float[Array, "*layers"] | None:
        """The learned tau (per layer for a stacked module; None for the convex aggregation)."""
        return None if self.log_temperature is None else jnp.exp(self.log_temperature)

    @jaxtyped(typechecker=beartype)
    def __call__(self, outputs: Float[Array, "*batch seq scales dim"], available: Bool[Array, "seq scales"]
                 ) -> Aggregated:
        available = jnp.broadcast_to(available, outputs.shape[:-1])

        @functools.partial(jax.checkpoint, prevent_cse=False)
        def aggregate(outputs: jax.Array, params: tuple[jax.Array, jax.Array | None]) -> Aggregated:
            prior, log_temperature = params
            if log_temperature is None:
                weights = prior_weights(prior, available)
                residual = jnp.zeros(weights.shape[:-1], weights.dtype)
            else:
                weights, residual = nash_weights(outputs, available, prior, jnp.exp(log_temperature),
                                                 num_iters=self.num_iters)
            return Aggregated(combine(outputs, weights), weights, normalised_entropy(weights, available), residual)

        return aggregate(outputs, (self.prior, self.log_temperature))
