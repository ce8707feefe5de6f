"""Loading a trained model: ``load_model(dir)`` reads a training run's metadata (model and train config,
tokenizer, dataset) and restores only the model, onto one device or, given a ``mesh``, sharded over it by the
training sharding rules (:mod:`nash_mhc.sharding`), so a model that does not fit one device can be evaluated
and sampled. ``python -m nash_mhc.generate`` and ``python -m nash_mhc.evaluate`` start here; their
``--mesh-data/--mesh-fsdp/--mesh-tp`` flags choose the mesh (none given: one device)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nash_mhc import exported, paths
from nash_mhc.cli import Checkpoint, CompileCache, SettingsParser
from nash_mhc.config import ModelConfig
from nash_mhc.data import DataConfig, Tokenizer, get_tokenizer
from nash_mhc.model import LanguageModel
from nash_mhc.sharding import MeshConfig, make_mesh, partition_specs
from nash_mhc.tpu_compile.fit import abstract_train_state
from nash_mhc.training.checkpoint import Checkpointer, CheckpointError, find_checkpoint, saved_model_config
from nash_mhc.training.config import TrainConfig
from nash_mhc.training.state import init_train_state

__all__ = ["LoadedModel", "load_from_flags", "load_model"]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A model restored from a checkpoint (or, ``untrained``, its step-0 initialisation) and its context."""

    model: LanguageModel
    config: ModelConfig
    tokenizer: Tokenizer
    step: int
    meta: dict[str, Any]
    mesh: Mesh  # where the model's arrays live

    def data_config(self, **changes: Any) -> DataConfig:
        """How the run read its data (dataset, tokenizer, Hugging Face configuration and split, text field)."""
        data = self.meta.get("data", {})
        names = {"dataset": "dataset", "tokenizer": "tokenizer", "dataset_name": "dataset_name",
                 "split": "dataset_split", "text_field": "text_field", "max_stream_tokens": "max_stream_tokens",
                 "prompt_field": "prompt_field", "response_field": "response_field"}
        return DataConfig(**{field: data[key] for key, field in names.items() if key in data}, **changes)

    @property
    def seed(self) -> int:
        return int(self.meta.get("train_config", {}).get("seed", 0))


def load_model(checkpoint_dir: str, *, step: int | None = None, untrained: bool = False,
               tokenizer: str | None = None, mesh: Mesh | None = None) -> LoadedModel:
    """Restore the model of a training run's checkpoint onto the first device (a one-device mesh), or onto
    ``mesh`` with the parameters placed as training places them (their declared logical axes,
    :mod:`nash_mhc.sharding`). Only the model's arrays are read, not the optimizer state.

    ``checkpoint_dir`` is a run directory (its latest step, or ``step``) or one step directory inside it.
    ``untrained=True`` returns the run's initialisation instead (same config and seed as its step 0), the
    baseline an evaluation compares against. ``tokenizer`` replaces the one the run recorded (same vocabulary
    size required; for a run whose tokenizer was given by a path that no longer resolves). Raises
    :class:`CheckpointError` (a ``ValueError``) with a one-line message when the directory holds no usable
    checkpoint. An export folder (:mod:`nash_mhc.exported`) loads too: its one model, no ``step``/``untrained``.
    """
    if exported.is_exported(checkpoint_dir):
        return _load_export(checkpoint_dir, step=step, untrained=untrained, tokenizer=tokenizer, mesh=mesh)
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
            model_config = ModelConfig.from_dict(saved_model_config(meta["model_config"]))
            train_config = TrainConfig.from_dict(meta["train_config"])
            if tokenizer is not None:
                meta = {**meta, "data": {**meta["data"], "tokenizer": tokenizer}}
            tokenizer = get_tokenizer(meta["data"]["tokenizer"])
        except KeyError as error:
            raise CheckpointError(f"checkpoint metadata at {directory}/{step} lacks {error}") from error
        except (TypeError, ValueError) as error:  # a field of another version, a value no config accepts
            raise CheckpointError(f"checkpoint metadata at {directory}/{step}: {error}") from error
        if tokenizer.vocab_size != model_config.vocab_size:
            raise CheckpointError(f"tokenizer {meta['data']['tokenizer']} has {tokenizer.vocab_size} ids, the model "
                                  f"at {directory}/{step} was trained with {model_config.vocab_size}")
        key = jax.random.key(train_config.seed)
        if mesh is not None:  # sharded by the training rules: the TrainState's own placement
            if untrained:
                model = init_train_state(model_config, train_config, mesh, key=key).model
                step = 0
            else:
                model = checkpointer.restore_model(step, abstract_train_state(model_config, train_config, mesh))
            return LoadedModel(model=model, config=model.config, tokenizer=tokenizer, step=step, meta=meta,
                               mesh=mesh)
        mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
        if untrained:
            model = eqx.filter_jit(lambda k: LanguageModel(model_config, key=k))(key)
            step = 0
        else:
            # An abstract TrainState (no initialisation is run) placed whole on one device is the template.
            replicated = NamedSharding(mesh, PartitionSpec())
            abstract = eqx.filter_eval_shape(init_train_state, model_config, train_config, mesh, key=key)
            template = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated)
                if isinstance(x, jax.ShapeDtypeStruct) else x, abstract)
            model = checkpointer.restore_model(step, template)
            # Uncommitted default-device arrays, like a freshly built model's (jit treats both alike).
            model = jax.tree.map(lambda a: jnp.asarray(jax.device_get(a)), model)
    finally:
        checkpointer.close()
    return LoadedModel(model=model, config=model.config, tokenizer=tokenizer, step=step, meta=meta, mesh=mesh)


def _load_export(directory: str, *, step: int | None, untrained: bool, tokenizer: str | None,
                 mesh: Mesh | None) -> LoadedModel:
    """An export folder as a :class:`LoadedModel` (on one device, or placed on ``mesh`` by the training rules)."""
    config = exported.read_config(directory)
    if untrained or (step is not None and step != config.get("step")):
        raise CheckpointError(f"{directory} is an exported model (step {config.get('step')}): --step and "
                              "--untrained need the training run's checkpoint directory")
    model = exported.load_exported(directory, device=None if mesh is not None else jax.devices()[0])
    spec = tokenizer or (config["tokenizer"] if config["tokenizer"] == "bytes"
                         else str(paths.as_path(directory) / config["tokenizer"]))
    loaded_tokenizer = get_tokenizer(spec)
    if loaded_tokenizer.vocab_size != model.config.vocab_size:
        raise CheckpointError(f"tokenizer {spec} has {loaded_tokenizer.vocab_size} ids, the model at {directory} "
                              f"was trained with {model.config.vocab_size}")
    if mesh is None:
        mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    else:
        arrays, static = eqx.partition(model, eqx.is_array)
        arrays = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), arrays,
                              partition_specs(arrays, mesh))
        model = eqx.combine(arrays, static)
    meta = {"data": {**config.get("data", {}), "tokenizer": spec}, "train_config": {"seed": config.get("seed", 0)}}
    return LoadedModel(model=model, config=model.config, tokenizer=loaded_tokenizer, step=int(config["step"]),
                       meta=meta, mesh=mesh)


def load_from_flags(parser: SettingsParser, argv: list[str] | None, settings: type[T]) -> tuple[T, LoadedModel]:
    """What ``generate`` and ``evaluate`` start with: their ``settings`` (checked before anything is loaded)
    and the model of the run ``--checkpoint-dir``/``--step``/``--untrained`` name, on one device or, when a
    ``--mesh-*`` flag is given, on that mesh over all devices; with the compile cache on."""
    given = parser.given(argv)
    checkpoint, config = parser.build(Checkpoint, given), parser.build(settings, given)
    mesh = parser.build(MeshConfig, given).make() if parser.values(MeshConfig, given) else None
    logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's read-only notices
    parser.build(CompileCache, given).use()
    return config, load_model(checkpoint.checkpoint_dir, step=checkpoint.step, untrained=checkpoint.untrained,
                              tokenizer=checkpoint.tokenizer, mesh=mesh)
