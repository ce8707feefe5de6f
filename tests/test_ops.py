"""Nash aggregation, causal resampling and RoPE as pure functions."""

from __future__ import annotations

import functools

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from nash_mhc.ops import (
    available_mask,
    combine,
    downsample,
    nash_weights,
    normalised_entropy,
    rope,
    upsample_shifted,
)

SEQ, SCALES, DIM = 12, 3, 8


@functools.cache
def weights_fn(num_iters: int):
    return jax.jit(functools.partial(nash_weights, num_iters=num_iters, temperature=0.5))


@settings(max_examples=50, deadline=None)
@given(
    outputs=hnp.arrays(np.float32, (SEQ, SCALES, DIM), elements=st.floats(-100, 100, width=32)),
    available=hnp.arrays(np.bool_, (SEQ, SCALES)),
    prior=hnp.arrays(np.float32, (SCALES,), elements=st.floats(-5, 5, width=32)),
    num_iters=st.sampled_from([0, 1, 3]),
)
def test_nash_weights_on_simplex_and_zero_on_unavailable(outputs, available, prior, num_iters):
    available[:, 0] = True  # scale 0 is always available
    w = np.asarray(weights_fn(num_iters)(jnp.asarray(outputs), jnp.asarray(available), jnp.asarray(prior)))
    assert np.all(w >= 0)
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)
    assert np.all(w[~available] == 0.0)


def test_weights_are_per_position_not_pooled():
    outputs = jax.random.normal(jax.random.key(0), (SEQ, SCALES, DIM))
    available = jnp.ones((SEQ, SCALES), bool)
    prior = jnp.zeros((SCALES,))
    changed = outputs.at[SEQ - 1].multiply(50.0)
    a = weights_fn(3)(outputs, available, prior)
    b = weights_fn(3)(changed, available, prior)
    assert np.array_equal(np.asarray(a[:-1]), np.asarray(b[:-1]))
    assert not np.array_equal(np.asarray(a[-1]), np.asarray(b[-1]))


def test_best_response_downweights_the_outlier_scale():
    base = jax.random.normal(jax.random.key(1), (SEQ, 1, DIM))
    outputs = jnp.concatenate([base, base + 0.01, base + 5.0], axis=1)
    w = weights_fn(3)(outputs, jnp.ones((SEQ, SCALES), bool), jnp.zeros((SCALES,)))
    assert bool(jnp.all(w[:, 2] < w[:, 0])) and bool(jnp.all(w[:, 2] < 0.2))


def test_identical_outputs_give_finite_nonzero_gradients():
    """The sqrt(0) case: every scale agrees, so every utility error is exactly zero."""
    same = jnp.broadcast_to(jax.random.normal(jax.random.key(2), (SEQ, 1, DIM)), (SEQ, SCALES, DIM))
    available = jnp.asarray(available_mask(SEQ, 1))[:, None].repeat(SCALES, 1).at[:3, 2].set(False)
    target = jax.random.normal(jax.random.key(3), (SEQ, DIM))

    def loss(outputs, prior):
        w = nash_weights(outputs, available, prior, num_iters=3, temperature=1.0)
        return jnp.sum(combine(outputs, w) * target) + normalised_entropy(w, available)

    for dtype in (jnp.float32, jnp.bfloat16):
        g_out, g_prior = jax.grad(loss, argnums=(0, 1))(same.astype(dtype), jnp.zeros((SCALES,)))
        assert bool(jnp.all(jnp.isfinite(g_out.astype(jnp.float32)))) and bool(jnp.any(g_out != 0))
        assert bool(jnp.all(jnp.isfinite(g_prior)))
    # away from the symmetric point the learned prior (the aggregation weights' parameter) gets gradient
    distinct = same + jax.random.normal(jax.random.key(4), same.shape)
    _, g_prior = jax.grad(loss, argnums=(0, 1))(distinct, jnp.zeros((SCALES,)))
    assert bool(jnp.all(jnp.isfinite(g_prior))) and bool(jnp.all(g_prior != 0))


def test_normalised_entropy_bounds_and_exclusions():
    available = jnp.array([[True, True, True], [True, True, False], [True, False, False]])
    uniform = jnp.array([[1 / 3] * 3, [0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    onehot = jnp.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    np.testing.assert_allclose(float(normalised_entropy(uniform, available)), 1.0, atol=1e-6)
    assert float(normalised_entropy(onehot, available)) == 0.0
    grad = jax.grad(lambda w: normalised_entropy(w, available))(onehot)
    assert bool(jnp.all(jnp.isfinite(grad)))


def test_downsample_sees_only_its_block():
    x = jax.random.normal(jax.random.key(4), (10, DIM))
    w = jax.random.normal(jax.random.key(5), (4, DIM))
    y = np.asarray(downsample(x, w))
    assert y.shape == (3, DIM)
    xp = np.concatenate([np.asarray(x), np.zeros((2, DIM), np.float32)])
    for j in range(3):
        np.testing.assert_allclose(y[j], (xp[4 * j:4 * j + 4] * np.asarray(w)).sum(0), rtol=1e-5, atol=1e-6)


def test_upsample_reads_the_last_complete_block():
    for seq, block in [(16, 4), (13, 4), (9, 2), (3, 4), (7, 1)]:
        blocks = -(-seq // block)
        coarse = jnp.arange(1, blocks + 1, dtype=jnp.float32)[:, None].repeat(DIM, 1)
        up, avail = upsample_shifted(coarse, seq, block)
        for i in range(seq):
            j = (i + 1) // block - 1
            assert bool(avail[i]) == (j >= 0)
            assert float(up[i, 0]) == (j + 1 if j >= 0 else 0.0)
            # the block read at i ends at or before i: nothing from the future
            assert j < 0 or (j + 1) * block - 1 <= i


def test_rope_depends_on_relative_position_times_spacing():
    q = jax.random.normal(jax.random.key(6), (1, 2, 16))
    k = jax.random.normal(jax.random.key(7), (1, 2, 16))
    seq = 12

    def score(i, j, spacing):
        qs = rope(jnp.broadcast_to(q, (seq, 2, 16)), spacing=spacing)
        ks = rope(jnp.broadcast_to(k, (seq, 2, 16)), spacing=spacing)
        return jnp.sum(qs[i] * ks[j], axis=-1)

    np.testing.assert_allclose(score(5, 2, 1), score(8, 5, 1), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(score(2, 1, 4), score(8, 4, 1), rtol=1e-4, atol=1e-5)
    norms = jnp.linalg.norm(rope(jnp.broadcast_to(q, (seq, 2, 16)), spacing=3), axis=-1)
    np.testing.assert_allclose(norms, jnp.broadcast_to(jnp.linalg.norm(q, axis=-1), (seq, 2)), rtol=1e-5)


def test_causal_block_skipping_equals_the_full_masked_matrix():
    """causal_attention scores query chunk c only against keys up to its end; the result must be the
    full masked attention (same numbers: the skipped blocks are exactly-zero probabilities)."""
    from nash_mhc.ops.attention import causal_attention, masked_attention, query_chunks

    assert [query_chunks(s) for s in (21, 64, 128, 192, 256, 1000, 2048)] == [1, 1, 2, 3, 4, 8, 8]
    for seq in (128, 192, 256):
        q, k, v = (jax.random.normal(jax.random.key(i), (seq, 2, 8)) for i in range(3))
        tril = jnp.tril(jnp.ones((seq, seq), bool))
        full = masked_attention(q, k, v, tril)
        np.testing.assert_allclose(np.asarray(causal_attention(q, k, v)), np.asarray(full), rtol=1e-6, atol=1e-6)
        grads = jax.grad(lambda q, k, v: jnp.sum(jnp.sin(causal_attention(q, k, v))), argnums=(0, 1, 2))(q, k, v)
        full_grads = jax.grad(lambda q, k, v, m: jnp.sum(jnp.sin(masked_attention(q, k, v, m))),
                              argnums=(0, 1, 2))(q, k, v, tril)
        for got, want in zip(grads, full_grads, strict=True):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
