"""A training run's set-up: :func:`prepare` validates everything a user can get wrong (mesh, batch, data,
checkpoint) in small steps, each callable on its own, and builds the :class:`Session` the loop runs.

Errors are ``ValueError`` subclasses with one-line messages (the CLI turns them into exit code 2).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from typing import Any

import jax
from jax.sharding import Mesh

from nash_mhc import exported, hardware, paths
from nash_mhc.data import DataConfig, NoWindows, PackedDataset, Tokenizer, open_windows
from nash_mhc.data.windows import skipped_text
from nash_mhc.model import describe
from nash_mhc.run_config import RunConfig
from nash_mhc.sharding import batch_shards, sharding_summary
from nash_mhc.training.checkpoint import (
    Checkpointer,
    CheckpointError,
    config_differences,
    find_checkpoint,
    saved_model_config,
)
from nash_mhc.training.config import TrainConfig
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
from nash_mhc.training.throughput import MFUMeter, device_peak


@dataclasses.dataclass
class Session:
    """Everything :func:`train` needs, built and validated by :func:`prepare`. The mesh is ``state.mesh``."""

    run_config: RunConfig
    state: TrainState
    start_step: int
    train_data: PackedDataset
    eval_data: PackedDataset | None  # None: the held-out part fills no window (and --eval-interval is 0)
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
        return Batch(**self.train_data.arrays_at(step, global_batch=self.run_config.train.batch_size,
                                                 process_index=jax.process_index(), process_count=jax.process_count()))

    def meta(self, step: int) -> dict[str, Any]:
        """The JSON record saved with the checkpoint of ``step``."""
        model, train, data = self.run_config.model, self.run_config.train, self.run_config.data
        return {"step": step, "rng": {"seed": train.seed}, "model_config": model.to_dict(),
                "train_config": train.to_dict(), "mesh": dict(self.state.mesh.shape), "jax_version": jax.__version__,
                "run": self.identity,
                "data": {"dataset": absolute_spec(data.dataset), "tokenizer": absolute_spec(data.tokenizer),
                         "next_step": step,
                         "dataset_name": data.dataset_name, "split": data.dataset_split, **data.fields_record(),
                         "max_stream_tokens": data.max_stream_tokens, "samples_seen": step * train.batch_size}}


def _source(path: str, flag: str) -> tuple[Checkpointer, list[int]]:
    """The read-only checkpointer and candidate steps behind ``--resume-from``/``--init-from`` (``flag``): the one
    step a step directory names, or every complete step of a run directory (newest first is tried first)."""
    if exported.is_exported(path):  # weights alone: no training state to restore
        raise CheckpointError(f"{flag} {path} is an exported model (model.safetensors + config.json, for generate, "
                              "evaluate and load_exported), not a training checkpoint; give the training run "
                              "directory it was exported from")
    directory, step = find_checkpoint(path)
    source = Checkpointer(directory, read_only=True)
    steps = [step] if step is not None else source.all_steps()
    if not steps:
        source.close()
        raise CheckpointError(f"no complete checkpoint found in {directory}")
    return source, steps


def _check_directory(directory: paths.Path) -> None:
    """One-line errors, before any work, for a ``--checkpoint-dir`` that cannot be a directory (a file, or under
    one) or cannot be created (read-only filesystem, no permission): a missing one is created and removed. A
    bucket's directory needs the bucket to exist (nothing is created in a bucket here)."""
    if paths.is_remote(directory):
        paths.check_bucket(directory)
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
            # os.rmdir removes only an empty directory, atomically: another run started beside this one may have
            # made its own directory in a parent meanwhile (epath's rmdir lists, then removes the whole tree).
            with contextlib.suppress(OSError):
                os.rmdir(created)


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


def _restore(run_config: RunConfig, identity: dict[str, Any], state: TrainState, source: Checkpointer,
             steps: list[int], resume: bool, own: bool) -> tuple[int, dict[str, Any], TrainState, list[str]]:
    """Restore the newest of ``steps`` that reads, fits this run's model (else CheckpointError at once) and, when
    resuming, its data and schedule (unless ``--allow-data-change``); returns (step, meta, state, notes).
    ``own``: ``source`` is the run's own directory, whose steps after the one restored are set aside."""
    model_config, notes = run_config.model, []

    def attempt(step: int) -> tuple[dict[str, Any], TrainState]:
        meta = source.read_meta(step)
        saved = saved_model_config(meta.get("model_config", {}))
        differ = config_differences(saved, model_config)
        if differ:
            detail = ", ".join(f"{k}: checkpoint {saved[k]!r} vs now {getattr(model_config, k, 'no such field')!r}"
                               for k in differ)
            raise ValueError(f"model config differs from the checkpoint's ({detail})")
        if resume:
            changes = identity_differences(meta.get("run", {}), identity)
            if changes and not run_config.loop.allow_data_change:
                raise ValueError(f"the run differs from checkpoint step {step}'s ({'; '.join(changes)}); pass "
                                 "--allow-data-change to resume anyway")
            if changes:
                notes.append(f"warning: resuming with changes allowed by --allow-data-change: {'; '.join(changes)}")
                before = TrainConfig.from_dict(meta["train_config"])
                if any(getattr(before, k) != getattr(run_config.train, k) for k in SCHEDULE_FIELDS):
                    notes.append(f"learning rate at step {step}: {float(make_schedule(before)(step)):.4g} before, "
                                 f"{float(make_schedule(run_config.train)(step)):.4g} now")
        return meta, source.restore(step, state)

    step, (meta, restored), skipped = restore_newest(steps, attempt, str(source.directory))
    if skipped:
        kept = f"set aside with the steps after step {step}" if own else "left in place"
        notes.insert(0, f"warning: skipped checkpoint {'; '.join(skipped)}; not deleted: "
                        f"{'they are' if len(skipped) > 1 else 'it is'} {kept}")
    return step, meta, restored, notes


def check_batch(train_config: TrainConfig, mesh: Mesh) -> None:
    """One-line errors for a batch the mesh's data x fsdp shards or the processes cannot split evenly."""
    if train_config.microbatch_size % batch_shards(mesh):
        raise ValueError(f"batch size {train_config.microbatch_size} sequences per microbatch is not divisible by "
                         f"data*fsdp = {batch_shards(mesh)}")
    if train_config.batch_size % jax.process_count():
        raise ValueError(f"{train_config.batch_size} sequences per update are not divisible by the "
                         f"{jax.process_count()} processes")


EVAL_HINT = "use a smaller --seq-len, a larger dataset, or --eval-interval 0 (train without evaluation)"


def open_data(run_config: RunConfig) -> tuple[RunConfig, Tokenizer, PackedDataset, PackedDataset | None, list[str]]:
    """(run_config with the tokenizer's vocabulary size, tokenizer, train windows, eval windows, notes for the log).
    A held-out part that fills no window is an error, unless ``--eval-interval`` is 0: then the eval windows are
    None and the notes hold a one-line warning."""
    model_config, train_config, data_config = run_config.model, run_config.train, run_config.data
    tokenizer = data_config.load_tokenizer()
    train_data = open_windows(data_config, "train", tokenizer, model_config.seq_len, train_config.seed)
    eval_data, notes = None, []
    try:
        eval_data = open_windows(data_config, "eval", tokenizer, model_config.seq_len, train_config.seed)
    except NoWindows as error:
        if run_config.loop.eval_interval:
            raise error.with_hint(EVAL_HINT) from None
        notes.append(f"warning: training without evaluation (--eval-interval 0): {error.what}")
    run_config = run_config.replace(model=model_config.replace(vocab_size=tokenizer.vocab_size))
    return run_config, tokenizer, train_data, eval_data, notes


@dataclasses.dataclass
class Start:
    """Where a run starts: its state, its first step, whether it resumes, and notes for the log."""

    state: TrainState
    step: int
    resume: bool
    own_steps: list[int]  # the checkpoints already in --checkpoint-dir
    notes: list[str]


def starting_state(run_config: RunConfig, identity: dict[str, Any], mesh: Mesh, directory: paths.Path) -> Start:
    """A fresh state, or one restored from ``--resume-from``, the directory's own newest checkpoint, or
    ``--init-from`` (weights only), in that order of precedence."""
    run, source = run_config.loop, None
    try:
        own = Checkpointer(directory, read_only=True) if directory.exists() else None
        own_steps = own.all_steps() if own is not None else []
        if run.resume_from:
            source, steps = _source(run.resume_from, "--resume-from")
        elif own_steps:
            source, steps, own = own, own_steps, None
        elif run.init_from:
            source, steps = _source(run.init_from, "--init-from")
        if own is not None:
            own.close()
        resume = bool(run.resume_from) or bool(own_steps)
        state = init_train_state(run_config.model, run_config.train, mesh, key=jax.random.key(run_config.train.seed))
        if source is None:
            return Start(state, 0, resume, own_steps, [])
        own_source = os.fspath(source.directory).rstrip("/") == os.fspath(directory).rstrip("/")
        step, meta, restored, notes = _restore(run_config, identity, state, source, steps, resume, own_source)
    finally:
        if source is not None:
            source.close()
    if resume:
        return Start(restored, int(meta["step"]), True, own_steps, notes)
    return Start(with_model(state, restored.model), 0, False, own_steps, notes)  # init: weights only


def set_aside_later_steps(directory: paths.Path, start: Start) -> None:
    """Process 0 moves the checkpoints and metrics after the start step out of the way (every host waits)."""
    if jax.process_index() == 0:
        aside = set_aside(directory, start.step, start.own_steps)
        if aside is not None:
            start.notes.append(f"set aside the checkpoints and metrics after step {start.step} in {aside}")
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("nash_mhc set aside")


def data_line(data_config: DataConfig, train_data: PackedDataset, eval_data: PackedDataset | None) -> str:
    """``data: <dataset> / <tokenizer>: <n> train tokens, <m> eval tokens[, <k> records skipped (<why>)]``."""
    skipped = dict(train_data.skipped)
    for reason, count in (eval_data.skipped if eval_data is not None else {}).items():
        skipped[reason] = skipped.get(reason, 0) + count
    held_out = f"{eval_data.num_tokens:,} eval tokens" if eval_data is not None else "no eval windows"
    return ", ".join(filter(None, (f"data: {data_config.dataset} / {data_config.tokenizer}: "
                                   f"{train_data.num_tokens:,} train tokens", held_out, skipped_text(skipped))))


def summary_lines(run_config: RunConfig, state: TrainState, devices: list[Any], meter: MFUMeter,
                  data: tuple[PackedDataset, PackedDataset | None], start: Start) -> list[str]:
    """The lines a run's log starts with: hardware, sharding, model, batch, data, peak and where it starts."""
    model_config, train_config, run = run_config.model, run_config.train, run_config.loop
    return [
        *hardware.summary_lines(devices),
        *sharding_summary(state.model, state.mesh),
        f"model: {describe(model_config)}",
        f"tokens per update: {train_config.batch_size * model_config.seq_len:,} ({train_config.batch_size} x "
        f"{model_config.seq_len}), accumulation steps: {train_config.grad_accum_steps}",
        data_line(run_config.data, *data),
        f"peak FLOP/s per device: {meter.peak / 1e9:,.1f} GFLOP/s ({meter.source})",
        *start.notes,
        f"resuming from step {start.step}" if start.resume else
        (f"initialised from {run.init_from}" if run.init_from else "fresh start"),
    ]


def write_resolved_config(directory: paths.Path, run_config: RunConfig, mesh: Mesh) -> None:
    """``config.json``: every setting of the run as resolved (:meth:`RunConfig.to_dict`: the tokenizer's vocabulary
    included, and the execution settings, which are how the steps run, not part of what a resume compares), and
    the mesh's shape."""
    (directory / "config.json").write_text(json.dumps({**run_config.to_dict(), "mesh": dict(mesh.shape)}, indent=2,
                                                      sort_keys=True) + "\n")


def prepare(run_config: RunConfig) -> Session:
    """Build mesh, data, state (fresh or restored) and outputs; raises ValueError on bad input.

    Nothing is created in ``--checkpoint-dir`` until every check has passed; an existing directory is locked
    (:class:`RunLock`) before it is read, so two runs never share it."""
    devices = hardware.init_devices()  # HardwareError (a ValueError) when JAX_PLATFORMS cannot be honoured
    mesh = run_config.mesh.make()
    check_batch(run_config.train, mesh)
    directory = paths.as_path(run_config.loop.checkpoint_dir)  # a local path or a bucket URI (gs://...)
    _check_directory(directory)
    # The peak first, in a process that has done nothing else yet, as a benchmark session or a fresh process
    # measures it: after the data, the state and the outputs were made, a CPU's matmul probe read low more often,
    # and every MFU of such a run as much too high (docs/results/startup_peak/README.md).
    peak = device_peak(dtype=run_config.model.dtype)
    run_config, tokenizer, train_data, eval_data, data_notes = open_data(run_config)
    identity = run_identity(run_config.data, tokenizer, run_config.train)
    lock = _lock(directory) if directory.exists() else None
    try:
        start = starting_state(run_config, identity, mesh, directory)
        start.notes[:0] = data_notes
        _make_directory(directory)
        if lock is None:
            lock = _lock(directory)
        set_aside_later_steps(directory, start)
        checkpointer = Checkpointer(directory, max_to_keep=run_config.loop.max_checkpoints)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    is_main = jax.process_index() == 0
    logger = RunLogger(directory, enabled=is_main, total_steps=run_config.train.total_steps, start_step=start.step,
                       progress=run_config.loop.progress)
    meter = MFUMeter(float(run_config.model.flops_per_token()), len(jax.devices()), *peak)
    summary = summary_lines(run_config, start.state, devices, meter, (train_data, eval_data), start)
    if is_main:
        write_resolved_config(directory, run_config, mesh)
    return Session(run_config, start.state, start.step, train_data, eval_data, tokenizer, checkpointer, logger, meter,
                   summary, lock, identity, start.step if start.resume else None)
