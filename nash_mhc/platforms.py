"""Which JAX platform to start: what accelerator this machine visibly has, and nash_mhc's default choice.

With libtpu installed (the ``tpu`` extra, which compiling for a TPU topology on a CPU host also needs) and
``JAX_PLATFORMS`` unset, JAX tries to start a TPU on every machine; on one without a TPU, libtpu prints half a
dozen error lines to stderr whenever a backend starts. :func:`select_platform`, called by every program's
``main`` before anything can start a backend (``import nash_mhc`` itself changes nothing), chooses the CPU
platform in exactly that case. An explicit ``JAX_PLATFORMS`` (or ``jax.config.jax_platforms``), a visible TPU or
GPU, ``JAX_FORCE_TPU_INIT`` or backends already running leave JAX's own choice alone. This module imports nothing
from nash_mhc; :mod:`nash_mhc.hardware` re-exports it.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from collections.abc import Callable, Mapping


def requested_platforms(env: Mapping[str, str] | None = None) -> list[str]:
    """Platforms named by ``JAX_PLATFORMS`` (or ``jax.config.jax_platforms`` when ``env`` is None)."""
    if env is None:
        import jax

        value = jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS", "")
    else:
        value = env.get("JAX_PLATFORMS", "")
    return [p.strip().lower() for p in (value or "").split(",") if p.strip()]


def detect_accelerator(env: Mapping[str, str] | None = None,
                       exists: Callable[[str], bool] = os.path.exists) -> str | None:
    """``"tpu"`` or ``"gpu"`` when this machine visibly has one (device files, TPU VM variables), else None."""
    env = os.environ if env is None else env
    if env.get("TPU_ACCELERATOR_TYPE") or env.get("TPU_WORKER_HOSTNAMES") or exists("/dev/accel0") \
            or exists("/dev/vfio/0"):
        return "tpu"
    if exists("/dev/nvidia0") or exists("/proc/driver/nvidia/version"):
        return "gpu"
    return None


# PCI device ids of Google TPU chips (vendor 0x1ae0, which also makes the gVNIC network card): v3, v4,
# v5p, v5e, v6e, 7x, as JAX's own TPU detection (jax._src.hardware_utils) lists them.
GOOGLE_PCI_VENDOR = "0x1ae0"
TPU_PCI_DEVICES = frozenset({"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076"})


def tpu_chips_on_pci(root: str = "/sys/bus/pci/devices") -> int:
    """How many TPU chips are attached through PCI (0 on any machine without a readable ``/sys``)."""
    count = 0
    for vendor in glob.glob(os.path.join(root, "*", "vendor")):
        try:
            with open(vendor) as f, open(os.path.join(os.path.dirname(vendor), "device")) as g:
                count += f.read().strip() == GOOGLE_PCI_VENDOR and g.read().strip() in TPU_PCI_DEVICES
        except OSError:
            continue
    return count


def libtpu_installed(env: Mapping[str, str] | None = None) -> bool:
    """Whether JAX would try to load a TPU runtime (the ``libtpu`` package, or ``TPU_LIBRARY_PATH``)."""
    env = os.environ if env is None else env
    return bool(env.get("TPU_LIBRARY_PATH")) or importlib.util.find_spec("libtpu") is not None


def default_platforms(env: Mapping[str, str] | None = None, exists: Callable[[str], bool] = os.path.exists,
                      tpu_chips: Callable[[], int] = tpu_chips_on_pci, libtpu: bool | None = None) -> str | None:
    """``"cpu"`` when JAX left to itself would try to start a TPU runtime on a machine without a TPU, else None.

    That is: libtpu is installed, ``JAX_PLATFORMS`` names nothing (an explicit choice is always kept), no
    TPU is visible (device files, TPU VM variables, TPU chips on PCI), no GPU is visible, and
    ``JAX_FORCE_TPU_INIT`` is unset.
    """
    env = os.environ if env is None else env
    if requested_platforms(env) or env.get("JAX_FORCE_TPU_INIT") is not None:
        return None
    if not (libtpu_installed(env) if libtpu is None else libtpu):
        return None
    if detect_accelerator(env, exists) is not None or tpu_chips() > 0:
        return None
    return "cpu"


def select_platform() -> str | None:
    """Apply :func:`default_platforms` to ``jax.config`` before any backend starts; returns what it set.

    A no-op when ``jax.config.jax_platforms`` is already set or JAX's backends are already running.
    """
    import jax
    from jax._src import xla_bridge

    if jax.config.jax_platforms or xla_bridge.backends_are_initialized():
        return None
    platforms = default_platforms()
    if platforms:
        jax.config.update("jax_platforms", platforms)
    return platforms
