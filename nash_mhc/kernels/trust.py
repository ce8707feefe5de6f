"""``auto`` checks before it trusts: the training program runs the kernels check for its step before the first step.

On a platform whose kernels are checked (TPU; a GPU once GPU kernels exist), :func:`trusted_kernels` runs
:func:`nash_mhc.kernels.check.run_check` for the step's model and per-host batch on the local devices. Under
``auto`` a failing kernel runs its XLA form for the whole run (:func:`nash_mhc.ops.dispatch.disable_kernels`),
with one warning line naming it and its error; under ``pallas`` a failure is a one-line error (exit 2); ``xla``
runs no kernel and checks none. The result is kept under the compile-cache directory, keyed by the device kind and
count, the JAX and libtpu versions, a hash of the kernels' source and the step's shapes; on a pod process 0 checks
and its decision is shared with every host.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np

from nash_mhc.config import ModelConfig
from nash_mhc.ops import dispatch
from nash_mhc.training.config import TrainConfig

CHECKED_PLATFORMS = ("tpu",)
# Internal, for tests only: comma-separated further platforms whose kernels are checked ("cpu": interpreted).
CHECK_PLATFORMS_ENV = "NASH_MHC_KERNELS_CHECK_PLATFORMS"
SOURCES = ("ops", "kernels/tpu", "layers")  # the packages holding the kernels and their dispatch sites


class KernelsFailed(ValueError):
    """A kernel failed its check under ``--kernels pallas`` (one line)."""


def checks_here() -> bool:
    """Whether this host's devices are on a platform whose kernels are checked before they are trusted."""
    extra = [p for p in os.environ.get(CHECK_PLATFORMS_ENV, "").split(",") if p]
    return jax.local_devices()[0].platform in (*CHECKED_PLATFORMS, *extra)


def source_hash() -> str:
    """SHA-256 of the kernels' source (every module of nash_mhc.ops, nash_mhc.kernels.tpu and nash_mhc.layers)."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent
    for path in sorted(p for package in SOURCES for p in (root / package).glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def cache_key(model_config: ModelConfig, train_config: TrainConfig) -> str:
    device = jax.local_devices()[0]
    identity = {"device": device.device_kind, "devices": jax.local_device_count(), "jax": jax.__version__,
                "jaxlib": _version("jaxlib"), "libtpu": _version("libtpu"), "source": source_hash(),
                "model": dataclasses.asdict(model_config), "train": dataclasses.asdict(train_config),
                "broken": os.environ.get(dispatch.BREAK_KERNEL, "")}  # the test hook's kernels
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _cache_file(cache_dir: str | None, key: str) -> Any:
    if not cache_dir or cache_dir.lower() == "none":
        return None
    from nash_mhc import paths

    return paths.as_path(cache_dir) / "kernels_check" / f"{key}.json"


def _check(model_config: ModelConfig, train_config: TrainConfig) -> dict[str, Any]:
    from nash_mhc.kernels.check import run_check

    report = run_check(model_config, train_config, repeats=1)
    failed = {r.name: f"{', '.join(r.kernels)}: relative error forward {r.forward[1]:.1e}"
                      + ("" if r.vjp is None else f", VJP {r.vjp[1]:.1e}") + f" > {r.tolerance:.0e}"
              for r in report.results if not r.ok}
    return {"target": report.target, "kernels": len(report.results), "failed": failed,
            "unchecked": sorted(report.unchecked)}


def _shared(result: dict[str, Any] | None) -> dict[str, Any]:
    """Process 0's ``result`` on every process (the others pass None)."""
    if jax.process_count() == 1:
        return result
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(result).encode(), np.uint8) if jax.process_index() == 0 else np.zeros(0, np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.int32(data.size)))
    buffer = data if data.size == size else np.zeros(size, np.uint8)
    return json.loads(bytes(np.asarray(multihost_utils.broadcast_one_to_all(buffer))).decode())


def check_result(model_config: ModelConfig, train_config: TrainConfig, cache_dir: str | None) -> dict[str, Any]:
    """The check's result for the step (``failed``: {choice name: error line}), from the cache or run by process 0
    on its local devices at its share of the batch, and shared with every process."""
    host_config = dataclasses.replace(train_config, batch_size=train_config.batch_size // jax.process_count())
    result = None
    if jax.process_index() == 0:
        cached = _cache_file(cache_dir, cache_key(model_config, host_config))
        try:
            result = json.loads(cached.read_text()) if cached is not None and cached.exists() else None
        except (OSError, ValueError):
            result = None
        if result is None:
            result = _check(model_config, host_config)
            try:
                if cached is not None:
                    cached.parent.mkdir(parents=True, exist_ok=True)
                    cached.write_text(json.dumps(result))
            except OSError:
                pass  # an unwritable cache only costs the next run the check
        else:
            result["cached"] = True
    return _shared(result)


def trusted_kernels(kernels: str, model_config: ModelConfig, train_config: TrainConfig, cache_dir: str | None
                    ) -> frozenset[str]:
    """The names of the step's kernels to run as their XLA form (to :func:`nash_mhc.ops.dispatch.disable_kernels`):
    under ``auto`` on a checked platform those that fail their check, each with a warning line on stderr. Raises
    :class:`KernelsFailed` under ``pallas`` when one fails."""
    if kernels == "xla" or not checks_here():
        return frozenset()
    result = check_result(model_config, train_config, cache_dir)
    failed = result["failed"]
    if kernels == "pallas" and failed:
        name, why = next(iter(failed.items()))
        raise KernelsFailed(f"kernel {name} fails its check against XLA on {result['target']} ({why}); "
                            f"{len(failed)} failing; train with --kernels auto or xla")
    for name, why in failed.items():
        print(f"WARNING: kernel {name} differs from its XLA form on {result['target']} ({why}): this run uses "
              "its XLA form", file=sys.stderr, flush=True)
    if result["unchecked"]:
        print(f"WARNING: kernels in no checked choice: {', '.join(result['unchecked'])}", file=sys.stderr)
    print(f"kernels check: {result['kernels'] - len(failed)} of {result['kernels']} kernels match XLA on "
          f"{result['target']}" + (" (cached)" if result.get("cached") else ""), flush=True)
    return frozenset(failed)


__all__ = ["CHECKED_PLATFORMS", "CHECK_PLATFORMS_ENV", "KernelsFailed", "cache_key", "check_result",
           "checks_here", "source_hash", "trusted_kernels"]
