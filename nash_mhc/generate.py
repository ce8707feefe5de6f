"""``python -m nash_mhc.generate``: continue a prompt with a trained model, streaming the text as it comes.

Loads the latest (or ``--step``) checkpoint of a training run's ``--checkpoint-dir`` and decodes with the
incremental cache of :mod:`nash_mhc.decoding` (``--temperature 0`` is greedy). With ``--num-samples N`` the
samples are drawn together; the first is streamed, the others are printed when generation ends.
``--mesh-data/--mesh-fsdp/--mesh-tp`` restore the model sharded over that mesh as training shards it (for
models larger than one device); without them it runs on one device.
Exit codes: 0 done, 2 bad arguments or inputs (one line on stderr).

The library function is :func:`nash_mhc.generate_tokens` (:func:`nash_mhc.decoding.generate_tokens`). Before
version 0.3 it was ``nash_mhc.generate(model, prompt, ...)``; that name is this program's module now and cannot be
called: call ``nash_mhc.generate_tokens`` (same arguments; ``nash_mhc.decoding.generate``, deprecated, still
works).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

import numpy as np

from nash_mhc.cli import SettingsParser, checkpoint_program_parser, fail
from nash_mhc.decoding import Sampling, generate_tokens
from nash_mhc.platforms import select_platform
from nash_mhc.settings import POSITIVE_INT, check_settings, setting

DEFAULT_NEW_TOKENS = 200


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
    """The prompt and how to sample its continuations."""

    prompt: str = setting("", "text to continue (empty: start a new document)")
    max_new_tokens: int | None = setting(None, "tokens to generate; prompt + new tokens must fit the model's context "
                                               f"(default: {DEFAULT_NEW_TOKENS}, or as many as fit)",
                                         check=POSITIVE_INT)
    temperature: float = setting(0.8, "sampling temperature; 0 = greedy (argmax)")
    top_k: int = setting(0, "sample among the k most likely tokens (0: all)")
    top_p: float = setting(1.0, "sample among the most likely tokens whose probability reaches p (1: all)")
    seed: int = setting(0, "seed of the sampling")
    num_samples: int = setting(1, "independent continuations to draw", check=POSITIVE_INT)
    cache: bool = setting(True, "recompute the full forward pass for every token (slow; the cache's reference)")
    ignore_eos: bool = setting(False, "keep generating after an end-of-document token")

    def __post_init__(self) -> None:
        check_settings(self)
        try:  # the sampling ranges are Sampling's own checks; its messages start with the setting's name
            Sampling(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)
        except ValueError as error:
            raise ValueError(f"--{error}") from None


def build_parser() -> SettingsParser:
    return checkpoint_program_parser("python -m nash_mhc.generate", __doc__, GenerateConfig)


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
    from nash_mhc.execution import ExecutionConfig
    from nash_mhc.inference import load_from_flags

    select_platform()  # before anything starts a JAX backend
    parser = build_parser()
    try:
        config, loaded = load_from_flags(parser, argv, GenerateConfig)
        execution = parser.build(ExecutionConfig, parser.given(argv))
        tokenizer, context = loaded.tokenizer, loaded.config.seq_len
        ids = tokenizer.encode(config.prompt) if config.prompt else np.asarray([tokenizer.eos_id], np.int32)
        if len(ids) >= context:
            raise ValueError(f"the prompt is {len(ids)} tokens, longer than the model's context of {context} "
                             f"tokens allows (at most {context - 1}, leaving room for one new token)")
        new_tokens = config.max_new_tokens or min(DEFAULT_NEW_TOKENS, context - len(ids))
        if len(ids) + new_tokens > context:
            raise ValueError(f"prompt ({len(ids)} tokens) + --max-new-tokens {new_tokens} exceed the model's "
                             f"context of {context} tokens; use --max-new-tokens <= {context - len(ids)}")
    except (ValueError, FileNotFoundError, PermissionError) as error:
        return fail(error)

    try:
        if config.num_samples > 1:
            print("--- sample 1 ---")
        sys.stdout.write(config.prompt)
        stream = TextStream(tokenizer)
        with execution.use():  # --kernels
            tokens = generate_tokens(loaded.model, ids, max_new_tokens=new_tokens, temperature=config.temperature,
                                     top_k=config.top_k, top_p=config.top_p, key=config.seed,
                                     num_samples=config.num_samples, use_cache=config.cache,
                                     eos_id=None if config.ignore_eos else tokenizer.eos_id,
                                     callback=lambda _, new: stream.add(new[0]))
        stream.close()
        print()
        for i in range(1, config.num_samples):
            print(f"--- sample {i + 1} ---")
            print(config.prompt + tokenizer.decode(tokens[i]), flush=True)
    except KeyboardInterrupt:
        print(flush=True)
        return 130
    except BrokenPipeError:  # e.g. piped into `head`: stop quietly
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keeps the interpreter's final flush from failing
    return 0


if __name__ == "__main__":
    sys.exit(main())
