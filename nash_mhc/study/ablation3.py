"""``python -m nash_mhc.study ablation3``: every rate on every seed, at equal tokens, FLOPs and wall-clock.

Every variant at every learning rate of a grid that grows while a best rate sits on its edge, on every seed.

The protocol is fixed here, before any run (the rules are :mod:`nash_mhc.study.ablation3_protocol`; the report,
:mod:`nash_mhc.study.ablation3_report`, restates it above its numbers):

- **Variants** (``--variants``, default :data:`~nash_mhc.study.variants.V3_VARIANTS`, 11): plain+full (the
  baseline), mhc+full, mhc-lite+full; mhc + multiscale + {nash, gate, convex}, each started at ``scale0`` (0.99
  on the finest scale: starts as full attention) and at ``uniform`` (every scale equal), at the default sparsity
  weight (``ModelConfig.sparsity_weight``, 0.01); and mhc+nash at sparsity 0 under both starts. So the starts are
  compared for all three aggregations, and sparsity only for the game (the variant the project is about): the
  full 3 x 2 x 2 factorial would add 4 variants of gate/convex at sparsity 0.
- **Every rate on every seed.** Each variant runs at every rate of its grid (``--learning-rates``, default 1e-3
  3e-3 1e-2) on every seed (``--seeds``, default 0 1 2). Its rate is the one with the lowest *mean over seeds*
  of the selection split's bits per byte at step S; a rate where a seed diverged is never chosen; a tie goes to
  the smaller rate. Only report-split numbers are reported.
- **Grid growth.** While a variant's best rate is the lowest or the highest of its grid, the study adds the next
  rate of the 1-3 ladder on that side (1e-2 -> 3e-2, 1e-3 -> 3e-4), runs it on every seed and chooses again;
  hard limit: at most ``--max-extra-rates`` (default 3) added rates per variant, and none outside [1e-5, 0.3].
  Every cell stays in results.json.
- **Splits**: held-out batches [0, N_sel) select, [N_sel, N_sel + N_rep) are reported, disjoint windows read
  in the same order by every run (``--window-seed 0``), so comparisons are paired by seed.
- **Equal tokens**: S = ``--steps`` steps of ``--batch-size`` x ``--seq-len`` (>= 256) tokens on one cosine
  schedule of S steps; report-split bits per byte at S.
- **Equal full FLOPs**: F_v = ``ModelConfig.flops_per_token_all()`` of the run's model when the config has it,
  else ``flops_per_token()`` (results.json names which); a costlier variant is also evaluated at s_v =
  floor(S F_base / F_v), mid-schedule (two training sessions: to s_v, evaluated, then on to S).
- **Equal wall-clock**: every run's median seconds per training step t (over the logged windows; compiles,
  start-ups and evaluations excluded) is measured on its machine. Per seed, the baseline trains S steps in
  S t_base, where t_base is the median of the baseline's step times over its finished runs of that seed (the
  step time does not depend on the rate; the baseline runs first in every seed's pass). A run has spent that
  time at w = floor(S t_base / t_v) (at most S): it is evaluated on the report split at its last checkpoint at or
  before w (checkpoints are kept every ``--checkpoint-interval`` steps, so the point is read up to one interval
  early, which favours the baseline) as soon as it finishes, so its ``result.json`` holds everything the report
  needs. Its checkpoints are then deleted (``--keep-checkpoints`` keeps them): a study spread over several
  machines' sessions carries on from the ``result.json`` files alone. The report reads the point of each
  variant's chosen rate; results.json has w, the checkpoint step and both step times.
- **Curves**: every logged step's training loss and the scale metrics (``scale_weight/<l>``, ``scale_prior/<l>``,
  ``scale_tv`` and per layer) of the last logged step and of the report evaluation at S, for every run.

Runs live in ``<out>/runs/<variant>/lr<rate>/seed<k>`` (:mod:`nash_mhc.study.child_runs`): a finished run is
never re-run, an interrupted one resumes, and the grid is recomputed from the finished runs, so a rerun continues it.

Cost on the shared 2-core VM: :data:`nash_mhc.study.ablation3_report.ESTIMATE` (hours for the default study;
the report repeats it).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import shlex
import shutil
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from nash_mhc.cli import add_compile_cache_argument
from nash_mhc.config import ModelConfig
from nash_mhc.run_config import RunConfig
from nash_mhc.study import ablation3_protocol as protocol
from nash_mhc.study import ablation3_report, report
from nash_mhc.study.child_runs import ChildRun, Diverged, Failed, Stopped, median_step_time, resolved_configs, travel
from nash_mhc.study.runner import ChildRunner, StudyError, python_module, read_json, study_directory, write_json
from nash_mhc.study.variants import V3_VARIANTS, spec3, variant_flags3

MIN_SEQ_LEN = 256  # coarse scales need long-range context to be worth using


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
    checkpoint_interval: int
    max_extra_rates: int


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
    p.add_argument("--out-dir", default="runs/study/ablation3", help="where runs, results.json and results.md go; "
                   "rerunning with the same directory resumes")
    p.add_argument("--model", default="tiny", help="model preset, tiny or wider")
    p.add_argument("--seq-len", type=int, default=256, help=f"context length of every run (>= {MIN_SEQ_LEN})")
    p.add_argument("--steps", type=int, default=700, help="optimizer steps per run, S (the same tokens for all)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--learning-rates", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2],
                   help="the starting grid of peak learning rates of every variant")
    p.add_argument("--max-extra-rates", type=int, default=protocol.MAX_EXTRA_RATES, help="the most rates the grid "
                   "of one variant may grow by while its best rate sits on an edge")
    p.add_argument("--warmup-steps", type=int, help="warmup steps (None: the training program's default)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds (initialisation and data order); "
                   "every rate of every variant runs on each")
    p.add_argument("--variants", nargs="+", default=list(V3_VARIANTS), help="variants, the baseline first: "
                   "<residual>+<attention>[@scale0|@uniform[-sp<sparsity weight>]]")
    p.add_argument("--dataset", default="stdlib", help="training data (any --dataset of nash_mhc.train)")
    p.add_argument("--dataset-name", help="configuration name of a Hugging Face dataset")
    p.add_argument("--tokenizer", default="bytes", help="tokenizer (any --tokenizer of nash_mhc.train)")
    p.add_argument("--selection-batches", type=int, default=16, help="held-out batches [0, N) that choose the rate")
    p.add_argument("--report-batches", type=int, default=32, help="held-out batches after those, reported")
    p.add_argument("--eval-batch-size", type=int, default=8, help="sequences per held-out batch")
    p.add_argument("--train-args", default="", help="further flags for every training run, one string")
    p.add_argument("--mesh-data", type=int, default=-1, help="data-parallel mesh axis (-1: the rest)")
    p.add_argument("--mesh-fsdp", type=int, default=1, help="FSDP mesh axis")
    p.add_argument("--mesh-tp", type=int, default=1, help="tensor-parallel mesh axis")
    p.add_argument("--log-interval", type=int, default=10, help="steps between logged losses (the curves)")
    p.add_argument("--checkpoint-interval", type=int, default=25, help="steps between kept checkpoints (all are "
                   "kept: the equal-wall-clock point is read at one, up to this many steps early)")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep a finished run's checkpoints (default: "
                   "deleted once its result.json, equal-wall-clock evaluation included, is written)")
    add_compile_cache_argument(p)
    report.add_common_arguments(p)


def settings_from_args(args: argparse.Namespace) -> Settings:
    for name in ("seq_len", "steps", "batch_size", "selection_batches", "report_batches", "eval_batch_size",
                 "log_interval", "checkpoint_interval"):
        if getattr(args, name) < 1:
            raise StudyError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.seq_len < MIN_SEQ_LEN or args.max_extra_rates < 0:
        raise StudyError(f"--seq-len must be >= {MIN_SEQ_LEN} and --max-extra-rates >= 0, got {args.seq_len} and "
                         f"{args.max_extra_rates}")
    if args.model not in ModelConfig.PRESETS or ModelConfig.preset(args.model).d_model < \
            ModelConfig.preset("tiny").d_model:
        raise StudyError(f"--model must be a preset of width >= tiny's, got {args.model!r}")
    for name in ("seeds", "learning_rates", "variants"):
        if len(set(getattr(args, name))) != len(getattr(args, name)):
            raise StudyError(f"--{name.replace('_', '-')} must be distinct, got {getattr(args, name)}")
    if min(args.seeds) < 0 or not all(protocol.LR_FLOOR <= lr <= protocol.LR_CEILING for lr in args.learning_rates):
        raise StudyError(f"--seeds must be non-negative and --learning-rates in [{protocol.LR_FLOOR:g}, "
                         f"{protocol.LR_CEILING:g}], got {args.seeds} and {args.learning_rates}")
    for variant in args.variants:
        try:
            spec3(variant)
        except ValueError as error:
            raise StudyError(str(error)) from None
    try:
        train_args = tuple(shlex.split(args.train_args))
    except ValueError as error:
        raise StudyError(f"cannot parse --train-args: {error}") from None
    return Settings(model=args.model, seq_len=args.seq_len, steps=args.steps, batch_size=args.batch_size,
                    warmup_steps=args.warmup_steps, dataset=args.dataset, tokenizer=args.tokenizer,
                    dataset_name=args.dataset_name, selection_batches=args.selection_batches,
                    report_batches=args.report_batches, eval_batch_size=args.eval_batch_size,
                    checkpoint_interval=args.checkpoint_interval, max_extra_rates=args.max_extra_rates,
                    train_args=train_args)


def train_command(settings: Settings, run: Run, checkpoint_dir: Path, args: argparse.Namespace,
                  total_steps: int) -> list[str]:
    """One training session of ``run`` up to ``total_steps`` on the schedule of S steps, keeping every
    checkpoint (rerunning it resumes)."""
    S = settings.steps
    command = python_module(
        "nash_mhc.train", "--model", settings.model, "--seq-len", settings.seq_len, *variant_flags3(run.variant),
        "--seed", run.seed, "--total-steps", total_steps, "--lr-schedule-steps", S, "--batch-size",
        settings.batch_size, "--learning-rate", run.learning_rate, "--dataset", settings.dataset, "--tokenizer",
        settings.tokenizer, "--mesh-data", args.mesh_data, "--mesh-fsdp", args.mesh_fsdp, "--mesh-tp", args.mesh_tp,
        "--checkpoint-dir", checkpoint_dir, "--checkpoint-interval", settings.checkpoint_interval,
        "--max-checkpoints", S // settings.checkpoint_interval + 3, "--log-interval", args.log_interval,
        "--compile-cache-dir", args.compile_cache_dir, "--no-progress")
    if settings.warmup_steps is not None:
        command += ["--warmup-steps", str(settings.warmup_steps)]
    if settings.dataset_name:
        command += ["--dataset-name", settings.dataset_name]
    return command + list(settings.train_args)


def full_flops(config: ModelConfig) -> tuple[float, str]:
    """(training FLOPs per token, the method's name): ``flops_per_token_all`` when the config has it."""
    method = getattr(config, "flops_per_token_all", None)
    if callable(method):
        return float(method()), "flops_per_token_all"
    return float(config.flops_per_token()), "flops_per_token (flops_per_token_all absent)"


def flops_steps(settings: Settings, variants: list[str], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Per variant: F_v, its method and the equal-FLOPs step s_v = floor(S F_base / F_v) (at most S)."""
    costs = {v: full_flops(resolved_configs(train_command(settings, Run(v, 1e-3, 0), Path("unused"), args,
                                                          settings.steps)).model) for v in variants}
    base = costs[variants[0]][0]
    return {v: {"flops_per_token": f, "flops_method": method,
                "step": max(1, min(settings.steps, math.floor(settings.steps * base / f)))}
            for v, (f, method) in costs.items()}


def checkpoint_steps(child: ChildRun) -> list[int]:
    directory = child.checkpoint_dir
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if directory.exists() else []


def scale_metrics(record: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in record.items() if k.startswith(("scale_weight/", "scale_prior/", "scale_tv"))}


def evaluation(settings: Settings, args: argparse.Namespace) -> dict[str, Any]:
    return dict(batch_size=settings.eval_batch_size, compile_cache_dir=args.compile_cache_dir)


def baseline_step_time(results: dict[Run, dict[str, Any]], baseline: str, seed: int) -> float | None:
    """t_base of a seed: the median step time of the baseline's finished runs of that seed (None before any)."""
    times = sorted(r["step_time_s"] for k, r in results.items()
                   if k.variant == baseline and k.seed == seed and r["status"] == "finished" and r["step_time_s"])
    if not times:
        return None
    middle = len(times) // 2
    return times[middle] if len(times) % 2 else (times[middle - 1] + times[middle]) / 2


def wallclock_point(child: ChildRun, settings: Settings, args: argparse.Namespace, bits_per_byte: float | None,
                    step_time: float | None, base_time: float | None) -> dict[str, Any] | None:
    """A finished run's equal-wall-clock point against ``base_time`` (evaluated at the checkpoint at or before w;
    the report-split value at S when that checkpoint is S); None without both step times."""
    if not step_time or not base_time:
        return None
    S = settings.steps
    w = protocol.wallclock_step(S, base_time, step_time)
    point = protocol.checkpoint_at_or_before(checkpoint_steps(child), w)
    value = bits_per_byte if point == S else None
    if point is not None and point != S:
        value = child.evaluate(f"report-step{point}", point, first_batch=settings.selection_batches,
                               num_batches=settings.report_batches, **evaluation(settings, args))["bits_per_byte"]
    return {"wallclock_step": w, "checkpoint_step": point, "bits_per_byte": value, "step_time_s": step_time,
            "baseline_step_time_s": base_time, "baseline_train_s": S * base_time}


def drop_checkpoints(child: ChildRun) -> None:
    """Delete a finished run's checkpoint folders (its metrics.jsonl and config.json stay)."""
    for step in checkpoint_steps(child):
        shutil.rmtree(child.checkpoint_dir / str(step))


def execute(runner: ChildRunner, settings: Settings, run: Run, flops_step: int, out: Path,
            args: argparse.Namespace, base_time: float | None) -> dict[str, Any]:
    """Bring one run to its ``result.json`` (read back when it exists), its equal-wall-clock point against
    ``base_time`` (the baseline's step time for this seed; the baseline itself passes None and is read at S)
    included; Stopped after a signal, Failed otherwise."""
    directory = run.directory(out)
    if (directory / "result.json").exists():
        return read_json(directory / "result.json")
    child = ChildRun(directory, runner, run.name)
    S, sel, rep = settings.steps, settings.selection_batches, settings.report_batches
    evals: dict[str, dict[str, Any]] = {}
    status = "finished"
    try:
        if flops_step < S:  # the equal-FLOPs point, mid-schedule
            child.train(train_command(settings, run, child.checkpoint_dir, args, flops_step), flops_step)
            evals["report_flops"] = child.evaluate(f"report-step{flops_step}", flops_step, first_batch=sel,
                                                   num_batches=rep, **evaluation(settings, args))
        child.train(train_command(settings, run, child.checkpoint_dir, args, S), S)
        evals["selection"] = child.evaluate(f"selection-step{S}", S, first_batch=0, num_batches=sel,
                                            **evaluation(settings, args))
        evals["report"] = child.evaluate(f"report-step{S}", S, first_batch=sel, num_batches=rep,
                                         **evaluation(settings, args))
    except Diverged:
        status = "diverged"
    records = child.records()
    resolved = RunConfig.from_dict(read_json(child.checkpoint_dir / "config.json"))  # as the run resolved it
    tokens_per_step = resolved.train.batch_size * settings.seq_len

    def bpb(name: str) -> float | None:
        return evals[name]["bits_per_byte"] if name in evals else None

    step_time = median_step_time(records)
    point = None
    if status == "finished":
        point = wallclock_point(child, settings, args, bpb("report"), step_time,
                                step_time if base_time is None else base_time)

    result = {
        **dataclasses.asdict(run), **spec3(run.variant), "status": status,
        "bits_per_byte": bpb("report"), "selection_bits_per_byte": bpb("selection"),
        "equal_flops_step": flops_step,
        "equal_flops_bits_per_byte": bpb("report" if flops_step == S else "report_flops"),
        "evaluations": evals, "travel": travel(records), "last_step": child.last_step(),
        "tokens_per_step": tokens_per_step, "tokens_trained": S * tokens_per_step,
        "step_time_s": step_time, "wall_s": child.wall_s(), "sessions": len(child.sessions()),
        "checkpoint_steps": checkpoint_steps(child), "wallclock": point, "commit": report.code_commit(),
        "curve": [[r["step"], r["loss"]] for r in records],
        "scale_use_end": {"train": scale_metrics(records[-1]) if records else {},
                          "report": scale_metrics(evals.get("report", {}))},
    }
    write_json(directory / "result.json", result)
    if not args.keep_checkpoints:
        drop_checkpoints(child)
    return result


def wallclock_points(grids: dict[str, dict[str, Any]], results: dict[Run, dict[str, Any]],
                     seeds: list[int]) -> dict[str, dict[int, dict[str, Any]]]:
    """Per variant and seed: the equal-wall-clock point of the run at the variant's chosen rate (from its
    ``result.json``; absent where that run has none)."""
    points: dict[str, dict[int, dict[str, Any]]] = {}
    for variant, grid in grids.items():
        for seed in seeds:
            mine = results.get(Run(variant, grid["best"], seed)) if grid["best"] else None
            if mine and mine.get("wallclock"):
                points.setdefault(variant, {})[seed] = mine["wallclock"]
    return points


def main(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    out, variants, seeds = Path(args.out_dir), list(args.variants), list(args.seeds)
    started = time.perf_counter()
    results: dict[Run, dict[str, Any]] = {}
    failures: list[str] = []
    failed: set[Run] = set()
    with study_directory(out, dataclasses.asdict(settings)):
        costs = flops_steps(settings, variants, args)
        runner = ChildRunner()

        def lookup(variant: str) -> Any:
            def value(lr: float, seed: int) -> Any:
                run = Run(variant, lr, seed)
                if run not in results and (run.directory(out) / "result.json").exists():
                    results[run] = read_json(run.directory(out) / "result.json")
                if run not in results:
                    return protocol.MISSING
                return results[run]["selection_bits_per_byte"] if results[run]["status"] == "finished" else None
            return value

        def grids() -> dict[str, dict[str, Any]]:
            return {v: protocol.grow_grid(args.learning_rates, seeds, lookup(v), args.max_extra_rates)
                    for v in variants}

        going, points = True, {}
        try:
            with tqdm(unit="run", disable=args.no_progress, dynamic_ncols=True) as bar:
                while going:  # each pass runs what the grids ask for; a grid grows once its runs are in
                    todo = [Run(v, lr, s) for s in seeds for v, g in grids().items() for lr in g["grid"]
                            if Run(v, lr, s) not in results and Run(v, lr, s) not in failed]
                    if not todo:
                        break
                    bar.total = len(results) + len(todo)
                    for run in todo:
                        bar.set_postfix_str(run.name)
                        try:
                            base = None if run.variant == variants[0] else \
                                baseline_step_time(results, variants[0], run.seed)
                            results[run] = execute(runner, settings, run, costs[run.variant]["step"], out, args,
                                                   base)
                        except Stopped:
                            going = False
                            break
                        except Failed as error:
                            failed.add(run)
                            failures.append(str(error))
                            tqdm.write(f"failed: {error}")
                        bar.update(1)
                if going and not runner.stopped:
                    points = wallclock_points(grids(), results, seeds)
        except Stopped:
            going = False
        finally:
            runner.close()
        ablation3_report.write_outputs(args, settings, variants, costs, grids(), results, points,
                                       time.perf_counter() - started)
    if runner.stopped or not going:
        print(f"stopped by a signal after {len(results)} runs; rerun the same command to continue")
        return 0
    for message in failures:
        print(f"failed: {message}")
    print(f"{len(results)} runs finished; wrote {report.report_dir(args) / 'results.md'}")
    return 1 if failures else 0
