"""What every kind of source shares: the Corpus record, the part names and the stable held-out hash."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from nash_mhc.data.sft import Fields, Skipped, pair_of

PARTS = ("train", "eval")
EVAL_FRACTION = 0.01


@dataclasses.dataclass(frozen=True)
class Corpus:
    """One part of a dataset: ``documents()`` yields its texts (``str``, or UTF-8 ``bytes``; or ``(prompt,
    response)`` pairs, :mod:`nash_mhc.data.sft`) in a fixed order, and a :class:`Skipped` in the place of each
    record of the part that gives none (a null text), so that it is counted; tokenising stops after
    ``max_tokens`` tokens when set (the bounded prefix of a stream)."""

    name: str
    part: str
    documents: Callable[[], Iterable[str | bytes | tuple[str, str] | Skipped]]
    max_tokens: int | None = None


def text_of(record: Any, field: Fields, where: str) -> str | tuple[str, str] | Skipped:
    """``record[field]`` (:class:`Skipped` for a null text); one-line errors for a record without the field (naming its
    fields) or with a field that is not text. A ``(prompt, response)`` field pair gives that pair."""
    if not isinstance(record, dict):
        raise ValueError(f"{where} is a JSON {type(record).__name__}, not an object with a {field!r} field")
    if not isinstance(field, str):
        return pair_of(record, field, where)
    if field not in record:
        fields = ", ".join(map(str, record)) or "none"
        raise ValueError(f"text field {field!r} not found in {where}; fields: {fields} (use --text-field)")
    if record[field] is not None and not isinstance(record[field], str):
        raise ValueError(f"text field {field!r} in {where} is a {type(record[field]).__name__}, not a string "
                         "(use --text-field)")
    return Skipped(f"null {field}") if record[field] is None else record[field]


def check_part(part: str) -> str:
    if part not in PARTS:
        raise ValueError(f"unknown split {part!r}; expected one of {', '.join(PARTS)}")
    return part


# ------------------------------------------------------------------------------------------- held-out part
def stable_fraction(key: str) -> float:
    """A number in [0, 1) from ``key`` (SHA-1: the same in every run and on every host)."""
    return int.from_bytes(hashlib.sha1(key.encode("utf-8")).digest()[:8], "big") / 2.0**64


def document_fractions(key: str, count: int) -> np.ndarray:
    """Stable numbers in [0, 1) for documents ``0..count-1`` of ``key`` (SHA-1 salt, SplitMix64 per index)."""
    salt = int.from_bytes(hashlib.sha1(key.encode("utf-8")).digest()[:8], "big")
    with np.errstate(over="ignore"):
        x = np.arange(count, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(salt)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def held_out(fractions: np.ndarray, eval_fraction: float | int = EVAL_FRACTION) -> np.ndarray:
    """Which items are held out: fraction below ``eval_fraction``, but with two or more items at least one
    each way (else the smallest fraction goes to eval, or the largest to train)."""
    mask = np.asarray(fractions) < eval_fraction
    if mask.size >= 2 and not mask.any():
        mask[int(np.argmin(fractions))] = True
    elif mask.size >= 2 and mask.all():
        mask[int(np.argmax(fractions))] = False
    return mask


def tail_cut(doc: str | bytes, eval_fraction: float = EVAL_FRACTION) -> int:
    """Where a one-document corpus is cut into train (before) and eval (after): a line break near the end."""
    target = max(1, int(len(doc) * (1.0 - eval_fraction)))
    cut = doc.rfind("\n" if isinstance(doc, str) else b"\n", 0, target)  # type: ignore[arg-type]
    return cut + 1 if cut > len(doc) // 2 else target
