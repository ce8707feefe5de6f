"""Rotary position embedding with an arbitrary position spacing."""

from __future__ import annotations

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
    products are float32; the result has the input dtype. On TPU, 16-bit inputs take :func:`rotate_tpu` (the
    same numbers, forward and backward).
    """
    seq, _, head_dim = x.shape[-3:]
    half = head_dim // 2
    cos, sin = angle_tables(seq, half, spacing, theta, positions)

    def halves(x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        x1, x2 = xf[..., :half], xf[..., half:]
        return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)

    if jnp.dtype(x.dtype).itemsize != 2:
        return halves(x)
    full_cos, signed_sin = jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([-sin, sin], axis=-1)
    return jax.lax.platform_dependent(x, tpu=lambda x: rotate_tpu(x, full_cos, signed_sin), default=halves)


def angle_tables(seq: int, half: int, spacing: int, theta: float, positions: jax.Array | None
                 ) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) [seq, 1, half] float32 of the angles (positions · spacing) · θ^(−i/half), i = 0..half−1
    (positions default to 0..seq−1)."""
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    index = jnp.arange(seq, dtype=jnp.float32) if positions is None else positions.astype(jnp.float32)
    angles = (index * spacing)[:, None] * freqs[None, :]
    return jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]


@jax.custom_vjp
def rotate_tpu(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """RoPE of 16-bit ``x`` [..., K] for TPU: x ⊙ cos + swap_halves(x) ⊙ sin in float32, rounded to x's dtype,
    with cos = [c, c] and sin = [-s, s] over the last axis (broadcast against x).

    Slicing the K/2 halves (:func:`rope`'s form) leaves each (8, 128) tile half empty; here the swap
    [x₁, x₂] → [x₂, x₁] is a one-hot matmul (one product by 1 per output, float32 accumulation: exact), and the
    backward pass is the rotation by the opposite angle (Rᵀ g = g ⊙ cos + swap_halves(g) ⊙ (−sin)), so its
    swap takes the 16-bit cotangent too. The TPU compiler's cost model charged RoPE's forward and backward (with
    the flash kernels' head-major transposes that fuse into it) about 2x this form (docs/tpu.md). On the CPU
    XLA fuses the slicing form better, so :func:`rope` uses this on TPU only."""
    swapped = jnp.einsum("...k,kj->...j", x, _swap_matrix(x.shape[-1], x.dtype), precision=jax.lax.Precision.HIGHEST,
                         preferred_element_type=jnp.float32)
    return (x.astype(jnp.float32) * cos + swapped * sin).astype(x.dtype)


def _swap_matrix(size: int, dtype: jnp.dtype) -> jax.Array:
    """P with x @ P = [x₂, x₁] (the halves of the last axis swapped)."""
    return jnp.asarray(np.roll(np.eye(size), size // 2, axis=0), dtype)


def _rotate_tpu_forward(x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, tuple]:
    return rotate_tpu(x, cos, sin), (cos, sin)


def _rotate_tpu_backward(residuals: tuple, g: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    cos, sin = residuals  # the angles get no gradient
    return rotate_tpu(g, cos, -sin), jnp.zeros_like(cos), jnp.zeros_like(sin)


rotate_tpu.defvjp(_rotate_tpu_forward, _rotate_tpu_backward)
