"""The training program's imperative shell: set-up, the loop, checkpoints, signals, logging.

``prepare`` validates everything a user can get wrong (mesh, batch, data, checkpoint) and raises
``ValueError`` subclasses with one-line messages (the CLI turns them into exit code 2). ``train`` runs one
plain loop around the jitted ``train_step``: batches come from a prefetch thread as a deterministic function
of (seed, step), metrics of step s are read only after step s+1 has been dispatched (so logging never stalls
the device), and a SIGTERM/SIGINT finishes the current step, saves and exits 0.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sys
import time
from typing import Any

import equinox as eqx
import jax
import numpy as np

from nash_mhc import hardware, paths
from nash_mhc.config import ModelConfig, describe
from nash_mhc.data import get_tokenizer, make_datasets
from nash_mhc.data.prefetch import Prefetcher
from nash_mhc.inference import count_bytes
from nash_mhc.sharding import batch_shards, make_mesh, shard_batch, sharding_summary
from nash_mhc.training.checkpoint import Checkpointer, CheckpointError, config_differences, find_checkpoint
from nash_mhc.training.config import TrainConfig
from nash_mhc.training.logger import RunLogger
from nash_mhc.training.state import Batch, TrainState, init_train_state
from nash_mhc.training.step import eval_step, train_step
from nash_mhc.training.throughput import device_peak, mfu

EXIT_OK, EXIT_USAGE, EXIT_NONFINITE = 0, 2, 3


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Settings of the training program that are neither architecture nor optimisation."""

    dataset: str = "stdlib"
    tokenizer: str = "bytes"
    dataset_name: str | None = None  # Hugging Face configuration
    split: str = "train"  # Hugging Face split to train on
    text_field: str = "text"
    num_workers: int = 1  # tokenisation threads of on-the-fly sources
    max_stream_tokens: int | None = 20_000_000  # prefix of a streamed hub dataset that is trained on
    checkpoint_dir: str = "runs/nash_mhc"
    checkpoint_interval: int = 500
    max_checkpoints: int = 3
    resume_from: str | None = None
    init_from: str | None = None
    log_interval: int = 10
    eval_interval: int = 0
    eval_steps: int = 4
    mesh_data: int = -1
    mesh_fsdp: int = 1
    mesh_tp: int = 1
    worker_buffer_size: int = 2
    max_nonfinite_steps: int = 10
    progress: bool = True
    stop_step: int | None = None  # where this run stops (default: TrainConfig.total_steps, the schedule end)

    def __post_init__(self) -> None:
        for name in ("checkpoint_interval", "log_interval", "max_nonfinite_steps", "eval_steps", "num_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("eval_interval", "worker_buffer_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.max_checkpoints < 1:
            raise ValueError(f"max-checkpoints must be >= 1, got {self.max_checkpoints}")
        if self.resume_from and self.init_from:
            raise ValueError("give --resume-from or --init-from, not both")


@dataclasses.dataclass
class Session:
    """Everything ``train`` needs, built and validated by ``prepare``."""

    model_config: ModelConfig
    train_config: TrainConfig
    run: RunConfig
    mesh: jax.sharding.Mesh
    state: TrainState
    start_step: int
    train_data: Any
    eval_data: Any
    checkpointer: Checkpointer
    logger: RunLogger
    peak_flops: float
    summary: list[str]


def initialize_distributed() -> None:
    """``jax.distributed.initialize`` from JAX_COORDINATOR_ADDRESS / JAX_PROCESS_COUNT / JAX_PROCESS_INDEX
    (CPU processes use gloo collectives), or with cluster auto-detection when NASH_MHC_DISTRIBUTED=1 (the pod
    launcher sets it on every worker) or TPU_WORKER_HOSTNAMES lists several workers. No-op otherwise."""
    address = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if address:
        count, index = os.environ.get("JAX_PROCESS_COUNT"), os.environ.get("JAX_PROCESS_INDEX")
        if count is None or index is None:
            raise ValueError("JAX_COORDINATOR_ADDRESS is set: also set JAX_PROCESS_COUNT and JAX_PROCESS_INDEX")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=address, num_processes=int(count), process_id=int(index))
    elif os.environ.get("NASH_MHC_DISTRIBUTED") == "1" or "," in os.environ.get("TPU_WORKER_HOSTNAMES", ""):
        jax.distributed.initialize()  # cluster auto-detection (Cloud TPU pod slices, SLURM, ...)


def _meta(session_step: int, model_config: ModelConfig, train_config: TrainConfig, run: RunConfig,
          mesh: jax.sharding.Mesh) -> dict[str, Any]:
    return {
        "step": session_step,
        "data": {"dataset": run.dataset, "tokenizer": run.tokenizer, "next_step": session_step,
                 "dataset_name": run.dataset_name, "split": run.split, "text_field": run.text_field,
                 "max_stream_tokens": run.max_stream_tokens,
                 "samples_seen": session_step * train_config.batch_size},
        "rng": {"seed": train_config.seed},
        "model_config": model_config.to_dict(),
        "train_config": train_config.to_dict(),
        "mesh": dict(mesh.shape),
        "jax_version": jax.__version__,
    }


def _open_source(path: str) -> tuple[Checkpointer, int, dict[str, Any]]:
    """The read-only checkpointer, step and metadata behind ``--resume-from``/``--init-from``."""
    directory, step = find_checkpoint(path)
    source = Checkpointer(directory, read_only=True)
    step = source.latest_step() if step is None else step
    if step is None:
        raise CheckpointError(f"no complete checkpoint found in {directory}")
    return source, step, source.read_meta(step)


def prepare(model_config: ModelConfig, train_config: TrainConfig, run: RunConfig) -> Session:
    """Build mesh, data, state (fresh or restored) and outputs; raises ValueError on bad input."""
    devices = hardware.init_devices()  # HardwareError (a ValueError) when JAX_PLATFORMS cannot be honoured
    mesh = make_mesh(run.mesh_data, run.mesh_fsdp, run.mesh_tp)
    shards = batch_shards(mesh)
    micro = train_config.microbatch_size
    if micro % shards:
        raise ValueError(f"batch size {train_config.batch_size} / {train_config.grad_accum_steps} accumulation "
                         f"steps = {micro} sequences per microbatch is not divisible by data*fsdp = {shards}")
    if train_config.batch_size % jax.process_count():
        raise ValueError(f"batch size {train_config.batch_size} is not divisible by the "
                         f"{jax.process_count()} processes")
    train_data, eval_data, tokenizer = make_datasets(run.dataset, run.tokenizer, model_config.seq_len,
                                                     train_config.seed, dataset_name=run.dataset_name,
                                                     split=run.split, text_field=run.text_field,
                                                     num_workers=run.num_workers,
                                                     max_stream_tokens=run.max_stream_tokens)
    if model_config.vocab_size != tokenizer.vocab_size:
        model_config = model_config.replace(vocab_size=tokenizer.vocab_size)

    directory = paths.as_path(run.checkpoint_dir)  # a local path or a bucket URI (gs://...)
    checkpointer = Checkpointer(directory, max_to_keep=run.max_checkpoints)
    resume: tuple[Checkpointer, int, dict[str, Any]] | None = None
    if run.resume_from:
        resume = _open_source(run.resume_from)
    elif checkpointer.latest_step() is not None:
        step = checkpointer.latest_step()
        resume = (checkpointer, step, checkpointer.read_meta(step))
    source = resume or (_open_source(run.init_from) if run.init_from else None)
    if source is not None:
        saved = source[2].get("model_config", {})
        differ = config_differences(saved, model_config)
        if differ:
            detail = ", ".join(f"{k}: checkpoint {saved[k]!r} vs now {getattr(model_config, k)!r}" for k in differ)
            raise CheckpointError(f"model config differs from the checkpoint's ({detail})")

    state = init_train_state(model_config, train_config, mesh, key=jax.random.key(train_config.seed))
    start_step = 0
    if resume is not None:
        state = resume[0].restore(resume[1], state)
        start_step = int(resume[2]["step"])
    elif source is not None:
        restored = source[0].restore(source[1], state)
        state = eqx.tree_at(lambda s: s.model, state, restored.model)  # weights only, fresh optimizer
    is_main = jax.process_index() == 0
    logger = RunLogger(directory, enabled=is_main, total_steps=run.stop_step or train_config.total_steps,
                       start_step=start_step, progress=run.progress)
    peak, peak_source = device_peak()
    summary = [
        *hardware.summary_lines(devices),
        *sharding_summary(state.model, mesh),
        f"model: {describe(model_config)}",
        f"tokens per update: {train_config.batch_size * model_config.seq_len:,} "
        f"({train_config.batch_size} x {model_config.seq_len}), accumulation steps: "
        f"{train_config.grad_accum_steps}",
        f"data: {run.dataset} / {run.tokenizer}: {train_data.num_tokens:,} train tokens, "
        f"{eval_data.num_tokens:,} eval tokens",
        f"peak FLOP/s per device: {peak / 1e9:,.1f} GFLOP/s ({peak_source})",
        f"resuming from step {start_step}" if resume is not None else
        (f"initialised from {run.init_from}" if run.init_from else "fresh start"),
    ]
    if is_main:
        directory.mkdir(parents=True, exist_ok=True)
        resolved = {"model_config": model_config.to_dict(), "train_config": train_config.to_dict(),
                    "run_config": dataclasses.asdict(run), "mesh": dict(mesh.shape)}
        (directory / "config.json").write_text(json.dumps(resolved, indent=2, sort_keys=True) + "\n")
    return Session(model_config, train_config, run, mesh, state, start_step, train_data, eval_data, checkpointer,
                   logger, peak, summary)


class StopSignal:
    """Records SIGTERM/SIGINT so the loop can finish the current step, save and exit cleanly."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        self.received = signum

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _preemption_reached(step: int) -> bool:
    if jax.process_count() == 1:
        return False
    try:
        from jax.experimental import multihost_utils

        return bool(multihost_utils.reached_preemption_sync_point(step))
    except Exception:  # noqa: BLE001 - the preemption service is only present on some platforms
        return False


def _host_batch(dataset: Any, step: int, global_batch: int) -> np.ndarray:
    return dataset.batch_at(step, global_batch=global_batch, process_index=jax.process_index(),
                            process_count=jax.process_count())


def evaluate(session: Session, state: TrainState) -> dict[str, float]:
    """Token-weighted mean loss over ``eval_steps`` fixed eval batches, its perplexity and bits per byte."""
    total = count = aux = 0.0
    num_bytes = 0
    tokenizer = get_tokenizer(session.run.tokenizer)
    batch_size = session.train_config.microbatch_size
    for i in range(session.run.eval_steps):
        tokens = shard_batch(_host_batch(session.eval_data, i, batch_size), session.mesh)
        metrics = jax.device_get(eval_step(state.model, Batch(tokens=tokens), mesh=session.mesh))
        total += float(metrics["ce_loss"]) * float(metrics["tokens"])
        count += float(metrics["tokens"])
        aux += float(metrics["aux_loss"])
        num_bytes += count_bytes(tokenizer, session.eval_data.batch_at(i, global_batch=batch_size)[:, 1:])
    ce = total / max(count, 1.0)
    return {"eval_loss": ce, "eval_ppl": math.exp(min(ce, 80.0)), "eval_aux_loss": aux / session.run.eval_steps,
            "eval_bpb": total / math.log(2) / max(num_bytes, 1)}


def train(session: Session) -> int:
    """Run from ``session.start_step`` to ``total_steps``; returns the process exit code."""
    run, tc, mc = session.run, session.train_config, session.model_config
    logger, checkpointer, mesh = session.logger, session.checkpointer, session.mesh
    for line in session.summary:
        logger.message(line)
    state = session.state
    step = session.start_step
    stop = StopSignal()
    tokens_per_step = tc.batch_size * mc.seq_len
    flops_per_token = mc.flops_per_token()
    prefetch = Prefetcher(lambda s: _host_batch(session.train_data, s, tc.batch_size), step,
                          run.worker_buffer_size)
    pending: tuple[int, dict[str, Any]] | None = None
    last_done = time.perf_counter()
    window_time = window_steps = 0.0
    nonfinite_run = 0
    compile_time: float | None = None
    exit_code = EXIT_OK

    end = tc.total_steps if run.stop_step is None else run.stop_step

    def finish(done_step: int, metrics: dict[str, Any]) -> bool:
        """Read the metrics of a completed step; returns False when training must abort."""
        nonlocal last_done, window_time, window_steps, nonfinite_run, compile_time
        values = {k: float(np.asarray(v)) for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        elapsed, last_done = now - last_done, now
        if compile_time is None:
            compile_time = elapsed
            logger.scalar("train/compile_time_s", compile_time, done_step)
        else:
            window_time += elapsed
            window_steps += 1
        diverged = not math.isfinite(values["loss"]) or values.get("skipped", 0.0) > 0  # skipped: grads non-finite
        nonfinite_run = nonfinite_run + 1 if diverged else 0
        if done_step % run.log_interval == 0 or done_step == end or done_step == session.start_step + 1:
            step_time = window_time / window_steps if window_steps else elapsed
            tps = tokens_per_step / step_time
            record = {"step": done_step, **{k: values[k] for k in
                                            ("loss", "ce_loss", "aux_loss", "learning_rate", "grad_norm")},
                      "tokens_per_second": tps,
                      "mfu": mfu(tps, flops_per_token, session.peak_flops, len(jax.devices())),
                      "step_time_s": step_time, "skipped": values.get("skipped", 0.0)}
            for key, value in values.items():
                if key.startswith(("scale_weight", "nash_")) or key == "res_diag":
                    record[key] = value
            logger.write(record)
            logger.progress(done_step, values["loss"], tps)
            window_time = window_steps = 0.0
        if nonfinite_run >= run.max_nonfinite_steps:
            print(f"error: loss or gradients were not finite for {nonfinite_run} steps in a row (last at step "
                  f"{done_step}); stopping without saving", file=sys.stderr)
            return False
        return True

    try:
        while step < end:
            _, host_tokens = prefetch.next()
            batch = Batch(tokens=shard_batch(host_tokens, mesh))
            state, metrics = train_step(state, batch)
            step += 1
            if pending is not None and not finish(*pending):
                pending, exit_code = None, EXIT_NONFINITE
                break
            pending = (step, metrics)
            stopping = stop.received is not None or _preemption_reached(step)
            if step % run.checkpoint_interval == 0 or stopping or step == end:
                if not finish(*pending):
                    pending, exit_code = None, EXIT_NONFINITE
                    break
                pending = None
                checkpointer.save(step, state, _meta(step, mc, tc, run, mesh))
            if run.eval_interval and step % run.eval_interval == 0:
                if pending is not None:
                    if not finish(*pending):
                        pending, exit_code = None, EXIT_NONFINITE
                        break
                    pending = None
                logger.write({"step": step, **evaluate(session, state)})
                last_done = time.perf_counter()
            if stopping:
                logger.message(f"stopping at step {step} after a {'signal' if stop.received else 'preemption'};"
                               " checkpoint saved")
                break
        if pending is not None and not finish(*pending):
            exit_code = EXIT_NONFINITE
    finally:
        prefetch.close()
        checkpointer.wait()
        stop.restore()
        logger.close()
    if exit_code == EXIT_OK and session.start_step >= end:
        print(f"nothing to do: the checkpoint is at step {session.start_step} >= total steps {end}",
              file=sys.stderr)
    checkpointer.close()
    return exit_code
