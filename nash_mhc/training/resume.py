"""Where a training run starts from: which checkpoint restores, whether it fits this run, what is set aside.

- :func:`restore_newest` tries the candidate steps newest first and falls back past any that cannot be read or
  restored, saying which steps it skipped and why (a corrupt checkpoint is never deleted).
- :func:`run_identity` is what a checkpoint records of the run besides the model: the tokenizer's content hash,
  the dataset, the learning-rate schedule, and what places the batches (the seed and the sequences per update:
  step ``s`` reads the global batch at ``s x sequences_per_update`` of the seed's order);
  :func:`identity_differences` compares two of them.
- :func:`set_aside` moves the step directories and ``metrics.jsonl`` lines *after* the step a run resumes
  from into ``<dir>/set_aside/<time>/``, so continuing from an older step neither collides with nor silently
  overwrites them, and ``metrics.jsonl`` never holds two lines for one step of one run.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nash_mhc import paths
from nash_mhc.training.checkpoint import CheckpointError

SCHEDULE_FIELDS = ("learning_rate", "min_lr_ratio", "warmup_steps", "lr_schedule_steps")
# Where each step's batch lies in the data: the seed's window order and the global batch (all microbatches, all
# hosts; the accumulation steps and the processes only split it). seq_len is a model field, refused on its own.
BATCH_FIELDS = {"seed": "seed", "sequences_per_update": "batch_size"}
SET_ASIDE = "set_aside"


def absolute_spec(spec: str) -> str:
    """A dataset or tokenizer spec with a local path made absolute (names, URIs and 'bytes' unchanged)."""
    if paths.scheme(spec) is None and spec and Path(spec).expanduser().exists():
        return str(Path(spec).expanduser().resolve())
    return spec


def run_identity(data: Any, tokenizer: Any, train: Any) -> dict[str, Any]:
    """The data, batch order and schedule a run trains on (``data``: DataConfig, ``train``: TrainConfig)."""
    return {"tokenizer": tokenizer.fingerprint, "dataset": absolute_spec(data.dataset),
            "dataset_name": data.dataset_name, "split": data.dataset_split, **data.fields_record(),
            **{name: getattr(train, field) for name, field in BATCH_FIELDS.items()},
            **{name: getattr(train, name) for name in SCHEDULE_FIELDS}}


def identity_differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """``"name: <saved> then, <now> now"`` for each field ``saved`` records whose value changed (a checkpoint
    written before a field was recorded is not compared on it)."""
    return [f"{k}: {saved[k]!r} then, {now[k]!r} now" for k in now if k in saved and saved[k] != now[k]]


def restore_newest(steps: list[int], attempt: Callable[[int], Any], where: str) -> tuple[int, Any, list[str]]:
    """``(step, attempt(step), skipped)`` for the newest of ``steps`` whose ``attempt`` does not raise
    :class:`CheckpointError`; ``skipped`` says why each newer step was passed over. A ValueError that is not a
    CheckpointError (the checkpoint does not fit this run) stops at once."""
    skipped = []
    for step in sorted(steps, reverse=True):
        try:
            return step, attempt(step), skipped
        except CheckpointError as error:
            if len(steps) == 1:
                raise
            skipped.append(f"step {step} ({error})")
    raise CheckpointError(f"no checkpoint in {where} restores: {'; '.join(skipped)}")


def set_aside(directory: paths.Path, after: int, step_dirs: list[int]) -> paths.Path | None:
    """Move ``directory``'s steps > ``after`` and its metrics lines of steps > ``after`` into
    ``<directory>/set_aside/<time>/``; returns that folder, or None when there was nothing to move."""
    newer = sorted(s for s in step_dirs if s > after)
    metrics = directory / "metrics.jsonl"
    keep, later = [], []
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            try:
                step = int(json.loads(line).get("step", 0))
            except (ValueError, AttributeError, TypeError):
                step = 0
            (later if step > after else keep).append(line)
    if not newer and not later:
        return None
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-after-{after}"
    target = paths.fresh(directory) / SET_ASIDE / stamp
    number = 1
    while target.exists():
        number += 1
        target = directory / SET_ASIDE / f"{stamp}-{number}"
    target.mkdir(parents=True)  # a bucket has no folders: nothing happens there until an object is written
    for step in newer:
        paths.move(directory / str(step), target / str(step))
    if later:
        (target / "metrics.jsonl").write_text("\n".join(later) + "\n")
        metrics.write_text("".join(line + "\n" for line in keep))
    return target
