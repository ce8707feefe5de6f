"""Causal softmax attention on one sequence (no batch axis; vmap for batches)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from beartype import beartype
from jaxtyping import Array, Bool, Float, jaxtyped


@jaxtyped(typechecker=beartype)
def masked_attention(q: Float[Array, "query heads head_dim"], k: Float[Array, "key heads head_dim"],
                     v: Float[Array, "key heads head_dim"], mask: Bool[Array, "query key"]
                     ) -> Float[Array, "query heads head_dim"]:
    """softmax(q kᵀ / √K, restricted to ``mask``) v with float32 scores and softmax.

    Masked scores are -inf, so their probabilities are exactly 0. Every query row needs at least one
    unmasked key. The core of :func:`causal_attention` and of one-query incremental decoding.
    Rematerialised: the backward pass keeps q, k, v and recomputes the [H, Tq, Tk] probabilities instead
    of saving them (one extra QKᵀ matmul for no score-sized residuals).
    """
    return _masked_attention(q, k, v, mask)


@jax.checkpoint
def _masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    head_dim = q.shape[-1]
    scores = jnp.einsum("qhk,shk->hqs", q, k, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / head_dim**0.5)
    scores = jnp.where(mask[None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("hqs,shk->qhk", probs, v, preferred_element_type=jnp.float32).astype(v.dtype)


@jaxtyped(typechecker=beartype)
def causal_attention(q: Float[Array, "seq heads head_dim"], k: Float[Array, "seq heads head_dim"],
                     v: Float[Array, "seq heads head_dim"]) -> Float[Array, "seq heads head_dim"]:
    """softmax(q kᵀ / √K + causal mask) v with float32 scores and softmax.

    Masked scores are -inf, so their probabilities are exactly 0 and a change at key j can never change
    the output at a query i < j, bit for bit.
    """
    seq = q.shape[0]
    return masked_attention(q, k, v, jnp.tril(jnp.ones((seq, seq), bool)))
