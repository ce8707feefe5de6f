"""MFU: one definition (nash_mhc.training.throughput.MFUMeter) for the training logs and the benchmarks."""

from __future__ import annotations

import dataclasses

import jax
import pytest

from nash_mhc import ModelConfig
from nash_mhc.training.throughput import PEAK_FLOPS, MatmulProbe, MFUMeter, device_peak, mfu

FLOPS_PER_TOKEN = ModelConfig.preset("small").flops_per_token()


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    device_kind: str
    platform: str


class ScriptedProbe:
    """A probe whose runs take the given times (seconds), in order."""

    flops = 4e9

    def __init__(self, *seconds: float):
        self.seconds = list(seconds)

    def __call__(self) -> float:
        return self.seconds.pop(0)


def never() -> float:
    raise AssertionError("a table peak must not run the probe")


@pytest.mark.parametrize("kind, peak", [("TPU v5 lite", 197e12), ("TPU v4", 275e12), ("NVIDIA H100 80GB HBM3", 989e12)])
def test_accelerators_divide_by_the_table_peak(kind, peak):
    meter = MFUMeter(FLOPS_PER_TOKEN, 8, device=FakeDevice(kind, "tpu"), probe=never)
    meter.sample()
    assert not meter.measured and meter.peak().per_device == peak
    figures = meter.report(tokens_per_step=4096, mean_step_seconds=0.5)
    assert figures["tokens_per_second"] == 8192
    assert figures["mfu"] == pytest.approx(8192 * FLOPS_PER_TOKEN / (peak * 8), rel=1e-12)
    # the names the training loop imports give the same figure for the same step on the same device
    assert mfu(8192, FLOPS_PER_TOKEN, device_peak(FakeDevice(kind, "tpu"))[0], 8) == figures["mfu"]


def test_other_devices_divide_by_the_mean_probe_of_the_window():
    """Mean step time over mean probe time: the same statistic on both sides, and one window per report."""
    meter = MFUMeter(FLOPS_PER_TOKEN, 2, device=FakeDevice("cpu", "cpu"), probe=ScriptedProbe(0.02, 0.04, 0.01))
    assert meter.measured
    meter.sample()
    meter.sample()
    figures = meter.report(tokens_per_step=1000, mean_step_seconds=0.1)
    assert figures["peak_flops_per_device"] == pytest.approx(4e9 / 0.03)
    assert figures["mfu"] == pytest.approx(1000 / 0.1 * FLOPS_PER_TOKEN / (4e9 / 0.03 * 2))
    # the window's samples are spent: a report without a sample of its own takes one (0.01 s)
    assert meter.report(1000, 0.1)["peak_flops_per_device"] == pytest.approx(4e9 / 0.01)


def test_tables_cover_the_documented_devices():
    assert set(PEAK_FLOPS) >= {"tpu v4", "tpu v5 lite", "tpu v5p", "tpu v6 lite", "a100", "h100", "h200"}


def test_the_probe_timed_as_a_step_has_an_mfu_near_one():
    """The real probe on this device, used as its own "step" (one token of probe.flops FLOPs) and timed
    interleaved with the samples as the loop and the benchmarks do: MFU ≈ 1. A shared CPU drifts by tens of
    percent between minutes but little within a second, hence [0.6, 1.6]."""
    device = jax.devices()[0]
    probe = MatmulProbe(device)
    meter = MFUMeter(probe.flops, 1, device=FakeDevice("cpu", "cpu"), probe=probe)
    step_seconds = []
    for _ in range(8):
        meter.sample()
        step_seconds.append(probe())  # the "step": one more run of the same matmul chain
    figures = meter.report(1, sum(step_seconds) / len(step_seconds))
    assert 1e8 < figures["peak_flops_per_device"] < 1e16
    assert 0.6 <= figures["mfu"] <= 1.6, figures
