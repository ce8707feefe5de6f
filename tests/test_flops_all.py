"""``ModelConfig.flops_per_token_all`` (nash_mhc.flops) against XLA's count of the compiled train step.

The reference is ``compiled.cost_analysis()`` of the real train step (``training.step._train_step_jit``: forward,
backward, optimizer) on one CPU device, ``flops + transcendentals`` (the count's convention: a transcendental is 1
op). XLA counts a ``while`` body once whatever its trip count, so every loop is unrolled before lowering: each
``jax.lax.scan`` (the layer scan, Sinkhorn's rounds forward and back, the microbatch and loss scans) and
``jax.lax.fori_loop`` gets ``unroll=True``, and the Nash solver's early-stopping ``while_loop`` is replaced by its
fixed-trip-count form (the one its TPU kernel runs: all ``nash_iters`` steps, done positions frozen, the same
values), so the compiled program has no loop left (checked). The optimizer's work is per step, not per token, and
the count leaves it out: it is subtracted as XLA's count of the step's non-model part (global norm, AdamW update,
the finite-check selects, the travel metrics) compiled on its own. What is left is forward + backward per token.
"""

from __future__ import annotations

import contextlib

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import USERS_CPU_EMITTERS

from nash_mhc.config import ModelConfig
from nash_mhc.ops import equilibrium
from nash_mhc.sharding import make_mesh
from nash_mhc.tpu_compile.fit import abstract_batch, abstract_train_state
from nash_mhc.training import step as step_module
from nash_mhc.training.config import TrainConfig

BATCH = 2


@contextlib.contextmanager
def no_loops():
    """Every scan and fori_loop traced inside is unrolled; the Nash solve runs its fixed ``nash_iters`` steps."""
    scan, fori, solve = jax.lax.scan, jax.lax.fori_loop, equilibrium._equilibrium_xla

    def unrolled_scan(f, init=None, xs=None, length=None, reverse=False, unroll=1, **kwargs):
        return scan(f, init, xs, length=length, reverse=reverse, unroll=True, **kwargs)

    def unrolled_fori(lower, upper, body, init, unroll=None):
        return fori(lower, upper, body, init, unroll=True)

    def fixed(gram, prior, temperature, available, max_iters):
        w, distance, z = equilibrium._equilibrium_entries(
            equilibrium._matrix_entries(gram), equilibrium._entries(prior), temperature,
            equilibrium._entries(available), equilibrium.TOLERANCE[jnp.dtype(gram.dtype)], max_iters, fixed=True)
        return jnp.stack(w, axis=-1), distance, jnp.stack(z, axis=-1)

    jax.lax.scan, jax.lax.fori_loop, equilibrium._equilibrium_xla = unrolled_scan, unrolled_fori, fixed
    try:
        yield
    finally:
        jax.lax.scan, jax.lax.fori_loop, equilibrium._equilibrium_xla = scan, fori, solve


def compiled_counts(config: ModelConfig) -> tuple[float, float]:
    """(XLA's flops + transcendentals of the whole train step, of its optimizer part alone)."""
    mesh = make_mesh(devices=jax.devices()[:1])
    state = abstract_train_state(config, TrainConfig(batch_size=BATCH), mesh)
    with no_loops():
        compiled = jax.jit(lambda b, s: step_module._train_step_jit(b, s)).lower(
            abstract_batch(BATCH, config.seq_len, mesh), state).compile(USERS_CPU_EMITTERS)
    assert " while(" not in compiled.as_text()  # the older emitters loop over a scatter-add (tests/helpers.py)

    def inexact(x):
        return isinstance(x, jax.ShapeDtypeStruct) and jnp.issubdtype(x.dtype, jnp.inexact)

    grads = eqx.filter(state.model, inexact)

    @eqx.filter_jit
    def optimizer_part(state, grads):
        params, static = eqx.partition(state.model, eqx.is_inexact_array)
        finite = jnp.isfinite(step_module.global_norm(grads))
        updates, opt_state = state.optimizer.update(grads, state.opt_state, params)
        new = jax.tree.map(lambda a, b: jnp.where(finite, a, b), optax.apply_updates(params, updates), params)
        opt_state = jax.tree.map(lambda a, b: jnp.where(finite, a, b), opt_state, state.opt_state)
        return new, opt_state, step_module.travel(eqx.combine(new, static), state.anchor)

    optimizer = jax.jit(lambda s, g: optimizer_part(s, g)).lower(state, grads).compile(USERS_CPU_EMITTERS)

    def total(c):
        cost = c.cost_analysis()
        return cost["flops"] + cost.get("transcendentals", 0.0)

    return total(compiled), total(optimizer)


# A compile of a train step each, and an accounting check rather than an invariant: all with the slow tests.
pytestmark = pytest.mark.slow

CASES = [
    ("plain", "full", "nash", {}),
    ("plain", "multiscale", "convex", {}),
    pytest.param("mhc", "full", "nash", {}, marks=pytest.mark.xfail(  # a known gap
        strict=True, reason="Sinkhorn: XLA counts ~125 ops per matrix entry and round, the count 30 (see report)")),
    ("mhc", "multiscale", "nash", {"nash_iters": 2}),
]


@pytest.mark.parametrize("residual, attention, aggregation_mode, overrides", CASES)
def test_flops_per_token_all_within_15_percent_of_the_compiled_train_step(residual, attention, aggregation_mode,
                                                                           overrides):
    """The count per token against XLA's count of the same step without its optimizer, per token (module
    docstring), within 15 %; and it exceeds the matmul-only ``flops_per_token`` by what it adds."""
    config = ModelConfig.preset("tiny", residual=residual, attention=attention, aggregation=aggregation_mode,
                                **overrides)
    step, optimizer = compiled_counts(config)
    assert 0 < optimizer < 0.1 * step  # the step holds the optimizer: a per-parameter cost, small at this batch
    reference = (step - optimizer) / (BATCH * config.seq_len)
    assert config.flops_per_token_all() > config.flops_per_token()
    assert config.flops_per_token_all() / reference == pytest.approx(1.0, abs=0.15)
