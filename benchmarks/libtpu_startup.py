"""Start-up cost of having libtpu installed on a CPU host: import time, first-step time, stderr lines.

    python benchmarks/libtpu_startup.py [--rounds 3] [--python OTHER_VENV/bin/python ...]

Runs fresh child processes of each interpreter given (default: this one), interleaved round by round, in
three modes:

  jax-first   ``import jax; jax.devices()`` before ``import nash_mhc``: JAX's own platform choice (what
              nash_mhc did before :func:`nash_mhc.platforms.select_platform`; with libtpu installed JAX
              tries to start a TPU)
  nash_mhc    ``import nash_mhc`` and :func:`nash_mhc.select_platform` (what the programs do when they start),
              then ``jax.devices()``
  cpu         as nash_mhc, with ``JAX_PLATFORMS=cpu``

Each child times the import, ``jax.devices()`` and the first ``tiny`` train step on one device (state
initialisation + compile + run), and the parent counts the child's stderr lines. Prints one table row per
interpreter and mode (median over the rounds). Timings on a shared machine are noisy: compare rows of one
run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
if sys.argv[1] == "jax-first":
    import jax
    jax.devices()
import nash_mhc
nash_mhc.select_platform()
t1 = time.perf_counter()
import jax
devices = jax.devices()
t2 = time.perf_counter()
from nash_mhc import ModelConfig, TrainConfig, make_mesh
from nash_mhc.training import Batch, init_train_state, train_step
config = ModelConfig.preset("tiny")
state = init_train_state(config, TrainConfig(batch_size=8), make_mesh(1, 1, 1, devices=devices[:1]),
                         key=jax.random.key(0))
tokens = jax.random.randint(jax.random.key(1), (8, config.seq_len + 1), 0, config.vocab_size)
state, metrics = train_step(state, Batch(tokens=tokens))
jax.block_until_ready(metrics)
t3 = time.perf_counter()
try:
    import libtpu  # noqa: F401
    has_libtpu = True
except ImportError:
    has_libtpu = False
print(json.dumps({"import_s": t1 - t0, "devices_s": t2 - t1, "first_step_s": t3 - t2,
                  "platform": devices[0].platform, "libtpu": has_libtpu}))
"""

MODES = {"jax-first": {}, "nash_mhc": {}, "cpu": {"JAX_PLATFORMS": "cpu"}}


def child(python: str, mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env.update(MODES[mode])
    result = subprocess.run([python, "-c", CHILD, mode], env=env, capture_output=True, text=True, timeout=600)
    if result.returncode:
        raise SystemExit(f"{python} {mode} failed:\n{result.stderr}")
    row = json.loads(result.stdout.strip().splitlines()[-1])
    row["stderr_lines"] = len(result.stderr.splitlines())
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="child processes per interpreter and mode")
    parser.add_argument("--python", action="append", default=None,
                        help="interpreter to measure (repeatable; default: this one)")
    args = parser.parse_args()
    pythons = args.python or [sys.executable]
    rows: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.rounds):
        for python in pythons:
            for mode in MODES:
                rows.setdefault((python, mode), []).append(child(python, mode))
    print("| interpreter | libtpu | mode | platform | import s | jax.devices() s | first tiny step s | stderr lines |")
    print("| --- | --- | --- | --- | ---: | ---: | ---: | ---: |")
    for (python, mode), runs in rows.items():
        med = {k: statistics.median(r[k] for r in runs) for k in ("import_s", "devices_s", "first_step_s")}
        lines = sorted({r["stderr_lines"] for r in runs})
        print(f"| {python} | {'yes' if runs[0]['libtpu'] else 'no'} | {mode} | {runs[0]['platform']} "
              f"| {med['import_s']:.2f} | {med['devices_s']:.2f} | {med['first_step_s']:.2f} "
              f"| {'/'.join(map(str, lines))} |")


if __name__ == "__main__":
    main()
