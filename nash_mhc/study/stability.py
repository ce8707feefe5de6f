"""``python -m nash_mhc.study stability``: deep narrow models over learning rates, plain vs hc vs mhc vs mhc-lite.

Hyper-Connections' residual mixing matrices are unconstrained, so their product over depth can grow (or
shrink) without bound; mHC's are (approximately) doubly stochastic, mhc-lite's exactly. This study trains the
residual modes in the setting where that difference can show at small scale (many layers, small width, the
mHC paper's learning rates and higher ones, no gradient clipping or weight decay unless asked for) and records
per run:

- the training loss and gradient norm (before clipping) of every step, and every non-finite step;
- at ``--probes`` evenly spaced steps (0 and the last included), the forward and backward gains
  (:mod:`nash_mhc.study.gains`) of the composite residual mapping at every depth, max and mean over the
  tokens of one fixed held-out batch (the same for every run; the mean is the paper's measure); for mhc also the
  pre-Sinkhorn logit spread, the column sums of H_res after the model's 20 Sinkhorn iterations and after 200,
  and the gains with the 200-iteration matrices (:mod:`nash_mhc.study.sinkhorn_probe`).

Runs train in this process on the library API (``init_train_state`` / ``train_step``), at any depth. A run is
saved to ``<out>/runs/L<depth>-lr<lr>/<residual>-seed<k>.json`` when it ends and is never re-run; a run cut
short by a signal is started again from its beginning.

Default size: depths 8 and 24 x 4 learning rates x 4 residual modes x 3 seeds = 96 runs of 300 steps. The
previous published version had 36 runs (depths 8 and 24, 2 rates, 3 modes, 3 seeds); its cost, and the estimate
for the default, are in docs/results/cpu_throughput/README.md ("Moved from docstrings"), and the report records
every run's wall time.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from nash_mhc.cli import CompileCache, add_compile_cache_argument
from nash_mhc.config import ModelConfig
from nash_mhc.study import report, stability_report
from nash_mhc.study.runner import ChildRunner, StudyError, read_json, study_directory, write_json
from nash_mhc.study.stability_runs import Run, Settings, train_run
from nash_mhc.study.variants import ATTENTIONS, RESIDUALS
from nash_mhc.training.config import TrainConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out-dir", default="runs/study/stability", help="where runs, results.json, report.md and "
                   "the figures go; rerunning with the same directory skips finished runs")
    p.add_argument("--model", default="tiny", help="preset the runs start from (width, heads, context)")
    p.add_argument("--d-model", type=int, help="model width (default: the preset's)")
    p.add_argument("--seq-len", type=int, help="sequence length (default: the preset's)")
    p.add_argument("--depths", type=int, nargs="+", default=[8, 24], help="numbers of layers to sweep")
    p.add_argument("--learning-rates", type=float, nargs="+", default=[4e-4, 9e-4, 1e-2, 3e-2],
                   help="peak learning rates to sweep (4e-4 and 9e-4: the ends of the mHC paper's range, arXiv "
                   "2512.24880 Table 5)")
    p.add_argument("--residual", nargs="+", choices=RESIDUALS, default=list(RESIDUALS), help="residual modes")
    p.add_argument("--attention", choices=tuple(ATTENTIONS), default="full", help="attention of every run: full, "
                   "or nash / gate / convex (multiscale with that aggregation); the study is about the residual "
                   "stream")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds (initialisation, data order)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--warmup-steps", type=int, default=10, help="linear warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (0: nothing pulls the "
                   "residual matrices back)")
    p.add_argument("--grad-clip", type=float, default=0.0, help="global gradient-norm clip (0: none, so that "
                   "gradient blow-ups are not hidden)")
    p.add_argument("--coefficient-lr-scale", type=float, default=TrainConfig.coefficient_lr_scale,
                   help="learning-rate multiplier of the coefficient parameters (the training program's default)")
    p.add_argument("--dataset", default="stdlib", help="'stdlib', 'synthetic' or a local text corpus")
    p.add_argument("--probes", type=int, default=5, help="evenly spaced steps (first and last included) at which "
                   "the gains over depth are measured")
    p.add_argument("--probe-batch", type=int, default=4, help="held-out sequences the gains are measured on")
    p.add_argument("--eval-batches", type=int, default=16, help="held-out batches of --batch-size sequences "
                   "each finished run is evaluated on at its last step (the same windows for every run; 0: none)")
    p.add_argument("--max-nonfinite-steps", type=int, default=10,
                   help="a run stops as diverged after this many non-finite steps in a row")
    add_compile_cache_argument(p)
    report.add_common_arguments(p)


def settings_from_args(args: argparse.Namespace) -> Settings:
    for name in ("steps", "batch_size", "probe_batch", "max_nonfinite_steps"):
        if getattr(args, name) < 1:
            raise StudyError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.eval_batches < 0 or (args.seq_len is not None and args.seq_len < 8):
        raise StudyError(f"--eval-batches must be >= 0 and --seq-len >= 8, got {args.eval_batches} and "
                         f"{args.seq_len}")
    if args.probes < 2:
        raise StudyError(f"--probes must be >= 2 (the first and the last step), got {args.probes}")
    if not 0 <= args.warmup_steps <= args.steps:
        raise StudyError(f"--warmup-steps must be in [0, --steps], got {args.warmup_steps}")
    if min(args.depths) < 1 or min(args.learning_rates) <= 0 or not args.coefficient_lr_scale > 0:
        raise StudyError("--depths must be >= 1, --learning-rates and --coefficient-lr-scale > 0")
    for name in ("depths", "learning_rates", "seeds"):
        if len(set(getattr(args, name))) != len(getattr(args, name)):
            raise StudyError(f"--{name.replace('_', '-')} has a repeated value: {getattr(args, name)}")
    try:  # the preset, width and heads must make a valid model
        ModelConfig.preset(args.model, **({"d_model": args.d_model} if args.d_model else {}),
                           **({"seq_len": args.seq_len} if args.seq_len else {}))
    except ValueError as error:
        raise StudyError(str(error)) from None
    return Settings(model=args.model, d_model=args.d_model, attention=args.attention, steps=args.steps,
                    batch_size=args.batch_size, warmup_steps=args.warmup_steps, weight_decay=args.weight_decay,
                    grad_clip=args.grad_clip, coefficient_lr_scale=args.coefficient_lr_scale, dataset=args.dataset,
                    probes=args.probes, probe_batch=args.probe_batch,
                    max_nonfinite_steps=args.max_nonfinite_steps, seq_len=args.seq_len,
                    eval_batches=args.eval_batches)


def main(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    out = Path(args.out_dir)
    started = time.perf_counter()
    with study_directory(out, dataclasses.asdict(settings)):
        CompileCache(args.compile_cache_dir).use()
        # seed by seed: a study cut short still has every setting of its first seeds
        runs = [Run(r, d, lr, s) for s in args.seeds for d in args.depths for lr in args.learning_rates
                for r in args.residual]
        runner = ChildRunner()  # no children here: it turns SIGTERM/SIGINT into a flag checked every step
        results: dict[Run, dict[str, Any]] = {}
        try:
            with tqdm(total=len(runs), unit="run", disable=args.no_progress, dynamic_ncols=True) as bar:
                for run in runs:
                    path = run.path(out)
                    if not path.exists():
                        bar.set_postfix_str(f"{run.setting} {run.residual} seed {run.seed}")
                        record = train_run(settings, run, runner)
                        if record is None:
                            break
                        path.parent.mkdir(parents=True, exist_ok=True)
                        write_json(path, record)
                    results[run] = read_json(path)
                    bar.update(1)
        finally:
            runner.close()
        stability_report.write_outputs(args, settings, runs, results, time.perf_counter() - started)
    if runner.stopped:
        print(f"stopped by a signal after {len(results)} of {len(runs)} runs; rerun the same command to continue")
    else:
        print(f"{len(results)} of {len(runs)} runs finished; wrote {report.report_dir(args) / 'report.md'}")
    return 0
