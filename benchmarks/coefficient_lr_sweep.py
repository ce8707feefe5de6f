"""The sweep that chose ``--coefficient-lr-scale``'s default: held-out loss and coefficient travel per scale.

Every run is ``python -m nash_mhc.train`` (the same preset, steps, learning rate, data and seeds; only
``--coefficient-lr-scale`` varies) followed by ``python -m nash_mhc.evaluate`` of its final checkpoint on the
held-out part. Selection rule, fixed before the runs: the scale with the lowest mean held-out bits per byte over
the seeds; where another scale's mean lies within one standard error of the best, the smaller scale is kept (the
closer one to plain AdamW). Writes ``results.json`` and ``results.md`` into ``--out``; finished runs are reused.

    python benchmarks/coefficient_lr_sweep.py --out docs/results/coefficient_lr
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

EXIT_NONFINITE = 3  # the training program's exit code for a loss that stayed non-finite


def run(argv: list[str], log: Path) -> tuple[int, str]:
    with open(log, "a") as file:
        file.write("$ " + " ".join(argv) + "\n")
        file.flush()
        done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=file, text=True)
        file.write(done.stdout)
    if done.returncode not in (0, EXIT_NONFINITE):
        raise SystemExit(f"{argv[2]} exited {done.returncode}; see {log}")
    return done.returncode, done.stdout


def one_run(args: argparse.Namespace, scale: float, seed: int) -> dict:
    directory = Path(args.out) / "runs" / f"scale{scale:g}" / f"seed{seed}"
    result_file = directory / "result.json"
    if result_file.exists():
        return json.loads(result_file.read_text())
    directory.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    train = [sys.executable, "-m", "nash_mhc.train", "--model", args.model, "--total-steps", str(args.steps),
             "--batch-size", str(args.batch_size), "--learning-rate", str(args.learning_rate), "--seed", str(seed),
             "--coefficient-lr-scale", str(scale), "--dataset", args.dataset, "--checkpoint-dir",
             str(directory / "train"), "--checkpoint-interval", str(args.steps), "--log-interval", "50",
             "--no-progress", "--compile-cache-dir", args.compile_cache_dir, *args.train_args.split()]
    code, _ = run(train, directory / "log.txt")
    last = json.loads((directory / "train" / "metrics.jsonl").read_text().strip().splitlines()[-1])
    evaluation = {"loss": None, "bits_per_byte": None}  # a diverged run has no evaluation
    if code == 0:
        evaluate = [sys.executable, "-m", "nash_mhc.evaluate", "--checkpoint-dir", str(directory / "train"),
                    "--num-batches", str(args.eval_batches), "--compile-cache-dir", args.compile_cache_dir]
        evaluation = json.loads(run(evaluate, directory / "log.txt")[1].strip().splitlines()[-1])
    result = {"scale": scale, "seed": seed, "status": "finished" if code == 0 else "diverged",
              "eval_loss": evaluation["loss"], "bits_per_byte": evaluation["bits_per_byte"],
              "travel": {k.split("/", 1)[1]: v for k, v in last.items() if k.startswith("travel/")},
              "final_train_loss": last["loss"], "wall_s": time.perf_counter() - start}
    result_file.write_text(json.dumps(result, indent=1) + "\n")
    return result


def mean_sem(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, float("nan")
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, math.sqrt(var / len(values))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/coefficient_lr_sweep")
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--scales", type=float, nargs="+", default=[1, 3, 10, 30, 100])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--dataset", default="stdlib")
    p.add_argument("--eval-batches", type=int, default=32)
    p.add_argument("--train-args", default="", help="further flags for every training run")
    p.add_argument("--compile-cache-dir", default="~/.cache/nash_mhc/xla")
    args = p.parse_args()
    results = [one_run(args, scale, seed) for scale in args.scales for seed in args.seeds]
    rows = []
    for scale in args.scales:
        mine = [r for r in results if r["scale"] == scale]
        finished = [r for r in mine if r.get("status", "finished") == "finished"]
        bpb, sem = mean_sem([r["bits_per_byte"] for r in finished]) if finished else (math.nan, math.nan)
        groups = sorted({g for r in finished for g in r["travel"]})
        travel = {g: sum(r["travel"][g] for r in finished) / len(finished) for g in groups}
        rows.append({"scale": scale, "bits_per_byte": bpb, "sem": sem, "travel": travel,
                     "diverged": len(mine) - len(finished)})
    # a scale with a diverged seed is not eligible: a default must train every seed
    eligible = [r for r in rows if not r["diverged"]]
    best = min(eligible, key=lambda r: r["bits_per_byte"])
    chosen = min((r for r in eligible if r["bits_per_byte"] <= best["bits_per_byte"] + (best["sem"] or 0.0)),
                 key=lambda r: r["scale"])
    command = shlex.join(["python", "benchmarks/coefficient_lr_sweep.py", *sys.argv[1:]])
    summary = {"command": command, "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores (shared VM)",
               "wall_s": sum(r["wall_s"] for r in results),  # each run's own training + evaluation time
               "rule": "lowest mean held-out bits per byte; within one standard error of it, the smaller scale",
               "chosen": chosen["scale"], "rows": rows, "runs": results}
    out = Path(args.out)
    (out / "results.json").write_text(json.dumps(summary, indent=1) + "\n")
    groups = sorted({g for r in rows for g in r["travel"]})
    lines = ["# Coefficient learning-rate scale sweep\n", f"Command: `{command}`  ", f"Machine: {summary['machine']}; "
             f"wall time of all runs {summary['wall_s'] / 60:.1f} min.  ", f"Rule (fixed before the runs): "
             f"{summary['rule']} (a scale with a diverged seed is not eligible). Chosen: **{chosen['scale']:g}**.\n",
             "| scale | diverged seeds | held-out bits/byte (mean ± s.e.) | "
             + " | ".join(f"travel/{g}" for g in groups) + " |",
             "| ---: | ---: | ---: | " + " | ".join("---:" for _ in groups) + " |"]
    for r in rows:
        lines.append(f"| {r['scale']:g} | {r['diverged']} | {r['bits_per_byte']:.4f} ± {r['sem']:.4f} | "
                     + " | ".join(f"{r['travel'].get(g, float('nan')):.3g}" for g in groups) + " |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
