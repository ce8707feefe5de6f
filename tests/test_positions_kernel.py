"""The per-position Pallas kernel (nash_mhc.kernels.tpu.positions_kernel) and the Nash solve run in it, in Pallas'
interpreter: the equilibrium against the float64 reference and the XLA loop, the declared cost against a hand count,
the tiles."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref

from nash_mhc.kernels.tpu.positions_kernel import elementwise_cost, position_rows, run_positions
from nash_mhc.ops import aggregation, equilibrium
from nash_mhc.ops.game import centred_gram, largest_eigenvalue

pytestmark = pytest.mark.kernels  # the quick loop leaves them to the rest (docs/testing.md)

ITERS = 16


@functools.cache
def game(seed: int = 0, positions: int = 1024, dim: int = 16):
    """Three scale outputs [1, P, 3, D] of unequal sizes and agreement, the coarser two missing at the first
    positions and at random others; the game's (gram, prior, effective temperature, available)."""
    rng = np.random.default_rng(seed)
    common = rng.normal(size=(positions, 1, dim))
    outputs = (0.6 * common + 0.8 * rng.normal(size=(positions, 3, dim))) * np.array([1.0, 3.0, 0.3])[None, :, None]
    available = np.ones((positions, 3), bool)
    available[:4, 1:] = False
    available[:, 2] &= rng.random(positions) < 0.7
    prior = np.array([0.5, -0.3, 0.2], np.float32)
    tau = np.float32(0.02)
    slabs = [jnp.asarray(outputs[None, :, s].astype(np.float32)) for s in range(3)]
    raw, scale = centred_gram(slabs, jnp.asarray(available[None]))
    gram = raw / scale[..., None, None]
    effective = tau + aggregation.FLOOR * largest_eigenvalue(gram, jnp.asarray(available[None]))
    inputs = (gram, jnp.broadcast_to(jnp.asarray(prior), (1, positions, 3)), effective, jnp.asarray(available[None]))
    return outputs.astype(np.float32), available, prior, tau, inputs


@functools.cache
def kernel_solve(seed: int = 0):
    return jax.jit(functools.partial(equilibrium._equilibrium_kernel, max_iters=ITERS, interpret=True))(
        *game(seed)[-1])


def test_the_kernel_solves_the_game_to_the_float64_reference_equilibrium():
    outputs, available, prior, tau, _ = game()
    w, residual, z = (np.asarray(a) for a in kernel_solve())
    ref_w, _ = ref.nash(outputs, available, prior, float(tau))
    assert residual.max() <= 1e-5
    assert np.all(w[0][~available] == 0.0)
    np.testing.assert_allclose(w[0], ref_w, atol=1e-4)  # as the XLA solve's reference test (tests/test_nash.py)
    assert np.all(np.isfinite(z))


def test_the_kernel_equals_the_xla_loop_to_float32_rounding():
    """Same steps, same frozen positions: the kernel's fixed-length loop and XLA's early stop agree to a few
    float32 ulps (the two programs fuse and round the same arithmetic differently)."""
    inputs = game()[-1]
    xla = jax.jit(functools.partial(equilibrium._equilibrium_xla, max_iters=ITERS))(*inputs)
    for a, b in zip(kernel_solve(), xla, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6, rtol=0)


def test_a_kernel_with_one_step_is_not_the_converged_solve():
    """The loop's length reaches the kernel: one Newton step leaves a larger residual than sixteen."""
    one = jax.jit(functools.partial(equilibrium._equilibrium_kernel, max_iters=1, interpret=True))(*game()[-1])
    assert float(jnp.max(one[1])) > 10 * float(jnp.max(kernel_solve()[1]))


def test_declared_cost_counts_the_function_operations_and_loop_trips():
    def fn(a, b):
        x = a[0] * b[0] + 1.0  # 2 flops
        y = jax.lax.fori_loop(0, 5, lambda _, v: v * 2.0, x)  # 5
        return [[jnp.exp(y), jnp.where(y > 0, y, a[1])]]  # 1 transcendental, 2 flops (compare, select)

    cost = elementwise_cost(fn, [2, 1], [2], 1024)
    assert (cost.flops, cost.transcendentals, cost.bytes_accessed) == (9 * 1024, 1024, 4 * 1024 * 5)

    with pytest.raises(ValueError, match="while loop"):
        elementwise_cost(lambda a: [[jax.lax.while_loop(lambda v: v < 1, lambda v: v + 1, a[0])]], [1], [1], 1)
    with pytest.raises(ValueError, match="not elementwise"):
        elementwise_cost(lambda a: [[jnp.sum(jnp.stack(a))]], [2], [1], 1)


def test_run_positions_tiles_and_rejects_positions_it_cannot_tile():
    assert [position_rows(p) for p in (1024, 3072, 8192, 16384, 1000, 128)] == [8, 24, 64, 64, None, None]
    x = jnp.arange(2 * 2048, dtype=jnp.float32).reshape(2, 2048)
    (out,) = run_positions(lambda a: [[a[0] * a[1], a[1] - a[0]]], [x], [2], interpret=True)
    np.testing.assert_array_equal(np.asarray(out), np.stack([x[0] * x[1], x[1] - x[0]]))
    with pytest.raises(ValueError, match="multiples of 1024"):
        run_positions(lambda a: [a], [jnp.zeros((1, 1000))], [1], interpret=True)


def test_sixteen_steps_reach_a_float32_fixed_point_so_more_change_no_bit():
    """The kernel runs every step of its loop (no early stop): after the default 16 each position sits at a float32
    fixed point (frozen, or a step that moves nothing), so 40 steps give the same bits."""
    more = jax.jit(functools.partial(equilibrium._equilibrium_kernel, max_iters=40, interpret=True))(*game()[-1])
    for a, b in zip(more, kernel_solve(), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
