"""Rotary position embedding with an arbitrary position spacing."""

from __future__ import annotations

import jax.numpy as jnp
from beartype import beartype
from jaxtyping import Array, Float, Int, jaxtyped


@jaxtyped(typechecker=beartype)
def rope(x: Float[Array, "*batch seq heads head_dim"], *, spacing: int = 1, theta: float = 10000.0,
         positions: Int[Array, "seq"] | None = None) -> Float[Array, "*batch seq heads head_dim"]:
    """Rotate (rotate-half convention) token j as if it sat at position ``positions[j] * spacing``.

    ``positions`` defaults to ``0..seq-1`` (a whole sequence); incremental decoding passes the index of the
    token(s) it holds. Coarse tokens at scale l use ``spacing = s_l`` (and coarse indices as positions) so
    their relative angles match fine-token distances. Leading batch axes share the positions. Angles are
    computed in float32; the result has the input dtype.
    """
    seq, _, head_dim = x.shape[-3:]
    half = head_dim // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    index = jnp.arange(seq, dtype=jnp.float32) if positions is None else positions.astype(jnp.float32)
    angles = (index * spacing)[:, None] * freqs[None, :]
    cos = jnp.cos(angles)[:, None, :]
    sin = jnp.sin(angles)[:, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return out.astype(x.dtype)
