"""Datasets in a bucket (``--dataset gs://bucket/...``), through the project's path layer (:mod:`nash_mhc.paths`:
``etils.epath`` over fsspec, ``gcsfs`` for ``gs://``; the ``gcs``/``tpu``/``cuda`` extras install it).

- Prepared shards are read by byte range: a batch fetches exactly its windows (``fsspec``'s concurrent
  ``cat_ranges``, one range per window), so each host reads only its own rows and nothing is downloaded whole.
- ``.jsonl``/``.json``/``.parquet``/``.txt`` files or folders are listed with ``fs.find`` and streamed
  (Parquet by row group through a seekable remote file), in the same relative-path order as a local copy, so
  the held-out part and every batch are the same as from that copy.
- :func:`upload` copies a finished local folder up (prepared shards: ``prepare --out gs://...``), the index last.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from nash_mhc import paths

__all__ = ["RangeTokens", "RangeWindows", "is_remote", "list_files", "size", "upload"]

is_remote = paths.is_remote


def _fs(uri: str) -> tuple[Any, str]:
    import fsspec

    paths.as_path(uri)  # one-line error when the bucket packages are missing
    return fsspec.core.url_to_fs(uri)


def list_files(root: paths.Path) -> list[tuple[str, paths.Path]]:
    """``(relative POSIX path, path)`` of every object under the bucket folder ``root`` (or ``root`` itself
    when it is one object), sorted; objects under hidden (``.``) folders or with hidden names are skipped."""
    uri = os.fspath(root).rstrip("/")
    fs, base = _fs(uri)
    if fs.isfile(base):
        return [(root.name, root)]
    found = []
    for name in fs.find(base):
        rel = name[len(base):].lstrip("/")
        if rel and not any(part.startswith(".") for part in rel.split("/")):
            found.append((rel, root / rel))
    return sorted(found)


def size(path: paths.Path) -> int | None:
    """Bytes of the object at ``path``, None when there is none."""
    fs, name = _fs(os.fspath(path))
    return int(fs.size(name)) if fs.isfile(name) else None


class RangeTokens:
    """A headerless token file in a bucket: ``shape`` and lazy windows; nothing is read until a batch asks."""

    def __init__(self, path: paths.Path, dtype: np.dtype, num_tokens: int) -> None:
        self.uri, self.dtype, self.shape = os.fspath(path), np.dtype(dtype), (int(num_tokens),)

    def as_windows(self, count: int, width: int) -> RangeWindows:
        return RangeWindows(self, count, width)


class RangeWindows:
    """``[count, width]`` windows of a :class:`RangeTokens`; ``windows[rows]`` reads exactly those rows."""

    def __init__(self, tokens: RangeTokens, count: int, width: int) -> None:
        self.tokens, self.shape = tokens, (count, width)
        self.bytes_read = 0  # what the batches read so far (the range reads are the only reads)

    def __getitem__(self, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        width, itemsize = self.shape[1], self.tokens.dtype.itemsize
        if rows.size and (rows.min() < 0 or rows.max() >= self.shape[0]):
            raise IndexError(f"window index out of range [0, {self.shape[0]})")
        fs, name = _fs(self.tokens.uri)
        starts = rows * width * itemsize
        blobs = fs.cat_ranges([name] * rows.size, starts.tolist(), (starts + width * itemsize).tolist(),
                              on_error="raise")
        data = b"".join(blobs)
        self.bytes_read += len(data)
        return np.frombuffer(data, dtype=self.tokens.dtype).reshape(rows.size, width)

    def __len__(self) -> int:
        return self.shape[0]


def upload(local: str | os.PathLike, remote: paths.Path, names: list[str]) -> None:
    """Copy the files ``names`` of the local folder ``local`` to the bucket folder ``remote``, in that order
    (streamed; put the file that marks the folder complete last)."""
    fs, base = _fs(os.fspath(remote).rstrip("/"))
    for name in names:
        fs.put_file(os.path.join(local, name), f"{base}/{name}")
    fs.invalidate_cache(base)
