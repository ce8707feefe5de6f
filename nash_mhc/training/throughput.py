"""Model FLOPs utilisation (MFU): the one definition used by the training loop, the benchmarks and the README.

    MFU = (tokens per step / mean step time) · flops_per_token / (peak FLOP/s per device · devices)

* ``flops_per_token`` is :meth:`nash_mhc.ModelConfig.flops_per_token` (forward + backward, real vocabulary).
* The peak is the vendor's dense bf16 figure (:data:`PEAK_FLOPS`) on a device whose kind is in the table. On
  any other device (a CPU, an accelerator missing from the table) it is measured by a matmul probe in the
  model's compute dtype, taken next to the steps it is compared with (the speed of a shared CPU drifts by tens
  of percent between minutes), and summarised with the same statistic as the step times: the mean time.

:class:`MFUMeter` holds that definition; a caller feeds it probe samples next to its step timings
(:meth:`MFUMeter.sample`) and asks for the figures of a window of steps (:meth:`MFUMeter.report`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

# Dense bf16 peak FLOP/s per chip / GPU (vendor figures, no sparsity).
PEAK_FLOPS = {
    "tpu v4": 275e12,
    "tpu v5 lite": 197e12,  # v5e
    "tpu v5e": 197e12,
    "tpu v5p": 459e12,
    "tpu v5": 459e12,
    "tpu v6 lite": 918e12,  # v6e (Trillium)
    "tpu v6e": 918e12,
    "a100": 312e12,
    "h100": 989e12,
    "h200": 989e12,
}

PROBE_SIZE = 1024


def table_peak(device_kind: str) -> float | None:
    """Peak FLOP/s of one device from :data:`PEAK_FLOPS`, matched by the longest name in ``device_kind``."""
    kind = device_kind.lower()
    matches = [name for name in PEAK_FLOPS if name in kind]
    return PEAK_FLOPS[max(matches, key=len)] if matches else None


class MatmulProbe:
    """A compiled square matmul chain ``(a @ b) @ b`` on one device; each call times one run (seconds)."""

    def __init__(self, device: Any | None = None, *, size: int = PROBE_SIZE, dtype: str = "float32"):
        device = jax.devices()[0] if device is None else device
        self.flops = 2.0 * 2.0 * size**3
        self._a = jax.device_put(jax.random.normal(jax.random.key(0), (size, size), jnp.dtype(dtype)), device)
        self._b = jax.device_put(jax.random.normal(jax.random.key(1), (size, size), jnp.dtype(dtype)), device)
        self._matmul = jax.jit(lambda a, b: (a @ b) @ b)
        jax.block_until_ready(self._matmul(self._a, self._b))  # compile outside any timing

    def __call__(self) -> float:
        start = time.perf_counter()
        jax.block_until_ready(self._matmul(self._a, self._b))
        return time.perf_counter() - start


@dataclasses.dataclass(frozen=True)
class Peak:
    """Peak FLOP/s of one device and where the figure comes from."""

    per_device: float
    source: str


class MFUMeter:
    """Tokens/s and MFU of windows of training steps on ``num_devices`` devices like ``device``.

    With a table peak nothing is measured. Otherwise call :meth:`sample` next to the step timings of each
    window (while no step is running: the probe shares the device), and :meth:`report` divides by the mean
    of the probe samples taken since the previous report, as the step time is the mean over the window.
    ``probe`` replaces the matmul probe (tests: any callable returning seconds, with a ``flops`` attribute).
    """

    def __init__(self, flops_per_token: float, num_devices: int, *, device: Any | None = None,
                 dtype: str = "float32", probe: Callable[[], float] | None = None):
        device = jax.devices()[0] if device is None else device
        self.flops_per_token = float(flops_per_token)
        self.num_devices = int(num_devices)
        self._table = table_peak(device.device_kind)
        self._source = (f"{device.device_kind} table" if self._table is not None
                        else f"{device.platform} {dtype} {PROBE_SIZE}² matmul probe")
        self._probe = None
        if self._table is None:
            self._probe = MatmulProbe(device, dtype=dtype) if probe is None else probe
        self._samples: list[float] = []

    @property
    def source(self) -> str:
        """Where the peak comes from (the table entry, or the probe's platform, dtype and size)."""
        return self._source

    @property
    def measured(self) -> bool:
        """True when the peak is measured (probe), False when it comes from the table."""
        return self._probe is not None

    def sample(self) -> None:
        """Time one probe run now and keep it for the next :meth:`report` (nothing with a table peak)."""
        if self._probe is not None:
            self._samples.append(self._probe())

    def peak(self) -> Peak:
        """The table figure, or the probe's FLOPs over the mean time of the samples since the last report
        (one is taken now if there are none)."""
        if self._probe is None:
            return Peak(self._table, self.source)
        if not self._samples:
            self.sample()
        mean_seconds = sum(self._samples) / len(self._samples)
        return Peak(self._probe.flops / mean_seconds, self.source)

    def report(self, tokens_per_step: float, mean_step_seconds: float) -> dict[str, float]:
        """Figures of one window: tokens/s, MFU, the mean step time and the peak per device used. Starts a new
        window of probe samples."""
        peak = self.peak().per_device
        self._samples.clear()
        tokens_per_second = tokens_per_step / mean_step_seconds
        return {"tokens_per_second": tokens_per_second,
                "mfu": mfu(tokens_per_second, self.flops_per_token, peak, self.num_devices),
                "step_time_s": mean_step_seconds, "peak_flops_per_device": peak}


def mfu(tokens_per_second: float, flops_per_token: float, peak_per_device: float, num_devices: int) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak of all devices."""
    return tokens_per_second * flops_per_token / (peak_per_device * num_devices)


def device_peak(device: Any | None = None, dtype: str = "float32") -> tuple[float, str]:
    """(peak FLOP/s of one device, where the figure comes from): the table, or one probe run now.

    A start-up figure for logs; MFU itself comes from :class:`MFUMeter`, whose probe is taken per window.
    """
    peak = MFUMeter(0.0, 1, device=device, dtype=dtype).peak()
    return peak.per_device, peak.source


__all__ = ["PEAK_FLOPS", "MFUMeter", "MatmulProbe", "Peak", "device_peak", "mfu", "table_peak"]
