"""Data: tokenizers, dataset sources, the deterministic (seed, step) → batch map, prepared shards, prefetch.

One call gives the training program its data::

    train, evaluation, tokenizer = make_datasets("stdlib", "bytes", seq_len=256, seed=0)
    batch = train.batch_at(step, global_batch=32, process_index=p, process_count=P)  # int32 [32 // P, 257]

Modules, lowest first: :mod:`.tokenizers` (and :mod:`.hub`), :mod:`.windows` (token windows and the batch
map), :mod:`.remote` (datasets in a bucket: listing, byte-range reads), :mod:`.prepared` (memory-mapped or
byte-range shards), :mod:`.sft` (prompt/response records and their loss mask), :mod:`.sources` (one module per
kind of dataset and the registry), :mod:`.encode` (documents → token stream and mask), :mod:`.prefetch`,
:mod:`.prepare` (the shards CLI).
"""

from __future__ import annotations

import dataclasses
import os

from nash_mhc.data.encode import encode_chunks, encode_corpus, masked_stream, token_stream
from nash_mhc.data.prefetch import Prefetcher
from nash_mhc.data.prepared import PreparedSplit
from nash_mhc.data.sources import Corpus, open_source
from nash_mhc.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, count_bytes, get_tokenizer
from nash_mhc.data.windows import NoWindows, PackedDataset
from nash_mhc.settings import POSITIVE_INT, check_settings, setting

__all__ = ["ByteTokenizer", "Corpus", "DataConfig", "HFTokenizer", "NoWindows", "PackedDataset", "Prefetcher",
           "PreparedSplit", "Tokenizer", "count_bytes", "encode_chunks", "encode_corpus", "get_tokenizer",
           "make_datasets", "masked_stream", "open_source", "open_windows", "token_stream"]


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The dataset (``--dataset``; see :mod:`nash_mhc.data.sources`) and the tokenizer that reads it.

    ``dataset_split`` is the Hugging Face dataset's own named split to train on (``--split``), not the
    train/eval *part* every dataset is cut into.
    """

    dataset: str = setting("stdlib", "'stdlib' (offline default corpus), 'synthetic', a local .txt/.jsonl/.json/"
                                     ".parquet file or directory, a save_to_disk directory, prepared shards (python "
                                     "-m nash_mhc.data.prepare) or a Hugging Face dataset id")
    dataset_name: str | None = setting(None, "configuration name of a Hugging Face dataset")
    dataset_split: str = setting("train", "split of a Hugging Face dataset (or saved DatasetDict) to train on",
                                 flag="--split")
    text_field: str = setting("text", "text column of JSON, Parquet and datasets data")
    prompt_field: str | None = setting(None, "with --response-field: prompt column of JSON, Parquet and datasets "
                                             "records; the loss counts only the response tokens (fine-tuning)")
    response_field: str | None = setting(None, "with --prompt-field: response column (the tokens the loss counts)")
    tokenizer: str = setting("bytes", "'bytes' (offline default), a tokenizer.json, a tokenizer directory or a "
                                      "Hugging Face tokenizer id")
    num_workers: int = setting(os.cpu_count() or 1, "tokenisation threads (the stream does not depend on them)",
                               check=POSITIVE_INT)
    max_stream_tokens: int | None = setting(20_000_000, "tokens read from a streamed Hugging Face dataset (its "
                                                        "deterministic prefix is trained on; prepare shards for "
                                                        "more)", check=POSITIVE_INT)

    def __post_init__(self) -> None:
        check_settings(self)
        if (self.prompt_field is None) != (self.response_field is None):
            raise ValueError("give both --prompt-field and --response-field (or neither)")
        if self.prompt_field is not None and self.prompt_field == self.response_field:
            raise ValueError(f"--prompt-field and --response-field must name two different fields, got "
                             f"{self.prompt_field!r} for both")

    @property
    def fields(self) -> str | tuple[str, str]:
        """What a record is read as: its text field, or the (prompt, response) pair of prompt/response data."""
        return self.text_field if self.prompt_field is None else (self.prompt_field, self.response_field)

    def fields_record(self) -> dict[str, str | None]:
        """The field settings a checkpoint records (so ``evaluate`` reads the data as training did)."""
        return {"text_field": self.text_field, "prompt_field": self.prompt_field,
                "response_field": self.response_field}

    def load_tokenizer(self) -> Tokenizer:
        return get_tokenizer(self.tokenizer)


def open_windows(config: DataConfig, part: str, tokenizer: Tokenizer, seq_len: int, seed: int) -> PackedDataset:
    """The windows of part ``part`` ("train" or the held-out "eval") of ``config``'s dataset: memory-mapped
    for prepared shards, tokenised now for every other kind. :class:`NoWindows` when the part fills none."""
    source = open_source(config.dataset, part, seed, dataset_name=config.dataset_name,
                         dataset_split=config.dataset_split, text_field=config.fields,
                         max_stream_tokens=config.max_stream_tokens)
    if isinstance(source, PreparedSplit):
        return source.windows(tokenizer, seq_len, seed=seed)
    tokens, mask, skipped = encode_corpus(source, tokenizer, num_workers=config.num_workers)
    return PackedDataset(tokens, seq_len, seed=seed, vocab_size=tokenizer.vocab_size, name=f"{source.name}/{part}",
                         loss_mask=mask, skipped=skipped)


def make_datasets(dataset: str, tokenizer: str | Tokenizer, seq_len: int, seed: int, **options: object
                  ) -> tuple[PackedDataset, PackedDataset, Tokenizer]:
    """``(train, eval, tokenizer)``; ``options`` are the other :class:`DataConfig` fields (``dataset_name``,
    ``dataset_split``, ``text_field``, ``prompt_field``, ``response_field``, ``num_workers``,
    ``max_stream_tokens``). Raises a one-line ``ValueError`` for anything unusable."""
    tok = get_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    config = DataConfig(dataset=dataset, tokenizer=tok.name, **options)  # type: ignore[arg-type]
    return (open_windows(config, "train", tok, seq_len, seed), open_windows(config, "eval", tok, seq_len, seed), tok)
