"""The training program's imperative shell: set-up (:func:`prepare`) and the loop (:func:`train`).

``prepare`` validates everything a user can get wrong (mesh, batch, data, checkpoint) and raises
``ValueError`` subclasses with one-line messages (the CLI turns them into exit code 2). ``train`` is one plain
``while`` loop around the jitted ``train_step``: batches come from a prefetch thread as a function of
(seed, step); the metrics of step s are read only after step s+1 has been dispatched (:class:`MetricsReader`,
so logging never stalls the device) and end the run when the loss stays non-finite; checkpoints, evaluations
and a SIGTERM/SIGINT (finish the step, save, exit 0) are hooks between steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import time
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from nash_mhc import hardware, paths
from nash_mhc.config import ModelConfig
from nash_mhc.data import DataConfig, PackedDataset, Prefetcher, Tokenizer, open_windows
from nash_mhc.model import describe
from nash_mhc.sharding import MeshConfig, batch_shards, sharding_summary
from nash_mhc.training.checkpoint import Checkpointer, CheckpointError, config_differences, find_checkpoint
from nash_mhc.training.config import RunConfig, TrainConfig
from nash_mhc.training.evaluation import evaluate
from nash_mhc.training.logger import RunLogger
from nash_mhc.training.optim import make_schedule
from nash_mhc.training.resume import (
    SCHEDULE_FIELDS,
    absolute_spec,
    identity_differences,
    restore_newest,
    run_identity,
    set_aside,
)
from nash_mhc.training.run_lock import RunLock
from nash_mhc.training.state import Batch, TrainState, init_train_state, with_model
from nash_mhc.training.step import train_step
from nash_mhc.training.throughput import MFUMeter

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
    meter: MFUMeter
    summary: list[str]
    lock: RunLock | None
    identity: dict[str, Any]  # the data and schedule this run trains on (resume.run_identity)
    last_saved: int | None  # the newest checkpoint step in the directory (None: none yet)

    def host_batch(self, step: int) -> Batch:
        """This process's rows of the global batch of ``step`` (and their loss mask, for prompt/response data)."""
        return Batch(**self.train_data.arrays_at(step, global_batch=self.configs.train.batch_size,
                                                 process_index=jax.process_index(), process_count=jax.process_count()))

    def meta(self, step: int) -> dict[str, Any]:
        """The JSON record saved with the checkpoint of ``step``."""
        model, train, data = self.configs.model, self.configs.train, self.configs.data
        return {"step": step, "rng": {"seed": train.seed}, "model_config": model.to_dict(),
                "train_config": train.to_dict(), "mesh": dict(self.state.mesh.shape), "jax_version": jax.__version__,
                "run": self.identity,
                "data": {"dataset": absolute_spec(data.dataset), "tokenizer": absolute_spec(data.tokenizer),
                         "next_step": step,
                         "dataset_name": data.dataset_name, "split": data.dataset_split, **data.fields_record(),
                         "max_stream_tokens": data.max_stream_tokens, "samples_seen": step * train.batch_size}}


def _source(path: str) -> tuple[Checkpointer, list[int]]:
    """The read-only checkpointer and candidate steps behind ``--resume-from``/``--init-from``: the one step a
    step directory names, or every complete step of a run directory (newest first is tried first)."""
    directory, step = find_checkpoint(path)
    source = Checkpointer(directory, read_only=True)
    steps = [step] if step is not None else source.all_steps()
    if not steps:
        source.close()
        raise CheckpointError(f"no complete checkpoint found in {directory}")
    return source, steps


def _check_directory(directory: paths.Path) -> None:
    """One-line errors, before any work, for a ``--checkpoint-dir`` that cannot be a directory (a file, or under
    one) or cannot be created (read-only filesystem, no permission): a missing one is created and removed."""
    if paths.is_remote(directory):
        return
    missing = []
    for parent in (directory, *directory.parents):
        if parent.exists():
            if not parent.is_dir():
                raise CheckpointError(f"--checkpoint-dir {directory}: {parent} is a file, not a directory")
            break
        missing.append(parent)
    if missing and jax.process_index() == 0:  # one probe per run (the hosts may share the filesystem)
        _make_directory(directory)
        for created in missing:  # deepest first: nothing is left behind
            with contextlib.suppress(OSError):
                created.rmdir()


def _make_directory(directory: paths.Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CheckpointError(f"cannot create --checkpoint-dir {directory}: {error.strerror or error}") from None


def _lock(directory: paths.Path) -> RunLock | None:
    """Process 0 holds the directory's lock (every host of one run shares it)."""
    if jax.process_index() != 0:
        return None
    try:
        return RunLock(directory)
    except OSError as error:
        raise CheckpointError(f"cannot write to --checkpoint-dir {directory}: {error.strerror or error}") from None


def _restore(configs: Configs, identity: dict[str, Any], state: TrainState, source: Checkpointer,
             steps: list[int], resume: bool) -> tuple[int, dict[str, Any], TrainState, list[str]]:
    """Restore the newest of ``steps`` that reads, fits this run's model (else CheckpointError at once) and, when
    resuming, its data and schedule (unless ``--allow-data-change``); returns (step, meta, state, notes)."""
    model_config, notes = configs.model, []

    def attempt(step: int) -> tuple[dict[str, Any], TrainState]:
        meta = source.read_meta(step)
        saved = meta.get("model_config", {})
        differ = config_differences(saved, model_config)
        if differ:
            detail = ", ".join(f"{k}: checkpoint {saved[k]!r} vs now {getattr(model_config, k, 'no such field')!r}"
                               for k in differ)
            raise ValueError(f"model config differs from the checkpoint's ({detail})")
        if resume:
            changes = identity_differences(meta.get("run", {}), identity)
            if changes and not configs.run.allow_data_change:
                raise ValueError(f"the run differs from checkpoint step {step}'s ({'; '.join(changes)}); pass "
                                 "--allow-data-change to resume anyway")
            if changes:
                notes.append(f"warning: resuming with changes allowed by --allow-data-change: {'; '.join(changes)}")
                before = TrainConfig.from_dict(meta["train_config"])
                if any(getattr(before, k) != getattr(configs.train, k) for k in SCHEDULE_FIELDS):
                    notes.append(f"learning rate at step {step}: {float(make_schedule(before)(step)):.4g} before, "
                                 f"{float(make_schedule(configs.train)(step)):.4g} now")
        return meta, source.restore(step, state)

    step, (meta, restored), skipped = restore_newest(steps, attempt, str(source.directory))
    if skipped:
        notes.insert(0, f"warning: skipped checkpoint {'; '.join(skipped)}; it is left in place")
    return step, meta, restored, notes


def prepare(configs: Configs) -> Session:
    """Build mesh, data, state (fresh or restored) and outputs; raises ValueError on bad input.

    Nothing is created in ``--checkpoint-dir`` until every check has passed; an existing directory is locked
    (:class:`RunLock`) before it is read, so two runs never share it."""
    model_config, train_config, data_config, mesh_config, run = configs
    devices = hardware.init_devices()  # HardwareError (a ValueError) when JAX_PLATFORMS cannot be honoured
    mesh = mesh_config.make()
    if train_config.microbatch_size % batch_shards(mesh):
        raise ValueError(f"batch size {train_config.microbatch_size} sequences per microbatch is not divisible by "
                         f"data*fsdp = {batch_shards(mesh)}")
    if train_config.batch_size % jax.process_count():
        raise ValueError(f"{train_config.batch_size} sequences per update are not divisible by the "
                         f"{jax.process_count()} processes")
    directory = paths.as_path(run.checkpoint_dir)  # a local path or a bucket URI (gs://...)
    _check_directory(directory)
    tokenizer = data_config.load_tokenizer()
    train_data, eval_data = (open_windows(data_config, part, tokenizer, model_config.seq_len, train_config.seed)
                             for part in ("train", "eval"))
    model_config = model_config.replace(vocab_size=tokenizer.vocab_size)
    configs = configs._replace(model=model_config)
    identity = run_identity(data_config, tokenizer, train_config)

    lock, source = (_lock(directory) if directory.exists() else None), None
    try:
        own = Checkpointer(directory, read_only=True) if directory.exists() else None
        own_steps = own.all_steps() if own is not None else []
        if run.resume_from:
            source, steps = _source(run.resume_from)
        elif own_steps:
            source, steps, own = own, own_steps, None
        elif run.init_from:
            source, steps = _source(run.init_from)
        if own is not None:
            own.close()
        resume = bool(run.resume_from) or bool(own_steps)
        state = init_train_state(model_config, train_config, mesh, key=jax.random.key(train_config.seed))
        start_step, notes = 0, []
        if source is not None:
            step, meta, restored, notes = _restore(configs, identity, state, source, steps, resume)
            source.close()
            source = None
            if resume:
                state, start_step = restored, int(meta["step"])
            else:
                state = with_model(state, restored.model)  # init: weights only
        is_main = jax.process_index() == 0
        _make_directory(directory)
        if lock is None:
            lock = _lock(directory)
        if is_main:
            aside = set_aside(directory, start_step, own_steps)
            if aside is not None:
                notes.append(f"set aside the checkpoints and metrics after step {start_step} in {aside}")
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("nash_mhc set aside")
        checkpointer = Checkpointer(directory, max_to_keep=run.max_checkpoints)
    except BaseException:
        if source is not None:
            source.close()
        if lock is not None:
            lock.release()
        raise
    logger = RunLogger(directory, enabled=is_main, total_steps=train_config.total_steps, start_step=start_step,
                       progress=run.progress)
    meter = MFUMeter.for_device(model_config.flops_per_token(), len(jax.devices()), dtype=model_config.dtype)
    summary = [
        *hardware.summary_lines(devices),
        *sharding_summary(state.model, mesh),
        f"model: {describe(model_config)}",
        f"tokens per update: {train_config.batch_size * model_config.seq_len:,} ({train_config.batch_size} x "
        f"{model_config.seq_len}), accumulation steps: {train_config.grad_accum_steps}",
        f"data: {data_config.dataset} / {data_config.tokenizer}: {train_data.num_tokens:,} train tokens, "
        f"{eval_data.num_tokens:,} eval tokens",
        f"peak FLOP/s per device: {meter.peak / 1e9:,.1f} GFLOP/s ({meter.source})",
        *notes,
        f"resuming from step {start_step}" if resume else
        (f"initialised from {run.init_from}" if run.init_from else "fresh start"),
    ]
    if is_main:
        resolved = {f"{name}_config": dataclasses.asdict(config) for name, config in configs._asdict().items()}
        (directory / "config.json").write_text(json.dumps({**resolved, "mesh": dict(mesh.shape)}, indent=2,
                                                          sort_keys=True) + "\n")
    return Session(configs, state, start_step, train_data, eval_data, tokenizer, checkpointer, logger, meter,
                   summary, lock, identity, start_step if resume else None)


class Diverged(Exception):
    """The loss or the gradients stayed non-finite for ``--max-nonfinite-steps`` steps in a row."""


class MetricsReader:
    """Reads each step's metrics one step late (the device is already busy with the next one), times the steps,
    logs every ``--log-interval`` and raises :class:`Diverged` after too many non-finite steps in a row.

    Throughput counts training only: the first step (compilation) reports none, a log step is read as soon as
    it completes (no later step in flight), so a window's time covers exactly its steps, and the clock
    restarts after every pause that is not a step (checkpoint, evaluation). Tokens/s and MFU come from the
    session's :class:`MFUMeter` (one peak for the run), the definition the benchmarks use."""

    def __init__(self, session: Session) -> None:
        self.session, self.pending = session, None
        self.nonfinite = 0
        self.compiled = False
        self.window_time = self.window_steps = 0.0
        self.restart_clock()

    def restart_clock(self) -> None:
        """Start timing afresh (after a pause that is not training: a checkpoint, an evaluation)."""
        self.last = time.perf_counter()

    def logs(self, step: int) -> bool:
        """Whether ``step`` gets a log line (every ``--log-interval``, the first and the last step)."""
        session = self.session
        return (step % session.configs.run.log_interval == 0 or step == session.configs.train.total_steps
                or step == session.start_step + 1)

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
        if self.logs(step):
            self._log(step, values)
        if self.nonfinite >= run.max_nonfinite_steps:
            kept = (f"the newest checkpoint is step {session.last_saved}, the last finite one" if session.last_saved
                    is not None else "no checkpoint was saved")
            raise Diverged(f"error: loss or gradients were not finite for {self.nonfinite} steps in a row (last at "
                           f"step {step}); stopping: {kept}")

    def _log(self, step: int, values: dict[str, float]) -> None:
        session, model = self.session, self.session.configs.model
        figures = {"tokens_per_second": math.nan, "mfu": math.nan, "step_time_s": math.nan}
        if self.window_steps:
            figures = session.meter.report(session.configs.train.batch_size * model.seq_len,
                                           self.window_time / self.window_steps)
        session.logger.write({"step": step, **{k: v for k, v in values.items() if k != "tokens"}, **figures})
        session.logger.progress(step, values["loss"], figures["tokens_per_second"])
        self.window_time = self.window_steps = 0.0
        self.restart_clock()


class StopSignal:
    """Records SIGTERM/SIGINT (and, on pods, the preemption notice) so the loop can save and exit cleanly."""

    def __enter__(self) -> StopSignal:
        self.received: int | None = None
        self.previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}
        return self

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.received is not None:  # a second signal: stop now, as without a handler
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.received = signum
        print("stopping after this step (send the signal again to stop at once)", file=sys.stderr, flush=True)

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


@jax.jit
def _all_finite(arrays: list[jax.Array]) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(a)) for a in arrays]))


def _save_if_finite(session: Session, step: int, state: TrainState, metrics: MetricsReader) -> None:
    """Save ``state`` at ``step`` unless a non-finite streak is running or the state itself is not finite, so
    rotation (``--max-checkpoints``) never deletes a good checkpoint to keep a broken one."""
    arrays = [a for a in jax.tree.leaves(eqx.filter(state, eqx.is_inexact_array))]
    if metrics.nonfinite or not bool(_all_finite(arrays)):
        session.logger.message(f"step {step}: not saving a checkpoint, the loss or the state is not finite")
        return
    session.checkpointer.save(step, state, session.meta(step))
    session.last_saved = step


def train(session: Session, step_fn: Any = train_step) -> int:
    """Run from ``session.start_step`` to ``total_steps`` with ``step_fn`` (or a wrapper); returns the exit code."""
    run, end, logger = session.configs.run, session.configs.train.total_steps, session.logger
    for line in session.summary:
        logger.message(line)
    state, step, metrics = session.state, session.start_step, MetricsReader(session)
    try:
        with jax.set_mesh(state.mesh), StopSignal() as stop, \
                Prefetcher(session.host_batch, step, run.worker_buffer_size) as batches:  # the run's ambient mesh
            while step < end:
                state, step_metrics = step_fn(state, batches.next()[1])
                step += 1
                metrics.push(step, step_metrics)
                if metrics.logs(step):  # read now: the window's time then covers exactly its steps
                    metrics.flush()
                stopping = stop.requested(step)
                if step % run.checkpoint_interval == 0 or stopping or step == end:
                    metrics.flush()
                    _save_if_finite(session, step, state, metrics)
                    metrics.restart_clock()
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
        if session.lock is not None:
            session.lock.release()
    if session.start_step >= end:
        print(f"nothing to do: the checkpoint is at step {session.start_step} >= total steps {end}", file=sys.stderr)
    return EXIT_OK
