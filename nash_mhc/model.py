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
    """What one forward pass returns for one sequence.

    logits: [T, V] float32, columns ≥ vocab_size masked to -1e30 (vocab padding never gets probability).
    aux_loss: mean normalised entropy of the scale-aggregation weights over layers (unscaled; the training
      loss multiplies it by ``sparsity_weight``); 0 for ``attention="full"``.
    scale_weights: [L] mean aggregation weight per scale over positions and layers.
    res_diag: mean diagonal of H_res over tokens, sublayers and layers (1 for one stream).
    residual_maps: [2·layers, T, n, n] every sublayer's H_res, only with ``return_residual_maps=True``.
    """

    logits: Float[Array, "seq vocab"]
    aux_loss: Float[Array, ""]
    scale_weights: Float[Array, "scales"]
    res_diag: Float[Array, ""]
    residual_maps: Float[Array, "sublayers seq n n"] | None = None


class Block(eqx.Module):
    """One transformer block: two hyper-connected sublayers (attention, then SwiGLU) on X [T, n, D]."""

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
    def __call__(self, x: Float[Array, "seq n dim"]) -> tuple[
            Float[Array, "seq n dim"], Float[Array, ""], Float[Array, "seq scales"], Float[Array, "2 seq n n"]]:
        """Returns (X, aggregation entropy, aggregation weights, H_res of both sublayers)."""
        stats = {}

        def attention(u: jax.Array) -> jax.Array:
            y, stats["weights"], stats["entropy"] = self.attn(self.attn_norm(u))
            return y

        x, res_attn = self.attn_hc(x, attention)
        x, res_ffn = self.ffn_hc(x, lambda u: self.ffn(self.ffn_norm(u)))
        return x, stats["entropy"], stats["weights"], jnp.stack([res_attn, res_ffn])


class LanguageModel(eqx.Module):
    """Decoder-only Nash-MHC language model on one token sequence (``jax.vmap`` for batches).

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

    def embed(self, tokens: Int[Array, "seq"]) -> Float[Array, "seq n dim"]:
        """Token embeddings, repeated into the n residual streams: X [T, n, D]."""
        c = self.config
        h = self.embedding[tokens]
        return jnp.broadcast_to(h[:, None, :], (tokens.shape[0], c.num_streams, c.d_model))

    def unembed(self, x: Float[Array, "seq n dim"]) -> Float[Array, "seq vocab"]:
        """Collapse the streams (sum), final norm and LM head: logits [T, V], padded columns -1e30."""
        c = self.config
        dt = jnp.dtype(c.dtype)
        h = self.final_norm(jnp.sum(x, axis=1))
        head = self.embedding.T if self.head is None else self.head
        logits = jnp.einsum("td,dv->tv", h.astype(dt), head.astype(dt), preferred_element_type=jnp.float32)
        real = jnp.arange(c.padded_vocab_size) < c.vocab_size
        return jnp.where(real[None, :], logits, -1e30)

    @jaxtyped(typechecker=beartype)
    def __call__(self, tokens: Int[Array, "seq"], *, return_residual_maps: bool = False) -> ModelOutput:
        c = self.config
        seq = tokens.shape[0]
        x = self.embed(tokens)
        params, static = eqx.partition(self.blocks, eqx.is_array)

        def layer(x: jax.Array, block_params: Block) -> tuple[jax.Array, tuple[jax.Array, ...]]:
            block = eqx.combine(block_params, static)
            x, entropy, weights, res = block(x)
            diag = jnp.mean(jnp.diagonal(res, axis1=-2, axis2=-1))
            ys = (entropy, jnp.mean(weights, axis=0), diag)
            return x, ys + ((res,) if return_residual_maps else ())

        if c.remat != "none":
            layer = jax.checkpoint(layer, policy=REMAT_POLICIES[c.remat])
        x, ys = jax.lax.scan(layer, x, params)
        entropy, weights, diag = ys[:3]
        logits = self.unembed(x)
        maps = ys[3].reshape(-1, seq, c.num_streams, c.num_streams) if return_residual_maps else None
        return ModelOutput(logits=logits, aux_loss=jnp.mean(entropy), scale_weights=jnp.mean(weights, axis=0),
                           res_diag=jnp.mean(diag), residual_maps=maps)
