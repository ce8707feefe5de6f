"""``python -m nash_mhc.train``: train a Nash-MHC language model (argparse → configs → training.loop).

With no flags it trains the ``small`` preset on the offline default corpus (the running Python's
standard-library sources, byte tokenizer) on all local devices along the ``data`` mesh axis.
Exit codes: 0 finished (or stopped by SIGTERM/SIGINT after saving), 2 bad arguments or inputs (one line on
stderr), 3 loss not finite for too many steps in a row, anything else a crash.
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from pathlib import Path
from typing import Any

from nash_mhc.cli import OneLineParser, add_compile_cache_argument, fail, use_compile_cache
from nash_mhc.config import AGGREGATION_MODES, ATTENTION_MODES, DTYPES, REMAT_POLICIES, RESIDUAL_MODES, ModelConfig


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m nash_mhc.train", description=__doc__.splitlines()[0],
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", help="JSON or TOML file of flag values (keys as flag names); flags override it")
    g = p.add_argument_group("model")
    g.add_argument("--model", default="small", help=f"model preset: {', '.join(ModelConfig.PRESETS)}")
    g.add_argument("--use-small-model", action="store_true", help="shorthand for --model small")
    g.add_argument("--seq-len", type=int, help="context length (default: the preset's)")
    g.add_argument("--dtype", choices=DTYPES, help="compute dtype (parameters stay float32)")
    g.add_argument("--remat", choices=REMAT_POLICIES, help="rematerialisation policy of the layer scan")
    g.add_argument("--residual", choices=RESIDUAL_MODES, help="residual connection mode")
    g.add_argument("--attention", choices=ATTENTION_MODES, help="attention mode")
    g.add_argument("--aggregation", choices=AGGREGATION_MODES, help="multiscale aggregation")
    g.add_argument("--num-streams", type=int, help="mHC residual streams n")
    g.add_argument("--num-scales", type=int, help="attention scales L")
    g.add_argument("--sparsity-weight", type=float, help="weight of the aggregation-entropy aux loss")
    g = p.add_argument_group("data")
    g.add_argument("--dataset", default="stdlib", help="'stdlib' (offline default corpus), 'synthetic', a local "
                   ".txt/.jsonl/.json/.parquet file or directory, a save_to_disk directory, prepared shards "
                   "(python -m nash_mhc.data.prepare) or a Hugging Face dataset id")
    g.add_argument("--dataset-name", help="configuration name of a Hugging Face dataset")
    g.add_argument("--split", default="train", help="split of a Hugging Face dataset to train on")
    g.add_argument("--text-field", default="text", help="text column of JSON, Parquet and datasets data")
    g.add_argument("--tokenizer", default="bytes", help="'bytes' (offline default), a tokenizer.json, a tokenizer "
                   "directory or a Hugging Face tokenizer id")
    g.add_argument("--num-workers", type=int, default=1, help="parallel tokenisation workers (on-the-fly sources)")
    g.add_argument("--max-stream-tokens", type=int, default=20_000_000, help="tokens read from a streamed "
                   "Hugging Face dataset (its deterministic prefix is trained on; prepare shards for more)")
    g.add_argument("--worker-buffer-size", type=int, default=2, help="batches the prefetch thread keeps ready")
    g = p.add_argument_group("optimisation")
    g.add_argument("--batch-size", type=int, default=8, help="global sequences per optimizer update "
                   "(per microbatch when --total-batch-tokens is given)")
    g.add_argument("--grad-accum-steps", type=int, default=1, help="microbatches per update")
    g.add_argument("--total-batch-tokens", type=int, help="tokens per update; derives the accumulation steps "
                   "as total / (batch-size * seq-len)")
    g.add_argument("--learning-rate", type=float, default=1e-3, help="peak learning rate")
    g.add_argument("--min-lr-ratio", type=float, default=0.1, help="final learning rate / peak")
    g.add_argument("--warmup-steps", type=int, help="linear warmup steps (default: 10%% of the schedule, "
                   "at most 1000)")
    g.add_argument("--total-steps", type=int, default=1000, help="optimizer updates to train for")
    g.add_argument("--lr-schedule-steps", type=int, help="length of the cosine schedule (default: "
                   "--total-steps); fix it to stop early and resume on the same schedule")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (matrices only)")
    g.add_argument("--grad-clip", type=float, default=1.0, help="global gradient-norm clip (0 disables)")
    g.add_argument("--seed", type=int, default=0, help="seed of initialisation and data order")
    g = p.add_argument_group("mesh")
    g.add_argument("--mesh-data", type=int, default=-1, help="data-parallel axis size (-1: the rest)")
    g.add_argument("--mesh-fsdp", type=int, default=1, help="FSDP axis size")
    g.add_argument("--mesh-tp", type=int, default=1, help="tensor-parallel axis size")
    g = p.add_argument_group("run")
    g.add_argument("--checkpoint-dir", default="runs/nash_mhc", help="checkpoints, metrics.jsonl, TensorBoard")
    g.add_argument("--checkpoint-interval", type=int, default=500, help="steps between checkpoints")
    g.add_argument("--max-checkpoints", type=int, default=3, help="checkpoints to keep")
    g.add_argument("--resume-from", help="checkpoint directory (or step directory) to resume from")
    g.add_argument("--init-from", help="start from another run's weights with a fresh optimizer")
    g.add_argument("--log-interval", type=int, default=10, help="steps between metric log lines")
    g.add_argument("--eval-interval", type=int, default=0, help="steps between evaluations (0: never)")
    g.add_argument("--eval-steps", type=int, default=4, help="batches per evaluation")
    g.add_argument("--max-nonfinite-steps", type=int, default=10,
                   help="abort after this many consecutive non-finite losses")
    add_compile_cache_argument(g)
    g.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse flags; values from ``--config FILE`` become defaults that explicit flags override."""
    parser = build_parser()
    pre_parser = argparse.ArgumentParser(add_help=False)
    pre_parser.add_argument("--config")
    config_path = pre_parser.parse_known_args(argv)[0].config
    if config_path:
        parser.set_defaults(**load_config_file(config_path, parser))
    return parser.parse_args(argv)


def load_config_file(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        parser.error(f"config file {path} does not exist")
    try:
        data = tomllib.loads(file.read_text()) if file.suffix == ".toml" else json.loads(file.read_text())
    except (ValueError, tomllib.TOMLDecodeError) as error:
        parser.error(f"cannot parse config file {path}: {error}")
    known = {action.dest for action in parser._actions}
    values = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(values) - known)
    if unknown:
        parser.error(f"unknown key(s) in {path}: {', '.join(unknown)}")
    return values


def configs_from_args(args: argparse.Namespace):
    """(ModelConfig, TrainConfig, RunConfig) from parsed flags; raises ValueError on inconsistent values."""
    from nash_mhc.training.config import TrainConfig
    from nash_mhc.training.loop import RunConfig

    overrides = {name: getattr(args, name) for name in ("seq_len", "dtype", "remat", "residual", "attention",
                                                         "aggregation", "num_streams", "num_scales",
                                                         "sparsity_weight") if getattr(args, name) is not None}
    if args.dataset_name and args.dataset in ("stdlib", "default", "synthetic"):
        raise ValueError(f"--dataset-name only applies to Hugging Face datasets, not {args.dataset!r}")
    if args.split != "train" and args.dataset in ("stdlib", "default", "synthetic"):
        raise ValueError(f"--split {args.split!r}: the offline corpora train on 'train' (eval uses a held-out "
                         "split automatically)")
    model_config = ModelConfig.preset("small" if args.use_small_model else args.model, **overrides)
    batch_size, accum = args.batch_size, args.grad_accum_steps
    if args.total_batch_tokens is not None:
        per_micro = args.batch_size * model_config.seq_len
        if args.total_batch_tokens % per_micro:
            raise ValueError(f"--total-batch-tokens {args.total_batch_tokens} is not a multiple of batch-size x "
                             f"seq-len = {per_micro}")
        accum = args.total_batch_tokens // per_micro
        batch_size = args.batch_size * accum
    schedule = args.lr_schedule_steps or args.total_steps
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, min(1000, schedule // 10))
    train_config = TrainConfig(batch_size=batch_size, grad_accum_steps=accum, learning_rate=args.learning_rate,
                               min_lr_ratio=args.min_lr_ratio, warmup_steps=warmup, total_steps=schedule,
                               weight_decay=args.weight_decay, grad_clip=args.grad_clip, seed=args.seed,
                               remat=args.remat)
    if args.max_stream_tokens < 1:
        raise ValueError(f"--max-stream-tokens must be >= 1, got {args.max_stream_tokens}")
    run = RunConfig(dataset=args.dataset, tokenizer=args.tokenizer, dataset_name=args.dataset_name,
                    split=args.split, text_field=args.text_field, num_workers=args.num_workers,
                    max_stream_tokens=args.max_stream_tokens, checkpoint_dir=args.checkpoint_dir,
                    checkpoint_interval=args.checkpoint_interval, max_checkpoints=args.max_checkpoints,
                    resume_from=args.resume_from, init_from=args.init_from, log_interval=args.log_interval,
                    eval_interval=args.eval_interval, eval_steps=args.eval_steps, mesh_data=args.mesh_data,
                    mesh_fsdp=args.mesh_fsdp, mesh_tp=args.mesh_tp, worker_buffer_size=args.worker_buffer_size,
                    max_nonfinite_steps=args.max_nonfinite_steps, progress=not args.no_progress,
                    stop_step=args.total_steps)
    return model_config, train_config, run


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        model_config, train_config, run = configs_from_args(args)
    except ValueError as error:
        return fail(error)

    from nash_mhc.training import loop  # imports JAX: after argument errors are reported

    try:
        loop.initialize_distributed()
        use_compile_cache(args.compile_cache_dir)  # a local directory or a bucket (gs://...)
        session = loop.prepare(model_config, train_config, run)
    except (ValueError, FileNotFoundError, PermissionError) as error:
        return fail(error)
    return loop.train(session)


if __name__ == "__main__":
    sys.exit(main())
