"""The streams' copies and sum at the ends of the layer stack (nash_mhc.ops.stream_copies, its kernels in
nash_mhc.kernels.tpu.stream_copies_kernel): the copy kernel in Pallas' interpreter bit for bit against NumPy, its
per-shard split under a mesh, the two custom gradients against float64 NumPy written from the equations (a sum
rounded once), and the declared cost against a walk of the grid."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import declared, moved
from jax.sharding import PartitionSpec as P

from nash_mhc.kernels.tpu import stream_copies_kernel as kernels
from nash_mhc.kernels.tpu.stream_copies_kernel import copies_kernel, sum_kernel
from nash_mhc.ops.stream_copies import copies, stream_copies, stream_sum, summed
from nash_mhc.sharding import make_mesh

N, B, T, D = 4, 2, 32, 384


def normal(shape, dtype, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), dtype)


@pytest.mark.parametrize("in_dtype,out_dtype", [(jnp.float32, jnp.bfloat16), (jnp.bfloat16, jnp.bfloat16),
                                                (jnp.float32, jnp.float32)])
def test_the_kernel_writes_n_copies_in_the_streams_dtype(in_dtype, out_dtype):
    h = normal((B * T, D), in_dtype)
    x = copies_kernel(h, N, out_dtype, blocks=(16, 128), interpret=True)  # 4 token tiles x 3 column tiles
    want = np.asarray(h.astype(out_dtype))
    assert x.shape == (N, B * T, D) and x.dtype == out_dtype
    for i in range(N):
        np.testing.assert_array_equal(np.asarray(x[i]), want, err_msg=f"stream {i}")


@pytest.mark.parametrize("in_dtype,out_dtype", [(jnp.bfloat16, jnp.bfloat16), (jnp.bfloat16, jnp.float32),
                                                (jnp.float32, jnp.float32)])
def test_the_sum_kernel_adds_the_streams_in_float32_and_rounds_once(in_dtype, out_dtype):
    x = normal((N, B * T, D), in_dtype, 5)
    got = sum_kernel(x, out_dtype, blocks=(16, 128), interpret=True)
    want = np.asarray(x, np.float64).sum(axis=0)
    assert got.shape == (B * T, D) and got.dtype == out_dtype
    if in_dtype == jnp.bfloat16:  # these 4 bfloat16 samples add exactly in float32: one rounding gives these bits
        np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.asarray(want, out_dtype)))
    else:
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-6, atol=1e-6)


def test_under_a_mesh_each_shard_copies_and_sums_its_own_tokens():
    """(data 2, fsdp 2, tp 2): the batch over data x fsdp, streams and features whole, equal to NumPy."""
    h, x = normal((4, T, D), jnp.float32), normal((N, 4, T, D), jnp.bfloat16, 6)
    run_copies = lambda h: copies(h, N, jnp.bfloat16, interpret=True)  # noqa: E731
    run_sum = lambda x: summed(x, jnp.bfloat16, interpret=True)  # noqa: E731
    with jax.set_mesh(make_mesh(2, 2, 2)):
        got_copies, got_sum = jax.jit(run_copies)(h), jax.jit(run_sum)(x)
        inner = [(e.params["in_specs"][0], e.params["out_specs"][0]) for f, a in ((run_copies, h), (run_sum, x))
                 for e in jax.make_jaxpr(f)(a).eqns if e.primitive.name == "shard_map"]
    np.testing.assert_array_equal(np.asarray(got_copies),
                                  np.broadcast_to(np.asarray(h.astype(jnp.bfloat16)), (N, 4, T, D)))
    np.testing.assert_array_equal(np.asarray(got_sum),
                                  np.asarray(jnp.asarray(np.asarray(x, np.float64).sum(axis=0), jnp.bfloat16)))
    assert inner == [(P(("data", "fsdp")), P(None, ("data", "fsdp"))), (P(None, ("data", "fsdp")), P(("data", "fsdp")))]


def test_bad_tiles_are_refused_with_one_line():
    h, x = normal((B * T, D), jnp.float32), normal((N, B * T, D), jnp.float32)
    for blocks in ((24, 128), (12, 128), (16, 256), (8, 128), (16, 192)):  # bfloat16: 16-row token tiles
        with pytest.raises(ValueError, match=r"copies_kernel needs tiles that divide \(tokens, dim\) = \(64, 384\)"):
            copies_kernel(h, N, jnp.bfloat16, blocks=blocks, interpret=True)
        with pytest.raises(ValueError, match=r"sum_kernel needs tiles that divide \(tokens, dim\) = \(64, 384\)"):
            sum_kernel(x, jnp.bfloat16, blocks=blocks, interpret=True)
    assert copies_kernel(h, N, jnp.float32, blocks=(8, 384), interpret=True).shape == (N, B * T, D)  # float32: 8 rows


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_copies_and_sum_with_their_gradients_match_float64_numpy(dtype):
    """X = n copies of h with dh = sum_i dX_i; h = sum_i X_i (float32) with dX_i = dh: each sum in float64, then
    rounded once to the result's dtype (a bfloat16 sum rounded after every addition would differ)."""
    h, gx = normal((B, T, D), dtype, 1), normal((N, B, T, D), dtype, 2)
    x, gh = normal((N, B, T, D), dtype, 3), normal((B, T, D), jnp.float32, 4)
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731

    out, pullback = jax.vjp(lambda h: stream_copies(h, N), h)
    (dh,) = pullback(gx)
    assert out.dtype == dtype and dh.dtype == dtype
    np.testing.assert_array_equal(f64(out), np.broadcast_to(f64(h), (N, B, T, D)))
    if dtype == jnp.bfloat16:  # these 4 bfloat16 samples add exactly in float32: one rounding gives these bits
        np.testing.assert_array_equal(f64(dh), f64(jnp.asarray(f64(gx).sum(axis=0), dtype)))
    else:
        np.testing.assert_allclose(f64(dh), f64(gx).sum(axis=0), rtol=1e-6, atol=1e-6)

    total, pullback = jax.vjp(stream_sum, x)
    (dx,) = pullback(gh)
    assert total.dtype == jnp.float32 and dx.dtype == dtype
    np.testing.assert_allclose(f64(total), f64(x).sum(axis=0), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(f64(dx), np.broadcast_to(f64(gh.astype(dtype)), (N, B, T, D)))


def test_the_tpu_lowers_the_three_kernels_and_the_cpu_none():
    """A gradient through both ends: the copies forward, the copies' gradient (the sum kernel) and the sum's
    gradient (the copies again) are Pallas calls on TPU; the CPU's program has none."""
    h = normal((B, T, D), jnp.bfloat16)
    step = jax.jit(jax.grad(lambda h: jnp.sum(stream_sum(stream_copies(h, N)) ** 2)))
    text = {platform: jax.export.export(step, platforms=[platform])(h).mlir_module() for platform in ("tpu", "cpu")}
    assert text["tpu"].count("tpu_custom_call") == 3 and "tpu_custom_call" not in text["cpu"]


def test_one_stream_is_the_embedding_itself():
    h = normal((B, T, D), jnp.bfloat16)
    out, pullback = jax.vjp(lambda h: stream_copies(h, 1), h)
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(h))
    np.testing.assert_array_equal(np.asarray(pullback(out)[0]), np.asarray(h))
    assert declared(lambda h: stream_copies(h, 1), h) == []


@pytest.mark.parametrize("tokens,dim,blocks,in_bytes,out_bytes", [(64, 384, (16, 128), 4, 2),
                                                                  (32768, 2048, (256, 512), 2, 2),
                                                                  (512, 256, (128, 256), 4, 4)])
def test_declared_costs_are_the_grids_bytes_and_additions(tokens, dim, blocks, in_bytes, out_bytes):
    tm, td = blocks
    grid, tile = (tokens // tm, dim // td), (lambda t, d: (t, d))
    sizes = (tokens, dim, N, in_bytes, out_bytes)
    copying, adding = kernels.copies_cost(*sizes), kernels.sum_cost(*sizes)
    assert copying.flops == 0 and copying.transcendentals == 0
    assert copying.bytes_accessed == moved(grid, [(tm * td * in_bytes, tile), (N * tm * td * out_bytes, tile)])
    assert adding.flops == (N - 1) * tokens * dim and adding.transcendentals == 0
    assert adding.bytes_accessed == moved(grid, [(N * tm * td * in_bytes, tile), (tm * td * out_bytes, tile)])
    dtype = {2: jnp.bfloat16, 4: jnp.float32}
    h = jax.ShapeDtypeStruct((tokens, dim), dtype[in_bytes])
    x = jax.ShapeDtypeStruct((N, tokens, dim), dtype[in_bytes])
    assert declared(lambda h: copies_kernel(h, N, dtype[out_bytes], blocks=blocks), h) == [copying]
    assert declared(lambda x: sum_kernel(x, dtype[out_bytes], blocks=blocks), x) == [adding]
