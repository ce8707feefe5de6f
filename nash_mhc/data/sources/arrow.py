"""Hugging Face ``datasets``: ``save_to_disk`` directories and hub datasets (the ``data`` extra).

A saved ``DatasetDict`` or a hub dataset with a ``validation``/``valid``/``val``/``test`` split holds out
that split; a saved ``Dataset`` without one holds out the rows whose stable hash falls below
``EVAL_FRACTION``. A hub dataset is streamed when the hub answers (else read from the local Hugging Face
cache); without its own eval split the first ``STREAM_EVAL_DOCUMENTS`` documents are held out (train skips
them), and training reads the stream up to ``max_stream_tokens`` tokens.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from nash_mhc import paths
from nash_mhc.data import hub
from nash_mhc.data.sft import Fields, columns
from nash_mhc.data.sources.base import Corpus, document_fractions, held_out, text_of

STREAM_EVAL_DOCUMENTS = 200
EVAL_SPLIT_NAMES = ("validation", "valid", "val", "test")


def _datasets(what: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{what} needs the 'datasets' package: pip install 'nash-mhc[data]'; or "
                         f"{hub.DATASET_ALTERNATIVES}") from None
    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    return datasets


def is_saved_dataset(path: Path | paths.Path) -> bool:
    """Whether ``path`` is a directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    return path.is_dir() and ((path / "dataset_dict.json").is_file()
                              or ((path / "state.json").is_file() and (path / "dataset_info.json").is_file()))


def _splits(available: Sequence[str], train_split: str, what: str) -> tuple[str, str | None]:
    """(the split to train on, the dataset's own eval split or None)."""
    if train_split not in available:
        raise ValueError(f"{what} has no split {train_split!r}; splits: {', '.join(available)} (use --split)")
    return train_split, next((s for s in EVAL_SPLIT_NAMES if s in available and s != train_split), None)


def _texts(rows: Iterable[dict[str, Any]], field: Fields, what: str) -> Iterator[Any]:
    return (text_of(row, field, what) for row in rows)


def _table_texts(table: Any, field: Fields, what: str) -> Iterator[Any]:
    """The ``field`` (or prompt/response pair) of every row of an Arrow ``Dataset``, read in column batches."""
    text_of(dict.fromkeys(table.column_names), field, what)  # fails now when the column is missing
    names = columns(field)
    rows = (dict(zip(names, values, strict=True)) for batch in table.select_columns(names).iter(1000)
            for values in zip(*(batch[n] for n in names), strict=True))
    return _texts(rows, field, what)


def _table_documents(train: Any, own_eval: Any, part: str, field: Fields, key: str, what: str) -> Iterator[Any]:
    """Documents of one part of an Arrow ``Dataset`` (``own_eval``: the dataset's eval split, or None)."""
    if own_eval is not None:
        yield from _table_texts(own_eval if part == "eval" else train, field, what)
        return
    mask = held_out(document_fractions(key, len(train)))
    for keep, text in zip(mask == (part == "eval"), _table_texts(train, field, what), strict=True):
        if keep:
            yield text


def saved_corpus(path: Path, name: str, part: str, dataset_split: str, text_field: Fields) -> Corpus:
    """A ``save_to_disk`` directory; ``dataset_split`` picks a split of a ``DatasetDict``."""
    what = f"dataset {name!r}"
    datasets = _datasets(what)
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as error:  # noqa: BLE001
        raise ValueError(f"{what}: cannot load the saved dataset: {hub.first_line(error)}") from None
    own_eval = None
    if isinstance(loaded, datasets.DatasetDict):
        train_split, eval_split = _splits(list(loaded), dataset_split, what)
        loaded, own_eval = loaded[train_split], (loaded[eval_split] if eval_split else None)
    elif dataset_split != "train":
        raise ValueError(f"{what} is a single saved Dataset without named splits; --split {dataset_split!r} does "
                         "not apply")
    for table in (loaded, own_eval):
        if table is not None:
            text_of(dict.fromkeys(table.column_names), text_field, what)
    return Corpus(name, part, lambda: _table_documents(loaded, own_eval, part, text_field, dataset_split, what))


def hub_corpus(repo_id: str, part: str, dataset_name: str | None, dataset_split: str, text_field: Fields,
               max_tokens: int | None) -> Corpus:
    """A hub dataset: streamed when the hub answers, else its copy in the local Hugging Face cache."""
    what = f"dataset {repo_id!r}"
    datasets = _datasets(f"{what} looks like a Hugging Face hub id, which")
    cached, reachable = None, hub.hub_reachable()
    try:
        if reachable:
            names = datasets.get_dataset_split_names(repo_id, dataset_name)
        else:
            with hub.offline(datasets_too=True):
                cached = datasets.load_dataset(repo_id, dataset_name)
            names = list(cached)
    except Exception as error:  # noqa: BLE001 - whatever the reason, the dataset is not usable
        if not reachable:
            raise ValueError(f"{what} cannot be reached offline; {hub.DATASET_ALTERNATIVES}") from None
        raise ValueError(f"{what}: {hub.first_line(error)}") from None
    train_split, own_eval = _splits(names, dataset_split, what)

    def rows(split: str) -> Iterator[Any]:
        where = f"{what} split {split!r}"
        if cached is not None:
            yield from _table_texts(cached[split], text_field, where)
            return
        try:
            yield from _texts(datasets.load_dataset(repo_id, dataset_name, split=split, streaming=True),
                              text_field, where)
        except ValueError:
            raise
        except Exception as error:  # noqa: BLE001 - network and hub errors become one line
            raise ValueError(f"{where}: {hub.first_line(error)}") from None

    def documents() -> Iterator[Any]:
        if part == "eval":
            head = itertools.islice(rows(own_eval or train_split), STREAM_EVAL_DOCUMENTS)
            yield from head
            return
        skip = 0 if own_eval else STREAM_EVAL_DOCUMENTS
        yield from itertools.islice(rows(train_split), skip, None)

    return Corpus(repo_id, part, documents, max_tokens)
