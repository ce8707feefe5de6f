"""``python -m nash_mhc.study ablation``: model variants trained for the same tokens, held-out bits per byte.

Every run (one grid cell, one seed) is a ``python -m nash_mhc.train`` child process in
``<out>/runs/<residual>-<attention>/seed<k>/train`` followed by ``python -m nash_mhc.evaluate`` of its final
checkpoint. All runs share the preset, steps, batch, learning rate and data; the runs of one seed share the
initialisation seed, the order of the training batches and the held-out eval batches, so per-seed differences
between cells are paired. A run is finished once its ``result.json`` exists and is then never re-run; an
interrupted run (crash, preemption, SIGTERM) continues from its latest checkpoint when the command is rerun.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from nash_mhc.cli import add_compile_cache_argument
from nash_mhc.config import ModelConfig
from nash_mhc.model import num_params
from nash_mhc.study import report
from nash_mhc.study.runner import (
    ChildRunner,
    StudyError,
    mean_std,
    pm,
    python_module,
    read_json,
    study_directory,
    write_json,
)
from nash_mhc.study.variants import ATTENTION_LABELS, ATTENTIONS, RESIDUALS, attention_flags

EXIT_NONFINITE = 3  # the training program's exit code for a loss that stayed non-finite
FINAL_LOSS_FRACTION = 0.1  # "final train loss": mean of the logged losses over this last fraction of the steps


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every run of one study shares (kept in ``<out>/study.json``; a rerun must agree with it)."""

    model: str
    steps: int
    batch_size: int
    learning_rate: float
    warmup_steps: int | None
    dataset: str
    tokenizer: str
    dataset_name: str | None
    eval_batches: int
    eval_batch_size: int
    train_args: tuple[str, ...]

    @property
    def tokens_label(self) -> str:
        return f"{self.steps} steps x {self.batch_size} sequences"


@dataclasses.dataclass(frozen=True)
class Run:
    """One grid cell (residual, attention variant) at one seed."""

    residual: str
    attention: str
    seed: int

    @property
    def cell(self) -> str:
        return f"{self.residual}-{self.attention}"

    def directory(self, out: Path) -> Path:
        return out / "runs" / self.cell / f"seed{self.seed}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out-dir", default="runs/study/ablation", help="where runs, results.json, results.md and "
                   "loss_curves.png go; rerunning with the same directory resumes")
    p.add_argument("--model", default="small", help=f"model preset: {', '.join(ModelConfig.PRESETS)}")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps per run (the same tokens for all)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--learning-rate", type=float, default=1e-3, help="peak learning rate of every run")
    p.add_argument("--warmup-steps", type=int, help="warmup steps (None: the training program's default)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="seeds (initialisation and data order)")
    p.add_argument("--residual", nargs="+", choices=RESIDUALS, default=list(RESIDUALS), help="residual modes")
    p.add_argument("--attention", nargs="+", choices=tuple(ATTENTIONS), default=list(ATTENTIONS),
                   help="attention variants: full, nash (multiscale+nash), convex (multiscale+convex)")
    p.add_argument("--dataset", default="stdlib", help="training data (any --dataset of nash_mhc.train)")
    p.add_argument("--dataset-name", help="configuration name of a Hugging Face dataset")
    p.add_argument("--tokenizer", default="bytes", help="tokenizer (any --tokenizer of nash_mhc.train)")
    p.add_argument("--eval-batches", type=int, default=32,
                   help="held-out batches per evaluation (0: the whole eval split)")
    p.add_argument("--eval-batch-size", type=int, default=8, help="sequences per held-out batch")
    p.add_argument("--train-args", default="", help="further flags for every training run, one string "
                   "(e.g. \"--dtype bfloat16 --grad-clip 0.5\"); part of the study's settings")
    p.add_argument("--mesh-data", type=int, default=-1, help="data-parallel mesh axis (-1: the rest)")
    p.add_argument("--mesh-fsdp", type=int, default=1, help="FSDP mesh axis")
    p.add_argument("--mesh-tp", type=int, default=1, help="tensor-parallel mesh axis")
    p.add_argument("--log-interval", type=int, default=10, help="steps between logged losses (the curves)")
    p.add_argument("--checkpoint-interval", type=int, default=100, help="steps between checkpoints (how much "
                   "an interrupted run repeats at most)")
    add_compile_cache_argument(p)
    report.add_common_arguments(p)


def settings_from_args(args: argparse.Namespace) -> Settings:
    for name in ("steps", "batch_size", "eval_batch_size", "log_interval", "checkpoint_interval"):
        if getattr(args, name) < 1:
            raise StudyError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.eval_batches < 0:
        raise StudyError(f"--eval-batches must be >= 0 (0: the whole eval split), got {args.eval_batches}")
    if args.model not in ModelConfig.PRESETS:
        raise StudyError(f"unknown --model {args.model!r}; choose one of {', '.join(ModelConfig.PRESETS)}")
    if len(set(args.seeds)) != len(args.seeds) or min(args.seeds) < 0:
        raise StudyError(f"--seeds must be distinct non-negative integers, got {args.seeds}")
    try:
        train_args = tuple(shlex.split(args.train_args))
    except ValueError as error:
        raise StudyError(f"cannot parse --train-args: {error}") from None
    return Settings(model=args.model, steps=args.steps, batch_size=args.batch_size,
                    learning_rate=args.learning_rate, warmup_steps=args.warmup_steps, dataset=args.dataset,
                    tokenizer=args.tokenizer, dataset_name=args.dataset_name, eval_batches=args.eval_batches,
                    eval_batch_size=args.eval_batch_size, train_args=train_args)


def train_command(settings: Settings, run: Run, checkpoint_dir: Path, args: argparse.Namespace) -> list[str]:
    """The ``python -m nash_mhc.train`` command line of one run (rerunning it resumes the run)."""
    command = python_module(
        "nash_mhc.train", "--model", settings.model, "--residual", run.residual, *attention_flags(run.attention),
        "--seed", run.seed, "--total-steps", settings.steps, "--batch-size", settings.batch_size,
        "--learning-rate", settings.learning_rate, "--dataset", settings.dataset, "--tokenizer", settings.tokenizer,
        "--mesh-data", args.mesh_data, "--mesh-fsdp", args.mesh_fsdp, "--mesh-tp", args.mesh_tp,
        "--checkpoint-dir", checkpoint_dir, "--checkpoint-interval", args.checkpoint_interval,
        "--log-interval", args.log_interval, "--compile-cache-dir", args.compile_cache_dir, "--no-progress")
    if settings.warmup_steps is not None:
        command += ["--warmup-steps", str(settings.warmup_steps)]
    if settings.dataset_name:
        command += ["--dataset-name", settings.dataset_name]
    return command + list(settings.train_args)


def eval_command(settings: Settings, checkpoint_dir: Path, args: argparse.Namespace) -> list[str]:
    """``python -m nash_mhc.evaluate`` of the run's final checkpoint on the held-out split."""
    return python_module("nash_mhc.evaluate", "--checkpoint-dir", checkpoint_dir, "--step", settings.steps,
                         "--num-batches", settings.eval_batches, "--batch-size", settings.eval_batch_size,
                         "--compile-cache-dir", args.compile_cache_dir)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Training records of ``metrics.jsonl`` (those with a loss), one per step: a step logged again after a
    resume keeps its latest record."""
    if not path.exists():
        return []
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line) if line.strip() else {}
        if "loss" in record:
            by_step[int(record["step"])] = record
    return [by_step[step] for step in sorted(by_step)]



def _median_step_time(records: list[dict[str, Any]]) -> float | None:
    """Median seconds per step over the logged steps that timed one (a session's first step is its compile and
    logs none)."""
    times = [r["step_time_s"] for r in records if r.get("step_time_s") is not None]
    return float(np.median(times)) if times else None

def summarise(settings: Settings, run: Run, directory: Path, evaluation: dict[str, Any] | None,
              status: str) -> dict[str, Any]:
    """The run's ``result.json``: its held-out evaluation, curve, size, cost and wall time."""
    resolved = read_json(directory / "train" / "config.json")
    config = ModelConfig.from_dict(resolved["model_config"])
    records = read_metrics(directory / "train" / "metrics.jsonl")
    tail = [r["loss"] for r in records if r["step"] > (1 - FINAL_LOSS_FRACTION) * settings.steps] or \
        [r["loss"] for r in records[-1:]]
    sessions = [json.loads(line) for line in (directory / "sessions.jsonl").read_text().splitlines()]
    return {
        **dataclasses.asdict(run), "status": status,
        "bits_per_byte": evaluation["bits_per_byte"] if evaluation else None,
        "eval_loss": evaluation["loss"] if evaluation else None,
        "eval_tokens": evaluation["tokens"] if evaluation else None,
        "eval_bytes": evaluation["bytes"] if evaluation else None,
        "final_train_loss": float(np.mean(tail)) if tail else None,
        "last_step": records[-1]["step"] if records else 0,
        "params": num_params(config), "flops_per_token": config.flops_per_token(),
        "tokens_trained": settings.steps * int(resolved["train_config"]["batch_size"]) * config.seq_len,
        "step_time_s": _median_step_time(records),
        "wall_s": sum(s["wall_s"] for s in sessions), "sessions": len(sessions),
        "curve": [[r["step"], r["loss"]] for r in records],
    }


def execute(runner: ChildRunner, settings: Settings, run: Run, out: Path,
            args: argparse.Namespace) -> tuple[str, dict[str, Any] | str | None]:
    """Bring one run to its result: ``("skipped"|"finished", result)``, ``("stopped", None)`` after a
    signal, or ``("failed", message)``."""
    directory = run.directory(out)
    if (directory / "result.json").exists():
        return "skipped", read_json(directory / "result.json")
    directory.mkdir(parents=True, exist_ok=True)
    checkpoint_dir = directory / "train"

    def session(program: str, code: int, wall: float) -> None:
        with open(directory / "sessions.jsonl", "a") as file:
            file.write(json.dumps({"program": program, "exit_code": code, "wall_s": wall, "time": time.time()})
                       + "\n")

    code, wall, _ = runner.run(train_command(settings, run, checkpoint_dir, args), directory / "train.log")
    session("train", code, wall)
    if code == EXIT_NONFINITE:  # a result: the loss diverged (rerunning would diverge again)
        result = summarise(settings, run, directory, None, "diverged")
        write_json(directory / "result.json", result)
        return "finished", result
    if code == 2:
        lines = (directory / "train.log").read_text().strip().splitlines()
        raise StudyError(f"the training program rejected the run's flags: {lines[-1] if lines else '?'}")
    if code != 0:
        return "failed", f"{run.cell} seed {run.seed}: training exited {code}, see {directory / 'train.log'}"
    records = read_metrics(checkpoint_dir / "metrics.jsonl")
    last = records[-1]["step"] if records else 0
    if last < settings.steps:
        if runner.stopped:
            return "stopped", None
        return "failed", f"{run.cell} seed {run.seed}: training stopped at step {last} of {settings.steps}"
    code, wall, stdout = runner.run(eval_command(settings, checkpoint_dir, args), directory / "eval.log", capture=True)
    session("evaluate", code, wall)
    if runner.stopped and code != 0:
        return "stopped", None
    lines = stdout.strip().splitlines()
    evaluation = json.loads(lines[-1]) if code == 0 and lines else None
    if evaluation is None or evaluation.get("step") != settings.steps:
        return "failed", f"{run.cell} seed {run.seed}: evaluation exited {code}, see {directory / 'eval.log'}"
    result = summarise(settings, run, directory, evaluation, "finished")
    write_json(directory / "result.json", result)
    return "finished", result


def cell_rows(runs: list[Run], results: dict[Run, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per grid cell: mean ± std over its finished seeds, and the bits-per-byte difference to the
    first cell (the baseline; plain-full in the default grid) paired by seed."""
    cells = list(dict.fromkeys((r.residual, r.attention) for r in runs))
    by_cell = {c: [results[r] for r in runs if (r.residual, r.attention) == c and r in results] for c in cells}
    base = {res["seed"]: res["bits_per_byte"] for res in by_cell[cells[0]] if res["status"] == "finished"}
    rows = []
    for residual, attention in cells:
        done = by_cell[(residual, attention)]
        ok = [res for res in done if res["status"] == "finished"]
        bpb = [res["bits_per_byte"] for res in ok]
        delta = [res["bits_per_byte"] - base[res["seed"]] for res in ok if res["seed"] in base]
        losses = [res["final_train_loss"] for res in ok]
        first = done[0] if done else {}
        rows.append({
            "residual": residual, "attention": attention, "attention_label": ATTENTION_LABELS[attention],
            "seeds": [res["seed"] for res in ok],
            "diverged_seeds": [res["seed"] for res in done if res["status"] == "diverged"],
            "bits_per_byte": mean_std(bpb), "delta_bits_per_byte": mean_std(delta),
            "final_train_loss": mean_std(losses), "params": first.get("params"),
            "flops_per_token": first.get("flops_per_token"), "tokens_trained": first.get("tokens_trained"),
            "wall_s": mean_std([res["wall_s"] for res in done]), "step_time_s": mean_std(
                [res["step_time_s"] for res in done if res["step_time_s"] is not None]),
            "baseline": f"{cells[0][0]}-{cells[0][1]}",
        })
    return rows


def write_outputs(out: Path, args: argparse.Namespace, settings: Settings, runs: list[Run],
                  results: dict[Run, dict[str, Any]], rows: list[dict[str, Any]], invocation_s: float) -> None:
    """``results.json``, ``results.md`` and ``loss_curves.png`` of the ablation (whatever has finished) in
    ``--report-dir``; ``out`` holds the runs."""
    from nash_mhc.study import plots

    info = report.machine(report.device_line([r.directory(out) / "train.log" for r in runs]))
    out = report.report_dir(args)
    total_s = sum(res["wall_s"] for res in results.values())
    complete = len(results) == len(runs)
    write_json(out / "results.json", {
        "command": args.command_line, "note": args.note, "machine": info,
        "settings": dataclasses.asdict(settings), "seeds": args.seeds, "complete": complete,
        "runs_finished": len(results), "runs_total": len(runs), "run_wall_s": total_s,
        "invocation_wall_s": invocation_s, "cells": rows, "runs": list(results.values())})
    plots.ablation_figure(rows, [results[r] for r in runs if r in results], out / "loss_curves.png")

    tokens = rows[0]["tokens_trained"] if rows and rows[0]["tokens_trained"] else None
    eval_what = ("the whole held-out split" if settings.eval_batches == 0 else
                 f"{settings.eval_batches} held-out batches of {settings.eval_batch_size} sequences")
    lines = report.header("Ablation: held-out bits per byte at equal training tokens", args, info,
                   f"Wall time: {report.duration(total_s)} summed over the runs ({len(results)} of {len(runs)} "
                   f"finished{'' if complete else '; rerun the command to continue'}).")
    lines += [f"Every run: preset `{settings.model}`, {settings.tokens_label}"
              + (f" = {tokens:,} training tokens" if tokens else "")
              + f", peak learning rate {settings.learning_rate:g}, data `{settings.dataset}` / `{settings.tokenizer}`"
              + (f", extra flags `{' '.join(settings.train_args)}`" if settings.train_args else "")
              + f"; seeds {', '.join(map(str, args.seeds))}. Held-out bits per byte from `python -m nash_mhc.evaluate` "
              f"on {eval_what} (the same batches for every cell of a seed).", "",
              "Columns: mean ± sample std over seeds; Δ is each seed's difference to the first row's run of the "
              f"same seed (paired); final train loss is the mean logged loss over the last "
              f"{100 * FINAL_LOSS_FRACTION:g} % of the steps; FLOPs/token counts forward + backward (`ModelConfig."
              "flops_per_token`); wall is per run (training + evaluation, all sessions).", ""]
    table = []
    for row in rows:
        diverged = f" ({len(row['diverged_seeds'])} diverged)" if row["diverged_seeds"] else ""
        table.append([row["residual"], row["attention_label"], f"{len(row['seeds'])}{diverged}",
                      pm(*row["bits_per_byte"], digits=4), pm(*row["delta_bits_per_byte"], digits=4),
                      pm(*row["final_train_loss"]), report.millions(row["params"]),
                      report.millions(row["flops_per_token"]),
                      f"{row['tokens_trained']:,}" if row["tokens_trained"] else "n/a",
                      pm(*row["step_time_s"], digits=3), pm(*row["wall_s"], digits=0)])
    delta = f"Δ vs {rows[0]['baseline']}" if rows else "Δ"
    lines += report.markdown_table(["residual", "attention", "seeds", "held-out bits/byte", delta,
                                    "final train loss", "params", "FLOPs/token", "tokens", "s/step (median)",
                                    "wall s/run"], table)
    lines += ["", "![training loss curves](loss_curves.png)", ""]
    (out / "results.md").write_text("\n".join(lines))


def main(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    out = Path(args.out_dir)
    started = time.perf_counter()
    with study_directory(out, dataclasses.asdict(settings)):
        # seed by seed: a study cut short still has every cell of its first seeds (paired comparisons)
        runs = [Run(r, a, s) for s in args.seeds for r in args.residual for a in args.attention]
        runner = ChildRunner()
        results: dict[Run, dict[str, Any]] = {}
        failures: list[str] = []
        try:
            with tqdm(total=len(runs), unit="run", disable=args.no_progress, dynamic_ncols=True) as bar:
                for run in runs:
                    if runner.stopped:
                        break
                    bar.set_postfix_str(f"{run.cell} seed {run.seed}")
                    outcome, value = execute(runner, settings, run, out, args)
                    if outcome in ("skipped", "finished"):
                        results[run] = value
                        bar.update(1)
                    elif outcome == "failed":
                        failures.append(value)
                        tqdm.write(f"failed: {value}")
                        bar.update(1)
        finally:
            runner.close()
        rows = cell_rows(runs, results)
        write_outputs(out, args, settings, runs, results, rows, time.perf_counter() - started)
    if runner.stopped:
        print(f"stopped by a signal after {len(results)} of {len(runs)} runs; rerun the same command to continue")
        return 0
    for message in failures:
        print(f"failed: {message}")
    print(f"{len(results)} of {len(runs)} runs finished; wrote {report.report_dir(args) / 'results.md'}")
    return 1 if failures else 0
