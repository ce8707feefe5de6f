"""Compile time of the training step: as depth grows (one lax.scan over layers keeps it flat), and the tiny
preset's against its target."""

from __future__ import annotations

import time

import jax
import pytest

from nash_mhc import ModelConfig, TrainConfig, make_mesh
from nash_mhc.study.tpu_estimate import variant_config
from nash_mhc.training import Batch, init_train_state
from nash_mhc.training.step import _train_step_jit

COMPILE_SECONDS: dict[int, float] = {}


def timed_step_compile(benchmark, config: ModelConfig, *, batch_size: int) -> float:
    """Seconds to lower and compile ``config``'s train step on one device from cleared caches (one round),
    recorded as the benchmark's time and its ``compile_seconds``."""
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    state = init_train_state(config, TrainConfig(batch_size=batch_size, warmup_steps=1, total_steps=10), mesh,
                             key=jax.random.key(0))
    batch = Batch(tokens=jax.numpy.zeros((batch_size, config.seq_len + 1), jax.numpy.int32))

    def compile_once() -> float:
        jax.clear_caches()
        start = time.perf_counter()
        _train_step_jit.lower(batch, state).compile()
        return time.perf_counter() - start

    benchmark.pedantic(compile_once, rounds=1, iterations=1)
    seconds = benchmark.stats.stats.mean
    benchmark.extra_info["compile_seconds"] = round(seconds, 2)
    return seconds


@pytest.mark.parametrize("depth", [4, 12, 24])
def test_step_compile_time(benchmark, depth):
    # one layer per scan iteration (no ExecutionConfig in force: scan_unroll 1): what keeps compile time flat in
    # depth (small's training default unrolls 4 layers)
    config = ModelConfig.preset("small", num_layers=depth)
    COMPILE_SECONDS[depth] = timed_step_compile(benchmark, config, batch_size=8)
    if 4 in COMPILE_SECONDS:
        ratio = COMPILE_SECONDS[depth] / COMPILE_SECONDS[4]
        benchmark.extra_info["ratio_to_depth_4"] = round(ratio, 3)
        print(f"\ndepth {depth}: compile {COMPILE_SECONDS[depth]:.1f}s ({ratio:.2f}x depth 4)")


TINY_COMPILE_TARGET_SECONDS = 60.0


# the study variants (nash_mhc.study.variants) from the plainest up to the tiny preset's own, mhc + multiscale +
# nash: where the compile goes
TINY_VARIANTS = ["plain+full", "mhc+full", "mhc+convex", "mhc+nash"]


@pytest.mark.parametrize("variant", TINY_VARIANTS)
def test_tiny_step_compile_time(benchmark, variant):
    # the laptop preset's whole train step (forward, backward, optimizer) compiles within a minute on a 2-core CPU,
    # in each variant; a target, so it lives here and not in the unit tests, where a loaded machine would fail it
    config = variant_config("tiny", variant)
    seconds = timed_step_compile(benchmark, config, batch_size=4)
    benchmark.extra_info["target_seconds"] = TINY_COMPILE_TARGET_SECONDS
    print(f"\ntiny {variant} train step: compile {seconds:.1f}s (target {TINY_COMPILE_TARGET_SECONDS:.0f}s)")
    assert seconds < TINY_COMPILE_TARGET_SECONDS, f"tiny {variant} train step took {seconds:.1f}s to compile"
