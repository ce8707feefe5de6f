"""``python -m nash_mhc.generate``: continue a prompt with a trained model, streaming the text as it comes.

Loads the latest (or ``--step``) checkpoint of a training run's ``--checkpoint-dir`` and decodes with the
incremental cache of :mod:`nash_mhc.decoding` (``--temperature 0`` is greedy). With ``--num-samples N`` the
samples are drawn together; the first is streamed, the others are printed when generation ends.
Exit codes: 0 done, 2 bad arguments or inputs (one line on stderr).

``nash_mhc.generate`` is also the library function :func:`nash_mhc.decoding.generate`: importing this module
makes the module itself callable, so ``nash_mhc.generate(model, prompt, ...)`` works either way.
"""

from __future__ import annotations

import argparse
import os
import sys
import types
from typing import Any

import numpy as np

from nash_mhc.cli import OneLineParser, add_checkpoint_arguments, add_compile_cache_argument, fail, use_compile_cache
from nash_mhc.decoding import Sampling
from nash_mhc.decoding import generate as _generate

DEFAULT_NEW_TOKENS = 200


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m nash_mhc.generate", description=__doc__.splitlines()[0],
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_checkpoint_arguments(p)
    p.add_argument("--prompt", default="", help="text to continue (empty: start a new document)")
    p.add_argument("--max-new-tokens", type=int,
                   help=f"tokens to generate; prompt + new tokens must fit the model's context (default: "
                        f"{DEFAULT_NEW_TOKENS}, or as many as fit)")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0 = greedy (argmax)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample among the most likely tokens whose probability reaches p (1: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    p.add_argument("--num-samples", type=int, default=1, help="independent continuations to draw")
    p.add_argument("--no-cache", action="store_true",
                   help="recompute the full forward pass for every token (slow; the cache's reference)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating after an end-of-document token")
    p.add_argument("--untrained", action="store_true", help="use the run's step-0 initialisation (a baseline)")
    add_compile_cache_argument(p)
    return p


def check_args(args: argparse.Namespace) -> None:
    """Value checks that need no model; raises ValueError with a one-line message."""
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.num_samples < 1:
        raise ValueError(f"--num-samples must be >= 1, got {args.num_samples}")
    try:  # the sampling ranges are Sampling's own checks; its messages start with the setting's name
        Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    except ValueError as error:
        raise ValueError(f"--{error}") from None
    if args.step is not None and args.step < 0:
        raise ValueError(f"--step must be >= 0, got {args.step}")


class TextStream:
    """Prints the decoded text of a growing token list; holds back an incomplete trailing UTF-8 character."""

    def __init__(self, tokenizer: Any, out: Any = None):
        self.tokenizer = tokenizer
        self.out = sys.stdout if out is None else out
        self.ids: list[int] = []
        self.printed = 0

    def add(self, token: int) -> None:
        self.ids.append(int(token))
        text = self.tokenizer.decode(np.asarray(self.ids, np.int32))
        if text.endswith("\ufffd"):  # maybe the first bytes of a character; wait for the rest
            return
        self._emit(text)

    def close(self) -> None:
        self._emit(self.tokenizer.decode(np.asarray(self.ids, np.int32)))

    def _emit(self, text: str) -> None:
        if len(text) > self.printed:
            self.out.write(text[self.printed:])
            self.out.flush()
            self.printed = len(text)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
    except ValueError as error:
        return fail(error)

    import logging

    from nash_mhc.inference import load_model

    logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's read-only notices
    use_compile_cache(args.compile_cache_dir)
    try:
        loaded = load_model(args.checkpoint_dir, step=args.step, untrained=args.untrained)
        tokenizer, context = loaded.tokenizer, loaded.config.seq_len
        ids = tokenizer.encode(args.prompt) if args.prompt else np.asarray([tokenizer.eos_id], np.int32)
        if len(ids) >= context:
            raise ValueError(f"the prompt is {len(ids)} tokens, longer than the model's context of {context} "
                             f"tokens allows (at most {context - 1}, leaving room for one new token)")
        if args.max_new_tokens is None:
            args.max_new_tokens = min(DEFAULT_NEW_TOKENS, context - len(ids))
        if len(ids) + args.max_new_tokens > context:
            raise ValueError(f"prompt ({len(ids)} tokens) + --max-new-tokens {args.max_new_tokens} exceed the "
                             f"model's context of {context} tokens; use --max-new-tokens <= {context - len(ids)}")
    except (ValueError, FileNotFoundError, PermissionError) as error:
        return fail(error)

    try:
        if args.num_samples > 1:
            print("--- sample 1 ---")
        sys.stdout.write(args.prompt)
        stream = TextStream(tokenizer)
        tokens = _generate(loaded.model, ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           top_k=args.top_k, top_p=args.top_p, key=args.seed, num_samples=args.num_samples,
                           use_cache=not args.no_cache, eos_id=None if args.ignore_eos else tokenizer.eos_id,
                           callback=lambda _, new: stream.add(new[0]))
        stream.close()
        print()
        for i in range(1, args.num_samples):
            print(f"--- sample {i + 1} ---")
            print(args.prompt + tokenizer.decode(tokens[i]), flush=True)
    except KeyboardInterrupt:
        print(flush=True)
        return 130
    except BrokenPipeError:  # e.g. piped into `head`: stop quietly
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keeps the interpreter's final flush from failing
    return 0


class _CallableModule(types.ModuleType):
    """Importing ``nash_mhc.generate`` (this CLI) rebinds the package attribute from the library function to
    the module; making the module callable keeps ``nash_mhc.generate(model, prompt, ...)`` working."""

    def __call__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        return _generate(*args, **kwargs)


if __name__ == "__main__":
    sys.exit(main())
else:
    sys.modules[__name__].__class__ = _CallableModule
