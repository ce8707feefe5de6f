"""Train-step throughput and MFU of ``tiny`` and ``small`` in the four residual × attention modes.

MFU = tokens/s × ``ModelConfig.flops_per_token()`` (6·N_matmul + causal attention per scale) ÷ the float32
matmul peak measured in the same process (``nash_mhc.training.throughput.probe_peak``).
"""

from __future__ import annotations

import jax
import pytest

from nash_mhc import ModelConfig, TrainConfig, make_mesh
from nash_mhc.training import Batch, init_train_state, train_step

MODES = [("plain", "full"), ("plain", "multiscale"), ("mhc", "full"), ("mhc", "multiscale")]
BATCH = 8


@pytest.mark.parametrize("preset", ["tiny", "small"])
@pytest.mark.parametrize("residual, attention", MODES)
def test_train_step_tokens_per_second(benchmark, peak_flops, preset, residual, attention):
    config = ModelConfig.preset(preset, residual=residual, attention=attention)
    train_config = TrainConfig(batch_size=BATCH, warmup_steps=1, total_steps=1000)
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    state = init_train_state(config, train_config, mesh, key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (BATCH, config.seq_len + 1), 0, config.vocab_size)
    batch = Batch(tokens=tokens)
    holder = {"state": state}

    def step():
        holder["state"], metrics = train_step(holder["state"], batch)
        return jax.block_until_ready(metrics)

    step()  # compile outside the timed region
    benchmark.pedantic(step, rounds=5 if preset == "small" else 10, iterations=1, warmup_rounds=1)
    tokens_per_second = BATCH * config.seq_len / benchmark.stats.stats.mean
    mfu = tokens_per_second * config.flops_per_token() / peak_flops
    benchmark.extra_info.update(tokens_per_second=round(tokens_per_second), mfu=round(mfu, 4),
                                peak_gflops=round(peak_flops / 1e9, 1))
    print(f"\n{preset} {residual}+{attention}: train {tokens_per_second:,.0f} tokens/s, MFU {mfu:.1%} "
          f"of {peak_flops / 1e9:.0f} GFLOP/s")
