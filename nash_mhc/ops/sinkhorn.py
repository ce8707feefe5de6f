"""Log-domain Sinkhorn projection onto (approximately) doubly-stochastic matrices."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from beartype import beartype
from jaxtyping import Array, Float, jaxtyped

from nash_mhc.ops.sinkhorn_kernel import sinkhorn_tokens, token_block
from nash_mhc.sharding import per_shard


@jaxtyped(typechecker=beartype)
def sinkhorn(logits: Float[Array, "*batch n n"], num_iters: int = 20) -> Float[Array, "*batch n n"]:
    """``exp`` of ``logits`` alternately column- then row-normalised ``num_iters`` times, in log space.

    Computed in float32 whatever the input dtype. Rows are normalised last, so row sums are 1 to float32
    precision; column sums converge as ``num_iters`` grows (fast for logits of small spread). Every iterate
    is a log-sum-exp shift, so values and gradients stay finite for logits of any magnitude. The iterations
    run in a ``lax.scan`` under ``jax.checkpoint``: only the input is saved for the backward pass, which
    re-runs the iterations (cheap on n×n matrices) and differentiates through them.

    Lowered for TPU, one [T, n, n] batch of matrices whose T a token tile divides runs as the Pallas kernels of
    :func:`nash_mhc.ops.sinkhorn_kernel.sinkhorn_tokens` on each device's token shard (same function, same
    saved input; finite logits); elsewhere (CPU, GPU) the XLA scan.
    """
    if num_iters < 1:
        raise ValueError(f"sinkhorn needs num_iters >= 1, got {num_iters}")
    xla = functools.partial(_sinkhorn_xla, num_iters=num_iters)
    if logits.ndim != 3 or token_block(logits.shape[0]) is None:
        return xla(logits)
    names = ("tokens", "streams", "streams")
    kernel = per_shard(functools.partial(_sinkhorn_shard, num_iters=num_iters), (names,), names)
    return jax.lax.platform_dependent(logits, tpu=kernel, default=xla)


def _sinkhorn_shard(logits: jax.Array, num_iters: int) -> jax.Array:
    """One device's tokens: the kernels, or the XLA scan where no token tile divides the shard."""
    if token_block(logits.shape[0]) is None:
        return _sinkhorn_xla(logits, num_iters)
    return sinkhorn_tokens(logits, num_iters)


def _sinkhorn_xla(logits: jax.Array, num_iters: int) -> jax.Array:
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
