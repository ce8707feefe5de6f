"""AdamW with linear warmup + cosine decay, global-norm clipping and matrices-only weight decay.

The whole chain is wrapped in ``optax.inject_hyperparams`` so the learning rate of the step just taken is
readable from the state: ``opt_state.hyperparams["learning_rate"]`` (see :func:`current_learning_rate`).
"""

from __future__ import annotations

import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int, PyTree

from nash_mhc.sharding import path_str
from nash_mhc.training.config import TrainConfig

# Leaves that receive weight decay: the matmul weights (attention, FFN, the mHC projection Φ, an untied LM
# head). Not decayed: the embedding (tied or not), RMSNorm gains, mHC α scalars and b biases, the
# downsampling kernels and the aggregation prior. Matched at the end of the attribute path.
DECAY_PATTERNS = (
    r"attn\.w[qkvo]",
    r"ffn\.w_(?:gate|up|down)",
    r"\w*hc\.phi",
    r"head",
)
_DECAY = tuple(re.compile(r"(?:^|\.)" + pattern + r"$") for pattern in DECAY_PATTERNS)


def is_decayed(path: str) -> bool:
    return any(pattern.search(path) for pattern in _DECAY)


def decay_mask(params: PyTree) -> PyTree:
    """True for leaves that get weight decay (see :data:`DECAY_PATTERNS`), False elsewhere."""
    return jax.tree_util.tree_map_with_path(lambda path, _: is_decayed(path_str(path)), params)


def make_schedule(config: TrainConfig) -> optax.Schedule:
    """Learning rate at optimizer step ``count`` (0-based).

    Linear warmup ``lr·(count+1)/warmup`` for ``count < warmup_steps`` (the first update is not wasted at
    lr = 0), then cosine from ``lr`` to ``lr·min_lr_ratio`` at ``total_steps``, constant afterwards.
    """
    peak = float(config.learning_rate)
    floor = peak * float(config.min_lr_ratio)
    warmup = int(config.warmup_steps)
    decay = max(int(config.lr_schedule_steps) - warmup, 1)

    def schedule(count: Int[Array, ""] | int) -> Float[Array, ""]:
        step = jnp.asarray(count, jnp.float32)
        warm = peak * (step + 1.0) / max(warmup, 1)
        progress = jnp.clip((step - warmup) / decay, 0.0, 1.0)
        cosine = floor + (peak - floor) * 0.5 * (1.0 + jnp.cos(math.pi * progress))
        return jnp.where(step < warmup, warm, cosine)

    return schedule


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """clip_by_global_norm → AdamW(β1, β2, eps, decoupled weight decay on matrices), lr by schedule."""

    def chain(learning_rate: Any) -> optax.GradientTransformation:
        parts = []
        if config.grad_clip > 0:
            parts.append(optax.clip_by_global_norm(config.grad_clip))
        parts.append(optax.adamw(learning_rate, b1=config.beta1, b2=config.beta2, eps=config.eps,
                                 weight_decay=config.weight_decay, mask=decay_mask))
        return optax.chain(*parts)

    return optax.inject_hyperparams(chain)(learning_rate=make_schedule(config))


def current_learning_rate(opt_state: PyTree) -> Float[Array, ""]:
    """The learning rate the last update used (inject_hyperparams stores it in the state)."""
    return jnp.asarray(opt_state.hyperparams["learning_rate"], jnp.float32)
