"""Block and LanguageModel: embed → n streams → scan over stacked blocks → collapse → norm → head.

Dimension letters: T tokens, D d_model, n streams, L scales, V padded vocabulary (see config.py).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from beartype import beartype
from jaxtyping import Array, Float, Int, jaxtyped

from nash_mhc.config import ModelConfig
from nash_mhc.layers.attention import MultiscaleAttention
from nash_mhc.layers.ffn import SwiGLU
from nash_mhc.layers.hyperconnection import HyperConnection
from nash_mhc.layers.init import EMBED_STD, normal
from nash_mhc.layers.norm import RMSNorm

REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class ModelOutput(eqx.Module):
    """What one forward pass returns for one sequence (a batched call adds a leading B to every field).

    logits: [T, V] float32, columns ≥ vocab_size masked to -1e30 (vocab padding never gets probability).
    aux_loss: mean normalised entropy of the scale-aggregation weights over layers (unscaled; the training
      loss multiplies it by ``sparsity_weight``); 0 for ``attention="full"``.
    scale_weights: [L] mean aggregation weight per scale over positions and layers.
    res_diag: mean diagonal of H_res over tokens, sublayers and layers (1 for one stream).
    residual_maps: [2·layers, T, n, n] every sublayer's H_res, only with ``return_residual_maps=True``.
    """

    logits: Float[Array, "*batch seq vocab"]
    aux_loss: Float[Array, "*batch"]
    scale_weights: Float[Array, "*batch scales"]
    res_diag: Float[Array, "*batch"]
    residual_maps: Float[Array, "*batch sublayers seq n n"] | None = None


class Block(eqx.Module):
    """One transformer block: two hyper-connected sublayers (attention, then SwiGLU) on X [B, T, n, D]."""

    attn_hc: HyperConnection
    attn_norm: RMSNorm
    attn: MultiscaleAttention
    ffn_hc: HyperConnection
    ffn_norm: RMSNorm
    ffn: SwiGLU

    def __init__(self, config: ModelConfig, *, key: jax.Array):
        c = config
        k1, k2, k3, k4 = jax.random.split(key, 4)
        hc = dict(sinkhorn_iters=c.sinkhorn_iters, identity_logit=c.hc_identity_logit, eps=c.norm_eps)
        self.attn_hc = HyperConnection(c.residual, c.num_streams, c.d_model, key=k1, **hc)
        self.attn_norm = RMSNorm(c.d_model, c.norm_eps)
        self.attn = MultiscaleAttention(
            c.d_model, c.num_heads, c.block_sizes, num_layers=c.num_layers, aggregation=c.aggregation,
            nash_iters=c.nash_iters, nash_temperature=c.nash_temperature, rope_theta=c.rope_theta,
            dtype=c.dtype, key=k2)
        self.ffn_hc = HyperConnection(c.residual, c.num_streams, c.d_model, key=k3, **hc)
        self.ffn_norm = RMSNorm(c.d_model, c.norm_eps)
        self.ffn = SwiGLU(c.d_model, c.ffn_hidden, num_layers=c.num_layers, dtype=c.dtype, key=k4)

    @jaxtyped(typechecker=beartype)
    def __call__(self, x: Float[Array, "*batch seq n dim"]) -> tuple[
            Float[Array, "*batch seq n dim"], Float[Array, "*batch"], Float[Array, "*batch seq scales"],
            Float[Array, "2 *batch seq n n"]]:
        """Returns (X, aggregation entropy per sequence, aggregation weights, H_res of both sublayers).

        The hyper-connections, norms and FFN are per token and run on the flattened [B·T, ...] tokens;
        attention gets them back as [B, T, D] sequences. One sequence [T, n, D] is run as a batch of one.
        """
        if x.ndim == 3:
            x, entropy, weights, res = self(x[None])
            return x[0], entropy[0], weights[0], res[:, 0]
        batch, seq, n, dim = x.shape
        stats = {}

        def attention(u: jax.Array) -> jax.Array:
            y, stats["weights"], stats["entropy"] = self.attn(self.attn_norm(u).reshape(batch, seq, dim))
            return y.reshape(batch * seq, dim)

        tokens = x.reshape(batch * seq, n, dim)
        tokens, res_attn = self.attn_hc(tokens, attention)
        tokens, res_ffn = self.ffn_hc(tokens, lambda u: self.ffn(self.ffn_norm(u)))
        res = jnp.stack([res_attn, res_ffn]).reshape(2, batch, seq, n, n)
        return tokens.reshape(batch, seq, n, dim), stats["entropy"], stats["weights"], res


class LanguageModel(eqx.Module):
    """Decoder-only Nash-MHC language model on tokens [T] or a batch [B, T] (``jax.vmap`` also works).

    The streams are created once after the embedding (n copies) and collapsed once before the final
    norm by summing over streams (the final RMSNorm makes the sum's scale irrelevant). Blocks are stacked
    along a leading layer axis and run with one ``lax.scan`` (compile time flat in depth), optionally
    rematerialised (``config.remat``: none | full | dots).
    """

    embedding: Float[Array, "vocab dim"]
    blocks: Block
    final_norm: RMSNorm
    head: Float[Array, "dim vocab"] | None
    config: ModelConfig = eqx.field(static=True)

    def __init__(self, config: ModelConfig, *, key: jax.Array):
        k_embed, k_blocks, k_head = jax.random.split(key, 3)
        V, D = config.padded_vocab_size, config.d_model
        self.embedding = normal(k_embed, (V, D), EMBED_STD)
        block_keys = jax.random.split(k_blocks, config.num_layers)
        self.blocks = eqx.filter_vmap(lambda k: Block(config, key=k))(block_keys)
        self.final_norm = RMSNorm(D, config.norm_eps)
        self.head = None if config.tie_embeddings else normal(k_head, (D, V), EMBED_STD)
        self.config = config

    def embed(self, tokens: Int[Array, "*batch seq"]) -> Float[Array, "*batch seq n dim"]:
        """Token embeddings, repeated into the n residual streams: X [..., T, n, D]."""
        c = self.config
        h = self.embedding[tokens]
        return jnp.broadcast_to(h[..., None, :], (*tokens.shape, c.num_streams, c.d_model))

    def unembed(self, x: Float[Array, "*batch seq n dim"]) -> Float[Array, "*batch seq vocab"]:
        """Collapse the streams (sum), final norm and LM head: logits [..., T, V], padded columns -1e30."""
        c = self.config
        dt = jnp.dtype(c.dtype)
        h = self.final_norm(jnp.sum(x, axis=-2))
        head = self.embedding.T if self.head is None else self.head
        logits = jnp.einsum("...d,dv->...v", h.astype(dt), head.astype(dt), preferred_element_type=jnp.float32)
        real = jnp.arange(c.padded_vocab_size) < c.vocab_size
        return jnp.where(real, logits, -1e30)

    @jaxtyped(typechecker=beartype)
    def __call__(self, tokens: Int[Array, "*batch seq"], *, return_residual_maps: bool = False) -> ModelOutput:
        """Forward pass of one sequence [T] or of a batch [B, T] (every output then has a leading B).

        A batch runs natively: token-wise layers see all B·T tokens at once, so each weight gradient is
        one matmul (``jax.vmap`` over single sequences gives the same numbers, more slowly on CPU).
        """
        if tokens.ndim == 1:
            out = self(tokens[None], return_residual_maps=return_residual_maps)
            return jax.tree.map(lambda a: a[0], out)
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [seq] or [batch, seq], got shape {tokens.shape}")
        c = self.config
        batch, seq = tokens.shape
        x = self.embed(tokens)
        params, static = eqx.partition(self.blocks, eqx.is_array)

        def layer(x: jax.Array, block_params: Block) -> tuple[jax.Array, tuple[jax.Array, ...]]:
            block = eqx.combine(block_params, static)
            x, entropy, weights, res = block(x)
            diag = jnp.mean(jnp.diagonal(res, axis1=-2, axis2=-1), axis=(0, 2, 3))
            ys = (entropy, jnp.mean(weights, axis=1), diag)
            return x, ys + ((res,) if return_residual_maps else ())

        if c.remat != "none":
            layer = jax.checkpoint(layer, policy=REMAT_POLICIES[c.remat])
        x, ys = jax.lax.scan(layer, x, params)
        entropy, weights, diag = ys[:3]  # [layers, B], [layers, B, L], [layers, B]
        logits = self.unembed(x)
        maps = None
        if return_residual_maps:  # [layers, 2, B, T, n, n] → [B, 2·layers, T, n, n]
            maps = jnp.moveaxis(ys[3], 2, 0).reshape(batch, -1, seq, c.num_streams, c.num_streams)
        return ModelOutput(logits=logits, aux_loss=jnp.mean(entropy, axis=0),
                           scale_weights=jnp.mean(weights, axis=0), res_diag=jnp.mean(diag, axis=0),
                           residual_maps=maps)
