"""Properties of the log-domain Sinkhorn projection, and of mHC-lite's exact doubly-stochastic H_res."""

from __future__ import annotations

import functools
import math

import equinox as eqx
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from hypothesis import given, settings
from hypothesis import strategies as st

from nash_mhc.ops import sinkhorn

SETTINGS = settings(max_examples=60, deadline=None)


@functools.cache
def projector(num_iters: int):
    return jax.jit(functools.partial(sinkhorn, num_iters=num_iters))


def logits_strategy(low: float, high: float):
    return st.integers(1, 6).flatmap(lambda n: hnp.arrays(
        np.float32, (3, n, n), elements=st.floats(low, high, width=32, allow_nan=False)))


@SETTINGS
@given(logits_strategy(-1e4, 1e4))
def test_nonnegative_and_rows_sum_to_one_for_any_logits(logits):
    p = np.asarray(projector(20)(jnp.asarray(logits)))
    assert np.all(np.isfinite(p)) and np.all(p >= 0)
    np.testing.assert_allclose(p.sum(-1), 1.0, atol=1e-5)


@SETTINGS
@given(logits_strategy(-1.0, 1.0))
def test_small_logits_are_doubly_stochastic_and_non_expansive(logits):
    p = np.asarray(projector(20)(jnp.asarray(logits)))
    np.testing.assert_allclose(p.sum(-2), 1.0, atol=1e-3)
    spectral = np.linalg.norm(p.astype(np.float64), ord=2, axis=(-2, -1))
    assert np.all(spectral <= 1 + 1e-3)


def test_column_error_shrinks_with_iterations_for_spread_out_logits():
    logits = 2.0 * jax.random.normal(jax.random.key(0), (256, 4, 4))
    errors = [float(jnp.max(jnp.abs(projector(t)(logits).sum(-2) - 1))) for t in (5, 20, 80, 320)]
    assert errors[0] > errors[1] > errors[2] > errors[3]
    assert errors[1] > 1e-3  # 20 iterations do not converge at std 2: H_res is only approximately DS
    assert errors[3] < 1e-4


@pytest.mark.parametrize("num_iters", [1, 20])
def test_gradient_matches_central_differences_of_the_float64_reference(num_iters):
    """The XLA path's custom backward (re-run the rounds, walk them back) against the float64 reference's
    directional derivatives, batch dimensions included ([2, 3, 4, 4])."""
    rng = np.random.default_rng(num_iters)
    z = jnp.asarray(2.0 * rng.normal(size=(2, 3, 4, 4)), jnp.float32)
    g = rng.normal(size=z.shape)
    (dz,) = jax.vjp(projector(num_iters), z)[1](jnp.asarray(g, jnp.float32))
    z64, eps = np.asarray(z, np.float64), 1e-5
    for _ in range(3):
        v = rng.normal(size=z.shape)
        want = (np.sum(ref.sinkhorn(z64 + eps * v, num_iters) * g)
                - np.sum(ref.sinkhorn(z64 - eps * v, num_iters) * g)) / (2 * eps)
        np.testing.assert_allclose(np.sum(np.asarray(dz, np.float64) * v), want, rtol=1e-4, atol=1e-4)


def test_one_by_one_is_exactly_one():
    p = projector(20)(jnp.array([[[3.7]], [[-1e4]]]))
    assert np.array_equal(np.asarray(p), np.ones((2, 1, 1), np.float32))


def test_gradients_finite_for_huge_logits_in_both_dtypes():
    weights = jax.random.normal(jax.random.key(2), (8, 4, 4))
    for dtype in (jnp.float32, jnp.bfloat16):
        logits = (1e4 * jax.random.normal(jax.random.key(1), (8, 4, 4))).astype(dtype)
        grad = jax.grad(lambda z: jnp.sum(sinkhorn(z) * weights))(logits)
        assert grad.dtype == dtype
        assert bool(jnp.all(jnp.isfinite(grad.astype(jnp.float32))))


def test_output_is_float32_and_rejects_non_square():
    out = sinkhorn(jnp.zeros((2, 3, 3), jnp.bfloat16))
    assert out.dtype == jnp.float32
    try:
        sinkhorn(jnp.zeros((2, 3, 4)))
    except Exception as error:  # beartype/jaxtyping violation
        assert "logits" in str(error)
    else:
        raise AssertionError("a non-square input must be rejected")


@functools.cache
def lite_coefficients(n: int):
    """jit(mhc-lite connection's coefficients(x)) of a fresh n-stream connection, its b_perm and α replaceable."""
    from nash_mhc.layers.hyperconnection import HyperConnection

    hc = HyperConnection("mhc-lite", n, 8, key=jax.random.PRNGKey(n))

    def coefficients(x, b_perm, alpha):
        return eqx.tree_at(lambda h: (h.b_perm, h.alpha), hc, (b_perm, alpha)).coefficients(x)
    return jax.jit(coefficients)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 5).flatmap(lambda n: st.tuples(
    st.just(n),
    hnp.arrays(np.float32, (math.factorial(n),), elements=st.floats(-1e4, 1e4, width=32)),
    hnp.arrays(np.float32, (3,), elements=st.floats(-1e3, 1e3, width=32)),
    st.floats(1e-3, 1e3), st.integers(0, 2**31 - 1))))
@pytest.mark.slow  # out of the quick loop (its 5-minute budget): no invariant, the full run keeps it
def test_mhc_lite_residual_matrix_is_doubly_stochastic_for_logits_of_any_magnitude(case):
    """mHC-lite's H_res = Σ_k softmax(α₂·a + b_perm)_k P_k: rows and columns sum to 1 within 1e-6 and no entry is
    negative, whatever the permutation logits (|b_perm| up to 1e4, |α| up to 1e3, inputs of any scale)."""
    n, b_perm, alpha, scale, seed = case
    x = scale * np.random.default_rng(seed).standard_normal((5, n, 8)).astype(np.float32)
    _, _, h_res = lite_coefficients(n)(jnp.asarray(x), jnp.asarray(b_perm), jnp.asarray(alpha))
    h_res = np.asarray(h_res, np.float64)
    assert np.all(np.isfinite(h_res)) and np.all(h_res >= 0)
    np.testing.assert_allclose(h_res.sum(-1), 1.0, atol=1e-6, rtol=0)
    np.testing.assert_allclose(h_res.sum(-2), 1.0, atol=1e-6, rtol=0)
