"""Benchmark helpers: compile outside the timed region, block until device work is done, one peak probe."""

from __future__ import annotations

import jax
import pytest

from nash_mhc import ModelConfig, TrainConfig, make_mesh
from nash_mhc.training import Batch, init_train_state, train_step
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


@pytest.fixture
def train_throughput(benchmark, peak_flops):
    """Time ``train_step`` of ``config`` on one device (compile outside the timed region) and record
    tokens/s and MFU (against the measured peak) in ``benchmark.extra_info``; returns (tokens/s, MFU)."""

    def run(config: ModelConfig, label: str, *, batch_size: int = 8, rounds: int = 5) -> tuple[float, float]:
        train_config = TrainConfig(batch_size=batch_size, warmup_steps=1, total_steps=1000)
        mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
        holder = {"state": init_train_state(config, train_config, mesh, key=jax.random.key(0))}
        tokens = jax.random.randint(jax.random.key(1), (batch_size, config.seq_len + 1), 0, config.vocab_size)
        batch = Batch(tokens=tokens)

        def step():
            holder["state"], metrics = train_step(holder["state"], batch)
            return jax.block_until_ready(metrics)

        step()  # compile outside the timed region
        benchmark.pedantic(step, rounds=rounds, iterations=1, warmup_rounds=1)
        tokens_per_second = batch_size * config.seq_len / benchmark.stats.stats.mean
        mfu = tokens_per_second * config.flops_per_token() / peak_flops
        benchmark.extra_info.update(tokens_per_second=round(tokens_per_second), mfu=round(mfu, 4),
                                    peak_gflops=round(peak_flops / 1e9, 1), d_model=config.d_model)
        print(f"\n{label}: train {tokens_per_second:,.0f} tokens/s, MFU {mfu:.1%} of {peak_flops / 1e9:.0f} GFLOP/s")
        return tokens_per_second, mfu

    return run
