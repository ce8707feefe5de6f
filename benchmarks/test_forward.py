"""Forward-pass throughput of the model presets (tokens/s in ``extra_info``)."""

from __future__ import annotations

import jax
import pytest

from nash_mhc import LanguageModel, ModelConfig

BATCH = 8


@pytest.mark.parametrize("preset", ["tiny", "small"])
@pytest.mark.parametrize("residual, attention", [("plain", "full"), ("mhc", "multiscale")])
def test_forward_tokens_per_second(benchmark, timed, preset, residual, attention):
    config = ModelConfig.preset(preset, residual=residual, attention=attention)
    model = LanguageModel(config, key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (BATCH, config.seq_len), 0, config.vocab_size)
    forward = jax.jit(lambda m, t: m(t).logits)
    timed(forward, model, tokens)
    tokens_per_second = BATCH * config.seq_len / benchmark.stats.stats.mean
    benchmark.extra_info["tokens_per_second"] = round(tokens_per_second)
    print(f"\n{preset} {residual}+{attention}: forward {tokens_per_second:,.0f} tokens/s")
