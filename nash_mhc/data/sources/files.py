"""Local ``.txt``/``.jsonl``/``.json``/``.parquet`` files (``.gz`` compressed text too), one file or a directory
of them (read recursively in relative-path order, hidden files skipped).

The files may be in a bucket (``gs://...``: listed and streamed through :mod:`nash_mhc.data.remote`).
A ``.txt`` file is one document; JSON records and Parquet rows give their ``text_field`` (a null text is
skipped and counted). The held-out part is keyed per document (SHA-1 of the file's relative path mixed with the record's
index), so every file contributes to both parts. Read with the standard library (``pyarrow`` for Parquet),
not ``datasets.load_dataset``, which is slower and writes a cache copy of the corpus
(docs/results/cpu_throughput/README.md, "Moved from docstrings").
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from nash_mhc import paths
from nash_mhc.data import remote
from nash_mhc.data.sft import FIELD_FLAGS, Fields, columns
from nash_mhc.data.sources.base import Corpus, document_fractions, held_out, tail_cut, text_of

SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".txt": "txt", ".text": "txt",
            ".parquet": "parquet"}
SUFFIX_TEXT = ".txt, .jsonl, .json, .parquet"
AnyPath = Path | paths.Path  # a local path, or a bucket path (etils.epath)


def file_kind(path: AnyPath) -> str | None:
    """``"txt" | "jsonl" | "json" | "parquet"`` from the file name (``.gz`` allowed except for Parquet)."""
    name = path.name.lower()
    kind = SUFFIXES.get(Path(name.removesuffix(".gz")).suffix)
    return None if kind == "parquet" and name.endswith(".gz") else kind


def local_files(path: AnyPath) -> list[tuple[str, AnyPath]]:
    """``(relative POSIX path, path)`` of the readable files at ``path`` (a file or a directory; or a bucket
    object or folder, :mod:`nash_mhc.data.remote`), sorted."""
    if remote.is_remote(path):
        return [(rel, file) for rel, file in remote.list_files(path) if file_kind(file)]
    if path.is_file():
        return [(path.name, path)] if file_kind(path) else []
    found = []
    for directory, subdirs, names in os.walk(path):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))
        found += [(file.relative_to(path).as_posix(), file) for name in names if not name.startswith(".")
                  for file in [Path(directory) / name] if file_kind(file) and file.is_file()]
    return sorted(found)


@contextlib.contextmanager
def _open(path: AnyPath) -> Iterator[Any]:
    """A binary reader of a local or bucket file (decompressed for ``.gz``)."""
    with path.open("rb") as raw:
        yield gzip.GzipFile(fileobj=raw) if path.name.lower().endswith(".gz") else raw


def _lines(path: AnyPath) -> Iterator[bytes]:
    """The non-blank lines of a (possibly gzip-compressed) file."""
    with _open(path) as f:
        yield from (line for line in f if line.strip())


def _read(path: AnyPath) -> bytes:
    with _open(path) as f:
        return f.read()


def _json_records(path: AnyPath, rel: str) -> list[Any]:
    try:
        obj = json.loads(_read(path))
    except json.JSONDecodeError as error:
        if error.msg == "Extra data":  # JSON lines in a .json file
            return [json.loads(line) for line in _lines(path)]
        raise ValueError(f"{rel}: not valid JSON ({error.msg}, line {error.lineno})") from None
    if isinstance(obj, dict):  # {"data": [records]} or one record
        lists = [v for v in obj.values() if isinstance(v, list) and v and isinstance(v[0], dict)]
        return lists[0] if len(lists) == 1 else [obj]
    if isinstance(obj, list):
        return obj
    raise ValueError(f"{rel}: a JSON {type(obj).__name__}, expected objects with a text field")


def _parquet(path: AnyPath, rel: str, field: Fields) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{rel}: reading Parquet needs pyarrow: pip install 'nash-mhc[data]'") from None
    try:
        file = pq.ParquetFile(path.open("rb") if remote.is_remote(path) else path)  # remote: a seekable reader
    except Exception as error:  # noqa: BLE001 - pyarrow's error text is the useful part
        raise ValueError(f"{rel}: not a readable Parquet file ({str(error).splitlines()[0]})") from None
    text_of(dict.fromkeys(file.schema_arrow.names), field, rel)  # fails now when the column is missing
    return file


_WARNED: set[tuple[str, int]] = set()  # (file, size) already reported by decode_text


def decode_text(rel: str, data: bytes) -> str:
    """``data`` as UTF-8; bytes that are not UTF-8 become U+FFFD, and a file with any (a binary file named
    ``.txt``, another encoding) is reported once per process on stderr."""
    text = data.decode("utf-8", errors="replace")
    replaced = text.count("\ufffd") - data.count("\ufffd".encode())
    if replaced and (rel, len(data)) not in _WARNED:
        _WARNED.add((rel, len(data)))
        print(f"warning: {rel} is not UTF-8 text ({replaced} invalid byte sequences in {len(data)} bytes: a binary "
              "file? another encoding?); each is read as U+FFFD", file=sys.stderr)
    return text


def read_file(rel: str, path: AnyPath, field: Fields) -> Iterator[Any]:
    """One file's documents (or prompt/response pairs) in order (``Skipped`` for a null text: it keeps its index)."""
    kind = file_kind(path)
    if kind == "txt" and not isinstance(field, str):
        raise ValueError(f"{rel}: a text file has no fields; {FIELD_FLAGS} need .jsonl/.json/.parquet records")
    if kind == "txt":
        data = _read(path)
        if data:
            yield decode_text(rel, data)
    elif kind == "parquet":
        for batch in _parquet(path, rel, field).iter_batches(columns=columns(field), batch_size=1024):
            for row in batch.to_pylist():
                yield text_of(row, field, rel)
    else:
        records = _json_records(path, rel) if kind == "json" else _lines(path)
        for i, record in enumerate(records):
            try:
                record = json.loads(record) if kind == "jsonl" else record
            except json.JSONDecodeError as error:
                raise ValueError(f"{rel} record {i + 1}: not valid JSON ({error.msg})") from None
            yield text_of(record, field, f"{rel} (record {i + 1})")


def _count(rel: str, path: AnyPath, field: Fields) -> int:
    """Documents in one file, checking the text field on its first record (or its schema) only."""
    kind = file_kind(path)
    if kind == "parquet":
        return int(_parquet(path, rel, field).metadata.num_rows)
    if kind == "jsonl":
        records = read_file(rel, path, field)
        next(records, None)  # parses and checks the first record
        records.close()
        return sum(1 for _ in _lines(path))
    return sum(1 for _ in read_file(rel, path, field))


def corpus(root: AnyPath, name: str, part: str, text_field: Fields) -> Corpus:
    """The ``part`` of the files at ``root``; checks the text field and that there is a document now."""
    files = local_files(root)
    if not files and root.is_file():
        raise ValueError(f"dataset {name!r}: unsupported file type (expected {SUFFIX_TEXT}, .gz allowed)")
    if not files:
        raise ValueError(f"dataset {name!r}: no {SUFFIX_TEXT} files under the directory")
    counts = [_count(rel, path, text_field) for rel, path in files]
    if not sum(counts):
        raise ValueError(f"dataset {name!r} is empty: no documents in its {SUFFIX_TEXT} files")
    fractions = np.concatenate([document_fractions(rel, c) for (rel, _), c in zip(files, counts, strict=True)])
    masks = np.split(held_out(fractions), np.cumsum(counts)[:-1])
    want_eval = part == "eval"

    def documents() -> Iterator[Any]:
        for (rel, path), mask in zip(files, masks, strict=True):
            for i, doc in enumerate(read_file(rel, path, text_field)):
                if i >= len(mask):
                    raise ValueError(f"{rel} changed while it was read; run again")
                if isinstance(doc, str) and sum(counts) == 1:  # one document: train is its head, eval its tail
                    yield doc[tail_cut(doc):] if want_eval else doc[:tail_cut(doc)]
                elif bool(mask[i]) == want_eval:  # a Skipped record too: it is counted
                    yield doc

    return Corpus(name, part, documents)
