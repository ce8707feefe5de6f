"""Multiscale downsampling's Pallas kernels (kernels.tpu.downsample_kernel), run in Pallas' interpreter on the CPU:
forward and both gradients against float64 NumPy written from the equations, the kernels against the XLA form of
``ops.multiscale.downsample``, the per-shard split under a mesh, the TPU dispatch and the declared cost against an
independent walk of the grid."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import declared, moved

from nash_mhc.kernels.tpu.downsample_kernel import (
    downsample_heads_kernel,
    downsample_heads_levels_kernel,
    downsample_kernel,
    downsample_levels_kernel,
    kernel_costs,
    row_tile,
)
from nash_mhc.ops.dispatch import lowering_platform
from nash_mhc.ops.multiscale import downsample, downsample_heads, downsample_heads_levels, downsample_levels
from nash_mhc.sharding import make_mesh

pytestmark = pytest.mark.kernels  # the quick loop leaves them to the rest (docs/testing.md)

T, D, ROWS = 512, 256, 256  # 2 row tiles x 2 column tiles per sequence


def problem(block: int, dtype, batch: int = 2, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(batch, T, D)), dtype)
    w = jnp.asarray(rng.normal(size=(block, D)), dtype)
    g = jnp.asarray(rng.normal(size=(batch, T // block, D)), dtype)
    return x, w, g


def reference(x, w, g):
    """float64 (y, dx, dw) from the equations: y[n, j] = sum_o w[o] x[n, j s + o] and its pullback of g."""
    x, w, g = (np.asarray(a, np.float64) for a in (x, w, g))
    batch, seq, dim = x.shape
    block = w.shape[0]
    y = np.zeros((batch, seq // block, dim))
    dx = np.zeros_like(x)
    dw = np.zeros_like(w)
    for j in range(seq // block):
        for o in range(block):
            y[:, j] += w[o] * x[:, j * block + o]
            dx[:, j * block + o] = w[o] * g[:, j]
            dw[o] += np.sum(g[:, j] * x[:, j * block + o], axis=0)
    return y, dx, dw


def kernel(x, w):
    return downsample_kernel(x, w, rows=ROWS, interpret=True)


@pytest.mark.parametrize("block", [4, 16])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_forward_and_gradients_match_float64_numpy(block, dtype):
    x, w, g = problem(block, dtype)
    y, pullback = jax.vjp(kernel, x, w)
    dx, dw = pullback(g)
    # float32 products and sums, rounded once to the dtype: half an eps of it relative, plus float32's summation error
    rtol = {jnp.float32: 1e-6, jnp.bfloat16: float(jnp.finfo(jnp.bfloat16).eps)}[dtype]
    for got, want in zip((y, dx, dw), reference(x, w, g), strict=True):
        assert got.dtype == dtype
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=rtol, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("block", [4, 16])
def test_the_kernels_are_the_xla_forms_function_and_gradients(block):
    x, w, g = problem(block, jnp.float32, seed=1)
    y, pullback = jax.vjp(kernel, x, w)
    y_xla, pullback_xla = jax.vjp(downsample, x, w)  # the CPU runs the XLA form
    for got, want in zip((y, *pullback(g)), (y_xla, *pullback_xla(g)), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_head_major_kernels_are_downsampling_of_the_flattened_heads(dtype):
    """v [B, T, H, K] read head-major by the kernels: the same numbers as the XLA form on [B, T, H K]."""
    x, w, g = problem(4, dtype, seed=3)
    heads = x.reshape(2, T, 2, 128)

    def head_major(v, w):
        return downsample_heads_kernel(v, w, rows=ROWS, interpret=True)
    y, pullback = jax.vjp(head_major, heads, w)
    y_xla, pullback_xla = jax.vjp(downsample_heads, heads, w)
    assert y.shape == (2, T // 4, 2, 128)
    for got, want in zip((y, *pullback(g.reshape(2, T // 4, 2, 128))),
                         (y_xla, *pullback_xla(g.reshape(2, T // 4, 2, 128))), strict=True):
        np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=1e-6, atol=1e-5)


def test_under_a_mesh_each_shard_runs_the_kernels_on_its_sequences():
    """(data 2, fsdp 2, tp 2): the sequences split four ways; y and dx equal one device's bit for bit."""
    x, w, g = problem(4, jnp.float32, batch=4, seed=2)
    def head_major(v, w):  # the heads split over tp as well
        return downsample_heads_kernel(v, w, rows=ROWS, interpret=True)
    heads, g_heads = x.reshape(4, T, 2, 128), g.reshape(4, T // 4, 2, 128)
    for f, v, cotangent in ((kernel, x, g), (head_major, heads, g_heads)):
        run = jax.jit(lambda v, w, g, f=f: jax.vjp(f, v, w)[1](g) + (f(v, w),))
        one = run(v, w, cotangent)
        with jax.set_mesh(make_mesh(2, 2, 2)):
            sharded = run(v, w, cotangent)
            assert "shard_map" in str(jax.make_jaxpr(run)(v, w, cotangent))  # the kernels run per shard
        (dx, dw, y), (dx_one, dw_one, y_one) = sharded, one
        np.testing.assert_array_equal(np.asarray(y), np.asarray(y_one))
        np.testing.assert_array_equal(np.asarray(dx), np.asarray(dx_one))
        # dw adds the shards' partial sums in another order
        np.testing.assert_allclose(np.asarray(dw), np.asarray(dw_one), rtol=1e-6, atol=1e-6 * np.abs(dw_one).max())


def test_row_tiles_and_bad_tiles():
    assert row_tile(2048, 2048, 4) == 2048 and row_tile(2048, 2048, 16) == 2048 and row_tile(768, 256, 4) == 256
    assert row_tile(2048, 200, 4) is None and row_tile(2048, 64, 4) is None  # columns not a multiple of 128
    assert row_tile(128, 256, 16) is None  # fewer than 16 coarse tokens
    x, w, _ = problem(4, jnp.float32)
    with pytest.raises(ValueError, match=r"downsampling kernels need a row tile that divides seq = 512"):
        downsample_kernel(x, w, rows=96, interpret=True)
    with pytest.raises(ValueError, match=r"whole groups of 16 blocks of each of \(4, 16\)"):  # 128 rows: 8 blocks of 16
        downsample_levels_kernel(x, (w, jnp.ones((16, D))), rows=128, interpret=True)


@pytest.mark.parametrize("sequences,seq,dim,block,rows,x_bytes", [
    (2, 512, 256, 4, 256, 4), (2, 768, 256, 4, 256, 2), (16, 2048, 2048, 16, 2048, 2)])
def test_declared_cost_is_the_grids_work_and_bytes(sequences, seq, dim, block, rows, x_bytes):
    forward, backward = kernel_costs(sequences, seq, dim, (block,), rows, x_bytes, x_bytes, x_bytes)
    elems = sequences * seq * dim
    assert forward.flops == 2 * elems  # a multiply and an add per element of x
    assert backward.flops == 3 * elems  # dw's multiply-add, dx's multiply
    for groups in (1, dim // 128):  # x as [N, 1, T, D] (downsample) and as K = 128 heads (downsample_heads)
        columns = dim // groups
        grid = (groups, columns // 128, sequences, seq // rows)  # the kernels' grid, walked in order
        fine = (rows * 128 * x_bytes, lambda g, c, n, t: (n, g, t, c))
        coarse = (rows // block * 128 * x_bytes, lambda g, c, n, t: (n, g, t, c))
        weights = (block * 128 * x_bytes, lambda g, c, n, t: (g, c))
        partials = (block * 128 * 4, lambda g, c, n, t: (n, t, g, c))
        assert forward.bytes_accessed == moved(grid, [fine, weights, coarse])
        assert backward.bytes_accessed == moved(grid, [fine, weights, coarse, fine, partials])


@pytest.mark.parametrize("sequences,seq,dim,block,x_bytes", [(2, 512, 256, 4, 4), (16, 2048, 2048, 16, 2)])
def test_the_tpu_branches_declare_the_kernels_costs(sequences, seq, dim, block, x_bytes):
    """What downsample's and downsample_heads' TPU branches declare in the value and gradient, forward then backward
    (the other branch is XLA), at the default row tile: the backward rule's forward kernels are dead code."""
    forward, backward = kernel_costs(sequences, seq, dim, (block,), row_tile(seq, dim, block), x_bytes, x_bytes,
                                     x_bytes)
    dtype = {2: jnp.bfloat16, 4: jnp.float32}[x_bytes]

    def loss(x, w):
        heads = x.reshape(sequences, seq, dim // 128, 128)
        return downsample(x, w).astype(jnp.float32).sum() + downsample_heads(heads, w).astype(jnp.float32).sum()
    got = declared(jax.value_and_grad(loss, argnums=(0, 1)), jax.ShapeDtypeStruct((sequences, seq, dim), dtype),
                   jax.ShapeDtypeStruct((block, dim), dtype), live=True)
    assert got == [forward, forward, backward, backward]


# ------------------------------------------------------------------------------ several levels in one call
BLOCKS = (4, 16)


def levels_problem(dtype, batch: int = 2, seed: int = 4):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(batch, T, D)), dtype)
    ws = tuple(jnp.asarray(rng.normal(size=(block, D)), dtype) for block in BLOCKS)
    gs = tuple(jnp.asarray(rng.normal(size=(batch, T // block, D)), dtype) for block in BLOCKS)
    return x, ws, gs


def levels_kernel(x, ws):
    return downsample_levels_kernel(x, ws, rows=ROWS, interpret=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_one_call_for_several_levels_matches_float64_numpy(dtype):
    """y_l of each level, dx = sum_l dx_l (float32 sums rounded once) and each dw_l, against the equations."""
    x, ws, gs = levels_problem(dtype)
    ys, pullback = jax.vjp(levels_kernel, x, ws)
    dx, dws = pullback(gs)
    want = [reference(x, w, g) for w, g in zip(ws, gs, strict=True)]
    rtol = {jnp.float32: 1e-6, jnp.bfloat16: float(jnp.finfo(jnp.bfloat16).eps)}[dtype]
    pairs = [(y, y_ref) for y, (y_ref, _, _) in zip(ys, want, strict=True)]
    pairs += [(dw, dw_ref) for dw, (_, _, dw_ref) in zip(dws, want, strict=True)]
    pairs += [(dx, sum(dx_ref for _, dx_ref, _ in want))]
    for got, expected in pairs:
        assert got.dtype == dtype
        np.testing.assert_allclose(np.asarray(got, np.float64), expected, rtol=rtol, atol=1e-5 * np.abs(expected).max())


def test_one_call_for_several_levels_is_one_call_per_level():
    """float32: each y_l and dw_l bit for bit the one-level kernel's, dx their dx's sum (rounded once)."""
    x, ws, gs = levels_problem(jnp.float32, seed=5)
    ys, pullback = jax.vjp(levels_kernel, x, ws)
    dx, dws = pullback(gs)
    dx_sum = 0.0
    for y, dw, w, g in zip(ys, dws, ws, gs, strict=True):
        y_one, pullback_one = jax.vjp(kernel, x, w)
        dx_one, dw_one = pullback_one(g)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(y_one))
        np.testing.assert_array_equal(np.asarray(dw), np.asarray(dw_one))
        dx_sum = dx_sum + np.asarray(dx_one)
    np.testing.assert_allclose(np.asarray(dx), dx_sum, rtol=1e-6, atol=1e-6 * np.abs(dx_sum).max())


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_one_call_for_several_levels_of_the_heads_is_downsampling_of_the_flattened_heads(dtype):
    """v [B, T, H, K] read head-major: the XLA form's numbers on [B, T, H K] for every level; dx, rounded once, against
    float64 (XLA's sum of the levels' dx, each rounded to bfloat16 first, is off by more where they cancel)."""
    x, ws, gs = levels_problem(dtype, seed=6)
    heads = x.reshape(2, T, 2, 128)
    g_heads = tuple(g.reshape(2, -1, 2, 128) for g in gs)

    def head_major(v, ws):
        return downsample_heads_levels_kernel(v, ws, rows=ROWS, interpret=True)

    def xla(v, ws):
        return tuple(downsample_heads(v, w) for w in ws)
    (ys, pullback), (ys_xla, pullback_xla) = jax.vjp(head_major, heads, ws), jax.vjp(xla, heads, ws)
    (dx, dws), (dx_xla, dws_xla) = pullback(g_heads), pullback_xla(g_heads)
    assert [y.shape for y in ys] == [(2, T // block, 2, 128) for block in BLOCKS]
    if dtype == jnp.bfloat16:
        dx_xla = sum(reference(x, w, g)[1] for w, g in zip(ws, gs, strict=True)).reshape(heads.shape)
    rtol = {jnp.float32: 1e-6, jnp.bfloat16: float(jnp.finfo(jnp.bfloat16).eps)}[dtype]
    for got, want in zip((*ys, *dws, dx), (*ys_xla, *dws_xla, dx_xla), strict=True):
        want = np.asarray(want, np.float64)
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=rtol, atol=1e-5 * np.abs(want).max())


def test_one_call_for_several_levels_under_a_mesh_equals_one_device():
    x, ws, gs = levels_problem(jnp.float32, batch=4, seed=7)
    run = jax.jit(lambda x, ws, gs: (levels_kernel(x, ws), *jax.vjp(levels_kernel, x, ws)[1](gs)))
    one = run(x, ws, gs)
    with jax.set_mesh(make_mesh(2, 2, 2)):
        sharded = run(x, ws, gs)
        assert "shard_map" in str(jax.make_jaxpr(run)(x, ws, gs))
    (ys, dx, dws), (ys_one, dx_one, dws_one) = sharded, one
    for got, want in zip((*ys, dx), (*ys_one, dx_one), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for got, want in zip(dws, dws_one, strict=True):  # the shards' partial sums added in another order
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("sequences,seq,dim,rows,x_bytes", [(2, 512, 256, 256, 4), (16, 2048, 2048, 2048, 2)])
def test_declared_cost_of_several_levels_is_the_grids_work_and_bytes(sequences, seq, dim, rows, x_bytes):
    forward, backward = kernel_costs(sequences, seq, dim, BLOCKS, rows, x_bytes, x_bytes, x_bytes)
    elems = sequences * seq * dim
    assert forward.flops == 2 * elems * len(BLOCKS)  # per level a multiply and an add per element of x
    assert backward.flops == 3 * elems * len(BLOCKS) + elems  # per level dw's multiply-add, dx's multiply; dx's sum
    for groups in (1, dim // 128):
        grid = (groups, dim // groups // 128, sequences, seq // rows)
        fine = (rows * 128 * x_bytes, lambda g, c, n, t: (n, g, t, c))
        coarse = [(rows // block * 128 * x_bytes, lambda g, c, n, t: (n, g, t, c)) for block in BLOCKS]
        weights = [(block * 128 * x_bytes, lambda g, c, n, t: (g, c)) for block in BLOCKS]
        partials = [(block * 128 * 4, lambda g, c, n, t: (n, t, g, c)) for block in BLOCKS]
        assert forward.bytes_accessed == moved(grid, [fine, *weights, *coarse])
        assert backward.bytes_accessed == moved(grid, [fine, *weights, *coarse, fine, *partials])


def test_lowered_for_tpu_the_levels_are_one_call_of_the_kernels():
    """downsample_levels / downsample_heads_levels: lowered for TPU, one forward and one backward kernel for both
    levels, with the levels' declared cost; lowered for the CPU, no kernel (one XLA downsampling per level)."""
    sequences, seq, dim = 2, 2048, 256
    forward, backward = kernel_costs(sequences, seq, dim, BLOCKS, row_tile(seq, dim, 16), 2, 2, 2)

    def loss(x, ws):
        heads = x.reshape(sequences, seq, dim // 128, 128)
        total = sum(y.astype(jnp.float32).sum() for y in downsample_levels(x, ws))
        return total + sum(y.astype(jnp.float32).sum() for y in downsample_heads_levels(heads, ws))
    args = (jax.ShapeDtypeStruct((sequences, seq, dim), jnp.bfloat16),
            tuple(jax.ShapeDtypeStruct((block, dim), jnp.bfloat16) for block in BLOCKS))
    with lowering_platform("tpu"):
        assert declared(jax.value_and_grad(loss, argnums=(0, 1)), *args, live=True) == [forward, forward, backward,
                                                                                         backward]
    with lowering_platform("cpu"):
        assert declared(jax.value_and_grad(loss, argnums=(0, 1)), *args, live=True) == []
