"""``python -m nash_mhc.data.prepare``: tokenise a corpus once into memory-mappable shards.

    python -m nash_mhc.data.prepare --dataset corpus.jsonl --tokenizer tokenizer.json --out data/corpus

reads every document of ``--dataset`` (any name training accepts: ``stdlib``, ``synthetic``, local
``.txt``/``.jsonl``/``.json``/``.parquet`` files or directories, a ``save_to_disk`` directory, a Hugging Face
hub id with ``--dataset-name``/``--split``), tokenises it on ``--num-workers`` threads with a progress bar and
writes fixed-size ``uint16``/``uint32`` shards of ``--shard-tokens`` tokens per split (``train`` and the
held-out ``eval``) plus ``index.json`` (format: :mod:`nash_mhc.data.shards`). Train on them with
``python -m nash_mhc.train --dataset data/corpus --tokenizer tokenizer.json``. The index is written last,
so an interrupted run leaves no usable-looking directory; an existing non-empty ``--out`` is refused (nothing
is overwritten or deleted). Exit codes: 0 done, 2 bad arguments or inputs (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from nash_mhc.cli import OneLineParser, fail

__all__ = ["build_parser", "main", "prepare_shards"]

DEFAULT_SHARD_TOKENS = 1 << 27  # 128 Mi tokens: 256 MiB per uint16 shard


def prepare_shards(
    dataset: str,
    tokenizer: str,
    out: str | Path,
    *,
    dataset_name: str | None = None,
    split: str = "train",
    text_field: str = "text",
    num_workers: int = 1,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    max_tokens: int | None = None,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """Tokenise ``dataset``'s train and eval splits into shards under ``out``; returns the index.

    ``max_tokens`` bounds the train split (default: all of it, a streamed hub dataset included). Raises a
    one-line ``ValueError`` for unusable input; on failure only the files this call created are removed.
    """
    from tqdm.auto import tqdm

    from nash_mhc.data import shards
    from nash_mhc.data.pipeline import encode_chunks, stream_dtype
    from nash_mhc.data.sources import load_source
    from nash_mhc.data.tokenizers import get_tokenizer

    if shard_tokens < 1:
        raise ValueError(f"--shard-tokens must be >= 1, got {shard_tokens}")
    if num_workers < 1:
        raise ValueError(f"--num-workers must be >= 1, got {num_workers}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {max_tokens}")
    directory = Path(out).expanduser()
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise ValueError(f"--out {str(out)!r} already exists and is not an empty directory; choose a new directory "
                         "(nothing was changed)")
    tok = get_tokenizer(tokenizer)
    sources = {role: load_source(dataset, role, seed, dataset_name=dataset_name, dataset_split=split,
                                 text_field=text_field, max_stream_tokens=max_tokens if role == "train" else None)
               for role in ("train", "eval")}
    if isinstance(sources["train"], shards.ShardSource):
        raise ValueError(f"dataset {dataset!r} is already prepared shards")
    made_dir = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    dtype = stream_dtype(tok.vocab_size)
    writers: list[shards.ShardWriter] = []
    splits: dict[str, Any] = {}
    started = time.perf_counter()
    try:
        for role, source in sources.items():
            writer = shards.ShardWriter(directory, role, dtype, shard_tokens)
            writers.append(writer)
            bar = tqdm(desc=f"{role} tokens", unit="tok", unit_scale=True, disable=not progress, file=sys.stderr)
            try:
                limit = max_tokens if role == "train" else None
                for chunk in encode_chunks(source, tok, num_workers=num_workers, max_tokens=limit):
                    writer.write(chunk.ids, chunk.documents)
                    bar.update(int(chunk.ids.size))
            finally:
                bar.close()
            splits[role] = writer.close()
            if not splits[role]["num_documents"]:
                raise ValueError(f"dataset {dataset!r} is empty: its {role} split has no documents")
        index = {
            "format": shards.FORMAT,
            "version": shards.VERSION,
            "dtype": dtype.name,
            "shard_tokens": shard_tokens,
            "tokenizer": shards.tokenizer_record(tok),
            "source": {"dataset": dataset, "dataset_name": dataset_name, "split": split, "text_field": text_field,
                       "max_tokens": max_tokens, "seed": seed},
            "splits": splits,
            "seconds": round(time.perf_counter() - started, 3),
        }
        tmp = directory / (shards.INDEX_FILE + ".tmp")
        tmp.write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, directory / shards.INDEX_FILE)
    except BaseException:
        for writer in writers:
            writer.abort()
        (directory / (shards.INDEX_FILE + ".tmp")).unlink(missing_ok=True)
        if made_dir and not any(directory.iterdir()):
            directory.rmdir()
        raise
    return index


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m nash_mhc.data.prepare", description=__doc__.splitlines()[0],
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dataset", required=True, help="what to tokenise (any --dataset of the training program)")
    p.add_argument("--dataset-name", help="configuration name of a Hugging Face dataset")
    p.add_argument("--split", default="train", help="split of a Hugging Face dataset to prepare for training")
    p.add_argument("--text-field", default="text", help="text column of JSON, Parquet and datasets data")
    p.add_argument("--tokenizer", default="bytes", help="'bytes', a tokenizer.json, a tokenizer directory or a hub "
                   "id")
    p.add_argument("--out", required=True, help="new (or empty) output directory")
    p.add_argument("--num-workers", type=int, default=os.cpu_count() or 1, help="tokenisation threads")
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard file")
    p.add_argument("--max-tokens", type=int, help="stop the train split after this many tokens (default: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of --dataset synthetic")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        index = prepare_shards(args.dataset, args.tokenizer, args.out, dataset_name=args.dataset_name,
                               split=args.split, text_field=args.text_field, num_workers=args.num_workers,
                               shard_tokens=args.shard_tokens, max_tokens=args.max_tokens, seed=args.seed,
                               progress=not args.no_progress)
    except (ValueError, FileNotFoundError, PermissionError) as error:
        return fail(error)
    summary = {role: {k: v for k, v in entry.items() if k != "shards"} | {"shards": len(entry["shards"])}
               for role, entry in index["splits"].items()}
    print(json.dumps({"out": str(args.out), "tokenizer": index["tokenizer"]["name"], "dtype": index["dtype"],
                      "splits": summary, "seconds": index["seconds"]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
