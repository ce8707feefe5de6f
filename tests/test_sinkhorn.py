"""Properties of the log-domain Sinkhorn projection."""

from __future__ import annotations

import functools

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
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
