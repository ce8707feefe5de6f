"""Document sources: where the training text comes from.

A source is a small, frozen, hashable description of one split of a corpus (the pipeline caches built token
streams keyed on it) with a ``documents()`` iterator of text. Offline sources:

- ``"stdlib"`` (also ``"default"``): the ``.py`` files of the running interpreter's standard library — no
  network, tens of MB of real code on every machine. Files are ordered by relative path; the held-out eval
  split is a stable hash of each relative path (about 1%), so it is the same on every host and every run.
- ``"synthetic"``: short documents generated from the seed by a fixed random word-level Markov grammar — cheap,
  deterministic and learnable, for smoke tests.

A later issue adds Hugging Face datasets, local files and pre-tokenised shards behind the same ``Source``
protocol and the same ``load_source`` entry point. A source may also implement
``document_bytes() -> Iterator[bytes]`` (raw UTF-8 documents, used by byte-level tokenizers without a
decode/encode round trip) or ``token_stream(tokenizer) -> np.ndarray`` (already tokenised, EOS-separated ids).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import sys
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

__all__ = [
    "EVAL_FRACTION",
    "SPLITS",
    "Source",
    "StdlibSource",
    "SyntheticSource",
    "eval_hash_fraction",
    "load_source",
    "split_paths",
    "stdlib_files",
]

SPLITS = ("train", "eval")
EVAL_FRACTION = 0.01
_STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@runtime_checkable
class Source(Protocol):
    """One split of a corpus. Implementations must be hashable (frozen dataclasses) and deterministic."""

    name: str
    split: str

    def documents(self) -> Iterator[str]:
        """The split's documents, in a fixed order."""
        ...


def _check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    return split


# ----------------------------------------------------------------------------------------------------------------
# Python standard library


def eval_hash_fraction(relpath: str) -> float:
    """A stable number in [0, 1) from a relative path (SHA-1, so it never changes across runs or hosts)."""
    digest = hashlib.sha1(relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_paths(relpaths: Sequence[str], eval_fraction: float = EVAL_FRACTION) -> tuple[list[str], list[str]]:
    """Split relative paths into (train, eval) by ``eval_hash_fraction``; order is preserved.

    With at least two paths each side gets at least one: if the hash puts none in eval, the path with the smallest
    hash goes there; if it puts all of them in eval, the path with the largest hash goes to train.
    """
    fractions = [eval_hash_fraction(p) for p in relpaths]
    is_eval = [f < eval_fraction for f in fractions]
    if len(relpaths) >= 2:
        if not any(is_eval):
            is_eval[int(np.argmin(fractions))] = True
        elif all(is_eval):
            is_eval[int(np.argmax(fractions))] = False
    train = [p for p, e in zip(relpaths, is_eval, strict=True) if not e]
    held_out = [p for p, e in zip(relpaths, is_eval, strict=True) if e]
    return train, held_out


def _default_stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


@functools.cache
def stdlib_files(root: str) -> tuple[str, ...]:
    """Relative POSIX paths of the ``.py`` files under ``root``, sorted.

    Skips ``site-packages``, ``dist-packages``, ``__pycache__`` and anything inside the active virtual
    environment; directory symlinks are not followed.
    """
    root_path = Path(root)
    if not root_path.is_dir():
        return ()
    venv = Path(sys.prefix).resolve() if sys.prefix != sys.base_prefix else None
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root_path):
        here = Path(dirpath)
        keep = []
        for d in dirnames:
            if d in _STDLIB_EXCLUDED_DIRS:
                continue
            if venv is not None and (here / d).resolve() == venv:
                continue
            keep.append(d)
        dirnames[:] = keep
        for f in filenames:
            if f.endswith(".py") and (here / f).is_file():
                found.append((here / f).relative_to(root_path).as_posix())
    return tuple(sorted(found))


@dataclasses.dataclass(frozen=True)
class StdlibSource:
    """The ``.py`` sources of the running Python's standard library (offline default corpus)."""

    split: str = "train"
    root: str = dataclasses.field(default_factory=_default_stdlib_root)
    eval_fraction: float = EVAL_FRACTION
    name: str = "stdlib"

    def __post_init__(self) -> None:
        _check_split(self.split)

    def files(self) -> list[str]:
        """This split's relative paths, sorted."""
        all_files = stdlib_files(self.root)
        if len(all_files) < 2:
            raise ValueError(
                f"no Python standard-library sources found under {self.root!r}; "
                "use --dataset synthetic (local paths come in a later release)"
            )
        train, held_out = split_paths(all_files, self.eval_fraction)
        return train if self.split == "train" else held_out

    def document_bytes(self) -> Iterator[bytes]:
        root = Path(self.root)
        for rel in self.files():
            yield (root / rel).read_bytes()

    def documents(self) -> Iterator[str]:
        for data in self.document_bytes():
            yield data.decode("utf-8", errors="replace")

    def __iter__(self) -> Iterator[str]:
        return self.documents()


# ----------------------------------------------------------------------------------------------------------------
# Synthetic grammar

_SPLIT_IDS = {"train": 0, "eval": 1}


@dataclasses.dataclass(frozen=True)
class SyntheticSource:
    """Deterministic, learnable documents from a seeded word-level Markov grammar.

    The grammar (``num_words`` lowercase words, each followed by one of three successors with probabilities
    0.6/0.3/0.1, or by the end of the sentence) depends on ``seed`` only; train and eval documents are different
    walks of the same grammar. Documents are a few capitalised sentences ending with ``"."``.
    """

    split: str = "train"
    seed: int = 0
    num_documents: int | None = None  # default: 1000 train, 64 eval
    num_words: int = 48
    name: str = "synthetic"

    def __post_init__(self) -> None:
        _check_split(self.split)

    def _grammar(self) -> tuple[list[str], np.ndarray]:
        rng = np.random.default_rng([self.seed, 0x5EED])
        letters = "abcdefghijklmnopqrstuvwxyz"
        words: list[str] = []
        seen: set[str] = set()
        while len(words) < self.num_words:
            n = int(rng.integers(2, 8))
            word = "".join(letters[i] for i in rng.integers(0, len(letters), size=n))
            if word not in seen:
                seen.add(word)
                words.append(word)
        # successors[w] = 3 next-word ids; id num_words means "end of sentence".
        successors = rng.integers(0, self.num_words + 1, size=(self.num_words, 3))
        return words, successors

    def documents(self) -> Iterator[str]:
        words, successors = self._grammar()
        end = len(words)
        count = self.num_documents
        if count is None:
            count = 1000 if self.split == "train" else 64
        rng = np.random.default_rng([self.seed, 0xD0C, _SPLIT_IDS[self.split]])
        starters = min(8, end)
        for _ in range(count):
            sentences = []
            for _ in range(int(rng.integers(2, 6))):
                w = int(rng.integers(0, starters))
                out = [words[w]]
                while len(out) < 16:
                    u = rng.random()
                    w = int(successors[w, 0 if u < 0.6 else (1 if u < 0.9 else 2)])
                    if w == end:
                        break
                    out.append(words[w])
                sentences.append(" ".join(out).capitalize() + ".")
            yield " ".join(sentences)

    def __iter__(self) -> Iterator[str]:
        return self.documents()


# ----------------------------------------------------------------------------------------------------------------


def load_source(name: str, split: str = "train", seed: int = 0) -> StdlibSource | SyntheticSource:
    """The ``split`` of dataset ``name``: ``"stdlib"``/``"default"`` (seed-independent) or ``"synthetic"``."""
    _check_split(split)
    if name in ("stdlib", "default"):
        return StdlibSource(split=split)
    if name == "synthetic":
        return SyntheticSource(split=split, seed=seed)
    if os.path.exists(name):
        raise ValueError(
            f"dataset {name!r} is a local path; local datasets are not supported yet, "
            "use --dataset stdlib (offline default) or --dataset synthetic"
        )
    raise ValueError(
        f"dataset {name!r} cannot be reached offline (no network, no Hugging Face datasets); "
        "use --dataset stdlib (the offline default corpus) or --dataset synthetic"
    )
