"""Prepared shards: a corpus tokenised once (``python -m nash_mhc.data.prepare``), one memory-mapped file per part.

A prepared directory holds ``train.bin`` and ``eval.bin`` (headerless native ``uint16``, or ``uint32`` for
vocabularies over 2**16) and ``index.json``: ``{"format": "nash_mhc-shards", "version": 2, "dtype",
"tokenizer": {name, fingerprint, vocab_size, bos_id, eos_id, pad_id}, "source": {how it was read}, "splits":
{"train": {file, num_tokens, num_documents, max_token_id[, skipped]}, "eval": {...}}}`` (``skipped``: the
records read as no document, per reason, when there were any). Each file is exactly the stream
the on-the-fly pipeline builds, so it gives the same windows and batches, and a host reads only its rows.
Opening checks the tokenizer (fingerprint, vocabulary size, EOS) and the file sizes against the index. In a
bucket (``gs://...``) the files are read by byte range, a batch's windows at a time (:mod:`nash_mhc.data.remote`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from nash_mhc import paths
from nash_mhc.data import remote
from nash_mhc.data.tokenizers import Tokenizer
from nash_mhc.data.windows import NoWindows, PackedDataset

FORMAT, VERSION, INDEX_FILE = "nash_mhc-shards", 2, "index.json"


def is_prepared(path: Path | paths.Path) -> bool:
    """Whether ``path`` is a directory with a prepared-shards ``index.json``."""
    try:
        return json.loads((path / INDEX_FILE).read_text(encoding="utf-8")).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def tokenizer_record(tokenizer: Tokenizer) -> dict[str, Any]:
    """What an index records about the tokenizer that made it."""
    return {"name": tokenizer.name, "fingerprint": tokenizer.fingerprint, "vocab_size": int(tokenizer.vocab_size),
            "bos_id": int(tokenizer.bos_id), "eos_id": int(tokenizer.eos_id), "pad_id": int(tokenizer.pad_id)}


class PreparedSplit:
    """One part (``"train"``/``"eval"``) of a prepared directory."""

    def __init__(self, path: Path | paths.Path, part: str, name: str) -> None:
        self.path = paths.as_path(path) if remote.is_remote(path) else Path(path)
        self.part, self.name = part, name

    def index(self) -> dict[str, Any]:
        """The parsed ``index.json`` (one-line ``ValueError`` when it is unusable)."""
        where = f"prepared shards {str(self.path)!r}"
        try:
            index = json.loads((self.path / INDEX_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise ValueError(f"{where}: cannot read {INDEX_FILE}: {error}") from None
        if index.get("version") != VERSION:
            raise ValueError(f"{where}: index version {index.get('version')!r} is not supported (expected "
                             f"{VERSION}); prepare the data again")
        return index

    def windows(self, tokenizer: Tokenizer, seq_len: int, *, seed: int = 0) -> PackedDataset:
        """The part's windows over its memory-mapped file, after checking tokenizer, ids and file size."""
        index, where = self.index(), repr(self.name)
        recorded, mine = index["tokenizer"], tokenizer_record(tokenizer)
        if any(recorded.get(k) != mine[k] for k in ("fingerprint", "vocab_size", "eos_id")):
            raise ValueError(f"prepared shards {where} do not match the tokenizer: they were made with "
                             f"{recorded.get('name')!r} ({recorded.get('fingerprint')}, vocab size "
                             f"{recorded.get('vocab_size')}) but --tokenizer {tokenizer.name!r} is "
                             f"{mine['fingerprint']} with vocab size {mine['vocab_size']}; pass --tokenizer "
                             f"{recorded.get('name')} or "
                             "prepare the data again")
        entry = index["splits"].get(self.part) or {}
        if not entry.get("num_tokens"):
            raise NoWindows(f"dataset {where} is empty: the prepared shards hold no {self.part} tokens", "")
        if int(entry["max_token_id"]) >= tokenizer.vocab_size:
            raise ValueError(f"prepared shards {where}: token id {entry['max_token_id']} >= vocab size "
                             f"{tokenizer.vocab_size} (token ids must lie in [0, {tokenizer.vocab_size}))")
        dtype, file = np.dtype(index["dtype"]), self.path / entry["file"]
        expected = int(entry["num_tokens"]) * dtype.itemsize
        in_bucket = remote.is_remote(file)
        size = remote.size(file) if in_bucket else (file.stat().st_size if file.is_file() else None)
        if size != expected:
            state = "is missing" if size is None else f"has {size} bytes, expected {expected}"
            raise ValueError(f"prepared shards {where}: {entry['file']} {state}; prepare the data again")
        tokens = (remote.RangeTokens(file, dtype, int(entry["num_tokens"])) if in_bucket  # read by byte range
                  else np.memmap(file, dtype=dtype, mode="r", shape=(int(entry["num_tokens"]),)))
        return PackedDataset(tokens, seq_len, seed=seed, vocab_size=tokenizer.vocab_size,
                             name=f"{self.name}/{self.part}", skipped=entry.get("skipped"))


def write_part(directory: Path, part: str, chunks: Iterable[tuple[np.ndarray, int]], dtype: np.dtype, *,
               progress: Callable[[int], object] = lambda tokens: None) -> dict[str, Any]:
    """Append ``(ids, documents)`` chunks (or EncodedChunks, whose skipped records are counted) to
    ``<part>.bin`` (written as ``.tmp``, renamed when complete; a failure removes it), calling
    ``progress(tokens)`` per chunk; returns the part's index entry."""
    final = directory / f"{part}.bin"
    temporary = final.with_name(final.name + ".tmp")
    entry: dict[str, Any] = {"file": final.name, "num_tokens": 0, "num_documents": 0, "max_token_id": -1}
    skipped: dict[str, int] = {}
    try:
        with open(temporary, "wb") as out:
            for chunk in chunks:  # (ids, documents) or an EncodedChunk
                ids, documents = chunk[0], chunk[1]
                for reason, count in (getattr(chunk, "skipped", None) or {}).items():
                    skipped[reason] = skipped.get(reason, 0) + count
                ids = np.ascontiguousarray(ids, dtype=dtype)
                out.write(ids.tobytes())
                entry["num_tokens"] += int(ids.size)
                entry["num_documents"] += int(documents)
                entry["max_token_id"] = max(entry["max_token_id"], int(ids.max()) if ids.size else -1)
                progress(ids.size)
        os.replace(temporary, final)
    finally:
        temporary.unlink(missing_ok=True)
    return {**entry, "skipped": skipped} if skipped else entry


def write_index(directory: Path, index: dict[str, Any]) -> None:
    """``index.json``, written last (atomically), so an interrupted preparation leaves no usable-looking directory."""
    temporary = directory / (INDEX_FILE + ".tmp")
    temporary.write_text(json.dumps({"format": FORMAT, "version": VERSION, **index}, indent=2) + "\n",
                         encoding="utf-8")
    os.replace(temporary, directory / INDEX_FILE)
