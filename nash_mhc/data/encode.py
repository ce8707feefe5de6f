"""Tokenising a corpus into one token stream: every document followed by EOS, in document order.

Work runs on ``num_workers`` threads over chunks of about ``CHUNK_CHARS`` characters of documents (the Rust
tokenizers release the GIL) and is reassembled in order, so the stream does not depend on ``num_workers``.
Documents over ``PIECE_CHARS`` characters are tokenised in pieces cut after a line break. Every id is checked
against the vocabulary (a one-line ``ValueError`` naming the id and the vocabulary size). A corpus of
``(prompt, response)`` pairs (:mod:`nash_mhc.data.sft`) also gives the loss-mask stream (:func:`masked_stream`).
The records a corpus skips (:class:`~nash_mhc.data.sft.Skipped`) are counted per reason, chunk by chunk.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import numpy as np
from jaxtyping import Integer

from nash_mhc.data.sft import Skipped, encode_example
from nash_mhc.data.sources.base import Corpus
from nash_mhc.data.tokenizers import Tokenizer
from nash_mhc.data.windows import NoWindows, check_ids, skipped_text, stream_dtype

__all__ = ["EncodedChunk", "encode_chunks", "encode_corpus", "masked_stream", "token_stream"]

CHUNK_CHARS = 1 << 18  # one unit of tokenisation work: documents adding up to about this many characters
PIECE_CHARS = 1 << 20  # longer documents are tokenised in pieces of at most this many characters


class EncodedChunk(NamedTuple):
    """Ids of consecutive documents, each followed by EOS, and how many documents they hold; for prompt/response
    pairs also the loss mask of the ids (0 prompt, 1 response and EOS), else None; the records skipped among
    them, per reason."""

    ids: np.ndarray
    documents: int
    mask: np.ndarray | None = None
    skipped: dict[str, int] | None = None


def pieces(doc: str | bytes) -> list[str | bytes]:
    """``doc`` cut after line breaks into pieces of at most ``PIECE_CHARS`` (hard cuts without a line break)."""
    newline = "\n" if isinstance(doc, str) else b"\n"
    out, start = [], 0
    while len(doc) - start > PIECE_CHARS:
        cut = doc.rfind(newline, start, start + PIECE_CHARS)  # type: ignore[arg-type]
        end = cut + 1 if cut > start else start + PIECE_CHARS
        if isinstance(doc, str) and "\udc00" <= doc[end] <= "\udfff":
            end -= 1  # never split a surrogate pair
        out.append(doc[start:end])
        start = end
    return [*out, doc[start:]]


def _work_units(docs: Iterable[Any]) -> Iterator[tuple[list[tuple[Any, bool]], collections.Counter[str]]]:
    """Groups of ``(piece, ends_document)`` of about ``CHUNK_CHARS`` characters, in order (a prompt/response
    pair is one piece), each with the count of the skipped records among them."""
    unit, size, skipped = [], 0, collections.Counter()
    for doc in docs:
        if isinstance(doc, Skipped):
            skipped[doc.reason] += 1
            continue
        parts = [doc] if isinstance(doc, tuple) else pieces(doc)
        for j, piece in enumerate(parts):
            unit.append((piece, j == len(parts) - 1))
            size += sum(map(len, piece)) if isinstance(piece, tuple) else len(piece)
            if size >= CHUNK_CHARS:
                yield unit, skipped
                unit, size, skipped = [], 0, collections.Counter()
    if unit or skipped:
        yield unit, skipped


def _ordered_map(fn: Callable[[Any], Any], items: Iterator[Any], workers: int) -> Iterator[Any]:
    """``map(fn, items)`` on ``workers`` threads, in order, ``2 * workers`` items at a time."""
    if workers <= 1:
        yield from map(fn, items)
        return
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="nash_mhc-tokenize") as pool:
        while batch := list(itertools.islice(items, 2 * workers)):
            yield from pool.map(fn, batch)


def encode_chunks(corpus: Corpus, tokenizer: Tokenizer, *, num_workers: int = 1,
                  max_tokens: int | None = None) -> Iterator[EncodedChunk]:
    """``corpus`` tokenised in chunks of the stream's dtype; stops after exactly ``max_tokens`` tokens when given
    (default: the corpus's own ``max_tokens``, the bounded prefix of a streamed dataset)."""
    if num_workers < 1:
        raise ValueError(f"num-workers must be >= 1, got {num_workers}")
    max_tokens = corpus.max_tokens if max_tokens is None else max_tokens
    dtype, eos = stream_dtype(tokenizer.vocab_size), np.array([tokenizer.eos_id], dtype=np.int64)
    where = f"{corpus.name}/{corpus.part} with tokenizer {tokenizer.name!r}"

    def encode(work: tuple[list[tuple[Any, bool]], collections.Counter[str]]) -> EncodedChunk:
        unit, skipped = work[0], dict(work[1])
        if not unit:  # only skipped records
            return EncodedChunk(np.zeros(0, dtype), 0, None, skipped)
        if isinstance(unit[0][0], tuple):  # prompt/response pairs: encoded apart, masked
            ids = iter(tokenizer.encode_batch([text for pair, _ in unit for text in pair]))
            examples = [encode_example(next(ids), next(ids), tokenizer.eos_id) for _ in unit]
            out, mask = (np.concatenate(parts) for parts in zip(*examples, strict=True))
            check_ids(out, tokenizer.vocab_size, where)
            return EncodedChunk(out.astype(dtype), len(unit), mask, skipped)
        ids = tokenizer.encode_batch([piece for piece, _ in unit])
        out = np.concatenate([part for (_, last), piece_ids in zip(unit, ids, strict=True)
                              for part in ([piece_ids, eos] if last else [piece_ids])])
        check_ids(out, tokenizer.vocab_size, where)
        return EncodedChunk(out.astype(dtype), sum(last for _, last in unit), None, skipped)

    total = 0
    chunks = _ordered_map(encode, _work_units(corpus.documents()), num_workers)
    try:
        for chunk in chunks:
            if max_tokens is not None and total + chunk.ids.size >= max_tokens:
                cut = max_tokens - total
                yield chunk._replace(ids=chunk.ids[:cut], mask=None if chunk.mask is None else chunk.mask[:cut])
                return
            total += chunk.ids.size
            yield chunk
    finally:
        chunks.close()  # type: ignore[attr-defined]


def token_stream(corpus: Corpus, tokenizer: Tokenizer, *, num_workers: int = 1) -> Integer[np.ndarray, " n"]:
    """The whole tokenised corpus as one array; a one-line ``ValueError`` when it has no documents."""
    return masked_stream(corpus, tokenizer, num_workers=num_workers)[0]


def masked_stream(corpus: Corpus, tokenizer: Tokenizer, *, num_workers: int = 1
                  ) -> tuple[Integer[np.ndarray, " n"], Integer[np.ndarray, " n"] | None]:
    """``(ids, loss mask)`` of the whole corpus; the mask is None unless it holds prompt/response pairs."""
    return encode_corpus(corpus, tokenizer, num_workers=num_workers)[:2]


def add_skipped(total: dict[str, int], skipped: dict[str, int] | None) -> dict[str, int]:
    """``total`` with the counts of ``skipped`` added (in place)."""
    for reason, count in (skipped or {}).items():
        total[reason] = total.get(reason, 0) + count
    return total


def encode_corpus(corpus: Corpus, tokenizer: Tokenizer, *, num_workers: int = 1
                  ) -> tuple[Integer[np.ndarray, " n"], Integer[np.ndarray, " n"] | None, dict[str, int]]:
    """``(ids, loss mask, skipped records per reason)`` of the whole corpus; a one-line :class:`NoWindows`
    when it has no documents."""
    chunks = list(encode_chunks(corpus, tokenizer, num_workers=num_workers))
    skipped: dict[str, int] = {}
    for chunk in chunks:
        add_skipped(skipped, chunk.skipped)
    if not sum(chunk.documents for chunk in chunks):
        detail = f", {skipped_text(skipped)}" if skipped else ""
        raise NoWindows(f"dataset {corpus.name!r} is empty: its {corpus.part} split has no documents{detail}", "",
                        skipped=skipped)
    ids = np.concatenate([chunk.ids for chunk in chunks])
    if all(chunk.mask is None for chunk in chunks):
        return ids, None, skipped
    return ids, np.concatenate([chunk.mask for chunk in chunks if chunk.mask is not None]), skipped
