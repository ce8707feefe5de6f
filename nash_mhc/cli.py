"""What every command-line program of the package shares: one-line errors (exit 2) and the compile cache."""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

EXIT_USAGE = 2
DEFAULT_COMPILE_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "nash_mhc", "xla")


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports errors as a single line (exit 2), without the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"error: {message} (see --help)\n")


def fail(error: str | BaseException) -> int:
    """Print ``error: <first line of the message>`` on stderr and return exit code 2."""
    text = str(error)
    line = text.splitlines()[0] if text else type(error).__name__
    print(f"error: {line}", file=sys.stderr)
    return EXIT_USAGE


def add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    """``--checkpoint-dir`` (required) and ``--step``: the programs that load a trained checkpoint."""
    parser.add_argument("--checkpoint-dir", required=True,
                        help="training run directory (its latest checkpoint) or one step directory inside it")
    parser.add_argument("--step", type=int, help="checkpoint step to load (default: the latest)")


def add_compile_cache_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--compile-cache-dir`` (default :data:`DEFAULT_COMPILE_CACHE`), read by :func:`use_compile_cache`."""
    parser.add_argument("--compile-cache-dir", default=DEFAULT_COMPILE_CACHE,
                        help="persistent XLA compilation cache ('none' disables)")


def use_compile_cache(directory: str | None) -> None:
    """Point JAX's persistent compilation cache at ``directory`` (local or gs://); None/'none' leaves it off."""
    if not directory or directory.lower() == "none":
        return
    import jax

    from nash_mhc import paths

    jax.config.update("jax_compilation_cache_dir", os.fspath(paths.as_path(directory)))
