"""Prompt/response data for supervised fine-tuning (``--prompt-field P --response-field R``).

A record's example is ``(prompt, response)``; it is tokenised as ``prompt ids + response ids + EOS`` (the two
texts encoded separately, so the boundary is exact) with the loss mask ``0`` on the prompt ids and ``1`` on the
response ids and the EOS: the model learns to answer and to stop, never to write prompts. Examples are packed
into the token stream like documents; the mask stream travels with it, so every window keeps the exact mask of
its tokens (the prediction of the first prompt token of the next example, from the previous EOS, weighs 0).
With ``--init-from`` a trained run, this is supervised fine-tuning.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

Fields = str | tuple[str, str]  # a text field, or (prompt field, response field)
FIELD_FLAGS = "--prompt-field/--response-field"


@dataclasses.dataclass(frozen=True)
class Skipped:
    """A record that gives no document, and why (``"null response"``): a source yields it in the record's place,
    and tokenising counts it (:mod:`nash_mhc.data.encode`)."""

    reason: str


def columns(field: Fields) -> list[str]:
    """The record fields ``field`` reads."""
    return [field] if isinstance(field, str) else list(field)


def pair_of(record: dict[str, Any], fields: tuple[str, str], where: str) -> tuple[str, str] | Skipped:
    """``(prompt, response)`` of ``record`` (:class:`Skipped` when either is null); one-line errors for a missing
    field (naming the record's fields) or one that is not text."""
    missing = [f for f in fields if f not in record]
    if missing:
        names = ", ".join(map(str, record)) or "none"
        raise ValueError(f"field {missing[0]!r} not found in {where}; fields: {names} (use {FIELD_FLAGS})")
    for field in fields:
        if record[field] is not None and not isinstance(record[field], str):
            raise ValueError(f"field {field!r} in {where} is a {type(record[field]).__name__}, not a string "
                             f"(use {FIELD_FLAGS})")
    nulls = [field for field in fields if record[field] is None]
    return Skipped(f"null {' and '.join(nulls)}") if nulls else (record[fields[0]], record[fields[1]])


def encode_example(prompt_ids: np.ndarray, response_ids: np.ndarray, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, mask)`` of one example: ids = prompt + response + [eos]; mask 0 on the prompt, 1 after it."""
    ids = np.concatenate([prompt_ids, response_ids, [eos_id]]).astype(np.int64)
    mask = np.zeros(ids.size, np.uint8)
    mask[prompt_ids.size:] = 1
    return ids, mask
