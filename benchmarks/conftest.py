"""Benchmark helpers: compile outside the timed region, block until device work is done, MFU per benchmark."""

from __future__ import annotations

import jax
import pytest

from nash_mhc import ModelConfig, TrainConfig, make_mesh
from nash_mhc.training import Batch, init_train_state, train_step
from nash_mhc.training.throughput import MFUMeter


@pytest.fixture
def timed(benchmark):
    """Run ``fn(*args)`` under pytest-benchmark after one warm-up (compile) call."""

    def run(fn, *args, rounds: int = 5):
        jax.block_until_ready(fn(*args))
        return benchmark.pedantic(lambda: jax.block_until_ready(fn(*args)), rounds=rounds, iterations=1)

    return run


@pytest.fixture
def train_throughput(benchmark):
    """Time ``train_step`` of ``config`` on one device (compile and one warm-up step outside the timed region)
    and record tokens/s and MFU in ``benchmark.extra_info``; returns (tokens/s, MFU).

    MFU is :class:`nash_mhc.training.throughput.MFUMeter`'s, as in the training logs: the mean round time over
    one peak per device and dtype (on a device without a table peak, the best of a steady matmul probe,
    measured once per session, before the first step, as the training program measures it once per run).
    """

    def run(config: ModelConfig, label: str, *, batch_size: int = 8, rounds: int = 5) -> tuple[float, float]:
        train_config = TrainConfig(batch_size=batch_size, warmup_steps=1, total_steps=1000)
        device = jax.devices()[0]
        meter = MFUMeter.for_device(config.flops_per_token(), 1, device=device, dtype=config.dtype)
        mesh = make_mesh(1, 1, 1, devices=[device])
        holder = {"state": init_train_state(config, train_config, mesh, key=jax.random.key(0))}
        tokens = jax.random.randint(jax.random.key(1), (batch_size, config.seq_len + 1), 0, config.vocab_size)
        batch = Batch(tokens=tokens)

        def step():
            holder["state"], metrics = train_step(holder["state"], batch)
            return jax.block_until_ready(metrics)

        step()  # compile
        step()  # warm-up
        benchmark.pedantic(step, rounds=rounds, iterations=1)
        figures = meter.report(batch_size * config.seq_len, benchmark.stats.stats.mean)
        benchmark.extra_info.update(tokens_per_second=round(figures["tokens_per_second"]),
                                    mfu=round(figures["mfu"], 4), d_model=config.d_model,
                                    peak_gflops=round(meter.peak / 1e9, 1))
        print(f"\n{label}: train {figures['tokens_per_second']:,.0f} tokens/s, MFU {figures['mfu']:.1%} of "
              f"{meter.peak / 1e9:,.0f} GFLOP/s ({meter.source})")
        return figures["tokens_per_second"], figures["mfu"]

    return run
