"""Causal multiscale attention (MAHA made causal), with ``full`` (scale 0 only) as the baseline."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from beartype import beartype
from jaxtyping import Array, Float, Int, jaxtyped

from nash_mhc.config import SCALE0_PRIOR_WEIGHT
from nash_mhc.layers.aggregation import ScaleAggregation
from nash_mhc.layers.init import EMBED_STD, normal, output_std
from nash_mhc.ops.attention import attend
from nash_mhc.ops.multiscale import (
    downsample,
    downsample_heads_levels,
    downsample_levels,
    renormalise,
    upsample_shifted,
)
from nash_mhc.ops.rope import rope
from nash_mhc.params import param
from nash_mhc.sharding import constrain_batch


class MultiscaleAttention(eqx.Module):
    """Attention at scales l = 0..L-1 with block sizes s_l = r**l, aggregated per position.

    Scale 0 is causal multi-head attention with RoPE on all T tokens. At scale l ≥ 1 the input and the
    (shared) value projection are downsampled block-wise (kernel = stride = s_l, learned depthwise weights
    initialised to mean pooling); the pooled input is renormalised to unit RMS per coarse token (so coarse
    attention logits start at the fine scale's RMS instead of ~1/s_l of it), queries/keys use that scale's
    own projections and RoPE with spacing s_l, attention is causal over coarse indices, and the result is
    upsampled *shifted*: fine position i reads the last block complete at i. Outputs of the available scales
    are aggregated per position (:class:`ScaleAggregation`, its prior starting at ``scale0_weight`` on scale 0),
    then one output projection is applied.
    Shapes: x [B, T, D] → (y [B, T, D], weights [B, T, L], entropy [B, T], Nash residual [B, T]).
    """

    wq: Float[Array, "scales dim heads head_dim"] = param("matmul", "scales", "embed", "heads", "head_dim")
    wk: Float[Array, "scales dim heads head_dim"] = param("matmul", "scales", "embed", "heads", "head_dim")
    wv: Float[Array, "dim heads head_dim"] = param("matmul", "embed", "heads", "head_dim")
    wo: Float[Array, "heads head_dim dim"] = param("matmul", "heads", "head_dim", "embed")
    down: tuple[Float[Array, "_ dim"], ...] = param("kernel", "block", "embed")
    aggregation: ScaleAggregation | None
    block_sizes: tuple[int, ...] = eqx.field(static=True)
    rope_theta: float = eqx.field(static=True)
    norm_eps: float = eqx.field(static=True)
    dtype: str = eqx.field(static=True)

    def __init__(self, dim: int, num_heads: int, block_sizes: tuple[int, ...], *, num_layers: int,
                 aggregation: str, nash_iters: int, nash_temperature: float, rope_theta: float, dtype: str,
                 key: jax.Array, norm_eps: float = 1e-6, scale0_weight: float = SCALE0_PRIOR_WEIGHT):
        head_dim = dim // num_heads
        scales = len(block_sizes)
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.wq = normal(kq, (scales, dim, num_heads, head_dim), EMBED_STD)
        self.wk = normal(kk, (scales, dim, num_heads, head_dim), EMBED_STD)
        self.wv = normal(kv, (dim, num_heads, head_dim), EMBED_STD)
        self.wo = normal(ko, (num_heads, head_dim, dim), output_std(num_layers))
        self.down = tuple(jnp.full((s, dim), 1.0 / s, jnp.float32) for s in block_sizes[1:])
        self.aggregation = (ScaleAggregation(scales, aggregation, num_iters=nash_iters, temperature=nash_temperature,
                                             dim=dim, scale0_weight=scale0_weight) if scales > 1 else None)
        self.block_sizes = tuple(block_sizes)
        self.rope_theta = rope_theta
        self.norm_eps = norm_eps
        self.dtype = dtype

    # Per-token pieces, shared by the full-sequence forward below and by incremental decoding
    # (nash_mhc.decoding), so both run the same math. Leading axes are batch.
    def values(self, x: Float[Array, "*batch seq dim"]) -> Float[Array, "*batch seq heads head_dim"]:
        """Shared value projection V = x W_v (x already in the compute dtype)."""
        return constrain_batch(jnp.einsum("...d,dhk->...hk", x, self.wv.astype(jnp.dtype(self.dtype))))

    def queries_keys(self, level: int, x: Float[Array, "*batch seq dim"], positions: Int[Array, "seq"] | None = None,
                     num_positions: int | None = None
                     ) -> tuple[Float[Array, "*batch seq heads head_dim"], Float[Array, "*batch seq heads head_dim"]]:
        """RoPE'd queries and keys of scale ``level`` for (coarse) tokens at ``positions`` (default 0..seq-1;
        given, every one below ``num_positions``: :func:`nash_mhc.ops.rope.rope`)."""
        dt = jnp.dtype(self.dtype)
        spacing = self.block_sizes[level]
        q = constrain_batch(jnp.einsum("...d,dhk->...hk", x, self.wq[level].astype(dt)))
        k = constrain_batch(jnp.einsum("...d,dhk->...hk", x, self.wk[level].astype(dt)))
        q = rope(q, spacing=spacing, theta=self.rope_theta, positions=positions, num_positions=num_positions)
        k = rope(k, spacing=spacing, theta=self.rope_theta, positions=positions, num_positions=num_positions)
        return q, k

    def coarse_input(self, level: int, x: Float[Array, "*batch seq dim"]) -> Float[Array, "*batch blocks dim"]:
        """Coarse tokens of scale ``level`` ≥ 1: the block-wise downsampled input, renormalised to unit RMS."""
        down = self.down[level - 1].astype(jnp.dtype(self.dtype))
        return renormalise(downsample(x, down), self.norm_eps)

    def coarse_inputs(self, x: Float[Array, "*batch seq dim"]) -> tuple[Float[Array, "*batch blocks dim"], ...]:
        """:meth:`coarse_input` of every level ≥ 1, downsampled together
        (:func:`nash_mhc.ops.multiscale.downsample_levels`: one kernel call on TPU)."""
        downs = [down.astype(jnp.dtype(self.dtype)) for down in self.down]
        return tuple(renormalise(pooled, self.norm_eps) for pooled in downsample_levels(x, downs))

    def output(self, out: Float[Array, "*batch seq heads head_dim"]) -> Float[Array, "*batch seq dim"]:
        """Output projection of the aggregated heads."""
        dt = jnp.dtype(self.dtype)
        return constrain_batch(jnp.einsum("...hk,hkd->...d", constrain_batch(out.astype(dt)), self.wo.astype(dt)))

    def _scale(self, level: int, x: jax.Array, v: jax.Array) -> jax.Array:
        """Attention output at one scale on its own (coarse) positions: [B, T_l, H, K]."""
        q, k = self.queries_keys(level, x)
        return attend(q, k, v)

    @jaxtyped(typechecker=beartype)
    def __call__(self, x: Float[Array, "*batch seq dim"]) -> tuple[
            Float[Array, "*batch seq dim"], Float[Array, "*batch seq scales"], Float[Array, "*batch seq"],
            Float[Array, "*batch seq"]]:
        """Returns (output, aggregation weights, their normalised entropy, Nash residual) per position.

        The projections run on the whole batch at once (weight gradients are single matmuls over every
        token); only the weight-free attention core is vmapped over sequences. One sequence [T, D] is run as
        a batch of one.
        """
        if x.ndim == 2:
            out, weights, entropy, residual = self(x[None])
            return out[0], weights[0], entropy[0], residual[0]
        dt = jnp.dtype(self.dtype)
        batch, seq, dim = x.shape
        x = x.astype(dt)
        v = self.values(x)
        heads, head_dim = v.shape[-2:]
        fine = self._scale(0, x, v)
        if self.aggregation is None:
            out = fine
            weights = jnp.ones((batch, seq, 1), jnp.float32)
            entropy = residual = jnp.zeros((batch, seq), jnp.float32)
        else:
            # the fine output stays [B, T, H, K]: the Nash kernels read it where attention left it
            outputs, masks = [fine], [jnp.ones((seq,), bool)]
            coarse_v = downsample_heads_levels(v, [down.astype(dt) for down in self.down])
            levels = zip(self.block_sizes[1:], self.coarse_inputs(x), coarse_v, strict=True)
            for level, (block, x_l, v_l) in enumerate(levels, start=1):
                o_l = self._scale(level, x_l, v_l).reshape(batch, -1, dim)
                up, avail = upsample_shifted(o_l, seq, block)
                outputs.append(up)
                masks.append(avail)
            combined, weights, entropy, residual = self.aggregation(outputs, jnp.stack(masks, axis=1))
            out = combined.reshape(batch, seq, heads, head_dim)
        return self.output(out), weights, entropy, residual
