"""Does the training program's CPU peak read what the probe reads in a fresh process?

    python benchmarks/startup_peak.py [--rounds 10] [--baseline-tree DIR]

Each round, one after the other: ``python -m nash_mhc.train --use-small-model --total-steps 1`` into a temporary
directory (the peak it prints at start-up, ``peak FLOP/s per device``), the same with the code of ``DIR`` first on
``PYTHONPATH`` (``--baseline-tree``, a checkout of another commit: ``git worktree add DIR COMMIT``), and a fresh
Python process that only measures :func:`nash_mhc.training.throughput.measured_peak`. It prints every reading,
and per contestant the median, the lowest and how many read under 80 % of the fresh processes' median: a
training log's MFU divides by its peak, so a peak read 20 % low makes every MFU of that run read 25 % high.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from host import machine

ROOT = Path(__file__).resolve().parents[1]
FRESH = ("import jax; from nash_mhc.training.throughput import measured_peak; "
         "print(measured_peak(jax.devices()[0], 'float32') / 1e9)")


def environment(tree: Path | None) -> dict[str, str]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [env.get("PYTHONPATH")])])
    return env


def training_peak(tree: Path | None, cache: Path) -> float:
    """GFLOP/s a one-step training run of ``small`` printed as its peak (``tree``'s code, else this checkout's)."""
    with tempfile.TemporaryDirectory() as run:
        command = [sys.executable, "-m", "nash_mhc.train", "--use-small-model", "--total-steps", "1",
                   "--checkpoint-dir", run, "--no-progress", "--compile-cache-dir", str(cache)]
        result = subprocess.run(command, cwd=tree or ROOT, env=environment(tree), capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"training failed ({result.returncode}):\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    return float(re.search(r"peak FLOP/s per device: ([\d,.]+) GFLOP/s", result.stdout).group(1).replace(",", ""))


def fresh_peak() -> float:
    result = subprocess.run([sys.executable, "-c", FRESH], cwd=ROOT, env=environment(None), capture_output=True,
                            text=True, check=True)
    return float(result.stdout.split()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--baseline-tree", type=Path, default=None)
    args = parser.parse_args()
    readings: dict[str, list[float]] = {"training program": []}
    if args.baseline_tree is not None:
        readings[f"training program at {args.baseline_tree}"] = []
    readings["fresh process"] = []
    print(f"machine: {machine()}", flush=True)
    with tempfile.TemporaryDirectory() as cache:  # compiled once, then read from the cache by every run
        for round_ in range(1, args.rounds + 1):
            readings["training program"].append(training_peak(None, Path(cache)))
            if args.baseline_tree is not None:
                readings[f"training program at {args.baseline_tree}"].append(
                    training_peak(args.baseline_tree.resolve(), Path(cache)))
            readings["fresh process"].append(fresh_peak())
            print(f"round {round_}: " + ", ".join(f"{name} {values[-1]:.1f}" for name, values in readings.items()),
                  flush=True)
    reference = statistics.median(readings["fresh process"])
    print(f"\nGFLOP/s over {args.rounds} rounds (low: under 80 % of the fresh processes' median, {reference:.1f})")
    for name, values in readings.items():
        low = sum(v < 0.8 * reference for v in values)
        print(f"  {name}: median {statistics.median(values):.1f}, lowest {min(values):.1f}, low {low} of "
              f"{len(values)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
