"""One training run of a study, driven through the package's programs in child processes.

A run lives in one directory: ``train/`` is the training program's ``--checkpoint-dir`` (checkpoints,
``metrics.jsonl``, ``config.json``), ``train.log`` / ``eval.log`` are the children's output, ``sessions.jsonl``
has one line per child (program, exit code, wall seconds) and ``evals/<name>.json`` holds each finished
evaluation. Every step is idempotent: training to a step the metrics already reached starts no child, a
written evaluation is read back, so a study rerun after a crash or a signal continues where it stopped (the
training program itself resumes from its latest checkpoint).
"""

from __future__ import annotations

import contextlib
import io
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from nash_mhc.study.runner import ChildRunner, StudyError, python_module, read_json, write_json

EXIT_NONFINITE = 3  # the training program's exit code for a loss that stayed non-finite
EVAL_WINDOW_SEED = 0  # every study evaluation reads the held-out windows in this one order (any run seed)


class Stopped(Exception):
    """A signal stopped the study while this run's child was working (rerun the study to continue)."""


class Diverged(Exception):
    """The training program gave up on a loss that stayed non-finite (a result, not an error)."""


class Failed(Exception):
    """A child failed for another reason; the message names its log."""


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Training records of ``metrics.jsonl`` (those with a loss), one per step: a step logged again after a
    resume keeps its latest record."""
    if not path.exists():
        return []
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line) if line.strip() else {}
        if "loss" in record:
            by_step[int(record["step"])] = record
    return [by_step[step] for step in sorted(by_step)]


def median_step_time(records: list[dict[str, Any]]) -> float | None:
    """Median seconds per step over the logged windows that timed one (a session's first step is its compile
    and logs none)."""
    times = [r["step_time_s"] for r in records if r.get("step_time_s") is not None]
    return float(np.median(times)) if times else None


def travel(records: list[dict[str, Any]]) -> dict[str, float]:
    """``{group: RMS distance from initialisation}`` of the last record that logs ``travel/<group>`` (none for a
    model without coefficient groups, e.g. plain + full)."""
    for record in reversed(records):
        groups = {k.removeprefix("travel/"): float(v) for k, v in record.items() if k.startswith("travel/")}
        if groups:
            return groups
    return {}


def resolved_configs(command: list[str]) -> Any:
    """The :class:`~nash_mhc.run_config.RunConfig` a ``python -m nash_mhc.train`` command builds (its flags parsed
    by the training program's own parser; the model's vocabulary from its tokenizer, as training sets it); a
    StudyError when the program would reject them."""
    from nash_mhc import train

    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):  # the parser's own one-line error becomes the StudyError's
            configs, _ = train.configs(command[3:])  # drop [python, -m, nash_mhc.train]
        return configs.replace(model=configs.model.replace(vocab_size=configs.data.load_tokenizer().vocab_size))
    except (ValueError, OSError) as error:
        raise StudyError(f"the training program would reject the runs' flags: {error}") from None
    except SystemExit:
        message = said.getvalue().strip().removeprefix("error: ")
        raise StudyError(f"the training program would reject the runs' flags: {message}") from None


class ChildRun:
    """The directory of one run and the children that bring it forward (see the module docstring)."""

    def __init__(self, directory: Path, runner: ChildRunner, name: str) -> None:
        self.directory, self.runner, self.name = directory, runner, name
        self.checkpoint_dir = directory / "train"

    def records(self) -> list[dict[str, Any]]:
        return read_metrics(self.checkpoint_dir / "metrics.jsonl")

    def last_step(self) -> int:
        records = self.records()
        return records[-1]["step"] if records else 0

    def sessions(self) -> list[dict[str, Any]]:
        path = self.directory / "sessions.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def _session(self, program: str, code: int, wall: float) -> None:
        with open(self.directory / "sessions.jsonl", "a") as file:
            file.write(json.dumps({"program": program, "exit_code": code, "wall_s": wall, "time": time.time()})
                       + "\n")

    def _rejected(self, log: Path, program: str) -> StudyError:
        lines = log.read_text().strip().splitlines() if log.exists() else []
        return StudyError(f"the {program} program rejected the run's flags: {lines[-1] if lines else '?'}")

    def train(self, command: list[str], until: int) -> None:
        """Run ``command`` (a ``python -m nash_mhc.train`` line with ``--total-steps until``) unless the metrics
        already reach ``until``. Raises Diverged, Stopped, Failed, or StudyError for flags it rejects."""
        if self.last_step() >= until:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        log = self.directory / "train.log"
        code, wall, _ = self.runner.run(command, log)
        self._session("train", code, wall)
        if code == EXIT_NONFINITE:
            raise Diverged(f"{self.name}: the loss stayed non-finite, see {log}")
        if code == 2:
            raise self._rejected(log, "training")
        if code != 0:
            raise Failed(f"{self.name}: training exited {code}, see {log}")
        if self.last_step() < until:
            if self.runner.stopped:
                raise Stopped(self.name)
            raise Failed(f"{self.name}: training stopped at step {self.last_step()} of {until}, see {log}")

    def evaluate(self, name: str, step: int, *, first_batch: int, num_batches: int, batch_size: int,
                 compile_cache_dir: str) -> dict[str, Any]:
        """Held-out evaluation ``name`` of the checkpoint at ``step``: batches [first_batch, first_batch +
        num_batches) of the held-out pass in the fixed window order (:data:`EVAL_WINDOW_SEED`), written to
        ``evals/<name>.json`` (read back when it exists). A pass too short for the range is a StudyError."""
        path = self.directory / "evals" / f"{name}.json"
        if path.exists():
            return read_json(path)
        command = python_module("nash_mhc.evaluate", "--checkpoint-dir", self.checkpoint_dir, "--step", step,
                                "--first-batch", first_batch, "--num-batches", num_batches, "--batch-size",
                                batch_size, "--window-seed", EVAL_WINDOW_SEED, "--compile-cache-dir",
                                compile_cache_dir)
        log = self.directory / "eval.log"
        code, wall, stdout = self.runner.run(command, log, capture=True)
        self._session("evaluate", code, wall)
        if code == 2 and not self.runner.stopped:
            raise self._rejected(log, "evaluation")
        lines = stdout.strip().splitlines()
        result = json.loads(lines[-1]) if code == 0 and lines else None
        if result is None:
            if self.runner.stopped:
                raise Stopped(self.name)
            raise Failed(f"{self.name}: evaluation exited {code}, see {log}")
        if result.get("step") != step or result.get("batches") != num_batches:
            raise StudyError(f"{self.name}: evaluation {name} read {result.get('batches')} batches at step "
                             f"{result.get('step')}, asked for {num_batches} at step {step}: the held-out part is "
                             "too short for the evaluation batches asked for (fewer batches or a smaller batch)")
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, result)
        return result

    def wall_s(self) -> float:
        return sum(s["wall_s"] for s in self.sessions())
