"""RoPE's Pallas TPU kernel (kernels.tpu.rope_kernel), run in Pallas' interpreter on the CPU: forward and gradient
against float64 NumPy written from the equations, bit for bit against the XLA forms (rope's slicing form and the
one-hot-matmul form), the per-shard split under a mesh, the TPU dispatch and the declared cost against an
independent walk of the grid."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from helpers import declared, moved

from nash_mhc.kernels.tpu.rope_kernel import kernel_cost, rotate_kernel, row_tile
from nash_mhc.ops.rope import angle_tables, rope, rotate_tpu
from nash_mhc.sharding import make_mesh

pytestmark = pytest.mark.kernels  # the quick loop leaves them to the rest (docs/testing.md)

T, H, K, SPACING = 64, 2, 256, 3  # 4 row tiles of 16; two lane tiles per head (the roll crosses them)


def tables(seq: int, head_dim: int, spacing: int) -> tuple[jax.Array, jax.Array]:
    """rope's own float32 tables as the kernel takes them: cos = [c, c], sin = [-s, s] [seq, head_dim]."""
    cos, sin = (t[:, 0] for t in angle_tables(seq, head_dim // 2, spacing, 10000.0))
    return jnp.asarray(np.concatenate([cos, cos], -1)), jnp.asarray(np.concatenate([-sin, sin], -1))


def problem(dtype, batch: int = 2, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(batch, T, H, K)) * 20.0, dtype)
    g = jnp.asarray(rng.normal(size=(batch, T, H, K)), dtype)
    return x, g


def kernel(x, rows=16):
    return rotate_kernel(x, *tables(T, K, SPACING), rows=rows, interpret=True)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_forward_and_gradient_match_float64_numpy(dtype):
    """y is the rotation of each pair (x_i, x_{i+K/2}) by the position's angle; the gradient of Σ g ⊙ y is the
    rotation of g by the opposite angle. Float32 tables (rounded once from float64) and products, y rounded once
    to the dtype: within one rounding of it, plus a few float32 eps."""
    x, g = problem(dtype)
    y, pullback = jax.vjp(kernel, x)
    (dx,) = pullback(g)
    positions = np.arange(T)
    want_y = ref.rope(np.asarray(x, np.float64), positions, SPACING)
    want_dx = ref.rope(np.asarray(g, np.float64), -positions, SPACING)
    for got, want in ((y, want_y), (dx, want_dx)):
        assert got.dtype == dtype
        rounding = 0.0 if dtype == jnp.float32 else float(jnp.finfo(dtype).eps)
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=rounding,
                                   atol=4 * float(jnp.finfo(jnp.float32).eps) * np.abs(want).max())


def test_the_kernel_gives_the_xla_forms_numbers():
    """The same float32 products and sum, rounded once: the one-hot-matmul form (which the TPU ran before) and
    rope's slicing form on the CPU, outputs and gradients. Bit for bit but where a compiler contracts the product
    and the sum into one fused multiply-add (seen on the CPU for one element of the gradient in 65,536): one
    rounding step of bfloat16 there."""
    x, g = problem(jnp.bfloat16, seed=1)
    cos, sin = tables(T, K, SPACING)
    y, pullback = jax.vjp(kernel, x)
    y_tpu, pullback_tpu = jax.vjp(lambda x: rotate_tpu(x, cos[:, None], sin[:, None]), x)
    y_cpu, pullback_cpu = jax.vjp(lambda x: rope(x, spacing=SPACING), x)
    for got, *wants in ((y, y_tpu, y_cpu), (pullback(g)[0], pullback_tpu(g)[0], pullback_cpu(g)[0])):
        for want in wants:
            got32, want32 = np.asarray(got, np.float32), np.asarray(want, np.float32)
            assert np.mean(got32 != want32) < 1e-3
            np.testing.assert_allclose(got32, want32, rtol=float(jnp.finfo(jnp.bfloat16).eps), atol=0)


def test_under_a_mesh_each_shard_rotates_its_sequences():
    """(data 2, fsdp 2, tp 2): rows split four ways and heads two; y and dx equal one device's bit for bit."""
    x, g = problem(jnp.bfloat16, batch=4, seed=2)
    run = jax.jit(lambda x, g: (kernel(x), jax.vjp(kernel, x)[1](g)[0]))
    one = run(x, g)
    with jax.set_mesh(make_mesh(2, 2, 2)):
        sharded = run(x, g)
        assert "shard_map" in str(jax.make_jaxpr(run)(x, g))  # the kernel runs per shard
    for got, want in zip(sharded, one, strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_row_tiles_and_bad_input():
    assert row_tile(2048, 128) == 512 and row_tile(96, 128) == 32 and row_tile(64, 256) == 64
    assert row_tile(2048, 64) is None and row_tile(2048, 192) is None  # the head dim is not whole lane tiles
    assert row_tile(8, 128) is None  # no tile divides the sequence
    x, _ = problem(jnp.bfloat16)
    with pytest.raises(ValueError, match=r"rope kernel needs x \[B, T, H, K\]"):
        kernel(x, rows=24)
    with pytest.raises(ValueError, match=r"rope kernel needs x \[B, T, H, K\]"):
        rotate_kernel(x, *tables(T // 2, K, 1), interpret=True)


@pytest.mark.parametrize("batch,seq,heads,head_dim,itemsize", [(2, 64, 2, 256, 2), (8, 2048, 16, 128, 2),
                                                                (3, 96, 1, 128, 4)])
def test_declared_cost_is_the_grids_work_and_bytes(batch, seq, heads, head_dim, itemsize):
    cost = kernel_cost(batch * heads, seq, head_dim, itemsize)
    elems = batch * seq * heads * head_dim
    assert cost.flops == 3 * elems and cost.transcendentals == 0  # two products and a sum per element
    rows = row_tile(seq, head_dim)
    grid = (seq // rows, batch * heads)  # the kernel's grid, walked in order
    tile = (rows * head_dim * itemsize, lambda t, n: (n, t))
    table = (rows * head_dim * 4, lambda t, n: t)
    assert cost.bytes_accessed == moved(grid, [tile, table, table, tile])


def test_rope_on_tpu_declares_the_kernel_forward_and_backward():
    """rope's TPU branch for a whole 16-bit sequence is the kernel, forward then backward (the other branch is
    XLA); at given positions (decoding) and for a head dim that is not whole lane tiles it stays XLA."""
    cost = kernel_cost(2 * H, T, K, 2)
    x = jax.ShapeDtypeStruct((2, T, H, K), jnp.bfloat16)

    def loss(x):
        return rope(x, spacing=SPACING).astype(jnp.float32).sum()
    assert declared(jax.grad(loss), x) == [cost, cost]
    positions = jnp.arange(T, dtype=jnp.int32)
    assert declared(jax.grad(lambda x: rope(x, positions=positions, num_positions=T).astype(jnp.float32).sum()),
                    x) == []
    assert declared(jax.grad(loss), jax.ShapeDtypeStruct((2, T, H, 64), jnp.bfloat16)) == []
