"""LanguageModel invariants: mode equivalences, mHC stability at init, finite gradients, typing, scan."""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import equations, perturbed

from nash_mhc import ExecutionConfig, LanguageModel, ModelConfig
from nash_mhc.model import Block

SEQ = 32


def tokens(seed: int = 0, seq: int = SEQ, batch: int | None = None) -> jax.Array:
    shape = (seq,) if batch is None else (batch, seq)
    return jax.random.randint(jax.random.key(seed), shape, 0, 259)


def lm_loss(model: LanguageModel, batch: jax.Array) -> jax.Array:
    out = jax.vmap(model)(batch[:, :-1])
    logp = jax.nn.log_softmax(out.logits, axis=-1)
    nll = -jnp.take_along_axis(logp, batch[:, 1:, None], axis=-1)
    return jnp.mean(nll) + 0.01 * jnp.mean(out.aux_loss)


value_and_grad = eqx.filter_jit(eqx.filter_value_and_grad(lm_loss))


def all_finite(tree) -> bool:
    return all(bool(jnp.all(jnp.isfinite(x.astype(jnp.float32)))) for x in jax.tree.leaves(eqx.filter(tree,
                                                                                                      eqx.is_array)))


def full_attention_twin(model: LanguageModel) -> LanguageModel:
    """The ``attention="full"`` model with every parameter it has taken from ``model`` (scale 0's Q and K)."""
    twin = LanguageModel(model.config.replace(attention="full"), key=jax.random.key(0))
    shared = lambda m: (m.embedding, m.blocks.attn.wv, m.blocks.attn.wo, m.blocks.ffn, m.blocks.attn_hc,  # noqa: E731
                        m.blocks.ffn_hc, m.blocks.attn_norm, m.blocks.ffn_norm, m.final_norm)
    twin = eqx.tree_at(shared, twin, shared(model), is_leaf=lambda x: x is None)
    return eqx.tree_at(lambda m: (m.blocks.attn.wq, m.blocks.attn.wk), twin,
                       (model.blocks.attn.wq[:, :1], model.blocks.attn.wk[:, :1]))


@pytest.mark.slow  # multi-second (a compilation per structure), an initialisation property, not an invariant
@pytest.mark.parametrize("aggregation", ["nash", "gate", "convex"])
def test_the_multiscale_model_starts_as_full_attention(aggregation):
    """At initialisation the prior puts 0.99 of each position's attention output on scale 0, so the multiscale
    model's logits equal those of the full-attention model with the same parameters up to the 1 % that the
    coarse scales get. Tolerance 3e-3: the deviation is linear in the coarse weight, and the previous uniform
    prior (coarse weight 2/3) moved the logits by 0.10-0.11 (asserted below), i.e. 1.5e-3 per 1 % (logits of
    RMS 0.18, max 1.56 here)."""
    model = LanguageModel(ModelConfig.preset("tiny", aggregation=aggregation), key=jax.random.key(0))
    ids = tokens(1, seq=64, batch=4)
    logits = eqx.filter_jit(lambda m, ids: m(ids).logits[..., :259])  # one compile per model structure
    full = logits(full_attention_twin(model), ids)
    assert float(jnp.max(jnp.abs(logits(model, ids) - full))) <= 3e-3
    uniform = eqx.tree_at(lambda m: m.blocks.attn.aggregation.prior, model,
                          jnp.zeros_like(model.blocks.attn.aggregation.prior))
    assert float(jnp.max(jnp.abs(logits(uniform, ids) - full))) >= 0.05  # the check can tell


@pytest.mark.slow
def test_mhc_with_one_stream_equals_plain_exactly():
    mhc = ModelConfig.preset("tiny", residual="mhc", num_streams=1)
    plain = ModelConfig.preset("tiny", residual="plain")
    a = perturbed(LanguageModel(mhc, key=jax.random.key(3)))
    b = perturbed(LanguageModel(plain, key=jax.random.key(3)))
    leaves_a, leaves_b = jax.tree.leaves(eqx.filter(a, eqx.is_array)), jax.tree.leaves(eqx.filter(b, eqx.is_array))
    assert len(leaves_a) == len(leaves_b)
    assert all(np.array_equal(x, y) for x, y in zip(leaves_a, leaves_b, strict=True))
    out_a, out_b = a(tokens()), b(tokens())
    assert np.array_equal(np.asarray(out_a.logits), np.asarray(out_b.logits))
    assert float(out_a.aux_loss) == float(out_b.aux_loss)


@eqx.filter_jit
def residual_maps(model: LanguageModel, tokens: jax.Array) -> jax.Array:
    return model(tokens, return_residual_maps=True).residual_maps


def amax_gain(maps: jax.Array) -> float:
    """The mHC paper's Amax gain magnitude of Π H_res: the largest absolute row or column sum over tokens."""
    composite = functools.reduce(lambda acc, h: jnp.einsum("tij,tjk->tik", h, acc), maps)
    return max(float(jnp.max(jnp.sum(jnp.abs(composite), axis=-1))),
               float(jnp.max(jnp.sum(jnp.abs(composite), axis=-2))))


@pytest.mark.parametrize("residual, moved, dtype", [("mhc", False, "float32"), ("mhc", True, "float32"),
                                                    ("mhc", True, "bfloat16"), ("hc", True, "float32")])
@pytest.mark.slow
def test_composite_residual_mapping_keeps_unit_gain_only_under_the_manifold_constraint(residual, moved, dtype):
    """Π H_res over all 12 sublayers, at init and with every parameter moved by 0.05 (a stand-in for training).

    mHC's maps are doubly stochastic, so their product is too: gain 1 up to Sinkhorn's column residual after
    20 iterations, |gain − 1| ≤ 0.01 (seen: 3e-4 at init, 2e-3 moved). HC's unconstrained maps do not keep it
    once the parameters move (seen: 2.4): |gain − 1| > 0.1. Under bfloat16 the residual streams between
    layers are bfloat16 (the maps are still computed in float32 from them) and the gain stays bounded.
    """
    config = ModelConfig.preset("tiny", residual=residual, num_layers=6, dtype=dtype)
    model = LanguageModel(config, key=jax.random.key(0))
    model = perturbed(model) if moved else model
    assert model.embed(tokens()).dtype == jnp.dtype(dtype)  # the streams live in the compute dtype
    maps = residual_maps(model, tokens())
    assert maps is not None and maps.shape == (2 * config.num_layers, SEQ, 4, 4)
    gain = amax_gain(maps)
    if residual == "mhc":
        assert abs(gain - 1.0) <= 0.01, gain
    else:
        assert abs(gain - 1.0) > 0.1, gain


@eqx.filter_jit
def run_block(block: Block, x: jax.Array) -> jax.Array:
    return block(x)[0]


def streams_after_each_block(model: LanguageModel, tokens: jax.Array) -> list[jax.Array]:
    """The residual state X [T, n, D] after every block, running the stacked blocks one at a time."""
    params, static = eqx.partition(model.blocks, eqx.is_array)
    x, states = model.embed(tokens), []
    for layer in range(model.config.num_layers):
        x = run_block(eqx.combine(jax.tree.map(lambda a, layer=layer: a[layer], params), static), x)
        states.append(x)
    return states


@pytest.mark.slow  # multi-second, not an invariant: the full run (CI) keeps it
def test_mhc_streams_stay_identical_at_init_like_a_prenorm_residual():
    """The n streams start as copies of the embedding, and at init every block keeps them (nearly) copies.

    With the coefficient projections off (α = 0) H_pre, H_post and H_res are the same for every token and
    stream, and a row-stochastic H_res maps identical streams to themselves: the streams agree to float32
    rounding (≤ 1e-5 of their scale: 12 sublayers whose H_res rows sum to 1 within ~n·eps; seen 1.1e-6).
    At the real init (α = 0.01) the streams differ only through the small
    per-stream spread of H_post: by at most 5 % of the block's update (seen: 1.2 %; HC at its init: 20 %).
    """
    model = LanguageModel(ModelConfig.preset("tiny", num_layers=6), key=jax.random.key(0))
    no_projection = eqx.tree_at(lambda m: (m.blocks.attn_hc.alpha, m.blocks.ffn_hc.alpha), model,
                                replace_fn=jnp.zeros_like)
    for states, bound in ((streams_after_each_block(no_projection, tokens()), None),
                          (streams_after_each_block(model, tokens()), 0.05)):
        previous = model.embed(tokens())
        for x in states:
            spread = float(jnp.max(jnp.abs(x - x[:, :1])))
            if bound is None:
                assert spread <= 1e-5 * float(jnp.max(jnp.abs(x))), spread
            else:
                update = float(jnp.max(jnp.abs(x - previous)))
                assert 0 < spread <= bound * update, (spread, update)
            previous = x
    out = model(tokens())
    assert 0.9 < float(out.res_diag) <= 1.0  # diag(H_res) ≈ 1 (b_res = τ·I), reported as res_diag
    np.testing.assert_allclose(float(jnp.sum(out.scale_weights)), 1.0, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.slow
def test_gradients_finite_for_huge_sinkhorn_logits(dtype):
    config = ModelConfig.preset("tiny", dtype=dtype, attention="full")  # the Sinkhorn path (full: a faster compile)
    model = perturbed(LanguageModel(config, key=jax.random.key(0)))
    for hc in ("attn_hc", "ffn_hc"):
        model = eqx.tree_at(lambda m, hc=hc: getattr(m.blocks, hc).alpha, model,
                            replace_fn=lambda a: a * 1e4)
        model = eqx.tree_at(lambda m, hc=hc: getattr(m.blocks, hc).b_res, model,
                            replace_fn=lambda b: b * 1e4)
    loss, grads = value_and_grad(model, tokens(batch=2, seq=SEQ + 1))
    assert bool(jnp.isfinite(loss)) and all_finite(grads)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.slow
def test_gradients_finite_when_all_scales_agree(dtype):
    """Zero value projection → every scale outputs exactly 0 → the Nash game's scale S and spread are 0."""
    model = perturbed(LanguageModel(ModelConfig.preset("tiny", dtype=dtype), key=jax.random.key(0)))
    model = eqx.tree_at(lambda m: m.blocks.attn.wv, model, replace_fn=jnp.zeros_like)
    loss, grads = value_and_grad(model, tokens(batch=2, seq=SEQ + 1))
    assert bool(jnp.isfinite(loss)) and all_finite(grads)


@pytest.mark.parametrize("aggregation", ["nash", "convex"])
@pytest.mark.slow  # multi-second, not an invariant: the full run (CI) keeps it
def test_aggregation_weights_receive_gradient(aggregation):
    model = perturbed(LanguageModel(ModelConfig.preset("tiny", aggregation=aggregation), key=jax.random.key(0)))
    _, grads = value_and_grad(model, tokens(batch=2, seq=SEQ + 1))
    prior_grad = grads.blocks.attn.aggregation.prior
    assert all_finite(grads) and bool(jnp.all(prior_grad != 0))
    assert bool(jnp.all(grads.blocks.attn_hc.alpha != 0)) and bool(jnp.any(grads.blocks.attn.down[0] != 0))


@pytest.mark.slow  # out of the quick loop (its 5-minute budget): no invariant, the full run keeps it
def test_padded_vocab_columns_get_no_probability():
    # the head masks the padding whatever the residual and attention: the cheapest model to compile
    config = ModelConfig.preset("tiny", residual="plain", attention="full")
    logits = eqx.filter_jit(lambda m, t: m(t).logits)(LanguageModel(config, key=jax.random.key(0)), tokens())
    assert logits.shape == (SEQ, config.padded_vocab_size)
    probs = jax.nn.softmax(logits, axis=-1)
    assert float(jnp.max(probs[:, config.vocab_size:])) == 0.0


@pytest.mark.slow  # multi-second, not an invariant: the full run (CI) keeps it
def test_untied_head_and_bfloat16_compute():
    config = ModelConfig.preset("tiny", tie_embeddings=False, dtype="bfloat16")
    model = LanguageModel(config, key=jax.random.key(0))
    assert model.head is not None and model.head.dtype == jnp.float32
    out = jax.jit(lambda m, t: m(t))(model, tokens())
    assert out.logits.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(out.logits[:, :config.vocab_size])))


@pytest.mark.slow
def test_remat_policies_and_scan_unroll_do_not_change_results():
    # the unroll beside a policy (full in groups) rather than alone: each compile of the tiny step's gradient is
    # multi-second. Each policy without the unroll is tests/test_step.py's (full on (1, 8, 1), dots on (1, 4, 2),
    # full in groups of 2 on (1, 1, 8), each against one device without remat).
    batch = tokens(batch=2, seq=SEQ + 1)
    results = {}
    settings = {"none": {}, "full-group-unrolled": {"remat_group": 2, "scan_unroll": 2}}  # tiny: 1 group of 2
    config = ModelConfig.preset("tiny")
    for name, extra in settings.items():
        with ExecutionConfig(remat=name.split("-")[0], **extra).use():
            results[name] = value_and_grad(perturbed(LanguageModel(config, key=jax.random.key(0))), batch)
    (loss, grads), (ref_loss, ref_grads) = results["full-group-unrolled"], results["none"]
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # three compiles of a gradient, about 40 s; the TPU's structure on the CPU
def test_layers_leaving_their_last_update_to_the_next_layer_give_the_same_loss_and_gradients(monkeypatch):
    """Lowered for TPU, the layer scan carries each block's FFN update to the next block's attention collapse
    (``leaves_updates``: the first block makes the identity update, the last one is made after the scan). Forced
    here on the CPU's XLA forms in float32, alone and in remat groups: the loss and gradients of each block making
    its own updates."""
    import nash_mhc.model as model_module
    from nash_mhc.layers.hyperconnection import MHC_MODES

    batch = tokens(batch=2, seq=17)

    def run(**settings: object) -> tuple[jax.Array, LanguageModel]:
        config = ModelConfig.preset("tiny", attention="full", num_layers=4)  # mhc
        model = perturbed(LanguageModel(config, key=jax.random.key(0)))
        with ExecutionConfig(**settings).use():
            return eqx.filter_jit(eqx.filter_value_and_grad(lm_loss))(model, batch)  # a new jit: a new trace

    own = run()
    monkeypatch.setattr(model_module, "leaves_updates", lambda mode, tokens, dim: mode in MHC_MODES)
    carried = {"none": run(), "full-group": run(remat="full", remat_group=2)}
    for name, (loss, grads) in carried.items():
        np.testing.assert_allclose(float(loss), float(own[0]), rtol=1e-6, err_msg=name)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(own[1]), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("unroll, group, loops", [(1, 1, 1), (6, 1, 0), (1, 3, 2), (3, 3, 1), (6, 3, 0)])
def test_scan_unroll_runs_the_layers_without_a_loop(unroll, group, loops):
    """scan_unroll counts layers per loop iteration, with or without remat groups: >= num_layers leaves no loop in
    the lowered forward pass (plain + full has no other loop); with groups of 3, unroll 3 unrolls the scan within
    each group but keeps the loop over the groups."""
    config = ModelConfig.preset("tiny", residual="plain", attention="full", num_layers=6)
    model = LanguageModel(config, key=jax.random.key(0))
    with ExecutionConfig(scan_unroll=unroll, remat="full" if group > 1 else "none", remat_group=group).use():
        text = jax.jit(lambda m, t: m(t).logits).lower(model, tokens(batch=2)).as_text()
    assert text.count("stablehlo.while") == loops


@pytest.mark.parametrize("residual, attention", [("mhc", "multiscale"), ("plain", "full")])
@pytest.mark.slow
def test_native_batch_equals_vmap_over_sequences(residual, attention):
    """model([B, T]) runs the batch natively; it must equal jax.vmap(model) and model([T]) row by row."""
    model = LanguageModel(ModelConfig.preset("tiny", residual=residual, attention=attention), key=jax.random.key(0))
    batch = tokens(batch=3)
    native = model(batch, return_residual_maps=True)
    mapped = jax.vmap(lambda t: model(t, return_residual_maps=True))(batch)
    single = model(batch[1], return_residual_maps=True)
    for name in ("logits", "aux_loss", "scale_weights", "layer_weights", "res_diag", "residual_maps"):
        got = np.asarray(getattr(native, name))
        assert got.shape == getattr(mapped, name).shape
        np.testing.assert_allclose(got, np.asarray(getattr(mapped, name)), rtol=1e-5, atol=1e-5, err_msg=name)
        np.testing.assert_allclose(got[1], np.asarray(getattr(single, name)), rtol=1e-5, atol=1e-5, err_msg=name)


def test_wrong_token_rank_or_dtype_is_a_type_error_naming_the_mismatch():
    model = LanguageModel(ModelConfig.preset("tiny"), key=jax.random.key(0))
    with pytest.raises(Exception, match="tokens") as three_d:
        model(tokens(batch=2)[None])
    assert "seq" in str(three_d.value)
    with pytest.raises(Exception, match="tokens") as floats:
        model(jnp.zeros((SEQ,), jnp.float32))
    assert "Int" in str(floats.value) or "int" in str(floats.value)


def layer_scans(jaxpr, num_layers: int) -> int:
    return sum(1 for e in jaxpr.eqns if e.primitive.name == "scan" and e.params["length"] == num_layers)


@pytest.mark.slow
def test_layers_run_in_one_scan_and_program_size_is_flat_in_depth():
    sizes = {}
    for depth in (3, 6):
        model = LanguageModel(ModelConfig.preset("tiny", num_layers=depth), key=jax.random.key(0))
        params, static = eqx.partition(model, eqx.is_array)
        forward = jax.make_jaxpr(lambda p, t, static=static: eqx.combine(p, static)(t).logits)(params, tokens())
        assert layer_scans(forward.jaxpr, depth) == 1
        train = jax.make_jaxpr(lambda p, b, static=static: jax.grad(lm_loss)(eqx.combine(p, static), b))(
            params, tokens(batch=2, seq=SEQ + 1))
        sizes[depth] = len(equations(train.jaxpr))
    assert sizes[3] == sizes[6]
