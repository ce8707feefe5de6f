"""One path layer for every run output: local directories and bucket URIs (``gs://``, ``s3://``, ...).

Built on ``etils.epath`` (the layer Orbax uses itself), so ``--checkpoint-dir gs://bucket/run`` reaches the
same filesystem in the checkpointer, the run logger, ``config.json`` and the compile cache:

- local paths (no scheme) are plain ``pathlib``-style paths made absolute (``~`` expanded);
- ``gs://``/``s3://``/``az://``/``hf://`` go through epath's fsspec backend (``gcsfs`` for ``gs://``, installed
  by the ``tpu``/``gcs`` extras), or through ``tf.io.gfile`` when TensorFlow is installed; Orbax writes the
  arrays themselves with TensorStore's native GCS driver;
- ``file:///abs/path`` is accepted and means the local path ``/abs/path``.

Object stores cannot append to a file and show an object only once its upload is complete, so files that
grow while a run is going (``metrics.jsonl``, TensorBoard event files) are written into a local
:class:`Mirror` and copied up whole every ``sync_interval_s`` seconds and at close.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import re
import shutil
import tempfile
import time
from pathlib import Path as LocalPath
from typing import Any

from etils import epath

Path = epath.Path
PathLike = str | os.PathLike

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
REMOTE_SCHEMES = ("gs", "s3", "az", "hf")
BUCKET_SCHEMES = ("gs", "s3", "az")  # <scheme>://<bucket>/<object path>
_GCS_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")  # GCS's naming rules, but for the dotted parts


def scheme(path: PathLike) -> str | None:
    """The URI scheme of ``path`` (``"gs"`` for ``gs://b/x``), or None for a plain local path."""
    match = _SCHEME.match(os.fspath(path))
    return match.group(1).lower() if match else None


def is_remote(path: PathLike) -> bool:
    """True for bucket URIs (anything with a scheme other than ``file://``)."""
    return scheme(path) not in (None, "file")


def as_path(path: PathLike) -> epath.Path:
    """``path`` as an ``epath.Path``: bucket URIs unchanged, local paths (and ``file://``) made absolute.

    Raises ValueError (a one-line message for the CLI) for a scheme epath cannot open.
    """
    text = os.fspath(path)
    kind = scheme(text)
    if kind is None:
        return epath.Path(LocalPath(text).expanduser().absolute())
    if kind == "file":
        return epath.Path(LocalPath(text[len("file://"):]).absolute())
    if kind not in REMOTE_SCHEMES:
        raise ValueError(f"unsupported path scheme {kind}:// in {text} (use a local path or one of "
                         f"{', '.join(s + '://' for s in REMOTE_SCHEMES)})")
    name = bucket(text)
    if kind in BUCKET_SCHEMES and not name:
        raise ValueError(f"{text}: no bucket name (write {kind}://BUCKET/path)")
    if kind == "gs" and not _GCS_BUCKET.fullmatch(name):
        raise ValueError(f"{text}: {name!r} is not a GCS bucket name (lowercase letters, digits, '-', '_' and '.', "
                         "3 to 63 of them, starting and ending with a letter or digit)")
    missing = missing_packages(kind)
    if missing:
        how = ("pip install -e \".[gcs]\"; the tpu and cuda extras include it" if kind == "gs"
               else "pip install " + " ".join(missing))
        raise ValueError(f"{text}: {kind}:// paths need {' and '.join(missing)} ({how})")
    return epath.Path(text)


def fresh(path: epath.Path) -> epath.Path:
    """``path`` after dropping the bucket client's cached listings under it (fsspec caches a folder's listing,
    and TensorStore and other processes write behind its back); a local path as it is."""
    if is_remote(path):
        with contextlib.suppress(ImportError, ValueError):
            _bucket_fs(path).invalidate_cache()
    return path


def _bucket_fs(path: epath.Path) -> Any:
    """The fsspec filesystem epath reaches ``path`` through (its own instance, with its own listing cache)."""
    from etils.epath import backend

    return backend.fsspec_backend.fs(os.fspath(path))


def move(source: epath.Path, target: epath.Path) -> None:
    """Move the folder ``source`` to ``target`` (whose parent need not exist). A bucket has no rename: the objects
    are copied and deleted one by one, so a move interrupted half-way leaves each object in one place or both."""
    if not is_remote(source):
        target.parent.mkdir(parents=True, exist_ok=True)
        source.rename(target)
        return
    fs = _bucket_fs(source)
    fs.mv(os.fspath(source), os.fspath(target), recursive=True)
    fs.invalidate_cache()


def bucket(path: PathLike) -> str:
    """The bucket of a bucket URI (``"b"`` for ``gs://b/x``; ``""`` for ``gs://``), or ``""`` for other paths."""
    text = os.fspath(path)
    kind = scheme(text)
    return text[len(kind) + 3:].split("/", 1)[0] if kind in BUCKET_SCHEMES else ""


def check_bucket(path: PathLike) -> None:
    """A one-line ValueError, writing nothing, when the bucket of bucket URI ``path`` does not exist or cannot be
    listed (other paths pass). Listing, not the bucket's metadata: a role that may use the objects but not read
    the bucket's metadata (Storage Object Admin) still passes, and nothing creates a misspelt bucket."""
    kind, name = scheme(path), bucket(path)
    if not name:
        return
    try:
        next(iter(epath.Path(f"{kind}://{name}").iterdir()), None)
    except FileNotFoundError:
        raise ValueError(f"{os.fspath(path)}: bucket {name} does not exist (or these credentials cannot see "
                         "it)") from None
    except Exception as error:  # noqa: BLE001 - permissions, network: each client has its own exceptions
        reason = (str(error).strip().splitlines() or [""])[0][:200]
        raise ValueError(f"{os.fspath(path)}: cannot reach bucket {name} ({type(error).__name__}: "
                         f"{reason})") from None


def missing_packages(kind: str) -> list[str]:
    """Packages that reading and writing ``kind://`` paths needs but are not installed.

    ``gs://``: epath reaches GCS through fsspec's ``gcs`` filesystem (gcsfs) unless TensorFlow is installed,
    and Orbax asks ``google-cloud-storage`` for the bucket's layout when it lists checkpoint steps (it
    fails with ModuleNotFoundError in a background thread without it).
    """
    missing = []
    fsspec_package = {"gs": "gcsfs", "s3": "s3fs", "az": "adlfs", "hf": "huggingface_hub"}[kind]
    if importlib.util.find_spec("tensorflow") is None or kind not in ("gs", "s3"):
        try:
            import fsspec

            fsspec.get_filesystem_class("gcs" if kind == "gs" else kind)
        except (ImportError, ValueError):
            missing.append(fsspec_package)
    if kind == "gs":
        try:
            import google.cloud.storage  # noqa: F401
        except ImportError:
            missing.append("google-cloud-storage")
    return missing


class Mirror:
    """A local working copy of a (possibly remote) directory for files that are appended to.

    For a local ``directory`` the copy *is* the directory and :meth:`sync` does nothing. For a bucket URI
    files are written under a local staging directory (``pull`` names the files whose remote content is
    downloaded first, so appending continues a resumed run's file) and :meth:`sync` uploads every file that
    changed since the last upload, at most once every ``interval_s`` seconds unless forced.
    """

    def __init__(self, directory: PathLike, *, pull: tuple[str, ...] = (), interval_s: float = 30.0,
                 staging_root: PathLike | None = None):
        self.remote = as_path(directory)
        self.interval_s = interval_s
        self._uploaded: dict[str, tuple[int, int]] = {}
        self._last_sync = -math.inf  # the first sync is due at once, so a run's first metrics show up early
        if not is_remote(directory):
            self.local = LocalPath(os.fspath(self.remote))
            self.local.mkdir(parents=True, exist_ok=True)
            self.active = False
            return
        self.active = True
        root = LocalPath(staging_root) if staging_root else None
        if root is not None:
            root.mkdir(parents=True, exist_ok=True)
        self.local = LocalPath(tempfile.mkdtemp(prefix="nash_mhc-mirror-", dir=root))
        for name in pull:
            source = self.remote / name
            if source.exists():
                target = self.local / name
                target.write_bytes(source.read_bytes())
                self._uploaded[name] = self._signature(target)

    @staticmethod
    def _signature(file: LocalPath) -> tuple[int, int]:
        stat = file.stat()
        return stat.st_size, stat.st_mtime_ns

    def due(self) -> bool:
        """True when this is a bucket mirror and ``interval_s`` has passed since the last upload."""
        return self.active and time.monotonic() - self._last_sync >= self.interval_s

    def sync(self, *, force: bool = False) -> list[str]:
        """Upload the files that changed (every ``interval_s`` seconds, or now if ``force``); returns names."""
        if not self.active or not (force or self.due()):
            return []
        self._last_sync = time.monotonic()
        self.remote.mkdir(parents=True, exist_ok=True)
        uploaded = []
        for file in sorted(self.local.iterdir()):
            if not file.is_file():
                continue
            signature = self._signature(file)
            if self._uploaded.get(file.name) == signature:
                continue
            (self.remote / file.name).write_bytes(file.read_bytes())
            self._uploaded[file.name] = signature
            uploaded.append(file.name)
        return uploaded

    def close(self) -> None:
        """Upload what changed and remove the local staging copy (nothing to do for a local directory)."""
        if self.active:
            self.sync(force=True)
            shutil.rmtree(self.local, ignore_errors=True)
            self.active = False
