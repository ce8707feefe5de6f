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


def use_compile_cache(directory: str | None) -> None:
    """Point JAX's persistent compilation cache at ``directory`` (local or gs://); None/'none' leaves it off."""
    if not directory or directory.lower() == "none":
        return
    import jax

    from nash_mhc import paths

    jax.config.update("jax_compilation_cache_dir", os.fspath(paths.as_path(directory)))
