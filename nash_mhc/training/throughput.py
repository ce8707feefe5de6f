"""Model FLOPs utilisation (MFU): the one definition used by the training loop, the benchmarks and the README.

    MFU = (tokens per step / mean step time) · flops_per_token / (peak FLOP/s per device · devices)

* ``flops_per_token`` is :meth:`nash_mhc.ModelConfig.flops_per_token` (forward + backward, real vocabulary).
* The peak is one figure per device and compute dtype, fixed before the first step and used for every log
  line and benchmark row: the vendor's dense bf16 figure (:data:`PEAK_FLOPS`) on a device whose kind is in
  the table; on any other device (a CPU, an accelerator missing from the table) the best FLOP/s of a square
  matmul probe once its readings are steady (:func:`steady_best`), measured once per process
  (:func:`measured_peak`).

Why the best and not the mean: interference only ever slows the probe down. On a shared CPU a run reads
either the hardware's rate (every core busy with it) or about half of it when a core is taken (another
process, the prefetch thread, a thread pool still spinning after a train step), in stretches of a few
hundred milliseconds (docs/results/cpu_throughput/README.md, "MFU convention"). The mean of a few probes taken between
training steps landed anywhere between the two, so the logged MFU jumped by ±20 points at a constant
tokens/s; the best of a warm, steady run reads the hardware's rate every time, and a step slowed by the
same interference shows as a lower MFU, which is what MFU is for.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any, Protocol

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
PROBE_BLOCK = 8  # probe runs per block
PROBE_MIN_BLOCKS = 3  # blocks after the warm-up block before the reading may count as steady
PROBE_TOLERANCE = 0.03  # steady: a block's best within 3 % of the best before it
PROBE_MAX_SECONDS = 1.0  # give up waiting for steadiness after this long (the best so far is kept)


def table_peak(device_kind: str) -> float | None:
    """Peak FLOP/s of one device from :data:`PEAK_FLOPS`, matched by the longest name in ``device_kind``."""
    kind = device_kind.lower()
    matches = [name for name in PEAK_FLOPS if name in kind]
    return PEAK_FLOPS[max(matches, key=len)] if matches else None


class Probe(Protocol):
    """Something that does ``flops`` FLOPs per call and returns the seconds the call took."""

    flops: float

    def __call__(self) -> float: ...


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


def steady_best(probe: Probe, *, block: int = PROBE_BLOCK, min_blocks: int = PROBE_MIN_BLOCKS,
                tolerance: float = PROBE_TOLERANCE, max_seconds: float = PROBE_MAX_SECONDS,
                clock: Callable[[], float] = time.perf_counter) -> float:
    """The best FLOP/s of ``probe`` once warm and steady.

    One block of ``block`` runs warms up (caches, thread pools) and is discarded. Then blocks run until, after
    at least ``min_blocks``, a block's best reproduces the best before it within ``tolerance`` (steady: the
    reading neither rose nor dipped), or until ``max_seconds`` have passed; the result is the best single run.
    """
    for _ in range(block):
        probe()
    start, best, blocks = clock(), 0.0, 0
    while True:
        block_best = max(probe.flops / probe() for _ in range(block))
        steady = blocks > 0 and abs(block_best - best) <= tolerance * best
        best, blocks = max(best, block_best), blocks + 1
        if (steady and blocks >= min_blocks) or clock() - start >= max_seconds:
            return best


@functools.cache
def measured_peak(device: Any, dtype: str) -> float:
    """:func:`steady_best` of a :class:`MatmulProbe` on ``device`` in ``dtype``, measured once per process."""
    return steady_best(MatmulProbe(device, dtype=dtype))


def device_peak(device: Any | None = None, *, dtype: str = "float32", probe: Probe | None = None
                ) -> tuple[float, str]:
    """(peak FLOP/s of one ``device``, where it comes from): the table's, else :func:`measured_peak` (or
    :func:`steady_best` of ``probe``, tests)."""
    device = jax.devices()[0] if device is None else device
    table = table_peak(device.device_kind)
    if table is not None:
        return table, f"{device.device_kind} table"
    peak = measured_peak(device, dtype) if probe is None else steady_best(probe)
    return peak, f"{device.platform} {dtype} {PROBE_SIZE}² matmul probe, best once steady"


@dataclasses.dataclass(frozen=True)
class MFUMeter:
    """Tokens/s and MFU of training steps on ``num_devices`` devices like ``device``, all over one ``peak``.

    The peak (FLOP/s per device) is the table's, else :func:`measured_peak` (at construction, so before the
    first step; once per process). ``probe`` replaces the matmul probe (tests: a :class:`Probe`).
    """

    flops_per_token: float
    num_devices: int
    peak: float
    source: str  # where the peak comes from (the table entry, or the probe's platform, dtype and size)

    @classmethod
    def for_device(cls, flops_per_token: float, num_devices: int, *, device: Any | None = None,
               dtype: str = "float32", probe: Probe | None = None) -> MFUMeter:
        return cls(float(flops_per_token), int(num_devices), *device_peak(device, dtype=dtype, probe=probe))

    def report(self, tokens_per_step: float, mean_step_seconds: float) -> dict[str, float]:
        """Figures of steps that took ``mean_step_seconds`` each: tokens/s, MFU and the mean step time."""
        tokens_per_second = tokens_per_step / mean_step_seconds
        return {"tokens_per_second": tokens_per_second,
                "mfu": mfu(tokens_per_second, self.flops_per_token, self.peak, self.num_devices),
                "step_time_s": mean_step_seconds}


def mfu(tokens_per_second: float, flops_per_token: float, peak_per_device: float, num_devices: int) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak of all devices."""
    return tokens_per_second * flops_per_token / (peak_per_device * num_devices)


__all__ = ["PEAK_FLOPS", "MFUMeter", "MatmulProbe", "Probe", "device_peak", "measured_peak", "mfu", "steady_best",
           "table_peak"]
