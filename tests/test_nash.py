"""The Nash aggregation, coarse-scale renormalisation and published Hyper-Connections against float64 NumPy
references written from the equations (nash_mhc.ops.aggregation and nash_mhc.layers.hyperconnection
docstrings), never from the code's own helpers."""

from __future__ import annotations

import functools
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

from nash_mhc import LanguageModel, ModelConfig
from nash_mhc.layers.aggregation import ScaleAggregation
from nash_mhc.layers.hyperconnection import HyperConnection
from nash_mhc.ops import combine, gate_weights, nash_aggregate, nash_weights, normalised_entropy, prior_weights
from nash_mhc.ops.equilibrium import solve_small
from nash_mhc.ops.game import largest_eigenvalue, scale_game
from nash_mhc.sharding import BATCH_AXES, make_mesh

DEFAULT = ModelConfig.preset("tiny")


# The float64 NumPy reference of the game: tests/reference.py (nash_game, nash, gate).
reference_game, reference_nash = ref.nash_game, ref.nash
FLOOR = 1.05  # c of τ_eff = τ + c·λmax(C), as the docstring of nash_mhc.ops.aggregation states it


def slabs(outputs: jax.Array) -> list[jax.Array]:
    """The L scale outputs of a stacked [..., L, D] array as the separate [..., D] arrays the aggregation takes."""
    return [outputs[..., s, :] for s in range(outputs.shape[-2])]


@functools.cache
def jitted_weights(num_iters: int):
    return jax.jit(lambda outputs, *args: nash_weights(slabs(outputs), *args, num_iters=num_iters))


def random_outputs(seed: int, seq: int, scales: int, dim: int, spreads=(1.0, 2.0, 0.5)) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(seq, scales, dim)) * np.asarray(spreads)[None, :, None]).astype(np.float32)


def aggregation(mode: str, *, prior=None, temperature: float = DEFAULT.nash_temperature, dim: int = 16
                ) -> ScaleAggregation:
    layer = ScaleAggregation(3, mode, num_iters=DEFAULT.nash_iters, temperature=temperature, dim=dim)
    return layer if prior is None else eqx.tree_at(lambda m: m.prior, layer, jnp.asarray(prior, jnp.float32))


# ------------------------------------------------------------------------------------------ the solver
@st.composite
def games(draw):
    """Scale outputs whose per-scale sizes, agreement and dimension span what trained models produce.

    Shapes are fixed per dimension (one compile each); fewer scales are drawn through availability.
    """
    seq, scales = 8, 4
    dim = draw(st.sampled_from([2, 64]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    log_scale = draw(st.lists(st.floats(-4, 4), min_size=scales, max_size=scales))
    agreement = draw(st.floats(-1.0, 1.0))  # correlation with a common direction (negative: opposed)
    common = rng.normal(size=(seq, 1, dim))
    own = rng.normal(size=(seq, scales, dim))
    signs = np.where(np.arange(scales) % 2, np.sign(agreement), 1.0)[None, :, None]
    outputs = (abs(agreement) * common * signs + np.sqrt(1 - agreement**2) * own) * np.exp(log_scale)[None, :, None]
    available = rng.random((seq, scales)) < draw(st.floats(0.3, 1.0))
    available[:, 0] = True
    prior = np.asarray(draw(st.lists(st.floats(-4, 4), min_size=scales, max_size=scales)))
    tau = draw(st.floats(1e-4, 1e2))
    return outputs.astype(np.float32), available, prior.astype(np.float32), np.float32(tau)


@settings(max_examples=60, deadline=None)
@given(games())
def test_equilibrium_is_solved_to_tolerance_and_matches_the_reference(game):
    """Residual max_l |w - BR(w)| <= 1e-5 within the default steps, and the weights equal the float64 reference's
    equilibrium (best responses iterated until they stop moving)."""
    outputs, available, prior, tau = game
    w, residual = jitted_weights(DEFAULT.nash_iters)(jnp.asarray(outputs), jnp.asarray(available),
                                                     jnp.asarray(prior), jnp.asarray(tau))
    w, residual = np.asarray(w), np.asarray(residual)
    assert residual.max() <= 1e-5
    assert np.all(w >= 0) and np.all(w[~available] == 0.0)
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)
    ref_w, ref_residual = reference_nash(outputs, available, prior, float(tau))
    assert ref_residual.max() <= 1e-13
    # float32 vs float64 of O(1) quantities, amplified by at most 1/(1 - 1/c) = 21 near a critical game
    np.testing.assert_allclose(w, ref_w, atol=1e-4)


@pytest.mark.slow  # a property of the game; the reference test pins the solve in the quick loop
@settings(max_examples=40, deadline=None)
@given(games(), st.integers(0, 2**32 - 1))
def test_best_response_is_a_contraction_so_the_equilibrium_is_unique(game, seed):
    """|BR(w) - BR(w')| <= (λmax/τ_eff) |w - w'| < |w - w'| / c on the simplex (reference BR), and every start
    reaches one point."""
    outputs, available, prior, tau = game
    rng = np.random.default_rng(seed)
    br, start, idx, tau_eff = reference_game(outputs[0], available[0], prior, float(tau))
    factor = (tau_eff - float(tau)) / FLOOR / tau_eff  # λmax / τ_eff
    assert factor < 1 / FLOOR
    for _ in range(5):
        a, b = rng.dirichlet(np.ones(len(idx))), rng.dirichlet(np.ones(len(idx)))
        assert np.linalg.norm(br(a) - br(b)) <= factor * np.linalg.norm(a - b) + 1e-12
    ends = []
    for w in (start, rng.dirichlet(np.ones(len(idx))), np.eye(len(idx))[0]):
        for _ in range(2000):
            w = br(w)
        ends.append(w)
    np.testing.assert_allclose(ends[1], ends[0], atol=1e-12)
    np.testing.assert_allclose(ends[2], ends[0], atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(games())
def test_the_game_moves_each_log_odds_by_less_than_the_stated_bound(game):
    """The README's bound: for available l, m, |log(w_l/w_m) - (b_l - b_m)| <= 2 λmax max((1-w_l)², (1-w_m)²) / τ_eff
    < 2/c, so each weight stays within a factor exp(2/c) of softmax(b)_l."""
    outputs, available, prior, tau = game
    w = np.asarray(jitted_weights(DEFAULT.nash_iters)(jnp.asarray(outputs), jnp.asarray(available),
                                                      jnp.asarray(prior), jnp.asarray(tau))[0], np.float64)
    for t in range(w.shape[0]):
        _, prior_w, idx, tau_eff = reference_game(outputs[t], available[t], prior, float(tau))
        lam = (tau_eff - float(tau)) / FLOOR
        wt, b = w[t, idx], prior[idx].astype(np.float64)
        for i in range(len(idx)):
            for j in range(len(idx)):
                moved = abs(np.log(wt[i] / wt[j]) - (b[i] - b[j]))
                bound = 2 * lam * max((1 - wt[i]) ** 2, (1 - wt[j]) ** 2) / tau_eff
                assert moved <= bound + 1e-4 and bound < 2 / FLOOR
        assert np.all(np.abs(np.log(wt / prior_w)) < 2 / FLOOR + 1e-4)


def test_two_distinct_scales_move_the_weights_well_away_from_the_prior():
    """Two opposed scale outputs at τ → 0: the equilibrium moves from softmax(b) by >= 0.2 in total variation for
    some prior (the floor τ + 2|C|_F this replaced allows at most 0.11 here: each log-odds moved < 1 nat)."""
    rng = np.random.default_rng(3)
    o = rng.normal(size=(16,)).astype(np.float32)
    outputs = jnp.asarray(np.stack([o, -o])[None])
    available = jnp.ones((1, 2), bool)
    moves = []
    for p0 in (0.55, 0.6, 0.65, 0.7):
        prior = jnp.asarray([np.log(p0 / (1 - p0)), 0.0], jnp.float32)
        w, residual = nash_weights(slabs(outputs), available, prior, jnp.asarray(1e-6), num_iters=DEFAULT.nash_iters)
        assert float(residual[0]) <= 1e-5
        moves.append(0.5 * float(jnp.sum(jnp.abs(w[0] - prior_weights(prior, available)[0]))))
    assert max(moves) >= 0.2, moves


@pytest.mark.slow  # a property of the game; the reference test pins the solve in the quick loop
def test_rescaling_every_output_moves_no_weights_nor_sparsity_term():
    outputs = jnp.asarray(random_outputs(0, 24, 3, 16))
    available = jnp.asarray(np.arange(24)[:, None] + 1 >= np.array([1, 2, 4])[None, :])
    gate = jnp.asarray(np.random.default_rng(1).normal(size=(3, 3, 16)), jnp.float32)
    layers = [aggregation("nash", prior=[0.3, -0.2, 0.5], temperature=0.05),  # a trained-looking prior
              eqx.tree_at(lambda m: m.gate, aggregation("gate", prior=[0.3, -0.2, 0.5]), gate)]
    for layer in layers:
        base = layer(slabs(outputs), available)
        for factor in (1e-2, 10.0, 1e3):
            scaled = layer(slabs(outputs * factor), available)
            assert float(jnp.max(jnp.abs(scaled.weights - base.weights))) <= 1e-5, (layer.mode, factor)
            assert float(jnp.max(jnp.abs(scaled.entropy - base.entropy))) <= 1e-5
            assert float(jnp.max(jnp.abs(scaled.output - factor * base.output))) <= 1e-5 * factor


def test_gradients_through_the_solver_match_finite_differences_in_float64():
    """Implicit differentiation at the equilibrium (both modes) against finite differences of the solver."""
    with jax.enable_x64(True):
        outputs = jnp.asarray(random_outputs(1, 4, 3, 5), jnp.float64)
        available = jnp.asarray([[True, False, False], [True, True, False], [True, True, True],
                                 [True, True, True]])
        target = jnp.asarray(np.random.default_rng(2).normal(size=(4, 5)))

        def objective(outputs, prior, tau):  # check_grads passes NumPy arrays for the perturbed points
            outputs, prior, tau = jnp.asarray(outputs), jnp.asarray(prior), jnp.asarray(tau)
            w, _ = nash_weights(slabs(outputs), available, prior, tau, num_iters=DEFAULT.nash_iters)
            return jnp.sum(combine(slabs(outputs), w) * target) + jnp.sum(normalised_entropy(w, available))

        for tau in (0.3, 1e-3):  # a cold game is close to critical: the implicit solve matters most there
            args = (outputs, jnp.asarray([0.2, -0.1, 0.4], jnp.float64), jnp.asarray(tau, jnp.float64))
            check_grads(jax.jit(objective), args, order=1, modes=("rev", "fwd"))  # jit: one compile, not op by op


def test_the_fused_backward_of_the_nash_aggregation_matches_finite_differences_and_autodiff():
    """nash_aggregate (what the layer runs: one custom VJP over the sum and the game) against finite differences
    in float64, and against autodiff of combine(nash_weights) in float32: the same values, gradients within
    rounding. Every cotangent is used: of the sum, of the weights (the sparsity term) and of the residual."""
    available = jnp.asarray([[True, False, False], [True, True, False], [True, True, True], [True, True, True]])

    def objective(aggregate):
        def f(outputs, prior, tau):
            outputs, prior, tau = jnp.asarray(outputs), jnp.asarray(prior), jnp.asarray(tau)
            out, w, residual = aggregate(slabs(outputs), prior, tau)
            return (jnp.sum(out.astype(prior.dtype) * target.astype(prior.dtype))
                    + jnp.sum(normalised_entropy(w, available)) + jnp.sum(w[:, 1]) + jnp.sum(residual))
        return f

    def fused(outputs, prior, tau):
        return nash_aggregate(outputs, available, prior, tau, num_iters=DEFAULT.nash_iters)

    def composed(outputs, prior, tau):
        w, residual = nash_weights(outputs, available, prior, tau, num_iters=DEFAULT.nash_iters)
        return combine(outputs, w), w, residual

    with jax.enable_x64(True):
        target = jnp.asarray(np.random.default_rng(2).normal(size=(4, 5)))
        for tau in (0.3, 1e-3):
            args = (jnp.asarray(random_outputs(1, 4, 3, 5), jnp.float64), jnp.asarray([0.2, -0.1, 0.4], jnp.float64),
                    jnp.asarray(tau, jnp.float64))
            check_grads(jax.jit(objective(fused)), args, order=1, modes=("rev",))
    target = jnp.asarray(np.random.default_rng(2).normal(size=(4, 5)), jnp.float32)
    args = (jnp.asarray(random_outputs(1, 4, 3, 5)), jnp.asarray([0.2, -0.1, 0.4]), jnp.asarray(0.05))
    got, expected = (jax.jit(jax.value_and_grad(objective(f), argnums=(0, 1, 2)))(*args) for f in (fused, composed))
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(expected[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_every_aggregation_starts_almost_entirely_on_scale_zero():
    """softmax(b) at initialisation puts 0.99 on scale 0 where all three scales are available (more where fewer
    are), so the multiscale model starts as full attention; the game, a conformity game, only adds to it."""
    outputs = jnp.asarray(random_outputs(3, 64, 3, 16))
    available = jnp.asarray(np.arange(64)[:, None] + 1 >= np.array([1, 2, 4])[None, :])
    for mode in ("nash", "gate", "convex"):
        weights = eqx.filter_jit(lambda layer, o, a: layer(slabs(o), a).weights)(aggregation(mode), outputs, available)
        assert float(jnp.min(weights[:, 0])) >= 0.99 - 1e-6, mode
    np.testing.assert_allclose(np.asarray(prior_weights(aggregation("convex").prior, jnp.ones((1, 3), bool))),
                               [[0.99, 0.005, 0.005]], atol=1e-6)


def test_the_gate_starts_at_the_prior_and_learns_from_the_outputs():
    outputs = jnp.asarray(random_outputs(5, 16, 3, 16))
    available = jnp.ones((16, 3), bool)
    layer = aggregation("gate", prior=[0.3, -0.2, 0.5])
    initial = eqx.filter_jit(lambda layer: layer(slabs(outputs), available).weights)(layer)
    np.testing.assert_allclose(np.asarray(initial), np.asarray(prior_weights(layer.prior, available)), atol=1e-7)
    weights = jax.jit(lambda g: gate_weights(slabs(outputs), available, layer.prior, g))  # one compilation each
    grad = jax.jit(jax.grad(lambda g: jnp.sum(weights(g)[:, 1] * jnp.arange(16))))(layer.gate)
    assert float(jnp.max(jnp.abs(grad))) > 1e-3  # zero-initialised but not stuck
    assert float(jnp.max(jnp.abs(weights(grad) - initial))) > 0.01  # input-dependent


def test_the_temperature_is_learned_and_changes_the_weights():
    outputs = jnp.asarray(random_outputs(4, 16, 3, 16))
    available = jnp.ones((16, 3), bool)
    prior = jnp.asarray([0.5, 0.0, 0.0])
    weights = jax.jit(lambda t: nash_weights(slabs(outputs), available, prior, t, num_iters=16)[0])
    hot, cold = weights(jnp.asarray(10.0)), weights(jnp.asarray(0.01))
    assert float(jnp.max(jnp.abs(hot - cold))) > 0.02
    grad = jax.jit(jax.grad(lambda t: jnp.sum(weights(t)[:, 1])))(jnp.asarray(0.1))
    assert bool(jnp.isfinite(grad)) and float(grad) != 0.0


def test_weights_are_per_position_not_pooled():
    outputs = jnp.asarray(random_outputs(5, 12, 3, 8))
    available = jnp.ones((12, 3), bool)
    args = (jnp.zeros(3), jnp.asarray(0.1))
    a = jitted_weights(16)(outputs, available, *args)[0]
    b = jitted_weights(16)(outputs.at[-1, 2].multiply(50.0), available, *args)[0]
    assert np.array_equal(np.asarray(a[:-1]), np.asarray(b[:-1]))
    assert not np.array_equal(np.asarray(a[-1]), np.asarray(b[-1]))


def spread_of_games(seed: int, seq: int = 16) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``seq`` positions from agreeing to opposed scales (each converges in 3 to 5 Newton steps at this temperature)."""
    rng = np.random.default_rng(seed)
    common, own = rng.normal(size=(seq, 1, 16)), rng.normal(size=(seq, 3, 16))
    agreement = np.linspace(0.99, -0.99, seq)[:, None, None] * np.array([1.0, 1.0, -1.0])[None, :, None]
    outputs = np.abs(agreement) * common * np.sign(agreement) + np.sqrt(1 - agreement**2) * own
    available = np.ones((seq, 3), bool)
    available[::5, 2] = False
    return (jnp.asarray(outputs, jnp.float32), jnp.asarray(available), jnp.asarray([0.5, -1.0, 0.0]),
            jnp.asarray(1e-3))


def test_under_a_mesh_each_device_solves_its_own_positions_without_communication():
    """Batch split over 8 devices: one device's weights (to float32 rounding: XLA's CPU code for 4 positions
    may round differently from its code for 32), and no collective in the compiled program (the loop's stopping
    test is per device; over the whole batch it was an all-reduce in every Newton step)."""
    outputs, available, prior, tau = spread_of_games(2)
    outputs, available = jnp.tile(outputs, (2, 1, 1)), jnp.tile(available, (2, 1))  # 32 positions, 4 per device
    one = jitted_weights(16)(outputs, available, prior, tau)
    mesh = make_mesh(8, 1, 1)
    with jax.set_mesh(mesh):
        split = jax.device_put((outputs, available), NamedSharding(mesh, P(BATCH_AXES)))
        solve = jax.jit(lambda o, a, p, t: nash_weights(slabs(o), a, p, t, num_iters=16))
        sharded = solve(*split, prior, tau)
        compiled = solve.lower(*split, prior, tau).compile().as_text()
    for a, b in zip(sharded, one, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
    assert not re.search(r"all-reduce|all-gather|collective-permute|all-to-all", compiled)


def test_the_scale_that_disagrees_with_the_others_gets_the_least_weight():
    base = jax.random.normal(jax.random.key(1), (12, 1, 8))
    outputs = jnp.concatenate([base, base + 0.01, base + 5.0], axis=1)
    w = jitted_weights(16)(outputs, jnp.ones((12, 3), bool), jnp.zeros(3), jnp.asarray(0.1))[0]
    assert bool(jnp.all(w[:, 2] < w[:, 0] - 0.03)) and bool(jnp.all(w[:, 2] < w[:, 1] - 0.03))


@pytest.mark.slow  # out of the quick loop (its 5-minute budget): no invariant, the full run keeps it
def test_identical_outputs_give_finite_gradients():
    """Every scale agrees: all errors and the spread are exactly 0 (no sqrt(0) gradient)."""
    same = jnp.broadcast_to(jax.random.normal(jax.random.key(2), (12, 1, 8)), (12, 3, 8))
    available = jnp.ones((12, 3), bool).at[:3, 2].set(False)
    target = jax.random.normal(jax.random.key(3), (12, 8))

    def loss(outputs, prior, tau):
        w, _ = nash_weights(slabs(outputs), available, prior, tau, num_iters=16)
        return jnp.sum(combine(slabs(outputs), w) * target) + jnp.sum(normalised_entropy(w, available))

    for dtype in (jnp.float32, jnp.bfloat16):
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(same.astype(dtype), jnp.zeros(3), jnp.asarray(0.1))
        assert all(bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))) for g in grads)
        assert bool(jnp.any(grads[0] != 0))


def centred_gram64(outputs: np.ndarray, available: np.ndarray) -> np.ndarray:
    """C of the module docstring in float64, written from the equations: outputs over sqrt(S), centred over the
    available scales, Gram over D (0 on unavailable rows and columns)."""
    o = np.where(available[..., None], outputs.astype(np.float64), 0.0)
    count = np.maximum(available.sum(-1), 1)
    o = o / np.sqrt(np.maximum((o * o).mean(-1).sum(-1) / count, 1e-300))[..., None, None]
    centred = np.where(available[..., None], o - o.sum(-2, keepdims=True) / count[..., None, None], 0.0)
    return np.einsum("...ld,...md->...lm", centred, centred) / o.shape[-1]


@pytest.mark.parametrize("scales", [1, 2, 3, 4])
def test_the_largest_eigenvalue_matches_eigvalsh_in_float64(scales):
    """Random outputs (spreads over 4 decades), every availability pattern with scale 0 available, two scales
    with equal eigenvalues (equilateral outputs) and all-equal outputs (C = 0): lambda_max within 1e-5 of
    NumPy's float64 eigvalsh, relative to the trace; gradients finite where eigenvalues coincide, and v v^T (v the
    float64 eigenvector) where lambda_max is simple with three or more scales available; in float64, within 1e-12."""
    rng = np.random.default_rng(scales)
    outputs = rng.normal(size=(512, scales, 16)) * 10.0 ** rng.uniform(-2, 2, size=(512, scales, 1))
    outputs[0] = 1.0  # C = 0
    if scales == 3:  # an equilateral triangle in a plane: two equal nonzero eigenvalues
        angles = 2 * np.pi * np.arange(3) / 3
        outputs[1] = 0.0
        outputs[1, :, 0], outputs[1, :, 1] = np.cos(angles), np.sin(angles)
    available = rng.random((512, scales)) < 0.7
    available[:, 0] = True
    available[:64] = True
    gram, spread = scale_game(slabs(jnp.asarray(outputs, jnp.float32)), jnp.asarray(available))
    expected = np.linalg.eigvalsh(centred_gram64(outputs, available))[..., -1]
    trace = np.trace(centred_gram64(outputs, available), axis1=-2, axis2=-1)
    np.testing.assert_array_less(np.abs(np.asarray(spread, np.float64) - expected), 1e-5 * np.maximum(trace, 1e-6))
    grads = jax.grad(lambda g: jnp.sum(largest_eigenvalue(g, jnp.asarray(available))))(gram)
    assert bool(jnp.all(jnp.isfinite(grads)))
    if scales >= 3:  # where lambda_max is simple, its gradient along symmetric dC is v^T dC v (v its eigenvector)
        values, vectors = np.linalg.eigh(np.asarray(gram[64:], np.float64))
        simple = (values[:, -1] - values[:, -2] > 1e-2 * values[:, -1]) & (available[64:].sum(-1) >= 3)
        assert simple.sum() > 100
        v = vectors[simple, :, -1]
        symmetric = (np.asarray(grads) + np.swapaxes(np.asarray(grads), -1, -2)) / 2
        np.testing.assert_allclose(symmetric[64:][simple], v[:, :, None] * v[:, None, :], atol=2e-4)
    with jax.enable_x64(True):  # the float64 path (the float64 gradient checks' dtype) to float64's precision
        gram64 = centred_gram64(outputs, available)
        exact = largest_eigenvalue(jnp.asarray(gram64), jnp.asarray(available))
        assert exact.dtype == jnp.float64
        np.testing.assert_array_less(np.abs(np.asarray(exact) - expected), 1e-12 * np.maximum(trace, 1e-6))


@pytest.mark.parametrize("size", [1, 2, 3, 4, 6])
def test_the_small_solver_matches_numpy_including_systems_that_need_pivoting(size):
    """Random well-conditioned systems, permutation matrices (a zero on the diagonal: no elimination without
    row exchanges) and identity rows (unavailable scales) against float64 ``np.linalg.solve``."""
    rng = np.random.default_rng(size)
    matrices = rng.normal(size=(300, size, size)) + 3.0 * np.eye(size)
    matrices[:100] = np.eye(size)[rng.permuted(np.tile(np.arange(size), (100, 1)), axis=1)]
    matrices[100:110, -1, :] = np.eye(size)[-1]
    rhs = rng.normal(size=(300, size))
    expected = np.linalg.solve(matrices, rhs[..., None])[..., 0]
    with jax.enable_x64(True):
        got = solve_small(jnp.asarray(matrices), jnp.asarray(rhs))
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-10, atol=1e-10)
        # reverse mode transposes it: d<x, g>/d rhs = A^-T g
        g = rng.normal(size=(300, size))
        cotangent = jax.grad(lambda b: jnp.sum(solve_small(jnp.asarray(matrices), b) * g))(jnp.asarray(rhs))
        np.testing.assert_allclose(np.asarray(cotangent), np.linalg.solve(np.swapaxes(matrices, -1, -2),
                                                                          g[..., None])[..., 0], rtol=1e-9, atol=1e-9)


def test_normalised_entropy_per_position():
    available = jnp.array([[True, True, True], [True, True, False], [True, False, False]])
    uniform = jnp.array([[1 / 3] * 3, [0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    onehot = jnp.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    np.testing.assert_allclose(np.asarray(normalised_entropy(uniform, available)), [1.0, 1.0, 0.0], atol=1e-6)
    assert np.all(np.asarray(normalised_entropy(onehot, available)) == 0.0)
    assert bool(jnp.all(jnp.isfinite(jax.grad(lambda w: jnp.sum(normalised_entropy(w, available)))(onehot))))


# ----------------------------------------------------------------------------- coarse renormalisation
@pytest.mark.parametrize("preset", ["tiny", "small"])
@pytest.mark.slow
def test_coarse_attention_logits_start_at_the_fine_scale_rms(preset):
    config = ModelConfig.preset(preset)
    model = LanguageModel(config, key=jax.random.key(0))
    attn = jax.tree.map(lambda a: a[0], model.blocks).attn  # first layer
    ids = jax.random.randint(jax.random.key(1), (2, config.seq_len), 0, config.vocab_size)
    x = model.embedding[ids]
    x = x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + config.norm_eps)  # the attention's input at init

    def logit_rms(level: int, inputs: jax.Array) -> float:
        q, k = attn.queries_keys(level, inputs)
        scores = jnp.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(config.head_dim)
        return float(jnp.sqrt(jnp.mean(scores**2)))

    fine = logit_rms(0, x)
    for level in range(1, config.num_scales):
        ratio = logit_rms(level, attn.coarse_input(level, x)) / fine
        assert 0.5 <= ratio <= 2.0, (level, ratio)


# ---------------------------------------------------------------------------------- Hyper-Connections
def reference_hc(x, norm_gain, eps, w_m, w_beta, w_r, s_alpha, s_beta, s_res, a_m, b, a_r, sublayer):
    """Dynamic Hyper-Connections (Zhu et al. 2409.19606, sec. 2.3 with the mHC paper's RMSNorm), float64.

    For each token: H̄ = norm(H) per stream; A_m = s_alpha tanh(H̄ w_m) + A_m; B = s_beta tanh(H̄ w_beta) + B;
    A_r = s_res tanh(H̄ W_r) + A_r (row i from stream i); h_0 = A_m^T H; Ĥ = B^T T(h_0) + A_r^T H.
    """
    out = np.zeros_like(x, dtype=np.float64)
    for t in range(x.shape[0]):
        h = x[t].astype(np.float64)  # [n, D]
        hbar = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps) * norm_gain
        am = s_alpha * np.tanh(hbar @ w_m) + a_m  # [n]
        bb = s_beta * np.tanh(hbar @ w_beta) + b  # [n]
        ar = s_res * np.tanh(hbar @ w_r) + a_r  # [n, n], row i from stream i
        h0 = am @ h
        out[t] = np.outer(bb, sublayer(h0)) + ar.T @ h
    return out


def test_hc_matches_the_published_equations():
    n, dim, seq = 4, 16, 5
    rng = np.random.default_rng(0)
    x = rng.normal(size=(seq, n, dim)).astype(np.float32)
    gain = 1 + 0.1 * rng.normal(size=dim)
    w_m, w_beta, w_r = rng.normal(size=dim) * 0.3, rng.normal(size=dim) * 0.3, rng.normal(size=(dim, n)) * 0.3
    s_alpha, s_beta, s_res = 0.7, -0.4, 0.5
    a_m, b, a_r = rng.normal(size=n), rng.normal(size=n), rng.normal(size=(n, n))
    weight = rng.normal(size=(dim, dim)) / np.sqrt(dim)

    layer = HyperConnection("hc", n, dim, eps=1e-6, key=jax.random.key(0))
    theta = np.concatenate([w_m[:, None], w_beta[:, None], w_r], axis=1)  # [pre | post | res] columns
    values = (theta, [s_alpha, s_beta, s_res], a_m, b, a_r.T, gain)  # our H_res[j, i] is the paper's A_r[i, j]
    layer = eqx.tree_at(lambda m: (m.phi, m.alpha, m.b_pre, m.b_post, m.b_res, m.norm.weight), layer,
                        tuple(jnp.asarray(v, jnp.float32) for v in values))
    got, _ = layer(jnp.asarray(x), lambda u: jnp.tanh(u @ jnp.asarray(weight, jnp.float32)))
    want = reference_hc(x, gain, 1e-6, w_m, w_beta, w_r, s_alpha, s_beta, s_res, a_m, b, a_r,
                        lambda u: np.tanh(u @ weight))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_hc_starts_as_the_pre_norm_residual_transformer():
    """One-hot H_pre, H_post = 1, H_res = I and zero dynamic weights: the plain model's function at step 0.

    (A negligible norm eps: the final RMSNorm of the n-stream sum sees n·x where the plain model sees x.)
    """
    hc = LanguageModel(ModelConfig.preset("tiny", residual="hc", norm_eps=1e-12), key=jax.random.key(5))
    plain = LanguageModel(ModelConfig.preset("tiny", residual="plain", norm_eps=1e-12), key=jax.random.key(5))
    ids = jax.random.randint(jax.random.key(6), (2, 64), 0, 259)
    np.testing.assert_allclose(np.asarray(hc(ids).logits), np.asarray(plain(ids).logits), atol=2e-5)
    b_pre = np.asarray(hc.blocks.attn_hc.b_pre), np.asarray(hc.blocks.ffn_hc.b_pre)
    n = hc.config.num_streams
    for layer in range(hc.config.num_layers):  # sublayer k reads stream k mod n
        assert np.argmax(b_pre[0][layer]) == (2 * layer) % n and np.argmax(b_pre[1][layer]) == (2 * layer + 1) % n


# ------------------------------------------------------------------------------------- sparsity term
@pytest.mark.slow  # multi-second, not an invariant: the full run (CI) keeps it
def test_sparsity_term_weighs_positions_by_the_loss_mask():
    from nash_mhc.training import Batch, eval_step

    model = LanguageModel(ModelConfig.preset("tiny"), key=jax.random.key(7))
    prior = jax.random.normal(jax.random.key(9), model.blocks.attn.aggregation.prior.shape)  # non-uniform weights
    model = eqx.tree_at(lambda m: m.blocks.attn.aggregation.prior, model, prior)
    tokens = np.asarray(jax.random.randint(jax.random.key(8), (8, 65), 0, 259))
    entropy = np.asarray(model(jnp.asarray(tokens[:, :-1])).entropy, np.float64)  # [B, T], 0 without a choice
    choice = np.arange(64) + 1 >= model.config.block_sizes[1]
    mask = np.ones((8, 64), np.float32)
    mask[:, 40:] = 0.0  # e.g. padding after a document end
    mask[3] = 0.0
    got = float(eval_step(model, Batch(tokens=tokens, loss_mask=mask))["aux_loss"])
    weight = mask * choice
    assert got == pytest.approx(float(np.sum(weight * entropy) / np.sum(weight)), rel=1e-5)
    unmasked = float(eval_step(model, Batch(tokens=tokens))["aux_loss"])
    assert unmasked == pytest.approx(float(np.sum(entropy * choice) / (8 * choice.sum())), rel=1e-5)
    assert abs(got - unmasked) > 1e-4  # the masked positions really were left out
