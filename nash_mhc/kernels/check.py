"""The kernels check: every Pallas kernel a preset's train step uses, run on the local devices at the step's
shapes against its XLA form, forward and VJP.

:func:`run_check` traces the step (:func:`nash_mhc.kernels.discover.discover`), keeps the choices whose TPU form
calls a Pallas kernel, and runs each (:func:`nash_mhc.kernels.replay.check_choice`): off TPU the kernels run in
Pallas' interpreter, so a CPU checks small shapes only (the ``tiny`` preset, a small batch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax

from nash_mhc.config import ModelConfig
from nash_mhc.kernels.discover import discover, kernel_choices
from nash_mhc.kernels.replay import Result, check_choice
from nash_mhc.training.config import TrainConfig


@dataclasses.dataclass(frozen=True)
class CheckReport:
    """The results of one check, and where it ran."""

    target: str                  # "1 x cpu, interpreted" / "8 x TPU v6 lite"
    results: tuple[Result, ...]
    unchecked: frozenset[str] = frozenset()  # kernels of the step that no named choice runs

    @property
    def ok(self) -> bool:
        return not self.unchecked and all(result.ok for result in self.results)

    @property
    def kernels(self) -> set[str]:
        """Every Pallas kernel the check ran."""
        return {name for result in self.results for name in result.kernels}


def run_check(model_config: ModelConfig, train_config: TrainConfig, devices: Sequence[Any] | None = None,
              seed: int = 0, repeats: int = 3) -> CheckReport:
    """Check every kernel of the train step of ``model_config`` at ``train_config``'s batch on ``devices``
    (default: the local ones)."""
    devices = list(jax.local_devices() if devices is None else devices)
    discovery = discover(model_config, train_config, devices)
    kept, unchecked = kernel_choices(discovery)
    key = jax.random.key(seed)
    results = tuple(check_choice(choice, names, discovery.mesh, jax.random.fold_in(key, k), repeats)
                    for k, (choice, names) in enumerate(kept))
    platform = devices[0].platform
    target = f"{len(devices)} x {devices[0].device_kind}" + ("" if platform == "tpu" else ", interpreted")
    return CheckReport(target, results, frozenset(unchecked))


def _error(error: tuple[float, float] | None) -> str:
    return "-" if error is None else f"{error[0]:.1e} {error[1]:.1e}"


def report_lines(report: CheckReport) -> list[str]:
    """A table: one row per checked choice (its name, Pallas kernels and operands), max abs and relative error
    forward and VJP, the tolerance (relative), the kernel's and XLA's milliseconds (forward + VJP) and the speed-up."""
    header = (f"{'kernel':<18} {'forward abs rel':<17} {'vjp abs rel':<17} {'tol':<7} {'kernel ms':>10} "
              f"{'xla ms':>9} {'speed-up':>8}  result  pallas calls")
    lines = [f"kernels check on {report.target}: {len(report.results)} kernels", header]
    for r in report.results:
        speed = r.xla_ms / r.kernel_ms if r.kernel_ms else float("inf")
        lines.append(f"{r.name:<18} {_error(r.forward):<17} {_error(r.vjp):<17} {r.tolerance:<7.0e} "
                     f"{r.kernel_ms:>10.2f} {r.xla_ms:>9.2f} {speed:>7.2f}x  {'ok' if r.ok else 'FAIL':<6}  "
                     f"{', '.join(r.kernels)} at {r.shapes}")
    failed = [r.name for r in report.results if not r.ok]
    if report.unchecked:
        lines.append(f"unchecked: {', '.join(sorted(report.unchecked))} (in the step, in no named choice of "
                     "nash_mhc.ops.dispatch.platform_dependent)")
    lines.append(f"mismatch: {', '.join(failed)} (run with --kernels xla)" if failed else "all kernels match XLA")
    return lines


__all__ = ["CheckReport", "report_lines", "run_check"]
