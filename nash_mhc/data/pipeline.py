"""Tokenising, packing, deterministic per-host batching and the one-call ``make_datasets`` entry point.

A split is tokenised once into a flat stream (every document followed by EOS; ``uint16`` while the vocabulary
fits), which is cut into non-overlapping windows of ``seq_len + 1`` tokens (inputs ``w[:-1]``, targets
``w[1:]``; the tail that does not fill a window is dropped). Tokenisation runs on ``num_workers`` threads over
chunks of documents (the Rust tokenizers release the GIL) and is reassembled in document order, so the stream
does not depend on ``num_workers``. Documents over 1M characters are tokenised in pieces cut after a line break.
Every id is checked against the vocabulary (one-line ``ValueError`` naming the id and the vocabulary size).

Batches are a pure function of ``(seed, step)``, so resuming at step k needs no data-loader state:

- global sample ``i`` of the run is window ``perm_e[i % N]`` with ``e = i // N`` the epoch, ``N`` the number of
  windows and ``perm_e = default_rng([seed, e]).permutation(N)``;
- row ``r`` of step ``s`` is global sample ``s * global_batch + r``;
- process ``p`` of ``P`` gets the contiguous rows ``[p * B / P, (p + 1) * B / P)`` — the layout
  ``jax.make_array_from_process_local_data`` expects for a batch sharded over its leading axis.

On-the-fly sources: every host builds the same stream (the corpus is deterministic) and slices its own rows.
Prepared shards (:mod:`nash_mhc.data.shards`) use the same windows and order over memory-mapped files, so a
host reads only its own rows.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
from jaxtyping import Int32, Integer

from nash_mhc.data.sources import DEFAULT_MAX_STREAM_TOKENS, Source, load_source
from nash_mhc.data.tokenizers import Tokenizer, get_tokenizer, tokenizer_fingerprint

__all__ = [
    "EncodedChunk",
    "PackedDataset",
    "build_token_stream",
    "clear_cache",
    "encode_chunks",
    "make_datasets",
    "stream_dtype",
    "token_stream",
]

CHUNK_CHARS = 1 << 18  # one unit of tokenisation work: documents adding up to about this many characters
PIECE_CHARS = 1 << 20  # longer documents are tokenised in pieces of at most this many characters


def stream_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype of a packed stream: ``uint16`` while every id fits, else ``uint32``."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


class EncodedChunk(NamedTuple):
    """Ids of consecutive documents, each followed by EOS, and how many documents they hold."""

    ids: np.ndarray
    documents: int


def _pieces(doc: str | bytes) -> list[str | bytes]:
    """``doc`` cut after line breaks into pieces of at most ``PIECE_CHARS`` (hard cuts without a line break)."""
    if len(doc) <= PIECE_CHARS:
        return [doc]
    newline = "\n" if isinstance(doc, str) else b"\n"
    out, start = [], 0
    while len(doc) - start > PIECE_CHARS:
        cut = doc.rfind(newline, start, start + PIECE_CHARS)  # type: ignore[arg-type]
        end = cut + 1 if cut > start else start + PIECE_CHARS
        if isinstance(doc, str) and end < len(doc) and "\udc00" <= doc[end] <= "\udfff":
            end -= 1  # never split a surrogate pair
        out.append(doc[start:end])
        start = end
    out.append(doc[start:])
    return out


def _work_units(docs: Iterator[str | bytes]) -> Iterator[list[tuple[str | bytes, bool]]]:
    """Groups of ``(piece, ends_document)`` of about ``CHUNK_CHARS`` characters, in order."""
    unit: list[tuple[str | bytes, bool]] = []
    size = 0
    for doc in docs:
        pieces = _pieces(doc)
        for j, piece in enumerate(pieces):
            unit.append((piece, j == len(pieces) - 1))
            size += len(piece)
            if size >= CHUNK_CHARS:
                yield unit
                unit, size = [], 0
    if unit:
        yield unit


def _ordered_map(fn: Callable[[Any], Any], items: Iterator[Any], workers: int) -> Iterator[Any]:
    """``map(fn, items)`` on ``workers`` threads, in order, with at most ``2 * workers`` items in flight."""
    if workers <= 1:
        for item in items:
            yield fn(item)
        return
    pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="nash_mhc-tokenize")
    pending: collections.deque[concurrent.futures.Future] = collections.deque()
    try:
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for future in pending:
            future.cancel()
        pool.shutdown(wait=True)


def _encoder(source: Source, tokenizer: Tokenizer) -> tuple[Iterator[str | bytes], Callable[[Sequence[Any]], list]]:
    raw = getattr(source, "document_bytes", None)
    encode_bytes = getattr(tokenizer, "encode_bytes", None)
    if raw is not None and encode_bytes is not None:
        return raw(), lambda pieces: [encode_bytes(p) for p in pieces]
    encode_batch = getattr(tokenizer, "encode_batch", None)
    if encode_batch is None:
        return source.documents(), lambda pieces: [tokenizer.encode(p) for p in pieces]
    return source.documents(), encode_batch


def check_ids(ids: np.ndarray, vocab_size: int, where: str) -> None:
    """One-line ``ValueError`` naming the first id outside ``[0, vocab_size)``."""
    if ids.size and (int(ids.max()) >= vocab_size or int(ids.min()) < 0):
        bad = ids[(ids >= vocab_size) | (ids < 0)]
        raise ValueError(f"{where}: token id {int(bad[0])} >= vocab size {vocab_size} (token ids must lie in "
                         f"[0, {vocab_size}))")


def encode_chunks(
    source: Source, tokenizer: Tokenizer, *, num_workers: int = 1, max_tokens: int | None = None
) -> Iterator[EncodedChunk]:
    """``source`` tokenised in document order, each document followed by EOS, in chunks of the stream's dtype.

    Stops after exactly ``max_tokens`` tokens when given (default: the source's own ``max_tokens``).
    """
    if num_workers < 1:
        raise ValueError(f"num-workers must be >= 1, got {num_workers}")
    if max_tokens is None:
        max_tokens = getattr(source, "max_tokens", None)
    dtype = stream_dtype(tokenizer.vocab_size)
    docs, encode_many = _encoder(source, tokenizer)
    eos = np.array([tokenizer.eos_id], dtype=np.int64)
    where = f"{source.name}/{source.split} with tokenizer {tokenizer.name!r}"

    def encode(unit: list[tuple[str | bytes, bool]]) -> EncodedChunk:
        arrays = encode_many([piece for piece, _ in unit])
        parts: list[np.ndarray] = []
        for (_, last), ids in zip(unit, arrays, strict=True):
            parts.append(np.asarray(ids))
            if last:
                parts.append(eos)
        out = np.concatenate(parts) if parts else np.zeros((0,), np.int64)
        check_ids(out, tokenizer.vocab_size, where)
        return EncodedChunk(out.astype(dtype), sum(last for _, last in unit))

    total = 0
    chunks = _ordered_map(encode, _work_units(docs), num_workers)
    try:
        for chunk in chunks:
            if max_tokens is not None and total + chunk.ids.size >= max_tokens:
                yield EncodedChunk(chunk.ids[: max_tokens - total], chunk.documents)
                return
            total += chunk.ids.size
            yield chunk
    finally:
        chunks.close()  # type: ignore[attr-defined]


def build_token_stream(
    source: Source, tokenizer: Tokenizer, *, num_workers: int = 1
) -> Integer[np.ndarray, " n"]:
    """Tokenise ``source`` into one flat array, each document followed by ``tokenizer.eos_id`` (uncached).

    Raises a one-line ``ValueError`` when the source has no documents at all (an empty corpus).
    """
    dtype = stream_dtype(tokenizer.vocab_size)
    pretokenised = getattr(source, "token_stream", None)
    if pretokenised is not None:
        stream = np.ascontiguousarray(pretokenised(tokenizer), dtype=dtype)
    else:
        pieces, documents = [], 0
        for chunk in encode_chunks(source, tokenizer, num_workers=num_workers):
            pieces.append(chunk.ids)
            documents += chunk.documents
        if not documents:
            raise ValueError(f"dataset {source.name!r} is empty: its {source.split} split has no documents")
        stream = np.concatenate(pieces) if pieces else np.zeros((0,), dtype=dtype)
    return stream


_STREAMS: dict[tuple[object, str, int], np.ndarray] = {}
_STREAMS_LOCK = threading.Lock()


def token_stream(source: Source, tokenizer: Tokenizer, *, num_workers: int = 1) -> Integer[np.ndarray, " n"]:
    """``build_token_stream``, cached in-process by (source, tokenizer fingerprint); the result is read-only."""
    key = (source, tokenizer_fingerprint(tokenizer), tokenizer.vocab_size)
    with _STREAMS_LOCK:
        stream = _STREAMS.get(key)
        if stream is None:
            stream = build_token_stream(source, tokenizer, num_workers=num_workers)
            stream.flags.writeable = False
            _STREAMS[key] = stream
    return stream


def clear_cache() -> None:
    """Forget every cached token stream."""
    with _STREAMS_LOCK:
        _STREAMS.clear()


class PackedDataset:
    """A token stream cut into fixed windows of ``seq_len + 1`` tokens, batched as a pure function of the step.

    Attributes: ``seq_len``, ``seed``, ``name``, ``vocab_size``, ``num_tokens`` (stream length, EOS included),
    ``num_windows``. Subclasses with another storage (memory-mapped shards) override ``read_windows``.
    """

    def __init__(
        self,
        tokens: Integer[np.ndarray, " n"],
        seq_len: int,
        *,
        seed: int = 0,
        vocab_size: int | None = None,
        shuffle: bool = True,
        name: str = "dataset",
    ) -> None:
        self._setup(int(tokens.shape[0]), seq_len, seed=seed, vocab_size=vocab_size, shuffle=shuffle, name=name)
        if vocab_size is not None:
            check_ids(tokens, vocab_size, name)
        window = seq_len + 1
        # A view, no copy: the stream may be a shared, cached, read-only array.
        self._windows = tokens[: self.num_windows * window].reshape(self.num_windows, window)

    def _setup(self, num_tokens: int, seq_len: int, *, seed: int, vocab_size: int | None, shuffle: bool,
               name: str) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be a positive integer, got {seq_len}")
        self.seq_len = seq_len
        self.seed = seed
        self.shuffle = shuffle
        self.name = name
        self.vocab_size = vocab_size
        self.num_tokens = num_tokens
        window = seq_len + 1
        self.num_windows = self.num_tokens // window
        if self.num_windows < 1:
            raise ValueError(
                f"{name}: corpus too small / empty: {self.num_tokens} tokens cannot fill one window of "
                f"seq_len + 1 = {window} tokens; use a smaller --seq-len or a larger dataset"
            )
        self._perms: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name={self.name!r}, seq_len={self.seq_len}, num_tokens={self.num_tokens}, "
                f"num_windows={self.num_windows}, seed={self.seed})")

    def read_windows(self, indices: np.ndarray) -> np.ndarray:
        """Windows ``indices`` as a ``[len(indices), seq_len + 1]`` integer array."""
        return self._windows[indices]

    def steps_per_epoch(self, global_batch: int) -> float:
        """How many steps of ``global_batch`` rows one pass over the windows takes."""
        return self.num_windows / global_batch

    def permutation(self, epoch: int) -> np.ndarray:
        """Window order of ``epoch``: ``default_rng([seed, epoch]).permutation(num_windows)`` (identity unshuffled)."""
        if not self.shuffle:
            return np.arange(self.num_windows)
        with self._lock:
            perm = self._perms.get(epoch)
            if perm is None:
                perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
                if len(self._perms) >= 2:  # batches only ever straddle two neighbouring epochs
                    self._perms.pop(min(self._perms))
                self._perms[epoch] = perm
        return perm

    def window_indices(
        self, step: int, *, global_batch: int, process_index: int = 0, process_count: int = 1
    ) -> np.ndarray:
        """Indices of the windows that make up this process's rows of ``step``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if global_batch < 1:
            raise ValueError(f"global_batch must be a positive integer, got {global_batch}")
        if process_count < 1 or not 0 <= process_index < process_count:
            raise ValueError(f"process_index={process_index} must lie in [0, process_count={process_count})")
        if global_batch % process_count:
            raise ValueError(f"global_batch={global_batch} must be divisible by process_count={process_count}")
        rows = global_batch // process_count
        first = step * global_batch + process_index * rows
        samples = np.arange(first, first + rows, dtype=np.int64)
        epochs, positions = np.divmod(samples, self.num_windows)
        out = np.empty(rows, dtype=np.int64)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            out[mask] = self.permutation(int(epoch))[positions[mask]]
        return out

    def batch_at(
        self, step: int, *, global_batch: int, process_index: int = 0, process_count: int = 1
    ) -> Int32[np.ndarray, "rows window"]:
        """This process's rows of ``step``: ``int32 [global_batch // process_count, seq_len + 1]``."""
        idx = self.window_indices(step, global_batch=global_batch, process_index=process_index,
                                  process_count=process_count)
        return self.read_windows(idx).astype(np.int32)

    def batches(
        self, start_step: int = 0, *, global_batch: int, process_index: int = 0, process_count: int = 1
    ) -> Iterator[tuple[int, Int32[np.ndarray, "rows window"]]]:
        """``(step, batch_at(step))`` for step = start_step, start_step + 1, ... (endless)."""
        step = start_step
        while True:
            yield step, self.batch_at(step, global_batch=global_batch, process_index=process_index,
                                      process_count=process_count)
            step += 1


def make_datasets(
    dataset: str,
    tokenizer: str | Tokenizer,
    seq_len: int,
    seed: int,
    *,
    dataset_name: str | None = None,
    split: str = "train",
    text_field: str = "text",
    num_workers: int = 1,
    max_stream_tokens: int | None = DEFAULT_MAX_STREAM_TOKENS,
) -> tuple[PackedDataset, PackedDataset, Tokenizer]:
    """``(train, eval, tokenizer)`` for dataset ``dataset`` and tokenizer ``tokenizer``.

    ``dataset`` is any name :func:`nash_mhc.data.load_source` accepts; ``dataset_name``/``split`` pick the
    configuration and training split of a Hugging Face dataset; ``text_field`` the text column of JSON,
    Parquet and ``datasets`` data; ``num_workers`` tokenisation threads; ``max_stream_tokens`` bounds what is
    read of a streamed hub dataset. Prepared shards are memory-mapped, not loaded. Streams of on-the-fly sources
    are cached in-process, so building again (e.g. a second run in the same process) does not re-read the
    corpus. Raises a one-line ``ValueError`` for anything unusable (unknown or unreachable dataset, missing
    path or text field, empty corpus, token id outside the vocabulary, shards of another tokenizer, a corpus too
    small for one window).
    """
    tok = get_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    splits = []
    for role in ("train", "eval"):
        source = load_source(dataset, role, seed, dataset_name=dataset_name, dataset_split=split,
                             text_field=text_field, max_stream_tokens=max_stream_tokens)
        packed = getattr(source, "packed_dataset", None)
        if packed is not None:
            splits.append(packed(tok, seq_len, seed=seed))
            continue
        stream = token_stream(source, tok, num_workers=num_workers)
        splits.append(PackedDataset(stream, seq_len, seed=seed, vocab_size=tok.vocab_size,
                                    name=f"{source.name}/{role}"))
    return splits[0], splits[1], tok
