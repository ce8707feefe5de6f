"""Document sources: where the training text comes from.

A source is a small, frozen, hashable description of one split (``"train"`` or the held-out ``"eval"``) of a
corpus (the pipeline caches built token streams keyed on it) with a ``documents()`` iterator of text. It may
also offer ``document_bytes() -> Iterator[bytes]`` (raw UTF-8 documents, used by byte-level tokenizers without
a decode/encode round trip), ``token_stream(tokenizer) -> np.ndarray`` (already tokenised, EOS-separated ids),
``packed_dataset(tokenizer, seq_len, seed)`` (its own random-access windows, e.g. memory-mapped shards) and
``max_tokens`` (the pipeline stops after that many tokens: the bounded prefix of a stream).

``load_source(name, split, seed, ...)`` resolves ``name``:

- ``"stdlib"`` (also ``"default"``): the ``.py`` files of the running interpreter's standard library — no
  network, tens of MB of real code on every machine. Files are ordered by relative path; the held-out eval
  split is a stable hash of each relative path (about 1%), so it is the same on every host and every run.
- ``"synthetic"``: short documents generated from the seed by a fixed random word-level Markov grammar — cheap,
  deterministic and learnable, for smoke tests.
- a local path: a directory of prepared shards (``python -m nash_mhc.data.prepare``; ``index.json``), a
  directory written by ``datasets``' ``save_to_disk``, or a ``.txt``/``.jsonl``/``.json``/``.parquet`` file
  (``.gz`` compressed text too) or a directory of them (read recursively, sorted by relative path, hidden
  files skipped). A ``.txt`` file is one document; JSON records and Parquet rows give their ``text_field``.
- anything else that looks like a Hugging Face hub id (``org/name``), with ``dataset_name`` (configuration) and
  ``dataset_split``: streamed through ``datasets`` when the hub is reachable, else read from the local
  Hugging Face cache; a one-line ``ValueError`` names the offline alternatives when neither works.

Held-out eval split (deterministic, the same on every host): the dataset's own ``validation``/``valid``/
``val``/``test`` split when a ``save_to_disk`` ``DatasetDict`` or a hub dataset has one; otherwise, for local
files and saved datasets, documents whose stable hash (SHA-1 of the file's relative path, mixed with the
document's index by SplitMix64) falls below ``eval_fraction`` — at least one document each way, and a corpus
of a single document is cut at a line break near ``1 - eval_fraction`` of its length; for a hub stream, its
first ``STREAM_EVAL_DOCUMENTS`` documents (train skips them).

Streaming hub datasets are read up to ``max_tokens`` tokens (``--max-stream-tokens``): that deterministic
prefix of the stream is then batched exactly like a local corpus, so resuming needs only the step. Corpora
larger than that belong in prepared shards.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import hashlib
import itertools
import json
import os
import sys
import sysconfig
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from nash_mhc.data import hub

__all__ = [
    "DEFAULT_MAX_STREAM_TOKENS",
    "EVAL_FRACTION",
    "SPLITS",
    "STREAM_EVAL_DOCUMENTS",
    "DiskDatasetSource",
    "FileSource",
    "HubSource",
    "Source",
    "StdlibSource",
    "SyntheticSource",
    "document_hash_fractions",
    "eval_hash_fraction",
    "load_source",
    "split_paths",
    "stdlib_files",
]

SPLITS = ("train", "eval")
EVAL_FRACTION = 0.01
DEFAULT_MAX_STREAM_TOKENS = 20_000_000
STREAM_EVAL_DOCUMENTS = 200
_STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_EVAL_SPLIT_NAMES = ("validation", "valid", "val", "test")


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
                "use --dataset synthetic or a local path"
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
# Held-out split of local documents

_MASK64 = (1 << 64) - 1


def document_hash_fractions(key: str, count: int) -> np.ndarray:
    """Stable numbers in [0, 1) for documents ``0..count-1`` of ``key`` (SHA-1 of the key, SplitMix64 per index)."""
    salt = int.from_bytes(hashlib.sha1(key.encode("utf-8")).digest()[:8], "big")
    with np.errstate(over="ignore"):
        x = np.arange(count, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(salt)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def _eval_masks(keys: Sequence[str], counts: Sequence[int], eval_fraction: float) -> list[np.ndarray]:
    """Per key, which of its documents are held out; at least one each way when there are two or more."""
    fractions = [document_hash_fractions(k, c) for k, c in zip(keys, counts, strict=True)]
    masks = [f < eval_fraction for f in fractions]
    total = sum(counts)
    if total >= 2:
        flat = np.concatenate(fractions)
        flat_mask = np.concatenate(masks)
        if not flat_mask.any():
            flat_mask[int(np.argmin(flat))] = True
        elif flat_mask.all():
            flat_mask[int(np.argmax(flat))] = False
        bounds = np.cumsum([0, *counts])
        masks = [flat_mask[bounds[i]:bounds[i + 1]] for i in range(len(counts))]
    for m in masks:
        m.flags.writeable = False
    return masks


def _tail_cut(doc: str | bytes, eval_fraction: float) -> int:
    """Where a single-document corpus is cut into train (before) and eval (after): after a line break near
    ``1 - eval_fraction`` of its length."""
    target = max(1, int(len(doc) * (1.0 - eval_fraction)))
    newline = "\n" if isinstance(doc, str) else b"\n"
    cut = doc.rfind(newline, 0, target)  # type: ignore[arg-type]
    return cut + 1 if cut > len(doc) // 2 else target


def _stat_digest(paths: Iterable[Path], root: Path) -> str:
    h = hashlib.sha1()
    for p in paths:
        try:
            st = p.stat()
        except OSError:
            continue
        h.update(f"{p.relative_to(root).as_posix() if p != root else p.name}\0{st.st_size}\0{st.st_mtime_ns}\n"
                 .encode())
    return h.hexdigest()[:16]


# ----------------------------------------------------------------------------------------------------------------
# Local files: .txt, .jsonl, .json, .parquet

_KINDS = ((".jsonl", "jsonl"), (".ndjson", "jsonl"), (".json", "json"), (".txt", "txt"), (".text", "txt"),
          (".parquet", "parquet"))
FILE_SUFFIXES = ".txt, .jsonl, .json, .parquet"


def file_kind(path: Path) -> str | None:
    """``"txt" | "jsonl" | "json" | "parquet"`` from the file name (``.gz`` allowed except for Parquet)."""
    name = path.name.lower()
    compressed = name.endswith(".gz")
    if compressed:
        name = name[:-3]
    for suffix, kind in _KINDS:
        if name.endswith(suffix):
            return None if (compressed and kind == "parquet") else kind
    return None


def _open_binary(path: Path) -> Any:
    return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")  # noqa: SIM115


def _read_bytes(path: Path) -> bytes:
    with _open_binary(path) as f:
        return f.read()


def _not_found(field: str, where: str, record: object) -> ValueError:
    if not isinstance(record, dict):
        return ValueError(f"{where} is a JSON {type(record).__name__}, not an object with a {field!r} field")
    fields = ", ".join(str(k) for k in record) or "none"
    return ValueError(f"text field {field!r} not found in {where}; fields: {fields} (use --text-field)")


def _text_of(record: object, field: str, where: str) -> str | None:
    if not isinstance(record, dict) or field not in record:
        raise _not_found(field, where, record)
    value = record[field]
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"text field {field!r} in {where} is a {type(value).__name__}, not a string "
                         "(use --text-field)")
    return value


def _json_records(path: Path, rel: str) -> list[Any]:
    data = _read_bytes(path)
    try:
        obj = json.loads(data)
    except json.JSONDecodeError as error:
        if error.msg == "Extra data":  # JSON lines in a .json file
            return [json.loads(line) for line in data.splitlines() if line.strip()]
        raise ValueError(f"{rel}: not valid JSON ({error.msg}, line {error.lineno})") from None
    if isinstance(obj, dict):
        lists = [v for v in obj.values() if isinstance(v, list) and v and isinstance(v[0], dict)]
        return lists[0] if len(lists) == 1 else [obj]
    if isinstance(obj, list):
        return obj
    raise ValueError(f"{rel}: a JSON {type(obj).__name__}, expected objects with a text field")


def _jsonl_lines(path: Path) -> Iterator[bytes]:
    """The non-blank lines of a JSON-lines file."""
    with _open_binary(path) as f:
        for line in f:
            if line.strip():
                yield line


def _parquet_file(path: Path, rel: str) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{rel}: reading Parquet needs pyarrow: pip install 'nash-mhc[data]'") from None
    try:
        return pq.ParquetFile(path)
    except Exception as error:  # noqa: BLE001 - pyarrow's error text is the useful part
        raise ValueError(f"{rel}: not a readable Parquet file ({str(error).splitlines()[0]})") from None


@dataclasses.dataclass(frozen=True)
class _FileEntry:
    rel: str
    path: Path
    kind: str
    count: int


def _count_and_check(path: Path, rel: str, kind: str, field: str) -> int:
    """Number of documents in one file; checks that the text field exists (first record / the schema)."""
    if kind == "txt":
        return 1 if path.stat().st_size > 0 else 0
    if kind == "jsonl":
        count = 0
        for line in _jsonl_lines(path):
            if count == 0:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{rel} line 1: not valid JSON ({error.msg})") from None
                _text_of(record, field, f"{rel} (first record)")
            count += 1
        return count
    if kind == "json":
        records = _json_records(path, rel)
        if records:
            _text_of(records[0], field, f"{rel} (first record)")
        return len(records)
    parquet = _parquet_file(path, rel)
    names = parquet.schema_arrow.names
    if field not in names:
        raise ValueError(f"text field {field!r} not found in {rel}; fields: {', '.join(names)} (use --text-field)")
    return int(parquet.metadata.num_rows)


def _iter_file(entry: _FileEntry, field: str, raw: bool) -> Iterator[str | bytes | None]:
    """One file's documents in order (``None`` for a record whose text is null: it keeps its index)."""
    if entry.kind == "txt":
        if entry.count:
            data = _read_bytes(entry.path)
            yield data if raw else data.decode("utf-8", errors="replace")
        return
    if entry.kind in ("jsonl", "json"):
        if entry.kind == "jsonl":
            records: Iterable[Any] = (_loads(line, entry.rel, i) for i, line in enumerate(_jsonl_lines(entry.path)))
        else:
            records = _json_records(entry.path, entry.rel)
        for i, record in enumerate(records):
            text = _text_of(record, field, f"{entry.rel} (record {i + 1})")
            yield None if text is None else (text.encode("utf-8") if raw else text)
        return
    parquet = _parquet_file(entry.path, entry.rel)
    for batch in parquet.iter_batches(columns=[field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if text is not None and not isinstance(text, str):
                raise ValueError(f"text field {field!r} in {entry.rel} is {type(text).__name__}, not a string "
                                 "(use --text-field)")
            yield None if text is None else (text.encode("utf-8") if raw else text)


def _loads(line: bytes, rel: str, index: int) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{rel} record {index + 1}: not valid JSON ({error.msg})") from None


def local_files(path: Path) -> list[tuple[str, Path]]:
    """``(relative POSIX path, path)`` of the readable text files at ``path`` (a file or a directory), sorted."""
    if path.is_file():
        return [(path.name, path)] if file_kind(path) else []
    found = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        here = Path(dirpath)
        for f in filenames:
            file = here / f
            if not f.startswith(".") and file_kind(file) and file.is_file():
                found.append((file.relative_to(path).as_posix(), file))
    return sorted(found)


@functools.lru_cache(maxsize=16)
def _file_plan(root: str, text_field: str, eval_fraction: float, stamp: str
               ) -> tuple[tuple[_FileEntry, ...], tuple[np.ndarray, ...]]:
    del stamp  # part of the cache key only: a changed corpus is planned again
    entries = tuple(_FileEntry(rel, p, kind, _count_and_check(p, rel, kind, text_field))
                    for rel, p in local_files(Path(root)) for kind in [file_kind(p) or ""])
    if sum(e.count for e in entries) == 0:
        raise ValueError(f"dataset {root!r} is empty: no documents in its {FILE_SUFFIXES} files")
    masks = _eval_masks([e.rel for e in entries], [e.count for e in entries], eval_fraction)
    return entries, tuple(masks)


@dataclasses.dataclass(frozen=True)
class FileSource:
    """Local ``.txt``/``.jsonl``/``.json``/``.parquet`` file(s); ``path`` is a file or a directory.

    ``stamp`` digests every file's size and modification time, so an edited corpus is a new cache key.
    """

    path: str
    split: str = "train"
    text_field: str = "text"
    eval_fraction: float = EVAL_FRACTION
    stamp: str = ""
    name: str = "files"

    def __post_init__(self) -> None:
        _check_split(self.split)

    def plan(self) -> tuple[tuple[_FileEntry, ...], tuple[np.ndarray, ...]]:
        """Every file with its document count, and which documents are held out."""
        return _file_plan(self.path, self.text_field, self.eval_fraction, self.stamp)

    def files(self) -> list[str]:
        """Relative paths of the files read (both splits draw documents from every file)."""
        return [e.rel for e in self.plan()[0]]

    def _documents(self, raw: bool) -> Iterator[str | bytes]:
        entries, masks = self.plan()
        want_eval = self.split == "eval"
        if sum(e.count for e in entries) == 1:  # one document: train is its head, eval its tail
            for entry in entries:
                for doc in _iter_file(entry, self.text_field, raw):
                    if doc is not None:
                        cut = _tail_cut(doc, self.eval_fraction)
                        yield doc[cut:] if want_eval else doc[:cut]
            return
        for entry, mask in zip(entries, masks, strict=True):
            if not entry.count or (want_eval and not mask.any()):
                continue
            for i, doc in enumerate(_iter_file(entry, self.text_field, raw)):
                if i >= entry.count:
                    raise ValueError(f"{entry.rel} changed while it was read; run again")
                if doc is not None and bool(mask[i]) == want_eval:
                    yield doc

    def document_bytes(self) -> Iterator[bytes]:
        return self._documents(raw=True)  # type: ignore[return-value]

    def documents(self) -> Iterator[str]:
        return self._documents(raw=False)  # type: ignore[return-value]

    def __iter__(self) -> Iterator[str]:
        return self.documents()


# ----------------------------------------------------------------------------------------------------------------
# Hugging Face datasets: save_to_disk directories and the hub


def _require_datasets(what: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{what} needs the 'datasets' package: pip install 'nash-mhc[data]'") from None
    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    return datasets


def is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a directory written by ``Dataset.save_to_disk``/``DatasetDict.save_to_disk``."""
    return path.is_dir() and ((path / "dataset_dict.json").is_file()
                              or ((path / "state.json").is_file() and (path / "dataset_info.json").is_file()))


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


_LOADED: dict[tuple[Any, ...], Any] = {}
_LOADED_LOCK = threading.Lock()


def _memo(key: tuple[Any, ...], load: Any) -> Any:
    with _LOADED_LOCK:
        if key not in _LOADED:
            _LOADED[key] = load()
        return _LOADED[key]


def _pick_splits(available: Sequence[str], train_split: str, what: str) -> tuple[str, str | None]:
    """(train split, the dataset's own eval split or None)."""
    if train_split not in available:
        raise ValueError(f"{what} has no split {train_split!r}; splits: {', '.join(available)} (use --split)")
    own_eval = next((s for s in _EVAL_SPLIT_NAMES if s in available and s != train_split), None)
    return train_split, own_eval


def _check_columns(columns: Sequence[str], field: str, what: str) -> None:
    if field not in columns:
        raise ValueError(f"text field {field!r} not found in {what}; fields: {', '.join(columns)} "
                         "(use --text-field)")


def _rows_text(dataset: Any, field: str, what: str, batch_size: int = 1000) -> Iterator[str | None]:
    for batch in dataset.select_columns([field]).iter(batch_size=batch_size):
        for text in batch[field]:
            if text is not None and not isinstance(text, str):
                raise ValueError(f"text field {field!r} in {what} is {type(text).__name__}, not a string "
                                 "(use --text-field)")
            yield text


def _arrow_documents(dataset: Any, split: str, own_eval: Any, field: str, eval_fraction: float, key: str,
                     what: str) -> Iterator[str]:
    """Documents of one role of an in-memory/memory-mapped ``datasets.Dataset`` (``own_eval``: its eval split)."""
    if split == "eval" and own_eval is not None:
        yield from (t for t in _rows_text(own_eval, field, what) if t is not None)
        return
    if own_eval is not None:
        yield from (t for t in _rows_text(dataset, field, what) if t is not None)
        return
    (mask,) = _eval_masks([key], [len(dataset)], eval_fraction)
    if split == "eval":
        yield from (t for t in _rows_text(dataset.select(np.flatnonzero(mask)), field, what) if t is not None)
        return
    for i, text in enumerate(_rows_text(dataset, field, what)):
        if text is not None and not mask[i]:
            yield text


@dataclasses.dataclass(frozen=True)
class DiskDatasetSource:
    """A ``datasets`` directory saved with ``save_to_disk`` (a ``Dataset`` or a ``DatasetDict``)."""

    path: str
    split: str = "train"
    dataset_split: str = "train"
    text_field: str = "text"
    eval_fraction: float = EVAL_FRACTION
    stamp: str = ""
    name: str = "saved-dataset"

    def __post_init__(self) -> None:
        _check_split(self.split)

    def open(self) -> tuple[Any, Any]:
        """(the train split's ``Dataset``, the dataset's own eval split or None); checks split and field."""
        return _memo(("disk", self.path, self.dataset_split, self.text_field, self.stamp), self._open)

    def _open(self) -> tuple[Any, Any]:
        datasets = _require_datasets(f"dataset {self.name!r}")
        try:
            loaded = datasets.load_from_disk(self.path)
        except Exception as error:  # noqa: BLE001
            raise ValueError(f"dataset {self.name!r}: cannot load the saved dataset: {_first_line(error)}") from None
        own_eval = None
        if isinstance(loaded, datasets.DatasetDict):
            train_split, eval_split = _pick_splits(list(loaded), self.dataset_split, f"dataset {self.name!r}")
            train, own_eval = loaded[train_split], (loaded[eval_split] if eval_split else None)
        else:
            if self.dataset_split != "train":
                raise ValueError(f"dataset {self.name!r} is a single saved Dataset without named splits; "
                                 f"--split {self.dataset_split!r} does not apply")
            train = loaded
        _check_columns(train.column_names, self.text_field, f"dataset {self.name!r}")
        if own_eval is not None:
            _check_columns(own_eval.column_names, self.text_field, f"dataset {self.name!r} (eval split)")
        return train, own_eval

    def documents(self) -> Iterator[str]:
        train, own_eval = self.open()
        return _arrow_documents(train, self.split, own_eval, self.text_field, self.eval_fraction,
                                f"{self.dataset_split}", f"dataset {self.name!r}")

    def __iter__(self) -> Iterator[str]:
        return self.documents()


def _offline_message(repo_id: str) -> str:
    return f"dataset {repo_id!r} cannot be reached offline; {hub.DATASET_ALTERNATIVES}"


@dataclasses.dataclass(frozen=True)
class HubSource:
    """A Hugging Face hub dataset, streamed (hub reachable) or from the local cache (offline).

    Train reads the stream up to ``max_tokens`` tokens (the pipeline stops there), skipping the first
    ``eval_documents`` documents when they are the eval split (no ``validation``/``test`` split of its own).
    """

    repo_id: str
    split: str = "train"
    dataset_name: str | None = None
    dataset_split: str = "train"
    text_field: str = "text"
    max_tokens: int | None = DEFAULT_MAX_STREAM_TOKENS
    eval_documents: int = STREAM_EVAL_DOCUMENTS
    name: str = ""

    def __post_init__(self) -> None:
        _check_split(self.split)

    def open(self) -> tuple[str, Any]:
        """``("stream", None)`` when the hub is reachable, else ``("cache", DatasetDict)`` from the local cache."""
        return _memo(("hub", self.repo_id, self.dataset_name), self._open)

    def _open(self) -> tuple[str, Any]:
        try:
            import datasets
        except ImportError:
            raise ValueError(f"dataset {self.repo_id!r} looks like a Hugging Face hub id, which needs the 'datasets' "
                             f"package (pip install 'nash-mhc[data]'); or {hub.DATASET_ALTERNATIVES}") from None
        datasets = _require_datasets(f"dataset {self.repo_id!r}")
        if hub.hub_reachable():
            return "stream", None
        try:
            with hub.offline(datasets_too=True):
                cached = datasets.load_dataset(self.repo_id, self.dataset_name)
        except Exception:  # noqa: BLE001 - whatever the reason, it is not usable offline
            raise ValueError(_offline_message(self.repo_id)) from None
        return "cache", cached

    def check(self) -> None:
        """Fail now (one line) when the dataset is neither reachable nor cached."""
        self.open()

    def _splits(self) -> tuple[str, str | None, Any]:
        mode, cached = self.open()
        what = f"dataset {self.repo_id!r}"
        if mode == "cache":
            return (*_pick_splits(list(cached), self.dataset_split, what), cached)
        datasets = _require_datasets(what)
        try:
            names = datasets.get_dataset_split_names(self.repo_id, self.dataset_name)
        except Exception as error:  # noqa: BLE001
            raise ValueError(f"{what}: {_first_line(error)}") from None
        return (*_pick_splits(names, self.dataset_split, what), None)

    def _rows(self, split_name: str, cached: Any) -> Iterator[str | None]:
        what = f"dataset {self.repo_id!r} split {split_name!r}"
        if cached is not None:
            data = cached[split_name]
            _check_columns(data.column_names, self.text_field, what)
            yield from _rows_text(data, self.text_field, what)
            return
        datasets = _require_datasets(what)
        try:
            stream = datasets.load_dataset(self.repo_id, self.dataset_name, split=split_name, streaming=True)
            for i, row in enumerate(stream):
                if i == 0:
                    _check_columns(list(row), self.text_field, what)
                text = row[self.text_field]
                if text is not None and not isinstance(text, str):
                    raise ValueError(f"text field {self.text_field!r} in {what} is {type(text).__name__}, not a "
                                     "string (use --text-field)")
                yield text
        except ValueError:
            raise
        except Exception as error:  # noqa: BLE001 - network and hub errors become one line
            raise ValueError(f"{what}: {_first_line(error)}") from None

    def documents(self) -> Iterator[str]:
        train_split, own_eval, cached = self._splits()
        if self.split == "eval":
            rows = self._rows(own_eval or train_split, cached)
            yield from (t for t in itertools.islice(rows, self.eval_documents) if t is not None)
            return
        for i, text in enumerate(self._rows(train_split, cached)):
            if text is not None and (own_eval is not None or i >= self.eval_documents):
                yield text

    def __iter__(self) -> Iterator[str]:
        return self.documents()


# ----------------------------------------------------------------------------------------------------------------


def _local_only(name: str, kind: str, dataset_name: str | None, dataset_split: str) -> None:
    if dataset_name:
        raise ValueError(f"--dataset-name only applies to Hugging Face hub datasets, not {kind} {name!r}")
    if dataset_split != "train":
        raise ValueError(f"--split {dataset_split!r}: {kind} {name!r} has no named splits (train uses 'train'; "
                         "eval uses a held-out split automatically)")


def load_source(
    name: str,
    split: str = "train",
    seed: int = 0,
    *,
    dataset_name: str | None = None,
    dataset_split: str = "train",
    text_field: str = "text",
    max_stream_tokens: int | None = DEFAULT_MAX_STREAM_TOKENS,
) -> Source:
    """The ``split`` (``"train"``/``"eval"``) of dataset ``name`` (see the module docstring for the names).

    ``dataset_name``/``dataset_split`` are the configuration and split of a Hugging Face dataset
    (``dataset_split`` also picks a split of a saved ``DatasetDict``); ``text_field`` is the JSON/Parquet/
    ``datasets`` column holding the text. Raises a one-line ``ValueError`` for anything unusable.
    """
    _check_split(split)
    if name in ("stdlib", "default", "synthetic"):
        if dataset_name:
            raise ValueError(f"--dataset-name only applies to Hugging Face datasets, not {name!r}")
        if dataset_split != "train":
            raise ValueError(f"--split {dataset_split!r}: the offline corpora train on 'train' (eval uses a "
                             "held-out split automatically)")
        return SyntheticSource(split=split, seed=seed) if name == "synthetic" else StdlibSource(split=split)
    path = Path(name).expanduser()
    if path.exists():
        from nash_mhc.data import shards  # shards builds on the pipeline, which imports this module

        root = path.resolve()
        if shards.is_shard_dir(root):
            _local_only(name, "prepared shards", dataset_name, dataset_split)
            return shards.ShardSource(str(root), split=split, stamp=shards.index_digest(root), name=name)
        if is_saved_dataset(root):
            if dataset_name:
                raise ValueError(f"--dataset-name only applies to Hugging Face hub datasets, not the saved dataset "
                                 f"{name!r}")
            stamp = _stat_digest(sorted(p for p in root.rglob("*") if p.is_file()), root)
            saved = DiskDatasetSource(str(root), split=split, dataset_split=dataset_split, text_field=text_field,
                                      stamp=stamp, name=name)
            saved.open()  # fail now on a wrong split or text field
            return saved
        _local_only(name, "local dataset", dataset_name, dataset_split)
        files = local_files(root)
        if not files:
            if root.is_file():
                raise ValueError(f"dataset {name!r}: unsupported file type (expected {FILE_SUFFIXES}, .gz allowed)")
            raise ValueError(f"dataset {name!r}: no {FILE_SUFFIXES} files under the directory")
        local = FileSource(str(root), split=split, text_field=text_field,
                           stamp=_stat_digest([p for _, p in files], root), name=name)
        local.plan()  # fail now on a missing text field or an empty corpus
        return local
    if not hub.looks_like_hub_id(name):
        raise ValueError(f"dataset path {name!r} does not exist")
    source = HubSource(name, split=split, dataset_name=dataset_name, dataset_split=dataset_split,
                       text_field=text_field, max_tokens=max_stream_tokens if split == "train" else None, name=name)
    source.check()
    return source
