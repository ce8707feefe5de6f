"""The Hugging Face Hub without hanging: what looks like a hub id, whether the hub answers, offline mode.

Training machines are often offline. Nothing here makes a network call with a long timeout:
:func:`hub_reachable` opens one TCP connection with a short timeout (none at all when ``HF_HUB_OFFLINE``/
``HF_DATASETS_OFFLINE``/``TRANSFORMERS_OFFLINE`` is set), and :func:`offline` makes ``huggingface_hub`` and
``datasets`` use their local caches only, so an id that is not cached fails at once.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import urllib.parse
from collections.abc import Iterator

DATASET_ALTERNATIVES = ("use --dataset stdlib, --dataset synthetic, a local .txt/.jsonl/.parquet path, a save_to_disk "
                        "directory or prepared shards (python -m nash_mhc.data.prepare)")
TOKENIZER_ALTERNATIVES = "use --tokenizer bytes, a local tokenizer.json file or a local tokenizer directory"

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[A-Za-z0-9][\w.\-]*)?$")
_FILE_SUFFIXES = (".txt", ".json", ".jsonl", ".parquet", ".gz", ".bin", ".arrow", ".model", ".csv")
_OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (its type name when the message is empty)."""
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def looks_like_hub_id(name: str) -> bool:
    """Whether ``name`` has the shape of a hub repository id (``org/name`` or a bare ``name``) rather than of a
    path (absolute, ``./``, ``~``, several ``/``, a file suffix)."""
    path_like = (name.startswith(("/", "./", "../", "~")) or "\\" in name or name.count("/") > 1
                 or name.lower().endswith(_FILE_SUFFIXES))
    return bool(_HUB_ID.match(name)) and not path_like


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the hub (or the HTTPS proxy in front of it) accepts a TCP connection; False in offline mode."""
    if any(os.environ.get(n, "").strip().upper() in {"1", "ON", "YES", "TRUE"} for n in _OFFLINE_VARIABLES):
        return False
    proxy = next((os.environ[v] for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
                  if os.environ.get(v)), None)
    if proxy:  # behind a proxy the hub is only as reachable as the proxy is
        url = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        port = url.port or 8080
    else:
        url = urllib.parse.urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
        port = url.port or (80 if url.scheme == "http" else 443)
    try:
        with socket.create_connection((url.hostname or "huggingface.co", port), timeout=timeout):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def offline(datasets_too: bool = False) -> Iterator[None]:
    """Run the body with ``huggingface_hub`` (and, with ``datasets_too``, ``datasets``) in offline mode: the
    environment variables for libraries not imported yet, the module constants for those that are."""
    saved_env = {n: os.environ.get(n) for n in _OFFLINE_VARIABLES[:2]}
    os.environ.update({n: "1" for n in saved_env})
    import huggingface_hub.constants as hub_constants

    modules = [hub_constants]
    if datasets_too:
        import datasets.config

        modules.append(datasets.config)
    saved = [(m, a, getattr(m, a)) for m in modules for a in _OFFLINE_VARIABLES[:2] if hasattr(m, a)]
    try:
        for module, attr, _ in saved:
            setattr(module, attr, True)
        yield
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value
