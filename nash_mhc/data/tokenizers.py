"""Tokenizers: text ↔ 1-D ``int32`` ids in ``[0, vocab_size)``, without special tokens (the pipeline puts
``eos_id`` after every document; ``pad_id`` never equals ``eos_id``, so EOS stays a trained target).

``get_tokenizer(spec)``: ``"bytes"`` (UTF-8 bytes, the offline default, vocabulary 259); a ``tokenizer.json`` or
a directory with one (``save_pretrained`` output; its ``tokenizer_config.json``/``special_tokens_map.json`` name
the special tokens), read with ``tokenizers``; another directory through ``transformers`` (fast backend); or a
hub id (local cache first, then the hub). Hugging Face specials: EOS is the configured ``eos_token`` or the first
of ``<|endoftext|> </s> ...`` in the vocabulary, BOS likewise (else EOS), PAD the configured or ``<pad>``-like
token unless it is EOS, else a new id after the vocabulary (never produced by ``encode``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
from jaxtyping import Int32, Integer

from nash_mhc.data import hub

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer", "count_bytes", "get_tokenizer"]

# The pipeline parallelises over documents itself (--num-workers); the Rust thread pool on top would
# oversubscribe the cores and print fork warnings in every subprocess started later.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline, generation and evaluation need from a tokenizer. ``fingerprint`` identifies the
    ids (vocabulary and merges); prepared shards record it. Texts may be ``str`` or UTF-8 ``bytes``."""

    name: str
    fingerprint: str
    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int

    def encode(self, text: str | bytes) -> Int32[np.ndarray, " n"]: ...

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]: ...

    def decode(self, ids: npt.ArrayLike) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, plus BOS=256, EOS=257, PAD=258 (``vocab_size`` 259)."""

    name = fingerprint = "bytes"
    vocab_size, bos_id, eos_id, pad_id = 259, 256, 257, 258

    def encode(self, text: str | bytes) -> Int32[np.ndarray, " n"]:
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: npt.ArrayLike) -> str:
        arr = np.asarray(ids).reshape(-1).astype(np.int64)
        return arr[(arr >= 0) & (arr < 256)].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


_EOS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "<|im_end|>", "[SEP]", "<|end|>")
_BOS = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>", "<|bos|>", "[CLS]")
_PAD = ("<pad>", "[PAD]", "<|pad|>", "<|padding|>")
_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` behind the protocol. ``name`` is the spec it was loaded from, ``fingerprint``
    ``"sha256:<hex>"`` of its serialised ``tokenizer.json``; ``base_vocab_size`` counts the backend's own ids
    (added tokens included), ``vocab_size`` also the appended EOS/PAD ids, if any."""

    def __init__(self, backend: Any, *, name: str, special_tokens: dict[str, str] | None = None) -> None:
        self.backend, self.name = backend, name
        self.fingerprint = "sha256:" + hashlib.sha256(backend.to_str().encode("utf-8")).hexdigest()
        self.base_vocab_size = next_id = int(backend.get_vocab_size(with_added_tokens=True))
        special = special_tokens or {}

        def lookup(kind: str, candidates: Sequence[str], avoid: int | None = None) -> int | None:
            for token in ([special[kind]] if kind in special else []) + list(candidates):
                token_id = backend.token_to_id(token)
                if token_id is not None and token_id != avoid and 0 <= token_id < self.base_vocab_size:
                    return int(token_id)
            return None

        self.eos_id = lookup("eos_token", _EOS)
        if self.eos_id is None:
            self.eos_id, next_id = next_id, next_id + 1
        bos = lookup("bos_token", _BOS)
        self.bos_id = self.eos_id if bos is None else bos
        self.pad_id = lookup("pad_token", _PAD, avoid=self.eos_id)
        if self.pad_id is None:
            self.pad_id, next_id = next_id, next_id + 1
        self.vocab_size = next_id

    def encode(self, text: str | bytes) -> Int32[np.ndarray, " n"]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        """Ids of each text (one Rust call, the GIL released)."""
        strings = [t.decode("utf-8", errors="replace") if isinstance(t, bytes) else t for t in texts]
        return [np.asarray(e.ids, dtype=np.int32)
                for e in self.backend.encode_batch(strings, add_special_tokens=False)]

    def decode(self, ids: npt.ArrayLike) -> str:
        arr = np.asarray(ids).reshape(-1).astype(np.int64)
        return self.backend.decode(arr[(arr >= 0) & (arr < self.base_vocab_size)].tolist(), skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer(name={self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def count_bytes(tokenizer: Tokenizer, ids: Integer[np.ndarray, "*batch seq"]) -> int:
    """UTF-8 bytes of the text that ``ids`` stand for (special tokens count 0): the denominator of bits per
    byte. Byte ids count one each; other tokenizers decode every row and count its UTF-8 length."""
    ids = np.asarray(ids)
    if isinstance(tokenizer, ByteTokenizer):
        return int(np.count_nonzero((ids >= 0) & (ids < 256)))
    return sum(len(tokenizer.decode(row).encode("utf-8")) for row in ids.reshape(-1, ids.shape[-1]))


# ------------------------------------------------------------------------------------------------- loading
def _special_tokens(files: Sequence[str | Path]) -> dict[str, str]:
    """``{"eos_token": ..., "bos_token": ..., "pad_token": ...}`` from tokenizer_config/special_tokens_map."""
    found: dict[str, str] = {}
    for file in files:
        try:
            data = json.loads(Path(file).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        for key in ("eos_token", "bos_token", "pad_token"):
            value = data.get(key) if isinstance(data, dict) else None
            text = value.get("content") if isinstance(value, dict) else value
            if isinstance(text, str) and text and key not in found:
                found[key] = text
    return found


def _from_json(file: Path, spec: str, config_files: Sequence[str | Path]) -> HFTokenizer:
    try:
        import tokenizers
    except ImportError:
        raise ValueError(f"tokenizer {spec!r} needs the 'tokenizers' package: pip install 'nash-mhc[data]' (or use "
                         "--tokenizer bytes)") from None
    try:
        backend = tokenizers.Tokenizer.from_file(str(file))
    except Exception as error:  # noqa: BLE001 - the Rust error text is the useful part
        raise ValueError(f"tokenizer {spec!r}: cannot read {file}: {hub.first_line(error)}") from None
    return HFTokenizer(backend, name=spec, special_tokens=_special_tokens(config_files))


def _from_transformers(source: str, spec: str, *, local_only: bool) -> HFTokenizer:
    """A tokenizer ``transformers`` can load, through its fast (``tokenizers``) backend."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError(f"tokenizer {spec!r} has no tokenizer.json (install transformers to load other tokenizer "
                         "formats)") from None
    try:
        tok = AutoTokenizer.from_pretrained(source, local_files_only=local_only)
    except Exception as error:  # noqa: BLE001
        raise ValueError(f"tokenizer {spec!r}: transformers cannot load it: {hub.first_line(error)}") from None
    if getattr(tok, "backend_tokenizer", None) is None:
        raise ValueError(f"tokenizer {spec!r} has no fast (tokenizers) backend; convert it to a tokenizer.json")
    special = {k: getattr(tok, k) for k in ("eos_token", "bos_token", "pad_token") if isinstance(getattr(tok, k), str)}
    return HFTokenizer(tok.backend_tokenizer, name=spec, special_tokens=special)


def _from_hub(spec: str) -> HFTokenizer:
    """A hub tokenizer: its tokenizer.json (and special-token files) from the local cache, else downloaded."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ValueError(f"tokenizer {spec!r} looks like a Hugging Face hub id but huggingface_hub is not installed "
                         f"(pip install 'nash-mhc[data]'); {hub.TOKENIZER_ALTERNATIVES}") from None
    online = hub.hub_reachable()
    for cached in (True, False) if online else (True,):
        try:
            with hub.offline() if cached else contextlib.nullcontext():
                directory = Path(snapshot_download(spec, allow_patterns=["tokenizer.json", *_CONFIG_FILES]))
        except Exception:  # noqa: BLE001 - not cached / the download failed
            continue
        if (directory / "tokenizer.json").is_file():
            return _from_json(directory / "tokenizer.json", spec, [directory / f for f in _CONFIG_FILES])
    if online:
        return _from_transformers(spec, spec, local_only=False)
    raise ValueError(f"tokenizer {spec!r} cannot be reached offline (not in the local Hugging Face cache); "
                     f"{hub.TOKENIZER_ALTERNATIVES}")


def get_tokenizer(name: str) -> Tokenizer:
    """The tokenizer ``name``: ``"bytes"``, a ``tokenizer.json``, a tokenizer directory or a hub id. Raises a
    one-line ``ValueError`` for a missing path, an unreadable file and a hub id that cannot be reached."""
    if name == "bytes":
        return ByteTokenizer()
    path = Path(name).expanduser()
    if path.is_file():
        return _from_json(path, name, [path.parent / f for f in _CONFIG_FILES])
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return _from_json(path / "tokenizer.json", name, [path / f for f in _CONFIG_FILES])
        return _from_transformers(str(path), name, local_only=True)
    if hub.looks_like_hub_id(name):
        return _from_hub(name)
    raise ValueError(f"tokenizer path {name!r} does not exist; {hub.TOKENIZER_ALTERNATIVES}")
