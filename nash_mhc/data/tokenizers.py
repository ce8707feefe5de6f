"""Tokenizers: the ``Tokenizer`` protocol and the offline byte-level tokenizer.

Every tokenizer maps text to a 1-D ``int32`` numpy array of ids in ``[0, vocab_size)`` and back. ``encode``
adds no special tokens; the data pipeline inserts ``eos_id`` between documents itself. A later issue adds
Hugging Face tokenizers behind the same protocol and the same ``get_tokenizer`` entry point.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
from jaxtyping import Int32

__all__ = ["ByteTokenizer", "Tokenizer", "get_tokenizer"]


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline and the generation CLI need from a tokenizer."""

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


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, plus BOS=256, EOS=257, PAD=258 (``vocab_size`` 259).

    The model pads its embedding table to a multiple of 128 (384) itself; ids 259..383 are never produced.
    """

    name: str = "bytes"
    vocab_size: int = 259
    bos_id: int = 256
    eos_id: int = 257
    pad_id: int = 258

    def encode(self, text: str) -> Int32[np.ndarray, " n"]:
        return self.encode_bytes(text.encode("utf-8"))

    def encode_bytes(self, data: bytes) -> Int32[np.ndarray, " n"]:
        """Ids of raw bytes (no decoding round trip); the fast path of the default corpus."""
        return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

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


def get_tokenizer(name: str) -> Tokenizer:
    """The tokenizer called ``name``; only ``"bytes"`` exists offline for now."""
    if name == "bytes":
        return ByteTokenizer()
    raise ValueError(
        f"unknown tokenizer {name!r}: only the 'bytes' tokenizer is available offline; "
        "Hugging Face tokenizers are not supported yet, use --tokenizer bytes"
    )
