"""The JAX ops and layers against the float64 NumPy reference in tests/reference.py, in float32.

Inputs are random and of order 1, and parameters are moved far off their initial values so that no term of an
equation is inert. Each tolerance is stated next to its check with the float32 rounding it allows for; every one
is far below the error of the mutations listed in the issue (a wrong attention scale, the other Sinkhorn order,
an upsampling shift off by one, H_post = σ, RoPE spacing 1), which move these outputs by 1e-2 or more.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref

from nash_mhc import ModelConfig
from nash_mhc.model import Block
from nash_mhc.ops import causal_attention, downsample, masked_attention, rope, sinkhorn, upsample_shifted

EPS32 = float(np.finfo(np.float32).eps)  # 1.19e-7


def normal(seed: int, shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
    return (scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def assert_close(got: object, want: np.ndarray, atol: float, rtol: float = 0.0) -> None:
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=atol, rtol=rtol)


def random_block(**overrides: object) -> Block:
    """One ``tiny`` block as the model builds it, every parameter random N(0, 0.2²) (no initialiser runs: the
    tests set the parameters they read to values of their own)."""
    shapes = eqx.filter_eval_shape(Block, ModelConfig.preset("tiny", **overrides), key=jax.random.key(0))
    leaves, treedef = jax.tree.flatten(shapes)
    return jax.tree.unflatten(treedef, [jnp.asarray(normal(i, leaf.shape, 0.2))
                                        if isinstance(leaf, jax.ShapeDtypeStruct) else leaf
                                        for i, leaf in enumerate(leaves)])


@pytest.fixture(scope="module")
def layer() -> Block:
    return random_block()


# ----------------------------------------------------------------------------------------------------- ops
def test_rms_norm_matches_reference(layer):
    norm = eqx.tree_at(lambda m: m.weight, layer.attn_norm, jnp.asarray(1.0 + normal(1, (64,), 0.5)))
    x = normal(2, (5, 7, 64), 3.0)
    # a mean of 64 squares, one rsqrt and two products: a few float32 ulps of outputs of order 1
    assert_close(norm(jnp.asarray(x)), ref.rms_norm(x, norm.weight, norm.eps), atol=1e-6, rtol=1e-6)


def test_rms_norm_output_passes_an_optimization_barrier_on_tpu_only(layer):
    """The TPU lowering writes the norm's output out once (an optimization barrier between it and the matmuls that
    read it); the CPU's and GPU's lowerings leave the fusion to XLA. The barrier is the identity, so the CPU
    reference test above holds for the TPU's numbers too."""
    x = jax.ShapeDtypeStruct((3, 64), jnp.bfloat16)
    lowered = {platform: jax.export.export(jax.jit(lambda x: layer.attn_norm(x)), platforms=[platform])(x).mlir_module()
               for platform in ("tpu", "cpu", "cuda")}
    barrier = "stablehlo.optimization_barrier"
    assert barrier in lowered["tpu"] and barrier not in lowered["cpu"] and barrier not in lowered["cuda"]


@pytest.mark.parametrize("spacing", [1, 3, 16])
def test_rope_matches_reference_at_any_spacing_and_positions(spacing):
    x = normal(3, (2, 9, 3, 16))
    positions = np.random.default_rng(4).integers(0, 300, 9)
    got = rope(jnp.asarray(x), spacing=spacing, positions=jnp.asarray(positions, jnp.int32), num_positions=300)
    # the tables are float64 cosines and sines rounded once to float32 (≤ eps/2 each, at any position); two
    # float32 products and a sum of them: a few eps times |x| (float32 angles would err by up to 2·eps·p·s rad)
    atol = 4 * EPS32 * np.abs(x).max()
    assert_close(got, ref.rope(x, positions, spacing), atol=atol)
    default = rope(jnp.asarray(x), spacing=spacing)  # positions 0..T-1
    assert_close(default, ref.rope(x, np.arange(9), spacing), atol=atol)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rope_gradient_is_the_reference_rotation_by_the_opposite_angle(dtype):
    """RoPE is a rotation R per token, so the gradient of Σ c ⊙ rope(x) is Rᵀ c: the reference rotation at the
    negated positions. bf16: the cotangent is a bf16 number, the float32 products and sums are rounded once."""
    x = normal(5, (2, 9, 3, 16))
    c = normal(6, (2, 9, 3, 16))
    positions = np.random.default_rng(7).integers(0, 300, 9)
    x_j, c_j = jnp.asarray(x, dtype), jnp.asarray(c, dtype)
    grad = jax.grad(lambda x: jnp.sum(c_j.astype(jnp.float32) * rope(x, spacing=3, positions=jnp.asarray(
        positions, jnp.int32), num_positions=300).astype(jnp.float32)))(x_j)
    assert grad.dtype == x_j.dtype
    want = ref.rope(np.asarray(c_j, np.float64), -positions, 3)
    scale = np.abs(want).max()
    atol = 4 * EPS32 * scale if dtype == "float32" else 2.0**-8 * scale  # float64 tables rounded once
    assert_close(np.asarray(grad, np.float64), want, atol=atol)


def test_rope_tpu_form_gives_the_same_bits_forward_and_backward():
    """The TPU form of bf16 RoPE (the half swap as a one-hot matmul, a hand-written backward), run on the CPU with
    rope's own float32 angle tables, equals what rope computes on the CPU (the slicing form, autodiff), outputs
    and gradients bit for bit."""
    from nash_mhc.ops.rope import angle_tables, rotate_tpu

    x = jnp.asarray(normal(8, (4, 9, 3, 128), 50.0), jnp.bfloat16)
    g = jnp.asarray(normal(9, (4, 9, 3, 128)), jnp.bfloat16)
    half, spacing = 64, 2
    cos, sin = angle_tables(9, half, spacing, 10000.0)  # rope's own
    tpu_out, tpu_pullback = jax.vjp(
        lambda x: rotate_tpu(x, jnp.concatenate([cos, cos], -1), jnp.concatenate([-sin, sin], -1)), x)
    cpu_out, cpu_pullback = jax.vjp(lambda x: rope(x, spacing=spacing), x)
    assert tpu_out.dtype == cpu_out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(tpu_out, np.float32), np.asarray(cpu_out, np.float32))
    np.testing.assert_array_equal(np.asarray(tpu_pullback(g)[0], np.float32),
                                  np.asarray(cpu_pullback(g)[0], np.float32))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gated_silu_tpu_form_matches_the_reference_forward_and_backward(dtype):
    """The TPU form of SwiGLU's gate (a hand-written backward whose two gradients are written once), run on the
    CPU: silu(a) ⊙ b and its pullback against float64 NumPy of the derivatives, d/da = b σ(a)(1 + a(1 − σ(a))),
    d/db = silu(a); float32 within a few eps; bfloat16 gradients within one rounding (relative 2^-8, computed in
    float32 and rounded once), its forward (autodiff's bfloat16 silu and product) within three."""
    from nash_mhc.ops.swiglu import gated_silu_tpu

    a, b, g = normal(30, (7, 96), 3.0), normal(31, (7, 96)), normal(32, (7, 96))
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    a, b, g = (np.asarray(cast(x), np.float64) for x in (a, b, g))  # the values the dtype holds
    out, pullback = jax.vjp(gated_silu_tpu, cast(a), cast(b))
    d_a, d_b = pullback(cast(g))
    s = ref.sigmoid(a)
    want = (ref.silu(a) * b, g * b * s * (1.0 + a * (1.0 - s)), g * ref.silu(a))
    eps = dict(float32=1e-6, bfloat16=2**-8)[dtype]
    for got, expected, roundings in zip((out, d_a, d_b), want, (3, 1, 1), strict=True):
        assert got.dtype == jnp.dtype(dtype)
        np.testing.assert_allclose(np.asarray(got, np.float64), expected, atol=1e-6, rtol=roundings * eps * 1.01)


@pytest.mark.parametrize("seq", [48, 256])  # one query chunk; four chunks (causal block skipping)
def test_causal_attention_matches_reference(seq):
    q, k, v = (normal(seed, (seq, 2, 16), scale) for seed, scale in ((5, 2.0), (6, 1.0), (7, 1.0)))
    # float32 scores (16-term dots) and a softmax over ≤ 256 keys: errors of a few 1e-7 on outputs of order 1
    assert_close(causal_attention(*map(jnp.asarray, (q, k, v))), ref.causal_attention(q, k, v), atol=2e-6)


def test_masked_attention_matches_reference():
    q, k, v = normal(8, (5, 2, 16), 2.0), normal(9, (11, 2, 16)), normal(10, (11, 2, 16))
    mask = np.random.default_rng(11).random((5, 11)) < 0.5
    mask[:, 0] = True  # every query needs a key
    got = masked_attention(*map(jnp.asarray, (q, k, v, mask)))
    assert_close(got, ref.attention(q, k, v, mask), atol=2e-6)


@pytest.mark.parametrize("num_iters", [1, 3, 20])
@pytest.mark.parametrize("n", [2, 4])
def test_sinkhorn_matches_reference(n, num_iters):
    """Logits of spread 3 are far from converged after 20 iterations, so the normalisation order shows."""
    logits = normal(12, (6, n, n), 3.0)
    # float32 log-sum-exps over n terms; the iteration contracts earlier rounding: ≤ 1.3e-7 seen on entries in [0, 1]
    assert_close(sinkhorn(jnp.asarray(logits), num_iters), ref.sinkhorn(logits, num_iters), atol=1e-6)


@pytest.mark.parametrize("seq, block", [(10, 4), (16, 4), (9, 3), (8, 1)])  # 10, 9: a trailing partial block
def test_downsample_matches_reference(seq, block):
    x, weights = normal(13, (2, seq, 6)), normal(14, (block, 6))
    got = np.asarray(downsample(jnp.asarray(x), jnp.asarray(weights)))
    for b in range(2):
        # sums of ≤ 4 float32 products of order 1
        assert_close(got[b], ref.downsample(x[b], weights), atol=1e-6)


@pytest.mark.parametrize("seq, block", [(10, 4), (16, 4), (9, 3), (8, 1), (3, 4)])  # (3, 4): no complete block
def test_upsample_shifted_matches_reference(seq, block):
    blocks = -(-seq // block)
    y = normal(15, (2, blocks, 6))
    got, available = upsample_shifted(jnp.asarray(y), seq, block)
    for b in range(2):
        want, want_available = ref.upsample_shifted(y[b], seq, block)
        np.testing.assert_array_equal(np.asarray(got[b]), want)  # a gather: exact
        np.testing.assert_array_equal(np.asarray(available), want_available)


# -------------------------------------------------------------------------------------------------- layers
def test_swiglu_matches_reference(layer):
    ffn = layer.ffn
    dim, hidden = ffn.w_gate.shape
    ffn = eqx.tree_at(lambda m: (m.w_gate, m.w_up, m.w_down), ffn,
                      (jnp.asarray(normal(16, (dim, hidden), dim**-0.5)), jnp.asarray(normal(17, (dim, hidden),
                       dim**-0.5)), jnp.asarray(normal(18, (hidden, dim), hidden**-0.5))))
    x = normal(19, (6, dim))
    # three float32 matmuls over 64 and 128 terms with outputs of order 1
    assert_close(ffn(jnp.asarray(x)), ref.swiglu(x, ffn.w_gate, ffn.w_up, ffn.w_down), atol=2e-6, rtol=2e-6)


def test_queries_keys_rotate_by_position_times_block_size(layer):
    """Scale l's queries/keys at position p are its position-0 ones rotated by RoPE at p·s_l (spacing s_l).

    Stated relative to position 0 so that whatever the layer does to a token before its projection stays out
    of the check; at scale 0 the position-0 query is also checked to be the plain projection x W_q.
    """
    attn = layer.attn
    dim = attn.wv.shape[0]
    attn = eqx.tree_at(lambda m: (m.wq, m.wk), attn, (jnp.asarray(normal(25, attn.wq.shape, dim**-0.5)),
                                                         jnp.asarray(normal(26, attn.wk.shape, dim**-0.5))))
    seq = 12
    x = normal(20, (seq, dim))
    positions = np.random.default_rng(21).integers(0, 200, seq)
    q0 = np.asarray(attn.queries_keys(0, jnp.asarray(x), jnp.zeros((seq,), jnp.int32), 1)[0])
    # one float32 matmul over 64 terms, outputs of order 1
    assert_close(q0, np.einsum("td,dhk->thk", x, ref.f64(attn.wq[0])), atol=2e-6)
    for level, block_size in enumerate(attn.block_sizes):
        zero = jnp.zeros((seq,), jnp.int32)
        q0, k0 = map(np.asarray, attn.queries_keys(level, jnp.asarray(x), zero, 1))
        q, k = attn.queries_keys(level, jnp.asarray(x), jnp.asarray(positions, jnp.int32), 200)
        atol = 4 * EPS32 * max(np.abs(q0).max(), np.abs(k0).max())  # float64 tables rounded once
        assert_close(q, ref.rope(q0, positions, block_size, attn.rope_theta), atol=atol)
        assert_close(k, ref.rope(k0, positions, block_size, attn.rope_theta), atol=atol)


def randomised_mhc(hc, seed: int):
    """The mHC connection with every coefficient parameter far from its init (α of order 1, random biases)."""
    n = hc.b_pre.shape[0]
    rng = np.random.default_rng(seed)
    values = (1.0 + 0.3 * rng.standard_normal(hc.norm.weight.shape), rng.standard_normal(hc.phi.shape) /
              np.sqrt(hc.phi.shape[0]), rng.uniform(0.5, 1.5, 3), rng.standard_normal(n), rng.standard_normal(n),
              2.0 * rng.standard_normal((n, n)))
    return eqx.tree_at(lambda m: (m.norm.weight, m.phi, m.alpha, m.b_pre, m.b_post, m.b_res), hc,
                       tuple(jnp.asarray(v, jnp.float32) for v in values))


def randomised_lite(hc, seed: int):
    """An mhc-lite connection with every coefficient parameter moved far off its initial value."""
    rng = np.random.default_rng(seed)
    n = hc.b_pre.shape[0]
    values = (1.0 + 0.3 * rng.standard_normal(hc.norm.weight.shape), rng.standard_normal(hc.phi.shape) /
              np.sqrt(hc.phi.shape[0]), rng.uniform(0.5, 1.5, 3), rng.standard_normal(n), rng.standard_normal(n),
              2.0 * rng.standard_normal(hc.b_perm.shape))
    return eqx.tree_at(lambda m: (m.norm.weight, m.phi, m.alpha, m.b_pre, m.b_post, m.b_perm), hc,
                       tuple(jnp.asarray(v, jnp.float32) for v in values))


def connection_on_random_streams(hc, seed: int):
    """(x, the connection's output, its H_res, the float64 reference output given the reference coefficients)
    for random streams x [7, n, dim] (seed ``seed``) through the block tanh(u @ w) (w from seed + 1)."""
    n = hc.b_pre.shape[0]
    dim = hc.norm.weight.shape[0] // n
    x = normal(seed, (7, n, dim))
    w = normal(seed + 1, (dim, dim), dim**-0.5)
    got, h_res = hc(jnp.asarray(x), lambda u: jnp.tanh(u @ jnp.asarray(w)))
    return x, got, h_res, lambda coefficients: ref.connection(x, coefficients,
                                                               lambda u: np.tanh(u @ w.astype(np.float64)))


def test_mhc_lite_connection_matches_reference():
    """mHC-lite's H_res (the n! permutation matrices' convex combination) and the connection, against the literal
    float64 construction of tests/reference.py."""
    hc = randomised_lite(random_block(residual="mhc-lite").attn_hc, seed=40)
    assert hc.mode == "mhc-lite" and hc.b_perm.shape == (24,)
    x, got, h_res, reference_connection = connection_on_random_streams(hc, seed=41)
    coefficients = ref.mhc_lite_coefficients(x, hc.norm.weight, hc.phi, hc.alpha, hc.b_pre, hc.b_post, hc.b_perm,
                                             eps=hc.norm.eps)
    want = reference_connection(coefficients)
    # H_res: a float32 Φ projection (256 terms) and a 24-way softmax, entries of order 1/24 to 1
    assert_close(h_res, coefficients[2], atol=2e-6)
    assert_close(got, want, atol=1e-5)  # as the mhc connection below


def test_mhc_connection_matches_reference(layer):
    hc = randomised_mhc(layer.attn_hc, seed=22)
    assert hc.mode == "mhc"
    x, got, h_res, reference_connection = connection_on_random_streams(hc, seed=23)
    coefficients = ref.mhc_coefficients(x, hc.norm.weight, hc.phi, hc.alpha, hc.b_pre, hc.b_post, hc.b_res,
                                        eps=hc.norm.eps, sinkhorn_iters=hc.sinkhorn_iters)
    want = reference_connection(coefficients)
    # H_res: float32 Φ projection (256 terms), then Sinkhorn as in test_sinkhorn_matches_reference
    assert_close(h_res, coefficients[2], atol=2e-6)
    # X: an n-term mix of order-1 streams plus H_post ⊗ y (y from a 64-term matmul), carrying the H_res error
    assert_close(got, want, atol=1e-5)


def randomised_attention(attn, seed: int):
    """Multiscale attention with projections of unit gain, random pooling weights, prior and (by its aggregation)
    temperature or gate."""
    rng = np.random.default_rng(seed)
    dim = attn.wv.shape[0]
    values = (rng.standard_normal(attn.wq.shape) * dim**-0.5, rng.standard_normal(attn.wk.shape) * dim**-0.5,
              rng.standard_normal(attn.wv.shape) * dim**-0.5, rng.standard_normal(attn.wo.shape) * dim**-0.5,
              tuple(1.0 / d.shape[0] + 0.3 * rng.standard_normal(d.shape) for d in attn.down),
              rng.standard_normal(attn.aggregation.prior.shape))
    attn = eqx.tree_at(lambda m: (m.wq, m.wk, m.wv, m.wo, m.down, m.aggregation.prior), attn,
                       jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), values))
    if attn.aggregation.mode == "nash":
        attn = eqx.tree_at(lambda m: m.aggregation.log_temperature, attn,
                           jnp.asarray(np.log(rng.uniform(0.05, 0.5)), jnp.float32))
    if attn.aggregation.mode == "gate":
        attn = eqx.tree_at(lambda m: m.aggregation.gate, attn, jnp.asarray(rng.standard_normal(
            attn.aggregation.gate.shape), jnp.float32))
    return attn


def reference_attention(attn):
    """The float64 reference of ``attn`` (any aggregation) as a function of x [T, D] → (y, weights)."""
    agg = attn.aggregation
    if agg.mode == "nash":
        tau = float(np.exp(np.float64(agg.log_temperature)))
        aggregate = lambda o, a: ref.nash(o, a, agg.prior, tau)[0]  # noqa: E731
    elif agg.mode == "gate":
        aggregate = lambda o, a: ref.gate(o, a, agg.prior, agg.gate)  # noqa: E731
    else:
        aggregate = lambda o, a: ref.convex(a, agg.prior)  # noqa: E731
    return lambda x: ref.multiscale_attention(x, attn.wq, attn.wk, attn.wv, attn.wo, list(attn.down),
                                              attn.block_sizes, aggregate, eps=attn.norm_eps, theta=attn.rope_theta)


@pytest.mark.parametrize("aggregation", ["nash", "gate", "convex"])
def test_multiscale_attention_matches_reference(layer, aggregation):
    """All three scales, the shifted upsampling, the aggregation weights and the output projection, at T = 64."""
    attn = randomised_attention(layer.attn if aggregation == "nash" else random_block(aggregation=aggregation).attn,
                                seed=27)
    x = normal(28, (64, attn.wv.shape[0]))
    y, weights, _, _ = eqx.filter_jit(lambda m, x: m(x))(attn, jnp.asarray(x))
    want_y, want_weights = reference_attention(attn)(x)
    assert np.abs(want_weights - 1.0 / 3).max() > 0.1  # the weights are not trivial here
    # Nash weights: the float32 solver vs float64 (2e-5 in test_nash), on float32 scale outputs
    assert_close(weights, want_weights, atol=5e-5)
    # y of order 1 after ~5 float32 matmuls (64 terms) and three softmaxes, carrying the weight error
    assert_close(y, want_y, atol=1e-4 * np.abs(want_y).max())


def test_tiny_block_matches_reference(layer):
    """One whole ``tiny`` block (mHC around multiscale attention, mHC around SwiGLU) on random streams."""
    block = eqx.tree_at(lambda b: (b.attn_hc, b.ffn_hc, b.attn), layer,
                        (randomised_mhc(layer.attn_hc, 29), randomised_mhc(layer.ffn_hc, 30),
                         randomised_attention(layer.attn, 31)))
    block = eqx.tree_at(lambda b: (b.attn_norm.weight, b.ffn_norm.weight), block,
                        (jnp.asarray(1.0 + normal(32, (64,), 0.3)), jnp.asarray(1.0 + normal(33, (64,), 0.3))))
    dim = block.ffn.w_gate.shape[0]
    hidden = block.ffn.w_gate.shape[1]
    block = eqx.tree_at(lambda b: (b.ffn.w_gate, b.ffn.w_up, b.ffn.w_down), block,
                        (jnp.asarray(normal(34, (dim, hidden), dim**-0.5)),
                         jnp.asarray(normal(35, (dim, hidden), dim**-0.5)),
                         jnp.asarray(normal(36, (hidden, dim), hidden**-0.5))))
    n = block.attn_hc.b_pre.shape[0]
    x = normal(37, (64, n, dim))
    got, _ = eqx.filter_jit(lambda m, x: m(x))(block, jnp.asarray(x))

    def coefficients(hc):
        return lambda xs: ref.mhc_coefficients(xs, hc.norm.weight, hc.phi, hc.alpha, hc.b_pre, hc.b_post,
                                               hc.b_res, eps=hc.norm.eps, sinkhorn_iters=hc.sinkhorn_iters)

    ffn = block.ffn
    want = ref.block(x, coefficients(block.attn_hc), coefficients(block.ffn_hc), block.attn_norm.weight,
                     block.ffn_norm.weight, lambda u: reference_attention(block.attn)(u)[0],
                     lambda u: ref.swiglu(u, ffn.w_gate, ffn.w_up, ffn.w_down), block.attn_norm.eps)
    # streams of order 1: the attention tolerance above plus the two connections' (test_mhc_...: 1e-5)
    assert_close(got, want, atol=2e-4 * np.abs(want).max())
