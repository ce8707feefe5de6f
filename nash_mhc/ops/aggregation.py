"""Per-position aggregation of multiscale attention outputs (Nash best response or convex)."""

from __future__ import annotations

import jax.numpy as jnp
from beartype import beartype
from jaxtyping import Array, Bool, Float, jaxtyped

ERROR_EPS = 1e-6  # inside the sqrt of the utility error: keeps d sqrt / dx finite at x = 0


@jaxtyped(typechecker=beartype)
def masked_softmax(logits: Float[Array, "*batch scales"], available: Bool[Array, "*batch scales"]
                   ) -> Float[Array, "*batch scales"]:
    """Softmax over the available entries; unavailable entries get exactly 0 (rows with none: all 0)."""
    logits = jnp.where(available, logits.astype(jnp.float32), -jnp.inf)
    peak = jnp.max(logits, axis=-1, keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    unnorm = jnp.where(available, jnp.exp(logits - peak), 0.0)
    total = jnp.sum(unnorm, axis=-1, keepdims=True)
    return unnorm / jnp.where(total > 0, total, 1.0)


@jaxtyped(typechecker=beartype)
def nash_weights(
    outputs: Float[Array, "seq scales dim"],
    available: Bool[Array, "seq scales"],
    prior: Float[Array, "scales"],
    *,
    num_iters: int,
    temperature: float,
) -> Float[Array, "seq scales"]:
    """Best-response weights of the scale "players" at every position independently.

    Start from ``w = softmax(prior)`` over the available scales, then ``num_iters`` times: consensus
    ``O* = Σ_l w_l O_l``, utility error ``e_l = sqrt(mean_d (O_l - O*)² + ε)`` (smooth: no sqrt(0)
    gradient), ``w = softmax(prior - e / temperature)``. Weights are per position (never pooled over the
    sequence, which would leak the future) and gradients flow through them into the outputs.
    ``num_iters = 0`` gives the convex (prior-only) aggregation.
    """
    o = outputs.astype(jnp.float32)
    logits = jnp.broadcast_to(prior.astype(jnp.float32), available.shape)
    w = masked_softmax(logits, available)
    for _ in range(num_iters):
        consensus = jnp.einsum("ts,tsd->td", w, o)
        sq_err = jnp.mean(jnp.square(o - consensus[:, None, :]), axis=-1)
        err = jnp.sqrt(sq_err + ERROR_EPS)
        w = masked_softmax(logits - err / temperature, available)
    return w


@jaxtyped(typechecker=beartype)
def combine(outputs: Float[Array, "seq scales dim"], weights: Float[Array, "seq scales"]
            ) -> Float[Array, "seq dim"]:
    """Σ_l w_l O_l in float32, returned in the outputs' dtype."""
    out = jnp.einsum("ts,tsd->td", weights, outputs.astype(jnp.float32))
    return out.astype(outputs.dtype)


@jaxtyped(typechecker=beartype)
def normalised_entropy(weights: Float[Array, "seq scales"], available: Bool[Array, "seq scales"]
                       ) -> Float[Array, ""]:
    """Mean over positions with ≥ 2 available scales of H(w) / log(#available), in [0, 1].

    The sparsity aux loss: 0 when each position picks one scale, 1 when weights are uniform. Positions
    with a single available scale have no choice and are excluded (0 if there are none).
    """
    count = jnp.sum(available, axis=-1)
    safe_w = jnp.where(weights > 0, weights, 1.0)
    entropy = -jnp.sum(jnp.where(weights > 0, weights * jnp.log(safe_w), 0.0), axis=-1)
    choice = count >= 2
    norm = jnp.log(jnp.where(choice, count, 2).astype(jnp.float32))
    per_pos = jnp.where(choice, entropy / norm, 0.0)
    num = jnp.sum(choice)
    return jnp.sum(per_pos) / jnp.maximum(num, 1).astype(jnp.float32)


__all__ = ["masked_softmax", "nash_weights", "combine", "normalised_entropy"]
