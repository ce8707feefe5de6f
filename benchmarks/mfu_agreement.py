"""Does the training log's MFU agree with the benchmark suite's for the same step?

    python benchmarks/mfu_agreement.py [--steps 30] [--modes mhc-multiscale plain-full]

In one run on this machine, for each residual-attention mode of ``small``:

1. ``python -m nash_mhc.train --use-small-model --residual R --attention A --batch-size 8 --total-steps 30
   --log-interval 1`` (the default corpus, one device) into a temporary directory; the MFU and tokens/s of
   steps 10-30 come from its ``metrics.jsonl``, its peak from its start-up line;
2. then the benchmark suite's own measurement of the same shapes (``small``, batch 8 x 256, one device):
   ``pytest benchmarks/test_train_step.py`` for the same modes, its MFU, tokens/s and peak from
   ``--benchmark-json``.

It prints, per mode, the median logged MFU against the benchmark's (relative difference) and how much the
logged MFU and tokens/s move over steps 10-30 (largest deviation from their medians). It exits 0 when every
median is within 15 % of the benchmark's and, in every mode whose tokens/s stays within ±10 %, the logged MFU
does too; else 1. Last, in this process, the peak's own probe: 64 single runs after a steady measurement (best,
median, lowest, and how many read under 60 % of the best). It also prints how many cores other processes kept
busy meanwhile (``/proc/stat`` less this
run's own CPU time): on a shared host they move both measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from host import machine

ROOT = Path(__file__).resolve().parents[1]
AGREEMENT, STEADINESS = 0.15, 0.10


def busy_seconds() -> float:
    """CPU seconds all processes on the machine have been busy (``/proc/stat``; 0 where there is none)."""
    stat = Path("/proc/stat")
    if not stat.exists():
        return 0.0
    ticks = [int(x) for x in stat.read_text().splitlines()[0].split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait


def own_seconds() -> float:
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def train_run(mode: str, steps: int, directory: Path) -> dict:
    """One CLI training run; its logged records of steps 10.. and the peak it printed at start-up."""
    residual, attention = mode.split("-")
    command = [sys.executable, "-m", "nash_mhc.train", "--use-small-model", "--residual", residual,
               "--attention", attention, "--batch-size", "8", "--total-steps", str(steps), "--log-interval", "1",
               "--checkpoint-interval", str(10 * steps), "--checkpoint-dir", str(directory), "--no-progress",
               "--compile-cache-dir", "none"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"training failed ({result.returncode}):\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    peak = re.search(r"peak FLOP/s per device: ([\d,.]+) GFLOP/s \((.*)\)", result.stdout + result.stderr)
    records = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if r["step"] >= 10 and r.get("mfu") is not None]
    return {"command": " ".join(command[1:]), "peak_gflops": float(peak.group(1).replace(",", "")),
            "source": peak.group(2), "mfu": [r["mfu"] for r in records],
            "tokens_per_second": [r["tokens_per_second"] for r in records]}


def benchmark_runs(modes: list[str], directory: Path) -> dict[str, dict]:
    """The suite's train-step benchmark of ``small`` in ``modes``, one pytest session."""
    output = directory / "benchmark.json"
    nodes = [f"benchmarks/test_train_step.py::test_train_step_tokens_per_second[{mode}-small]" for mode in modes]
    command = [sys.executable, "-m", "pytest", *nodes, "--benchmark-only", "-q", "-p", "no:cacheprovider",
               f"--benchmark-json={output}"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"benchmark failed ({result.returncode}):\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    found = {}
    for bench in json.loads(output.read_text())["benchmarks"]:
        mode = bench["name"].split("[")[1].removesuffix("-small]")
        found[mode] = {**bench["extra_info"], "rounds": bench["stats"]["rounds"]}
    return found


def probe_readings(runs: int = 64) -> str:
    """The peak (the suite's definition) and the spread of ``runs`` single runs of its probe, in GFLOP/s."""
    import jax

    from nash_mhc.training.throughput import MatmulProbe, steady_best

    probe = MatmulProbe(jax.devices()[0])
    peak = steady_best(probe)
    readings = sorted(probe.flops / probe() / 1e9 for _ in range(runs))
    low = sum(r < 0.6 * peak / 1e9 for r in readings)
    return (f"probe: steady best {peak / 1e9:,.0f} GFLOP/s; {runs} single runs after it: best {readings[-1]:,.0f}, "
            f"median {statistics.median(readings):,.0f}, lowest {readings[0]:,.0f}, {low} under 60 % of the "
            f"steady best")


def spread(values: list[float]) -> float:
    """Largest relative deviation from the median."""
    middle = statistics.median(values)
    return max(abs(v / middle - 1) for v in values)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--modes", nargs="+", default=["mhc-multiscale", "plain-full"])
    args = parser.parse_args()
    start, busy, own = time.perf_counter(), busy_seconds(), own_seconds()
    print(f"machine: {machine()}")
    with tempfile.TemporaryDirectory() as tmp:
        trained = {mode: train_run(mode, args.steps, Path(tmp) / mode) for mode in args.modes}
        benched = benchmark_runs(args.modes, Path(tmp))
    ok = True
    for mode in args.modes:
        run, bench = trained[mode], benched[mode]
        logged = statistics.median(run["mfu"])
        difference = logged / bench["mfu"] - 1
        mfu_spread, tps_spread = spread(run["mfu"]), spread(run["tokens_per_second"])
        agrees = abs(difference) <= AGREEMENT
        steady = mfu_spread < STEADINESS or tps_spread >= STEADINESS
        ok = ok and agrees and steady
        print(f"\nsmall {mode}, batch 8 x 256, one device")
        print(f"  training log, steps 10-{args.steps} ({len(run['mfu'])} lines): MFU median {logged:.1%} "
              f"(range {min(run['mfu']):.1%}-{max(run['mfu']):.1%}, largest deviation {mfu_spread:.1%}), "
              f"tokens/s median {statistics.median(run['tokens_per_second']):,.0f} (largest deviation "
              f"{tps_spread:.1%}); peak {run['peak_gflops']:,.1f} GFLOP/s ({run['source']})")
        print(f"  benchmark suite ({bench['rounds']} rounds): MFU {bench['mfu']:.1%}, tokens/s "
              f"{bench['tokens_per_second']:,}; peak {bench['peak_gflops']:,.1f} GFLOP/s")
        print(f"  logged median / benchmark - 1 = {difference:+.1%} ({'within' if agrees else 'NOT within'} "
              f"{AGREEMENT:.0%}); logged MFU deviation {mfu_spread:.1%} with tokens/s deviation {tps_spread:.1%} "
              f"({'ok' if steady else 'NOT ok'}: < {STEADINESS:.0%} when tokens/s is)")
    print(f"\n{probe_readings()}")
    wall = time.perf_counter() - start
    others = (busy_seconds() - busy - (own_seconds() - own)) / wall
    print(f"\nother processes kept {max(others, 0.0):.2f} cores busy on average; wall time {wall:.0f} s; "
          f"{'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
