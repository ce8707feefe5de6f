"""AdamW with linear warmup + cosine decay, global-norm clipping, weight decay and learning-rate groups by role.

The whole chain is wrapped in ``optax.inject_hyperparams`` so the learning rate of the step just taken is
readable from the state: ``opt_state.hyperparams["learning_rate"]`` (see :func:`current_learning_rate`).
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int, PyTree

from nash_mhc.params import role_mask
from nash_mhc.training.config import TrainConfig


def decay_mask(params: PyTree) -> PyTree:
    """True for the leaves whose declared role takes weight decay (the matmul weights and an untied LM head;
    :mod:`nash_mhc.params`), False elsewhere."""
    return role_mask(params, lambda decl: decl.role.decay)


def coefficient_mask(params: PyTree) -> PyTree:
    """True for the leaves of the coefficient learning-rate group (declared role ``coefficient``)."""
    return role_mask(params, lambda decl: decl.role.coefficient)


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
    """clip_by_global_norm → AdamW(β1, β2, eps, decoupled weight decay on the decayed roles), lr by schedule, then
    the coefficient group's updates × ``coefficient_lr_scale`` (its parameters take no weight decay, so this is
    AdamW at ``coefficient_lr_scale`` × the learning rate for them)."""

    def chain(learning_rate: Any) -> optax.GradientTransformation:
        parts = []
        if config.grad_clip > 0:
            parts.append(optax.clip_by_global_norm(config.grad_clip))
        parts.append(optax.adamw(learning_rate, b1=config.beta1, b2=config.beta2, eps=config.eps,
                                 weight_decay=config.weight_decay, mask=decay_mask))
        parts.append(optax.masked(optax.scale(config.coefficient_lr_scale), coefficient_mask))
        return optax.chain(*parts)

    return optax.inject_hyperparams(chain)(learning_rate=make_schedule(config))


def current_learning_rate(opt_state: PyTree) -> Float[Array, ""]:
    """The learning rate the last update used (inject_hyperparams stores it in the state)."""
    return jnp.asarray(opt_state.hyperparams["learning_rate"], jnp.float32)
