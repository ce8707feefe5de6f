"""The Nash aggregation's Pallas kernels (kernels.tpu.aggregation_kernels), run in Pallas' interpreter on the CPU:
each kernel against float64 NumPy written from the equations, the outputs' gradient they compute against autodiff
of the Gram matrix, the aggregation with the kernels against the XLA form and finite differences, the per-shard
split under a mesh, and the declared cost against an independent walk of the grid."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import declared, moved
from jax.test_util import check_grads

from nash_mhc.kernels.tpu.aggregation_kernels import (
    gram_pullback,
    gram_sums,
    kernel_costs,
    output_dots,
    pullback_columns,
    pullback_xla,
    stat_columns,
    weighted_sum,
)
from nash_mhc.ops.aggregation import _pullback_coefficients, nash_aggregate
from nash_mhc.ops.game import centred_gram
from nash_mhc.sharding import make_mesh

pytestmark = pytest.mark.kernels  # the quick loop leaves them to the rest (docs/testing.md)

L, T, D = 3, 32, 256
BLOCKS = (16, 128)  # 2 token tiles x 2 column tiles
# per position: which scales exist (scale 0 always; one, two or all three), repeated over the positions
AVAILABLE = np.asarray([[1, 0, 0], [1, 1, 0], [1, 1, 1], [1, 0, 1]], bool)


def problem(seed: int = 0, batch: int = 2, dtype=jnp.float32):
    """L outputs [batch, T, D] (scale 1 close to scale 0, scale 2 far), available [batch, T, L], and the cotangent
    g [batch, T, D]; the last position of the first sequence has all-zero outputs (the scale floor)."""
    rng = np.random.default_rng(seed)
    base = rng.normal(size=(batch, T, D))
    outputs = [base, base + 0.3 * rng.normal(size=base.shape), 2.0 * rng.normal(size=base.shape)]
    for o in outputs:
        o[0, -1] = 0.0
    available = np.broadcast_to(np.resize(AVAILABLE, (T, L)), (batch, T, L))
    g = rng.normal(size=(batch, T, D))
    return [jnp.asarray(o, dtype) for o in outputs], jnp.asarray(available), jnp.asarray(g, dtype)


def reference_sums(outputs, available):
    """float64 [..., K]: sum_d o_l², then sum_d c_i c_j (i <= j), from the equations of the module docstring."""
    o = np.stack([np.asarray(x, np.float64) for x in outputs], axis=-2)  # [..., L, D]
    a = np.asarray(available, np.float64)[..., None]
    o = o * a
    mean = o.sum(axis=-2, keepdims=True) / np.maximum(a.sum(axis=-2, keepdims=True), 1.0)
    c = (o - mean) * a
    squares = [np.sum(o[..., i, :] ** 2, axis=-1) for i in range(L)]
    products = [np.sum(c[..., i, :] * c[..., j, :], axis=-1) for i in range(L) for j in range(i, L)]
    return np.stack(squares + products, axis=-1)


def f64(x) -> np.ndarray:
    return np.asarray(x, np.float64)


def reference_pullback(outputs, available, coefficients, g):
    """float64 dO_l = a_l (dc_l - sum_m a_m dc_m / count + s o_l) + w_l g, dc_l = sum_m A_lm c_m."""
    o = np.stack([f64(x) for x in outputs], axis=-2)  # [..., L, D]
    co = f64(coefficients)
    a = co[..., :L, None]
    area = co[..., L:L + L * L].reshape(*co.shape[:-1], L, L)
    w, s, count = co[..., L + L * L:2 * L + L * L, None], co[..., -2, None, None], co[..., -1, None, None]
    o = o * a
    c = (o - o.sum(axis=-2, keepdims=True) / count) * a
    dc = np.einsum("...lm,...md->...ld", area, c)
    d = a * (dc - (a * dc).sum(axis=-2, keepdims=True) / count + s * o) + w * f64(g)[..., None, :]
    return [d[..., i, :] for i in range(L)]


def coefficients_for(available, seed):
    """Random pullback coefficients [..., P] with the true mask and count (a, A, w, s, count)."""
    rng = np.random.default_rng(seed)
    mask = np.asarray(available, np.float32)
    lead = mask.shape[:-1]
    count = np.maximum(mask.sum(-1, keepdims=True), 1.0)
    columns = [mask, rng.normal(size=(*lead, L * L)), rng.normal(size=(*lead, L)), rng.normal(size=(*lead, 1)), count]
    coefficients = np.concatenate(columns, axis=-1).astype(np.float32)
    assert coefficients.shape[-1] == pullback_columns(L)
    return jnp.asarray(coefficients)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_each_kernel_matches_float64_numpy(dtype):
    outputs, available, g = problem(dtype=dtype)
    sums = gram_sums(outputs, available, blocks=BLOCKS, interpret=True)
    assert sums.shape == (2, T, stat_columns(L)) and sums.dtype == jnp.float32
    want = reference_sums(outputs, available)
    np.testing.assert_allclose(np.asarray(sums), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    dots = output_dots(outputs, g, blocks=BLOCKS, interpret=True)
    want = np.stack([np.sum(f64(o) * f64(g), axis=-1) for o in outputs], -1)
    np.testing.assert_allclose(np.asarray(dots), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # bfloat16 results: within one rounding of the float64 value
    tolerance = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}[dtype]
    weights = jnp.asarray(np.random.default_rng(1).dirichlet(np.ones(L), size=(2, T)), jnp.float32)
    out = weighted_sum(outputs, weights, blocks=BLOCKS, interpret=True)
    assert out.dtype == dtype
    want = sum(f64(weights)[..., s, None] * f64(o) for s, o in enumerate(outputs))
    np.testing.assert_allclose(f64(out), want, rtol=tolerance, atol=tolerance * np.abs(want).max())
    coefficients = coefficients_for(available, seed=2)
    grads = gram_pullback(outputs, g, coefficients, blocks=BLOCKS, interpret=True)
    for got, want in zip(grads, reference_pullback(outputs, available, coefficients, g), strict=True):
        assert got.dtype == dtype
        np.testing.assert_allclose(f64(got), want, rtol=tolerance, atol=tolerance * np.abs(want).max())


def test_the_pullback_is_autodiffs_of_the_weighted_sum_and_the_gram_matrix_in_float64():
    """pullback_xla (the pullback kernel's body) of _pullback_coefficients against jax.vjp of the weighted sum and
    centred_gram, float64, with every availability pattern and a position under the scale floor (outputs of
    about 1e-20: the floor replaces their scale by 1, so the scale's gradient must not reach them)."""
    with jax.enable_x64(True):
        outputs, available, g = problem(seed=1, dtype=jnp.float64)
        rng = np.random.default_rng(2)
        outputs = [o.at[0, -1].set(1e-20 * rng.normal(size=D)) for o in outputs]
        g = g.at[0, -1].set(0.0)  # there, only the Gram matrix's pullback (of size 1e-20) remains
        d_raw = jnp.asarray(rng.normal(size=(2, T, L, L)))
        d_scale = jnp.asarray(rng.normal(size=(2, T)))
        weights = jnp.asarray(rng.dirichlet(np.ones(L), size=(2, T)))
        (raw, scale), pull = jax.vjp(lambda o: centred_gram(o, available), outputs)
        want = [d + weights[..., s, None] * g for s, d in enumerate(pull((d_raw, d_scale))[0])]
        kept = scale != 1.0  # no position of this problem has a true scale of exactly 1
        assert not bool(kept[0, -1]) and bool(kept[0, 0])
        coefficients = _pullback_coefficients(available, weights, kept, d_raw, d_scale, D)
        got = pullback_xla(outputs, g, coefficients)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(np.asarray(a[0, -1]), np.asarray(b[0, -1]), rtol=1e-10, atol=0)


def loss(kernels: bool, target):
    def f(outputs, prior, tau, available):
        out, w, residual = nash_aggregate(outputs, available, prior, tau, num_iters=20, kernels=kernels,
                                          interpret=kernels)
        return (jnp.sum(out.astype(jnp.float32).reshape(target.shape) * target) + jnp.sum(w[..., 1] ** 2)
                + jnp.sum(residual))
    return f


def test_the_aggregation_with_kernels_is_the_xla_forms_function_and_gradients():
    """Every cotangent used (the sum's, the weights', the residual's): value and gradients equal the XLA form's to
    float32 rounding; the all-zero position gets finite gradients."""
    outputs, available, target = problem(seed=3)
    prior, tau = jnp.asarray([0.4, -0.2, 0.1]), jnp.asarray(0.05)
    got, want = (jax.value_and_grad(loss(k, target), argnums=(0, 1, 2))(outputs, prior, tau, available)
                 for k in (True, False))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        assert np.all(np.isfinite(np.asarray(a)))
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * np.abs(np.asarray(b)).max())


def test_the_kernels_gradients_match_central_differences():
    """The whole aggregation with the kernels (float32: the kernels compute in float32) against central differences
    of itself, in the outputs, the prior and the temperature."""
    outputs, available, target = problem(seed=4, batch=1)
    outputs = [o[:, :8] for o in outputs]
    f = loss(True, target[:, :8])
    def objective(o, p, t):  # check_grads passes NumPy arrays
        return f([jnp.asarray(x) for x in o], jnp.asarray(p), jnp.asarray(t), available[:, :8])
    check_grads(jax.jit(objective), (outputs, jnp.asarray([0.4, -0.2, 0.1]), jnp.asarray(0.3)), order=1,
                modes=("rev",), atol=2e-2, rtol=2e-2, eps=1e-2)  # jit: one compile, not op by op


@pytest.mark.slow  # out of the quick loop (its 5-minute budget): no invariant, the full run keeps it
def test_under_a_mesh_each_shard_runs_the_kernels_on_its_positions():
    """(data 2, fsdp 2, tp 2): the positions split four ways; sums and gradients equal one device's."""
    outputs, available, target = problem(seed=5, batch=4)
    prior, tau = jnp.asarray([0.4, -0.2, 0.1]), jnp.asarray(0.05)
    grad = jax.jit(jax.grad(loss(True, target), argnums=(0, 1, 2)))
    sums = jax.jit(lambda o, a: gram_sums(o, a, interpret=True))
    one, one_sums = grad(outputs, prior, tau, available), sums(outputs, available)
    with jax.set_mesh(make_mesh(2, 2, 2)):
        sharded, sharded_sums = grad(outputs, prior, tau, available), sums(outputs, available)
    np.testing.assert_array_equal(np.asarray(sharded_sums), np.asarray(one_sums))
    for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(one), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5 * np.abs(np.asarray(b)).max())


def heads(x, head_dim=128):
    """A [B, T, D] output as the multi-head [B, T, H, K] one."""
    return x.reshape(*x.shape[:-1], D // head_dim, head_dim)


@pytest.mark.parametrize("head_dim", [128, 64])
def test_a_head_major_first_output_gives_the_rows_function_and_gradients(head_dim):
    """The fine output as [B, T, H, K] (read head-major by the kernels, one head per column tile; K = 64 is no whole
    lane tile, so it goes to rows first): value and gradients those of the same output as rows [B, T, H K], with the
    kernels and in the XLA form (there bit for bit: it reshapes to rows); the combined output and the fine output's
    gradient come back [B, T, H, K]. The TPU compile of a small head dim is tests/test_estimate.py's (tiny)."""
    outputs, available, target = problem(seed=6)
    prior, tau = jnp.asarray([0.4, -0.2, 0.1]), jnp.asarray(0.05)
    for kernels in (True, False):
        f = loss(kernels, target)
        want = jax.value_and_grad(f, argnums=(0, 1, 2))(outputs, prior, tau, available)
        got = jax.value_and_grad(lambda o, *a, f=f: f([heads(o[0], head_dim), *o[1:]], *a), argnums=(0, 1, 2))(
            outputs, prior, tau, available)
        combined = nash_aggregate([heads(outputs[0], head_dim), *outputs[1:]], available, prior, tau, num_iters=20,
                                  kernels=kernels, interpret=kernels)[0]
        assert combined.shape == (2, T, D // head_dim, head_dim)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            if kernels:  # other column tiles: the sums over D add in another order
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                                           atol=1e-6 * np.abs(np.asarray(b)).max())
            else:
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_head_major_output_under_a_mesh_splits_every_operand_by_batch():
    """(data 2, fsdp 2, tp 2) with a batch of 2, which data x fsdp = 4 does not divide: batch falls back to data
    while the flattened positions would split four ways; with a head-major operand every operand keeps its batch
    axis, so all split alike and the result is one device's."""
    outputs, available, target = problem(seed=7, batch=2)
    outputs = [heads(outputs[0]), *outputs[1:]]
    prior, tau = jnp.asarray([0.4, -0.2, 0.1]), jnp.asarray(0.05)
    grad = jax.jit(jax.value_and_grad(loss(True, target), argnums=(0, 1, 2)))
    one = grad(outputs, prior, tau, available)
    with jax.set_mesh(make_mesh(2, 2, 2)):
        sharded = grad(outputs, prior, tau, available)
    for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(one), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5 * np.abs(np.asarray(b)).max())


def test_a_head_major_output_needs_rows_of_its_width_beside_it():
    outputs, available, _ = problem()
    with pytest.raises(ValueError, match=r"a \[B, T, H, K\] first output needs the others \[B, T, H K\]"):
        nash_aggregate([heads(outputs[0]), outputs[1][:, :, :128]], available[..., :2], jnp.zeros(2),
                       jnp.asarray(0.1), num_iters=4)


def test_bad_tiles_are_refused_with_one_line():
    outputs, available, _ = problem()
    with pytest.raises(ValueError, match=r"aggregation kernels need tiles that divide \(tokens, dim\) = \(64, 256\)"):
        gram_sums(outputs, available, blocks=(24, 128), interpret=True)


@pytest.mark.parametrize("tokens,dim,blocks,x_bytes", [(64, 256, (16, 128), 4), (32768, 2048, (256, 512), 2)])
def test_declared_cost_is_the_grids_work_and_bytes(tokens, dim, blocks, x_bytes):
    tm, td = blocks
    k, p = stat_columns(L), pullback_columns(L)
    assert (k, p) == (3 + 6, 3 + 9 + 3 + 2)
    costs = kernel_costs(L, tokens, dim, x_bytes, x_bytes)
    grid, elems = (tokens // tm, dim // td), tokens * dim
    tile = (tm * td * x_bytes, lambda t, d: (t, d))

    def row(columns: int):  # a [tm, columns] float32 tile of the token tile's row
        return tm * columns * 4, lambda t, d: t
    # per element: L selects, L adds and a divide (the mean), L subtracts and L mask products (the centring)
    mean_centred = L + L + 1 + L + L
    assert costs.gram.flops == elems * (mean_centred + 2 * k)  # a multiply and an add per sum
    assert costs.gram.bytes_accessed == moved(grid, [tile] * L + [row(L), row(k)])
    assert costs.combine.flops == elems * 2 * L
    assert costs.combine.bytes_accessed == moved(grid, [tile] * L + [row(L), tile])
    assert costs.dots.flops == elems * 2 * L
    assert costs.dots.bytes_accessed == moved(grid, [tile] * (L + 1) + [row(L)])
    # dc: L² multiply-adds; the mean's share: L multiply-adds and a divide; per output: subtract, s o (2), select,
    # w g (2)
    assert costs.pullback.flops == elems * (mean_centred + 2 * L * L + 2 * L + 1 + 6 * L)
    assert costs.pullback.bytes_accessed == moved(grid, [tile] * (L + 1) + [row(p)] + [tile] * L)

    # what the aggregation's forward and backward passes declare, in order
    dtype = {2: jnp.bfloat16, 4: jnp.float32}[x_bytes]
    outputs = [jax.ShapeDtypeStruct((1, tokens, dim), dtype)] * L
    available = jnp.ones((1, tokens, L), bool)

    def aggregate(outputs, prior, tau):
        out, w, _ = nash_aggregate(outputs, available, prior, tau, num_iters=2, kernels=True)
        return out.astype(jnp.float32).sum() + w.sum()
    got = declared(jax.grad(aggregate, argnums=(0, 1, 2)), outputs, jax.ShapeDtypeStruct((L,), jnp.float32),
                   jax.ShapeDtypeStruct((), jnp.float32))
    # the game's Newton loop runs as the per-position kernel where the positions tile (tests/test_positions_kernel.py);
    # it is the one with transcendentals (the softmaxes' exps)
    assert [c.transcendentals > 0 for c in got].count(True) == (tokens % 1024 == 0)
    assert [c for c in got if c.transcendentals == 0] == [costs.gram, costs.combine, costs.dots, costs.pullback]
