"""Parameter initialisers (all parameters are float32)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

EMBED_STD = 0.02


def normal(key: jax.Array, shape: tuple[int, ...], std: float) -> jax.Array:
    return std * jax.random.normal(key, shape, jnp.float32)


def output_std(num_layers: int) -> float:
    """GPT-2 scaled init for projections that write into the residual: 0.02 / sqrt(2 · layers)."""
    return EMBED_STD / math.sqrt(2 * num_layers)
