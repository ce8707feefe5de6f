"""The Pallas kernels of mHC's stream collapse (kernels.tpu.stream_collapse_kernels), run in Pallas' interpreter on the
CPU, composed with the stream-mix kernels into one whole hyper-connection: its value against the float64 NumPy
reference (tests/reference.py) and its gradients against central differences of that reference, the per-shard
split under a mesh, and the declared cost against an independent walk of the grid."""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from helpers import declared, equations, moved, needs_libtpu

from nash_mhc.kernels.tpu.stream_collapse_kernels import ROW_TILE_BYTES, _dx_tiles, _row_tile, kernel_costs
from nash_mhc.layers.hyperconnection import HyperConnection, _mhc_pre_weights, _pre_operand, connect_pair
from nash_mhc.ops.stream_collapse import PreWeights, collapse_streams
from nash_mhc.ops.stream_mix import stream_mix
from nash_mhc.sharding import make_mesh

N, T, D = 4, 32, 256
NORM_EPS = 1e-5  # the sublayer's RMSNorm, when the collapse applies it
BLOCKS = (16, 128)  # 2 token tiles x 2 column tiles


def connection(mode: str, seed: int = 0, tokens: int = T):
    """A hyper-connection with every coefficient parameter moved off its initialisation, streams x [n, T, D], the
    sublayer's gain s [D] (y = u ⊙ s) and the loss weights w [n, T, D]."""
    rng = np.random.default_rng(seed)
    hc = HyperConnection(mode, N, D, key=jax.random.key(seed))
    hc = jax.tree.map(lambda a: a + jnp.asarray(0.3 * rng.normal(size=a.shape), a.dtype), hc)
    hc = eqx.tree_at(lambda h: h.alpha, hc, jnp.asarray([0.7, -0.5, 0.9], jnp.float32))
    x, w = (jnp.asarray(rng.normal(size=(N, tokens, D)), jnp.float32) for _ in range(2))
    return hc, x, jnp.asarray(1 + 0.5 * rng.normal(size=D), jnp.float32), w


def pre_weights(hc: HyperConnection) -> PreWeights:
    """The connection's H_pre for the collapse kernel, as :meth:`HyperConnection._mhc_collapse` passes it."""
    return PreWeights(_pre_operand, functools.partial(_mhc_pre_weights, N, hc.phi.shape[0] // N, hc.norm.eps))


def kernel_loss(hc, x, s, w, blocks=BLOCKS, gain=None, kernels=True):
    """sum(w ⊙ X') of the connection with the collapse and mix kernels (interpreter); with a ``gain`` [D] the
    sublayer is RMSNorm(u) ⊙ s, normalised by the collapse (``kernels=False``: its XLA form)."""
    xs, u, h_post, h_res = collapse_streams(hc._coefficient_function(), pre_weights(hc), x, hc._weighted_phi(),
                                            hc._coefficient_params(), norm_weight=gain, norm_eps=NORM_EPS,
                                            blocks=blocks, interpret=True, kernels=kernels)
    out = stream_mix(xs, u * s.astype(u.dtype), h_res, h_post, blocks=blocks, interpret=True, defer=True)
    return jnp.sum(w * out.astype(jnp.float32))


def reference_loss(mode, params, x, s, w, eps, iters, gain=None):
    """The same loss in float64 NumPy from tests/reference.py, on token-major X [T, n, D]; with a ``gain`` the
    sublayer is RMSNorm(u) ⊙ s."""
    norm_weight, phi, alpha, b_pre, b_post, b_last = params
    xt = np.swapaxes(x, 0, 1)
    if mode == "mhc":
        coefficients = ref.mhc_coefficients(xt, norm_weight, phi, alpha, b_pre, b_post, b_last, eps=eps,
                                            sinkhorn_iters=iters)
    else:
        coefficients = ref.mhc_lite_coefficients(xt, norm_weight, phi, alpha, b_pre, b_post, b_last, eps=eps)
    normed = (lambda u: u) if gain is None else (lambda u: ref.rms_norm(u, gain, NORM_EPS))
    out = ref.connection(xt, coefficients, lambda u: normed(u) * ref.f64(s))
    return float(np.sum(np.swapaxes(out, 0, 1) * ref.f64(w)))


def parameters(hc):
    last = hc.b_res if hc.mode == "mhc" else hc.b_perm
    return [hc.norm.weight, hc.phi, hc.alpha, hc.b_pre, hc.b_post, last]


def xla_loss(hc, x, s, w):
    """The same loss through :meth:`HyperConnection.streams_major` on the CPU: the XLA forms of both custom
    backward passes (``kernels=False``)."""
    out, _ = hc.streams_major(x, lambda u: u * s.astype(u.dtype))
    return jnp.sum(w * out.astype(jnp.float32))


def assert_central_differences(values, got, loss, rng, eps=1e-4):
    """Each gradient in ``got``, projected on a random direction v, against (L(p + εv) − L(p − εv)) / 2ε of
    ``loss(delta, k)`` (the float64 reference with ``delta`` added to ``values[k]``)."""
    for k, (value, grad) in enumerate(zip(values, got, strict=True)):
        v = rng.normal(size=value.shape)
        want = (loss(eps * v, k) - loss(-eps * v, k)) / (2 * eps)
        np.testing.assert_allclose(float(np.sum(np.asarray(grad, np.float64) * v)), want, rtol=2e-4,
                                   atol=2e-4 * np.abs(want) + 1e-3, err_msg=f"argument {k}")


@pytest.mark.parametrize("path", [kernel_loss, xla_loss], ids=["kernels", "xla"])
@pytest.mark.parametrize("mode", ["mhc", "mhc-lite"])
def test_gradients_match_central_differences_of_the_float64_reference(mode, path):
    """Every input's gradient, projected on a random direction, against (L(p + εv) − L(p − εv)) / 2ε of the
    NumPy reference (float64, ε = 1e-4)."""
    hc, x, s, w = connection(mode)
    loss_value, grads = jax.value_and_grad(lambda hc, x: path(hc, x, s, w), argnums=(0, 1))(hc, x)
    got = parameters(grads[0]) + [grads[1]]
    values = [np.asarray(a, np.float64) for a in parameters(hc) + [x]]
    rng = np.random.default_rng(1)
    eps = 1e-4
    for k, (value, grad) in enumerate(zip(values, got, strict=True)):
        v = rng.normal(size=value.shape)

        def loss(delta, k=k):
            moved_values = [a + delta if i == k else a for i, a in enumerate(values)]
            return reference_loss(mode, moved_values[:6], moved_values[6], s, w, hc.norm.eps, hc.sinkhorn_iters)
        if k == 0:  # the forward pass itself (the collapse kernel's raw projection, sum of squares, H_pre and u)
            np.testing.assert_allclose(float(loss_value), loss(0.0), rtol=1e-5)
        want = (loss(eps * v) - loss(-eps * v)) / (2 * eps)
        np.testing.assert_allclose(float(np.sum(np.asarray(grad, np.float64) * v)), want, rtol=2e-4,
                                   atol=2e-4 * np.abs(want) + 1e-3, err_msg=f"argument {k}")


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "xla"])
def test_the_collapse_normalises_u_for_the_sublayer_like_the_float64_reference(kernels):
    """With the sublayer's RMSNorm given to the collapse (the kernel normalises each tile of u where it writes it;
    the backward pass runs the norm's from the saved statistic): the loss and every gradient, the norm's gain
    included, against central differences of the float64 reference whose sublayer is RMSNorm(u) ⊙ s."""
    hc, x, s, w = connection("mhc", seed=4)
    gain = jnp.asarray(1 + 0.3 * np.random.default_rng(7).normal(size=D), jnp.float32)
    loss_value, grads = jax.value_and_grad(lambda hc, x, g: kernel_loss(hc, x, s, w, gain=g, kernels=kernels),
                                           argnums=(0, 1, 2))(hc, x, gain)
    got = parameters(grads[0]) + [grads[1], grads[2]]
    values = [np.asarray(a, np.float64) for a in parameters(hc) + [x, gain]]
    rng = np.random.default_rng(8)

    def loss(delta, k):
        moved_values = [a + delta if i == k else a for i, a in enumerate(values)]
        return reference_loss("mhc", moved_values[:6], moved_values[6], s, w, hc.norm.eps, hc.sinkhorn_iters,
                              gain=moved_values[7])
    np.testing.assert_allclose(float(loss_value), loss(0.0, 0), rtol=1e-5)
    assert_central_differences(values, got, loss, rng)


def pair_loss(hc1, hc2, x, gain1, gain2, s, s2, w, kernels=True, blocks=BLOCKS, interpret=True):
    """sum(w ⊙ X'') of two connections in a row, each sublayer RMSNorm(u) ⊙ s normalised by its collapse, the
    first's stream update made by the second's collapse (``update=``; kernels in the interpreter, or the XLA form;
    ``interpret=False``: the kernels lowered for a TPU)."""
    def collapse(hc, x, gain, update=None):
        return collapse_streams(hc._coefficient_function(), pre_weights(hc), x, hc._weighted_phi(),
                                hc._coefficient_params(), norm_weight=gain, norm_eps=NORM_EPS, blocks=blocks,
                                interpret=interpret, kernels=kernels, update=update)
    xs, y, h_post, h_res = collapse(hc1, x, gain1)
    xs, y2, h_post2, h_res2 = collapse(hc2, xs, gain2, update=(y * s.astype(y.dtype), h_res, h_post))
    out = stream_mix(xs, y2 * s2.astype(y2.dtype), h_res2, h_post2, blocks=blocks, interpret=interpret,
                     kernels=kernels, defer=True)
    return jnp.sum(w * out.astype(jnp.float32))


def reference_pair_loss(values, s, s2, w, eps, iters):
    """The same loss in float64 NumPy: ``values`` = the two connections' parameters (6 each), X [n, T, D], the two
    gains."""
    p1, p2, x, gain1, gain2 = values[:6], values[6:12], values[12], values[13], values[14]
    xt = np.swapaxes(x, 0, 1)
    for params, gain, scale in ((p1, gain1, s), (p2, gain2, s2)):
        norm_weight, phi, alpha, b_pre, b_post, b_res = params
        coefficients = ref.mhc_coefficients(xt, norm_weight, phi, alpha, b_pre, b_post, b_res, eps=eps,
                                            sinkhorn_iters=iters)
        xt = ref.connection(xt, coefficients,
                            lambda u, gain=gain, scale=scale: ref.rms_norm(u, gain, NORM_EPS) * ref.f64(scale))
    return float(np.sum(np.swapaxes(xt, 0, 1) * ref.f64(w)))


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "xla"])
def test_a_collapse_that_makes_the_previous_update_matches_the_float64_reference(kernels):
    """Two connections in a row, the second's collapse making the first's stream update (``update=``: on TPU one
    kernel writes the updated streams and collapses them), as the model's layer runs attention and FFN: the loss
    and every gradient (both connections' parameters, X, both gains) against central differences of the float64
    reference of the two connections one after the other."""
    hc1, x, s, w = connection("mhc", seed=5)
    hc2, _, s2, _ = connection("mhc", seed=6)
    rng = np.random.default_rng(10)
    gains = [jnp.asarray(1 + 0.3 * rng.normal(size=D), jnp.float32) for _ in range(2)]
    loss_value, grads = jax.value_and_grad(
        lambda hc1, hc2, x, g1, g2: pair_loss(hc1, hc2, x, g1, g2, s, s2, w, kernels=kernels),
        argnums=(0, 1, 2, 3, 4))(hc1, hc2, x, *gains)
    got = parameters(grads[0]) + parameters(grads[1]) + list(grads[2:])
    values = [np.asarray(a, np.float64) for a in parameters(hc1) + parameters(hc2) + [x, *gains]]

    def loss(delta, k):
        return reference_pair_loss([a + delta if i == k else a for i, a in enumerate(values)], s, s2, w,
                                   hc1.norm.eps, hc1.sinkhorn_iters)
    np.testing.assert_allclose(float(loss_value), loss(0.0, 0), rtol=1e-5)
    assert_central_differences(values, got, loss, rng)


@pytest.mark.slow  # multi-second: the float64 reference and mesh tests of the same kernels are in the quick loop
def test_the_update_inside_the_collapse_gives_the_bits_of_the_update_then_the_collapse():
    """bfloat16 streams: the second collapse taking the first's update (kernels, interpreter) gives the loss and
    gradients, bit for bit, of stream_mix's update followed by a plain collapse (the CPU's path in the model)."""
    hc1, x, s, w = connection("mhc", seed=7)
    hc2, _, s2, _ = connection("mhc", seed=8)
    x = x.astype(jnp.bfloat16)

    def separate(hc1, hc2, x):
        def collapse(hc, x):
            return collapse_streams(hc._coefficient_function(), pre_weights(hc), x, hc._weighted_phi(),
                                    hc._coefficient_params(), norm_weight=hc.norm.weight[:D], norm_eps=NORM_EPS,
                                    blocks=BLOCKS, interpret=True)
        xs, y, h_post, h_res = collapse(hc1, x)
        xs = stream_mix(xs, y * s.astype(y.dtype), h_res, h_post, blocks=BLOCKS, interpret=True, defer=True)
        xs, y2, h_post2, h_res2 = collapse(hc2, xs)
        out = stream_mix(xs, y2 * s2.astype(y2.dtype), h_res2, h_post2, blocks=BLOCKS, interpret=True, defer=True)
        return jnp.sum(w * out.astype(jnp.float32))

    def fused(hc1, hc2, x):
        return pair_loss(hc1, hc2, x, hc1.norm.weight[:D], hc2.norm.weight[:D], s, s2, w)
    want = jax.jit(jax.value_and_grad(separate, argnums=(0, 1, 2)))(hc1, hc2, x)
    got = jax.jit(jax.value_and_grad(fused, argnums=(0, 1, 2)))(hc1, hc2, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow  # two TPU compiles of about 20 s: the tile tests below guard the choice in the quick loop
@needs_libtpu
@pytest.mark.parametrize("slice_name", ["v5e-1", "v4-8"])
def test_the_pairs_kernels_fit_the_vmem_of_v5e_and_v4_at_1b_shapes(slice_name):
    """The gradient of two connections in a row, the second's collapse making the first's update, with the kernels'
    default tiles at one `1b` shard of the fit table's v5e-8 batch (8 x 2048 tokens, n = 4, D = 2048, bfloat16
    streams), compiled by the TPU compiler under a one-chip mesh of a chip with 16 MiB of VMEM (v4) or a 16 MiB
    scoped limit (v5e): the compile fails where a kernel's tiles need more (the dx kernel that runs the update's
    backward needed 18.5 MiB at (256, 512) tiles, the collapse that makes the update 21 MiB on v4 at 64 rows, and
    `1b` did not compile for v5e-8 or v4-32)."""
    from jax.sharding import NamedSharding, PartitionSpec

    from nash_mhc.tpu_compile.fit import topology_devices

    mesh = make_mesh(1, 1, 1, devices=topology_devices(slice_name)[:1])
    tokens, dim = 8 * 2048, 2048
    params, static = [], []
    for seed in (0, 1):
        p, st = eqx.partition(HyperConnection("mhc", N, dim, key=jax.random.key(seed)), eqx.is_array)
        params.append(p)
        static.append(st)

    def loss(p1, p2, x, gain, s, w):
        hc1, hc2 = eqx.combine(p1, static[0]), eqx.combine(p2, static[1])
        return pair_loss(hc1, hc2, x, gain, gain, s, s, w, blocks=None, interpret=False)

    def abstract(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec()))
    arguments = (*(jax.tree.map(lambda a: abstract(a.shape, a.dtype), p) for p in params),
                 abstract((N, tokens, dim), jnp.bfloat16), abstract((dim,), jnp.float32),
                 abstract((dim,), jnp.float32), abstract((N, tokens, dim), jnp.float32))
    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*arguments).compile()
    assert "tpu_custom_call" in compiled.as_text()


def test_bfloat16_streams_follow_the_xla_path_within_bfloat16_rounding():
    """The kernels' gradients for bf16 streams against the HyperConnection's XLA path (the same rules in XLA)."""
    hc, x, s, w = connection("mhc", seed=2)
    x = x.astype(jnp.bfloat16)
    got = jax.grad(lambda hc, x: kernel_loss(hc, x, s, w), argnums=(0, 1))(hc, x)
    want = jax.grad(lambda hc, x: xla_loss(hc, x, s, w), argnums=(0, 1))(hc, x)
    assert got[1].dtype == jnp.bfloat16
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        np.testing.assert_allclose(a, b, atol=2e-2 * np.abs(b).max(), rtol=0)


@pytest.mark.slow  # multi-second: the pair under a mesh below runs the normalising collapse in the quick loop
@pytest.mark.parametrize("normalised", [False, True], ids=["u", "norm"])
def test_under_a_mesh_each_shard_runs_the_kernels_on_its_tokens(normalised):
    """(data 2, fsdp 2, tp 2): 128 tokens split four ways, 2 x 2 tiles of (16, 128) per shard, so every collapse
    kernel runs on each shard and dW sums over two token tiles there and over the shards after; gradients equal
    one device's to float32 rounding (the parameter gradients add up across shards in another order). ``norm``:
    the collapse also normalises u (its statistic split with the tokens, the gain whole on every shard)."""
    hc, x, s, w = connection("mhc", seed=3, tokens=128)
    gain = jnp.asarray(1 + 0.3 * np.random.default_rng(9).normal(size=D), jnp.float32) if normalised else None
    grad = jax.jit(jax.grad(lambda hc, x, g: kernel_loss(hc, x, s, w, gain=g), argnums=(0, 1, 2)))
    one = grad(hc, x, gain)
    with jax.set_mesh(make_mesh(2, 2, 2)):
        sharded = grad(hc, x, gain)
    for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(one), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5 * np.abs(np.asarray(b)).max())


def test_under_a_mesh_the_collapse_that_makes_the_update_runs_on_each_shard():
    """The pair of connections, the second's collapse making the first's update, under (data 2, fsdp 2, tp 2): every
    kernel, the dx kernel that also runs the update's backward included, on each shard's 32 tokens; gradients equal
    one device's to float32 rounding."""
    hc1, x, s, w = connection("mhc", seed=11, tokens=128)
    hc2, _, s2, _ = connection("mhc", seed=12, tokens=128)
    grad = jax.jit(jax.grad(lambda hc1, hc2, x: pair_loss(hc1, hc2, x, hc1.norm.weight[:D], hc2.norm.weight[:D], s,
                                                          s2, w), argnums=(0, 1, 2)))
    one = grad(hc1, hc2, x)
    with jax.set_mesh(make_mesh(2, 2, 2)):
        sharded = grad(hc1, hc2, x)
    for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(one), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5 * np.abs(np.asarray(b)).max())


@pytest.mark.parametrize("normalised", [False, True], ids=["u", "norm"])
def test_kernels_that_accumulate_along_their_inner_grid_axis_declare_it_arbitrary(normalised):
    """dH_pre sums over column tiles, dx sums dW over token tiles: a "parallel" inner axis would let a
    megacore chip (v4, v5p) split the sum between its cores, which the interpreter cannot show. With the norm,
    dH_pre's kernel takes whole rows and writes each tile's part of the gain's gradient: no sum along its grid."""
    hc, x, _, _ = connection("mhc")
    gain = jnp.ones(D, jnp.float32) if normalised else None

    def loss(x, w):
        _, u, h_post, h_res = collapse_streams(hc._coefficient_function(), pre_weights(hc), x, w,
                                               hc._coefficient_params(), norm_weight=gain, blocks=BLOCKS)
        return u.sum() + h_post.sum() + h_res.sum()
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, hc._weighted_phi())
    semantics = [eqn.params["compiler_params"].dimension_semantics for eqn in equations(jaxpr)
                 if eqn.primitive.name == "pallas_call"]
    # collapse (whole rows: no sum along the grid), dH_pre, dx
    dh_pre = ("parallel",) if normalised else ("parallel", "arbitrary")
    assert semantics == [("parallel",), dh_pre, ("parallel", "arbitrary")]


@pytest.mark.parametrize("tokens,dim,want,half", [(8192, 2048, 128, 64), (32768, 2048, 128, 64),
                                                  (4096, 768, 256, 128), (48, 64, 16, 16), (8192, 16384, 16, None),
                                                  (8192, 65536, None, None), (40, 256, None, None)])
def test_the_forward_kernel_takes_the_largest_token_tile_of_whole_rows_that_fits(tokens, dim, want, half):
    """Token tiles of whole rows: the largest of TOKEN_BLOCKS that divides T with n x tile x D float32 within
    ROW_TILE_BYTES (4 MiB), or half of it for the kernel that also makes the previous update (X and X' in VMEM);
    none (the XLA form) where no tile divides T or even 16 rows are too wide."""
    assert _row_tile(None, N, tokens, dim) == want
    assert _row_tile(None, N, tokens, dim, ROW_TILE_BYTES // 2) == half
    assert _row_tile((32, 128), N, tokens, dim) == 32  # given tiles win


def test_the_dx_kernel_that_runs_the_updates_backward_takes_token_tiles_within_its_budget():
    """dx's tiles are stream_mix's (the largest token and column tiles that divide), except when it also runs the
    update's backward: then n x tm x td float32 within UPDATE_DX_TILE_BYTES (1 MiB), the column tile kept."""
    assert _dx_tiles(None, N, 16384, 2048, True, False) == (256, 512)
    assert _dx_tiles(None, N, 16384, 2048, True, True) == (128, 512)
    assert _dx_tiles(None, N, 16384, 768, True, True) == (256, 256)  # 1 MiB at 256 x 256
    assert _dx_tiles(None, N, 48, 64, True, True) == (16, 64)
    assert _dx_tiles((32, 128), N, 16384, 2048, True, True) == (32, 128)  # given tiles win
    assert _dx_tiles(None, N, 16384, 2048, False, True) is None  # the XLA form
    assert _dx_tiles(None, N, 40, 256, True, True) is None  # no token tile divides


@needs_libtpu
def test_chips_with_16_mib_of_vmem_take_a_quarter_of_each_tile_budget():
    """Under a mesh of TPU v4 chips (16 MiB of VMEM) every budget is a quarter; under v5e's the full one."""
    from nash_mhc.tpu_compile.fit import topology_devices

    for name, row, half, dx in (("v4-8", 32, 16, (32, 512)), ("v5e-1", 128, 64, (128, 512))):
        with jax.set_mesh(make_mesh(1, 1, 1, devices=topology_devices(name)[:1])):
            assert _row_tile(None, N, 16384, 2048) == row
            assert _row_tile(None, N, 16384, 2048, ROW_TILE_BYTES // 2) == half
            assert _dx_tiles(None, N, 16384, 2048, True, True) == dx


def test_an_update_left_unmade_needs_mhc_connections():
    """connect_pair leaves (or takes) an update only between mhc / mhc-lite collapses: with HC it is refused."""
    hc = HyperConnection("hc", N, D, key=jax.random.key(0))
    x = jnp.zeros((N, T, D), jnp.float32)
    with pytest.raises(ValueError, match="connect_pair: an update left unmade needs mhc or mhc-lite connections, "
                                         "got hc and hc"):
        connect_pair(x, (hc, lambda u: u, None), (hc, lambda u: u, None), leave_update=True)


def test_bad_tiles_are_refused_with_one_line():
    hc, x, _, _ = connection("mhc")
    with pytest.raises(ValueError, match=r"collapse_streams needs tiles that divide \(tokens, dim\) = \(32, 256\)"):
        collapse_streams(hc._coefficient_function(), pre_weights(hc), x, hc._weighted_phi(),
                         hc._coefficient_params(), blocks=(24, 128))


@pytest.mark.parametrize("tokens,dim,blocks,x_bytes", [(32, 256, (16, 128), 4), (32768, 2048, (256, 512), 2)])
def test_declared_cost_is_the_grids_multiply_adds_and_bytes(tokens, dim, blocks, x_bytes):
    tm, td = blocks
    coeffs = 2 * N + N * N
    costs = kernel_costs(N, tokens, dim, coeffs, x_bytes, blocks)
    stream, slab = N * tm * td * x_bytes, tm * td * x_bytes
    # collapse: grid (token), whole rows; dh_pre: grid (token, column); dx: grid (column, token), tokens innermost
    rows = N * tm * dim * x_bytes
    assert costs.collapse.flops == 2 * N * tokens * dim * (coeffs + 2)  # X_j W_j, X_j², H_pre X_j
    assert costs.collapse.transcendentals == tokens * (N + 1)  # H_pre: rsqrt and n sigmoids per token
    assert costs.collapse.bytes_accessed == moved((tokens // tm,), [
        (rows, lambda t: t), (N * dim * coeffs * 4, lambda t: 0), (2 * N * 4, lambda t: 0),
        (tm * coeffs * 4, lambda t: t), (tm * 4, lambda t: t), (tm * dim * x_bytes, lambda t: t)])
    assert costs.dh_pre.flops == 2 * N * tokens * dim
    assert costs.dh_pre.bytes_accessed == moved((tokens // tm, dim // td), [
        (stream, lambda t, d: (t, d)), (slab, lambda t, d: (t, d)), (tm * N * 4, lambda t, d: t)])
    # dX's and dW's products, n for H_resᵀ g and two more for dX
    assert costs.dx.flops == 2 * N * tokens * dim * (2 * coeffs + N + 2)
    assert costs.dx.bytes_accessed == moved((dim // td, tokens // tm), [
        (stream, lambda d, t: (t, d)), (stream, lambda d, t: (t, d)), (slab, lambda d, t: (t, d)),
        (tm * (N + 1 + N * N) * 4, lambda d, t: t), (tm * coeffs * 4, lambda d, t: t),
        (N * coeffs * td * 4, lambda d, t: d),
        (stream, lambda d, t: (t, d)), (N * coeffs * td * 4, lambda d, t: d)])

    # mhc-lite: no Sinkhorn, whose own kernels would join the list
    hc = jax.eval_shape(lambda: HyperConnection("mhc-lite", N, dim, key=jax.random.key(0)))
    dtype = {2: jnp.bfloat16, 4: jnp.float32}[x_bytes]
    x = jax.ShapeDtypeStruct((N, tokens, dim), dtype)
    lite = (2 * N + 24,)  # n! = 24 permutation columns

    def loss(x, w, params):
        _, u, h_post, h_res = collapse_streams(hc._coefficient_function(), pre_weights(hc), x, w, params,
                                               blocks=blocks)
        return u.astype(jnp.float32).sum() + h_post.sum() + h_res.sum()
    params = tuple(jax.ShapeDtypeStruct(shape, jnp.float32) for shape in ((3,), (N,), (N,), (24,)))
    w = jax.ShapeDtypeStruct((N, dim, *lite), jnp.float32)
    lite_costs = kernel_costs(N, tokens, dim, lite[0], x_bytes, blocks)
    assert declared(jax.grad(loss, argnums=(0, 1)), x, w, params) == [lite_costs.collapse, lite_costs.dh_pre,
                                                                       lite_costs.dx]

    # with the sublayer's RMSNorm: the collapse also reads the gain once and writes inv [T, 1] and y (X's dtype);
    # per token and feature a multiply-add of the sum of squares and two multiplies, an rsqrt per token
    normed = kernel_costs(N, tokens, dim, coeffs, x_bytes, blocks, norm=True)
    assert normed.collapse.flops == costs.collapse.flops + 4 * tokens * dim
    assert normed.collapse.transcendentals == tokens * (N + 2)
    assert normed.collapse.bytes_accessed == moved((tokens // tm,), [
        (rows, lambda t: t), (N * dim * coeffs * 4, lambda t: 0), (2 * N * 4, lambda t: 0), (dim * 4, lambda t: 0),
        (tm * coeffs * 4, lambda t: t), (tm * 4, lambda t: t), (tm * dim * x_bytes, lambda t: t),
        (tm * 4, lambda t: t), (tm * dim * x_bytes, lambda t: t)])
    assert normed.dx == costs.dx
    # and dH_pre's kernel walks the collapse's tiles of whole rows, running the norm's backward first: reads X, u,
    # dy, inv and the gain (once), writes du, dH_pre and each tile's partial gain gradient; per token and feature
    # x̂, dy · g, the mean's multiply-add, du's three and the gain gradient's multiply-add beside X_j du's n
    assert normed.dh_pre.flops == (2 * N + 9) * tokens * dim
    assert normed.dh_pre.transcendentals == 0
    assert normed.dh_pre.bytes_accessed == moved((tokens // tm,), [
        (rows, lambda t: t), (tm * dim * x_bytes, lambda t: t), (tm * dim * x_bytes, lambda t: t),
        (tm * 4, lambda t: t), (dim * 4, lambda t: 0),
        (tm * dim * x_bytes, lambda t: t), (tm * N * 4, lambda t: t), (dim * 4, lambda t: t)])

    def normed_loss(x, w, params, gain):
        _, y, h_post, h_res = collapse_streams(hc._coefficient_function(), pre_weights(hc), x, w, params,
                                               norm_weight=gain, blocks=blocks)
        return y.astype(jnp.float32).sum() + h_post.sum() + h_res.sum()
    lite_normed = kernel_costs(N, tokens, dim, lite[0], x_bytes, blocks, norm=True)
    gain = jax.ShapeDtypeStruct((dim,), jnp.float32)
    assert declared(jax.grad(normed_loss, argnums=(0, 1, 3)), x, w, params, gain) == [
        lite_normed.collapse, lite_normed.dh_pre, lite_costs.dx]


@pytest.mark.parametrize("tokens,dim,blocks,x_bytes", [(32, 256, (16, 128), 4), (32768, 2048, (256, 512), 2)])
def test_the_collapse_that_makes_the_update_declares_the_updates_bytes_but_no_second_read(tokens, dim, blocks, x_bytes):
    """With ``update``, the collapse kernel also reads the previous X, y, H_res and H_post and writes the updated X
    (its n (n + 1) multiply-adds per token and feature), then collapses that from VMEM; the dx kernel reads the
    previous X in X's place, y, H_res and H_post, makes the updated X again and runs the update's deferred backward
    (dy, dH_res, dH_post per column tile): against the grids' walks, and the kernels of the pair's gradient: the
    fused forward, dH_pre (with the norm) and the fused dx, no separate update backward."""
    tm = blocks[0]
    coeffs = 2 * N + N * N
    rows, slab = N * tm * dim * x_bytes, tm * dim * x_bytes
    costs = kernel_costs(N, tokens, dim, coeffs, x_bytes, blocks, norm=True, update_bytes=x_bytes)
    plain = kernel_costs(N, tokens, dim, coeffs, x_bytes, blocks, norm=True)
    assert costs.collapse.flops == plain.collapse.flops + 2 * N * (N + 1) * tokens * dim
    assert costs.collapse.transcendentals == plain.collapse.transcendentals
    assert costs.collapse.bytes_accessed == moved((tokens // tm,), [
        (rows, lambda t: t), (slab, lambda t: t), (tm * N * N * 4, lambda t: t), (tm * N * 4, lambda t: t),  # X, y, H
        (N * dim * coeffs * 4, lambda t: 0), (2 * N * 4, lambda t: 0), (dim * 4, lambda t: 0),  # W, operand, gain
        (rows, lambda t: t),  # the updated X, written
        (tm * coeffs * 4, lambda t: t), (tm * 4, lambda t: t), (slab, lambda t: t), (tm * 4, lambda t: t),
        (slab, lambda t: t)])  # raw, ss, u, inv, y
    assert costs.dh_pre == plain.dh_pre
    td = blocks[1]
    stream, tile = N * tm * td * x_bytes, tm * td * x_bytes
    # dx's products, then the update made again (n (n + 1)) and its dy, dH_res, dH_post (n (n + 2))
    assert costs.dx.flops == plain.dx.flops + 2 * N * (2 * N + 3) * tokens * dim
    assert costs.dx.bytes_accessed == moved((dim // td, tokens // tm), [
        (stream, lambda d, t: (t, d)), (tile, lambda d, t: (t, d)), (tm * N * N * 4, lambda d, t: t),
        (tm * N * 4, lambda d, t: t),  # the previous X, y, H_res, H_post
        (stream, lambda d, t: (t, d)), (tile, lambda d, t: (t, d)), (tm * (N + 1 + N * N) * 4, lambda d, t: t),
        (tm * coeffs * 4, lambda d, t: t), (N * coeffs * td * 4, lambda d, t: d),  # g, du, scalars, d_raw, W
        (stream, lambda d, t: (t, d)), (N * coeffs * td * 4, lambda d, t: d), (tile, lambda d, t: (t, d)),
        (tm * N * N * 4, lambda d, t: (d, t)), (tm * N * 4, lambda d, t: (d, t))])  # dX, dWᵀ, dy, dH parts

    # mhc-lite: no Sinkhorn, whose own kernels would join the list
    hc = jax.eval_shape(lambda: HyperConnection("mhc-lite", N, dim, key=jax.random.key(0)))
    lite = 2 * N + 24  # n! = 24 permutation columns
    dtype = {2: jnp.bfloat16, 4: jnp.float32}[x_bytes]
    x = jax.ShapeDtypeStruct((N, tokens, dim), dtype)
    y = jax.ShapeDtypeStruct((tokens, dim), dtype)
    h_res, h_post = jax.ShapeDtypeStruct((tokens, N, N), jnp.float32), jax.ShapeDtypeStruct((tokens, N), jnp.float32)
    w = jax.ShapeDtypeStruct((N, dim, lite), jnp.float32)
    params = tuple(jax.ShapeDtypeStruct(shape, jnp.float32) for shape in ((3,), (N,), (N,), (24,)))
    gain = jax.ShapeDtypeStruct((dim,), jnp.float32)

    def loss(x, y, h_res, h_post, w, params, gain):
        xs, y2, h_post2, h_res2 = collapse_streams(hc._coefficient_function(), pre_weights(hc), x, w, params,
                                                   norm_weight=gain, blocks=blocks, update=(y, h_res, h_post))
        return xs.astype(jnp.float32).sum() + y2.astype(jnp.float32).sum() + h_post2.sum() + h_res2.sum()
    lite_costs = kernel_costs(N, tokens, dim, lite, x_bytes, blocks, norm=True, update_bytes=x_bytes)
    assert declared(jax.grad(loss, argnums=tuple(range(7))), x, y, h_res, h_post, w, params, gain) == [
        lite_costs.collapse, lite_costs.dh_pre, lite_costs.dx]
