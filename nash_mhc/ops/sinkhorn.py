"""Log-domain Sinkhorn projection onto (approximately) doubly-stochastic matrices."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from beartype import beartype
from einops import rearrange
from jaxtyping import Array, Float, jaxtyped

from nash_mhc.kernels.tpu.sinkhorn_kernel import sinkhorn_tokens, token_block
from nash_mhc.ops.dispatch import platform_dependent
from nash_mhc.ops.sinkhorn_rounds import project, sinkhorn_round, walk_back_exp
from nash_mhc.sharding import per_shard


@jaxtyped(typechecker=beartype)
def sinkhorn(logits: Float[Array, "*batch n n"], num_iters: int = 20) -> Float[Array, "*batch n n"]:
    """``exp`` of ``logits`` alternately column- then row-normalised ``num_iters`` times, in log space.

    Computed in float32 whatever the input dtype. Rows are normalised last, so row sums are 1 to float32
    precision; column sums converge as ``num_iters`` grows (fast for logits of small spread). Every iterate
    is a log-sum-exp shift, so values and gradients stay finite for logits of any magnitude. The forward pass of
    a gradient keeps every round's exponentiated iterates and the backward pass walks them back
    (:mod:`nash_mhc.ops.sinkhorn_rounds`: the gradient of exactly these ``num_iters`` rounds). The matrices
    are laid out [n, n, tokens], so every step is vectorised along the tokens. Reverse mode only (a
    ``custom_vjp``, as the TPU kernels).

    Lowered for TPU, one [T, n, n] batch of matrices whose T a token tile divides runs as the Pallas kernels of
    :func:`nash_mhc.kernels.tpu.sinkhorn_kernel.sinkhorn_tokens` on each device's token shard (same function; they
    save only the logits and rerun the rounds on chip; finite logits); elsewhere (CPU, GPU) the same rounds in XLA.
    """
    if num_iters < 1:
        raise ValueError(f"sinkhorn needs num_iters >= 1, got {num_iters}")
    xla = functools.partial(_sinkhorn_xla, num_iters=num_iters)
    if logits.ndim != 3 or token_block(logits.shape[0]) is None:
        return xla(logits)
    names = ("tokens", "streams", "streams")
    kernel = per_shard(functools.partial(_sinkhorn_shard, num_iters=num_iters), (names,), names)
    return platform_dependent(logits, tpu=kernel, default=xla, name="sinkhorn")


def _sinkhorn_shard(logits: jax.Array, num_iters: int) -> jax.Array:
    """One device's tokens: the kernels, or the XLA rounds where no token tile divides the shard."""
    if token_block(logits.shape[0]) is None:
        return _sinkhorn_xla(logits, num_iters)
    return sinkhorn_tokens(logits, num_iters)


def _sinkhorn_xla(logits: jax.Array, num_iters: int) -> jax.Array:
    """[*batch, n, n] → [*batch, n, n] float32 by :func:`_rounds` on the matrices laid out [n, n, tokens]."""
    *batch, n, _ = logits.shape
    z = rearrange(logits.astype(jnp.float32), "... i j -> i j (...)")
    return rearrange(_rounds(z, num_iters), "i j t -> t i j").reshape(*batch, n, n)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _rounds(z: jax.Array, num_iters: int) -> jax.Array:
    """exp of ``num_iters`` rounds of [n, n, T] float32."""
    return project(z, num_iters)


def _rounds_fwd(z: jax.Array, num_iters: int) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """The rounds, keeping each one's exponentiated iterates exp(c), exp(r) [num_iters, n, n, T] for the walk
    back: 2 num_iters n² floats per matrix, where re-running the rounds in the backward pass kept only z (n²)
    but computed every round and its exponentials twice more (CPU: 1.4 x the time of forward + backward,
    docs/results/cpu_throughput/README.md). Under remat only the layer being differentiated holds them."""
    def forward(z: jax.Array, _: None) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        c, r = sinkhorn_round(z)
        return r, (jnp.exp(c), jnp.exp(r))

    _, iterates = jax.lax.scan(forward, z, None, length=num_iters)
    return iterates[1][-1], iterates


def _rounds_bwd(num_iters: int, iterates: tuple[jax.Array, jax.Array], g: jax.Array) -> tuple[jax.Array]:
    """Walk the saved iterates back from the last."""
    def backward(dr: jax.Array, exps: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, None]:
        return walk_back_exp(dr, *exps), None

    dz, _ = jax.lax.scan(backward, g * iterates[1][-1], iterates, reverse=True)
    return (dz,)


_rounds.defvjp(_rounds_fwd, _rounds_bwd)
