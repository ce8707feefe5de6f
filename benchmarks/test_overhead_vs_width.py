"""Train-step tokens/s of ``small`` widened to d_model 512, plain+full and mhc+multiscale.

Compared with the d_model 256 rows of ``test_train_step.py`` it shows how the mHC + multiscale overhead and
the MFU move with width (the README's explanation of the targets uses both).
"""

from __future__ import annotations

import jax
import pytest

from nash_mhc import ModelConfig, TrainConfig, make_mesh
from nash_mhc.training import Batch, init_train_state, train_step

BATCH = 8
WIDTH = 512


@pytest.mark.parametrize("residual, attention", [("plain", "full"), ("mhc", "multiscale")])
def test_train_step_at_width_512(benchmark, peak_flops, residual, attention):
    config = ModelConfig.preset("small", d_model=WIDTH, num_heads=WIDTH // 64, residual=residual,
                                attention=attention)
    train_config = TrainConfig(batch_size=BATCH, warmup_steps=1, total_steps=1000)
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    holder = {"state": init_train_state(config, train_config, mesh, key=jax.random.key(0))}
    tokens = jax.random.randint(jax.random.key(1), (BATCH, config.seq_len + 1), 0, config.vocab_size)
    batch = Batch(tokens=tokens)

    def step():
        holder["state"], metrics = train_step(holder["state"], batch)
        return jax.block_until_ready(metrics)

    step()  # compile outside the timed region
    benchmark.pedantic(step, rounds=3, iterations=1, warmup_rounds=1)
    tokens_per_second = BATCH * config.seq_len / benchmark.stats.stats.mean
    mfu = tokens_per_second * config.flops_per_token() / peak_flops
    benchmark.extra_info.update(tokens_per_second=round(tokens_per_second), mfu=round(mfu, 4), d_model=WIDTH)
    print(f"\nsmall d_model={WIDTH} {residual}+{attention}: train {tokens_per_second:,.0f} tokens/s, "
          f"MFU {mfu:.1%} of {peak_flops / 1e9:.0f} GFLOP/s")
