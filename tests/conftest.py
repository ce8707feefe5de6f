"""Test-suite set-up: the CPU platform with 8 host devices on every machine, XLA CPU's machine code unoptimised
and from its older emitters (faster compiles), the jaxtyping import hook over the whole package, float32 matmuls
at full precision, one persistent XLA compilation cache for the whole run, and per-test timeouts (longer for
``slow`` tests)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

# The suite runs the same on a TPU VM or GPU host as on a CPU: the CPU platform with 8 fake devices for the
# sharding tests (accelerator throughput lives in benchmarks/). Both must be set before JAX starts a backend.
os.environ["JAX_PLATFORMS"] = "cpu"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# XLA's CPU backend compiles the test process's programs faster than XLA's defaults (the quick loop is mostly XLA
# CPU compiles; docs/testing.md, Time):
# - LLVM's optimisation of the machine code off (`-O0`): about a third off each compile. XLA's own HLO passes are
#   the same at every level; the machine code is about 2 x slower and its rounding can differ in the last bits.
# - XLA CPU's older elemental emitters instead of its MLIR fusion emitters: about half of what is left. XLA forms
#   some CPU fusions and reductions differently for them, so the CPU program's fusions differ from a user's CPU
#   run; its sharding, collectives and math do not, nor does any other platform's program.
# Every bit-for-bit test compares two programs compiled alike; the others compare against float64 references or
# golden files within tolerances. The programs the tests start get the same flags (helpers.cpu_env: their short
# runs are mostly compile), except the README's 100-step training of `small`, which compiles with XLA's defaults
# as users run it. libtpu's TPU compiles are unchanged by both. An XLA_FLAGS that names either keeps its own.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
if "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"

# Tests never touch the network: Hugging Face libraries must use only local files.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# One persistent XLA compilation cache for the whole run: the pytest process (or xdist's controller) makes it, its
# workers find it through the environment, and the training programs the tests start get it as their
# --compile-cache-dir (the ``cache_dir`` fixture), so a program compiled in one module, worker or subprocess is read
# back by the others (JAX's own threshold: programs that took 1 s or more to compile). The quick loop spends about
# two thirds of its time in XLA's CPU compiler (docs/testing.md). The process that made the directory removes it
# at the end (pytest_unconfigure).
XLA_CACHE_ENV = "NASH_MHC_TEST_XLA_CACHE"
if XLA_CACHE_ENV not in os.environ:
    os.environ[XLA_CACHE_ENV] = tempfile.mkdtemp(prefix="nash_mhc_test_xla_")
    _MADE_XLA_CACHE: str | None = os.environ[XLA_CACHE_ENV]
else:
    _MADE_XLA_CACHE = None

import jax  # noqa: E402
from jaxtyping import install_import_hook  # noqa: E402

# Every function and dataclass in nash_mhc gets a beartype-checked jaxtyping wrapper for the whole
# session, on top of the decorators the package applies itself.
with install_import_hook("nash_mhc", "beartype.beartype"):
    import nash_mhc  # noqa: F401
    import nash_mhc.data  # noqa: F401  (not imported by the package __init__)

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_compilation_cache_dir", os.environ[XLA_CACHE_ENV])


SLOW_TIMEOUT_S = 1800  # the default (pyproject.toml, [tool.pytest.ini_options] timeout) is for the others


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``slow`` tests get :data:`SLOW_TIMEOUT_S` unless they set a timeout of their own. (The order of the files
    is pytest-xdist's: ``--dist loadfile`` hands out the files with the most tests first.)"""
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))


def pytest_unconfigure(config: pytest.Config) -> None:
    """Remove the run's compilation cache, in the process that made it (xdist's controller, after its workers)."""
    if _MADE_XLA_CACHE is not None:
        shutil.rmtree(_MADE_XLA_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def fresh_jax_caches() -> object:
    """Drop every module's compiled programs when it ends: one pytest process compiles hundreds of them, and
    the full suite crashed once (SIGSEGV inside XLA's CPU compiler, in test_step) with all of them alive."""
    yield
    jax.clear_caches()


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    """The run's persistent XLA compilation cache (:data:`XLA_CACHE_ENV`), for the ``--compile-cache-dir`` of the
    training programs the tests start: a step compiled for one module's runs is not compiled again for another's,
    in either worker."""
    return Path(os.environ[XLA_CACHE_ENV])
