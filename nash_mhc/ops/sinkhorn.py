"""Log-domain Sinkhorn projection onto (approximately) doubly-stochastic matrices."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from beartype import beartype
from jaxtyping import Array, Float, jaxtyped


@jaxtyped(typechecker=beartype)
def sinkhorn(logits: Float[Array, "*batch n n"], num_iters: int = 20) -> Float[Array, "*batch n n"]:
    """``exp`` of ``logits`` alternately column- then row-normalised ``num_iters`` times, in log space.

    Computed in float32 whatever the input dtype. Rows are normalised last, so row sums are 1 to float32
    precision; column sums converge as ``num_iters`` grows (fast for logits of small spread). Every iterate
    is a log-sum-exp shift, so values and gradients stay finite for logits of any magnitude. The iterations
    run in a ``lax.scan`` under ``jax.checkpoint``: only the input is saved for the backward pass, which
    re-runs the iterations (cheap on n×n matrices) and differentiates through them.
    """
    if num_iters < 1:
        raise ValueError(f"sinkhorn needs num_iters >= 1, got {num_iters}")
    z = logits.astype(jnp.float32)

    def normalise(z: jax.Array, _: None) -> tuple[jax.Array, None]:
        z = z - jax.nn.logsumexp(z, axis=-2, keepdims=True)  # columns sum to 1
        z = z - jax.nn.logsumexp(z, axis=-1, keepdims=True)  # rows sum to 1
        return z, None

    # the backward pass re-runs the iterations instead of saving all of them
    @functools.partial(jax.checkpoint, prevent_cse=False)
    def project(z: jax.Array) -> jax.Array:
        z, _ = jax.lax.scan(normalise, z, None, length=num_iters)
        return jnp.exp(z)

    return project(z)
