"""One training run's settings: :class:`RunConfig` nests the model, execution, optimisation, data, mesh and loop
configs. The training program builds it from its flags (``nash_mhc.train.configs``), the run's ``config.json``
records it (:meth:`RunConfig.to_dict`) and readers get it back (:meth:`RunConfig.from_dict`). Each setting is still
declared once, in the config it belongs to."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, ClassVar

from nash_mhc.config import ConfigMethods, ModelConfig, config_from_dict
from nash_mhc.data import DataConfig
from nash_mhc.execution import ExecutionConfig
from nash_mhc.sharding.mesh import MeshConfig
from nash_mhc.training.config import LoopConfig, TrainConfig


@dataclasses.dataclass(frozen=True)
class RunConfig(ConfigMethods):
    """Every setting of one training run (frozen; ``RunConfig(model)`` takes every other config's defaults).
    ``execution`` is resolved (its None fields filled, :meth:`ExecutionConfig.for_preset`) and checked against
    ``model``: the run's steps are traced under ``execution.use()``."""

    # config.json's key of each field; the loop's is "run_config", its key since before LoopConfig had that name
    KEYS: ClassVar[dict[str, str]] = {"model": "model_config", "execution": "execution_config",
                                      "train": "train_config", "data": "data_config", "mesh": "mesh_config",
                                      "loop": "run_config"}

    model: ModelConfig
    execution: ExecutionConfig = dataclasses.field(default_factory=ExecutionConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    loop: LoopConfig = dataclasses.field(default_factory=LoopConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "execution", self.execution.for_preset(None))
        self.execution.check(self.model.num_layers, self.model.seq_len)

    def to_dict(self) -> dict[str, Any]:
        """``{"model_config": {...}, "execution_config": {...}, ...}`` (:attr:`KEYS`), as ``config.json`` holds it."""
        return {key: dataclasses.asdict(getattr(self, name)) for name, key in self.KEYS.items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        """From :meth:`to_dict`'s form (a ``config.json``; other keys, e.g. its ``mesh``, are ignored). A section
        an older run did not write takes its config's defaults; retired fields are dropped (format-3 runs')."""
        kinds = typing.get_type_hints(cls)  # {"model": ModelConfig, ...}
        given = {name: config_from_dict(kinds[name], data[key]) for name, key in cls.KEYS.items() if key in data}
        if "model" not in given:
            raise ValueError("a run's config has no model_config")
        return cls(**given)
