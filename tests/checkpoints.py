"""Test helper: write a training checkpoint (state + the metadata the programs read) without a training run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nash_mhc.training.checkpoint import Checkpointer


def write_checkpoint(directory: Path, step: int, state: Any, model_config: Any, train_config: Any) -> dict:
    """Save ``state`` as step ``step`` of a ``synthetic``/``bytes`` run in ``directory``; returns its metadata."""
    meta = {"step": step, "data": {"dataset": "synthetic", "tokenizer": "bytes"}, "rng": {"seed": 0},
            "model_config": model_config.to_dict(), "train_config": train_config.to_dict()}
    checkpointer = Checkpointer(directory)
    checkpointer.save(step, state, meta)
    checkpointer.wait()
    checkpointer.close()
    return meta
