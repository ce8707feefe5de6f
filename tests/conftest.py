"""Test-suite set-up: type-check the whole package with the jaxtyping import hook, float32 everywhere."""

from __future__ import annotations

import os

# 8 fake CPU devices for the sharding tests; must be set before JAX initialises its backend.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

# Tests never touch the network: Hugging Face libraries must use only local files.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import jax  # noqa: E402
from jaxtyping import install_import_hook  # noqa: E402

# Every function and dataclass in nash_mhc gets a beartype-checked jaxtyping wrapper for the whole
# session, on top of the decorators the package applies itself.
with install_import_hook("nash_mhc", "beartype.beartype"):
    import nash_mhc  # noqa: F401
    import nash_mhc.data  # noqa: F401  (not imported by the package __init__)

jax.config.update("jax_default_matmul_precision", "highest")
