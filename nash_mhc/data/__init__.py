"""Data: tokenizers, document sources, packed deterministic per-host batches, prepared shards, a prefetch thread.

One-call entry point for the training loop::

    train, evaluation, tokenizer = make_datasets("stdlib", "bytes", seq_len=256, seed=0)
    batch = train.batch_at(step, global_batch=32, process_index=p, process_count=P)  # int32 [32 // P, 257]

``dataset`` may also be ``"synthetic"``, a local ``.txt``/``.jsonl``/``.json``/``.parquet`` file or directory, a
``save_to_disk`` directory, a directory of shards from ``python -m nash_mhc.data.prepare``, or a Hugging Face
hub id (``make_datasets(..., dataset_name=, split=, text_field=, num_workers=, max_stream_tokens=)``);
``tokenizer`` is ``"bytes"``, a ``tokenizer.json``, a tokenizer directory or a hub id.
"""

from nash_mhc.data.pipeline import (
    EncodedChunk,
    PackedDataset,
    build_token_stream,
    clear_cache,
    encode_chunks,
    make_datasets,
    stream_dtype,
    token_stream,
)
from nash_mhc.data.prefetch import Prefetcher
from nash_mhc.data.shards import ShardedDataset, ShardSource
from nash_mhc.data.sources import (
    DEFAULT_MAX_STREAM_TOKENS,
    DiskDatasetSource,
    FileSource,
    HubSource,
    Source,
    StdlibSource,
    SyntheticSource,
    load_source,
    split_paths,
    stdlib_files,
)
from nash_mhc.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, get_tokenizer

__all__ = [
    "DEFAULT_MAX_STREAM_TOKENS",
    "ByteTokenizer",
    "DiskDatasetSource",
    "EncodedChunk",
    "FileSource",
    "HFTokenizer",
    "HubSource",
    "PackedDataset",
    "Prefetcher",
    "ShardSource",
    "ShardedDataset",
    "Source",
    "StdlibSource",
    "SyntheticSource",
    "Tokenizer",
    "build_token_stream",
    "clear_cache",
    "encode_chunks",
    "get_tokenizer",
    "load_source",
    "make_datasets",
    "split_paths",
    "stdlib_files",
    "stream_dtype",
    "token_stream",
]
