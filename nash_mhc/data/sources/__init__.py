"""Where the text comes from: one registry (:func:`open_source`) over one small module per kind of dataset.

A dataset has two parts, ``"train"`` and the held-out ``"eval"`` (not to be confused with ``dataset_split``,
the named split of a Hugging Face dataset, e.g. ``"validation"``). :func:`open_source` resolves a name to
a :class:`Corpus` (documents in a fixed order, tokenised by :mod:`nash_mhc.data.encode`) or, for prepared
shards, a :class:`~nash_mhc.data.prepared.PreparedSplit` (tokens already on disk):

- ``"stdlib"`` (also ``"default"``): the ``.py`` files of the running Python's standard library
  (:mod:`.stdlib`); ``"synthetic"``: a seeded word grammar (:mod:`.synthetic`);
- a local path: prepared shards (``index.json``), a ``save_to_disk`` directory (:mod:`.arrow`), or
  ``.txt``/``.jsonl``/``.json``/``.parquet`` files (:mod:`.files`);
- a bucket URI (``gs://...``): prepared shards (read by byte range) or those files (:mod:`nash_mhc.data.remote`);
- anything else shaped like ``org/name``: a Hugging Face hub dataset (:mod:`.arrow`), streamed up to
  ``max_stream_tokens`` tokens (that deterministic prefix is what is trained on).

Held-out part, the same on every host and run: the dataset's own ``validation``/``valid``/``val``/``test``
split when it has one; else the documents whose stable hash falls below ``EVAL_FRACTION`` (at least one each
way; a single document is cut at a line break near its end); for a hub stream, its first documents.
"""

from __future__ import annotations

from pathlib import Path

from nash_mhc import paths
from nash_mhc.data import hub, prepared, remote
from nash_mhc.data.sft import FIELD_FLAGS, Fields
from nash_mhc.data.sources import arrow, files, stdlib, synthetic
from nash_mhc.data.sources.base import EVAL_FRACTION, PARTS, Corpus, check_part, held_out, stable_fraction

__all__ = ["EVAL_FRACTION", "PARTS", "Corpus", "held_out", "open_source", "stable_fraction"]


# ------------------------------------------------------------------------------------------------ registry
def _only_named(kind: str, name: str, dataset_name: str | None, dataset_split: str, *, splits: bool = False) -> None:
    """One-line errors for ``--dataset-name``/``--split`` on kinds of dataset that have no such thing."""
    if dataset_name:
        raise ValueError(f"--dataset-name only applies to Hugging Face hub datasets, not {kind} {name!r}")
    if dataset_split != "train" and not splits:
        raise ValueError(f"--split {dataset_split!r}: {kind} {name!r} has no named splits (train uses 'train'; eval "
                         "uses a held-out split automatically)")


def _no_pairs(kind: str, name: str, text_field: Fields) -> None:
    if not isinstance(text_field, str):
        raise ValueError(f"{FIELD_FLAGS}: {kind} {name!r} has no prompt/response records (use a .jsonl/.json/"
                         ".parquet file or folder, or a datasets dataset)")


def _bucket_source(name: str, part: str, dataset_name: str | None, dataset_split: str,
                   text_field: Fields) -> Corpus | prepared.PreparedSplit:
    """Prepared shards or data files in a bucket (``gs://...``)."""
    root = paths.as_path(name.rstrip("/"))
    if not root.exists():
        raise ValueError(f"dataset path {name!r} does not exist")
    _only_named("bucket dataset", name, dataset_name, dataset_split)
    if prepared.is_prepared(root):
        _no_pairs("prepared shards", name, text_field)
        return prepared.PreparedSplit(root, part, name)
    if arrow.is_saved_dataset(root):
        raise ValueError(f"dataset {name!r}: a save_to_disk directory is not read from a bucket; prepare shards "
                         "from it (python -m nash_mhc.data.prepare --out gs://...) or copy it locally")
    return files.corpus(root, name, part, text_field)


def open_source(name: str, part: str, seed: int = 0, *, dataset_name: str | None = None,
                dataset_split: str = "train", text_field: Fields = "text",
                max_stream_tokens: int | None = None) -> Corpus | prepared.PreparedSplit:
    """Part ``part`` of dataset ``name`` (see the module docstring); a one-line ``ValueError`` for anything
    unusable (unknown or unreachable dataset, missing path, split or text field, empty corpus). ``text_field``
    may be a (prompt, response) field pair (:mod:`nash_mhc.data.sft`): the corpus then yields pairs."""
    check_part(part)
    if name in ("stdlib", "default", "synthetic"):
        _only_named("the offline corpus", name, dataset_name, dataset_split)
        _no_pairs("the offline corpus", name, text_field)
        return synthetic.corpus(part, seed) if name == "synthetic" else stdlib.corpus(part)
    if remote.is_remote(name):
        return _bucket_source(name, part, dataset_name, dataset_split, text_field)
    path = Path(name).expanduser()
    if path.exists():
        root = path.resolve()
        if prepared.is_prepared(root):
            _only_named("prepared shards", name, dataset_name, dataset_split)
            _no_pairs("prepared shards", name, text_field)
            return prepared.PreparedSplit(root, part, name)
        if arrow.is_saved_dataset(root):
            _only_named("the saved dataset", name, dataset_name, dataset_split, splits=True)
            return arrow.saved_corpus(root, name, part, dataset_split, text_field)
        _only_named("local dataset", name, dataset_name, dataset_split)
        return files.corpus(root, name, part, text_field)
    if not hub.looks_like_hub_id(name):
        raise ValueError(f"dataset path {name!r} does not exist")
    return arrow.hub_corpus(name, part, dataset_name, dataset_split, text_field,
                            max_stream_tokens if part == "train" else None)
