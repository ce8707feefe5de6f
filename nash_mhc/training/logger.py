"""Run logging on process 0: tqdm progress bar, ``metrics.jsonl``, TensorBoard scalars and extra sinks.

An extra sink (:meth:`RunLogger.add_sink`, e.g. :class:`nash_mhc.training.wandb_log.WandbSink`) receives every
scalar TensorBoard gets, under the same names, with its step, and is closed with the logger.

The directory may be a bucket URI (``gs://bucket/run``): both files are then written into a local
:class:`nash_mhc.paths.Mirror` (an earlier ``metrics.jsonl`` is downloaded first, so a resumed run appends)
and uploaded whole every ``sync_interval_s`` seconds and at close, since object stores cannot append.
"""

from __future__ import annotations

import json
import math
from typing import Any

from tqdm import tqdm

from nash_mhc import paths


class RunLogger:
    """Writes one JSON object per logged step to ``<dir>/metrics.jsonl`` and the same scalars to TensorBoard.

    Disabled (every method a no-op) on processes other than 0, so a multi-host run writes one log.
    """

    def __init__(self, directory: paths.PathLike, *, enabled: bool, total_steps: int, start_step: int,
                 progress: bool = True, sync_interval_s: float = 60.0):
        self.enabled = enabled
        self.directory = paths.as_path(directory)
        self._bar = None
        self._jsonl = None
        self._tb = None
        self._mirror = None
        self._sinks: list[Any] = []  # objects with log(scalars: dict[str, float], step: int) and close()
        if not enabled:
            return
        from tensorboardX import SummaryWriter

        # Local directory: the mirror is the directory itself. Bucket: a local copy, uploaded by _sync.
        self._mirror = paths.Mirror(directory, pull=("metrics.jsonl",), interval_s=sync_interval_s)
        self._jsonl = (self._mirror.local / "metrics.jsonl").open("a", buffering=1)
        self._tb = SummaryWriter(logdir=str(self._mirror.local), flush_secs=10)
        if progress:
            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                             mininterval=1.0)

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` (must hold ``step``) to metrics.jsonl and TensorBoard."""
        if not self.enabled:
            return
        step = int(record["step"])
        clean = {k: (float(v) if isinstance(v, int | float) and not isinstance(v, bool) else v)
                 for k, v in record.items()}
        clean["step"] = step
        self._jsonl.write(json.dumps({k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                      for k, v in clean.items()}) + "\n")
        shown = ("loss", "eval_loss", "grad_norm", "learning_rate", "tokens_per_second", "mfu")
        line = " ".join(f"{k} {clean[k]:.4g}" for k in shown if isinstance(clean.get(k), float))
        self.message(f"step {step}: {line}")
        scalars = {}
        for key, value in clean.items():
            if key != "step" and isinstance(value, float) and math.isfinite(value):
                group = "eval" if key.startswith("eval") else "train"
                scalars[key if "/" in key else f"{group}/{key}"] = value
        self._scalars(scalars, step)
        self._sync()

    def add_sink(self, sink: Any) -> None:
        """Send every later scalar to ``sink.log(scalars, step)`` too; ``sink.close()`` runs at :meth:`close`
        (ignored on a disabled logger: only process 0 logs)."""
        if self.enabled:
            self._sinks.append(sink)

    def _scalars(self, scalars: dict[str, float], step: int) -> None:
        for name, value in scalars.items():
            self._tb.add_scalar(name, value, step)
        for sink in self._sinks:
            sink.log(scalars, step)

    def _sync(self) -> None:
        """Upload the files to a bucket directory when due (nothing to do for a local directory)."""
        if self._mirror is not None and self._mirror.due():
            self._tb.flush()
            self._mirror.sync(force=True)

    def scalar(self, name: str, value: float, step: int) -> None:
        if self.enabled:
            self._scalars({name: float(value)}, step)

    def progress(self, step: int, loss: float, tokens_per_second: float) -> None:
        if self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_second:,.0f}", refresh=False)
            self._bar.refresh()

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()
        self._sinks = []
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._mirror is not None:
            self._mirror.close()  # final upload of a bucket directory
