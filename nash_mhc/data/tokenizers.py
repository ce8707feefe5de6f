"""Tokenizers: the ``Tokenizer`` protocol, the offline byte-level tokenizer and Hugging Face tokenizers.

Every tokenizer maps text to a 1-D ``int32`` numpy array of ids in ``[0, vocab_size)`` and back. ``encode``
adds no special tokens; the data pipeline inserts ``eos_id`` between documents itself. ``pad_id`` is always
different from ``eos_id`` (so EOS stays a trained target); the model pads ``vocab_size`` to a multiple of 128.

``get_tokenizer(spec)`` accepts

- ``"bytes"``: UTF-8 bytes (the offline default, ``vocab_size`` 259);
- a ``tokenizer.json`` file, or a directory holding one (``save_pretrained`` output; its
  ``tokenizer_config.json``/``special_tokens_map.json`` name the special tokens), read with ``tokenizers``
  (extra ``data``); a directory without ``tokenizer.json`` is loaded with ``transformers`` when installed;
- a Hugging Face hub id (``HuggingFaceTB/smollm-360M``): from the local Hugging Face cache, or downloaded when
  the hub is reachable. Offline and not cached → a one-line ``ValueError`` naming the offline alternatives.

Special tokens of a Hugging Face tokenizer: EOS is the configured ``eos_token`` or the first of
``<|endoftext|> </s> <|end_of_text|> <eos> ...`` in the vocabulary; BOS likewise (else BOS = EOS); PAD is the
configured ``pad_token`` or ``<pad>``/``[PAD]`` when that differs from EOS, else a new id appended after the
vocabulary (ids that are not in the vocabulary are never produced by ``encode`` and dropped by ``decode``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
from jaxtyping import Int32

from nash_mhc.data import hub

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer", "get_tokenizer", "tokenizer_fingerprint"]

# The pipeline parallelises over documents itself (--num-workers); the Rust thread pool on top would
# oversubscribe the cores and print fork warnings in every subprocess started later.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline and the generation CLI need from a tokenizer.

    Optional extras the pipeline uses when present: ``encode_batch(texts)`` (a list of id arrays),
    ``encode_bytes(data)`` (raw UTF-8, no decode round trip) and ``fingerprint`` (a string identifying the
    vocabulary and merges; defaults to ``name``).
    """

    name: str
    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> Int32[np.ndarray, " n"]:
        """Ids of ``text``, without special tokens."""
        ...

    def decode(self, ids: npt.ArrayLike) -> str:
        """Text of ``ids``; special tokens are dropped."""
        ...


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """What identifies ``tokenizer``'s ids: its ``fingerprint`` attribute, else its name."""
    return str(getattr(tokenizer, "fingerprint", tokenizer.name))


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, plus BOS=256, EOS=257, PAD=258 (``vocab_size`` 259).

    The model pads its embedding table to a multiple of 128 (384) itself; ids 259..383 are never produced.
    """

    name: str = "bytes"
    fingerprint: str = "bytes"
    vocab_size: int = 259
    bos_id: int = 256
    eos_id: int = 257
    pad_id: int = 258

    def encode(self, text: str) -> Int32[np.ndarray, " n"]:
        return self.encode_bytes(text.encode("utf-8"))

    def encode_bytes(self, data: bytes) -> Int32[np.ndarray, " n"]:
        """Ids of raw bytes (no decoding round trip); the fast path of the default corpus."""
        return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: npt.ArrayLike) -> str:
        arr = np.asarray(ids).reshape(-1).astype(np.int64)
        data = arr[(arr >= 0) & (arr < 256)].astype(np.uint8).tobytes()
        return data.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ByteTokenizer)

    def __hash__(self) -> int:
        return hash(ByteTokenizer)


# ----------------------------------------------------------------------------------------------------------------
# Hugging Face

_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "<|im_end|>", "[SEP]", "<|end|>")
_BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>", "<|bos|>", "[CLS]")
_PAD_CANDIDATES = ("<pad>", "[PAD]", "<|pad|>", "<|padding|>")
_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_special_tokens(files: Sequence[str | Path]) -> dict[str, str]:
    """``{"eos_token": ..., "bos_token": ..., "pad_token": ...}`` from tokenizer_config/special_tokens_map."""
    found: dict[str, str] = {}
    for file in files:
        try:
            data = json.loads(Path(file).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict):
            continue
        for key in ("eos_token", "bos_token", "pad_token"):
            text = _token_text(data.get(key))
            if text and key not in found:
                found[key] = text
    return found


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` behind the ``Tokenizer`` protocol (see the module docstring for specials).

    ``name`` is the spec it was loaded from (a path or hub id); ``fingerprint`` is ``"sha256:<hex>"`` of its
    serialised ``tokenizer.json``, which the shard index records; ``base_vocab_size`` counts the tokenizer's
    own ids (added tokens included), ``vocab_size`` also the appended PAD/EOS ids, if any.
    """

    def __init__(self, backend: Any, *, name: str, special_tokens: dict[str, str] | None = None) -> None:
        self._backend = backend
        self.name = name
        self.fingerprint = "sha256:" + hashlib.sha256(backend.to_str().encode("utf-8")).hexdigest()
        self.base_vocab_size = int(backend.get_vocab_size(with_added_tokens=True))
        special_tokens = special_tokens or {}
        next_id = self.base_vocab_size

        def lookup(configured: str | None, candidates: Sequence[str], avoid: int | None = None) -> int | None:
            for token in ([configured] if configured else []) + list(candidates):
                token_id = backend.token_to_id(token)
                if token_id is not None and token_id != avoid and 0 <= token_id < self.base_vocab_size:
                    return int(token_id)
            return None

        eos = lookup(special_tokens.get("eos_token"), _EOS_CANDIDATES)
        if eos is None:
            eos, next_id = next_id, next_id + 1
        self.eos_id = eos
        bos = lookup(special_tokens.get("bos_token"), _BOS_CANDIDATES, avoid=None)
        self.bos_id = eos if bos is None else bos
        pad = lookup(special_tokens.get("pad_token"), _PAD_CANDIDATES, avoid=eos)
        if pad is None or pad == eos:
            pad, next_id = next_id, next_id + 1
        self.pad_id = pad
        self.vocab_size = next_id

    @property
    def backend(self) -> Any:
        """The wrapped ``tokenizers.Tokenizer``."""
        return self._backend

    def _ids(self, encoding: Any) -> np.ndarray:
        return np.asarray(encoding.ids, dtype=np.int32)

    def encode(self, text: str) -> Int32[np.ndarray, " n"]:
        return self._ids(self._backend.encode(text, add_special_tokens=False))

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Ids of each text (one Rust call, the GIL released)."""
        return [self._ids(e) for e in self._backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: npt.ArrayLike) -> str:
        arr = np.asarray(ids).reshape(-1).astype(np.int64)
        keep = arr[(arr >= 0) & (arr < self.base_vocab_size)]
        return self._backend.decode(keep.tolist(), skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer(name={self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HFTokenizer) and other.fingerprint == self.fingerprint

    def __hash__(self) -> int:
        return hash(self.fingerprint)


@dataclasses.dataclass
class _TransformersAdapter:
    """A slow ``transformers`` tokenizer (no Rust backend) behind the same interface as ``HFTokenizer``."""

    tok: Any
    name: str

    def __post_init__(self) -> None:
        self.base_vocab_size = len(self.tok)
        vocab = self.tok.get_vocab()
        payload = json.dumps(sorted(vocab.items()), ensure_ascii=False).encode("utf-8")
        self.fingerprint = "sha256:" + hashlib.sha256(payload).hexdigest()
        next_id = self.base_vocab_size
        eos = self.tok.eos_token_id
        if eos is None:
            eos, next_id = next_id, next_id + 1
        self.eos_id = int(eos)
        self.bos_id = int(self.tok.bos_token_id) if self.tok.bos_token_id is not None else self.eos_id
        pad = self.tok.pad_token_id
        if pad is None or pad == self.eos_id:
            pad, next_id = next_id, next_id + 1
        self.pad_id = int(pad)
        self.vocab_size = next_id

    def encode(self, text: str) -> Int32[np.ndarray, " n"]:
        return np.asarray(self.tok.encode(text, add_special_tokens=False), dtype=np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: npt.ArrayLike) -> str:
        arr = np.asarray(ids).reshape(-1).astype(np.int64)
        return self.tok.decode(arr[(arr >= 0) & (arr < self.base_vocab_size)].tolist(), skip_special_tokens=True)


def _require_tokenizers(spec: str) -> Any:
    try:
        import tokenizers
    except ImportError:
        raise ValueError(
            f"tokenizer {spec!r} needs the 'tokenizers' package: pip install 'nash-mhc[data]' (or use --tokenizer "
            "bytes)"
        ) from None
    return tokenizers


def _from_json(file: Path, spec: str, config_dir: Path | None) -> HFTokenizer:
    tokenizers = _require_tokenizers(spec)
    try:
        backend = tokenizers.Tokenizer.from_file(str(file))
    except Exception as error:  # noqa: BLE001 - the Rust error text is the useful part
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(f"tokenizer {spec!r}: cannot read {file}: {first}") from None
    directory = config_dir if config_dir is not None else file.parent
    special = _read_special_tokens([directory / f for f in _CONFIG_FILES])
    return HFTokenizer(backend, name=spec, special_tokens=special)


def _from_transformers(source: str, spec: str, *, local_only: bool) -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None
    try:
        tok = AutoTokenizer.from_pretrained(source, local_files_only=local_only)
    except Exception as error:  # noqa: BLE001
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(f"tokenizer {spec!r}: transformers cannot load it: {first}") from None
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        special = {k: v for k, v in (("eos_token", tok.eos_token), ("bos_token", tok.bos_token),
                                     ("pad_token", tok.pad_token)) if isinstance(v, str)}
        return HFTokenizer(backend, name=spec, special_tokens=special)
    return _TransformersAdapter(tok, spec)


def _from_directory(directory: Path, spec: str) -> Any:
    file = directory / "tokenizer.json"
    if file.is_file():
        return _from_json(file, spec, directory)
    loaded = _from_transformers(str(directory), spec, local_only=True)
    if loaded is None:
        raise ValueError(f"tokenizer directory {spec!r} has no tokenizer.json (install transformers to load other "
                         "tokenizer formats)")
    return loaded


def _hub_file(repo_id: str, filename: str, online: bool) -> str | None:
    from huggingface_hub import hf_hub_download

    try:
        with hub.offline():
            return hf_hub_download(repo_id, filename)
    except Exception:  # noqa: BLE001 - not cached
        pass
    if not online:
        return None
    try:
        return hf_hub_download(repo_id, filename)
    except Exception:  # noqa: BLE001 - absent from the repository, or the download failed
        return None


def _from_hub(spec: str) -> Any:
    try:
        import huggingface_hub  # noqa: F401
    except ImportError:
        raise ValueError(f"tokenizer {spec!r} looks like a Hugging Face hub id but huggingface_hub is not "
                         f"installed (pip install 'nash-mhc[data]'); {hub.TOKENIZER_ALTERNATIVES}") from None
    online = hub.hub_reachable()
    file = _hub_file(spec, "tokenizer.json", online)
    if file is not None:
        configs = [c for c in (_hub_file(spec, f, online) for f in _CONFIG_FILES) if c is not None]
        tokenizer = _from_json(Path(file), spec, None)
        special = _read_special_tokens(configs)
        if special:
            tokenizer = HFTokenizer(tokenizer.backend, name=spec, special_tokens=special)
        return tokenizer
    if online:
        loaded = _from_transformers(spec, spec, local_only=False)
        if loaded is not None:
            return loaded
        raise ValueError(f"tokenizer {spec!r}: no tokenizer.json on the Hugging Face hub for it (install "
                         "transformers for other formats)")
    raise ValueError(f"tokenizer {spec!r} cannot be reached offline (not in the local Hugging Face cache); "
                     f"{hub.TOKENIZER_ALTERNATIVES}")


_CACHE: dict[tuple[str, object], Any] = {}
_CACHE_LOCK = threading.Lock()


def _cache_key(spec: str) -> tuple[str, object]:
    path = Path(spec).expanduser()
    target = path / "tokenizer.json" if path.is_dir() else path
    try:
        stat = target.stat()
        return str(target.resolve()), (stat.st_mtime_ns, stat.st_size)
    except OSError:
        return spec, None


def get_tokenizer(name: str) -> Tokenizer:
    """The tokenizer ``name``: ``"bytes"``, a ``tokenizer.json``, a tokenizer directory or a hub id.

    Loaded tokenizers are cached per process (a file is reloaded when it changes). Raises a one-line
    ``ValueError`` for a missing path, an unreadable file and a hub id that cannot be reached offline.
    """
    if name == "bytes":
        return ByteTokenizer()
    key = _cache_key(name)
    with _CACHE_LOCK:
        cached = _CACHE.get(key)
    if cached is not None:
        return cached
    path = Path(name).expanduser()
    if path.is_file():
        tokenizer = _from_json(path, name, None)
    elif path.is_dir():
        tokenizer = _from_directory(path, name)
    elif hub.looks_like_hub_id(name):
        tokenizer = _from_hub(name)
    else:
        raise ValueError(f"tokenizer path {name!r} does not exist; {hub.TOKENIZER_ALTERNATIVES}")
    with _CACHE_LOCK:
        _CACHE[key] = tokenizer
    return tokenizer
