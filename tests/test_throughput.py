"""MFU: one definition (nash_mhc.training.throughput.MFUMeter) for the training logs and the benchmarks, over one
peak per device and dtype: the table's, or the best of a warm, steady matmul probe (fake probes here)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from nash_mhc import ModelConfig
from nash_mhc.training import throughput
from nash_mhc.training.throughput import PEAK_FLOPS, MatmulProbe, MFUMeter, mfu, steady_best

FLOPS_PER_TOKEN = ModelConfig.preset("small").flops_per_token()
FLOPS = 4e9  # per run of the fake probes: 0.04 s = 100 GFLOP/s


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    device_kind: str
    platform: str


class ScriptedProbe:
    """A probe whose runs read the given GFLOP/s, in order (then the last one forever); counts its runs."""

    flops = FLOPS

    def __init__(self, *gflops: float):
        self.gflops, self.runs = list(gflops), 0

    def __call__(self) -> float:
        value = self.gflops[min(self.runs, len(self.gflops) - 1)]
        self.runs += 1
        return self.flops / (value * 1e9)


def never() -> float:
    raise AssertionError("a table peak must not run the probe")


def blocks(*values: list[float]) -> list[float]:
    return [v for block in values for v in block]


@pytest.mark.parametrize("kind, peak", [("TPU v5 lite", 197e12), ("TPU v4", 275e12), ("NVIDIA H100 80GB HBM3", 989e12)])
def test_accelerators_divide_by_the_table_peak(kind, peak):
    meter = MFUMeter.for_device(FLOPS_PER_TOKEN, 8, device=FakeDevice(kind, "tpu"), probe=never)
    assert meter.peak == peak and meter.source == f"{kind} table"
    figures = meter.report(tokens_per_step=4096, mean_step_seconds=0.5)
    assert figures["tokens_per_second"] == 8192 and figures["step_time_s"] == 0.5
    assert figures["mfu"] == pytest.approx(8192 * FLOPS_PER_TOKEN / (peak * 8), rel=1e-12)
    assert mfu(8192, FLOPS_PER_TOKEN, peak, 8) == figures["mfu"]


def test_tables_cover_the_documented_devices():
    assert set(PEAK_FLOPS) >= {"tpu v4", "tpu v5 lite", "tpu v5p", "tpu v6 lite", "a100", "h100", "h200"}


def test_the_warm_up_block_is_discarded_and_a_reproduced_best_is_steady():
    """Block 0 warms up (even a fast reading there does not count); blocks 1-3 agree within 3 %: done after 4."""
    probe = ScriptedProbe(*blocks([900.0] + [50.0] * 7, [100.0] * 8, [101.0] * 8, [99.0] * 7 + [102.0]),
                          1000.0)
    assert steady_best(probe, block=8, min_blocks=3, tolerance=0.03) == pytest.approx(102e9)
    assert probe.runs == 32


def test_a_stretch_at_half_speed_is_not_the_peak():
    """A core taken for a while (runs at half speed) then freed: the reading rises, so it is not steady until
    the full speed has been reproduced by a later block; the peak is the full speed."""
    probe = ScriptedProbe(*blocks([100.0] * 8, [250.0] * 8, [245.0] * 8, [250.0] * 3 + [490.0] * 5,
                                  [480.0] * 8), 10.0)
    assert steady_best(probe, block=8, min_blocks=3, tolerance=0.03) == pytest.approx(490e9)
    # block 2 agreed with block 1 but before min_blocks; block 3 rose to 490; block 4 (480) reproduced it
    assert probe.runs == 40


def test_a_dip_is_not_steady_either():
    probe = ScriptedProbe(*blocks([100.0] * 8, [490.0] * 8, [488.0] * 8, [250.0] * 8, [490.0] * 8), 10.0)
    assert steady_best(probe, block=8, min_blocks=3, tolerance=0.03) == pytest.approx(490e9)
    assert probe.runs == 40


def test_a_reading_that_never_settles_stops_after_max_seconds_with_the_best_so_far():
    readings = [100.0 * 1.1**k for k in range(200)]  # rises by 10 % every run: never steady
    probe, now = ScriptedProbe(*readings), [0.0]

    def clock() -> float:
        now[0] += 0.25  # each block "takes" 0.25 s
        return now[0]

    peak = steady_best(probe, block=4, min_blocks=3, tolerance=0.03, max_seconds=1.0, clock=clock)
    assert probe.runs == 4 + 4 * 4  # warm-up, then 4 blocks: clock reads 0.5, 0.75, 1.0, 1.25 after them
    assert peak == pytest.approx(readings[probe.runs - 1] * 1e9)


def test_one_peak_serves_every_report():
    """The peak is fixed when the meter is made: later probe readings cannot move a report, so MFU moves
    exactly with tokens/s."""
    probe = ScriptedProbe(100.0)
    meter = MFUMeter.for_device(FLOPS_PER_TOKEN, 2, device=FakeDevice("cpu", "cpu"), probe=probe)
    runs = probe.runs
    assert meter.peak == pytest.approx(100e9) and "probe" in meter.source
    probe.gflops = [40.0]
    first, second = meter.report(1000, 0.1), meter.report(1000, 0.2)
    assert probe.runs == runs
    assert first["mfu"] == pytest.approx(1000 / 0.1 * FLOPS_PER_TOKEN / (100e9 * 2), rel=1e-12)
    assert second["mfu"] / first["mfu"] == pytest.approx(second["tokens_per_second"] / first["tokens_per_second"])


def test_the_matmul_peak_is_measured_once_per_process_per_device_and_dtype(monkeypatch):
    made = []

    def fake_probe(device, *, dtype):
        made.append((device, dtype))
        return ScriptedProbe({"float32": 200.0, "bfloat16": 50.0}[dtype])

    monkeypatch.setattr(throughput, "MatmulProbe", fake_probe)
    throughput.measured_peak.cache_clear()
    try:
        cpu, other = FakeDevice("cpu", "cpu"), FakeDevice("some accelerator", "gpu")
        meters = [MFUMeter.for_device(FLOPS_PER_TOKEN, 1, device=d, dtype=t)
                  for d, t in ((cpu, "float32"), (cpu, "float32"), (cpu, "bfloat16"), (other, "float32"))]
        assert made == [(cpu, "float32"), (cpu, "bfloat16"), (other, "float32")]
        assert [m.peak for m in meters] == pytest.approx([200e9, 200e9, 50e9, 200e9])
    finally:
        throughput.measured_peak.cache_clear()


def test_the_probe_counts_the_flops_xla_counts():
    """MatmulProbe.flops against XLA's cost analysis of the same chain (an independent count)."""
    probe = MatmulProbe(size=128)
    shape = jax.ShapeDtypeStruct((128, 128), jnp.float32)
    counted = jax.jit(lambda a, b: (a @ b) @ b).lower(shape, shape).cost_analysis()["flops"]
    assert probe.flops == counted
    assert 0 < probe() < 10
