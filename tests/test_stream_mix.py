"""The Pallas stream-mix kernels (nash_mhc.kernels.tpu.stream_mix_kernel, through nash_mhc.ops.stream_mix), run in
Pallas' interpreter on the CPU: forward and gradients against float64 NumPy written from the equations, the
per-shard split under a mesh, the XLA path the CPU runs against the same reference, and the declared cost against
an independent walk of the grid."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import declared, moved
from jax.sharding import PartitionSpec as P

from nash_mhc.kernels.tpu.stream_mix_kernel import kernel_costs, mix_blocks
from nash_mhc.ops.stream_mix import SHARD_AXES, mix_streams, stream_mix
from nash_mhc.sharding import make_mesh, per_shard

N, T, D = 4, 64, 384
BLOCKS = (16, 128)  # 4 token tiles x 3 column tiles: the coefficient gradients add up over column tiles


def inputs(dtype, seed=0):
    """x [n, T, D], y [T, D], a doubly-stochastic-like h_res [T, n, n], h_post [T, n], cotangent g [n, T, D]."""
    rng = np.random.default_rng(seed)
    x, y, g = (jnp.asarray(rng.normal(size=s), dtype) for s in ((N, T, D), (T, D), (N, T, D)))
    h_res = jnp.asarray(rng.dirichlet(np.ones(N), size=(T, N)), jnp.float32)
    h_post = jnp.asarray(2 * rng.random((T, N)), jnp.float32)
    return x, y, h_res, h_post, g


def reference(x, y, h_res, h_post, g):
    """(out, dx, dy, dh_res, dh_post) in float64: out_i = sum_j h_res[:, i, j] x_j + h_post[:, i] y and the
    transposes of that bilinear map."""
    x, y, r, p, g = (np.asarray(a, np.float64) for a in (x, y, h_res, h_post, g))
    out = np.einsum("tij,jtd->itd", r, x) + p.T[:, :, None] * y[None]
    return (out, np.einsum("tij,itd->jtd", r, g), np.einsum("ti,itd->td", p, g), np.einsum("itd,jtd->tij", g, x),
            np.einsum("itd,td->ti", g, y))


def with_grads(mix, x, y, h_res, h_post, g):
    out, pullback = jax.vjp(mix, x, y, h_res, h_post)
    return (out, *pullback(g))


def kernel(x, y, h_res, h_post, defer=False):
    return stream_mix(x, y, h_res, h_post, blocks=BLOCKS, interpret=True, defer=defer)


NAMES = ("out", "dx", "dy", "dh_res", "dh_post")


@pytest.mark.parametrize("mix", [kernel, mix_streams], ids=["kernel", "xla"])
def test_forward_and_gradients_match_float64_reference(mix):
    case = inputs(jnp.float32)
    for name, a, b in zip(NAMES, with_grads(mix, *case), reference(*case), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float64), b, atol=2e-5, rtol=2e-5, err_msg=name)


@pytest.mark.parametrize("mix", [kernel, mix_streams], ids=["kernel", "xla"])
def test_the_deferred_rule_hands_back_g_for_x_and_the_same_other_gradients(mix):
    """``defer=True`` (the mhc collapse's update): x's cotangent is g itself, bit for bit, for the collapse to apply
    H_resᵀ; the output and the other three gradients are the reference's."""
    case = inputs(jnp.float32)
    got = with_grads(functools.partial(mix, defer=True), *case)
    want = reference(*case)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(case[4]))
    for name, a, b in zip(NAMES, got, want, strict=True):
        if name != "dx":
            np.testing.assert_allclose(np.asarray(a, np.float64), b, atol=2e-5, rtol=2e-5, err_msg=name)


@pytest.mark.parametrize("mix", [kernel, mix_streams], ids=["kernel", "xla"])
def test_bfloat16_streams_are_rounded_once_and_coefficient_gradients_stay_float32(mix):
    case = inputs(jnp.bfloat16, seed=1)
    got, want = with_grads(mix, *case), reference(*case)
    for name, a, b in zip(NAMES, got, want, strict=True):
        tol = 2e-5 if name.startswith("dh") else 2 ** -8  # one bfloat16 rounding of a float32 result
        assert a.dtype == (jnp.float32 if name.startswith("dh") else jnp.bfloat16), name
        np.testing.assert_allclose(np.asarray(a, np.float64), b, atol=tol * np.abs(b).max(), rtol=0, err_msg=name)


def test_under_a_mesh_each_shard_mixes_its_own_tokens():
    """(data 2, fsdp 2, tp 2): tokens over data x fsdp, streams and features whole, bit-equal to one device."""
    x, y, h_res, h_post, _ = inputs(jnp.float32)
    mix = per_shard(kernel, *SHARD_AXES)
    mesh = make_mesh(2, 2, 2)
    with jax.set_mesh(mesh):
        sharded = jax.jit(mix)(x, y, h_res, h_post)
        inner = [e for e in jax.make_jaxpr(mix)(x, y, h_res, h_post).eqns if e.primitive.name == "shard_map"]
    np.testing.assert_array_equal(np.asarray(sharded), np.asarray(kernel(x, y, h_res, h_post)))
    assert [e.params["in_specs"][0] for e in inner] == [P(None, ("data", "fsdp"))]


def test_bad_tiles_are_refused_with_one_line():
    x, y, h_res, h_post, _ = inputs(jnp.float32)
    for blocks in ((24, 128), (12, 128), (16, 256)):
        with pytest.raises(ValueError, match=r"stream_mix needs tiles that divide \(tokens, dim\) = \(64, 384\)"):
            stream_mix(x, y, h_res, h_post, blocks=blocks, interpret=True)
    assert mix_blocks(32768, 2048) == (256, 512) and mix_blocks(64, 384) == (64, 128)
    assert mix_blocks(48, 100) == (16, 100) and mix_blocks(12, 128) is None


# ---------------------------------------------------------------------------------------------- cost
@pytest.mark.parametrize("tokens,dim,blocks,x_bytes,y_bytes", [(64, 384, (16, 128), 4, 4),
                                                                (32768, 2048, (256, 512), 2, 2),
                                                                (512, 256, (128, 256), 2, 4)])
def test_declared_cost_is_the_grids_multiply_adds_and_bytes(tokens, dim, blocks, x_bytes, y_bytes):
    tm, td = blocks
    grid = (tokens // tm, dim // td)
    tile, coefficient = (lambda t, d: (t, d)), (lambda t, d: t)
    stream, slab = (N * tm * td * x_bytes, tile), (tm * td * y_bytes, tile)
    res, post = (tm * N * N * 4, coefficient), (tm * N * 4, coefficient)
    per_element = N * (2 * N + 2)  # n outputs (or transposes) of n + 1 multiply-adds
    costs = kernel_costs(N, tokens, dim, x_bytes, y_bytes)
    assert costs.forward.flops == per_element * tokens * dim
    assert costs.backward.flops == 2 * per_element * tokens * dim
    assert costs.forward.bytes_accessed == moved(grid, [stream, slab, res, post, stream])
    assert costs.backward.bytes_accessed == moved(grid, [stream, slab, res, post, stream, stream, slab, res, post])
    # deferred: dx not computed nor written (dy, dh_res and dh_post: n + n² + n multiply-adds)
    assert costs.deferred_backward.flops == 2 * N * (N + 2) * tokens * dim
    assert costs.deferred_backward.bytes_accessed == moved(grid, [stream, slab, res, post, stream, slab, res, post])

    dtype = {2: jnp.bfloat16, 4: jnp.float32}
    x = jax.ShapeDtypeStruct((N, tokens, dim), dtype[x_bytes])
    y = jax.ShapeDtypeStruct((tokens, dim), dtype[y_bytes])
    r, p = jax.ShapeDtypeStruct((tokens, N, N), jnp.float32), jax.ShapeDtypeStruct((tokens, N), jnp.float32)

    def loss(x, y, r, p):
        return stream_mix(x, y, r, p, blocks=blocks).astype(jnp.float32).sum()
    assert declared(jax.grad(loss, argnums=(0, 1, 2, 3)), x, y, r, p) == [costs.forward, costs.backward]

    def deferred_loss(x, y, r, p):
        return stream_mix(x, y, r, p, blocks=blocks, defer=True).astype(jnp.float32).sum()
    assert declared(jax.grad(deferred_loss, argnums=(0, 1, 2, 3)), x, y, r, p) == [costs.forward,
                                                                                  costs.deferred_backward]
