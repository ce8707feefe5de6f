"""Test-suite set-up: the CPU platform with 8 host devices on every machine, the jaxtyping import hook over the
whole package, float32 matmuls at full precision, and per-test timeouts (longer for ``slow`` tests)."""

from __future__ import annotations

import os

import pytest

# The suite runs the same on a TPU VM or GPU host as on a CPU: the CPU platform with 8 fake devices for the
# sharding tests (accelerator throughput lives in benchmarks/). Both must be set before JAX starts a backend.
os.environ["JAX_PLATFORMS"] = "cpu"
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


SLOW_TIMEOUT_S = 1800  # the default (pyproject.toml, [tool.pytest.ini_options] timeout) is for the others


# The longest test files first: pytest-xdist (``-n 2 --dist loadfile``) hands out whole files in collection
# order, so a long file collected last (test_train_cli.py, about 11 minutes of subprocess trainings) would run
# alone at the end while the other worker idles. Longest first (by their measured durations) keeps both busy.
LONGEST_FIRST = ("test_train_cli.py", "test_step.py", "test_checkpoint_integrity.py", "test_generate.py",
                 "test_study.py", "test_docs.py", "test_data_sources.py", "test_integrations.py", "test_notebook.py",
                 "test_model.py", "test_bf16.py",
                 "test_examples.py", "test_nash.py", "test_evaluate.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``slow`` tests get :data:`SLOW_TIMEOUT_S` unless they set a timeout of their own; the files of
    :data:`LONGEST_FIRST` run first, in that order (the others after them, in their own order)."""
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order


@pytest.fixture(autouse=True, scope="module")
def fresh_jax_caches() -> object:
    """Drop every module's compiled programs when it ends: one pytest process compiles hundreds of them, and
    the full suite crashed once (SIGSEGV inside XLA's CPU compiler, in test_step) with all of them alive."""
    yield
    jax.clear_caches()


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory):
    """One persistent XLA compilation cache for the training-program subprocesses of every test module, so a
    step compiled for one module's runs is not compiled again for another's."""
    return tmp_path_factory.mktemp("xla_cache")
