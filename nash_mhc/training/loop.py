"""The training program's imperative shell: set-up (:func:`prepare`) and the loop (:func:`train`).

``prepare`` validates everything a user can get wrong (mesh, batch, data, checkpoint) and raises
``ValueError`` subclasses with one-line messages (the CLI turns them into exit code 2). ``train`` is one plain
``while`` loop around the jitted ``train_step``: batches come from a prefetch thread as a function of
(seed, step); the metrics of step s are read only after step s+1 has been dispatched (:class:`MetricsReader`,
so logging never stalls the device) and end the run when the loss stays non-finite; checkpoints, evaluations
and a SIGTERM/SIGINT (finish the step, save, exit 0) are hooks between steps.
"""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import sys
import time
from typing import Any, NamedTuple

import equinox as eqx
import jax
import numpy as np

from nash_mhc import hardware, paths
from nash_mhc.config import ModelConfig, describe
from nash_mhc.data import DataConfig, PackedDataset, Prefetcher, Tokenizer, open_windows
from nash_mhc.sharding import MeshConfig, batch_shards, sharding_summary
from nash_mhc.training.checkpoint import Checkpointer, CheckpointError, config_differences, find_checkpoint
from nash_mhc.training.config import RunConfig, TrainConfig
from nash_mhc.training.evaluation import evaluate
from nash_mhc.training.logger import RunLogger
from nash_mhc.training.state import Batch, TrainState, init_train_state
from nash_mhc.training.step import train_step
from nash_mhc.training.throughput import device_peak, mfu

EXIT_OK, EXIT_NONFINITE = 0, 3


class Configs(NamedTuple):
    """Every setting of one training run (the training program builds them from its flags)."""

    model: ModelConfig
    train: TrainConfig
    data: DataConfig
    mesh: MeshConfig
    run: RunConfig


@dataclasses.dataclass
class Session:
    """Everything :func:`train` needs, built and validated by :func:`prepare`. The mesh is ``state.mesh``."""

    configs: Configs
    state: TrainState
    start_step: int
    train_data: PackedDataset
    eval_data: PackedDataset
    tokenizer: Tokenizer
    checkpointer: Checkpointer
    logger: RunLogger
    peak_flops: float
    summary: list[str]

    def host_batch(self, step: int) -> np.ndarray:
        """This process's rows of the global batch of ``step``."""
        return self.train_data.batch_at(step, global_batch=self.configs.train.batch_size,
                                        process_index=jax.process_index(), process_count=jax.process_count())

    def meta(self, step: int) -> dict[str, Any]:
        """The JSON record saved with the checkpoint of ``step``."""
        model, train, data = self.configs.model, self.configs.train, self.configs.data
        return {"step": step, "rng": {"seed": train.seed}, "model_config": model.to_dict(),
                "train_config": train.to_dict(), "mesh": dict(self.state.mesh.shape), "jax_version": jax.__version__,
                "data": {"dataset": data.dataset, "tokenizer": data.tokenizer, "next_step": step,
                         "dataset_name": data.dataset_name, "split": data.dataset_split, "text_field": data.text_field,
                         "max_stream_tokens": data.max_stream_tokens, "samples_seen": step * train.batch_size}}


def _open_checkpoint(path: str) -> tuple[Checkpointer, int, dict[str, Any]]:
    """The read-only checkpointer, step and metadata behind ``--resume-from``/``--init-from``."""
    directory, step = find_checkpoint(path)
    source = Checkpointer(directory, read_only=True)
    step = source.latest_step() if step is None else step
    if step is None:
        raise CheckpointError(f"no complete checkpoint found in {directory}")
    return source, step, source.read_meta(step)


def prepare(configs: Configs) -> Session:
    """Build mesh, data, state (fresh or restored) and outputs; raises ValueError on bad input."""
    model_config, train_config, data_config, mesh_config, run = configs
    devices = hardware.init_devices()  # HardwareError (a ValueError) when JAX_PLATFORMS cannot be honoured
    mesh = mesh_config.make()
    if train_config.microbatch_size % batch_shards(mesh):
        raise ValueError(f"batch size {train_config.microbatch_size} sequences per microbatch is not divisible by "
                         f"data*fsdp = {batch_shards(mesh)}")
    if train_config.batch_size % jax.process_count():
        raise ValueError(f"{train_config.batch_size} sequences per update are not divisible by the "
                         f"{jax.process_count()} processes")
    tokenizer = data_config.load_tokenizer()
    train_data, eval_data = (open_windows(data_config, part, tokenizer, model_config.seq_len, train_config.seed)
                             for part in ("train", "eval"))
    model_config = model_config.replace(vocab_size=tokenizer.vocab_size)
    configs = configs._replace(model=model_config)

    directory = paths.as_path(run.checkpoint_dir)  # a local path or a bucket URI (gs://...)
    checkpointer = Checkpointer(directory, max_to_keep=run.max_checkpoints)
    resume = _open_checkpoint(run.resume_from) if run.resume_from else None
    if resume is None and checkpointer.latest_step() is not None:
        resume = (checkpointer, checkpointer.latest_step(), checkpointer.read_meta(checkpointer.latest_step()))
    source = resume or (_open_checkpoint(run.init_from) if run.init_from else None)
    if source is not None:
        saved = source[2].get("model_config", {})
        differ = config_differences(saved, model_config)
        if differ:
            detail = ", ".join(f"{k}: checkpoint {saved[k]!r} vs now {getattr(model_config, k)!r}" for k in differ)
            raise CheckpointError(f"model config differs from the checkpoint's ({detail})")

    state = init_train_state(model_config, train_config, mesh, key=jax.random.key(train_config.seed))
    start_step = int(resume[2]["step"]) if resume else 0
    if source is not None:
        restored = source[0].restore(source[1], state)
        state = restored if resume else eqx.tree_at(lambda s: s.model, state, restored.model)  # init: weights only
    is_main = jax.process_index() == 0
    logger = RunLogger(directory, enabled=is_main, total_steps=train_config.total_steps, start_step=start_step,
                       progress=run.progress)
    peak, peak_source = device_peak()
    summary = [
        *hardware.summary_lines(devices),
        *sharding_summary(state.model, mesh),
        f"model: {describe(model_config)}",
        f"tokens per update: {train_config.batch_size * model_config.seq_len:,} ({train_config.batch_size} x "
        f"{model_config.seq_len}), accumulation steps: {train_config.grad_accum_steps}",
        f"data: {data_config.dataset} / {data_config.tokenizer}: {train_data.num_tokens:,} train tokens, "
        f"{eval_data.num_tokens:,} eval tokens",
        f"peak FLOP/s per device: {peak / 1e9:,.1f} GFLOP/s ({peak_source})",
        f"resuming from step {start_step}" if resume else
        (f"initialised from {run.init_from}" if run.init_from else "fresh start"),
    ]
    if is_main:
        directory.mkdir(parents=True, exist_ok=True)
        resolved = {f"{name}_config": dataclasses.asdict(config) for name, config in configs._asdict().items()}
        (directory / "config.json").write_text(json.dumps({**resolved, "mesh": dict(mesh.shape)}, indent=2,
                                                          sort_keys=True) + "\n")
    return Session(configs, state, start_step, train_data, eval_data, tokenizer, checkpointer, logger, peak,
                   summary)


class Diverged(Exception):
    """The loss or the gradients stayed non-finite for ``--max-nonfinite-steps`` steps in a row."""


class MetricsReader:
    """Reads each step's metrics one step late (the device is already busy with the next one), times the steps,
    logs every ``--log-interval`` and raises :class:`Diverged` after too many non-finite steps in a row."""

    def __init__(self, session: Session) -> None:
        self.session, self.pending = session, None
        self.nonfinite = 0
        self.compiled = False
        self.window_time = self.window_steps = 0.0
        self.restart_clock()

    def restart_clock(self) -> None:
        """Start timing afresh (after a pause that is not training: evaluation)."""
        self.last = time.perf_counter()

    def push(self, step: int, metrics: dict[str, jax.Array]) -> None:
        """Hold the metrics of ``step`` (just dispatched) and read those of the step before."""
        self.flush()
        self.pending = (step, metrics)

    def flush(self) -> None:
        """Read the held metrics now (before a checkpoint, an evaluation or the end)."""
        if self.pending is not None:
            step, metrics = self.pending
            self.pending = None
            self._read(step, {k: float(np.asarray(v)) for k, v in jax.device_get(metrics).items()})

    def _read(self, step: int, values: dict[str, float]) -> None:
        session, run = self.session, self.session.configs.run
        now = time.perf_counter()
        elapsed, self.last = now - self.last, now
        if not self.compiled:  # the first step's time is mostly compilation
            self.compiled = True
            session.logger.scalar("train/compile_time_s", elapsed, step)
        else:
            self.window_time, self.window_steps = self.window_time + elapsed, self.window_steps + 1
        finite = math.isfinite(values["loss"]) and not values.get("skipped", 0.0)  # skipped: grads non-finite
        self.nonfinite = 0 if finite else self.nonfinite + 1
        if step % run.log_interval == 0 or step == session.configs.train.total_steps or \
                step == session.start_step + 1:
            self._log(step, values, self.window_time / self.window_steps if self.window_steps else elapsed)
        if self.nonfinite >= run.max_nonfinite_steps:
            raise Diverged(f"error: loss or gradients were not finite for {self.nonfinite} steps in a row (last at "
                           f"step {step}); stopping without saving")

    def _log(self, step: int, values: dict[str, float], step_time: float) -> None:
        session, model = self.session, self.session.configs.model
        tokens_per_second = session.configs.train.batch_size * model.seq_len / step_time
        utilisation = mfu(tokens_per_second, model.flops_per_token(), session.peak_flops, len(jax.devices()))
        session.logger.write({"step": step, **{k: v for k, v in values.items() if k != "tokens"},
                              "tokens_per_second": tokens_per_second, "mfu": utilisation, "step_time_s": step_time})
        session.logger.progress(step, values["loss"], tokens_per_second)
        self.window_time = self.window_steps = 0.0


class StopSignal:
    """Records SIGTERM/SIGINT (and, on pods, the preemption notice) so the loop can save and exit cleanly."""

    def __enter__(self) -> StopSignal:
        self.received: int | None = None
        self.previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}
        return self

    def _handle(self, signum: int, _frame: Any) -> None:
        self.received = signum

    def requested(self, step: int) -> bool:
        return self.received is not None or _preemption_reached(step)

    def __exit__(self, *exc_info: object) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _preemption_reached(step: int) -> bool:
    if jax.process_count() == 1:
        return False
    try:
        from jax.experimental import multihost_utils

        return bool(multihost_utils.reached_preemption_sync_point(step))
    except Exception:  # noqa: BLE001 - the preemption service is only present on some platforms
        return False


def eval_record(session: Session, state: TrainState) -> dict[str, float]:
    """The training program's evaluation: ``--eval-steps`` microbatches of held-out windows."""
    result = evaluate(state.model, session.eval_data, session.tokenizer, num_batches=session.configs.run.eval_steps,
                      batch_size=session.configs.train.microbatch_size)
    return {"eval_loss": result.loss, "eval_ppl": result.perplexity, "eval_aux_loss": result.aux_loss,
            "eval_bpb": result.bits_per_byte}


def train(session: Session) -> int:
    """Run from ``session.start_step`` to ``total_steps``; returns the process exit code."""
    run, end, logger = session.configs.run, session.configs.train.total_steps, session.logger
    for line in session.summary:
        logger.message(line)
    state, step, metrics = session.state, session.start_step, MetricsReader(session)
    try:
        with jax.set_mesh(state.mesh), StopSignal() as stop, \
                Prefetcher(session.host_batch, step, run.worker_buffer_size) as batches:  # the run's ambient mesh
            while step < end:
                state, step_metrics = train_step(state, Batch(tokens=batches.next()[1]))
                step += 1
                metrics.push(step, step_metrics)
                stopping = stop.requested(step)
                if step % run.checkpoint_interval == 0 or stopping or step == end:
                    metrics.flush()
                    session.checkpointer.save(step, state, session.meta(step))
                if run.eval_interval and step % run.eval_interval == 0:
                    metrics.flush()
                    logger.write({"step": step, **eval_record(session, state)})
                    metrics.restart_clock()
                if stopping:
                    logger.message(f"stopping at step {step} after a {'signal' if stop.received else 'preemption'};"
                                   " checkpoint saved")
                    break
            metrics.flush()
    except Diverged as error:
        print(error, file=sys.stderr)
        return EXIT_NONFINITE
    finally:
        session.checkpointer.wait()
        logger.close()
        session.checkpointer.close()
    if session.start_step >= end:
        print(f"nothing to do: the checkpoint is at step {session.start_step} >= total steps {end}", file=sys.stderr)
    return EXIT_OK
