"""A TPU form or an XLA form of one function, chosen when the step is lowered, with one backward rule for both.

Differentiated as it is, ``jax.lax.platform_dependent``'s conditional keeps the residuals of every branch: JAX's
partial evaluation of a ``cond`` makes each branch return the union of the branches' residuals, zeros in place of
the others'. Those zeros are made outside any mesh annotation, so unsharded: in the `1b` Nash-MHC step on v6e-8
the XLA downsampling's residual became a bf16[32, 512, 4, 2048] zero of the global batch on every chip, 1.7 % of
the step's estimate (docs/tpu.md). :func:`platform_vjp` saves the operands instead and chooses again in the
backward pass, between the two forms' own VJPs.
"""

from __future__ import annotations

from collections.abc import Callable

import jax


def platform_vjp(tpu: Callable[..., jax.Array], default: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """``f(*args) = jax.lax.platform_dependent(*args, tpu=tpu, default=default)``, differentiable in every
    argument, whose backward pass is ``platform_dependent`` of the two forms' VJPs at the saved ``args``.

    For functions whose backward needs no more than their operands (linear maps such as the multiscale
    resampling): each form's forward inside its VJP is dead code, which the compiler drops. Both forms must
    take and return arrays of the same shapes and dtypes."""

    def pullback(form: Callable[..., jax.Array]) -> Callable[..., tuple[jax.Array, ...]]:
        def run(*operands: jax.Array) -> tuple[jax.Array, ...]:
            *args, cotangent = operands
            return jax.vjp(form, *args)[1](cotangent)
        return run

    @jax.custom_vjp
    def f(*args: jax.Array) -> jax.Array:
        return jax.lax.platform_dependent(*args, tpu=tpu, default=default)

    def forward(*args: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        return f(*args), args

    def backward(args: tuple[jax.Array, ...], cotangent: jax.Array) -> tuple[jax.Array, ...]:
        return jax.lax.platform_dependent(*args, cotangent, tpu=pullback(tpu), default=pullback(default))

    f.defvjp(forward, backward)
    return f


__all__ = ["platform_vjp"]
