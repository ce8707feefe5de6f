"""Peak FLOP/s of the accelerator (a table, or a matmul probe on CPU) and MFU."""

from __future__ import annotations

import time

import jax

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


def table_peak(device_kind: str) -> float | None:
    """Peak FLOP/s of one device from :data:`PEAK_FLOPS`, matched by the longest name in ``device_kind``."""
    kind = device_kind.lower()
    matches = [name for name in PEAK_FLOPS if name in kind]
    return PEAK_FLOPS[max(matches, key=len)] if matches else None


def probe_peak(size: int = 1024, repeats: int = 10, dtype: str = "float32") -> float:
    """Measured FLOP/s of a square matmul chain on the default device (best of ``repeats``)."""
    a = jax.random.normal(jax.random.key(0), (size, size), dtype)
    b = jax.random.normal(jax.random.key(1), (size, size), dtype)
    matmul = jax.jit(lambda a, b: (a @ b) @ b)
    jax.block_until_ready(matmul(a, b))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(matmul(a, b))
        best = min(best, time.perf_counter() - start)
    return 2 * 2 * size**3 / best


def device_peak(device: jax.Device | None = None, dtype: str = "float32") -> tuple[float, str]:
    """(peak FLOP/s of one device, where the figure comes from)."""
    device = jax.devices()[0] if device is None else device
    peak = table_peak(device.device_kind)
    if peak is not None:
        return peak, f"{device.device_kind} table"
    return probe_peak(dtype=dtype), f"{device.platform} matmul probe"


def mfu(tokens_per_second: float, flops_per_token: float, peak_per_device: float, num_devices: int) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak of all devices."""
    return tokens_per_second * flops_per_token / (peak_per_device * num_devices)


__all__ = ["PEAK_FLOPS", "device_peak", "mfu", "probe_peak", "table_peak"]
