"""What JAX is running on: platform, device kind, process layout, and a loud warning on a CPU fallback.

``python -m nash_mhc.hardware`` prints the same lines as the training program's start-up summary; run it
on every new machine (on a pod: on every worker) before training. It exits 2 with one line on stderr when
``JAX_PLATFORMS`` names a platform JAX cannot start.

Two ways a run ends up on the CPU by mistake, both reported here:

- ``JAX_PLATFORMS`` asks for an accelerator. JAX 0.10 raises when it cannot start the only platform named
  (``JAX_PLATFORMS=tpu`` without libtpu, ``=cuda`` without the CUDA plugin); :func:`init_devices` turns that
  into :class:`HardwareError` (exit 2). With a fallback in the list (``JAX_PLATFORMS=cuda,cpu``) JAX quietly
  runs on the CPU; :func:`fallback_warning` says so.
- ``JAX_PLATFORMS`` is unset on a TPU VM or a GPU box, but the installed jaxlib has no plugin for it
  (``pip install jax`` instead of ``.[tpu]``/``.[cuda]``): the device files are there and JAX uses the CPU.

What the machine has, and the platform nash_mhc picks when the user names none, is
:mod:`nash_mhc.platforms` (applied by every program when it starts); its helpers are re-exported here.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from nash_mhc.platforms import (
    default_platforms,
    detect_accelerator,
    libtpu_installed,
    requested_platforms,
    select_platform,
    tpu_chips_on_pci,
)

ACCELERATORS = {"tpu": "tpu", "cuda": "gpu", "rocm": "gpu", "gpu": "gpu"}
INSTALL_HINT = {"tpu": "pip install -e \".[tpu]\" on the TPU VM; only one process may hold the TPU "
                       "(`sudo lsof -w /dev/accel* /dev/vfio/*` shows who does)",
                "gpu": "pip install -e \".[cuda]\" and check that `nvidia-smi` lists the GPUs"}


__all__ = ["ACCELERATORS", "HardwareError", "captured_native_stderr", "default_platforms", "detect_accelerator",
           "fallback_warning", "init_devices", "libtpu_installed", "main", "requested_platforms",
           "select_platform", "summary_lines", "tpu_chips_on_pci"]


class HardwareError(ValueError):
    """The platform a user asked for cannot be started (a one-line, user-facing message)."""


@contextlib.contextmanager
def captured_native_stderr() -> Iterator[list[bytes]]:
    """Redirect file descriptor 2 (native libraries' stderr, e.g. libtpu's start-up errors) to a buffer.

    Yields a list that holds the captured bytes once the block has ended; nothing is written to stderr.
    """
    captured: list[bytes] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as buffer:
        os.dup2(buffer.fileno(), 2)
        try:
            yield captured
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            buffer.seek(0)
            captured.append(buffer.read())


def init_devices(env: Mapping[str, str] | None = None) -> list[Any]:
    """``jax.devices()``, with a failure to start a requested platform turned into :class:`HardwareError`.

    When ``JAX_PLATFORMS`` asks for an accelerator, what its runtime prints while starting is held back: it
    is shown when the accelerator started, and dropped when it did not (the one-line error, or the CPU
    fallback warning of :func:`fallback_warning`, says what happened instead).
    """
    import jax

    requested = requested_platforms(env)
    quiet = captured_native_stderr() if any(p in ACCELERATORS for p in requested) else contextlib.nullcontext()
    try:
        with quiet as captured:
            devices = list(jax.devices())
        if captured and devices[0].platform != "cpu":
            sys.stderr.write(captured[0].decode(errors="replace"))
        return devices
    except Exception as error:  # noqa: BLE001 - JAX raises RuntimeError, AssertionError, ... here
        if not requested:
            raise
        wanted = ",".join(requested)
        kinds = {ACCELERATORS[p] for p in requested if p in ACCELERATORS}
        hint = "; ".join(INSTALL_HINT[k] for k in sorted(kinds)) or "check the platform names (cpu, tpu, cuda)"
        detail = str(error).splitlines()[0].split(" (set JAX_PLATFORMS")[0] if str(error) else ""
        raise HardwareError(f"JAX_PLATFORMS={wanted!r} but JAX cannot start it "
                            f"({type(error).__name__}{': ' + detail if detail else ''}); {hint}; "
                            "or unset JAX_PLATFORMS to let JAX choose") from error


def fallback_warning(platform: str, env: Mapping[str, str] | None = None,
                     exists: Callable[[str], bool] = os.path.exists) -> str | None:
    """A warning line when an accelerator was asked for or is present but JAX runs on ``platform`` cpu."""
    if platform != "cpu":
        return None
    asked = [p for p in requested_platforms(env) if p in ACCELERATORS]
    if asked:
        kind = ACCELERATORS[asked[0]]
        return (f"WARNING: JAX_PLATFORMS asks for {','.join(asked)} but JAX fell back to the CPU: the {kind} "
                f"could not be started ({INSTALL_HINT[kind]})")
    present = detect_accelerator(env, exists)
    if present:
        return (f"WARNING: this machine has a {present.upper()} but JAX is running on the CPU "
                f"({INSTALL_HINT[present]}; set JAX_PLATFORMS={'tpu' if present == 'tpu' else 'cuda'} to make "
                "this an error)")
    return None


def initialize_distributed(env: Mapping[str, str] | None = None) -> None:
    """``jax.distributed.initialize`` from JAX_COORDINATOR_ADDRESS / JAX_PROCESS_COUNT / JAX_PROCESS_INDEX
    (CPU processes use gloo collectives), or with cluster auto-detection when NASH_MHC_DISTRIBUTED=1 (the pod
    launcher sets it on every worker) or TPU_WORKER_HOSTNAMES lists several workers. No-op otherwise."""
    import jax

    env = os.environ if env is None else env
    address = env.get("JAX_COORDINATOR_ADDRESS")
    if address:
        count, index = env.get("JAX_PROCESS_COUNT"), env.get("JAX_PROCESS_INDEX")
        if count is None or index is None:
            raise ValueError("JAX_COORDINATOR_ADDRESS is set: also set JAX_PROCESS_COUNT and JAX_PROCESS_INDEX")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=address, num_processes=int(count), process_id=int(index))
    elif env.get("NASH_MHC_DISTRIBUTED") == "1" or "," in env.get("TPU_WORKER_HOSTNAMES", ""):
        jax.distributed.initialize()  # cluster auto-detection (Cloud TPU pod slices, SLURM, ...)


def _memory(device: Any) -> str | None:
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - not every backend implements memory_stats
        return None
    limit = (stats or {}).get("bytes_limit")
    return f"{limit / 2**30:.1f} GiB" if limit else None


def summary_lines(devices: Sequence[Any] | None = None, env: Mapping[str, str] | None = None,
                  exists: Callable[[str], bool] = os.path.exists) -> list[str]:
    """Start-up summary: devices, platform and kind, process/host layout, and a CPU-fallback warning."""
    import jax

    devices = list(jax.devices() if devices is None else devices)
    first = devices[0]
    count, index = jax.process_count(), jax.process_index()
    local = [d for d in devices if d.process_index == index]
    hosts = len({d.process_index for d in devices})
    lines = [f"devices: {len(devices)} x {first.device_kind} ({first.platform}), {count} process(es)",
             f"layout: process {index} of {count}, {len(local)} local device(s) per process, {hosts} host(s)"
             + (f", {len({getattr(d, 'slice_index', 0) for d in devices})} slice(s)"
                if getattr(first, "slice_index", None) is not None else "")]
    details = [f"jax {jax.__version__}"]
    accelerator_type = (os.environ if env is None else env).get("TPU_ACCELERATOR_TYPE")
    if accelerator_type:
        details.append(f"TPU slice {accelerator_type}")
    memory = _memory(first)
    if memory:
        details.append(f"{memory} memory per device")
    lines.append("platform: " + ", ".join(details))
    warning = fallback_warning(first.platform, env, exists)
    if warning:
        lines.append(warning)
    return lines


def main(argv: list[str] | None = None) -> int:
    """Print the hardware summary (after ``jax.distributed`` set-up on pods); exit 2 on a platform error."""
    del argv
    select_platform()
    try:
        initialize_distributed()
        devices = init_devices()
    except (HardwareError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for line in summary_lines(devices):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
