"""The Pallas Sinkhorn kernels (nash_mhc.kernels.tpu.sinkhorn_kernel), run in Pallas' interpreter on the CPU: the
projection against the float64 NumPy reference, its gradient against central differences of that reference,
the per-shard split under a mesh, and the declared cost against an independent count."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from helpers import declared, moved

from nash_mhc.kernels.tpu.sinkhorn_kernel import kernel_costs, sinkhorn_tokens, token_block
from nash_mhc.sharding import make_mesh, per_shard

pytestmark = pytest.mark.kernels  # the quick loop leaves them to the rest (docs/testing.md)

T, N, ITERS, BLOCK = 256, 4, 20, 128


def logits(seed=0, scale=2.0):
    return jnp.asarray(scale * np.random.default_rng(seed).normal(size=(T, N, N)), jnp.float32)


def kernel(z, iters=ITERS):
    return sinkhorn_tokens(z, iters, block=BLOCK, interpret=True)


@pytest.mark.parametrize("iters", [1, ITERS])
def test_projection_matches_the_float64_reference(iters):
    z = logits()
    np.testing.assert_allclose(np.asarray(kernel(z, iters), np.float64), ref.sinkhorn(z, iters), atol=1e-6, rtol=0)


def test_gradient_matches_central_differences_of_the_reference():
    z = logits(seed=1)
    rng = np.random.default_rng(2)
    g = rng.normal(size=z.shape)
    (dz,) = jax.vjp(kernel, z)[1](jnp.asarray(g, jnp.float32))
    for _ in range(3):
        v = rng.normal(size=z.shape)
        eps = 1e-5
        want = (np.sum(ref.sinkhorn(np.asarray(z, np.float64) + eps * v, ITERS) * g)
                - np.sum(ref.sinkhorn(np.asarray(z, np.float64) - eps * v, ITERS) * g)) / (2 * eps)
        np.testing.assert_allclose(np.sum(np.asarray(dz, np.float64) * v), want, rtol=1e-4, atol=1e-4)


def test_bfloat16_logits_give_float32_matrices_and_gradients():
    z = logits(seed=3).astype(jnp.bfloat16)
    out, pullback = jax.vjp(kernel, z)
    assert out.dtype == jnp.float32 and pullback(jnp.ones_like(out))[0].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float64), ref.sinkhorn(np.asarray(z, np.float64), ITERS), atol=1e-6)


def test_under_a_mesh_each_shard_projects_its_own_tokens():
    """(data 2, fsdp 2, tp 2): 1,024 tokens split four ways (256 per shard, two tiles), bit-equal to one device."""
    z = jnp.asarray(np.random.default_rng(4).normal(size=(1024, N, N)), jnp.float32)
    names = ("tokens", "streams", "streams")
    project = per_shard(kernel, (names,), names)
    with jax.set_mesh(make_mesh(2, 2, 2)):
        sharded = jax.jit(project)(z)
    np.testing.assert_array_equal(np.asarray(sharded), np.asarray(kernel(z)))


def test_bad_tiles_and_iterations_are_refused_with_one_line():
    z = logits()
    with pytest.raises(ValueError, match="a token tile that is a multiple of 128 and divides 256, got 96"):
        sinkhorn_tokens(z, ITERS, block=96, interpret=True)
    with pytest.raises(ValueError, match="sinkhorn needs num_iters >= 1, got 0"):
        sinkhorn_tokens(z, 0, interpret=True)
    assert token_block(32768) == 512 and token_block(384) == 128 and token_block(64) is None


@pytest.mark.parametrize("tokens,iters", [(256, 20), (32768, 20), (512, 3)])
def test_declared_cost_counts_every_normalisation_and_moves_each_matrix_once(tokens, iters):
    """Counted per token: one normalisation along an axis is n² maxima + n² subtractions + n² sums + n log-sums'
    additions + n² subtractions = 4n² + n FLOPs and n² exp + n log; walked back it is n² exp, n² multiply-adds for
    the sum and n² for the update."""
    block = token_block(tokens)
    per_round = 2 * (4 * N * N + N)
    costs = kernel_costs(tokens, N, iters)
    assert costs.forward.flops == tokens * iters * per_round
    assert costs.forward.transcendentals == tokens * (iters * 2 * (N * N + N) + N * N)
    assert costs.backward.flops == tokens * (iters * per_round + iters * 2 * 4 * N * N + N * N)
    assert costs.backward.transcendentals == tokens * (iters * 2 * (N * N + N) + N * N + iters * 2 * N * N)
    tile = (N * N * block * 4, lambda outer, inner: outer)
    assert costs.forward.bytes_accessed == moved((tokens // block, 1), [tile] * 2)
    assert costs.backward.bytes_accessed == moved((tokens // block, 1), [tile] * 3)
    z = jax.ShapeDtypeStruct((tokens, N, N), jnp.float32)
    assert declared(jax.grad(lambda z: sinkhorn_tokens(z, iters).sum()), z) == [costs.forward, costs.backward]
