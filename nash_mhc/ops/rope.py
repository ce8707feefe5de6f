"""Rotary position embedding with an arbitrary position spacing."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from beartype import beartype
from jaxtyping import Array, Float, Int, jaxtyped


@jaxtyped(typechecker=beartype)
def rope(x: Float[Array, "*batch seq heads head_dim"], *, spacing: int = 1, theta: float = 10000.0,
         positions: Int[Array, "seq"] | None = None) -> Float[Array, "*batch seq heads head_dim"]:
    """Rotate (rotate-half convention) token j as if it sat at position ``positions[j] * spacing``.

    ``positions`` defaults to ``0..seq-1`` (a whole sequence); incremental decoding passes the index of the
    token(s) it holds. Coarse tokens at scale l use ``spacing = s_l`` (and coarse indices as positions) so
    their relative angles match fine-token distances. Leading batch axes share the positions. Angles and
    products are float32; the result has the input dtype.
    """
    seq, _, head_dim = x.shape[-3:]
    half = head_dim // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    index = jnp.arange(seq, dtype=jnp.float32) if positions is None else positions.astype(jnp.float32)
    angles = (index * spacing)[:, None] * freqs[None, :]
    cos = jnp.cos(angles)[:, None, :]
    sin = jnp.sin(angles)[:, None, :]
    return _rotate(x, jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([-sin, sin], axis=-1))


@jax.custom_vjp
def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x ⊙ cos + swap_halves(x) ⊙ sin in float32, returned in x's dtype; cos = [c, c], sin = [-s, s] over the
    last axis (broadcast against x). A rotation R; its transpose is the rotation by the opposite angle."""
    return (x.astype(jnp.float32) * cos + _swap_halves(x).astype(jnp.float32) * sin).astype(x.dtype)


def _rotate_forward(x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, tuple]:
    return _rotate(x, cos, sin), (cos, sin)


def _rotate_backward(residuals: tuple, g: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Rᵀ g = g ⊙ cos + swap_halves(g) ⊙ (−sin) (with sin = [−s, s], swap_halves(g ⊙ [s, −s]) = that term), in
    float32 from g's dtype, as autodiff of the forward computes it; the angles get no gradient."""
    cos, sin = residuals
    return _rotate(g, cos, -sin), jnp.zeros_like(cos), jnp.zeros_like(sin)


_rotate.defvjp(_rotate_forward, _rotate_backward)


def _swap_halves(x: jax.Array) -> jax.Array:
    """[x₁, x₂] → [x₂, x₁] over the last axis, exactly. On TPU for 16-bit inputs a one-hot matmul (each output is
    one input times 1, accumulated in float32: exact): slicing the halves puts each in (8, 128) tiles half
    empty, and the TPU compiler's cost model charges RoPE's forward and backward about 2x the matmul form
    (``benchmarks/tpu_estimate.py``, docs/tpu.md)."""
    half = x.shape[-1] // 2

    def slices(x: jax.Array) -> jax.Array:
        return jnp.concatenate([x[..., half:], x[..., :half]], axis=-1)

    if jnp.dtype(x.dtype).itemsize != 2:
        return slices(x)
    return jax.lax.platform_dependent(x, tpu=functools.partial(_swap_halves_matmul, half=half), default=slices)


def _swap_halves_matmul(x: jax.Array, half: int) -> jax.Array:
    permutation = jnp.asarray(np.roll(np.eye(2 * half), half, axis=0), x.dtype)  # x @ P = [x₂, x₁]
    return jnp.einsum("...k,kj->...j", x, permutation, precision=jax.lax.Precision.HIGHEST,
                      preferred_element_type=jnp.float32).astype(x.dtype)
