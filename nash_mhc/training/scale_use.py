"""Scale use: how much of each layer's attention output every scale carries, the prior's share and the used
weights' distance from it, in every logged training step and every evaluation.

Only a model with several attention scales (``attention="multiscale"``, ``num_scales`` > 1) has them. Names
(flat, so ``metrics.jsonl`` stays one level deep; layers i count from 0, scales l from 0 = the finest):

* ``scale_weight/<l>``, ``scale_weight/layer<i>/<l>``: the mean weight w_l that the aggregation (nash, gate or
  convex) gave scale l, averaged over layers, and in layer i;
* ``scale_prior/<l>``, ``scale_prior/layer<i>/<l>``: the same of the prior p = softmax(b) over the available
  scales (the aggregation's learned prior logits b: the game's and the gate's start, the convex weights
  themselves);
* ``scale_tv``, ``scale_tv/layer<i>``: the mean total variation distance 1/2 Σ_l |w_l - p_l| of the weights from
  the prior (0 for convex).

Convention: every mean is over the positions that count, each weighed by its loss mask, and a scale that is not
available at a position (no complete block there yet) counts with weight 0 at it, as the aggregation gives it. So
each layer's ``scale_weight`` (and ``scale_prior``) sums to 1 over the scales: the share of the layer's attention
output that each scale carries, the early positions where coarse scales are missing included.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from nash_mhc.model import LanguageModel
from nash_mhc.ops.game import prior_weights
from nash_mhc.ops.multiscale import available_mask

Sums = dict[str, jax.Array]


def scale_use_sums(layer_weights: Float[Array, "batch layers seq scales"], mask: Float[Array, "batch seq"],
                   model: LanguageModel) -> Sums:
    """The mask-weighted sums behind :func:`scale_use_metrics`, which add up over microbatches and batches:
    ``count`` Σ mask, ``weight`` and ``prior`` [layers, L] Σ mask · w (p), ``tv`` [layers] Σ mask · TV(w, p).
    ``layer_weights`` is the forward's (``ModelOutput.layer_weights``). Empty for a model with one scale."""
    aggregation = model.blocks.attn.aggregation
    if aggregation is None:
        return {}
    seq = mask.shape[-1]
    available = jnp.asarray(np.stack([available_mask(seq, s) for s in model.config.block_sizes], axis=-1))
    prior = jax.vmap(prior_weights, in_axes=(0, None))(aggregation.prior.astype(jnp.float32), available)
    weights, mask = layer_weights.astype(jnp.float32), mask.astype(jnp.float32)  # [B, layers, T, L], [B, T]
    tv = 0.5 * jnp.sum(jnp.abs(weights - prior), axis=-1)  # [B, layers, T]
    sums = {"count": jnp.sum(mask), "weight": jnp.einsum("bt,bitl->il", mask, weights),
            "prior": jnp.einsum("t,itl->il", jnp.sum(mask, axis=0), prior), "tv": jnp.einsum("bt,bit->i", mask, tv)}
    return jax.lax.stop_gradient(sums)


def scale_use_metrics(sums: Sums) -> dict[str, Float[Array, ""]]:
    """The named scalar metrics (module docstring) of :func:`scale_use_sums`' sums (those of one batch, or added
    up over several); empty for a model with one scale."""
    if not sums:
        return {}
    count = jnp.where(sums["count"] > 0, sums["count"], 1.0)
    metrics = {}
    for name in ("weight", "prior"):
        per_layer = sums[name] / count  # [layers, L]
        mean = jnp.mean(per_layer, axis=0)
        metrics.update({f"scale_{name}/{level}": mean[level] for level in range(per_layer.shape[1])})
        metrics.update({f"scale_{name}/layer{i}/{level}": per_layer[i, level] for i in range(per_layer.shape[0])
                        for level in range(per_layer.shape[1])})
    tv = sums["tv"] / count
    metrics["scale_tv"] = jnp.mean(tv)
    metrics.update({f"scale_tv/layer{i}": tv[i] for i in range(tv.shape[0])})
    return metrics
