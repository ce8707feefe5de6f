"""Packing, deterministic per-host batching and the one-call ``make_datasets`` entry point.

A split is tokenised once into a flat stream (every document followed by EOS; ``uint16`` while the vocabulary
fits), which is cut into non-overlapping windows of ``seq_len + 1`` tokens (inputs ``w[:-1]``, targets
``w[1:]``; the tail that does not fill a window is dropped).

Batches are a pure function of ``(seed, step)``, so resuming at step k needs no data-loader state:

- global sample ``i`` of the run is window ``perm_e[i % N]`` with ``e = i // N`` the epoch, ``N`` the number of
  windows and ``perm_e = default_rng([seed, e]).permutation(N)``;
- row ``r`` of step ``s`` is global sample ``s * global_batch + r``;
- process ``p`` of ``P`` gets the contiguous rows ``[p * B / P, (p + 1) * B / P)`` — the layout
  ``jax.make_array_from_process_local_data`` expects for a batch sharded over its leading axis.

Every host builds the same stream (the corpus is deterministic) and slices its own rows.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
from jaxtyping import Int32, Integer

from nash_mhc.data.sources import Source, load_source
from nash_mhc.data.tokenizers import Tokenizer, get_tokenizer

__all__ = [
    "PackedDataset",
    "build_token_stream",
    "clear_cache",
    "make_datasets",
    "stream_dtype",
    "token_stream",
]


def stream_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype of a packed stream: ``uint16`` while every id fits, else ``uint32``."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def build_token_stream(source: Source, tokenizer: Tokenizer) -> Integer[np.ndarray, " n"]:
    """Tokenise ``source`` into one flat array, each document followed by ``tokenizer.eos_id`` (uncached)."""
    dtype = stream_dtype(tokenizer.vocab_size)
    pretokenised = getattr(source, "token_stream", None)
    if pretokenised is not None:
        return np.ascontiguousarray(pretokenised(tokenizer), dtype=dtype)
    raw = getattr(source, "document_bytes", None)
    encode_bytes = getattr(tokenizer, "encode_bytes", None)
    if raw is not None and encode_bytes is not None:
        encoded = (encode_bytes(doc) for doc in raw())
    else:
        encoded = (tokenizer.encode(doc) for doc in source.documents())
    eos = np.array([tokenizer.eos_id], dtype=dtype)
    pieces: list[np.ndarray] = []
    for ids in encoded:
        pieces.append(ids.astype(dtype, copy=False))
        pieces.append(eos)
    if not pieces:
        return np.zeros((0,), dtype=dtype)
    return np.concatenate(pieces)


_STREAMS: dict[tuple[object, str, int], np.ndarray] = {}
_STREAMS_LOCK = threading.Lock()


def token_stream(source: Source, tokenizer: Tokenizer) -> Integer[np.ndarray, " n"]:
    """``build_token_stream``, cached in-process by (source, tokenizer name); the result is read-only."""
    key = (source, tokenizer.name, tokenizer.vocab_size)
    with _STREAMS_LOCK:
        stream = _STREAMS.get(key)
        if stream is None:
            stream = build_token_stream(source, tokenizer)
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
    ``num_windows``.
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
        if seq_len < 1:
            raise ValueError(f"seq_len must be a positive integer, got {seq_len}")
        self.seq_len = seq_len
        self.seed = seed
        self.shuffle = shuffle
        self.name = name
        self.num_tokens = int(tokens.shape[0])
        window = seq_len + 1
        self.num_windows = self.num_tokens // window
        if self.num_windows < 1:
            raise ValueError(
                f"{name}: corpus too small / empty: {self.num_tokens} tokens cannot fill one window of "
                f"seq_len + 1 = {window} tokens; use a smaller --seq-len or a larger dataset"
            )
        self.vocab_size = vocab_size
        if vocab_size is not None and self.num_tokens:
            top = int(tokens.max())
            if top >= vocab_size or int(tokens.min()) < 0:
                raise ValueError(f"{name}: token ids must lie in [0, {vocab_size}), found {top}")
        # A view, no copy: the stream may be a shared, cached, read-only array.
        self._windows = tokens[: self.num_windows * window].reshape(self.num_windows, window)
        self._perms: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (f"PackedDataset(name={self.name!r}, seq_len={self.seq_len}, num_tokens={self.num_tokens}, "
                f"num_windows={self.num_windows}, seed={self.seed})")

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
        return self._windows[idx].astype(np.int32)

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
    dataset: str, tokenizer: str, seq_len: int, seed: int
) -> tuple[PackedDataset, PackedDataset, Tokenizer]:
    """``(train, eval, tokenizer)`` for dataset ``dataset`` and tokenizer ``tokenizer``.

    Streams are cached in-process, so building again (e.g. a second run in the same process) does not re-read
    the corpus. Raises a one-line ``ValueError`` for unknown names and for corpora too small for one window.
    """
    tok = get_tokenizer(tokenizer)
    splits = []
    for split in ("train", "eval"):
        source = load_source(dataset, split, seed)
        stream = token_stream(source, tok)
        splits.append(PackedDataset(stream, seq_len, seed=seed, vocab_size=tok.vocab_size,
                                    name=f"{source.name}/{split}"))
    return splits[0], splits[1], tok
