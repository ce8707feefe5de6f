"""The study's imperative shell: child processes, signals, an output-directory lock, JSON files.

A study runs the package's own programs (``python -m nash_mhc.train`` / ``nash_mhc.evaluate``) one at a
time as child processes, each writing to its own log file. A SIGTERM or SIGINT received by the study is
forwarded to the running child as SIGTERM (the training program then finishes its step, saves a checkpoint
and exits 0) and no further child is started: rerunning the same command continues from the checkpoints.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np


class StudyError(ValueError):
    """A problem a user can fix (bad flags, an output directory of another study): one line, exit 2."""


class ChildRunner:
    """Runs commands one at a time; ``stopped`` turns True once the study received SIGTERM/SIGINT."""

    def __init__(self) -> None:
        self.stopped = False
        self._child: subprocess.Popen | None = None
        self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum: int, _frame: Any) -> None:
        self.stopped = True
        if self._child is not None and self._child.poll() is None:
            self._child.send_signal(signal.SIGTERM)

    def run(self, argv: list[str], log_path: Path, *, capture: bool = False) -> tuple[int, float, str]:
        """Run ``argv`` with its output appended to ``log_path``: (exit code, wall seconds, stdout).

        ``capture=True`` also returns the child's stdout (written to the log once it exited); otherwise the
        log follows the child live and the returned stdout is empty.
        """
        start = time.perf_counter()
        with open(log_path, "a") as log:
            log.write(f"$ {shlex.join(argv)}\n")
            log.flush()
            self._child = subprocess.Popen(argv, stdout=subprocess.PIPE if capture else log, stderr=log, text=True)
            if self.stopped:  # a signal that arrived while the child was being started
                self._child.send_signal(signal.SIGTERM)
            try:
                stdout, _ = self._child.communicate()
            finally:
                code, self._child = self._child.wait(), None
            log.write(stdout or "")
        return code, time.perf_counter() - start, stdout or ""

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def python_module(module: str, *args: Any) -> list[str]:
    """``[python, -m, module, *args]`` with the interpreter running the study."""
    return [sys.executable, "-m", module, *map(str, args)]


class DirectoryLock:
    """An exclusive lock on ``<directory>/.lock`` so two studies never write the same runs at once."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self._file = open(directory / ".lock", "w")  # noqa: SIM115 - held until release()
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise StudyError(f"{directory} is in use by another study process") from None

    def release(self) -> None:
        fcntl.flock(self._file, fcntl.LOCK_UN)
        self._file.close()


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as JSON atomically (a temporary file renamed over ``path``)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=_plain) + "\n")
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def check_settings(out: Path, settings: dict[str, Any]) -> None:
    """Record a study's shared settings in ``<out>/study.json``, or check that a rerun agrees with them
    (runs made under other settings must not be mixed into one table)."""
    path = out / "study.json"
    current = json.loads(json.dumps(settings))  # tuples as lists, as stored
    if path.exists():
        stored = read_json(path)["settings"]
        differ = sorted(k for k in set(stored) | set(current) if stored.get(k) != current.get(k))
        if differ:
            detail = ", ".join(f"{k}: {stored.get(k)!r} there vs {current.get(k)!r} now" for k in differ)
            raise StudyError(f"{out} holds a study with other settings ({detail}); use another --out-dir")
    else:
        write_json(path, {"settings": current})


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof 1; NaN for fewer than two values)."""
    if not values:
        return math.nan, math.nan
    array = np.asarray(values, dtype=np.float64)
    return float(array.mean()), float(array.std(ddof=1)) if len(array) > 1 else math.nan


def pm(mean: float, std: float, digits: int = 3) -> str:
    """``mean ± std`` for a markdown cell (``mean`` alone when std is undefined)."""
    if math.isnan(mean):
        return "n/a"
    return f"{mean:.{digits}f}" if math.isnan(std) else f"{mean:.{digits}f} ± {std:.{digits}f}"


@contextmanager
def study_directory(out: Path, settings: dict[str, Any]) -> Iterator[None]:
    """Hold ``out``'s lock while a study writes there, after recording or checking its shared ``settings``."""
    lock = DirectoryLock(out)
    try:
        check_settings(out, settings)
        yield
    finally:
        lock.release()
