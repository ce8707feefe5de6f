"""``--profile-steps A:B``: a ``jax.profiler`` trace of training steps A..B (inclusive) on process 0.

The trace starts just before step A is dispatched and stops once step B has finished on the device; it is
written under ``<checkpoint-dir>/profile/`` (``plugins/profile/<time>/<host>.xplane.pb``, the layout
TensorBoard's profile plugin and XProf read: ``tensorboard --logdir <checkpoint-dir>/profile`` with
``tensorboard-plugin-profile`` installed, or ``xprof --logdir <checkpoint-dir>/profile``). A bucket directory
gets the trace uploaded when it stops. Steps are counted as the log counts them (the first step is 1); the
first step of a run includes compilation, so start at 2 or later to see steady-state steps.
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


class Profiler:
    """Wraps a train step function; counts the steps from ``start_step`` and traces steps A..B.

    Use as a context manager around the loop, so a run that ends inside the window still closes the trace."""

    def __init__(self, config: ProfileConfig, directory: paths.PathLike, start_step: int) -> None:
        self.window = config.steps if jax.process_index() == 0 else None
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
