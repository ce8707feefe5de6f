"""DataConfig: which dataset and tokenizer a program reads, each setting declared once (default, help, check)."""

from __future__ import annotations

import dataclasses
import os

from nash_mhc.data.tokenizers import Tokenizer, get_tokenizer
from nash_mhc.settings import POSITIVE_INT, check_settings, setting


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
    tokenizer: str = setting("bytes", "'bytes' (offline default), a tokenizer.json, a tokenizer directory or a "
                                      "Hugging Face tokenizer id")
    num_workers: int = setting(os.cpu_count() or 1, "tokenisation threads (the stream does not depend on them)",
                               check=POSITIVE_INT)
    max_stream_tokens: int | None = setting(20_000_000, "tokens read from a streamed Hugging Face dataset (its "
                                                        "deterministic prefix is trained on; prepare shards for "
                                                        "more)", check=POSITIVE_INT)

    def __post_init__(self) -> None:
        check_settings(self)

    def load_tokenizer(self) -> Tokenizer:
        return get_tokenizer(self.tokenizer)
