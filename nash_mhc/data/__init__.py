"""Data: tokenizers, document sources, packed deterministic per-host batches and a prefetch thread.

One-call entry point for the training loop::

    train, evaluation, tokenizer = make_datasets("stdlib", "bytes", seq_len=256, seed=0)
    batch = train.batch_at(step, global_batch=32, process_index=p, process_count=P)  # int32 [32 // P, 257]
"""

from nash_mhc.data.pipeline import (
    PackedDataset,
    build_token_stream,
    clear_cache,
    make_datasets,
    stream_dtype,
    token_stream,
)
from nash_mhc.data.prefetch import Prefetcher
from nash_mhc.data.sources import Source, StdlibSource, SyntheticSource, load_source, split_paths, stdlib_files
from nash_mhc.data.tokenizers import ByteTokenizer, Tokenizer, get_tokenizer

__all__ = [
    "ByteTokenizer",
    "PackedDataset",
    "Prefetcher",
    "Source",
    "StdlibSource",
    "SyntheticSource",
    "Tokenizer",
    "build_token_stream",
    "clear_cache",
    "get_tokenizer",
    "load_source",
    "make_datasets",
    "split_paths",
    "stdlib_files",
    "stream_dtype",
    "token_stream",
]
