"""Exported models: ``model.safetensors`` + ``config.json`` (written by ``python -m nash_mhc.export``).

The export holds the model alone (no optimizer state, no Orbax): every array of the ``LanguageModel`` pytree in
``model.safetensors``, named by its tree path (``blocks.attn.wq``, ``embed.weight``: ``jax.tree_util.keystr``
with ``.`` separators, so parameters added later are exported without a list to update), and ``config.json``
(``{"format": "nash_mhc-export", "version", "model_format", "model_config", "tokenizer", "step", "data",
"seed", "nash_mhc_version", "checksums"}``; ``checksums``: the crc32c of every tensor's bytes, verified by
:func:`load_exported`; exports written before it have none). A Hugging Face tokenizer is saved beside them
(``tokenizer.json``, ``tokenizer_config.json``); the byte tokenizer is recorded by name.

:func:`load_exported` rebuilds the model from these files alone, on any device (JAX's default, or ``device``):
it imports the model code and ``safetensors``, not the training stack. ``python -m nash_mhc.generate`` and
``python -m nash_mhc.evaluate`` accept an export folder as ``--checkpoint-dir``. Needs the ``export`` extra
(``safetensors``).
"""

from __future__ import annotations

import json
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from nash_mhc import paths
from nash_mhc.config import ModelConfig
from nash_mhc.model import LanguageModel
from nash_mhc.model_format import FORMAT_CHANGES, MODEL_FORMAT

FORMAT, VERSION = "nash_mhc-export", 1
WEIGHTS, CONFIG = "model.safetensors", "config.json"

__all__ = ["ExportError", "crc32c", "export_model", "is_exported", "load_exported", "named_arrays", "read_config",
           "require_safetensors"]


class ExportError(ValueError):
    """An export folder that cannot be read, or an export that cannot be written (one-line message)."""


def require_safetensors() -> Any:
    try:
        import safetensors.numpy
    except ImportError:
        raise ExportError("exported models need the 'safetensors' package: pip install 'nash-mhc[export]'") from None
    return safetensors.numpy


def named_arrays(tree: Any) -> list[tuple[str, Any]]:
    """``(name, leaf)`` of every array leaf (arrays or ShapeDtypeStructs), named by tree path."""
    arrays = eqx.filter(tree, lambda x: isinstance(x, jax.Array | jax.ShapeDtypeStruct | np.ndarray))
    leaves = jax.tree_util.tree_flatten_with_path(arrays)[0]
    return [(jax.tree_util.keystr(path, simple=True, separator="."), leaf) for path, leaf in leaves]


def crc32c(tensor: np.ndarray, chunk_bytes: int = 1 << 22) -> int:
    """crc32c (``google-crc32c``, what GCS uses) of ``tensor``'s C-order bytes, fed in chunks (its C function
    takes only ``bytes``: one copy of a large tensor at once costs more than the hashing)."""
    import google_crc32c

    flat = np.ascontiguousarray(tensor).reshape(-1).view(np.uint8)
    crc = 0
    for start in range(0, flat.size, chunk_bytes):
        crc = google_crc32c.extend(crc, flat[start:start + chunk_bytes].tobytes())
    return crc


def is_exported(directory: paths.PathLike) -> bool:
    """Whether ``directory`` holds a ``config.json`` (of any kind) and ``model.safetensors``."""
    try:
        path = paths.as_path(directory)
        return (path / CONFIG).is_file() and (path / WEIGHTS).is_file()
    except (ValueError, OSError):
        return False


def read_config(directory: paths.PathLike) -> dict[str, Any]:
    """The export's ``config.json``; :class:`ExportError` for another format or model format."""
    path = paths.as_path(directory) / CONFIG
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ExportError(f"cannot read {path}: {error}") from None
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        found = config.get("format", "no 'format' key") if isinstance(config, dict) else type(config).__name__
        raise ExportError(f"{path} is not a nash_mhc export (format {found!r}, expected {FORMAT!r}); export a "
                          "checkpoint with python -m nash_mhc.export")
    if config.get("model_format") != MODEL_FORMAT:
        found = config.get("model_format")
        why = FORMAT_CHANGES.get(found, "it was written by a newer nash_mhc") if isinstance(found, int) else ""
        raise ExportError(f"{path} has model format {found!r}, this nash_mhc reads format {MODEL_FORMAT}: {why}")
    if config.get("version") != VERSION:
        raise ExportError(f"{path}: export version {config.get('version')!r} is not supported (expected {VERSION})")
    return config


def load_exported(directory: paths.PathLike, *, device: jax.Device | None = None) -> LanguageModel:
    """The ``LanguageModel`` of an export folder, its arrays on ``device`` (default: JAX's default device).

    Every array of the model built from ``config.json``'s ``model_config`` is read from ``model.safetensors``
    by tree path, with its shape and dtype checked; a missing or extra tensor is an :class:`ExportError`."""
    config = read_config(directory)
    try:
        model_config = ModelConfig.from_dict(config["model_config"])
    except (KeyError, TypeError, ValueError) as error:
        raise ExportError(f"{directory}/{CONFIG}: model_config: {error}") from None
    template = eqx.filter_eval_shape(LanguageModel, model_config, key=jax.random.key(0))
    weights = paths.as_path(directory) / WEIGHTS
    try:
        tensors = require_safetensors().load(weights.read_bytes())
    except ExportError:
        raise
    except Exception as error:  # noqa: BLE001 - safetensors' error text is the useful part
        raise ExportError(f"cannot read {weights}: {str(error).splitlines()[0] if str(error) else error}") from None
    named = named_arrays(template)
    missing = [name for name, _ in named if name not in tensors]
    extra = sorted(set(tensors) - {name for name, _ in named})
    if missing or extra:
        raise ExportError(f"{weights} does not fit the model of its config.json: missing {missing[:3]}, "
                          f"unexpected {extra[:3]}")
    values, recorded = {}, config.get("checksums", {})
    for name, leaf in named:
        tensor = tensors[name]
        if tuple(tensor.shape) != tuple(leaf.shape) or tensor.dtype != leaf.dtype:
            raise ExportError(f"{weights}: {name} is {tensor.dtype}{list(tensor.shape)}, the model expects "
                              f"{leaf.dtype}{list(leaf.shape)}")
        if name in recorded and crc32c(tensor) != recorded[name]:
            raise ExportError(f"{weights} is corrupt: crc32c of {name} differs from the one recorded at export")
        values[name] = jax.device_put(tensor, device) if device is not None else jnp.asarray(tensor)
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: values[jax.tree_util.keystr(path, simple=True, separator=".")]
        if isinstance(leaf, jax.ShapeDtypeStruct) else leaf, template)


def _save_tokenizer(tokenizer: Any, out: paths.Path) -> str:
    """What ``config.json`` records as the tokenizer; a Hugging Face one is written into ``out``."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None:
        return tokenizer.name  # "bytes"
    (out / "tokenizer.json").write_text(backend.to_str())
    special = {kind: backend.id_to_token(getattr(tokenizer, f"{kind}_id"))
               for kind in ("eos", "bos", "pad") if getattr(tokenizer, f"{kind}_id") < tokenizer.base_vocab_size}
    (out / "tokenizer_config.json").write_text(json.dumps({f"{k}_token": v for k, v in special.items()}) + "\n")
    return "tokenizer.json"


def export_model(model: LanguageModel, tokenizer: Any, out: paths.PathLike, *, step: int = 0,
                 meta: dict[str, Any] | None = None) -> paths.Path:
    """Write ``model`` (its arrays gathered to the host) and its config and tokenizer into the new or empty
    folder ``out``; returns it. ``meta`` is the checkpoint's record (its data and seed are kept)."""
    st = require_safetensors()
    directory = paths.as_path(out)
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise ExportError(f"--out {out} already exists and is not an empty directory (nothing was changed)")
    tensors = {name: np.asarray(jax.device_get(leaf)) for name, leaf in named_arrays(model)}
    directory.mkdir(parents=True, exist_ok=True)
    meta = meta or {}
    config = {"format": FORMAT, "version": VERSION, "model_format": MODEL_FORMAT,
              "model_config": model.config.to_dict(), "tokenizer": _save_tokenizer(tokenizer, directory),
              "step": step, "data": meta.get("data", {}), "seed": meta.get("train_config", {}).get("seed", 0),
              "nash_mhc_version": _version(), "checksums": {name: crc32c(t) for name, t in tensors.items()}}
    (directory / WEIGHTS).write_bytes(st.save(tensors, metadata={"format": FORMAT, "model_format": str(MODEL_FORMAT)}))
    (directory / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")  # last: marks it complete
    return directory


def _version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("nash-mhc")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that is not installed
        return "unknown"
