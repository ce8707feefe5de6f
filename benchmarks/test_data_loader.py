"""Data-loader throughput against what training consumes (tokens/s in ``extra_info``).

- ``small`` train step: tokens/s of one optimizer step of the ``small`` preset, batch 8, on one device;
- prepared shards: ``batch_at`` of consecutive steps (8 random windows of ``seq_len + 1`` tokens of the
  memory-mapped ``train.bin``, the work the prefetch thread does per step); must deliver >= 20x the train
  step's tokens/s;
- on-the-fly: tokenising a JSON-lines corpus with a byte-level BPE (``tokenizers``, 2 worker threads) into the
  packed stream; must produce >= 2x the train step's tokens/s.

The corpus is the first ~4 MB of the running Python's standard library (one JSON record per file); the BPE
(vocabulary 2048) is trained on it here, so nothing is downloaded.
"""

from __future__ import annotations

import json
import sysconfig
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from nash_mhc import ModelConfig, TrainConfig, make_mesh
from nash_mhc.data import DataConfig, get_tokenizer, make_datasets, open_source, token_stream
from nash_mhc.data.prepare import PrepareConfig, prepare_shards
from nash_mhc.data.sources.stdlib import stdlib_files
from nash_mhc.sharding import shard_batch
from nash_mhc.training import Batch, init_train_state, train_step

BATCH = 8
CORPUS_BYTES = 4_000_000
LOADER_STEPS = 200
RATES: dict[str, float] = {}


class SmallStep:
    """The ``small`` preset's train step on one device, compiled on construction."""

    def __init__(self) -> None:
        self.config = ModelConfig.preset("small")
        train_config = TrainConfig(batch_size=BATCH, total_steps=1000, warmup_steps=10)
        mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
        self.state = init_train_state(self.config, train_config, mesh, key=jax.random.key(0))
        tokens = np.random.default_rng(0).integers(0, self.config.vocab_size, (BATCH, self.config.seq_len + 1),
                                                   dtype=np.int32)
        self.batch = Batch(tokens=shard_batch(tokens, mesh))
        self.tokens_per_step = BATCH * self.config.seq_len
        self()  # compile outside any timed region

    def __call__(self) -> None:
        self.state, metrics = train_step(self.state, self.batch)  # the state is donated: keep the new one
        jax.block_until_ready(metrics)


@pytest.fixture(scope="module")
def small_step() -> SmallStep:
    step = SmallStep()
    start = time.perf_counter()
    for _ in range(3):
        step()
    RATES.setdefault("train_step", 3 * step.tokens_per_step / (time.perf_counter() - start))
    return step


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, str]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("loader_corpus")
    stdlib = sysconfig.get_paths()["stdlib"]
    docs, size = [], 0
    for rel in stdlib_files(stdlib):
        text = (Path(stdlib) / rel).read_text(encoding="utf-8", errors="replace")
        docs.append(text)
        size += len(text)
        if size >= CORPUS_BYTES:
            break
    with open(root / "corpus.jsonl", "w") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=2048, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                      show_progress=False))
    tok.save(str(root / "tokenizer.json"))
    data = DataConfig(dataset=str(root / "corpus.jsonl"), tokenizer=str(root / "tokenizer.json"), num_workers=2)
    prepare_shards(data, PrepareConfig(out=str(root / "shards"), progress=False))
    return {"jsonl": str(root / "corpus.jsonl"), "tokenizer": str(root / "tokenizer.json"),
            "shards": str(root / "shards")}


def report(benchmark, name: str, tokens_per_second: float, required: float | None = None) -> None:
    RATES[name] = tokens_per_second
    benchmark.extra_info["tokens_per_second"] = round(tokens_per_second)
    train = RATES["train_step"]
    benchmark.extra_info["small_train_step_tokens_per_second"] = round(train)
    line = f"\n{name}: {tokens_per_second:,.0f} tokens/s; small train step: {train:,.0f} tokens/s"
    if required is not None:
        ratio = tokens_per_second / train
        benchmark.extra_info["ratio_to_train_step"] = round(ratio, 2)
        benchmark.extra_info["required_ratio"] = required
        line += f"; ratio {ratio:,.1f}x (required >= {required:g}x)"
    print(line)


def test_small_train_step_tokens_per_second(benchmark, small_step):
    benchmark.pedantic(small_step, rounds=5, iterations=1)
    RATES["train_step"] = small_step.tokens_per_step / benchmark.stats.stats.mean
    report(benchmark, "train_step", RATES["train_step"])


def test_shard_loader_tokens_per_second(benchmark, corpus, small_step):
    dataset, _, _ = make_datasets(corpus["shards"], corpus["tokenizer"], small_step.config.seq_len, seed=0)
    assert isinstance(dataset.windows, np.memmap) and dataset.num_windows > 1000
    position = {"step": 0}

    def read_batches() -> None:
        for _ in range(LOADER_STEPS):
            batch = dataset.batch_at(position["step"], global_batch=BATCH)
            position["step"] += 1
        assert batch.shape == (BATCH, small_step.config.seq_len + 1)

    benchmark.pedantic(read_batches, rounds=5, iterations=1, warmup_rounds=1)
    rate = LOADER_STEPS * BATCH * small_step.config.seq_len / benchmark.stats.stats.mean
    report(benchmark, "shard_loader", rate, required=20)
    assert rate >= 20 * RATES["train_step"]


def test_on_the_fly_tokenisation_tokens_per_second(benchmark, corpus, small_step):
    tokenizer = get_tokenizer(corpus["tokenizer"])
    source = open_source(corpus["jsonl"], "train")
    sizes = []

    def tokenise() -> None:
        sizes.append(token_stream(source, tokenizer, num_workers=2).size)  # tokenises every round

    benchmark.pedantic(tokenise, rounds=3, iterations=1)
    rate = sizes[-1] / benchmark.stats.stats.mean
    benchmark.extra_info["stream_tokens"] = sizes[-1]
    report(benchmark, "on_the_fly_tokenisation", rate, required=2)
    assert rate >= 2 * RATES["train_step"]
