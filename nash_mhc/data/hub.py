"""The Hugging Face Hub without hanging: what looks like a hub id, whether the hub answers, offline mode.

Training machines are often offline (this workplace is). Nothing here makes a network call with a long
timeout: :func:`hub_reachable` opens one TCP connection with a short timeout (or none at all when
``HF_HUB_OFFLINE``/``HF_DATASETS_OFFLINE``/``TRANSFORMERS_OFFLINE`` is set), and :func:`offline` forces
``huggingface_hub`` and ``datasets`` to use their local caches only, so an id that is not cached fails at once.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import urllib.parse
from collections.abc import Iterator

__all__ = [
    "DATASET_ALTERNATIVES",
    "TOKENIZER_ALTERNATIVES",
    "hub_reachable",
    "looks_like_hub_id",
    "looks_like_path",
    "offline",
    "offline_env",
]

DATASET_ALTERNATIVES = (
    "use --dataset stdlib, --dataset synthetic, a local .txt/.jsonl/.parquet path, a save_to_disk directory or "
    "prepared shards (python -m nash_mhc.data.prepare)"
)
TOKENIZER_ALTERNATIVES = (
    "use --tokenizer bytes, a local tokenizer.json file or a local tokenizer directory (save_pretrained)"
)

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[A-Za-z0-9][\w.\-]*)?$")
_FILE_SUFFIXES = (".txt", ".json", ".jsonl", ".parquet", ".gz", ".bin", ".arrow", ".model", ".csv")
_TRUE = {"1", "ON", "YES", "TRUE"}
_REACHABLE: dict[tuple[str, int], bool] = {}
_LOCK = threading.Lock()


def looks_like_path(name: str) -> bool:
    """Whether ``name`` is meant as a file-system path (absolute, ``./``, ``~``, several ``/``, a file suffix)."""
    if name.startswith(("/", "./", "../", "~", ".\\")) or "\\" in name or name in (".", ".."):
        return True
    if name.count("/") > 1:
        return True
    return name.lower().endswith(_FILE_SUFFIXES)


def looks_like_hub_id(name: str) -> bool:
    """Whether ``name`` has the shape of a hub repository id (``org/name`` or a bare canonical ``name``)."""
    return bool(_HUB_ID.match(name)) and not looks_like_path(name)


def offline_env() -> bool:
    """Whether the environment asks for offline mode (``HF_HUB_OFFLINE`` and friends)."""
    names = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    return any(os.environ.get(n, "").strip().upper() in _TRUE for n in names)


def _endpoint() -> tuple[str, int]:
    for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        proxy = os.environ.get(var)
        if proxy:  # behind a proxy the hub is only as reachable as the proxy is
            parsed = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
            if parsed.hostname:
                return parsed.hostname, parsed.port or 8080
    parsed = urllib.parse.urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    return parsed.hostname or "huggingface.co", parsed.port or (80 if parsed.scheme == "http" else 443)


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face Hub answers: False in offline mode, else one TCP connect (cached per process)."""
    if offline_env():
        return False
    address = _endpoint()
    with _LOCK:
        known = _REACHABLE.get(address)
        if known is None:
            try:
                with socket.create_connection(address, timeout=timeout):
                    known = True
            except OSError:
                known = False
            _REACHABLE[address] = known
    return known


@contextlib.contextmanager
def offline(datasets_too: bool = False) -> Iterator[None]:
    """Run the body with ``huggingface_hub`` (and, with ``datasets_too``, ``datasets``) in offline mode.

    Sets the environment variables before the libraries are first imported and patches the module constants
    they read at call time, then restores everything.
    """
    saved_env = {n: os.environ.get(n) for n in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    patched: list[tuple[object, str, object]] = []
    try:
        import huggingface_hub.constants as hub_constants

        patched.append((hub_constants, "HF_HUB_OFFLINE", hub_constants.HF_HUB_OFFLINE))
        if datasets_too:
            import datasets.config as datasets_config

            for attr in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
                if hasattr(datasets_config, attr):
                    patched.append((datasets_config, attr, getattr(datasets_config, attr)))
        for module, attr, _ in patched:
            setattr(module, attr, True)
        yield
    finally:
        for module, attr, value in patched:
            setattr(module, attr, value)
        for n, v in saved_env.items():
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v
