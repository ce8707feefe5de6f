"""TrainConfig: the optimisation and step settings (frozen, validated, every field defaulted)."""

from __future__ import annotations

import dataclasses
from typing import Any

from nash_mhc.config import REMAT_POLICIES, ConfigMethods


@dataclasses.dataclass(frozen=True)
class TrainConfig(ConfigMethods):
    """Optimiser, schedule and step settings.

    batch_size: global batch in sequences per optimizer step (all microbatches, all hosts); it must divide
      by ``grad_accum_steps``. The step itself takes whatever batch it is given; the training program sizes
      batches by this field.
    learning_rate / min_lr_ratio / warmup_steps / total_steps: linear warmup from ``lr/warmup`` to ``lr``
      over ``warmup_steps``, then cosine decay to ``lr * min_lr_ratio`` at ``total_steps`` (held after).
    weight_decay, beta1, beta2, eps: AdamW (decoupled decay, matrices only; see ``training.optim``).
    grad_clip: global-norm clipping threshold (0 disables clipping).
    grad_accum_steps: microbatches per step (strided split, token-weighted accumulation).
    seed: initialisation seed (the training program derives its PRNG key from it).
    remat: ``None`` keeps ``ModelConfig.remat``; ``"none" | "full" | "dots"`` overrides it for training.
    """

    batch_size: int = 32
    learning_rate: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    total_steps: int = 10_000
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    grad_accum_steps: int = 1
    seed: int = 0
    remat: str | None = None

    def __post_init__(self) -> None:
        def fail(msg: str) -> None:
            raise ValueError(f"TrainConfig: {msg}")

        def is_int(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        for name in ("batch_size", "total_steps", "grad_accum_steps"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                fail(f"{name} must be a positive integer, got {value!r}")
        for name in ("warmup_steps", "seed"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                fail(f"{name} must be a non-negative integer, got {value!r}")
        for name in ("learning_rate", "min_lr_ratio", "weight_decay", "beta1", "beta2", "eps", "grad_clip"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or value != value:
                fail(f"{name} must be a number, got {value!r}")
        if self.learning_rate <= 0:
            fail(f"learning_rate must be > 0, got {self.learning_rate}")
        if not 0 <= self.min_lr_ratio <= 1:
            fail(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.warmup_steps > self.total_steps:
            fail(f"warmup_steps={self.warmup_steps} exceeds total_steps={self.total_steps}")
        if self.weight_decay < 0:
            fail(f"weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                fail(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.eps <= 0:
            fail(f"eps must be > 0, got {self.eps}")
        if self.grad_clip < 0:
            fail(f"grad_clip must be >= 0 (0 disables clipping), got {self.grad_clip}")
        if self.batch_size % self.grad_accum_steps:
            fail(f"batch_size={self.batch_size} must be divisible by grad_accum_steps={self.grad_accum_steps}")
        if self.remat is not None and self.remat not in REMAT_POLICIES:
            fail(f"unknown remat {self.remat!r}; choose one of {', '.join(REMAT_POLICIES)} (or None)")

    @property
    def microbatch_size(self) -> int:
        return self.batch_size // self.grad_accum_steps

