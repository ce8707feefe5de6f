"""``python -m nash_mhc.evaluate``: loss, perplexity and bits per byte of a trained model on held-out text.

Loads the latest (or ``--step``) checkpoint of a training run's ``--checkpoint-dir`` and evaluates it on the
held-out ``eval`` split of the run's dataset (or ``--dataset``), at the model's context length. Prints one
JSON line: loss (mean nats per predicted token), perplexity (exp(loss)), bits_per_byte (total nats / ln 2 /
UTF-8 bytes of the predicted text, comparable across tokenizers), tokens, bytes, batches, step.
``--untrained`` evaluates the run's step-0 initialisation instead, the baseline to compare with.
Exit codes: 0 done, 2 bad arguments or inputs (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys

from nash_mhc.cli import OneLineParser, add_checkpoint_arguments, add_compile_cache_argument, fail, use_compile_cache


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m nash_mhc.evaluate", description=__doc__.splitlines()[0],
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_checkpoint_arguments(p)
    p.add_argument("--dataset", help="'stdlib' or 'synthetic' (default: the dataset the run trained on)")
    p.add_argument("--split", default="eval", choices=("eval", "train"), help="split to evaluate on")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per batch")
    p.add_argument("--num-batches", type=int, default=16,
                   help="batches to evaluate (0: the whole split; capped at one pass over it)")
    p.add_argument("--untrained", action="store_true", help="evaluate the run's step-0 initialisation")
    add_compile_cache_argument(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.batch_size < 1:
        return fail(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.num_batches < 0:
        return fail(f"--num-batches must be >= 0 (0: the whole split), got {args.num_batches}")
    if args.step is not None and args.step < 0:
        return fail(f"--step must be >= 0, got {args.step}")

    import logging

    from nash_mhc.inference import eval_dataset, evaluate_model, load_model

    logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's read-only notices
    use_compile_cache(args.compile_cache_dir)
    try:
        loaded = load_model(args.checkpoint_dir, step=args.step, untrained=args.untrained)
        dataset_name = args.dataset or loaded.dataset
        options = loaded.source_options if dataset_name == loaded.dataset else {}
        data = eval_dataset(dataset_name, loaded.tokenizer, loaded.config.seq_len, seed=loaded.seed,
                            split=args.split, **options)
    except (ValueError, FileNotFoundError, PermissionError) as error:
        return fail(error)
    result = evaluate_model(loaded.model, data, loaded.tokenizer, batch_size=args.batch_size,
                            num_batches=args.num_batches)
    record = {**result.to_dict(), "step": loaded.step, "dataset": dataset_name, "split": args.split}
    print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
