"""Rotary position embedding with an arbitrary position spacing."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from beartype import beartype
from jaxtyping import Array, Float, Int, jaxtyped

from nash_mhc.kernels.tpu.rope_kernel import rotate_kernel, row_tile
from nash_mhc.ops.dispatch import platform_dependent


@jaxtyped(typechecker=beartype)
def rope(x: Float[Array, "*batch seq heads head_dim"], *, spacing: int = 1, theta: float = 10000.0,
         positions: Int[Array, "seq"] | None = None, num_positions: int | None = None
         ) -> Float[Array, "*batch seq heads head_dim"]:
    """Rotate (rotate-half convention) token j as if it sat at position ``positions[j] * spacing``.

    ``positions`` defaults to ``0..seq-1`` (a whole sequence); incremental decoding passes the index of the
    token(s) it holds, with ``num_positions`` > every index (the size of the angle table they index; ValueError
    without it). Coarse tokens at scale l use ``spacing = s_l`` (and coarse indices as positions) so their
    relative angles match fine-token distances. Leading batch axes share the positions. The angle tables are
    constants of the program (:func:`angle_tables`), so a position gets the same cosine and sine in a whole
    sequence and in decoding; products are float32; the result has the input dtype. On TPU, a whole bfloat16
    sequence [B, T, H, K] whose head dim is a multiple of 128 takes the Pallas kernel
    :func:`nash_mhc.kernels.tpu.rope_kernel.rotate_kernel`, other 16-bit inputs :func:`rotate_tpu` (the same float32
    products and sum, forward and backward).
    """
    seq, _, head_dim = x.shape[-3:]
    half = head_dim // 2
    if positions is None:
        cos, sin = map(jnp.asarray, angle_tables(seq, half, spacing, theta))
    elif num_positions is None:
        raise ValueError("rope: positions need num_positions, the size of the angle table they index")
    else:
        cos, sin = (jnp.asarray(table)[positions] for table in angle_tables(num_positions, half, spacing, theta))

    def halves(x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        x1, x2 = xf[..., :half], xf[..., half:]
        return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)

    if jnp.dtype(x.dtype).itemsize != 2:
        return halves(x)
    full_cos, signed_sin = jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([-sin, sin], axis=-1)
    kernel = positions is None and x.ndim == 4 and x.dtype == jnp.bfloat16 and row_tile(seq, head_dim) is not None

    def tpu(x: jax.Array) -> jax.Array:
        if kernel:  # a whole sequence: the Pallas kernel; decoding's given positions: the one-hot form
            return rotate_kernel(x, full_cos[:, 0], signed_sin[:, 0])
        return rotate_tpu(x, full_cos, signed_sin)
    return platform_dependent(x, tpu=tpu, default=halves, name="rope")


@functools.lru_cache(maxsize=64)
def angle_tables(count: int, half: int, spacing: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin) [count, 1, half] float32 of the angles (p · spacing) · θ^(−i/half), p = 0..count−1,
    i = 0..half−1: computed in float64 NumPy when the program is traced, rounded once.

    Constants, not XLA operations: computed in the program, the CPU backend fused the cosine and sine into
    every rotation and evaluated them once per element of x (a [B, T, H, K] rotation computed B·H times the
    table's transcendentals, in the forward and the backward pass)."""
    freqs = float(theta) ** (-np.arange(half, dtype=np.float64) / half)
    angles = (np.arange(count, dtype=np.float64) * spacing)[:, None] * freqs[None, :]
    tables = tuple(np.asarray(f(angles), np.float32)[:, None, :] for f in (np.cos, np.sin))
    for table in tables:
        table.setflags(write=False)  # shared by the cache
    return tables


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
