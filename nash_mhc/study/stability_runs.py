"""One run of the stability study: its settings, and its training in this process with gain probes."""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from nash_mhc.config import ModelConfig
from nash_mhc.model import num_params
from nash_mhc.study.runner import ChildRunner
from nash_mhc.study.sinkhorn_probe import make_probe
from nash_mhc.study.variants import ATTENTIONS


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every run of one stability study shares (kept in ``<out>/study.json``)."""

    model: str
    d_model: int | None
    attention: str
    steps: int
    batch_size: int
    warmup_steps: int
    weight_decay: float
    grad_clip: float
    coefficient_lr_scale: float
    dataset: str
    probes: int
    probe_batch: int
    max_nonfinite_steps: int
    seq_len: int | None = None  # None: the preset's (older studies' study.json has no such key)
    eval_batches: int = 0  # held-out batches of batch_size read at the end (0: none)

    def probe_steps(self) -> list[int]:
        return sorted({round(i * self.steps / (self.probes - 1)) for i in range(self.probes)})


@dataclasses.dataclass(frozen=True)
class Run:
    residual: str
    depth: int
    learning_rate: float
    seed: int

    @property
    def setting(self) -> str:
        return f"L{self.depth}-lr{self.learning_rate:g}"

    def path(self, out: Path) -> Path:
        return out / "runs" / self.setting / f"{self.residual}-seed{self.seed}.json"


def model_config(settings: Settings, run: Run, vocab_size: int) -> ModelConfig:
    size = {"d_model": settings.d_model} if settings.d_model else {}
    size |= {"seq_len": settings.seq_len} if settings.seq_len else {}
    return ModelConfig.preset(settings.model, residual=run.residual, num_layers=run.depth, vocab_size=vocab_size,
                              **ATTENTIONS[settings.attention], **size)


def train_run(settings: Settings, run: Run, runner: ChildRunner) -> dict[str, Any] | None:
    """Train one run, probing the gains; its record, or None when a signal cut it short."""
    import jax
    import jax.numpy as jnp

    from nash_mhc import TrainConfig, make_mesh
    from nash_mhc.data import make_datasets
    from nash_mhc.training import Batch, init_train_state, train_step
    from nash_mhc.training.evaluation import evaluate

    seq_len = settings.seq_len or ModelConfig.preset(settings.model).seq_len
    train_data, _, tokenizer = make_datasets(settings.dataset, "bytes", seq_len, seed=run.seed)
    # held-out windows, the same for every run: the probe batch (batch 0 of probe_batch sequences), and the
    # final evaluation's batches 1.. of batch_size sequences (disjoint from the probe's)
    _, probe_data, _ = make_datasets(settings.dataset, "bytes", seq_len, seed=0)
    probe_tokens = jnp.asarray(probe_data.batch_at(0, global_batch=settings.probe_batch)[:, :-1])
    config = model_config(settings, run, tokenizer.vocab_size)
    train_config = TrainConfig(batch_size=settings.batch_size, learning_rate=run.learning_rate,
                               warmup_steps=settings.warmup_steps, total_steps=settings.steps,
                               weight_decay=settings.weight_decay, grad_clip=settings.grad_clip, seed=run.seed,
                               coefficient_lr_scale=settings.coefficient_lr_scale)
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    state = init_train_state(config, train_config, mesh, key=jax.random.key(run.seed))
    probe = make_probe(run.residual)

    probes: dict[int, dict[str, list[float]]] = {}
    losses: list[float] = []
    grad_norms: list[float] = []
    step_times: list[float] = []
    nonfinite: list[int] = []
    in_a_row = 0
    start = time.perf_counter()
    probe_at = settings.probe_steps()
    for step in range(settings.steps + 1):
        if runner.stopped:
            return None
        if step in probe_at or in_a_row >= settings.max_nonfinite_steps or step == settings.steps:
            probes[step] = probe(state.model, probe_tokens)
        if step == settings.steps or in_a_row >= settings.max_nonfinite_steps:
            break
        tick = time.perf_counter()
        batch = Batch(tokens=train_data.batch_at(step, global_batch=settings.batch_size))
        state, metrics = train_step(state, batch)
        values = jax.device_get({k: metrics[k] for k in ("loss", "grad_norm", "skipped")})
        step_times.append(time.perf_counter() - tick)
        loss, grad_norm = float(values["loss"]), float(values["grad_norm"])
        losses.append(loss)
        grad_norms.append(grad_norm)
        bad = not (math.isfinite(loss) and math.isfinite(grad_norm)) or float(values["skipped"]) > 0
        in_a_row = in_a_row + 1 if bad else 0
        if bad:
            nonfinite.append(step + 1)
    diverged = in_a_row >= settings.max_nonfinite_steps
    held_out = {}
    if settings.eval_batches and not diverged:
        result = evaluate(state.model, probe_data, tokenizer, batch_size=settings.batch_size,
                          num_batches=settings.eval_batches, first_batch=1, mesh=mesh)
        held_out = {"eval_loss": result.loss, "eval_bits_per_byte": result.bits_per_byte,
                    "eval_tokens": result.tokens}
    return {**dataclasses.asdict(run), "status": "diverged" if diverged else "finished", **held_out,
            "steps_done": len(losses), "loss": losses, "grad_norm": grad_norms, "nonfinite_steps": nonfinite,
            "probes": {str(k): v for k, v in sorted(probes.items())}, "params": num_params(config),
            "step_time_s": float(np.median(step_times[1:] or step_times)),
            "wall_s": time.perf_counter() - start}
