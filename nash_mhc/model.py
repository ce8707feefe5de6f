"""Block and LanguageModel: embed → n streams → scan over stacked blocks → collapse → norm → head.

Dimension letters: T tokens, D d_model, n streams, L scales, V padded vocabulary (see config.py).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from beartype import beartype
from einops import rearrange
from jaxtyping import Array, Float, Int, jaxtyped

from nash_mhc import execution
from nash_mhc.config import ModelConfig
from nash_mhc.layers.attention import MultiscaleAttention
from nash_mhc.layers.ffn import SwiGLU
from nash_mhc.layers.hyperconnection import HyperConnection, Update, connect_pair, identity_update, leaves_updates
from nash_mhc.layers.init import EMBED_STD, normal
from nash_mhc.layers.norm import RMSNorm
from nash_mhc.ops.dispatch import tpu_kernels
from nash_mhc.ops.matmul import f32_einsum
from nash_mhc.ops.multiscale import choice_mask
from nash_mhc.ops.stream_copies import stream_copies, stream_sum
from nash_mhc.ops.stream_mix import mix_streams
from nash_mhc.ops.stream_slabs import slab_sum
from nash_mhc.params import ROLES, declared_parameters, map_declared, param, stacked
from nash_mhc.sharding import constrain_batch, gather_fsdp, rows_to_batch

REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def grouped_scan(layer: Any, x: Any, params: Any, group: int, unroll: int = 1) -> tuple[Any, Any]:
    """``lax.scan(layer, x, params)`` (x: an array or a tuple of them) as a scan over groups of ``group`` layers,
    each group rematerialised whole: the backward pass keeps the input of every group (num_layers / group states)
    and, while it runs through one group, that group's layer inputs (``group`` states). Two nested scans: compile
    time stays flat in depth. ``params``' leaves are stacked [num_layers, ...]; the outputs come back stacked the
    same way.

    A group is its first ``group - 1`` layers scanned, then its last layer on its own: the backward pass reruns
    a group's forward only for the layer inputs it needs, and the last layer's output is not one of them. Left
    inside the inner scan, the last layer ran anyway (a scan computes every iteration), one layer forward per
    group and step for nothing (seen in tests/test_estimate.py's unrolled compile, which dropped it).
    ``unroll``: layers per loop iteration, as for a plain scan: the scan within a group unrolls up to ``unroll``
    of its layers, the scan over groups ``unroll // group`` groups; ``unroll >= num_layers`` leaves no loop. An
    unrolled group hands its layer inputs to the backward pass directly instead of stacking them into
    [group, ...] buffers and slicing them back."""
    def regroup(a: jax.Array) -> jax.Array:
        return rearrange(a, "(groups group) ... -> groups group ...", group=group)

    @jax.checkpoint  # nothing inside a group is saved; its forward pass is rerun in the backward pass
    def run_group(x: Any, group_params: Any) -> tuple[Any, Any]:
        x, ys = jax.lax.scan(layer, x, jax.tree.map(lambda a: a[:-1], group_params), unroll=min(unroll, group - 1))
        x, last = layer(x, jax.tree.map(lambda a: a[-1], group_params))
        return x, jax.tree.map(lambda a, b: jnp.concatenate([a, b[None]]), ys, last)

    x, ys = jax.lax.scan(run_group, x, jax.tree.map(regroup, params), unroll=max(1, unroll // group))
    return x, jax.tree.map(lambda a: rearrange(a, "groups group ... -> (groups group) ..."), ys)


def matmul_weights_in_compute_dtype(blocks: Any, dtype: str) -> Any:
    """``blocks`` (stacked layers) with the parameters whose declared role is ``cast_once`` (the attention and FFN
    matmul weights; :mod:`nash_mhc.params`) in the compute ``dtype``, cast once before the layer scan instead of
    inside every layer.

    Each layer reads its slice of each of these weights once and casts it to the compute dtype there anyway, so
    values and gradients are unchanged (casting commutes with slicing); under fsdp the per-layer all-gathers of
    the weights then move compute-dtype bytes (half of float32's for bfloat16) and the gathered copies are half
    the size. Weights read more than once per step (the embedding, the LM head, the downsampling kernels) stay
    float32, so their gradients still add up in float32. The identity for ``dtype="float32"``.
    """
    dt = jnp.dtype(dtype)
    return map_declared(lambda path, leaf, decl, axes: leaf.astype(dt) if decl is not None and decl.role.cast_once
                        else leaf, blocks, stack=("layers",))


class ModelOutput(eqx.Module):
    """What one forward pass returns for one sequence (a batched call adds a leading B to every field).

    logits: [T, V] float32, columns ≥ vocab_size masked to -1e30 (vocab padding never gets probability).
    aux_loss: the sparsity term: mean over layers and over the positions with a choice of scales
      (:func:`nash_mhc.ops.choice_mask`) of the normalised entropy of the aggregation weights (unscaled and
      unmasked; training weights ``entropy`` by the loss mask and multiplies by ``sparsity_weight``);
      0 for ``attention="full"``.
    entropy: [T] that entropy per position, averaged over layers (0 where there is no choice).
    scale_weights: [L] mean aggregation weight per scale over positions and layers.
    layer_weights: [layers, T, L] every layer's aggregation weights per position (0 on unavailable scales).
    nash_residual: max over layers and positions of the equilibrium residual max_l |w - BR(w)| (0 unless
      ``aggregation="nash"`` with several scales).
    res_diag: mean diagonal of H_res over tokens, sublayers and layers (1 for one stream).
    residual_maps: [2·layers, T, n, n] every sublayer's H_res, only with ``return_residual_maps=True``.
    """

    logits: Float[Array, "*batch seq vocab"]
    aux_loss: Float[Array, "*batch"]
    entropy: Float[Array, "*batch seq"]
    scale_weights: Float[Array, "*batch scales"]
    layer_weights: Float[Array, "*batch layers seq scales"]
    nash_residual: Float[Array, "*batch"]
    res_diag: Float[Array, "*batch"]
    residual_maps: Float[Array, "*batch sublayers seq n n"] | None = None


class BlockStats(NamedTuple):
    """Per-position statistics of one block: aggregation weights [..., T, L], their normalised entropy
    [..., T], the Nash residual [..., T], and the H_res of both sublayers [2, ..., T, n, n]."""

    weights: Float[Array, "*batch seq scales"]
    entropy: Float[Array, "*batch seq"]
    nash_residual: Float[Array, "*batch seq"]
    res: Float[Array, "2 *batch seq n n"]


class Block(eqx.Module):
    """One transformer block: two hyper-connected sublayers (attention, then SwiGLU) on X [B, T, n, D].

    ``layer`` (its depth, possibly traced) numbers its sublayers 2·layer and 2·layer + 1 for the HC
    initialisation.
    """

    attn_hc: HyperConnection
    attn_norm: RMSNorm
    attn: MultiscaleAttention
    ffn_hc: HyperConnection
    ffn_norm: RMSNorm
    ffn: SwiGLU

    def __init__(self, config: ModelConfig, *, key: jax.Array, layer: int | Int[Array, ""] = 0):
        c = config
        k1, k2, k3, k4 = jax.random.split(key, 4)
        hc = dict(sinkhorn_iters=c.sinkhorn_iters, identity_logit=c.hc_identity_logit, eps=c.norm_eps)
        self.attn_hc = HyperConnection(c.residual, c.num_streams, c.d_model, key=k1, sublayer_index=2 * layer, **hc)
        self.attn_norm = RMSNorm(c.d_model, c.norm_eps)
        self.attn = MultiscaleAttention(
            c.d_model, c.num_heads, c.block_sizes, num_layers=c.num_layers, aggregation=c.aggregation,
            nash_iters=c.nash_iters, nash_temperature=c.nash_temperature, rope_theta=c.rope_theta,
            dtype=c.dtype, key=k2, norm_eps=c.norm_eps, scale0_weight=c.scale0_prior_weight)
        self.ffn_hc = HyperConnection(c.residual, c.num_streams, c.d_model, key=k3, sublayer_index=2 * layer + 1,
                                      **hc)
        self.ffn_norm = RMSNorm(c.d_model, c.norm_eps)
        self.ffn = SwiGLU(c.d_model, c.ffn_hidden, num_layers=c.num_layers, dtype=c.dtype, key=k4)

    @jaxtyped(typechecker=beartype)
    def __call__(self, x: Float[Array, "*batch seq n dim"]) -> tuple[
            Float[Array, "*batch seq n dim"], BlockStats]:
        """Returns (X, the attention's aggregation statistics and both sublayers' H_res).

        One sequence [T, n, D] is run as a batch of one. The work is :meth:`streams_major`'s.
        """
        if x.ndim == 3:
            x, stats = self(x[None])
            return x[0], BlockStats(*(a[0] for a in stats[:3]), stats.res[:, 0])
        xs, stats = self.streams_major(rearrange(x, "b t n d -> n b t d"))
        return rearrange(xs, "n b t d -> b t n d"), stats

    def streams_major(self, xs: Float[Array, "n batch seq dim"], update: Update | None = None, *,
                      leave_update: bool = False) -> tuple:
        """:meth:`__call__` on the streams-major state [n, B, T, D] that the model's layer scan carries: (X, stats).

        The hyper-connections, norms and FFN are per token and run on the flattened [n, B·T, D] tokens;
        attention gets them back as [B, T, D] sequences. mhc and mhc-lite only: ``update`` is the previous block's
        FFN update still to be made on X, (y [B, T, D], H_res [B, T, n, n], H_post [B, T, n]), which this block's
        attention collapse makes; ``leave_update`` leaves this block's FFN update unmade and returns (X, update,
        stats) (:func:`nash_mhc.layers.hyperconnection.connect_pair`: on TPU each update is made inside the next
        collapse kernel).
        """
        n, batch, seq, dim = xs.shape
        found = {}

        def attention(u: jax.Array) -> jax.Array:
            y, *found["stats"] = self.attn(rearrange(u, "(b t) d -> b t d", b=batch))
            return rearrange(y, "b t d -> (b t) d")

        tokens = rearrange(xs, "n b t d -> n (b t) d")
        flat = None if update is None else tuple(rearrange(a, "b t ... -> (b t) ...") for a in update)
        # each connection applies its sublayer's pre-norm (mhc on TPU: inside its collapse kernel, which also makes
        # the previous sublayer's stream update)
        out = connect_pair(tokens, (self.attn_hc, attention, self.attn_norm), (self.ffn_hc, self.ffn, self.ffn_norm),
                           update=flat, leave_update=leave_update)
        res = rearrange(jnp.stack(out[-2:]), "s (b t) i j -> s b t i j", b=batch)
        xs, stats = constrain_batch(rearrange(out[0], "n (b t) d -> n b t d", b=batch), dim=1), BlockStats(
            *found["stats"], res)
        if not leave_update:
            return xs, stats
        return xs, tuple(constrain_batch(rearrange(a, "(b t) ... -> b t ...", b=batch)) for a in out[1]), stats


def make_update(xs: Float[Array, "n batch seq dim"], update: Update) -> Float[Array, "n batch seq dim"]:
    """The stream update ``update`` (:meth:`Block.streams_major`'s, left unmade) made on X: what the layer stack's
    last block leaves for the stream sum."""
    batch = xs.shape[1]
    tokens = mix_streams(rearrange(xs, "n b t d -> n (b t) d"),
                         *(rearrange(a, "b t ... -> (b t) ...") for a in update), defer=True)
    return constrain_batch(rearrange(tokens, "n (b t) d -> n b t d", b=batch), dim=1)


def _check_token_ids(tokens: jax.Array, vocab_size: int) -> None:
    """ValueError if concrete ``tokens`` hold an id outside ``[0, vocab_size)`` (tracers are not checked)."""
    if isinstance(tokens, jax.core.Tracer) or tokens.size == 0:
        return
    ids = np.asarray(tokens)
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")


def lm_head_logits(h: Float[Array, "*batch seq dim"], head: Float[Array, "dim vocab"], config: ModelConfig
                   ) -> Float[Array, "*batch seq vocab"]:
    """Logits [..., T, V] float32 of states ``h`` [..., T, D] by the head weight [D, V]; padded columns -1e30.
    Compute-dtype operands, float32 accumulation and logits; the backward matmuls stay in the compute dtype."""
    logits = f32_einsum("td,dv->tv", h.reshape(-1, h.shape[-1]), head, config.dtype)
    logits = logits.reshape(*h.shape[:-1], logits.shape[-1])
    real = jnp.arange(config.padded_vocab_size) < config.vocab_size
    return jnp.where(real, logits, -1e30)


class LanguageModel(eqx.Module):
    """Decoder-only Nash-MHC language model on tokens [T] or a batch [B, T] (``jax.vmap`` also works).

    The streams are created once after the embedding (n copies) and collapsed once before the final
    norm by summing over streams (the final RMSNorm makes the sum's scale irrelevant). Blocks are stacked
    along a leading layer axis and run with one ``lax.scan`` (compile time flat in depth), optionally
    rematerialised and unrolled as the :class:`~nash_mhc.execution.ExecutionConfig` in force says (read while the
    model is traced).
    """

    embedding: Float[Array, "vocab dim"] = param("embedding", "vocab", "embed")
    blocks: Block = stacked("layers")
    final_norm: RMSNorm
    head: Float[Array, "dim vocab"] | None = param("head", "embed", "vocab")
    config: ModelConfig = eqx.field(static=True)

    def __init__(self, config: ModelConfig, *, key: jax.Array):
        k_embed, k_blocks, k_head = jax.random.split(key, 3)
        V, D = config.padded_vocab_size, config.d_model
        self.embedding = normal(k_embed, (V, D), EMBED_STD)
        block_keys = jax.random.split(k_blocks, config.num_layers)
        self.blocks = eqx.filter_vmap(lambda k, i: Block(config, key=k, layer=i))(
            block_keys, jnp.arange(config.num_layers))
        self.final_norm = RMSNorm(D, config.norm_eps)
        self.head = None if config.tie_embeddings else normal(k_head, (D, V), EMBED_STD)
        self.config = config

    def nash_temperatures(self) -> Float[Array, "layers"] | None:
        """Every layer's learned Nash temperature tau (None unless the Nash aggregation has several scales)."""
        aggregation = self.blocks.attn.aggregation
        return None if aggregation is None else aggregation.temperature

    def embed(self, tokens: Int[Array, "*batch seq"]) -> Float[Array, "*batch seq n dim"]:
        """Token embeddings, repeated into the n residual streams: X [..., T, n, D] in the compute dtype.

        The residual streams live in the compute dtype between layers (bfloat16 halves what the layer scan
        keeps per layer, as in the mHC paper and MaxText); inside each sublayer the coefficients and the
        stream mixing ``H_res X + H_post y`` are computed in float32 and rounded once on the way out
        (:class:`~nash_mhc.layers.hyperconnection.HyperConnection`). Under float32 this is the identity.
        """
        h = self.embed_tokens(tokens)
        return jnp.broadcast_to(h[..., None, :], (*tokens.shape, self.config.num_streams, self.config.d_model))

    def embed_tokens(self, tokens: Int[Array, "*batch seq"]) -> Float[Array, "*batch seq dim"]:
        """The tokens' embedding rows [..., T, D] in the compute dtype (one stream's worth of :meth:`embed`).

        Under a mesh the rows of a batch move from the table's split (d_model over fsdp) to the batch's
        (:func:`~nash_mhc.sharding.rows_to_batch`). Left to the compiler, on a mesh with data > 1 and fsdp > 1 the
        CPU's (and GPU's) partitioner moved them (and their gradient) by replicating the whole [B, T, D] activation
        on every device ("Involuntary full rematerialization"). The TPU compiler makes that move itself: there the
        constraints only added to the compiler's estimate (docs/results/tpu_estimate/README.md, "Moved from
        docstrings"), so a step lowered for TPU keeps the lookup unconstrained."""
        rows = self.embedding[tokens].astype(self.config.dtype)
        return rows_to_batch(rows) if tokens.ndim > 1 and not tpu_kernels() else rows

    def unembed(self, x: Float[Array, "*batch seq n dim"]) -> Float[Array, "*batch seq vocab"]:
        """Collapse the streams (sum), final norm and LM head: logits [..., T, V], padded columns -1e30."""
        return self.head_logits(self.collapse(x))

    def collapse(self, x: jax.Array, streams_axis: int = -2) -> Float[Array, "*batch seq dim"]:
        """The streams' sum (in float32) under the final norm: what the LM head reads, [..., T, D] float32.
        ``x`` is token-major [..., T, n, D] (``streams_axis`` -2) or the layer scan's streams-major [n, B, T, D]
        (``streams_axis`` 0: a sum of whole slabs)."""
        if streams_axis == 0:  # the training step's layout: the sum and its backward as stream_sum's slabs
            return self.final_norm(stream_sum(x))
        return self.final_norm(slab_sum(jnp.moveaxis(x, streams_axis, 0)))  # the same additions, in the same order

    def head_logits(self, h: Float[Array, "*batch seq dim"]) -> Float[Array, "*batch seq vocab"]:
        """LM head on collapsed states ``h`` [..., T, D]: logits [..., T, V] float32, padded columns -1e30.
        Position-wise, so it can run on a slice of the positions at a time (chunked cross-entropy)."""
        return lm_head_logits(h, self.head_weight(), self.config)

    def head_weight(self) -> Float[Array, "dim vocab"]:
        """The LM head's weight [D, V]: the embedding's transpose when tied."""
        return self.embedding.T if self.head is None else self.head

    @jaxtyped(typechecker=beartype)
    def __call__(self, tokens: Int[Array, "*batch seq"], *, return_residual_maps: bool = False) -> ModelOutput:
        """Forward pass of one sequence [T] or of a batch [B, T] (every output then has a leading B).

        A batch runs natively: token-wise layers see all B·T tokens at once, so each weight gradient is
        one matmul (``jax.vmap`` over single sequences gives the same numbers, more slowly on CPU).

        Token ids must lie in ``[0, vocab_size)``: a concrete array outside it raises ValueError (a gather
        would silently clamp or read padding rows). The check reads the ids on the host, so it runs only on
        eager calls and costs one device→host copy of the ids there; traced calls (``jit``, the train step)
        skip it, as their ids come from a tokenizer or the data pipeline, whose ids are in range.
        """
        _check_token_ids(tokens, self.config.vocab_size)
        h, out = self.features(tokens, return_residual_maps=return_residual_maps)
        return eqx.tree_at(lambda o: o.logits, out, self.head_logits(h))

    def features(self, tokens: Int[Array, "*batch seq"], *, return_residual_maps: bool = False
                 ) -> tuple[Float[Array, "*batch seq dim"], ModelOutput]:
        """(collapsed states h [..., T, D] float32, the ModelOutput with ``logits`` = h): the forward pass up
        to the LM head, for a loss that applies :meth:`head_logits` to a few positions at a time."""
        if tokens.ndim == 1:
            h, out = self.features(tokens[None], return_residual_maps=return_residual_maps)
            return h[0], jax.tree.map(lambda a: a[0], out)
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [seq] or [batch, seq], got shape {tokens.shape}")
        c = self.config
        batch, seq = tokens.shape
        x = stream_copies(self.embed_tokens(tokens), c.num_streams)  # the layer scan carries X streams-major
        params, static = eqx.partition(self.blocks, eqx.is_array)
        params = matmul_weights_in_compute_dtype(params, c.dtype)
        # mhc / mhc-lite on TPU: each block leaves its FFN's stream update to the next block's attention collapse,
        # made inside that collapse's kernel, so the scan carries (X, the update); the first block makes the
        # identity update, the stream sum's input the last block's
        leave = leaves_updates(self.blocks.attn_hc.mode, batch * seq, c.d_model)
        if leave:
            start = identity_update(batch * seq, c.num_streams, c.d_model, jnp.dtype(c.dtype))
            x = (x, tuple(rearrange(a, "(b t) ... -> b t ...", b=batch) for a in start))

        def layer(x: Any, block_params: Block) -> tuple[Any, tuple[jax.Array, ...]]:
            block = eqx.combine(gather_fsdp(block_params), static)
            if leave:
                *x, stats = block.streams_major(*x, leave_update=True)
                x = tuple(x)
            else:
                x, stats = block.streams_major(x)
            diag = jnp.mean(jnp.diagonal(stats.res, axis1=-2, axis2=-1), axis=(0, 2, 3))
            ys = (stats.entropy, stats.weights, jnp.max(stats.nash_residual, axis=1), diag)
            return x, ys + ((stats.res,) if return_residual_maps else ())

        if c.num_layers % (scan := execution.current()).remat_group:  # remat, group, unroll: ExecutionConfig.use()
            raise ValueError(f"remat_group {scan.remat_group} does not divide num_layers {c.num_layers}")
        if scan.remat != "none":
            layer = jax.checkpoint(layer, policy=REMAT_POLICIES[scan.remat])
        if scan.remat != "none" and scan.remat_group > 1:
            x, ys = grouped_scan(layer, x, params, scan.remat_group, scan.scan_unroll)
        else:
            x, ys = jax.lax.scan(layer, x, params, unroll=scan.scan_unroll)
        if leave:
            x = make_update(*x)
        entropy, weights, residual, diag = ys[:4]  # [layers, B, T], [layers, B, T, L], [layers, B], [layers, B]
        h = self.collapse(x, streams_axis=0)  # [B, T, D]
        maps = None
        if return_residual_maps:  # [layers, 2, B, T, n, n] → [B, 2·layers, T, n, n]
            maps = rearrange(ys[4], "layers s b t i j -> b (layers s) t i j")
        entropy = jnp.mean(entropy, axis=0)
        choice = choice_mask(seq, c.block_sizes)  # entropy is 0 elsewhere
        aux = jnp.sum(entropy, axis=-1) / max(int(choice.sum()), 1)
        return h, ModelOutput(logits=h, aux_loss=aux, entropy=entropy, scale_weights=jnp.mean(weights, axis=(0, 2)),
                              layer_weights=rearrange(weights, "layers b t l -> b layers t l"),
                              nash_residual=jnp.max(residual, axis=0), res_diag=jnp.mean(diag, axis=0),
                              residual_maps=maps)


def param_counts(config: ModelConfig) -> dict[str, int]:
    """Parameters of the model of ``config`` by declared role (:data:`nash_mhc.params.ROLES`), counted on its
    abstract leaves (nothing is allocated)."""
    model = eqx.filter_eval_shape(LanguageModel, config, key=jax.random.key(0))
    counts = dict.fromkeys(ROLES, 0)
    for _path, leaf, decl in declared_parameters(model):
        counts[decl.role.name] += int(np.prod(leaf.shape))
    return counts


def num_params(config: ModelConfig) -> int:
    """All parameters of the model of ``config``."""
    return sum(param_counts(config).values())


def describe(config: ModelConfig) -> str:
    """One-line human summary used by the CLIs."""
    return (f"d={config.d_model} layers={config.num_layers} heads={config.num_heads} "
            f"streams={config.num_streams} scales={config.num_scales}(r={config.compression_ratio}) "
            f"residual={config.residual} attention={config.attention} aggregation={config.aggregation} "
            f"params={num_params(config) / 1e6:.2f}M flops/token={config.flops_per_token() / 1e6:.1f}M "
            f"dtype={config.dtype}")
