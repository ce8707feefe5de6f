"""Data sources beyond the default corpus: local files, ``save_to_disk`` datasets, prepared shards, Hugging Face
tokenizers, the hub (offline), exact resume, per-host rows, the error messages, and training from each.

Everything runs offline: the hub is forced offline (``HF_HUB_OFFLINE=1``) wherever a hub id appears, and the
tokenizer is a small byte-level BPE trained here with ``tokenizers`` and saved as ``tokenizer.json``.
"""

from __future__ import annotations

import itertools
import json
import random
import subprocess
from pathlib import Path

import numpy as np
import pytest

from nash_mhc.data import (
    ByteTokenizer,
    Corpus,
    HFTokenizer,
    PackedDataset,
    encode,
    get_tokenizer,
    hub,
    make_datasets,
    open_source,
    prepare,
    prepared,
    token_stream,
)
from nash_mhc.data.sources import files

SEQ = 32
WORDS = ["the", "a", "cat", "dog", "sat", "ran", "on", "under", "mat", "log", "quickly", "slowly", "big", "small",
         "red", "blue", "tree", "house", "river", "stone", "bird", "sings", "and", "then", "later", "near", "far"]


def one_line(excinfo: pytest.ExceptionInfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Path]:
    """A generated corpus as .jsonl, .parquet (field ``content``), a save_to_disk DatasetDict, a plain saved
    Dataset and prepared shards, plus the BPE tokenizer.json trained on it."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))).capitalize() + "."
                 for _ in range(400)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(sentences, trainer)
    tok.save(str(root / "tokenizer.json"))
    docs = [" ".join(rng.choice(sentences) for _ in range(rng.randint(3, 12))) for _ in range(500)]
    with open(root / "corpus.jsonl", "w") as f:
        for i, doc in enumerate(docs):
            f.write(json.dumps({"id": i, "text": doc}) + "\n")
    pq.write_table(pa.table({"content": docs, "n": list(range(len(docs)))}), root / "corpus.parquet",
                   row_group_size=64)
    datasets.disable_progress_bars()
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": docs[:450]}),
                          "validation": datasets.Dataset.from_dict({"text": docs[450:]})}
                         ).save_to_disk(str(root / "saved_dict"))
    datasets.Dataset.from_dict({"text": docs, "n": list(range(len(docs)))}).save_to_disk(str(root / "saved"))
    code = prepare.main(["--dataset", str(root / "corpus.jsonl"), "--tokenizer", str(root / "tokenizer.json"),
                         "--out", str(root / "shards"), "--num-workers", "2", "--no-progress"])
    assert code == 0
    return {"root": root, "tokenizer": root / "tokenizer.json", "jsonl": root / "corpus.jsonl",
            "parquet": root / "corpus.parquet", "saved_dict": root / "saved_dict", "saved": root / "saved",
            "shards": root / "shards", "docs": docs}  # type: ignore[dict-item]


# ---------------------------------------------------------------------------------------------------------------
# Tokenizers


def test_hf_tokenizer_from_file_and_directory(corpus):
    tok = get_tokenizer(str(corpus["tokenizer"]))
    base = tok.backend.get_vocab_size()
    assert isinstance(tok, HFTokenizer) and tok.base_vocab_size == base > 300
    assert tok.eos_id == tok.backend.token_to_id("<|endoftext|>")
    assert tok.pad_id == base and tok.vocab_size == base + 1 and tok.pad_id != tok.eos_id  # PAD appended
    assert tok.fingerprint.startswith("sha256:")
    assert get_tokenizer(str(corpus["tokenizer"])).fingerprint == tok.fingerprint
    text = "The cat sat on the mat. Bird sings!"
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.ndim == 1 and ids.max() < tok.vocab_size
    assert tok.decode(ids) == text
    assert tok.decode(np.concatenate([ids, [tok.eos_id, tok.pad_id]])) == text  # specials dropped
    assert [a.tolist() for a in tok.encode_batch([text, "dog"])] == [ids.tolist(), tok.encode("dog").tolist()]
    # A save_pretrained-style directory: tokenizer.json plus tokenizer_config.json naming the specials.
    directory = corpus["root"] / "tok_dir"
    directory.mkdir(exist_ok=True)
    (directory / "tokenizer.json").write_bytes(corpus["tokenizer"].read_bytes())
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>",
                                                                 "pad_token": "<|endoftext|>"}))
    from_dir = get_tokenizer(str(directory))
    assert from_dir.fingerprint == tok.fingerprint and (from_dir.eos_id, from_dir.pad_id) == (tok.eos_id, base)


# ---------------------------------------------------------------------------------------------------------------
# Sources


def all_docs(source_train, source_eval) -> tuple[list[str], list[str]]:
    return list(source_train.documents()), list(source_eval.documents())


def test_local_files_split_deterministically_into_train_and_eval(corpus):
    docs = corpus["docs"]
    for path, field in ((corpus["jsonl"], "text"), (corpus["parquet"], "content")):
        train, held_out = all_docs(open_source(str(path), "train", text_field=field),
                                   open_source(str(path), "eval", seed=5, text_field=field))
        assert isinstance(open_source(str(path), "train", text_field=field), Corpus)
        assert 1 <= len(held_out) < 0.05 * len(docs) and len(train) + len(held_out) == len(docs)
        assert sorted(train + held_out) == sorted(docs)
        assert [d for d in docs if d not in set(held_out)] == train  # file order kept
    # A directory: every supported file, recursively, sorted by relative path; hidden and other files skipped.
    directory = corpus["root"] / "mixed"
    directory.mkdir()
    (directory / "a.txt").write_text("first text file\nline two\n")
    (directory / ".hidden.txt").write_text("never read")
    (directory / "sub").mkdir()
    (directory / "sub" / "b.json").write_text(json.dumps([{"text": "json one"}, {"text": "json two"}]))
    (directory / "sub" / "c.jsonl").write_text('{"text": "line one"}\n\n{"text": "line two"}\n')
    (directory / "notes.md").write_text("ignored: not a supported suffix")
    assert [rel for rel, _ in files.local_files(directory)] == ["a.txt", "sub/b.json", "sub/c.jsonl"]
    train, held_out = all_docs(open_source(str(directory), "train"), open_source(str(directory), "eval"))
    assert len(held_out) >= 1 and sorted(train + held_out) == sorted(
        ["first text file\nline two\n", "json one", "json two", "line one", "line two"])


def test_single_text_file_is_cut_at_a_line_break(tmp_path):
    text = "".join(f"line {i} of a single long document\n" for i in range(400))
    (tmp_path / "book.txt").write_text(text)
    train, held_out = all_docs(open_source(str(tmp_path / "book.txt"), "train"),
                               open_source(str(tmp_path / "book.txt"), "eval"))
    assert len(train) == len(held_out) == 1 and train[0] + held_out[0] == text
    assert train[0].endswith("\n") and 0 < len(held_out[0]) < 0.03 * len(text)


def test_saved_datasets_use_their_validation_split_or_a_hash_split(corpus):
    docs = corpus["docs"]
    source = open_source(str(corpus["saved_dict"]), "train")
    assert isinstance(source, Corpus)
    train, held_out = all_docs(source, open_source(str(corpus["saved_dict"]), "eval"))
    assert train == docs[:450] and held_out == docs[450:]
    train, held_out = all_docs(open_source(str(corpus["saved"]), "train"), open_source(str(corpus["saved"]), "eval"))
    assert 1 <= len(held_out) < 0.05 * len(docs) and sorted(train + held_out) == sorted(docs)
    # --split picks another split of a DatasetDict; unknown splits are listed.
    train, held_out = all_docs(open_source(str(corpus["saved_dict"]), "train", dataset_split="validation"),
                               open_source(str(corpus["saved_dict"]), "eval", dataset_split="validation"))
    assert held_out and sorted(train + held_out) == sorted(docs[450:])  # no other eval split: a hash split
    with pytest.raises(ValueError) as excinfo:
        open_source(str(corpus["saved_dict"]), "train", dataset_split="test")
    assert "no split 'test'; splits: train, validation" in one_line(excinfo)


def test_hub_source_streams_a_bounded_prefix_and_holds_out_its_head(monkeypatch):
    """The hub code path with ``datasets`` stubbed: streaming when reachable, the local cache when offline."""
    import datasets

    docs = [f"Document number {i}. " * 5 for i in range(400)]
    calls = []

    def fake_load_dataset(repo, name=None, split=None, streaming=False, **kwargs):
        calls.append((repo, name, split, streaming))
        if streaming:
            return datasets.Dataset.from_dict({"text": docs}).to_iterable_dataset()
        return datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": docs})})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setattr(datasets, "get_dataset_split_names", lambda repo, name=None, **kw: ["train"])
    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=3.0: True)
    streamed = open_source("org/corpus", "train", dataset_name="cfg", max_stream_tokens=5_000)
    assert isinstance(streamed, Corpus) and streamed.max_tokens == 5_000
    assert list(open_source("org/corpus", "eval", dataset_name="cfg").documents()) == docs[:200]
    assert list(streamed.documents()) == docs[200:]
    stream = token_stream(streamed, ByteTokenizer())
    assert stream.size == 5_000 and calls[-1] == ("org/corpus", "cfg", "train", True)
    expected = np.frombuffer("".join(d + "\x00" for d in docs[200:]).encode(), np.uint8).astype(np.uint16)[:5_000]
    expected = np.where(expected == 0, ByteTokenizer.eos_id, expected)
    np.testing.assert_array_equal(stream, expected)
    # Offline: the same documents from the local cache (here: the stub), never the network.
    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=3.0: False)
    offline = open_source("org/corpus", "train", dataset_name="cfg", max_stream_tokens=5_000)
    assert calls[-1][3] is False
    np.testing.assert_array_equal(token_stream(offline, ByteTokenizer()), stream)


# ---------------------------------------------------------------------------------------------------------------
# Tokenising, shards, determinism


def test_stream_does_not_depend_on_workers_or_chunking(corpus, monkeypatch):
    tok = get_tokenizer(str(corpus["tokenizer"]))
    source = open_source(str(corpus["jsonl"]), "train")
    reference = token_stream(source, tok, num_workers=1)
    assert reference.dtype == np.uint16 and int((reference == tok.eos_id).sum()) == len(list(source.documents()))
    monkeypatch.setattr(encode, "CHUNK_CHARS", 3_000)
    np.testing.assert_array_equal(token_stream(source, tok, num_workers=3), reference)
    # Long documents are tokenised in pieces cut after a line break; EOS only after the last piece.
    monkeypatch.setattr(encode, "PIECE_CHARS", 100)
    long_doc = "".join(f"row {i} of the table\n" for i in range(50))
    assert all(len(p) <= 100 for p in encode.pieces(long_doc)) and "".join(encode.pieces(long_doc)) == long_doc
    bytes_stream = token_stream(Corpus("list", "train", lambda: [long_doc]), ByteTokenizer(), num_workers=2)
    assert bytes_stream.tolist() == list(long_doc.encode()) + [ByteTokenizer.eos_id]


def test_prepared_shards_index_and_identical_batches(corpus):
    tok = get_tokenizer(str(corpus["tokenizer"]))
    index = json.loads((corpus["shards"] / "index.json").read_text())
    assert (index["format"], index["version"], index["dtype"]) == ("nash_mhc-shards", 2, "uint16")
    assert index["tokenizer"]["fingerprint"] == tok.fingerprint and index["tokenizer"]["vocab_size"] == tok.vocab_size
    train_entry = index["splits"]["train"]
    assert train_entry["file"] == "train.bin"
    assert (corpus["shards"] / "train.bin").stat().st_size == 2 * train_entry["num_tokens"]
    assert train_entry["num_documents"] + index["splits"]["eval"]["num_documents"] == len(corpus["docs"])
    assert train_entry["max_token_id"] < tok.vocab_size

    shards, shards_eval, _ = make_datasets(str(corpus["shards"]), str(corpus["tokenizer"]), SEQ, 3)
    fly, fly_eval, _ = make_datasets(str(corpus["jsonl"]), str(corpus["tokenizer"]), SEQ, 3, num_workers=2)
    assert isinstance(shards.windows, np.memmap) and not isinstance(fly.windows, np.memmap)  # read lazily
    assert (shards.num_tokens, shards.num_windows) == (fly.num_tokens, fly.num_windows)
    for step in (0, 1, 7, 40, 500):  # 500 is several epochs in
        np.testing.assert_array_equal(shards.batch_at(step, global_batch=8), fly.batch_at(step, global_batch=8))
        np.testing.assert_array_equal(shards_eval.batch_at(step, global_batch=2),
                                      fly_eval.batch_at(step, global_batch=2))


def test_resume_is_bit_identical(corpus):
    uninterrupted, _, _ = make_datasets(str(corpus["shards"]), str(corpus["tokenizer"]), SEQ, 11)
    reference = [b for _, b in itertools.islice(uninterrupted.batches(0, global_batch=8), 60)]
    # A new process: nothing but the step carries over.
    split = open_source(str(corpus["shards"]), "train")
    resumed = split.windows(get_tokenizer(str(corpus["tokenizer"])), SEQ, seed=11)
    for step, batch in itertools.islice(resumed.batches(23, global_batch=8), 60 - 23):
        np.testing.assert_array_equal(batch, reference[step])
    # Rows are the stream's consecutive windows of SEQ + 1 tokens.
    stream = np.fromfile(corpus["shards"] / "train.bin", np.uint16)
    rows = resumed.window_indices(23, global_batch=8)
    np.testing.assert_array_equal(reference[23], stream[: resumed.num_windows * (SEQ + 1)].reshape(-1, SEQ + 1)[rows])


@pytest.mark.parametrize("kind", ["shards", "jsonl"])
def test_two_hosts_get_disjoint_rows_that_cover_the_global_batch(corpus, kind):
    dataset, _, _ = make_datasets(str(corpus[kind]), str(corpus["tokenizer"]), SEQ, 1)
    for step in (0, 13):
        full = dataset.batch_at(step, global_batch=8)
        hosts = [dataset.batch_at(step, global_batch=8, process_index=p, process_count=2) for p in range(2)]
        np.testing.assert_array_equal(np.concatenate(hosts), full)
        rows = [set(dataset.window_indices(step, global_batch=8, process_index=p, process_count=2)) for p in range(2)]
        assert not rows[0] & rows[1] and len(rows[0] | rows[1]) == 8


def test_uint32_shards_for_large_vocabularies(tmp_path):
    from nash_mhc.data.windows import stream_dtype

    assert stream_dtype(65_536) == np.uint16 and stream_dtype(65_537) == np.uint32
    ids = np.arange(70_000, 70_050, dtype=np.int64)
    entry = prepared.write_part(tmp_path, "train", [(ids[:20], 1), (ids[20:], 1)], np.dtype(np.uint32))
    assert entry == {"file": "train.bin", "num_tokens": 50, "num_documents": 2, "max_token_id": 70_049}
    data = PackedDataset(np.memmap(tmp_path / "train.bin", np.uint32, mode="r"), 4, vocab_size=80_000, shuffle=False)
    np.testing.assert_array_equal(data.batch_at(1, global_batch=3), ids[15:30].reshape(3, 5))
    assert not list(tmp_path.glob("*.tmp"))


def bad_shards(directory: Path, ids: list[int], max_token_id: int) -> Path:
    """Prepared shards (byte tokenizer) whose train and eval parts hold ``ids``; the index claims ``max_token_id``."""
    directory.mkdir()
    np.array(ids, np.uint16).tofile(directory / "train.bin")
    entry = {"file": "train.bin", "num_tokens": len(ids), "num_documents": 1, "max_token_id": max_token_id}
    prepared.write_index(directory, {"dtype": "uint16", "tokenizer": prepared.tokenizer_record(ByteTokenizer()),
                                     "splits": {"train": entry, "eval": entry}})
    return directory


# ---------------------------------------------------------------------------------------------------------------
# Errors: one line each


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_hub_ids_offline_name_the_alternatives(offline):
    with pytest.raises(ValueError) as excinfo:
        make_datasets("HuggingFaceTB/smollm-corpus", "bytes", SEQ, 0, dataset_name="cosmopedia-v2")
    message = one_line(excinfo)
    assert message.startswith("dataset 'HuggingFaceTB/smollm-corpus' cannot be reached offline; use --dataset stdlib")
    assert "save_to_disk directory" in message and "python -m nash_mhc.data.prepare" in message
    with pytest.raises(ValueError) as excinfo:
        get_tokenizer("HuggingFaceTB/smollm-360M")
    message = one_line(excinfo)
    assert "'HuggingFaceTB/smollm-360M' cannot be reached offline" in message and "tokenizer.json" in message


def test_missing_paths(tmp_path):
    with pytest.raises(ValueError) as excinfo:
        make_datasets(str(tmp_path / "nope.jsonl"), "bytes", SEQ, 0)
    assert "does not exist" in one_line(excinfo) and "nope.jsonl" in str(excinfo.value)
    with pytest.raises(ValueError) as excinfo:
        get_tokenizer(str(tmp_path / "missing" / "tokenizer.json"))
    assert "tokenizer path" in one_line(excinfo) and "does not exist" in str(excinfo.value)
    (tmp_path / "notes.md").write_text("x")
    with pytest.raises(ValueError, match="no .txt, .jsonl, .json, .parquet files"):
        open_source(str(tmp_path), "train")


def test_missing_text_field_lists_the_fields(corpus, tmp_path):
    for path in (corpus["jsonl"], corpus["parquet"]):
        with pytest.raises(ValueError) as excinfo:
            open_source(str(path), "train", text_field="body")
        message = one_line(excinfo)
        assert "text field 'body' not found" in message and "--text-field" in message
        assert ("fields: id, text" if path.suffix == ".jsonl" else "fields: content, n") in message
    with pytest.raises(ValueError) as excinfo:
        open_source(str(corpus["saved"]), "train", text_field="body")
    assert "text field 'body' not found" in one_line(excinfo) and "fields: text, n" in str(excinfo.value)
    (tmp_path / "mixed.jsonl").write_text('{"text": "ok"}\n{"title": "no text here"}\n')
    with pytest.raises(ValueError) as excinfo:
        list(open_source(str(tmp_path / "mixed.jsonl"), "train").documents())
    assert "record 2" in one_line(excinfo) and "fields: title" in str(excinfo.value)


def test_token_ids_outside_the_vocabulary(corpus, tmp_path):
    class SmallVocab(ByteTokenizer):
        name = fingerprint = "small"
        vocab_size = 100

    with pytest.raises(ValueError) as excinfo:
        token_stream(open_source(str(corpus["jsonl"]), "train"), SmallVocab())
    assert "token id " in one_line(excinfo) and ">= vocab size 100" in str(excinfo.value)
    # Shards whose index records an id the tokenizer does not have.
    bad = bad_shards(tmp_path / "bad", [1, 2, 300, 257] * 40, 300)
    with pytest.raises(ValueError) as excinfo:
        make_datasets(str(bad), "bytes", 7, 0)
    assert "token id 300 >= vocab size 259" in one_line(excinfo)
    # An index that hides it: caught when the batch is read.
    hidden = bad_shards(tmp_path / "hidden", [1, 2, 300, 257] * 40, 257)
    train, _, _ = make_datasets(str(hidden), "bytes", 7, 0)
    with pytest.raises(ValueError, match="token id 300 >= vocab size 259"):
        train.batch_at(0, global_batch=20)


def test_shards_of_another_tokenizer(corpus):
    with pytest.raises(ValueError) as excinfo:
        make_datasets(str(corpus["shards"]), "bytes", SEQ, 0)
    message = one_line(excinfo)
    assert "do not match the tokenizer" in message and str(corpus["tokenizer"]) in message and "bytes" in message


def test_empty_corpora(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    (tmp_path / "empties").mkdir()
    (tmp_path / "empties" / "a.txt").write_text("")
    for name in ("empty.jsonl", "empties"):
        with pytest.raises(ValueError) as excinfo:
            make_datasets(str(tmp_path / name), "bytes", SEQ, 0)
        assert "is empty" in one_line(excinfo)
    before = snapshot(tmp_path)
    assert prepare.main(["--dataset", str(tmp_path / "empty.jsonl"), "--out", str(tmp_path / "out"),
                         "--no-progress"]) == 2
    assert snapshot(tmp_path) == before and not (tmp_path / "out").exists()


def test_prepare_refuses_a_non_empty_output(corpus, capsys):
    before = snapshot(corpus["shards"])
    code = prepare.main(["--dataset", str(corpus["jsonl"]), "--out", str(corpus["shards"]), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "not an empty directory" in err and len(err.strip().splitlines()) == 1
    assert snapshot(corpus["shards"]) == before


# ---------------------------------------------------------------------------------------------------------------
# The training program, in-process (8 fake CPU devices; one compile shared by every run: same tokenizer)


@pytest.fixture(scope="module")
def train_main(cache_dir):
    from nash_mhc.train import main

    cache = str(cache_dir)

    def run(*argv: str) -> int:
        return main(["--model", "tiny", "--batch-size", "8", "--no-progress", "--log-interval", "1",
                     "--compile-cache-dir", cache, "--learning-rate", "3e-3", "--warmup-steps", "1", *argv])

    return run


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.fixture(scope="module")
def trained(corpus, train_main, tmp_path_factory) -> dict[str, Path]:
    """Two steps (of a 4-step schedule) from each kind of source; jsonl runs all 4 as the reference."""
    root = tmp_path_factory.mktemp("runs")
    tok = str(corpus["tokenizer"])
    runs = {
        "jsonl": ["--dataset", str(corpus["jsonl"]), "--num-workers", "2", "--total-steps", "4"],
        "parquet": ["--dataset", str(corpus["parquet"]), "--text-field", "content"],
        "saved": ["--dataset", str(corpus["saved_dict"]), "--split", "train", "--eval-interval", "2",
                  "--eval-steps", "1"],
        "shards": ["--dataset", str(corpus["shards"]), "--worker-buffer-size", "3"],
    }
    for name, argv in runs.items():
        code = train_main("--tokenizer", tok, "--total-steps", "2", "--lr-schedule-steps", "4", *argv,
                          "--checkpoint-dir", str(root / name))
        assert code == 0, name
    return {name: root / name for name in runs}


@pytest.mark.slow
def test_training_from_jsonl_parquet_saved_dataset_and_shards(corpus, trained):
    tok = str(corpus["tokenizer"])
    for name, run_dir in trained.items():
        curve = losses(run_dir)
        assert sorted(curve) == ([1, 2, 3, 4] if name == "jsonl" else [1, 2]), name
        assert all(np.isfinite(v) for v in curve.values()), name
        config = json.loads((run_dir / "config.json").read_text())
        assert config["model_config"]["vocab_size"] == get_tokenizer(tok).vocab_size
        assert config["data_config"]["tokenizer"] == tok
    jsonl = losses(trained["jsonl"])
    assert losses(trained["shards"]) == {1: jsonl[1], 2: jsonl[2]}  # the same batches, prepared or not
    lines = [json.loads(x) for x in (trained["saved"] / "metrics.jsonl").read_text().splitlines()]
    assert any("eval_loss" in r for r in lines)


@pytest.mark.slow
def test_training_resumes_from_shards_exactly(corpus, train_main, trained):
    """Shards stopped at step 2 and resumed to 4 match 4 uninterrupted steps (of the same stream)."""
    code = train_main("--dataset", str(corpus["shards"]), "--tokenizer", str(corpus["tokenizer"]),
                      "--lr-schedule-steps", "4", "--total-steps", "4", "--checkpoint-dir", str(trained["shards"]))
    assert code == 0
    assert losses(trained["shards"]) == losses(trained["jsonl"])


@pytest.mark.parametrize("case", ["hub", "hub-tokenizer", "missing", "field", "token-id", "mismatch", "empty"])
def test_training_errors_exit_2_with_one_line_and_lose_nothing(corpus, train_main, tmp_path, capsys, offline,
                                                               case):
    tok = str(corpus["tokenizer"])
    bad_ids = bad_shards(tmp_path / "bad_ids", [1, 300, 257] * 100, 300)
    (tmp_path / "empty.jsonl").write_text("")
    argv, expected = {
        "hub": (["--dataset", "HuggingFaceTB/smollm-corpus", "--dataset-name", "cosmopedia-v2"],
                "cannot be reached offline; use --dataset stdlib"),
        "hub-tokenizer": (["--tokenizer", "HuggingFaceTB/smollm-360M"], "cannot be reached offline"),
        "missing": (["--dataset", str(tmp_path / "data" / "train.jsonl")], "does not exist"),
        "field": (["--dataset", str(corpus["jsonl"]), "--text-field", "body", "--tokenizer", tok],
                  "fields: id, text"),
        "token-id": (["--dataset", str(bad_ids)], "token id 300 >= vocab size 259"),
        "mismatch": (["--dataset", str(corpus["shards"])], "do not match the tokenizer"),
        "empty": (["--dataset", str(tmp_path / "empty.jsonl")], "is empty"),
    }[case]
    before = snapshot(corpus["root"]), snapshot(tmp_path)
    code = train_main(*argv, "--total-steps", "2", "--checkpoint-dir", str(tmp_path / "run"))
    err = capsys.readouterr().err
    assert code == 2, err
    assert expected in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert (snapshot(corpus["root"]), snapshot(tmp_path)) == before
    assert not (tmp_path / "run").exists()


def test_dataset_name_and_split_only_where_they_mean_something(corpus, train_main, tmp_path, capsys):
    for argv, expected in ((["--dataset", "stdlib", "--split", "validation"], "has no named splits"),
                           (["--dataset", str(corpus["jsonl"]), "--dataset-name", "x"], "--dataset-name only"),
                           (["--dataset", str(corpus["shards"]), "--split", "test"], "has no named splits")):
        assert train_main(*argv, "--checkpoint-dir", str(tmp_path / "run")) == 2
        assert expected in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# Data in a bucket: a real GCS server (gcp-storage-emulator on 127.0.0.1; tests/gcs_emulator.py)


@pytest.fixture(scope="module")
def bucket(corpus):
    """The emulator holding ``gs://bucket/corpus.jsonl`` (uploaded) and ``gs://bucket/shards`` (written by
    ``prepare --out gs://...`` from the same jsonl)."""
    from gcs_emulator import emulator

    with emulator() as gcs:
        gcs.fs.put_file(str(corpus["jsonl"]), "bucket/corpus.jsonl")
        code = prepare.main(["--dataset", str(corpus["jsonl"]), "--tokenizer", str(corpus["tokenizer"]),
                             "--out", "gs://bucket/shards", "--num-workers", "2", "--no-progress"])
        assert code == 0
        yield gcs


@pytest.mark.slow  # an emulator, an upload and a prepare: I/O integration; the quick loop is near its 5 minutes
def test_bucket_shards_and_jsonl_give_the_local_batches_and_a_host_reads_only_its_rows(corpus, bucket, capsys):
    tok = str(corpus["tokenizer"])
    for name in ("train.bin", "eval.bin"):  # prepare --out gs:// uploaded what a local prepare writes
        assert bucket.fs.cat_file(f"bucket/shards/{name}") == (corpus["shards"] / name).read_bytes()
    local, local_eval, _ = make_datasets(str(corpus["shards"]), tok, SEQ, 3)
    shards, shards_eval, _ = make_datasets("gs://bucket/shards", tok, SEQ, 3)
    lines, lines_eval, _ = make_datasets("gs://bucket/corpus.jsonl", tok, SEQ, 3, num_workers=2)
    for data in (shards, lines):
        assert (data.num_tokens, data.num_windows) == (local.num_tokens, local.num_windows)
    for step in (0, 7, 500):
        for data, reference in ((shards, local), (lines, local), (shards_eval, local_eval), (lines_eval, local_eval)):
            np.testing.assert_array_equal(data.batch_at(step, global_batch=8), reference.batch_at(step, global_batch=8))

    # Byte ranges: a host's batch reads exactly its rows' windows, nothing else of the file.
    fresh, _, _ = make_datasets("gs://bucket/shards", tok, SEQ, 3)
    host = fresh.batch_at(13, global_batch=8, process_index=1, process_count=2)
    np.testing.assert_array_equal(host, local.batch_at(13, global_batch=8)[4:])
    assert fresh.windows.bytes_read == 4 * (SEQ + 1) * 2  # 4 rows of SEQ + 1 uint16 tokens
    assert fresh.windows.bytes_read * 100 < bucket.fs.size("bucket/shards/train.bin")

    code = prepare.main(["--dataset", str(corpus["jsonl"]), "--tokenizer", tok, "--out", "gs://bucket/shards",
                         "--no-progress"])
    assert code == 2 and "already exists and is not empty" in capsys.readouterr().err
    with pytest.raises(ValueError, match="does not exist"):
        make_datasets("gs://bucket/missing.jsonl", tok, SEQ, 0)


@pytest.mark.slow
def test_training_from_the_bucket_matches_local_data_and_resumes_exactly(corpus, bucket, train_main, trained,
                                                                         tmp_path):
    """Shards and a .jsonl in the bucket give the local jsonl run's losses, bit for bit; the shards run stopped
    at step 2 and resumed to 4 matches the 4 uninterrupted steps."""
    reference = losses(trained["jsonl"])
    for name in ("shards", "corpus.jsonl"):
        run = tmp_path / name
        code = train_main("--dataset", f"gs://bucket/{name}", "--tokenizer", str(corpus["tokenizer"]),
                          "--total-steps", "2", "--lr-schedule-steps", "4", "--checkpoint-dir", str(run))
        assert code == 0 and losses(run) == {1: reference[1], 2: reference[2]}, name
    code = train_main("--dataset", "gs://bucket/shards", "--tokenizer", str(corpus["tokenizer"]), "--total-steps", "4",
                      "--lr-schedule-steps", "4", "--checkpoint-dir", str(tmp_path / "shards"))
    assert code == 0 and losses(tmp_path / "shards") == reference


@pytest.mark.slow
def test_two_processes_of_4_devices_train_from_the_bucket_as_one_of_8(corpus, bucket, trained, tmp_path, cache_dir):
    """Two processes, each reading its half of every batch from the bucket's shards by byte range, log the
    losses of the one-process, 8-device run on the same data (the local jsonl reference: same batches)."""
    from helpers import cpu_env
    from test_train_cli import command, free_port

    port, procs = free_port(), []
    argv = ["--dataset", "gs://bucket/shards", "--tokenizer", str(corpus["tokenizer"]), "--batch-size", "8",
            "--learning-rate", "3e-3", "--warmup-steps", "1", "--total-steps", "2", "--lr-schedule-steps", "4",
            "--checkpoint-dir", str(tmp_path / "multi")]
    for index in range(2):
        env = cpu_env(4, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_PROCESS_COUNT="2",
                          JAX_PROCESS_INDEX=str(index))
        procs.append(subprocess.Popen(command(*argv, cache=cache_dir), env=env, cwd=Path(__file__).parents[1],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    two, one = losses(tmp_path / "multi"), losses(trained["jsonl"])
    assert sorted(two) == [1, 2]
    for step in (1, 2):
        assert abs(two[step] - one[step]) <= 1e-6 * abs(one[step]), (step, two[step], one[step])


# ---------------------------------------------------------------------------------------------------------------
# Records skipped for a null field are counted, through every path to the windows


def test_null_records_are_counted_per_reason_in_both_parts_and_through_prepared_shards(tmp_path, capsys):
    """600 prompt/response records, 100 with a null response and 10 with a null prompt: the windows of the two
    parts count them, whatever the worker count; a text corpus prepared as shards keeps its count in index.json."""
    rows = [{"prompt": None if i % 60 == 1 else f"q{i}", "response": None if i % 6 == 0 else f"a{i}"}
            for i in range(600)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    for workers in (1, 3):
        train, held, _ = make_datasets(str(tmp_path / "pairs.jsonl"), "bytes", 4, 0, prompt_field="prompt",
                                       response_field="response", num_workers=workers)
        both = {k: train.skipped.get(k, 0) + held.skipped.get(k, 0) for k in {*train.skipped, *held.skipped}}
        assert both == {"null response": 100, "null prompt": 10}, workers
    texts = [{"text": None if i % 4 == 0 else f"document {i}"} for i in range(400)]
    (tmp_path / "texts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in texts))
    assert prepare.main(["--dataset", str(tmp_path / "texts.jsonl"), "--out", str(tmp_path / "shards"),
                         "--no-progress"]) == 0
    capsys.readouterr()
    counted = []
    for dataset in ("texts.jsonl", "shards"):
        train, held, _ = make_datasets(str(tmp_path / dataset), "bytes", 4, 0)
        counted.append((train.skipped, held.skipped))
    assert counted[0] == counted[1] and counted[0][0]["null text"] + counted[0][1].get("null text", 0) == 100


def test_a_part_of_only_null_records_says_how_many_were_skipped(tmp_path):
    (tmp_path / "nulls.jsonl").write_text("".join(json.dumps({"text": None}) + "\n" for _ in range(5)))
    with pytest.raises(ValueError) as excinfo:
        make_datasets(str(tmp_path / "nulls.jsonl"), "bytes", SEQ, 0)
    assert "its train split has no documents, 4 records skipped (4 null text)" in one_line(excinfo)
