"""``python -m nash_mhc.study ablation``: variants, each at its best learning rate, at equal tokens and equal FLOPs.

The design is fixed here, before any run (the report restates it above its numbers):

- **Variants**: the grid ``--residual`` x ``--attention`` (default: plain / hc / mhc / mhc-lite x full /
  multiscale+nash / multiscale+gate / multiscale+convex, 16 variants); the first is the baseline (plain+full).
- **Learning rate, chosen per variant**: one run per ``--learning-rates`` value at the first seed; the chosen
  rate is the one whose run has the lowest held-out bits per byte on the *selection* split at step S (a run
  whose loss diverged is never chosen; a tie goes to the smaller rate); the other ``--seeds`` train at it.
- **Two disjoint held-out splits**: evaluation batches [0, N_sel) of the held-out part select, batches
  [N_sel, N_sel + N_rep) are reported (``python -m nash_mhc.evaluate --first-batch``); every run reads the
  same windows in the same order (``--window-seed 0``), so the splits are disjoint and comparisons paired.
- **Equal tokens**: every run trains S = ``--steps`` steps of ``--batch-size`` sequences of ``--seq-len``
  tokens on one cosine schedule of S steps; its report-split bits per byte at step S.
- **Equal FLOPs**: a variant costlier per token than the baseline (F_v > F_base, ``ModelConfig.flops_per_token``
  of the run's resolved model) is also evaluated at s_v = floor(S * F_base / F_v), where its training FLOPs equal
  the baseline's total: it trains as two sessions, ``--total-steps s_v --lr-schedule-steps S``, is evaluated, and
  resumes with ``--total-steps S``. That point is read mid-schedule, before its learning rate has decayed.
- Deltas are paired by seed against the baseline at its own chosen rate; mean and sample std over seeds.
  Coefficient travel (``travel/<group>`` of the run's last metrics line) is reported with each result.

Runs live in ``<out>/runs/<variant>/lr<rate>/seed<k>`` (:mod:`nash_mhc.study.child_runs`); a finished run
(``result.json``) is never re-run and an interrupted one continues from its checkpoint when the command is rerun.

Default size: 16 x (3 + 2) = 80 runs of S = 700 steps of ``tiny`` at ``--seq-len 256``, batch 8, hours on the
shared 2-core VM; mhc+nash's steps take several times plain+full's. The report records every run's wall time and the
study's (``run_wall_s``, ``invocation_wall_s``); the pilot measurements behind the default size are in
docs/results/cpu_throughput/README.md ("Moved from docstrings").
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import shlex
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from nash_mhc.cli import add_compile_cache_argument
from nash_mhc.config import ModelConfig
from nash_mhc.study import ablation_report, report
from nash_mhc.study.child_runs import (
    ChildRun,
    Diverged,
    Failed,
    Stopped,
    median_step_time,
    resolved_configs,
    travel,
)
from nash_mhc.study.runner import ChildRunner, StudyError, python_module, read_json, study_directory, write_json
from nash_mhc.study.variants import ATTENTIONS, RESIDUALS, split, variant_flags

FINAL_LOSS_FRACTION = 0.1  # "final train loss": mean of the logged losses over this last fraction of the steps


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every run of one study shares (kept in ``<out>/study.json``; a rerun must agree with it)."""

    model: str
    seq_len: int
    steps: int
    batch_size: int
    warmup_steps: int | None
    dataset: str
    tokenizer: str
    dataset_name: str | None
    selection_batches: int
    report_batches: int
    eval_batch_size: int
    train_args: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Run:
    """One variant at one learning rate and seed."""

    variant: str
    learning_rate: float
    seed: int

    @property
    def name(self) -> str:
        return f"{self.variant} lr {self.learning_rate:g} seed {self.seed}"

    def directory(self, out: Path) -> Path:
        return out / "runs" / self.variant / f"lr{self.learning_rate:g}" / f"seed{self.seed}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out-dir", default="runs/study/ablation", help="where runs, results.json, results.md and "
                   "the figure go; rerunning with the same directory resumes")
    p.add_argument("--model", default="tiny", help=f"model preset: {', '.join(ModelConfig.PRESETS)}")
    p.add_argument("--seq-len", type=int, default=256, help="context length of every run (long enough for the "
                   "coarse attention scales to see long-range context)")
    p.add_argument("--steps", type=int, default=700, help="optimizer steps per run, S (the same tokens for all)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--learning-rates", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2],
                   help="peak learning rates tried per variant at the first seed (a log grid)")
    p.add_argument("--warmup-steps", type=int, help="warmup steps (None: the training program's default, 10%% "
                   "of the schedule)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds (initialisation and data "
                   "order); the first one also runs the learning-rate sweep")
    p.add_argument("--residual", nargs="+", choices=RESIDUALS, default=list(RESIDUALS), help="residual modes")
    p.add_argument("--attention", nargs="+", choices=tuple(ATTENTIONS), default=list(ATTENTIONS),
                   help="attention variants: full, nash / gate / convex (multiscale with that aggregation)")
    p.add_argument("--dataset", default="stdlib", help="training data (any --dataset of nash_mhc.train)")
    p.add_argument("--dataset-name", help="configuration name of a Hugging Face dataset")
    p.add_argument("--tokenizer", default="bytes", help="tokenizer (any --tokenizer of nash_mhc.train)")
    p.add_argument("--selection-batches", type=int, default=16, help="held-out batches [0, N) that choose the "
                   "learning rate")
    p.add_argument("--report-batches", type=int, default=32, help="held-out batches after the selection ones "
                   "whose bits per byte are reported")
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
    for name in ("seq_len", "steps", "batch_size", "selection_batches", "report_batches", "eval_batch_size",
                 "log_interval", "checkpoint_interval"):
        if getattr(args, name) < 1:
            raise StudyError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.model not in ModelConfig.PRESETS:
        raise StudyError(f"unknown --model {args.model!r}; choose one of {', '.join(ModelConfig.PRESETS)}")
    for name in ("seeds", "learning_rates", "residual", "attention"):
        if len(set(getattr(args, name))) != len(getattr(args, name)):
            raise StudyError(f"--{name.replace('_', '-')} must be distinct, got {getattr(args, name)}")
    if min(args.seeds) < 0 or not all(0 < lr < math.inf for lr in args.learning_rates):
        raise StudyError(f"--seeds must be non-negative and --learning-rates positive, got {args.seeds} and "
                         f"{args.learning_rates}")
    try:
        train_args = tuple(shlex.split(args.train_args))
    except ValueError as error:
        raise StudyError(f"cannot parse --train-args: {error}") from None
    return Settings(model=args.model, seq_len=args.seq_len, steps=args.steps, batch_size=args.batch_size,
                    warmup_steps=args.warmup_steps, dataset=args.dataset, tokenizer=args.tokenizer,
                    dataset_name=args.dataset_name, selection_batches=args.selection_batches,
                    report_batches=args.report_batches, eval_batch_size=args.eval_batch_size,
                    train_args=train_args)


def train_command(settings: Settings, run: Run, checkpoint_dir: Path, args: argparse.Namespace,
                  total_steps: int) -> list[str]:
    """The ``python -m nash_mhc.train`` line of one run's session up to ``total_steps`` on the schedule of S
    steps (rerunning it resumes the run)."""
    command = python_module(
        "nash_mhc.train", "--model", settings.model, "--seq-len", settings.seq_len, *variant_flags(run.variant),
        "--seed", run.seed, "--total-steps", total_steps, "--lr-schedule-steps", settings.steps,
        "--batch-size", settings.batch_size, "--learning-rate", run.learning_rate, "--dataset", settings.dataset,
        "--tokenizer", settings.tokenizer, "--mesh-data", args.mesh_data, "--mesh-fsdp", args.mesh_fsdp,
        "--mesh-tp", args.mesh_tp, "--checkpoint-dir", checkpoint_dir, "--checkpoint-interval",
        args.checkpoint_interval, "--log-interval", args.log_interval, "--compile-cache-dir", args.compile_cache_dir,
        "--no-progress")
    if settings.warmup_steps is not None:
        command += ["--warmup-steps", str(settings.warmup_steps)]
    if settings.dataset_name:
        command += ["--dataset-name", settings.dataset_name]
    return command + list(settings.train_args)


def flops_steps(settings: Settings, variants: list[str], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Per variant: its FLOPs per token F_v and equal-FLOPs step s_v = floor(S * F_base / F_v) (at most S; the
    first variant is the baseline), and beside F_v the count of every op, ``flops_per_token_all`` (recorded; the
    steps still follow F_v)."""
    models = {v: resolved_configs(train_command(settings, Run(v, 1.0, 0), Path("unused"), args, settings.steps)).model
              for v in variants}
    flops = {v: m.flops_per_token() for v, m in models.items()}
    base = flops[variants[0]]
    return {v: {"flops_per_token": f, "flops_per_token_all": models[v].flops_per_token_all(),
                "step": max(1, min(settings.steps, math.floor(settings.steps * base / f))),
                "cheaper_than_baseline": f < base} for v, f in flops.items()}


def choose_learning_rate(candidates: dict[float, float | None]) -> float | None:
    """The selection rule: the rate with the lowest selection-split bits per byte; a diverged run (None or not
    finite) is never chosen; a tie goes to the smaller rate; None when every run diverged."""
    finite = {lr: bpb for lr, bpb in candidates.items() if bpb is not None and math.isfinite(bpb)}
    return min(finite, key=lambda lr: (finite[lr], lr)) if finite else None


def summarise(settings: Settings, run: Run, child: ChildRun, evals: dict[str, dict[str, Any]], status: str,
              flops_step: int) -> dict[str, Any]:
    """The run's ``result.json``: held-out evaluations, travel, curve, size, cost and wall time."""
    from nash_mhc.model import num_params

    resolved = read_json(child.checkpoint_dir / "config.json")
    config = ModelConfig.from_dict(resolved["model_config"])
    records = child.records()
    tail = [r["loss"] for r in records if r["step"] > (1 - FINAL_LOSS_FRACTION) * settings.steps] or \
        [r["loss"] for r in records[-1:]]
    tokens_per_step = int(resolved["train_config"]["batch_size"]) * config.seq_len

    def bpb(name: str) -> float | None:
        return evals[name]["bits_per_byte"] if name in evals else None

    residual, attention = split(run.variant)
    return {
        **dataclasses.asdict(run), "residual": residual, "attention": attention, "status": status,
        "bits_per_byte": bpb("report"), "selection_bits_per_byte": bpb("selection"),
        "equal_flops_step": flops_step,
        "equal_flops_bits_per_byte": bpb("report" if flops_step == settings.steps else "report_flops"),
        "evaluations": evals, "travel": travel(records),
        "final_train_loss": sum(tail) / len(tail) if tail else None, "last_step": child.last_step(),
        "params": num_params(config), "flops_per_token": config.flops_per_token(),
        "flops_per_token_all": config.flops_per_token_all(), "tokens_per_step": tokens_per_step,
        "tokens_trained": settings.steps * tokens_per_step, "step_time_s": median_step_time(records),
        "wall_s": child.wall_s(), "sessions": len(child.sessions()),
        "curve": [[r["step"], r["loss"]] for r in records],
    }


def execute(runner: ChildRunner, settings: Settings, run: Run, flops_step: int, out: Path,
            args: argparse.Namespace) -> dict[str, Any]:
    """Bring one run to its result (read back when it exists); Stopped after a signal, Failed otherwise."""
    directory = run.directory(out)
    if (directory / "result.json").exists():
        return read_json(directory / "result.json")
    child = ChildRun(directory, runner, run.name)
    S, sel, rep = settings.steps, settings.selection_batches, settings.report_batches
    evaluation = dict(batch_size=settings.eval_batch_size, compile_cache_dir=args.compile_cache_dir)
    evals: dict[str, dict[str, Any]] = {}
    status = "finished"
    try:
        if flops_step < S:  # the equal-FLOPs point: stop there, evaluate, resume on the same schedule
            child.train(train_command(settings, run, child.checkpoint_dir, args, flops_step), flops_step)
            evals["report_flops"] = child.evaluate(f"report-step{flops_step}", flops_step, first_batch=sel,
                                                   num_batches=rep, **evaluation)
        child.train(train_command(settings, run, child.checkpoint_dir, args, S), S)
        evals["selection"] = child.evaluate(f"selection-step{S}", S, first_batch=0, num_batches=sel, **evaluation)
        evals["report"] = child.evaluate(f"report-step{S}", S, first_batch=sel, num_batches=rep, **evaluation)
    except Diverged:  # a result: rerunning would diverge again
        status = "diverged"
    result = summarise(settings, run, child, evals, status, flops_step)
    write_json(directory / "result.json", result)
    return result


def main(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    out = Path(args.out_dir)
    variants = [f"{r}+{a}" for r in args.residual for a in args.attention]
    started = time.perf_counter()
    with study_directory(out, dataclasses.asdict(settings)):
        costs = flops_steps(settings, variants, args)
        first, others = args.seeds[0], args.seeds[1:]
        results: dict[Run, dict[str, Any]] = {}
        failures: list[str] = []
        runner = ChildRunner()

        def bring(run: Run, bar: tqdm) -> bool:
            """Run ``run``; False once a signal stopped the study."""
            bar.set_postfix_str(run.name)
            try:
                results[run] = execute(runner, settings, run, costs[run.variant]["step"], out, args)
            except Stopped:
                return False
            except Failed as error:
                failures.append(str(error))
                tqdm.write(f"failed: {error}")
            bar.update(1)
            return True

        chosen: dict[str, float | None] = {}
        try:
            total = len(variants) * (len(args.learning_rates) + len(others))
            with tqdm(total=total, unit="run", disable=args.no_progress, dynamic_ncols=True) as bar:
                # the sweep of every variant first, then seed by seed: a study cut short has paired comparisons
                sweep = [Run(v, lr, first) for v in variants for lr in args.learning_rates]
                going = all(bring(run, bar) for run in sweep)
                for v in variants:
                    mine = [results.get(Run(v, lr, first)) for lr in args.learning_rates]
                    if all(mine):
                        chosen[v] = choose_learning_rate(
                            {r["learning_rate"]: r["selection_bits_per_byte"] for r in mine if r is not None})
                seeded = [Run(v, chosen[v], s) for s in others for v in variants if chosen.get(v) is not None]
                going = going and all(bring(run, bar) for run in seeded)
        finally:
            runner.close()
        ablation_report.write_outputs(args, settings, variants, costs, chosen, results,
                                      time.perf_counter() - started)
    if runner.stopped or not going:
        print(f"stopped by a signal after {len(results)} runs; rerun the same command to continue")
        return 0
    for message in failures:
        print(f"failed: {message}")
    print(f"{len(results)} of {total} runs finished; wrote {report.report_dir(args) / 'results.md'}")
    return 1 if failures else 0
