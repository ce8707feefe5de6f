"""Using a trained model: load it from a training run's checkpoint, and evaluate it on held-out text.

``load_model(dir)`` reads the run's metadata (model/train config, tokenizer) and restores only what is
needed onto one device; ``evaluate_model`` reports the token-weighted cross-entropy, perplexity and
bits per byte (tokenizer-independent: total nats / ln 2 / UTF-8 bytes of the predicted text).
Both ``python -m nash_mhc.generate`` and ``python -m nash_mhc.evaluate`` are thin shells around this module.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, Float, Int, Integer

from nash_mhc.config import ModelConfig
from nash_mhc.data import ByteTokenizer, PackedDataset, Tokenizer, get_tokenizer, load_source, token_stream
from nash_mhc.model import LanguageModel
from nash_mhc.sharding import make_mesh
from nash_mhc.training.checkpoint import Checkpointer, CheckpointError, find_checkpoint
from nash_mhc.training.config import TrainConfig
from nash_mhc.training.state import init_train_state

__all__ = ["EvalResult", "LoadedModel", "count_bytes", "eval_dataset", "evaluate_model", "load_model"]


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A model restored from a checkpoint (or, ``untrained``, its step-0 initialisation) and its context."""

    model: LanguageModel
    config: ModelConfig
    tokenizer: Tokenizer
    step: int
    meta: dict[str, Any]

    @property
    def dataset(self) -> str:
        """The dataset the run trained on."""
        return str(self.meta.get("data", {}).get("dataset", "stdlib"))

    @property
    def seed(self) -> int:
        return int(self.meta.get("train_config", {}).get("seed", 0))

    @property
    def source_options(self) -> dict[str, Any]:
        """How the run read its dataset (Hugging Face configuration/split, text field, ...): load_source kwargs."""
        data = self.meta.get("data", {})
        names = {"dataset_name": "dataset_name", "split": "dataset_split", "text_field": "text_field",
                 "max_stream_tokens": "max_stream_tokens"}
        return {option: data[key] for key, option in names.items() if key in data}


def load_model(checkpoint_dir: str, *, step: int | None = None, untrained: bool = False) -> LoadedModel:
    """Restore the model of a training run's checkpoint onto the first device.

    ``checkpoint_dir`` is a run directory (its latest step, or ``step``) or one step directory inside it.
    ``untrained=True`` returns the run's initialisation instead (same config and seed as its step 0), the
    baseline an evaluation compares against. Raises :class:`CheckpointError` (a ``ValueError``) with a
    one-line message when the directory holds no usable checkpoint.
    """
    directory, dir_step = find_checkpoint(checkpoint_dir)
    if step is None:
        step = dir_step
    checkpointer = Checkpointer(directory, read_only=True)
    try:
        steps = checkpointer.all_steps()
        if not steps:
            raise CheckpointError(f"no complete checkpoint found in {directory}")
        step = max(steps) if step is None else step
        if step not in steps:
            raise CheckpointError(f"no checkpoint at step {step} in {directory} (have {sorted(steps)})")
        meta = checkpointer.read_meta(step)
        try:
            model_config = ModelConfig.from_dict(meta["model_config"])
            train_config = TrainConfig.from_dict(meta["train_config"])
            tokenizer = get_tokenizer(meta["data"]["tokenizer"])
        except (KeyError, TypeError) as error:
            raise CheckpointError(f"checkpoint metadata at {directory}/{step} lacks {error}") from error
        key = jax.random.key(train_config.seed)
        if untrained:
            model = eqx.filter_jit(lambda k: LanguageModel(model_config, key=k))(key)
            step = 0
        else:
            # An abstract TrainState (no initialisation is run) placed whole on one device is the template.
            mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
            replicated = NamedSharding(mesh, PartitionSpec())
            abstract = eqx.filter_eval_shape(init_train_state, model_config, train_config, mesh, key=key)
            template = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated)
                if isinstance(x, jax.ShapeDtypeStruct) else x, abstract)
            model = checkpointer.restore(step, template).model
            # Uncommitted default-device arrays, like a freshly built model's (jit treats both alike).
            model = jax.tree.map(lambda a: jnp.asarray(jax.device_get(a)), model)
    finally:
        checkpointer.close()
    return LoadedModel(model=model, config=model.config, tokenizer=tokenizer, step=step, meta=meta)


# ------------------------------------------------------------------------------------------------ evaluation
def count_bytes(tokenizer: Tokenizer, ids: Integer[np.ndarray, "*batch seq"]) -> int:
    """UTF-8 bytes of the text that ``ids`` stand for (special tokens count 0).

    Uses the tokenizer's own ``num_bytes(ids)`` when it has one; the byte tokenizer's ids < 256 are one byte
    each; otherwise each row is decoded and its UTF-8 length counted.
    """
    ids = np.asarray(ids)
    own = getattr(tokenizer, "num_bytes", None)
    if callable(own):
        return int(own(ids))
    if isinstance(tokenizer, ByteTokenizer):
        return int(np.count_nonzero((ids >= 0) & (ids < 256)))
    rows = ids.reshape(-1, ids.shape[-1]) if ids.ndim else ids.reshape(1, 1)
    return sum(len(tokenizer.decode(row).encode("utf-8")) for row in rows)


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """loss: mean cross-entropy per predicted token (nats); perplexity = exp(loss);
    bits_per_byte = total nats / ln 2 / bytes (the UTF-8 bytes of the predicted tokens)."""

    loss: float
    perplexity: float
    bits_per_byte: float
    tokens: int
    bytes: int
    batches: int

    def to_dict(self) -> dict[str, float | int]:
        return dataclasses.asdict(self)


@eqx.filter_jit
def _token_nll(model: LanguageModel, tokens: Int[Array, "batch window"]) -> Float[Array, "batch seq"]:
    """Cross-entropy (nats) of every next-token prediction of a batch of windows [B, T+1]."""
    logits = model(tokens[:, :-1]).logits.astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


def eval_dataset(dataset: str, tokenizer: Tokenizer, seq_len: int, *, seed: int = 0, split: str = "eval",
                 **source_options: Any) -> Any:
    """One split (default: the held-out ``eval`` split) of ``dataset`` cut into windows of seq_len + 1.

    The same windows as the training program's eval set (:func:`nash_mhc.data.make_datasets`), without
    building the training split. ``source_options`` go to :func:`nash_mhc.data.load_source` (a run's own
    are :attr:`LoadedModel.source_options`).
    """
    source = load_source(dataset, split, seed, **source_options)
    packed = getattr(source, "packed_dataset", None)
    if packed is not None:  # prepared shards: memory-mapped windows
        return packed(tokenizer, seq_len, seed=seed)
    return PackedDataset(token_stream(source, tokenizer), seq_len, seed=seed, vocab_size=tokenizer.vocab_size,
                         name=f"{source.name}/{split}")


def evaluate_model(model: LanguageModel, dataset: Any, tokenizer: Tokenizer, *, batch_size: int = 8,
                   num_batches: int | None = 16) -> EvalResult:
    """Token-weighted mean cross-entropy of ``model`` over ``num_batches`` batches of ``dataset``.

    ``dataset`` is any windowed dataset of the data pipeline (``num_windows``, ``batch_at(i, global_batch=)``).
    Batches are the dataset's fixed, seed-determined windows, none repeated: ``num_batches`` is capped at one
    pass, and ``None``/0 means the whole split. Sums are accumulated on the host in float64.
    """
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    if num_batches is not None and num_batches < 0:
        raise ValueError(f"number of batches must be >= 0 (0: the whole split), got {num_batches}")
    batch_size = min(batch_size, dataset.num_windows)
    available = dataset.num_windows // batch_size
    count = available if not num_batches else min(num_batches, available)
    total_nats = 0.0
    tokens = num_bytes = 0
    for i in range(count):
        batch = dataset.batch_at(i, global_batch=batch_size)
        nll = np.asarray(_token_nll(model, jnp.asarray(batch)), np.float64)
        total_nats += float(nll.sum())
        tokens += nll.size
        num_bytes += count_bytes(tokenizer, batch[:, 1:])
    loss = total_nats / max(tokens, 1)
    return EvalResult(loss=loss, perplexity=math.exp(min(loss, 700.0)),
                      bits_per_byte=total_nats / math.log(2) / max(num_bytes, 1), tokens=tokens, bytes=num_bytes,
                      batches=count)
