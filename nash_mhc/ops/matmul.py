"""A two-operand einsum in a low-precision compute dtype with float32 accumulation and a float32 result, whose
backward matmuls run in that compute dtype too.

``jnp.einsum(a, b, preferred_element_type=float32)`` on bfloat16 operands gives the float32 result the
softmax and the cross-entropy want, but its automatic transpose multiplies the float32 cotangent by a bfloat16
operand: a mixed float32 x bfloat16 matmul, which XLA runs in float32 (half the MXU rate on TPU, twice the
operand bytes). :func:`f32_einsum` rounds the cotangent to the compute dtype instead, as mixed-precision
training does for every other matmul's cotangent, and accumulates both gradient matmuls in float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _transposed_specs(spec: str) -> tuple[str, str]:
    """("C,B->A", "A,C->B") for ``spec`` = "A,B->C": the einsums of the two operands' gradients.

    Every index must be a letter and appear in at least two of A, B, C (an index summed inside one operand
    alone has no transpose as an einsum of two arrays).
    """
    inputs, _, out = spec.replace(" ", "").partition("->")
    a, _, b = inputs.partition(",")
    if not (a and b and out) or not (a + b + out).isalpha():
        raise ValueError(f"f32_einsum needs an explicit two-operand spec of letters 'A,B->C', got {spec!r}")
    for index in set(a + b + out):
        if (index in a) + (index in b) + (index in out) < 2:
            raise ValueError(f"f32_einsum: index {index!r} of {spec!r} appears in only one of the operands "
                             "and the result")
    return f"{out},{b}->{a}", f"{a},{out}->{b}"


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def _mixed(spec: str, a: jax.Array, b: jax.Array, dtype: str) -> jax.Array:
    return jnp.einsum(spec, a.astype(dtype), b.astype(dtype), preferred_element_type=jnp.float32)


def _mixed_fwd(spec: str, a: jax.Array, b: jax.Array, dtype: str) -> tuple[jax.Array, tuple]:
    a_c, b_c = a.astype(dtype), b.astype(dtype)
    # The residuals are the compute-dtype operands; zero-size arrays carry the original dtypes.
    out = jnp.einsum(spec, a_c, b_c, preferred_element_type=jnp.float32)
    return out, (a_c, b_c, jnp.zeros((0,), a.dtype), jnp.zeros((0,), b.dtype))


def _mixed_bwd(spec: str, dtype: str, residuals: tuple, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    a_c, b_c, a_like, b_like = residuals
    spec_a, spec_b = _transposed_specs(spec)
    g = g.astype(dtype)
    grad_a = jnp.einsum(spec_a, g, b_c, preferred_element_type=jnp.float32)
    grad_b = jnp.einsum(spec_b, a_c, g, preferred_element_type=jnp.float32)
    return grad_a.astype(a_like.dtype), grad_b.astype(b_like.dtype)


_mixed.defvjp(_mixed_fwd, _mixed_bwd)


def f32_einsum(spec: str, a: jax.Array, b: jax.Array, dtype: str | jnp.dtype) -> jax.Array:
    """``einsum(spec, a, b)`` with both operands cast to ``dtype``, float32 accumulation and a float32 result.

    Backward: the float32 cotangent is rounded to ``dtype`` and each operand's gradient is one matmul of two
    ``dtype`` operands with float32 accumulation, returned in that operand's own dtype (a float32 operand cast
    here gets a float32 gradient, not a rounded one). With ``dtype`` float32 this is the plain einsum.
    ``spec``: explicit, two operands, letters only (``"qhk,shk->hqs"``); see :func:`_transposed_specs`.
    """
    _transposed_specs(spec)  # validate
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32:
        return jnp.einsum(spec, a.astype(dtype), b.astype(dtype), preferred_element_type=jnp.float32)
    return _mixed(spec, a, b, dtype.name)


__all__ = ["f32_einsum"]
