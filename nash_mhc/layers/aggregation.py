"""Aggregation of the per-scale attention outputs at each position."""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
from beartype import beartype
from jaxtyping import Array, Bool, Float, jaxtyped

from nash_mhc.ops.aggregation import combine, nash_weights, normalised_entropy


class ScaleAggregation(eqx.Module):
    """Combine outputs O_l of the available scales at each position.

    ``nash``: best-response iterations starting from, and biased by, learned per-scale prior logits
    (:func:`nash_mhc.ops.nash_weights`); ``convex``: softmax of the learned logits alone, masked to the
    available scales. The aux loss is the mean normalised entropy of the weights (sparsity term).
    """

    prior: Float[Array, "scales"]
    mode: str = eqx.field(static=True)
    num_iters: int = eqx.field(static=True)
    temperature: float = eqx.field(static=True)

    def __init__(self, num_scales: int, mode: str, *, num_iters: int, temperature: float):
        self.prior = jnp.zeros((num_scales,), jnp.float32)
        self.mode = mode
        self.num_iters = num_iters
        self.temperature = temperature

    @jaxtyped(typechecker=beartype)
    def __call__(self, outputs: Float[Array, "seq scales dim"], available: Bool[Array, "seq scales"]
                 ) -> tuple[Float[Array, "seq dim"], Float[Array, "seq scales"], Float[Array, ""]]:
        """Returns (combined output, weights (0 on unavailable scales), normalised entropy).

        Rematerialised: the backward pass keeps the stacked outputs and re-runs the best-response
        iterations instead of saving their [T, L, D] intermediates.
        """
        iters = self.num_iters if self.mode == "nash" else 0

        @functools.partial(jax.checkpoint, prevent_cse=False)
        def aggregate(outputs: jax.Array, prior: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
            weights = nash_weights(outputs, available, prior, num_iters=iters, temperature=self.temperature)
            return combine(outputs, weights), weights, normalised_entropy(weights, available)

        return aggregate(outputs, self.prior)
