"""Data pipeline: byte tokenizer, offline sources, deterministic packed per-host batches, prefetch thread."""

from __future__ import annotations

import sysconfig
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from nash_mhc.data import (
    ByteTokenizer,
    Corpus,
    PackedDataset,
    Prefetcher,
    Tokenizer,
    get_tokenizer,
    make_datasets,
    open_source,
    token_stream,
)
from nash_mhc.data.sources import held_out, stable_fraction, stdlib, synthetic


def list_corpus(*docs: str) -> Corpus:
    """A corpus given as a literal list of documents: the interface every source kind produces."""
    return Corpus("list", "train", lambda: iter(docs))


def one_line(excinfo: pytest.ExceptionInfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer


def test_byte_tokenizer_round_trip_and_specials():
    tok = get_tokenizer("bytes")
    assert isinstance(tok, ByteTokenizer) and isinstance(tok, Tokenizer)
    assert (tok.name, tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == ("bytes", 259, 256, 257, 258)
    text = "héllo wörld — 日本語 🙂\n\tdef f(): pass"
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.ndim == 1
    assert ids.tolist() == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(ids.tolist()) == text
    with_specials = np.concatenate([[tok.bos_id], ids[:3], [tok.eos_id, tok.pad_id], ids[3:]])
    assert tok.decode(with_specials) == text
    assert tok.encode("").shape == (0,)
    assert tok.decode(np.array([0xFF], dtype=np.int32)) == "\ufffd"  # invalid UTF-8 is replaced, not raised


def test_unreachable_hub_tokenizer_is_a_one_line_value_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # never a network call, whatever the machine
    with pytest.raises(ValueError) as excinfo:
        get_tokenizer("gpt2")
    message = one_line(excinfo)
    assert "'gpt2'" in message and "cannot be reached offline" in message and "--tokenizer bytes" in message


# ---------------------------------------------------------------------------------------------------------------
# Sources


def test_stdlib_corpus_found_split_disjoint_and_stable():
    root = sysconfig.get_paths()["stdlib"]
    train_src, eval_src = open_source("stdlib", "train"), open_source("default", "eval", seed=7)
    assert isinstance(train_src, Corpus) and (train_src.name, train_src.part, eval_src.part) == ("stdlib", "train",
                                                                                                   "eval")
    train, held = stdlib.split_files(root)
    everything = stdlib.stdlib_files(root)
    assert len(everything) > 500
    assert list(everything) == sorted(everything)
    assert not any("site-packages" in p or "dist-packages" in p or "__pycache__" in p for p in everything)
    assert all(p.endswith(".py") for p in everything)
    assert train and held and not set(train) & set(held)
    assert set(train) | set(held) == set(everything)
    assert len(held) < 0.05 * len(everything)
    # The held-out files are those whose SHA-1 fraction is below 1 %, whatever the seed.
    assert held == [p for p in everything if stable_fraction(p) < 0.01]
    assert len(list(eval_src.documents())) == len(held)
    assert next(iter(eval_src.documents())) == (Path(root) / held[0]).read_bytes()


def test_held_out_puts_at_least_one_item_each_way():
    for count in (2, 5):
        mask = held_out(np.full(count, 0.5))
        assert mask.sum() == 1
    mask = held_out(np.array([0.1, 0.2, 0.3]), eval_fraction=1.0)
    assert mask.tolist() == [True, True, False]
    assert held_out(np.array([0.9])).tolist() == [False]  # one item: nothing is forced


def test_synthetic_source_is_deterministic():
    a = list(open_source("synthetic", "train", seed=3).documents())
    b = list(synthetic.corpus("train", seed=3).documents())
    assert a == b and len(a) > 100 and all(doc.endswith(".") for doc in a)
    assert list(synthetic.corpus("train", seed=4).documents()) != a
    assert list(synthetic.corpus("eval", seed=3).documents())[:5] != a[:5]
    train, held_out, _ = make_datasets("synthetic", "bytes", seq_len=64, seed=3)
    again, _, _ = make_datasets("synthetic", "bytes", seq_len=64, seed=3)
    assert held_out.num_windows >= 1
    np.testing.assert_array_equal(train.batch_at(2, global_batch=8), again.batch_at(2, global_batch=8))


def test_unknown_dataset_and_split_are_one_line_value_errors(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError) as excinfo:
        make_datasets("HuggingFaceFW/fineweb-edu", "bytes", seq_len=64, seed=0)
    message = one_line(excinfo)
    assert "cannot be reached offline" in message and "--dataset stdlib" in message
    with pytest.raises(ValueError) as excinfo:
        open_source("stdlib", "validation")
    assert "unknown split 'validation'" in one_line(excinfo)


# ---------------------------------------------------------------------------------------------------------------
# Packing and batching


def test_documents_are_separated_by_eos():
    tok = ByteTokenizer()
    stream = token_stream(list_corpus("ab", "é", ""), tok)
    assert stream.dtype == np.uint16
    expected = [97, 98, tok.eos_id, 0xC3, 0xA9, tok.eos_id, tok.eos_id]
    assert stream.tolist() == expected
    with pytest.raises(ValueError, match="is empty"):
        token_stream(list_corpus(), tok)


def test_stdlib_stream_windows():
    train, held, tok = make_datasets("stdlib", "bytes", seq_len=128, seed=0)
    assert train.num_tokens > 1_000_000 and held.num_windows >= 1
    assert train.num_windows == train.num_tokens // 129
    stream = token_stream(open_source("stdlib", "train"), tok)
    assert stream.dtype == np.uint16 and stream[-1] == tok.eos_id and stream.size == train.num_tokens
    # One EOS per file (the sources contain no id 257 themselves).
    assert int((stream == tok.eos_id).sum()) == len(stdlib.split_files(sysconfig.get_paths()["stdlib"])[0])
    for ds in (train, held):
        batch = ds.batch_at(3, global_batch=4)
        assert batch.shape == (4, ds.seq_len + 1) and batch.dtype == np.int32
        assert batch.min() >= 0 and batch.max() < tok.vocab_size


def test_batches_are_deterministic_in_seed_and_step():
    tokens = np.arange(10_000, dtype=np.uint16) % 259
    first = PackedDataset(tokens, 15, seed=5, vocab_size=259)
    second = PackedDataset(tokens.copy(), 15, seed=5, vocab_size=259)
    other_seed = PackedDataset(tokens, 15, seed=6, vocab_size=259)
    for step in (0, 1, 17, 1000):
        np.testing.assert_array_equal(first.batch_at(step, global_batch=8), second.batch_at(step, global_batch=8))
        assert not np.array_equal(first.batch_at(step, global_batch=8), other_seed.batch_at(step, global_batch=8))
    assert not np.array_equal(first.batch_at(0, global_batch=8), first.batch_at(1, global_batch=8))
    # Windows are contiguous, non-overlapping slices of the stream.
    batch = first.batch_at(0, global_batch=8)
    for row, w in zip(batch, first.window_indices(0, global_batch=8), strict=True):
        np.testing.assert_array_equal(row, tokens[w * 16 : (w + 1) * 16])
    # Rebuilding from scratch gives the same batches.
    a, _, _ = make_datasets("synthetic", "bytes", seq_len=32, seed=0)
    b, _, _ = make_datasets("synthetic", "bytes", seq_len=32, seed=0, num_workers=2)
    np.testing.assert_array_equal(a.batch_at(9, global_batch=6), b.batch_at(9, global_batch=6))


def test_each_epoch_is_a_permutation_of_the_windows():
    ds = PackedDataset(np.arange(7 * 5, dtype=np.uint16), 4, seed=0)  # 7 windows of 5 tokens
    assert ds.num_windows == 7
    order = np.concatenate([ds.window_indices(s, global_batch=3) for s in range(7)])  # 21 samples = 3 epochs
    for epoch in range(3):
        chunk = order[epoch * 7 : (epoch + 1) * 7]
        assert sorted(chunk.tolist()) == list(range(7))
        np.testing.assert_array_equal(chunk, np.random.default_rng([0, epoch]).permutation(7))
    assert not np.array_equal(order[:7], order[7:14])


def test_processes_get_disjoint_contiguous_row_blocks():
    ds, _, _ = make_datasets("synthetic", "bytes", seq_len=32, seed=1)
    for step in (0, 5):
        full = ds.batch_at(step, global_batch=8)
        for count in (2, 4):
            parts = [ds.batch_at(step, global_batch=8, process_index=p, process_count=count) for p in range(count)]
            assert all(part.shape == (8 // count, 33) for part in parts)
            np.testing.assert_array_equal(np.concatenate(parts), full)
        idx = [set(ds.window_indices(step, global_batch=8, process_index=p, process_count=2)) for p in range(2)]
        assert not idx[0] & idx[1]


def test_resuming_at_step_k_matches_iterating_from_zero():
    ds, _, _ = make_datasets("synthetic", "bytes", seq_len=32, seed=2)
    from_zero = dict(zip(range(12), (b for _, b in ds.batches(0, global_batch=4)), strict=False))
    resumed = ds.batches(7, global_batch=4)
    for step in range(7, 12):
        got_step, batch = next(resumed)
        assert got_step == step
        np.testing.assert_array_equal(batch, from_zero[step])


def test_batching_validation_errors():
    ds = PackedDataset(np.zeros(100, dtype=np.uint16), 9)
    with pytest.raises(ValueError, match="divisible by process_count"):
        ds.batch_at(0, global_batch=5, process_count=2)
    with pytest.raises(ValueError, match="process_index"):
        ds.batch_at(0, global_batch=4, process_index=2, process_count=2)
    with pytest.raises(ValueError) as excinfo:
        PackedDataset(np.zeros(9, dtype=np.uint16), 9, name="tiny")
    assert "corpus too small / empty" in one_line(excinfo)
    with pytest.raises(ValueError, match="corpus too small / empty"):
        make_datasets("synthetic", "bytes", seq_len=1_000_000, seed=0)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 259\)"):
        PackedDataset(np.full(20, 300, dtype=np.uint16), 9, vocab_size=259).batch_at(0, global_batch=1)


# ---------------------------------------------------------------------------------------------------------------
# Prefetch


def test_prefetcher_preserves_order_and_stays_bounded():
    calls: list[int] = []

    def fn(step: int) -> int:
        calls.append(step)
        return step * step

    with Prefetcher(fn, start_step=3, buffer_size=2) as pf:
        got = [pf.next() for _ in range(5)]
        assert got == [(s, s * s) for s in range(3, 8)]
        time.sleep(0.2)
        # At most buffer_size queued plus one being put: never runs far ahead of the consumer.
        assert max(calls) <= 7 + 2 + 1
        assert next(pf) == (8, 64)
    assert pf.closed
    sync = Prefetcher(fn, start_step=0, buffer_size=0)
    assert [sync.next() for _ in range(3)] == [(0, 0), (1, 1), (2, 4)] and sync.pool is None


@pytest.mark.parametrize("buffer_size", [0, 2])
def test_prefetcher_propagates_exceptions(buffer_size):
    def fn(step: int) -> int:
        if step == 2:
            raise KeyError("boom at 2")
        return step

    pf = Prefetcher(fn, start_step=0, buffer_size=buffer_size)
    assert pf.next() == (0, 0) and pf.next() == (1, 1)
    with pytest.raises(KeyError, match="boom at 2"):
        pf.next()
    with pytest.raises(KeyError, match="boom at 2"):
        pf.next()
    pf.close()


def test_prefetcher_close_stops_thread_promptly():
    gate = threading.Event()

    def slow(step: int) -> int:
        gate.wait(0.05)
        return step

    pf = Prefetcher(slow, start_step=0, buffer_size=1)
    assert pf.next() == (0, 0)
    start = time.perf_counter()
    pf.close()
    assert time.perf_counter() - start < 1.0
    with pytest.raises(RuntimeError, match="closed"):
        pf.next()
    pf.close()  # idempotent


def test_dropped_prefetcher_stops_its_thread():
    def prefetch_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("nash_mhc-prefetch")]

    before = set(prefetch_threads())
    pf = Prefetcher(lambda step: step, start_step=0, buffer_size=1)
    assert pf.next() == (0, 0)
    (thread,) = set(prefetch_threads()) - before
    del pf
    thread.join(2.0)
    assert not thread.is_alive()
