"""bfloat16 compute is really on under ``dtype="bfloat16"``, and it stays close to float32.

Tests that only checked finiteness and closeness to float32 also pass with bf16 silently off; each test here
fails then: the matmuls' operand dtypes are read from the jaxpr, and the logit and loss differences must be
nonzero as well as small.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import equations, perturbed, run_steps, write_checkpoint

from nash_mhc import ExecutionConfig, LanguageModel, ModelConfig, TrainConfig, make_mesh
from nash_mhc.decoding import decode_step, init_cache
from nash_mhc.training import Batch, init_train_state
from nash_mhc.training.checkpoint import Checkpointer

BF16_UNIT_ROUNDOFF = 2.0**-9  # 8 significant bits


# ------------------------------------------------------------------------------------------------ jaxpr
def dot_generals(jaxpr: jax.extend.core.Jaxpr) -> list[jax.extend.core.JaxprEqn]:
    """Every dot_general, including those inside scan, checkpoint (remat), custom_jvp/vjp and pjit bodies."""
    return [eqn for eqn in equations(jaxpr) if eqn.primitive.name == "dot_general"]


# Sizes chosen so that no axis other than the streams (n = 5) and the scales (L = 3) has size 5 or 3: batch 1,
# T 64 (coarse 32, 16), D 64, H 4, K 16, F 128, V 384, blocks 2 and 4, n² = 25, 2n + n² = 35.
JAXPR_CONFIG = ModelConfig.preset("tiny", dtype="bfloat16", num_streams=5, num_scales=3, compression_ratio=2)
# streams, scales, and the 2n + n² coefficients of the mHC projection (each stream's [T, D] slab times its rows
# of Φ)
COEFFICIENT_AXES = {JAXPR_CONFIG.num_streams, JAXPR_CONFIG.num_scales, JAXPR_CONFIG.num_hc_coefficients}


def is_coefficient_math(eqn: jax.extend.core.JaxprEqn) -> bool:
    """The mHC coefficients and the scale aggregation stay float32 by design (docs/design.md §7); every such dot
    has an operand with a streams, scales or hyper-connection coefficients axis."""
    return any(size in COEFFICIENT_AXES for var in eqn.invars for size in var.aval.shape)


MATMULS = 18  # the forward's matmuls outside the coefficient math (see the forward test)


def operand_dtypes(eqn: jax.extend.core.JaxprEqn) -> tuple[str, ...]:
    return tuple(str(var.aval.dtype) for var in eqn.invars)


def forward(model: LanguageModel, tokens: jax.Array) -> jax.Array:
    return model(tokens).logits


def gradient(model: LanguageModel, tokens: jax.Array) -> LanguageModel:
    def loss(m: LanguageModel) -> jax.Array:
        logp = jax.nn.log_softmax(m(tokens[:, :-1]).logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    return eqx.filter_grad(loss)(model)


def decode(model: LanguageModel, tokens: jax.Array) -> jax.Array:
    return decode_step(model, init_cache(model, tokens.shape[-1]), tokens[0, 0], 5)[0]


def traced_dots(program) -> list[jax.extend.core.JaxprEqn]:
    model = eqx.filter_eval_shape(LanguageModel, JAXPR_CONFIG, key=jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((1, JAXPR_CONFIG.seq_len + (program is gradient)), jnp.int32)
    return dot_generals(eqx.filter_make_jaxpr(program)(model, tokens)[0].jaxpr)


@pytest.mark.parametrize("program", [forward, decode])
def test_every_matmul_outside_the_coefficient_math_takes_bfloat16_operands(program):
    dots = traced_dots(program)
    wide = [eqn for eqn in dots if not is_coefficient_math(eqn)]
    # V; Q and K at 3 scales; QKᵀ and AV at 3 scales; W_o; 3 FFN; head (downsampling is an elementwise weighted
    # sum in float32, not a matmul)
    assert len(wide) >= MATMULS
    not_bf16 = [(operand_dtypes(e), [v.aval.shape for v in e.invars]) for e in wide
                if operand_dtypes(e) != ("bfloat16", "bfloat16")]
    assert not not_bf16, f"matmuls not in bfloat16: {not_bf16}"
    assert {operand_dtypes(e) for e in dots if is_coefficient_math(e)} == {("float32", "float32")}


def test_backward_matmuls_take_bfloat16_operands():
    """Also the LM head's and the attention scores' (their forward returns float32: ``f32_einsum`` rounds the
    cotangent instead of letting a float32 x bfloat16 matmul run in float32); those accumulate in float32."""
    wide = [eqn for eqn in traced_dots(gradient) if not is_coefficient_math(eqn)]
    assert len(wide) >= 3 * MATMULS
    not_bf16 = [(operand_dtypes(e), [v.aval.shape for v in e.invars]) for e in wide
                if operand_dtypes(e) != ("bfloat16", "bfloat16")]
    assert not not_bf16, f"backward matmuls not in bfloat16: {not_bf16}"
    c = JAXPR_CONFIG
    score_shapes = {(c.num_heads, c.seq_len // s, c.seq_len // s) for s in c.block_sizes}  # [H, Tq, Tk]
    head = [e for e in wide if any(c.padded_vocab_size in v.aval.shape for v in (*e.invars, *e.outvars))]
    scores = [e for e in wide if any(v.aval.shape[-3:] in score_shapes for v in (*e.invars, *e.outvars))]
    # the head: forward and 2 backward; every scale's QKᵀ and AV: 2 forward (+ recomputed) and 4 backward
    assert len(head) == 3 and len(scores) >= 6 * c.num_scales
    assert {str(e.params["preferred_element_type"]) for e in head + scores} == {"float32"}


def test_f32_einsum_gradients_are_float32_accumulated_and_keep_the_operands_dtypes():
    """Against float64 NumPy: the gradients of sum(c ⊙ (a b)) for a bf16 ``a`` and a float32 ``b`` cast to
    bf16 inside. ``b``'s gradient (a float32 weight's) is one matmul over 4096 rows of bf16 operands, accumulated
    and returned in float32: within 1e-5 of the exact value (a bf16 result would be off by up to 2^-9 = 2e-3);
    ``a``'s comes back in bf16, within its rounding."""
    from nash_mhc.ops.matmul import f32_einsum

    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((4096, 64)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((64, 96)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((4096, 96)), jnp.float32)
    out, grads = jax.value_and_grad(lambda a, b: jnp.sum(c * f32_einsum("td,dv->tv", a, b, "bfloat16")),
                                    argnums=(0, 1))(a, b)
    assert out.dtype == jnp.float32 and grads[0].dtype == jnp.bfloat16 and grads[1].dtype == jnp.float32
    a64, b64, c64 = (np.asarray(x, np.float64) for x in (a, b.astype(jnp.bfloat16), c.astype(jnp.bfloat16)))
    want_a, want_b = c64 @ b64.T, a64.T @ c64
    scale_b = np.abs(want_b).max()
    assert np.abs(np.asarray(grads[1], np.float64) - want_b).max() <= 1e-5 * scale_b  # bf16 rounding: 2e-3
    assert np.abs(np.asarray(grads[0], np.float64) - want_a).max() <= 2 * BF16_UNIT_ROUNDOFF * np.abs(want_a).max()
    # the float32 weight gradient is not a bf16 number: it was not rounded on the way out
    assert not np.array_equal(np.asarray(grads[1]), np.asarray(grads[1].astype(jnp.bfloat16), np.float32))


@pytest.mark.slow  # about 70 s: two train-step compiles; the quick loop stays under 5 minutes
def test_the_layer_scan_reads_its_matmul_weights_in_bfloat16_and_no_bit_changes(monkeypatch):
    """The large matmul weights are cast to bfloat16 once before the layer scan (fsdp gathers half the bytes),
    and the loss and every gradient are bit for bit those of each layer casting its own slice."""
    import nash_mhc.model as model_module

    config = JAXPR_CONFIG
    model = perturbed(LanguageModel(config, key=jax.random.key(0)))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (2, config.seq_len + 1)), jnp.int32)
    jaxpr = eqx.filter_make_jaxpr(gradient)(model, tokens)[0].jaxpr
    read = {(str(v.aval.dtype), v.aval.shape) for eqn in equations(jaxpr) if eqn.primitive.name == "scan"
            for v in eqn.invars}
    layers, dim, hidden = config.num_layers, config.d_model, config.ffn_hidden
    assert ("bfloat16", (layers, dim, hidden)) in read and ("bfloat16", (layers, hidden, dim)) in read
    assert ("float32", (layers, dim, hidden)) not in read

    def run() -> list[np.ndarray]:
        value, grads = eqx.filter_jit(lambda m, t: eqx.filter_value_and_grad(
            lambda m: jnp.sum(m(t[:, :-1]).logits[..., :8]) + m(t[:, :-1]).aux_loss.sum())(m))(model, tokens)
        return [np.asarray(value)] + [np.asarray(g) for g in jax.tree.leaves(grads)]

    once = run()
    monkeypatch.setattr(model_module, "matmul_weights_in_compute_dtype", lambda blocks, dtype: blocks)
    per_layer = run()
    assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(once, per_layer, strict=True))


# ---------------------------------------------------------------------------------------------- numbers
DECODE_CONFIG = ModelConfig.preset("tiny", seq_len=24)  # blocks 1, 2, 4; 22 tokens fed: a trailing partial block
FED = 22


@eqx.filter_jit
def logits_and_cached(f32: LanguageModel, bf16: LanguageModel, tokens: jax.Array
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(float32 logits, bfloat16 logits, bfloat16 logits of feeding the tokens one at a time through the cache)."""

    def feed(cache, xs):
        logits, cache = decode_step(bf16, cache, *xs)
        return cache, logits

    _, cached = jax.lax.scan(feed, init_cache(bf16, bf16.config.seq_len), (tokens, jnp.arange(tokens.shape[0])))
    return f32(tokens).logits, bf16(tokens).logits, cached


@pytest.fixture(scope="module")
def outputs() -> dict[str, np.ndarray]:
    f32 = perturbed(LanguageModel(DECODE_CONFIG, key=jax.random.key(0)))
    bf16 = perturbed(LanguageModel(DECODE_CONFIG.replace(dtype="bfloat16"), key=jax.random.key(0)))
    for a, b in zip(jax.tree.leaves(eqx.filter(f32, eqx.is_array)), jax.tree.leaves(eqx.filter(bf16, eqx.is_array)),
                    strict=True):
        assert a.dtype == b.dtype == jnp.float32 and np.array_equal(a, b)  # same float32 parameters
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, DECODE_CONFIG.vocab_size, FED), jnp.int32)
    real = slice(0, DECODE_CONFIG.vocab_size)
    return {name: np.asarray(x)[:, real] for name, x in zip(("f32", "bf16", "cached"),
                                                            logits_and_cached(f32, bf16, tokens), strict=True)}


def test_bfloat16_logits_differ_from_float32_by_bfloat16_rounding(outputs):
    """Nonzero: on average at least a quarter of one bf16 rounding of the logits' spread (seen: 2.6 roundings;
    0 with bf16 off). Small: at most 10 % of the spread anywhere (seen: 2.6 %)."""
    f32, bf16 = outputs["f32"], outputs["bf16"]
    spread = float(np.std(f32))
    assert spread > 0.1 and np.all(np.isfinite(bf16))
    difference = np.abs(bf16 - f32)
    assert difference.mean() >= 0.25 * BF16_UNIT_ROUNDOFF * spread, difference.mean() / spread
    assert difference.max() <= 0.1 * spread, difference.max() / spread


def test_bfloat16_cached_decoding_matches_the_bfloat16_full_forward(outputs):
    """The cache runs the same bf16 matmuls row by row: at most 1e-3 of the spread (a fifth of one bf16
    rounding, and 1/20 of the bf16-vs-float32 difference above; seen: 5e-7)."""
    full, cached = outputs["bf16"], outputs["cached"]
    error = np.abs(cached - full).max(axis=-1)
    assert error.max() <= 1e-3 * float(np.std(full)), error


# ------------------------------------------------------------------------------------------------ training
STEP_MODEL = ModelConfig.preset("tiny", d_model=64, num_heads=8, ffn_hidden=256, seq_len=16, num_layers=2)
STEPS = 20


def learnable_batches() -> list[np.ndarray]:
    """Rows are arithmetic progressions mod the vocabulary (random start and stride 1..3): learnable in 20 steps."""
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(STEPS):
        start, stride = rng.integers(0, STEP_MODEL.vocab_size, (8, 1)), rng.integers(1, 4, (8, 1))
        batches.append(((start + stride * np.arange(STEP_MODEL.seq_len + 1)) % STEP_MODEL.vocab_size).astype(np.int32))
    return batches


@pytest.mark.slow
def test_bfloat16_training_follows_the_float32_loss_curve_on_a_sharded_mesh():
    """20 steps on a (2, 2, 2) mesh from the same initialisation and batches: the bf16 losses are within 0.01
    nats of the float32 ones at every step (seen: ≤ 7e-4, while the curve falls by about 0.8 nats) and not
    identical to them (with bf16 off the two runs would be the same program)."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 (fake) devices")
    mesh = make_mesh(2, 2, 2)
    train = TrainConfig(batch_size=8, learning_rate=3e-3, warmup_steps=2, total_steps=STEPS)
    batches = learnable_batches()
    curves = {}
    for dtype in ("float32", "bfloat16"):
        state = init_train_state(STEP_MODEL.replace(dtype=dtype), train, mesh, key=jax.random.key(0))
        _, losses = run_steps(state, [Batch(tokens=tokens) for tokens in batches])
        curves[dtype] = np.array(losses)
    f32, bf16 = curves["float32"], curves["bfloat16"]
    assert np.all(np.isfinite(bf16)) and f32[0] - f32[-1] > 0.5  # the curve moves
    difference = np.abs(bf16 - f32)
    assert difference.max() <= 0.01, difference
    assert difference.max() > 1e-5, difference


@pytest.mark.slow
def test_bfloat16_grouped_remat_resume_is_bit_identical(tmp_path):
    """bf16 streams with layers rematerialised in groups of 2: 4 steps straight equal, bit for bit, 2 steps, a
    save, a restore onto a fresh state and 2 more steps (losses and parameters). One device: the sharded
    resumes are tested on the CLI (test_train_cli), and grouped remat sharded == one device in test_step."""
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    model = STEP_MODEL.replace(dtype="bfloat16")
    train = TrainConfig(batch_size=8, learning_rate=3e-3, warmup_steps=2, total_steps=STEPS)
    batches = [Batch(tokens=tokens) for tokens in learnable_batches()[:4]]

    with ExecutionConfig(remat="full", remat_group=2).use():
        straight, straight_losses = run_steps(init_train_state(model, train, mesh, key=jax.random.key(0)), batches)
        first, first_losses = run_steps(init_train_state(model, train, mesh, key=jax.random.key(0)), batches[:2])
        write_checkpoint(tmp_path / "run", 2, first, model, train)
        fresh = init_train_state(model, train, mesh, key=jax.random.key(1))  # other values, same shardings
        reader = Checkpointer(tmp_path / "run", read_only=True)
        resumed, resumed_losses = run_steps(reader.restore(2, fresh), batches[2:])
        reader.close()
    assert first_losses + resumed_losses == straight_losses
    for a, b in zip(jax.tree.leaves(eqx.filter(straight, eqx.is_array)),
                    jax.tree.leaves(eqx.filter(resumed, eqx.is_array)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
