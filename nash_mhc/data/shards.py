"""Pre-tokenised shards: the on-disk format ``python -m nash_mhc.data.prepare`` writes and training reads.

A prepared directory holds, per split (``train``, ``eval``), fixed-size raw token files
``<split>-00000.bin``, ``<split>-00001.bin``, ... (native little-endian ``uint16`` while the vocabulary fits
in 16 bits, else ``uint32``; no header, so ``np.memmap`` reads them directly; every file holds exactly
``shard_tokens`` tokens except the last of a split) and ``index.json``::

    {"format": "nash_mhc-shards", "version": 1, "dtype": "uint16", "shard_tokens": 16777216,
     "tokenizer": {"name": "bytes", "fingerprint": "bytes", "vocab_size": 259, "bos_id": 256, "eos_id": 257,
                   "pad_id": 258},
     "source": {"dataset": ..., "dataset_name": ..., "split": ..., "text_field": ..., "max_tokens": ...},
     "splits": {"train": {"num_tokens": ..., "num_documents": ..., "max_token_id": ...,
                          "shards": [{"file": "train-00000.bin", "num_tokens": ...}, ...]},
                "eval": {...}}}

The concatenated shards of a split are one token stream (documents separated by EOS, exactly what the
on-the-fly pipeline would build), cut into the same windows and batched in the same ``(seed, step)`` order
(:class:`ShardedDataset`), so prepared and on-the-fly training see identical batches. Training checks that the
index's tokenizer fingerprint (``"bytes"``, or ``sha256`` of the serialised ``tokenizer.json``) and vocabulary
size match ``--tokenizer``, that the files have the recorded sizes, and every batch's ids against the
vocabulary.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from jaxtyping import Integer

from nash_mhc.data.pipeline import PackedDataset, check_ids
from nash_mhc.data.sources import _check_split
from nash_mhc.data.tokenizers import Tokenizer, get_tokenizer, tokenizer_fingerprint

__all__ = [
    "FORMAT",
    "INDEX_FILE",
    "ShardSource",
    "ShardWriter",
    "ShardedDataset",
    "index_digest",
    "is_shard_dir",
    "read_index",
    "tokenizer_record",
]

FORMAT = "nash_mhc-shards"
VERSION = 1
INDEX_FILE = "index.json"


def is_shard_dir(path: Path) -> bool:
    """Whether ``path`` is a directory with a prepared-shards ``index.json``."""
    index = path / INDEX_FILE
    if not index.is_file():
        return False
    try:
        return json.loads(index.read_text(encoding="utf-8")).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def index_digest(path: Path) -> str:
    """A short digest of the index (the cache key of a prepared directory)."""
    return hashlib.sha1((path / INDEX_FILE).read_bytes()).hexdigest()[:16]


def read_index(path: Path) -> dict[str, Any]:
    """The parsed ``index.json`` of a prepared directory (one-line ``ValueError`` when it is unusable)."""
    try:
        index = json.loads((path / INDEX_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ValueError(f"prepared shards {str(path)!r}: cannot read {INDEX_FILE}: {error}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ValueError(f"prepared shards {str(path)!r}: {INDEX_FILE} is not a {FORMAT} index")
    if index.get("version") != VERSION:
        raise ValueError(f"prepared shards {str(path)!r}: index version {index.get('version')!r} is not supported "
                         f"(expected {VERSION}); prepare the data again")
    return index


def tokenizer_record(tokenizer: Tokenizer) -> dict[str, Any]:
    """What an index records about the tokenizer that made it."""
    return {"name": tokenizer.name, "fingerprint": tokenizer_fingerprint(tokenizer),
            "vocab_size": int(tokenizer.vocab_size), "bos_id": int(tokenizer.bos_id),
            "eos_id": int(tokenizer.eos_id), "pad_id": int(tokenizer.pad_id)}


def check_tokenizer(index: dict[str, Any], tokenizer: Tokenizer, where: str) -> None:
    """One-line ``ValueError`` when the shards were made with another tokenizer than ``tokenizer``."""
    recorded = index.get("tokenizer", {})
    mine = tokenizer_record(tokenizer)
    differ = [k for k in ("fingerprint", "vocab_size", "eos_id") if recorded.get(k) != mine[k]]
    if differ:
        raise ValueError(
            f"prepared shards {where} do not match the tokenizer: they were made with {recorded.get('name')!r} "
            f"({recorded.get('fingerprint')}, vocab size {recorded.get('vocab_size')}) but --tokenizer "
            f"{tokenizer.name!r} is {mine['fingerprint']} with vocab size {mine['vocab_size']}; pass --tokenizer "
            f"{recorded.get('name')} or prepare the data again"
        )


class ShardWriter:
    """Appends token chunks to fixed-size shard files ``<prefix>-NNNNN.bin`` in ``directory``.

    Each file is written as ``.tmp`` and renamed when complete; ``close()`` returns the split's index entry.
    ``abort()`` removes the files this writer created (and only those).
    """

    def __init__(self, directory: Path, prefix: str, dtype: np.dtype, shard_tokens: int) -> None:
        if shard_tokens < 1:
            raise ValueError(f"shard-tokens must be >= 1, got {shard_tokens}")
        self.directory, self.prefix, self.dtype, self.shard_tokens = directory, prefix, np.dtype(dtype), shard_tokens
        self.shards: list[dict[str, Any]] = []
        self.created: list[Path] = []
        self.num_tokens = self.num_documents = 0
        self.max_token_id = -1
        self._file: Any = None
        self._tmp: Path | None = None
        self._in_file = 0

    def _open(self) -> None:
        name = f"{self.prefix}-{len(self.shards):05d}.bin"
        self._tmp = self.directory / (name + ".tmp")
        self.created.append(self._tmp)
        self._file = open(self._tmp, "wb")  # noqa: SIM115 - closed in _finish
        self._in_file = 0

    def _finish(self) -> None:
        if self._file is None:
            return
        self._file.close()
        assert self._tmp is not None
        final = self._tmp.with_suffix("")
        os.replace(self._tmp, final)
        self.created.append(final)
        self.shards.append({"file": final.name, "num_tokens": self._in_file})
        self._file, self._tmp = None, None

    def write(self, ids: np.ndarray, documents: int = 0) -> None:
        ids = np.ascontiguousarray(ids, dtype=self.dtype)
        if ids.size:
            self.max_token_id = max(self.max_token_id, int(ids.max()))
        self.num_documents += documents
        start = 0
        while start < ids.size:
            if self._file is None:
                self._open()
            take = min(ids.size - start, self.shard_tokens - self._in_file)
            self._file.write(ids[start:start + take].tobytes())
            self._in_file += take
            self.num_tokens += take
            start += take
            if self._in_file == self.shard_tokens:
                self._finish()

    def close(self) -> dict[str, Any]:
        self._finish()
        return {"num_tokens": self.num_tokens, "num_documents": self.num_documents,
                "max_token_id": self.max_token_id, "shards": self.shards}

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        for path in self.created:
            path.unlink(missing_ok=True)


class ShardedDataset(PackedDataset):
    """The windows of a split's memory-mapped shards, in the same order as a ``PackedDataset`` of their stream.

    Only the rows a process asks for are read; a window may straddle two shards. Ids are checked against
    ``vocab_size`` in every batch.
    """

    def __init__(self, files: list[Path], counts: list[int], dtype: np.dtype, seq_len: int, *, seed: int = 0,
                 vocab_size: int | None = None, shuffle: bool = True, name: str = "shards") -> None:
        self._setup(int(sum(counts)), seq_len, seed=seed, vocab_size=vocab_size, shuffle=shuffle, name=name)
        self._files = [f for f, c in zip(files, counts, strict=True) if c]
        self._counts = [c for c in counts if c]
        self._dtype = np.dtype(dtype)
        self._starts = np.concatenate([[0], np.cumsum(self._counts)]).astype(np.int64)
        self._maps: list[np.memmap | None] = [None] * len(self._files)

    def _map(self, i: int) -> np.memmap:
        mapped = self._maps[i]
        if mapped is None:
            mapped = np.memmap(self._files[i], dtype=self._dtype, mode="r", shape=(self._counts[i],))
            self._maps[i] = mapped
        return mapped

    def read_windows(self, indices: np.ndarray) -> np.ndarray:
        window = self.seq_len + 1
        out = np.empty((len(indices), window), dtype=self._dtype)
        for row, w in enumerate(np.asarray(indices, dtype=np.int64)):
            start, filled = int(w) * window, 0
            shard = int(np.searchsorted(self._starts, start, side="right")) - 1
            while filled < window:
                offset = start + filled - int(self._starts[shard])
                take = min(window - filled, self._counts[shard] - offset)
                out[row, filled:filled + take] = self._map(shard)[offset:offset + take]
                filled += take
                shard += 1
        if self.vocab_size is not None:
            check_ids(out, self.vocab_size, self.name)
        return out


@dataclasses.dataclass(frozen=True)
class ShardSource:
    """One split of a prepared-shards directory (``python -m nash_mhc.data.prepare``)."""

    path: str
    split: str = "train"
    stamp: str = ""
    name: str = "shards"

    def __post_init__(self) -> None:
        _check_split(self.split)

    def index(self) -> dict[str, Any]:
        return read_index(Path(self.path))

    def _split(self, tokenizer: Tokenizer | None) -> tuple[dict[str, Any], list[Path], list[int], np.dtype]:
        index = self.index()
        where = repr(self.name)
        if tokenizer is not None:
            check_tokenizer(index, tokenizer, where)
        entry = index.get("splits", {}).get(self.split)
        if not entry or not entry.get("num_tokens"):
            raise ValueError(f"dataset {self.name!r} is empty: the prepared shards hold no {self.split} tokens")
        vocab = int(index["tokenizer"]["vocab_size"])
        if int(entry.get("max_token_id", -1)) >= vocab:
            raise ValueError(f"prepared shards {where}: token id {entry['max_token_id']} >= vocab size {vocab} "
                             f"(token ids must lie in [0, {vocab}))")
        dtype = np.dtype(index["dtype"])
        files, counts = [], []
        for shard in entry["shards"]:
            file = Path(self.path) / shard["file"]
            expected = int(shard["num_tokens"]) * dtype.itemsize
            size = file.stat().st_size if file.is_file() else None
            if size != expected:
                state = "is missing" if size is None else f"has {size} bytes, expected {expected}"
                raise ValueError(f"prepared shards {where}: {shard['file']} {state}; prepare the data again")
            files.append(file)
            counts.append(int(shard["num_tokens"]))
        return index, files, counts, dtype

    def packed_dataset(self, tokenizer: Tokenizer, seq_len: int, *, seed: int = 0) -> ShardedDataset:
        """The split's windows, memory-mapped (checks the tokenizer and the files first)."""
        _, files, counts, dtype = self._split(tokenizer)
        return ShardedDataset(files, counts, dtype, seq_len, seed=seed, vocab_size=tokenizer.vocab_size,
                              name=f"{self.name}/{self.split}")

    def token_stream(self, tokenizer: Tokenizer) -> Integer[np.ndarray, " n"]:
        """The split's whole stream in memory (for small splits; training memory-maps instead)."""
        _, files, counts, dtype = self._split(tokenizer)
        stream = np.concatenate([np.fromfile(f, dtype=dtype, count=c) for f, c in zip(files, counts, strict=True)])
        check_ids(stream, tokenizer.vocab_size, self.name)
        return stream

    def documents(self) -> Iterator[str]:
        """The split's documents decoded with the tokenizer that made them (for inspection)."""
        index = self.index()
        tokenizer = get_tokenizer(index["tokenizer"]["name"])
        stream = self.token_stream(tokenizer)
        ends = np.flatnonzero(stream == tokenizer.eos_id)
        start = 0
        for end in ends:
            yield tokenizer.decode(stream[start:end])
            start = int(end) + 1

    def __iter__(self) -> Iterator[str]:
        return self.documents()
