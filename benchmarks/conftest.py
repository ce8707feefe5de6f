"""Benchmark helpers: compile outside the timed region, block until device work is done, one peak probe."""

from __future__ import annotations

import jax
import pytest

from nash_mhc.training.throughput import probe_peak


@pytest.fixture
def timed(benchmark):
    """Run ``fn(*args)`` under pytest-benchmark after one warm-up (compile) call."""

    def run(fn, *args, rounds: int = 5):
        jax.block_until_ready(fn(*args))
        return benchmark.pedantic(lambda: jax.block_until_ready(fn(*args)), rounds=rounds, iterations=1)

    return run


@pytest.fixture(scope="session")
def peak_flops() -> float:
    """float32 matmul FLOP/s of one device, measured once per session (the MFU denominator on CPU)."""
    return probe_peak()
