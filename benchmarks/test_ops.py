"""Micro-benchmarks of the mHC and aggregation ops across stream counts and batch sizes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from nash_mhc import ModelConfig
from nash_mhc.ops import nash_weights, sinkhorn


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("tokens", [1024, 16384])
def test_sinkhorn(benchmark, timed, n, tokens):
    logits = jax.random.normal(jax.random.key(0), (tokens, n, n))
    project = jax.jit(sinkhorn)
    timed(project, logits, rounds=20)
    benchmark.extra_info["matrices_per_second"] = round(tokens / benchmark.stats.stats.mean)


@pytest.mark.parametrize("spread", ["narrow", "wide"])
@pytest.mark.parametrize("tokens", [2048, 16384])
def test_sinkhorn_forward_backward(benchmark, timed, tokens, spread):
    """A gradient through n = 4 Sinkhorn (20 rounds), one jitted program: logits of std 1 ("narrow", about mHC's
    at initialisation) or std 100 ("wide", all but permutation matrices)."""
    scale = {"narrow": 1.0, "wide": 100.0}[spread]
    logits = scale * jax.random.normal(jax.random.key(0), (tokens, 4, 4))
    weights = jax.random.normal(jax.random.key(1), (tokens, 4, 4))
    gradient = jax.jit(jax.grad(lambda z: jnp.sum(sinkhorn(z) * weights)))
    timed(gradient, logits, rounds=20)
    benchmark.extra_info["matrices_per_second"] = round(tokens / benchmark.stats.stats.mean)


@pytest.mark.parametrize("scales", [2, 4])
@pytest.mark.parametrize("tokens", [1024, 8192])
def test_nash_aggregation(benchmark, timed, scales, tokens):
    dim = 256
    outputs = list(jax.random.normal(jax.random.key(0), (scales, tokens, dim)))  # the L outputs, one array each
    available = jnp.ones((tokens, scales), bool)
    prior = jnp.zeros((scales,))
    weights = jax.jit(functools.partial(nash_weights, num_iters=ModelConfig().nash_iters))
    timed(weights, outputs, available, prior, jnp.asarray(0.1), rounds=20)
    benchmark.extra_info["positions_per_second"] = round(tokens / benchmark.stats.stats.mean)
