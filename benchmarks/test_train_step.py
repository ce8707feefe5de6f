"""Train-step throughput and MFU of ``tiny`` and ``small`` in the four residual × attention modes.

MFU = tokens/s × ``ModelConfig.flops_per_token()`` (6·N_matmul + causal attention per scale) ÷ the peak of
``nash_mhc.training.throughput.MFUMeter`` (on a CPU the best of a steady matmul probe, measured once per
session, as the training program measures it once per run).
"""

from __future__ import annotations

import pytest

from nash_mhc import ModelConfig

MODES = [("plain", "full"), ("plain", "multiscale"), ("mhc", "full"), ("mhc", "multiscale")]


@pytest.mark.parametrize("preset", ["tiny", "small"])
@pytest.mark.parametrize("residual, attention", MODES)
def test_train_step_tokens_per_second(train_throughput, preset, residual, attention):
    config = ModelConfig.preset(preset, residual=residual, attention=attention)
    train_throughput(config, f"{preset} {residual}+{attention}", rounds=5 if preset == "small" else 10)
