"""TrainConfig (optimisation and step) and LoopConfig (the training program's outputs and loop), each setting
declared once (default, help, check); ``python -m nash_mhc.train`` generates its flags from these fields."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from nash_mhc.config import ConfigMethods
from nash_mhc.settings import (
    NON_NEGATIVE,
    NON_NEGATIVE_INT,
    POSITIVE,
    POSITIVE_INT,
    between,
    check_settings,
    setting,
)

SEED = (lambda v: NON_NEGATIVE_INT[0](v) and v < 2**63, "must be an integer in [0, 2**63)")  # jax.random.key's range


@dataclasses.dataclass(frozen=True)
class TrainConfig(ConfigMethods):
    """Optimiser, schedule and step settings (frozen, validated; ``TrainConfig()`` is valid).

    The two step counts: ``total_steps`` is where training stops (``--total-steps``); ``lr_schedule_steps`` is
    the length of the warmup + cosine schedule (default: ``total_steps``). Both are resolved here, so
    ``warmup_steps`` and ``lr_schedule_steps`` are never None after construction. One optimizer update takes
    ``batch_size`` sequences (all microbatches, all hosts), split into ``grad_accum_steps`` microbatches
    (strided split, token-weighted accumulation). The training program's ``--batch-size`` is the microbatch,
    so it sets ``batch_size = --batch-size x grad_accum_steps``.
    """

    # format-3 checkpoints carry these; they are ExecutionConfig's now (nash_mhc.execution)
    RETIRED: ClassVar[tuple[str, ...]] = ("remat", "loss_chunks")

    grad_accum_steps: int = setting(1, "microbatches per optimizer update (default: 1, or from "
                                       "--total-batch-tokens)", check=POSITIVE_INT)
    batch_size: int = setting(8, check=POSITIVE_INT)
    learning_rate: float = setting(1e-3, "peak learning rate", check=POSITIVE)
    min_lr_ratio: float = setting(0.1, "final learning rate / peak", check=between(0, 1))
    warmup_steps: int | None = setting(None, "linear warmup steps (default: 10% of the schedule, at most 1000)",
                                       check=NON_NEGATIVE_INT)
    total_steps: int = setting(1000, "optimizer updates to train for (where the run stops)", check=POSITIVE_INT)
    lr_schedule_steps: int | None = setting(None, "length of the cosine schedule (default: --total-steps); fix "
                                                  "it to stop early and resume on the same schedule",
                                            check=POSITIVE_INT)
    weight_decay: float = setting(0.1, "AdamW weight decay (parameters whose declared role is a matmul weight or an "
                                       "untied LM head)", check=NON_NEGATIVE)
    # Default 1: in both sweeps (docs/results/coefficient_lr*/results.md) every larger scale gave a worse held-out
    # loss, although the coefficients then travel about scale x further.
    coefficient_lr_scale: float = setting(1.0, "learning-rate multiplier of the coefficient group (mHC/HC alpha, "
                                               "biases and projection, mhc-lite logits, the aggregation prior, "
                                               "temperature and gate), which takes no weight decay",
                                          check=POSITIVE)
    beta1: float = setting(0.9, "AdamW beta1", check=between(0, 1, high_open=True))
    beta2: float = setting(0.95, "AdamW beta2", check=between(0, 1, high_open=True))
    eps: float = setting(1e-8, "AdamW epsilon", check=POSITIVE)
    grad_clip: float = setting(1.0, "global gradient-norm clip (0 disables)", check=NON_NEGATIVE)
    seed: int = setting(0, "seed of initialisation and data order", check=SEED)

    def __post_init__(self) -> None:
        check_settings(self)
        if self.lr_schedule_steps is None:
            object.__setattr__(self, "lr_schedule_steps", self.total_steps)
        if self.warmup_steps is None:
            object.__setattr__(self, "warmup_steps", max(1, min(1000, self.lr_schedule_steps // 10)))
        if self.warmup_steps > self.lr_schedule_steps:
            raise ValueError(f"TrainConfig: warmup_steps={self.warmup_steps} exceeds the schedule's "
                             f"lr_schedule_steps={self.lr_schedule_steps}")
        if self.batch_size % self.grad_accum_steps:
            raise ValueError(f"TrainConfig: batch_size={self.batch_size} must be divisible by "
                             f"grad_accum_steps={self.grad_accum_steps}")

    @property
    def microbatch_size(self) -> int:
        return self.batch_size // self.grad_accum_steps


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """The training program's outputs, resumption, logging, evaluation and loop guards."""

    checkpoint_dir: str = setting("runs/nash_mhc", "checkpoints, metrics.jsonl, TensorBoard and config.json "
                                                   "(a local directory or gs://...)")
    checkpoint_interval: int = setting(500, "steps between checkpoints", check=POSITIVE_INT)
    max_checkpoints: int = setting(3, "checkpoints to keep", check=POSITIVE_INT)
    resume_from: str | None = setting(None, "checkpoint directory (or step directory) to resume from")
    init_from: str | None = setting(None, "start from another run's weights with a fresh optimizer")
    allow_data_change: bool = setting(False, "resume although the tokenizer, dataset, learning-rate schedule, "
                                             "--seed or sequences per update (--batch-size x grad-accum-steps) "
                                             "differ from the checkpoint's (each difference is printed)")
    log_interval: int = setting(10, "steps between metric log lines", check=POSITIVE_INT)
    eval_interval: int = setting(0, "steps between evaluations (0: never)", check=NON_NEGATIVE_INT)
    eval_steps: int = setting(4, "batches per evaluation", check=POSITIVE_INT)
    max_nonfinite_steps: int = setting(10, "abort after this many consecutive non-finite losses",
                                       check=POSITIVE_INT)
    worker_buffer_size: int = setting(2, "batches the prefetch thread keeps ready", check=NON_NEGATIVE_INT)
    progress: bool = setting(True, "no tqdm progress bar")

    def __post_init__(self) -> None:
        check_settings(self)
        if self.resume_from and self.init_from:
            raise ValueError("give --resume-from or --init-from, not both")
