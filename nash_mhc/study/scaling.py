"""``python -m nash_mhc.study scaling``: held-out bits per byte vs training FLOPs over sizes, a power law per variant.

- **Sizes**: ``--sizes D:L:H ...`` (width, layers, heads) as overrides of the ``--model`` preset at
  ``--seq-len``; the default ladder 32:2:2 48:2:2 64:3:4 80:3:4 96:4:4 spans 33k-443k non-embedding parameters
  for plain+full (``tiny`` is 64:2:4, ``small`` 256:4:4).
- **Tokens**: a run of a model with N non-embedding parameters (every parameter but the token embedding and an
  untied LM head, counted by declared role, ``nash_mhc.model.param_counts``) trains
  ceil(r N / (batch x seq_len)) steps, r = ``--tokens-per-param`` (20, the Chinchilla ratio); each variant
  counts its own N, so at one size a variant with more parameters trains on more tokens.
- **Compute**: C = ``ModelConfig.flops_per_token`` (forward + backward, attention included) x tokens trained.
- **Held-out**: bits per byte on evaluation batches [0, ``--eval-batches``) of the held-out part, the same
  windows for every run (``--window-seed 0``). One run (``--seed``) per variant and size, at one learning rate
  (``--learning-rate``, not tuned per size: the report says so).
- **Fit**: ``bpb = a C^-b`` per variant by least squares in log-log coordinates, with the parameters' covariance
  (:mod:`nash_mhc.study.powerlaw`, which says why not ``a C^-b + c``); where the fitted curves of the baseline and
  each other variant cross, with the caveat of the fitted range.

Runs live in ``<out>/runs/<variant>/d<D>-L<L>-h<H>``; finished runs are skipped, interrupted ones resume from
their checkpoints when the command is rerun.

Default size: five model sizes per variant at ``--seq-len 256``, batch 8, each trained to r = 20 tokens per
parameter; mhc+nash's steps take several times plain+full's, so its runs dominate the cost. The report records
every run's seconds per step and wall time (``s/step``, ``wall``); the pilot measurements behind the default size
are in docs/results/cpu_throughput/README.md ("Moved from docstrings").
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
from nash_mhc.study import report, scaling_report
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
from nash_mhc.study.variants import BASELINE, FULL_MODEL, split, variant_flags

DEFAULT_SIZES = ("32:2:2", "48:2:2", "64:3:4", "80:3:4", "96:4:4")


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every run of one scaling study shares (kept in ``<out>/study.json``)."""

    model: str
    seq_len: int
    tokens_per_param: float
    batch_size: int
    learning_rate: float
    warmup_fraction: float
    seed: int
    dataset: str
    tokenizer: str
    dataset_name: str | None
    eval_batches: int
    eval_batch_size: int
    train_args: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Run:
    variant: str
    size: str  # "D:L:H"

    @property
    def dims(self) -> dict[str, int]:
        d, layers, heads = map(int, self.size.split(":"))
        return {"d_model": d, "num_layers": layers, "num_heads": heads}

    @property
    def name(self) -> str:
        return f"{self.variant} {self.size}"

    def directory(self, out: Path) -> Path:
        dims = self.dims
        return out / "runs" / self.variant / f"d{dims['d_model']}-L{dims['num_layers']}-h{dims['num_heads']}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out-dir", default="runs/study/scaling", help="where runs, results.json, report.md and "
                   "scaling.png go; rerunning with the same directory resumes")
    p.add_argument("--model", default="tiny", help="preset the sizes override (vocabulary, streams, scales)")
    p.add_argument("--seq-len", type=int, default=256, help="context length of every run")
    p.add_argument("--sizes", nargs="+", default=list(DEFAULT_SIZES), help="model sizes as width:layers:heads")
    p.add_argument("--variants", nargs="+", default=[BASELINE, FULL_MODEL],
                   help="<residual>+<attention> variants (attention: full, nash, gate, convex)")
    p.add_argument("--tokens-per-param", type=float, default=20.0, help="training tokens per non-embedding "
                   "parameter of each run")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--learning-rate", type=float, default=3e-3, help="peak learning rate of every run")
    p.add_argument("--warmup-fraction", type=float, default=0.1, help="linear warmup as a fraction of a run's steps")
    p.add_argument("--seed", type=int, default=0, help="seed of every run (initialisation and data order)")
    p.add_argument("--dataset", default="stdlib", help="training data (any --dataset of nash_mhc.train)")
    p.add_argument("--dataset-name", help="configuration name of a Hugging Face dataset")
    p.add_argument("--tokenizer", default="bytes", help="tokenizer (any --tokenizer of nash_mhc.train)")
    p.add_argument("--eval-batches", type=int, default=32, help="held-out batches [0, N) evaluated")
    p.add_argument("--eval-batch-size", type=int, default=8, help="sequences per held-out batch")
    p.add_argument("--train-args", default="", help="further flags for every training run, one string")
    p.add_argument("--log-interval", type=int, default=20, help="steps between logged losses")
    p.add_argument("--checkpoint-interval", type=int, default=200, help="steps between checkpoints")
    add_compile_cache_argument(p)
    report.add_common_arguments(p)


def settings_from_args(args: argparse.Namespace) -> Settings:
    for name in ("seq_len", "batch_size", "eval_batches", "eval_batch_size", "log_interval", "checkpoint_interval"):
        if getattr(args, name) < 1:
            raise StudyError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not (args.tokens_per_param > 0 and args.learning_rate > 0 and 0 <= args.warmup_fraction <= 1):
        raise StudyError("--tokens-per-param and --learning-rate must be > 0 and --warmup-fraction in [0, 1]")
    if args.model not in ModelConfig.PRESETS:
        raise StudyError(f"unknown --model {args.model!r}; choose one of {', '.join(ModelConfig.PRESETS)}")
    for name in ("sizes", "variants"):
        if len(set(getattr(args, name))) != len(getattr(args, name)):
            raise StudyError(f"--{name} must be distinct, got {getattr(args, name)}")
    if len(args.sizes) < 3:
        raise StudyError(f"--sizes needs at least 3 sizes for a fit with an uncertainty, got {len(args.sizes)}")
    for variant in args.variants:
        try:
            split(variant)
        except ValueError as error:
            raise StudyError(f"--variants: {error}") from None
    for size in args.sizes:
        parts = size.split(":")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise StudyError(f"--sizes takes width:layers:heads of positive integers, got {size!r}")
        try:
            ModelConfig.preset(args.model, seq_len=args.seq_len, **Run("plain+full", size).dims)
        except ValueError as error:
            raise StudyError(f"--sizes {size}: {error}") from None
    try:
        train_args = tuple(shlex.split(args.train_args))
    except ValueError as error:
        raise StudyError(f"cannot parse --train-args: {error}") from None
    return Settings(model=args.model, seq_len=args.seq_len, tokens_per_param=args.tokens_per_param,
                    batch_size=args.batch_size, learning_rate=args.learning_rate,
                    warmup_fraction=args.warmup_fraction, seed=args.seed, dataset=args.dataset,
                    tokenizer=args.tokenizer, dataset_name=args.dataset_name, eval_batches=args.eval_batches,
                    eval_batch_size=args.eval_batch_size, train_args=train_args)


def train_command(settings: Settings, run: Run, steps: int, checkpoint_dir: Path,
                  args: argparse.Namespace) -> list[str]:
    dims = run.dims
    command = python_module(
        "nash_mhc.train", "--model", settings.model, "--seq-len", settings.seq_len, "--d-model", dims["d_model"],
        "--num-layers", dims["num_layers"], "--num-heads", dims["num_heads"], *variant_flags(run.variant),
        "--seed", settings.seed, "--total-steps", steps, "--batch-size", settings.batch_size,
        "--learning-rate", settings.learning_rate, "--warmup-steps", math.floor(settings.warmup_fraction * steps),
        "--dataset", settings.dataset, "--tokenizer", settings.tokenizer, "--checkpoint-dir", checkpoint_dir,
        "--checkpoint-interval", args.checkpoint_interval, "--log-interval", args.log_interval,
        "--compile-cache-dir", args.compile_cache_dir, "--no-progress")
    if settings.dataset_name:
        command += ["--dataset-name", settings.dataset_name]
    return command + list(settings.train_args)


def plan(settings: Settings, run: Run, args: argparse.Namespace) -> dict[str, Any]:
    """A run's model and budget: non-embedding parameters N, steps = ceil(r N / tokens per step), tokens and
    training FLOPs C (from the model the training command builds)."""
    from nash_mhc.model import param_counts

    configs = resolved_configs(train_command(settings, run, 1, Path("unused"), args))
    config = configs.model
    counts = param_counts(config)
    non_embedding = sum(counts.values()) - counts["embedding"] - counts["head"]
    per_step = configs.train.batch_size * config.seq_len  # sequences per update (accumulation included)
    steps = max(1, math.ceil(settings.tokens_per_param * non_embedding / per_step))
    return {"params": sum(counts.values()), "non_embedding_params": non_embedding, "steps": steps,
            "tokens": steps * per_step, "flops_per_token": config.flops_per_token(),
            "compute": config.flops_per_token() * steps * per_step}


def execute(runner: ChildRunner, settings: Settings, run: Run, budget: dict[str, Any], out: Path,
            args: argparse.Namespace) -> dict[str, Any]:
    """Train and evaluate one run (its result read back when it exists); Stopped after a signal, Failed else."""
    directory = run.directory(out)
    if (directory / "result.json").exists():
        return read_json(directory / "result.json")
    child = ChildRun(directory, runner, run.name)
    status, evaluation = "finished", None
    try:
        child.train(train_command(settings, run, budget["steps"], child.checkpoint_dir, args), budget["steps"])
        evaluation = child.evaluate(f"report-step{budget['steps']}", budget["steps"], first_batch=0,
                                    num_batches=settings.eval_batches, batch_size=settings.eval_batch_size,
                                    compile_cache_dir=args.compile_cache_dir)
    except Diverged:
        status = "diverged"
    records = child.records()
    result = {"variant": run.variant, "size": run.size, **run.dims, **budget, "status": status,
              "bits_per_byte": evaluation["bits_per_byte"] if evaluation else None, "evaluation": evaluation,
              "travel": travel(records), "final_train_loss": records[-1]["loss"] if records else None,
              "last_step": child.last_step(), "step_time_s": median_step_time(records), "wall_s": child.wall_s(),
              "sessions": len(child.sessions())}
    write_json(directory / "result.json", result)
    return result


def main(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    out = Path(args.out_dir)
    runs = [Run(v, size) for size in args.sizes for v in args.variants]  # size by size: a cut-short study compares
    started = time.perf_counter()
    with study_directory(out, dataclasses.asdict(settings)):
        budgets = {run: plan(settings, run, args) for run in runs}
        runner = ChildRunner()
        results: dict[Run, dict[str, Any]] = {}
        failures: list[str] = []
        try:
            with tqdm(total=len(runs), unit="run", disable=args.no_progress, dynamic_ncols=True) as bar:
                for run in runs:
                    bar.set_postfix_str(f"{run.name} ({budgets[run]['steps']} steps)")
                    try:
                        results[run] = execute(runner, settings, run, budgets[run], out, args)
                    except Stopped:
                        break
                    except Failed as error:
                        failures.append(str(error))
                        tqdm.write(f"failed: {error}")
                    bar.update(1)
        finally:
            runner.close()
        scaling_report.write_outputs(args, settings, runs, budgets, results, time.perf_counter() - started)
    if runner.stopped:
        print(f"stopped by a signal after {len(results)} of {len(runs)} runs; rerun the same command to continue")
        return 0
    for message in failures:
        print(f"failed: {message}")
    print(f"{len(results)} of {len(runs)} runs finished; wrote {report.report_dir(args) / 'report.md'}")
    return 1 if failures else 0
