"""Helpers the test modules share: the repository root, subprocess environments, the model modes the quick loop
covers, train-like parameters, a checkpoint without a run, a few train steps, and what Pallas kernels declare and
move."""

from __future__ import annotations

import importlib.util
import itertools
import os
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.extend
import numpy as np
import pytest

from nash_mhc.training import train_step
from nash_mhc.training.checkpoint import Checkpointer

ROOT = Path(__file__).resolve().parents[1]

# the TPU compiler's tests (libtpu compiles for abstract TPU devices on this CPU host)
needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="needs libtpu (pip install -e '.[tpu]')")

# (residual, attention, aggregation) modes of the quick loop's per-mode invariant tests: the default mode, each
# residual with full attention, each aggregation with mHC and multiscale attention.
# Every residual, attention and aggregation code path runs; the rest of the product runs with the slow tests.
QUICK_MODES = frozenset({("mhc", "multiscale", "nash"), ("mhc", "full", "nash"), ("hc", "full", "nash"),
                         ("plain", "full", "nash"), ("mhc", "multiscale", "gate"), ("mhc", "multiscale", "convex"),
                         ("mhc-lite", "full", "nash")})


def perturbed(model: Any, scale: float = 0.05, seed: int = 1) -> Any:
    """``model`` with every array leaf moved by ``scale`` x N(0, 1) (a stand-in for trained parameters: no branch
    is inert, no symmetry holds). On the host in NumPy: the sum is the same float32 rounding as XLA's, and no
    program is compiled per leaf shape (jax.random and eager adds compiled one each: about 5 s per model)."""
    leaves, treedef = jax.tree.flatten(eqx.filter(model, eqx.is_array))
    rng = np.random.default_rng(seed)
    moved = [jax.numpy.asarray(np.asarray(x) + (scale * rng.standard_normal(x.shape)).astype(x.dtype))
             for x in leaves]
    return eqx.combine(jax.tree.unflatten(treedef, moved), model)


def mode_case(mode: tuple[str, str, str], *rest: Any) -> Any:
    """A parametrize case of ``mode`` followed by ``rest``: marked slow unless the mode is in QUICK_MODES."""
    return (*mode, *rest) if tuple(mode) in QUICK_MODES else pytest.param(*mode, *rest, marks=pytest.mark.slow)


def suite_xla_flags() -> str:
    """The suite's CPU optimisation level and emitters as XLA_FLAGS (tests/conftest.py): what :func:`cpu_env`
    gives a child process unless it trains long enough that its steps outweigh the compile (``optimised``), and
    what a child whose results a test compares bit for bit with its own must have."""
    return " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                    if f.startswith(("--xla_backend_optimization_level", "--xla_cpu_use_fusion_emitters")))


# A test that compares its compiled program bit for bit with another made differently (an effect added, a function
# compiled alone), or counts the ops of its fusions, compiles with XLA CPU's default fusion emitters, as users' CPU
# programs are: jax.jit(..., compiler_options=USERS_CPU_EMITTERS) or .compile(compiler_options=...) (conftest.py).
USERS_CPU_EMITTERS = {"xla_cpu_use_fusion_emitters": True}


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without JAX's, libtpu's and XLA's settings (a child picks its own), plus
    ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "TPU_")) and k != "XLA_FLAGS"}
    return {**env, **extra}


def cpu_env(devices: int = 1, optimised: bool = False, **extra: str) -> dict[str, str]:
    """The environment of a child program on the CPU platform with ``devices`` host devices, compiling at the
    suite's level (:func:`suite_xla_flags`: a short run's compile is most of its time), or at XLA's default level,
    as users run it, where ``optimised``."""
    level = "" if optimised else f" {suite_xla_flags()}"
    return clean_env(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}{level}".strip(),
                     JAX_PLATFORMS="cpu", **extra)


def write_checkpoint(directory: Path, step: int, state: Any, model_config: Any, train_config: Any) -> dict:
    """Save ``state`` as step ``step`` of a ``synthetic``/``bytes`` run in ``directory``; returns its metadata."""
    meta = {"step": step, "data": {"dataset": "synthetic", "tokenizer": "bytes"}, "rng": {"seed": 0},
            "model_config": model_config.to_dict(), "train_config": train_config.to_dict()}
    checkpointer = Checkpointer(directory)
    checkpointer.save(step, state, meta)
    checkpointer.wait()
    checkpointer.close()
    return meta


def run_steps(state: Any, batches: list[Any]) -> tuple[Any, list[float]]:
    """(the state after one ``train_step`` per batch, each step's loss)."""
    losses = []
    for batch in batches:
        state, metrics = train_step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


def equations(jaxpr: Any) -> list[Any]:
    """Every equation of a (closed) jaxpr and of the jaxprs nested in its equations (scan, cond, remat,
    custom_jvp/vjp, pjit, shard_map bodies), each equation before those nested in it."""
    found = []
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        found.append(eqn)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += equations(sub)
    return found


def declared(fn: Any, *args: Any, live: bool = False) -> list[Any]:
    """The CostEstimate of every pallas_call in fn's jaxpr (sub-jaxprs included), in order; with ``live`` only
    those whose results are read (after dead-code elimination, as the compiler runs it: the VJP in the backward
    rule of ``nash_mhc.ops.dispatch.platform_vjp`` traces a forward kernel that nothing reads)."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    if live:
        from jax._src.interpreters.partial_eval import dce_jaxpr  # no public API for it
        jaxpr = dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))[0]
    return [eqn.params["cost_estimate"] for eqn in equations(jaxpr) if eqn.primitive.name == "pallas_call"]


def moved(grid: tuple[int, ...], operands: list[tuple[int, Any]]) -> int:
    """HBM bytes of a grid walked in order (the last axis innermost), an operand's tile moved whenever its block
    index differs from the previous step's; ``operands`` are (tile bytes, index(*program ids))."""
    total = 0
    for tile_bytes, index in operands:
        last = None
        for ids in itertools.product(*map(range, grid)):
            total += tile_bytes * (index(*ids) != last)
            last = index(*ids)
    return total
