"""Hardware detection: the start-up summary, and what happens when a user asks for a TPU/GPU that is not
there — JAX 0.10 raises for a lone unavailable platform (we exit 2 with one line) and silently falls back
when the list ends in ``cpu`` (we warn)."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import pytest
from helpers import clean_env

from nash_mhc import hardware

# The subprocess tests ask for a platform that is not there; on a real TPU/GPU machine it would be.
needs_no_accelerator = pytest.mark.skipif(hardware.detect_accelerator() is not None,
                                          reason="this machine has an accelerator")



def run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], env=clean_env(**env), capture_output=True, text=True,
                          timeout=120)


def no_devices(path: str) -> bool:
    return False


def test_summary_lines_describe_platform_kind_and_layout():
    lines = hardware.summary_lines(env={}, exists=no_devices)
    count, first = jax.device_count(), jax.devices()[0]
    assert lines[0] == f"devices: {count} x {first.device_kind} ({first.platform}), 1 process(es)"
    assert lines[1] == f"layout: process 0 of 1, {count} local device(s) per process, 1 host(s)"
    assert lines[2] == f"platform: jax {jax.__version__}" and len(lines) == 3
    tpu_vm = hardware.summary_lines(env={"TPU_ACCELERATOR_TYPE": "v4-32"}, exists=no_devices)
    assert "TPU slice v4-32" in tpu_vm[2]
    assert tpu_vm[-1].startswith("WARNING: this machine has a TPU but JAX is running on the CPU")


def test_fallback_warning_names_what_was_asked_for_or_found():
    assert hardware.fallback_warning("tpu", {"JAX_PLATFORMS": "tpu"}, no_devices) is None
    assert hardware.fallback_warning("cpu", {"JAX_PLATFORMS": "cpu"}, no_devices) is None
    assert hardware.fallback_warning("cpu", {}, no_devices) is None
    asked = hardware.fallback_warning("cpu", {"JAX_PLATFORMS": "cuda,cpu"}, no_devices)
    assert asked.startswith("WARNING: JAX_PLATFORMS asks for cuda but JAX fell back to the CPU")
    assert '.[cuda]' in asked
    gpu_box = hardware.fallback_warning("cpu", {}, lambda path: path == "/dev/nvidia0")
    assert gpu_box.startswith("WARNING: this machine has a GPU") and "JAX_PLATFORMS=cuda" in gpu_box
    assert hardware.detect_accelerator({}, lambda path: path == "/dev/accel0") == "tpu"
    assert hardware.detect_accelerator({}, lambda path: path == "/dev/vfio/0") == "tpu"
    assert hardware.requested_platforms({"JAX_PLATFORMS": " TPU, cpu "}) == ["tpu", "cpu"]


@pytest.mark.slow  # a subprocess that starts JAX: seconds, and no invariant of the model
@needs_no_accelerator
def test_unavailable_platform_is_a_one_line_exit_2():
    result = run("nash_mhc.hardware", JAX_PLATFORMS="tpu")
    assert result.returncode == 2, result.stderr
    assert result.stdout == "" and result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith("error: JAX_PLATFORMS='tpu' but JAX cannot start it")
    assert '.[tpu]' in result.stderr

    trained = run("nash_mhc.train", "--model", "tiny", "--dataset", "synthetic", "--total-steps", "2",
                  "--checkpoint-dir", os.devnull + "/never-created", JAX_PLATFORMS="cuda")
    assert trained.returncode == 2 and trained.stderr.count("\n") == 1, trained.stderr
    assert trained.stderr.startswith("error: JAX_PLATFORMS='cuda' but JAX cannot start it")


@needs_no_accelerator
def test_fallback_to_cpu_is_reported():
    result = run("nash_mhc.hardware", JAX_PLATFORMS="cuda,cpu")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "devices: 1 x cpu (cpu), 1 process(es)"
    assert lines[-1].startswith("WARNING: JAX_PLATFORMS asks for cuda but JAX fell back to the CPU")


def test_initialize_distributed_needs_the_whole_process_layout():
    """jax.distributed set-up lives here (not in the training loop): nothing to do without variables, a one-line
    ValueError when only the coordinator is given (before any connection is tried)."""
    hardware.initialize_distributed({})  # a single process: no-op
    with pytest.raises(ValueError, match="also set JAX_PROCESS_COUNT and JAX_PROCESS_INDEX"):
        hardware.initialize_distributed({"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1", "JAX_PROCESS_COUNT": "2"})
