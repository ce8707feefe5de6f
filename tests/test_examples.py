"""Smoke tests: every example runs to completion as a user would start it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_example(name: str, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run([sys.executable, str(ROOT / "examples" / name), *args], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_quickstart_builds_runs_and_learns():
    out = run_example("quickstart.py", "--steps", "20")
    losses = [float(line.split()[3]) for line in out.splitlines() if line.startswith("step")]
    assert "logits (4, 64, 384)" in out
    assert losses[-1] < losses[0] - 1.0
