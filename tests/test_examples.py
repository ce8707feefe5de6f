"""Smoke tests: every example runs to completion as a user would start it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import ROOT, suite_xla_flags


def run_example(name: str, *args: str, **extra_env: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the suite's level, with the example's flags
    env = {**env, **extra_env, "XLA_FLAGS": f"{suite_xla_flags()} {extra_env.get('XLA_FLAGS', '')}".strip()}
    result = subprocess.run([sys.executable, str(ROOT / "examples" / name), *args], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


@pytest.mark.slow
def test_quickstart_builds_runs_and_learns():
    out = run_example("quickstart.py", "--steps", "20")
    losses = [float(line.split()[3]) for line in out.splitlines() if line.startswith("step")]
    assert "logits (4, 64, 384)" in out
    assert losses[-1] < losses[0] - 1.0


@pytest.mark.slow
def test_custom_training_loop_learns():
    out = run_example("custom_training_loop.py", "--steps", "12")
    losses = [float(line.split()[3]) for line in out.splitlines() if line.startswith("step")]
    assert losses[-1] < losses[0] - 0.5 and "eval loss" in out


@pytest.mark.slow
def test_sharded_training_prints_the_memory_table():
    # it sets 8 fake devices itself, beside any XLA flags of the user's (here one that changes no result)
    out = run_example("sharded_training.py", "--steps", "2", XLA_FLAGS="--xla_cpu_enable_fast_math=false")
    assert "mesh data=2 fsdp=2 tp=2" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit() and "%" in line]
    assert len(rows) == 8 and all(row[-1] == "25.8%" for row in rows)
    assert "step 2: loss" in out

