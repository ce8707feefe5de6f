"""The training program's loop (:func:`train`), around a :class:`~nash_mhc.training.session.Session` that
:func:`~nash_mhc.training.session.prepare` built.

``train`` is one plain ``while`` loop around the jitted ``train_step``: batches come from a prefetch thread as a
function of (seed, step); the metrics of step s are read only after step s+1 has been dispatched
(:class:`MetricsReader`, so logging never stalls the device) and end the run when the loss stays non-finite;
checkpoints, evaluations and a SIGTERM/SIGINT (finish the step, save, exit 0) are hooks between steps.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from nash_mhc.data import Prefetcher
from nash_mhc.training.evaluation import evaluate
from nash_mhc.training.session import Session
from nash_mhc.training.state import TrainState
from nash_mhc.training.step import train_step

EXIT_OK, EXIT_NONFINITE = 0, 3


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
        return (step % session.run_config.loop.log_interval == 0 or step == session.run_config.train.total_steps
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
        session, run = self.session, self.session.run_config.loop
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
        session, model = self.session, self.session.run_config.model
        figures = {"tokens_per_second": math.nan, "mfu": math.nan, "step_time_s": math.nan}
        if self.window_steps:
            figures = session.meter.report(session.run_config.train.batch_size * model.seq_len,
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
    result = evaluate(state.model, session.eval_data, session.tokenizer, num_batches=session.run_config.loop.eval_steps,
                      batch_size=session.run_config.train.microbatch_size)
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
    run, end, logger = session.run_config.loop, session.run_config.train.total_steps, session.logger
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
