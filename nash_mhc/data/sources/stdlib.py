"""``--dataset stdlib``: the ``.py`` files of the running Python's standard library, the offline default corpus.

No network and tens of MB of real code on every machine. Files are ordered by relative path; a file is held out
when the stable hash of its relative path falls below ``EVAL_FRACTION`` (about 1 %).
"""

from __future__ import annotations

import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from nash_mhc.data.sources.base import Corpus, held_out, stable_fraction

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_files(root: str) -> list[str]:
    """Relative POSIX paths of the ``.py`` files under ``root``, sorted; skips ``site-packages``,
    ``dist-packages``, ``__pycache__`` and the active virtual environment; directory links are not followed."""
    venv = Path(sys.prefix).resolve() if sys.prefix != sys.base_prefix else None
    found = []
    for directory, subdirs, names in os.walk(root):
        here = Path(directory)
        subdirs[:] = [d for d in subdirs if d not in EXCLUDED_DIRS and (here / d).resolve() != venv]
        found += [(here / f).relative_to(root).as_posix() for f in names if f.endswith(".py") and (here / f).is_file()]
    return sorted(found)


def split_files(root: str) -> tuple[list[str], list[str]]:
    """(train, eval) relative paths of the standard library under ``root``, each in path order."""
    files = stdlib_files(root)
    if len(files) < 2:
        raise ValueError(f"no Python standard-library sources found under {root!r}; use --dataset synthetic or a "
                         "local path")
    mask = held_out(np.array([stable_fraction(p) for p in files]))
    return [p for p, e in zip(files, mask, strict=True) if not e], [p for p, e in zip(files, mask, strict=True) if e]


def corpus(part: str, root: str | None = None) -> Corpus:
    """The train or eval files of the standard library as raw UTF-8 documents (one per file)."""
    root = root or sysconfig.get_paths()["stdlib"]
    paths = split_files(root)[part == "eval"]

    def documents() -> Iterator[bytes]:
        for rel in paths:
            yield (Path(root) / rel).read_bytes()

    return Corpus("stdlib", part, documents)
