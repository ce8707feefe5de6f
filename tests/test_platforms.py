"""Platform choice (nash_mhc.platforms): on a CPU host with libtpu installed, nash_mhc's programs start JAX on the
CPU quietly; an explicit JAX_PLATFORMS, a visible TPU/GPU or JAX_FORCE_TPU_INIT leave JAX's own choice alone.
Importing the package changes no JAX setting and starts no backend."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from helpers import clean_env

from nash_mhc import hardware, platforms

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="needs libtpu (pip install -e '.[tpu]')")
needs_no_accelerator = pytest.mark.skipif(
    hardware.detect_accelerator() is not None or hardware.tpu_chips_on_pci() > 0,
    reason="this machine has an accelerator")


def no_devices(path: str) -> bool:
    return False


def no_chips() -> int:
    return 0


def test_cpu_is_chosen_only_for_libtpu_without_a_tpu_or_gpu():
    def choose(env: dict[str, str], exists=no_devices, chips=no_chips, libtpu=True) -> str | None:
        return platforms.default_platforms(env, exists, chips, libtpu)

    assert choose({}) == "cpu"
    assert choose({}, libtpu=False) is None                      # no libtpu: JAX starts no TPU runtime anyway
    assert choose({"JAX_PLATFORMS": "tpu"}) is None               # an explicit choice is kept
    assert choose({"JAX_PLATFORMS": "cpu"}) is None
    assert choose({"JAX_FORCE_TPU_INIT": "1"}) is None
    assert choose({"TPU_ACCELERATOR_TYPE": "v5litepod-8"}) is None
    assert choose({}, exists=lambda path: path == "/dev/accel0") is None
    assert choose({}, exists=lambda path: path == "/dev/vfio/0") is None
    assert choose({}, exists=lambda path: path == "/dev/nvidia0") is None
    assert choose({}, chips=lambda: 4) is None                    # TPU chips on PCI (e.g. /dev/vfio/<n> only)
    assert choose({"JAX_PLATFORMS": ""}) == "cpu"                 # empty is unset
    assert platforms.libtpu_installed({"TPU_LIBRARY_PATH": "/opt/libtpu.so"})


def test_tpu_chips_are_counted_on_pci_by_vendor_and_device(tmp_path):
    def device(name: str, vendor: str, device_id: str) -> None:
        (tmp_path / name).mkdir()
        (tmp_path / name / "vendor").write_text(vendor + "\n")
        (tmp_path / name / "device").write_text(device_id + "\n")

    device("0000:00:04.0", "0x1ae0", "0x0042")  # Google gVNIC network card: same vendor, not a TPU
    device("0000:00:05.0", "0x8086", "0x0063")  # another vendor
    assert platforms.tpu_chips_on_pci(str(tmp_path)) == 0
    device("0000:00:06.0", "0x1ae0", "0x0063")  # v5e
    device("0000:00:07.0", "0x1ae0", "0x006f")  # v6e
    assert platforms.tpu_chips_on_pci(str(tmp_path)) == 2
    assert platforms.tpu_chips_on_pci(str(tmp_path / "missing")) == 0


def test_native_stderr_is_captured(capfd):
    with hardware.captured_native_stderr() as captured:
        os.write(2, b"from a native library\n")
    assert captured == [b"from a native library\n"]
    assert capfd.readouterr().err == ""



def test_importing_the_package_starts_no_backend_and_changes_no_setting():
    """Every module of the package imported in a fresh interpreter: no JAX backend started, jax_platforms as the
    environment left it (unset), whatever this machine has."""
    script = ("import importlib, pkgutil, jax, nash_mhc; from jax._src import xla_bridge; "
              "[importlib.import_module(m.name) for m in pkgutil.walk_packages(nash_mhc.__path__, 'nash_mhc.')]; "
              "print(xla_bridge.backends_are_initialized(), jax.config.jax_platforms)")
    result = subprocess.run([sys.executable, "-c", script], env=clean_env(), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "None"], result.stdout


@pytest.mark.slow  # a subprocess that starts JAX with libtpu installed: seconds, and no invariant of the model
@needs_libtpu
@needs_no_accelerator
def test_cpu_host_with_libtpu_starts_quietly():
    """The programs (here ``python -m nash_mhc.hardware``) and a library user who calls select_platform start the
    CPU without a word on stderr."""
    program = subprocess.run([sys.executable, "-m", "nash_mhc.hardware"], env=clean_env(), capture_output=True,
                             text=True, timeout=120)
    assert program.returncode == 0 and program.stderr == "", program.stderr
    assert program.stdout.startswith("devices: ") and "cpu" in program.stdout.splitlines()[0], program.stdout
    script = "import {first}; import jax; print(jax.devices()[0].platform, jax.config.jax_platforms)"
    quiet = subprocess.run([sys.executable, "-c", script.format(first="nash_mhc; nash_mhc.select_platform()")],
                           env=clean_env(), capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout.split() == ["cpu", "cpu"] and quiet.stderr == ""
    # Control: JAX on its own tries the TPU runtime, which complains on stderr (what the choice avoids).
    noisy = subprocess.run([sys.executable, "-c", script.format(first="jax")], env=clean_env(),
                           capture_output=True, text=True, timeout=120)
    assert noisy.returncode == 0 and noisy.stdout.split() == ["cpu", "None"]
    assert noisy.stderr.strip(), "libtpu printed nothing: the control no longer shows the problem"
