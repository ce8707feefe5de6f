"""Train-step tokens/s of ``small`` widened to d_model 512, plain+full and mhc+multiscale.

Compared with the d_model 256 rows of ``test_train_step.py`` it shows how the mHC + multiscale overhead and
the MFU move with width (the README's explanation of the targets uses both).
"""

from __future__ import annotations

import pytest

from nash_mhc import ModelConfig

WIDTH = 512


@pytest.mark.parametrize("residual, attention", [("plain", "full"), ("mhc", "multiscale")])
def test_train_step_at_width_512(train_throughput, residual, attention):
    config = ModelConfig.preset("small", d_model=WIDTH, num_heads=WIDTH // 64, residual=residual,
                                attention=attention)
    train_throughput(config, f"small d_model={WIDTH} {residual}+{attention}", rounds=3)
