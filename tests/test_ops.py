"""Causal resampling and RoPE as pure functions (the Nash aggregation is in test_nash.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref

from nash_mhc.ops import (
    downsample,
    multiscale,
    rope,
    upsample_shifted,
)

SEQ, SCALES, DIM = 12, 3, 8


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


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("block", [4, 16])
def test_the_tpu_matmul_forms_of_resampling_match_the_reference(block, dtype):
    """The chunked one-hot-matmul forms that TPUs lower (nash_mhc.ops.multiscale) against the float64 reference:
    upsampling is a copy, bit for bit; downsampling differs only by the result's rounding. Their gradients equal
    the XLA forms' (every CPU test runs those)."""
    seq, rng = 2 * multiscale.CHUNK, np.random.default_rng(block)
    x = jnp.asarray(rng.normal(size=(2, seq, DIM)), dtype)
    w = jnp.asarray(rng.normal(size=(block, DIM)), dtype)
    coarse = jnp.asarray(rng.normal(size=(2, seq // block, DIM)), dtype)
    down = multiscale._downsample_chunked(x, w)
    up = multiscale._upsample_chunked(coarse, block)
    assert down.dtype == up.dtype == dtype
    rtol = 1e-6 if dtype == jnp.float32 else 2.0**-8
    for b in range(2):
        np.testing.assert_allclose(np.asarray(down[b], np.float64), ref.downsample(x[b], w), rtol=rtol, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(up[b], np.float64), ref.upsample_shifted(coarse[b], seq, block)[0])

    # gradients, from the equations: dx[j·s + o] = w[o] ⊙ dc[j], dw[o] = Σ_{b,j} dc[b, j] ⊙ x[b, j·s + o], and
    # dy[j] = Σ du[i] over the fine positions i that read block j; each within rtol of the sum of its terms' sizes
    dc = jnp.asarray(rng.normal(size=(2, seq // block, DIM)), dtype)
    du = jnp.asarray(rng.normal(size=(2, seq, DIM)), dtype)
    dx, dw = jax.vjp(multiscale._downsample_chunked, x, w)[1](dc)
    (dy,) = jax.vjp(lambda y: multiscale._upsample_chunked(y, block), coarse)[1](du)
    dc64, du64 = np.asarray(dc, np.float64)[:, :, None], np.asarray(du, np.float64)
    fine = np.asarray(x, np.float64).reshape(2, seq // block, block, DIM)
    reads = ref.upsample_shifted(np.eye(seq // block), seq, block)[0]  # [T, T/s]: row i picks the block i reads
    for got, expected, size in (
            (dx, dc64 * np.asarray(w, np.float64), np.abs(dc64 * np.asarray(w, np.float64))),
            (dw, (dc64 * fine).sum((0, 1)), np.abs(dc64 * fine).sum((0, 1))),
            (dy, np.einsum("ij,bid->bjd", reads, du64), np.einsum("ij,bid->bjd", reads, np.abs(du64)))):
        error = np.abs(np.asarray(got, np.float64).reshape(expected.shape) - expected)
        assert np.all(error <= rtol * size + 1e-6), float(np.max(error - rtol * size))


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


def test_rope_at_given_positions_equals_the_whole_sequence_bit_for_bit():
    """Decoding rotates a token at its index into the same constant tables a whole sequence uses: equal bits
    (the invariant cached == full decoding rests on); positions without the table size are refused."""
    x = jax.random.normal(jax.random.key(8), (2, 10, 3, 16))
    whole = jax.jit(lambda x: rope(x, spacing=4))(x)
    at = jax.jit(lambda x, p: rope(x, spacing=4, positions=p, num_positions=10))
    for p in (0, 3, 9):
        np.testing.assert_array_equal(np.asarray(at(x[:, p:p + 1], jnp.asarray([p]))), np.asarray(whole[:, p:p + 1]))
    with pytest.raises(ValueError, match="num_positions"):
        rope(x, positions=jnp.arange(10))


@pytest.mark.slow
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
