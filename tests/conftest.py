"""Test-suite set-up: type-check the whole package with the jaxtyping import hook, float32 everywhere."""

from __future__ import annotations

import jax
from jaxtyping import install_import_hook

# Every function and dataclass in nash_mhc gets a beartype-checked jaxtyping wrapper for the whole
# session, on top of the decorators the package applies itself.
with install_import_hook("nash_mhc", "beartype.beartype"):
    import nash_mhc  # noqa: F401

jax.config.update("jax_default_matmul_precision", "highest")
