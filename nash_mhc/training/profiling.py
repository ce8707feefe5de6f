"""``--profile-steps A:B``: a ``jax.profiler`` trace of training steps A..B (inclusive) on process 0.

The trace starts just before step A is dispatched and stops once step B has finished on the device; it is
written under ``<checkpoint-dir>/profile/`` (``plugins/profile/<time>/<host>.xplane.pb``, the layout
TensorBoard's profile plugin and XProf read: ``tensorboard --logdir <checkpoint-dir>/profile`` with
``tensorboard-plugin-profile`` installed, or ``xprof --logdir <checkpoint-dir>/profile``). A bucket directory
gets the trace uploaded when it stops. Steps are counted as the log counts them (the first step is 1; a resumed
run's first step is its checkpoint's + 1); the first step of a run includes compilation, so start at 2 or later
to see steady-state steps. A window that starts before the run's first step or after its last traces nothing,
and one that ends after the last stops there: either says so in a warning at the start of the run.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import jax

from nash_mhc import paths
from nash_mhc.settings import setting

PROFILE_DIR = "profile"


def _parse(text: str) -> tuple[int, int]:
    first, sep, last = text.partition(":")
    try:
        start, stop = int(first), int(last if sep else first)
    except ValueError:
        raise ValueError(f"--profile-steps must be A:B (two step numbers, e.g. 3:5), got {text!r}") from None
    if not 1 <= start <= stop:
        raise ValueError(f"--profile-steps {text}: need 1 <= A <= B (steps count from 1)")
    return start, stop


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
    """Which training steps to trace with the JAX profiler."""

    profile_steps: str | None = setting(None, "A:B: write a jax.profiler trace of steps A to B (inclusive) to "
                                              "<checkpoint-dir>/profile/ (view with TensorBoard's profile plugin "
                                              "or xprof)")

    def __post_init__(self) -> None:
        if self.profile_steps is not None:
            _parse(self.profile_steps)

    @property
    def steps(self) -> tuple[int, int] | None:
        return None if self.profile_steps is None else _parse(self.profile_steps)


def run_window(window: tuple[int, int], start_step: int, total_steps: int) -> tuple[tuple[int, int] | None,
                                                                                   str | None]:
    """(the steps of ``window`` to trace in a run of steps ``start_step`` + 1 to ``total_steps``, or None;
    a warning naming the window and the run's steps when that is not the whole window, else None)."""
    first, last = window
    if start_step >= total_steps:  # the run has no steps (the loop says so)
        return None, None
    where = f"--profile-steps {first}:{last} {{}} this run's steps {start_step + 1} to {total_steps}"
    if first > total_steps or last <= start_step:
        return None, f"warning: {where.format('lies outside')}; no trace is written"
    if first <= start_step:
        return None, f"warning: {where.format('starts before')}; no trace is written"
    if last > total_steps:
        return (first, total_steps), f"warning: {where.format('ends after')}; the trace stops at step {total_steps}"
    return window, None


class Profiler:
    """Wraps a train step function; counts the steps from ``start_step`` and traces steps A..B (those of them up
    to ``total_steps``; ``note``: the warning of :func:`run_window`, or None).

    Use as a context manager around the loop, so a run that ends inside the window still closes the trace."""

    def __init__(self, config: ProfileConfig, directory: paths.PathLike, start_step: int, total_steps: int) -> None:
        self.window, self.note = None, None
        if config.steps is not None and jax.process_index() == 0:
            self.window, self.note = run_window(config.steps, start_step, total_steps)
        self.target = paths.as_path(directory) / PROFILE_DIR
        self.step = start_step
        self.local: str | None = None  # where the running trace is written

    def wrap(self, step_fn: Callable[..., Any]) -> Callable[..., Any]:
        if self.window is None:
            return step_fn

        def traced(*args: Any, **kwargs: Any) -> Any:
            self.step += 1
            first, last = self.window
            if self.step == first:
                self._start()
            out = step_fn(*args, **kwargs)
            if self.step == last and self.local is not None:
                jax.block_until_ready(out)
                self._stop()
            return out

        return traced

    def _start(self) -> None:
        if paths.is_remote(self.target):
            self.local = tempfile.mkdtemp(prefix="nash_mhc-profile-")
        else:
            self.local = os.fspath(self.target)
            os.makedirs(self.local, exist_ok=True)
        jax.profiler.start_trace(self.local)

    def _stop(self) -> None:
        jax.profiler.stop_trace()
        local, self.local = self.local, None
        if paths.is_remote(self.target):  # upload the trace files, then drop the local copy
            for root, _, names in os.walk(local):
                for name in names:
                    file = os.path.join(root, name)
                    remote = self.target / os.path.relpath(file, local)
                    remote.parent.mkdir(parents=True, exist_ok=True)
                    with open(file, "rb") as f:
                        remote.write_bytes(f.read())
            shutil.rmtree(local, ignore_errors=True)

    def __enter__(self) -> Profiler:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.local is not None:
            self._stop()
