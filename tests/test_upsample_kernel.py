"""Multiscale shifted upsampling's Pallas kernels (kernels.tpu.upsample_kernel), run in Pallas' interpreter on the
CPU: forward and gradient against float64 NumPy written from the equations, against the XLA form of
``ops.multiscale.upsample_shifted``, the per-shard split under a mesh, the TPU dispatch and the declared cost against
an independent walk of the grid."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import declared, moved

from nash_mhc.kernels.tpu.downsample_kernel import row_tile
from nash_mhc.kernels.tpu.upsample_kernel import kernel_costs, upsample_kernel
from nash_mhc.ops.multiscale import upsample_shifted
from nash_mhc.sharding import make_mesh

pytestmark = pytest.mark.kernels  # the quick loop leaves them to the rest (docs/testing.md)

D = 256


def rows_for(block: int) -> int:
    return 16 * block  # the smallest tile: several tiles per sequence, so the shift crosses tile boundaries


def problem(block: int, dtype, batch: int = 2, tiles: int = 3, seed: int = 0):
    seq = tiles * rows_for(block)
    rng = np.random.default_rng(seed)
    y = jnp.asarray(rng.normal(size=(batch, seq // block, D)), dtype)
    g = jnp.asarray(rng.normal(size=(batch, seq, D)), dtype)
    return y, g


def reference(y, g, block):
    """float64 (up, dy) from the equations: up[i] = y[(i + 1) // s - 1] for i >= s - 1, else 0, and its pullback."""
    y, g = np.asarray(y, np.float64), np.asarray(g, np.float64)
    seq = y.shape[1] * block
    up, dy = np.zeros((y.shape[0], seq, y.shape[2])), np.zeros_like(y)
    for i in range(block - 1, seq):
        k = (i + 1) // block - 1
        up[:, i] = y[:, k]
        dy[:, k] += g[:, i]
    return up, dy


def kernel(y, block):
    return upsample_kernel(y, block, rows=rows_for(block), interpret=True)


@pytest.mark.parametrize("block", [2, 4, 16, 17])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_forward_and_gradient_match_float64_numpy(block, dtype):
    y, g = problem(block, dtype)
    up, pullback = jax.vjp(lambda y: kernel(y, block), y)
    (dy,) = pullback(g)
    want_up, want_dy = reference(y, g, block)
    assert up.dtype == dy.dtype == dtype
    np.testing.assert_array_equal(np.asarray(up, np.float64), want_up)  # a copy: exact
    # float32 sums of s terms rounded once to the dtype
    rtol = {jnp.float32: 1e-6, jnp.bfloat16: float(jnp.finfo(jnp.bfloat16).eps)}[dtype]
    np.testing.assert_allclose(np.asarray(dy, np.float64), want_dy, rtol=rtol, atol=1e-5 * np.abs(want_dy).max())


@pytest.mark.parametrize("block", [4, 16])
def test_the_kernels_are_the_xla_forms_function_and_gradient(block):
    y, g = problem(block, jnp.float32, seed=1)
    seq = g.shape[1]
    up, pullback = jax.vjp(lambda y: kernel(y, block), y)
    up_xla, pullback_xla = jax.vjp(lambda y: upsample_shifted(y, seq, block)[0], y)  # the CPU runs the XLA form
    np.testing.assert_array_equal(np.asarray(up), np.asarray(up_xla))
    np.testing.assert_allclose(np.asarray(pullback(g)[0]), np.asarray(pullback_xla(g)[0]), rtol=1e-6, atol=1e-5)


def test_under_a_mesh_each_shard_runs_the_kernels_on_its_sequences():
    """(data 2, fsdp 2, tp 2): the sequences split four ways; output and gradient equal one device's bit for bit."""
    y, g = problem(4, jnp.float32, batch=4, seed=2)
    run = jax.jit(lambda y, g: (kernel(y, 4), jax.vjp(lambda y: kernel(y, 4), y)[1](g)[0]))
    one = run(y, g)
    with jax.set_mesh(make_mesh(2, 2, 2)):
        sharded = run(y, g)
        assert "shard_map" in str(jax.make_jaxpr(run)(y, g))  # the kernels run per shard
    for a, b in zip(sharded, one, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bad_tiles_are_refused_with_one_line():
    y, _ = problem(4, jnp.float32)
    with pytest.raises(ValueError, match=r"upsampling kernels need a block of 2 to 17 .* seq = 192"):
        upsample_kernel(y, 4, rows=32, interpret=True)
    with pytest.raises(ValueError, match=r"got block = 32"):
        upsample_kernel(y[:, :6], 32, rows=192, interpret=True)


@pytest.mark.parametrize("sequences,seq,dim,block,rows,x_bytes", [
    (2, 512, 256, 4, 256, 4), (2, 768, 256, 4, 256, 2), (3, 1536, 128, 16, 512, 2), (16, 2048, 2048, 16, 2048, 2)])
def test_declared_cost_is_the_grids_work_and_bytes(sequences, seq, dim, block, rows, x_bytes):
    forward, backward = kernel_costs(sequences, seq, dim, block, rows, x_bytes, x_bytes)
    tiles, coarse_rows = seq // rows, rows // block
    grid = (dim // 128, sequences, tiles)  # the kernels' grid, walked in order
    fine = (rows * 128 * x_bytes, lambda c, n, t: (n, t, c))
    coarse = (coarse_rows * 128 * x_bytes, lambda c, n, t: (n, t, c))
    # 16-row blocks: the coarse rows ending just before the tile (the sequence's last 16 in the first tile, which
    # ignores them), the fine rows just after it (the sequence's last 16 in the last tile)
    before = (16 * 128 * x_bytes, lambda c, n, t: (n, t * coarse_rows // 16 - 1 if t else seq // block // 16 - 1, c))
    after = (16 * 128 * x_bytes, lambda c, n, t: (n, (t + 1) * rows // 16 if t < tiles - 1 else seq // 16 - 1, c))
    assert forward.flops == 0  # a copy
    assert forward.bytes_accessed == moved(grid, [coarse, before, fine])
    assert backward.flops == (block - 1) * sequences * seq // block * dim  # each coarse output adds s terms
    assert backward.bytes_accessed == moved(grid, [fine, after, coarse])


@pytest.mark.parametrize("sequences,seq,dim,block,x_bytes", [(2, 512, 256, 4, 4), (16, 2048, 2048, 16, 2)])
def test_the_tpu_branch_declares_the_kernels_costs(sequences, seq, dim, block, x_bytes):
    """What upsample_shifted's TPU branch declares in a gradient, forward then backward, at the default row tile."""
    forward, backward = kernel_costs(sequences, seq, dim, block, row_tile(seq, dim, block), x_bytes, x_bytes)
    dtype = {2: jnp.bfloat16, 4: jnp.float32}[x_bytes]

    def loss(y):
        return upsample_shifted(y, seq, block)[0].astype(jnp.float32).sum()
    got = declared(jax.grad(loss), jax.ShapeDtypeStruct((sequences, seq // block, dim), dtype))
    assert got == [forward, backward]
