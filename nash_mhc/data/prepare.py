"""``python -m nash_mhc.data.prepare``: tokenise a corpus once into memory-mappable prepared shards.

    python -m nash_mhc.data.prepare --dataset corpus.jsonl --tokenizer tokenizer.json --out data/corpus

reads every document of ``--dataset`` (any dataset training accepts), tokenises it on ``--num-workers`` threads
and writes ``train.bin``, the held-out ``eval.bin`` and ``index.json`` (format: :mod:`nash_mhc.data.prepared`).
Train on them with ``python -m nash_mhc.train --dataset data/corpus --tokenizer tokenizer.json``. An existing
non-empty ``--out`` is refused (nothing is overwritten or deleted). ``--out gs://bucket/shards`` writes the shards
in a local temporary directory and uploads them, ``index.json`` last (training reads them by byte range).
Exit codes: 0 done, 2 bad arguments or inputs (one line on stderr).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from nash_mhc import paths
from nash_mhc.cli import SettingsParser, fail
from nash_mhc.data import DataConfig, prepared, remote
from nash_mhc.data.encode import encode_chunks
from nash_mhc.data.sources import open_source
from nash_mhc.data.windows import skipped_text, stream_dtype
from nash_mhc.settings import POSITIVE_INT, check_settings, setting


@dataclasses.dataclass(frozen=True)
class PrepareConfig:
    """Where the shards go and how much of the corpus they hold."""

    out: str = setting(help="new (or empty) output directory, local or in a bucket (gs://...: written to a local "
                            "temporary directory first, then uploaded)")
    max_tokens: int | None = setting(None, "stop the train part after this many tokens (default: all of it)",
                                     check=POSITIVE_INT)
    seed: int = setting(0, "seed of --dataset synthetic")
    progress: bool = setting(True, "no progress bar")

    def __post_init__(self) -> None:
        check_settings(self)


def prepare_shards(data: DataConfig, config: PrepareConfig) -> dict[str, Any]:
    """Tokenise ``data``'s train and eval parts into ``config.out``; returns the index. Raises a one-line
    ``ValueError`` for unusable input; on failure only what this call created is removed."""
    if remote.is_remote(config.out):  # written locally, then uploaded (index.json last)
        target = paths.as_path(config.out)
        if target.exists() and (not target.is_dir() or any(target.iterdir())):
            raise ValueError(f"--out {config.out!r} already exists and is not empty; choose a new folder (nothing "
                             "was changed)")
        with tempfile.TemporaryDirectory(prefix="nash_mhc-prepare-") as staging:
            index = prepare_shards(data, dataclasses.replace(config, out=staging))
            remote.upload(staging, target, [*(entry["file"] for entry in index["splits"].values()),
                                            prepared.INDEX_FILE])
        return index
    directory = Path(config.out).expanduser()
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise ValueError(f"--out {config.out!r} already exists and is not an empty directory; choose a new "
                         "directory (nothing was changed)")
    tokenizer = data.load_tokenizer()
    corpora = {part: open_source(data.dataset, part, config.seed, dataset_name=data.dataset_name,
                                 dataset_split=data.dataset_split, text_field=data.text_field)
               for part in ("train", "eval")}
    if isinstance(corpora["train"], prepared.PreparedSplit):
        raise ValueError(f"dataset {data.dataset!r} is already prepared shards")
    made = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    dtype, splits, started = stream_dtype(tokenizer.vocab_size), {}, time.perf_counter()
    try:
        for part, corpus in corpora.items():
            limit = config.max_tokens if part == "train" else None
            with tqdm(desc=f"{part} tokens", unit="tok", unit_scale=True, disable=not config.progress,
                      file=sys.stderr) as bar:
                chunks = encode_chunks(corpus, tokenizer, num_workers=data.num_workers, max_tokens=limit)
                splits[part] = prepared.write_part(directory, part, chunks, dtype, progress=bar.update)
            if not splits[part]["num_documents"]:
                skipped = skipped_text(splits[part].get("skipped", {}))
                raise ValueError(f"dataset {data.dataset!r} is empty: its {part} split has no documents"
                                 + (f", {skipped}" if skipped else ""))
        index = {"dtype": dtype.name, "tokenizer": prepared.tokenizer_record(tokenizer),
                 "source": {"dataset": data.dataset, "dataset_name": data.dataset_name, "split": data.dataset_split,
                            "text_field": data.text_field, "max_tokens": config.max_tokens, "seed": config.seed},
                 "splits": splits, "seconds": round(time.perf_counter() - started, 3)}
        prepared.write_index(directory, index)
    except BaseException:
        for entry in splits.values():
            (directory / entry["file"]).unlink(missing_ok=True)
        if made and not any(directory.iterdir()):
            directory.rmdir()
        raise
    return index


def build_parser() -> SettingsParser:
    parser = SettingsParser("python -m nash_mhc.data.prepare", __doc__)
    parser.add_settings(DataConfig, only=("dataset", "dataset_name", "dataset_split", "text_field", "tokenizer",
                                          "num_workers"))
    parser.add_settings(PrepareConfig)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    given = parser.given(argv)
    try:
        index = prepare_shards(parser.build(DataConfig, given), parser.build(PrepareConfig, given))
    except (ValueError, OSError) as error:  # bad input, or a filesystem that refuses the output
        return fail(error)
    summary = {part: {k: v for k, v in entry.items() if k != "file"} for part, entry in index["splits"].items()}
    print(json.dumps({"out": str(given["out"]), "tokenizer": index["tokenizer"]["name"], "dtype": index["dtype"],
                      "splits": summary, "seconds": index["seconds"]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
