"""``python -m nash_mhc.export --checkpoint-dir D --out DIR``: a trained model as ``model.safetensors`` +
``config.json`` (+ its tokenizer), readable without the training stack by ``nash_mhc.load_exported(DIR)``.

Reads the latest (or ``--step``) checkpoint of a training run (:func:`nash_mhc.inference.load_model`) and writes
the model alone: the format is :mod:`nash_mhc.exported`. ``--out`` must be new or empty (a local folder or
``gs://...``). Needs the ``export`` extra (``safetensors``). Exit codes: 0 written, 2 bad arguments or inputs
(one line on stderr).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

import numpy as np

from nash_mhc.exported import export_model, named_arrays, require_safetensors
from nash_mhc.settings import setting


@dataclasses.dataclass(frozen=True)
class ExportConfig:
    """Where the export goes."""

    out: str = setting(help="new (or empty) folder for model.safetensors, config.json and the tokenizer (a local "
                            "path or gs://...)")


def build_parser() -> Any:
    from nash_mhc.cli import Checkpoint, SettingsParser

    parser = SettingsParser("python -m nash_mhc.export", __doc__)
    parser.add_settings(Checkpoint, only=("checkpoint_dir", "step", "tokenizer"))
    parser.add_settings(ExportConfig)
    return parser


def main(argv: list[str] | None = None) -> int:
    import logging

    from nash_mhc.cli import Checkpoint, fail
    from nash_mhc.inference import load_model
    from nash_mhc.platforms import select_platform

    select_platform()  # before anything starts a JAX backend
    parser = build_parser()
    given = parser.given(argv)
    try:
        checkpoint, config = parser.build(Checkpoint, given), parser.build(ExportConfig, given)
        require_safetensors()  # before the checkpoint is read
        logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's read-only notices
        loaded = load_model(checkpoint.checkpoint_dir, step=checkpoint.step, tokenizer=checkpoint.tokenizer)
        out = export_model(loaded.model, loaded.tokenizer, config.out, step=loaded.step, meta=loaded.meta)
    except (ValueError, OSError) as error:
        return fail(error)
    count = sum(int(np.prod(leaf.shape)) for _, leaf in named_arrays(loaded.model))
    print(json.dumps({"out": str(out), "step": loaded.step, "parameters": count, "tensors":
                      len(named_arrays(loaded.model)), "tokenizer": loaded.tokenizer.name}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
