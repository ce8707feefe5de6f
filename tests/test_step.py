"""The sharded training step: mesh equivalence, accumulation, skipping, tracing, collectives, optimizer.

Runs on the 8 fake CPU devices that tests/conftest.py requests. One module-scoped fixture compiles one
step per mesh (on first use) and runs 5 steps on it; the tests read its results (CI has 2 cores). The quick
suite uses one device and (2, 2, 2), which splits every axis; the other meshes run with the ``slow`` tests.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import equations

from nash_mhc import ExecutionConfig, LanguageModel, ModelConfig, execution
from nash_mhc.sharding import make_mesh, named_shardings, path_str, shard_batch
from nash_mhc.training import (
    Batch,
    TrainConfig,
    decay_mask,
    eval_step,
    init_train_state,
    loss_terms,
    make_optimizer,
    make_schedule,
    num_train_step_traces,
    reshard_state,
    train_step,
)
from nash_mhc.training import step as step_module
from nash_mhc.training.checkpoint import config_differences, saved_model_config
from nash_mhc.training.optim import coefficient_mask

MODEL = ModelConfig.preset("tiny", d_model=64, num_heads=8, ffn_hidden=256, seq_len=16, num_layers=2)
TRAIN = TrainConfig(batch_size=8, learning_rate=1e-3, warmup_steps=2, total_steps=10)
# Data parallelism alone is not a mesh of its own: (2, 2, 2) splits the batch over data, and the CLI's two-process
# run shards it over two hosts (test_train_cli).
MESHES = [(1, 1, 1), (1, 8, 1), (1, 4, 2), (2, 2, 2), (1, 1, 8)]
QUICK_MESHES = [(1, 1, 1), (2, 2, 2)]  # a compilation costs ~35 s of CPU: the other meshes are for `slow` runs
# Three slow meshes also rematerialise (the same step, recomputed: it must still match one device, un-remat'd).
REMAT_ON = {(1, 8, 1): dict(remat="full"), (1, 4, 2): dict(remat="dots"), (1, 1, 8): dict(remat="full", remat_group=2)}
STEPS = 5
ROWS, SEQ = 8, 16


def needs_8_devices() -> None:
    if jax.device_count() < 8:
        pytest.skip("needs 8 (fake) devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")


def mesh_for(shape: tuple[int, int, int]) -> jax.sharding.Mesh:
    devices = jax.devices()[:1] if math.prod(shape) == 1 else None
    return make_mesh(*shape, devices=devices)


def make_batches() -> list[Batch]:
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(STEPS):
        tokens = rng.integers(0, MODEL.vocab_size, (ROWS, SEQ + 1)).astype(np.int32)
        mask = (rng.random((ROWS, SEQ)) < 0.8).astype(np.float32)  # uneven token counts per row
        batches.append(Batch(tokens=tokens, loss_mask=mask))
    return batches


def host(tree: object) -> list[np.ndarray]:
    return [np.array(leaf) for leaf in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


def mesh_params(shapes: list[tuple[int, int, int]]) -> list:
    """``shapes`` as pytest parameters, those outside :data:`QUICK_MESHES` marked slow."""
    return [shape if shape in QUICK_MESHES else pytest.param(shape, marks=pytest.mark.slow) for shape in shapes]


class Runs(dict):
    """Per mesh, computed on first use: metrics of 5 steps, host copies of the parameters after steps 1 and 3,
    the trace count, the final state and the batches.

    The state is initialised once (on one device) and copied onto each mesh with ``reshard_state`` (born-
    sharded initialisation is tested in test_sharding.py): one step compilation per mesh.
    """

    def __init__(self) -> None:
        super().__init__()
        self.batches = make_batches()
        self.base = init_train_state(MODEL, TRAIN, mesh_for((1, 1, 1)), key=jax.random.key(0))

    def __missing__(self, shape: tuple[int, int, int]) -> dict:
        state = reshard_state(self.base, mesh_for(shape))  # a copy: ``base`` is never donated
        traces_before = num_train_step_traces()
        metrics, params = [], {}
        with ExecutionConfig(**REMAT_ON.get(shape, {})).use() as execution:  # the same parameters, rematerialised
            for i, batch in enumerate(self.batches):
                state, m = train_step(state, batch)
                metrics.append({k: float(v) for k, v in m.items()})
                if i + 1 in (1, 3):
                    params[i + 1] = host(state.model)
        self[shape] = dict(metrics=metrics, params=params, traces=num_train_step_traces() - traces_before,
                           state=state, batches=self.batches, execution=execution)
        return self[shape]


@pytest.fixture(scope="module")
def runs() -> Runs:
    needs_8_devices()
    return Runs()


# ------------------------------------------------------------------------------------ equivalence
@pytest.mark.parametrize("shape", mesh_params(MESHES[1:]))
def test_sharded_steps_match_one_device(runs, shape):
    """3 float32 steps: losses within 1e-5 relative, every parameter within 1e-4 absolute; on the meshes of
    REMAT_ON with remat full, dots, or full in groups of 2 layers, against the un-rematerialised one device."""
    ref, got = runs[(1, 1, 1)], runs[shape]
    execution = got["execution"]
    assert (execution.remat, execution.remat_group) == (REMAT_ON.get(shape, {}).get("remat", "none"),
                                                        REMAT_ON.get(shape, {}).get("remat_group", 1))
    for step in range(3):
        for name in ("loss", "ce_loss", "aux_loss", "grad_norm"):
            a, b = got["metrics"][step][name], ref["metrics"][step][name]
            assert abs(a - b) <= 1e-5 * abs(b), (step, name, a, b)
        assert got["metrics"][step]["tokens"] == ref["metrics"][step]["tokens"]
    for a, b in zip(got["params"][3], ref["params"][3], strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)


@pytest.mark.slow  # multi-second, not an invariant: the full run (CI) keeps it
def test_training_makes_progress_and_logs(runs):
    """Progress: after the 5 steps, every batch's loss is below the loss the step that trained on it saw (the
    model learned from it; seen: by 0.06 nats for the last one up to 0.35 for the first, trained on 4 times
    longer). Logs: every metric is present and consistent with the schedule and the loss terms."""
    run = runs[(1, 1, 1)]
    metrics = run["metrics"]
    after = [float(eval_step(run["state"].model, batch, mesh=run["state"].mesh)["ce_loss"]) for batch in run["batches"]]
    before = [m["ce_loss"] for m in metrics]
    assert all(a < b for a, b in zip(after, before, strict=True)), (before, after)
    assert before[0] - after[0] > 0.2, (before, after)
    schedule = make_schedule(TRAIN)
    for step, m in enumerate(metrics):
        assert set(m) >= {"loss", "ce_loss", "aux_loss", "grad_norm", "learning_rate", "tokens", "skipped",
                          "nash_residual", "nash_temperature"}
        assert m["skipped"] == 0.0 and 0.0 <= m["nash_residual"] <= 1e-4 and m["nash_temperature"] > 0
        assert m["learning_rate"] == pytest.approx(float(schedule(step)), rel=1e-6)
        assert m["loss"] == pytest.approx(m["ce_loss"] + MODEL.sparsity_weight * m["aux_loss"], rel=1e-6)
        assert 0.0 < m["aux_loss"] <= 1.0 and m["grad_norm"] > 0
        scale_weights = [m[f"scale_weight/{level}"] for level in range(MODEL.num_scales)]
        assert sum(scale_weights) == pytest.approx(1.0, abs=1e-5) and min(scale_weights) > 0
        assert 0.0 < m["res_diag"] <= 1.0
    assert metrics[0]["ce_loss"] == pytest.approx(math.log(MODEL.vocab_size), rel=0.05)
    assert metrics[0]["learning_rate"] == pytest.approx(TRAIN.learning_rate / 2)  # warmup (step+1)/2


@pytest.mark.parametrize("shape", mesh_params(MESHES))
def test_step_traces_once_per_mesh(runs, shape):
    assert runs[shape]["traces"] == 1, shape


def test_step_count_and_state_sharding_preserved(runs):
    state = runs[(2, 2, 2)]["state"]
    assert int(state.step) == STEPS and int(state.skipped) == 0
    assert int(state.opt_state.count) == STEPS
    arrays = eqx.filter(state, eqx.is_array)
    for (path, leaf), expected in zip(jax.tree_util.tree_flatten_with_path(arrays)[0],
                                      jax.tree.leaves(named_shardings(state, state.mesh)), strict=True):
        assert leaf.sharding.is_equivalent_to(expected, leaf.ndim), path_str(path)


# ----------------------------------------------------------------------------------- loss and eval
def reference_terms(logits: np.ndarray, targets: np.ndarray, mask: np.ndarray) -> tuple[float, float]:
    nll = optax.softmax_cross_entropy_with_integer_labels(jnp.asarray(logits), jnp.asarray(targets))
    return float(jnp.sum(nll * mask)), float(np.sum(mask))


@pytest.mark.parametrize("shape", [(1, 1, 8), (2, 2, 2), (1, 1, 5)])
def test_vocab_parallel_cross_entropy_matches_dense(shape):
    """Σ NLL, count, Σ weight·entropy and d(mean CE)/d(logits) equal the dense result; (1,1,5): 384 % 5 != 0, so
    the vocabulary falls back to replicated and no tp collective is used."""
    needs_8_devices()
    mesh = make_mesh(*shape, devices=jax.devices()[:math.prod(shape)])
    assert step_module.vocab_is_split(384, mesh) == (shape != (1, 1, 5))
    rng = np.random.default_rng(1)
    vocab, real = 384, 259
    logits = rng.normal(size=(8, 4, vocab)).astype(np.float32) * 5
    logits[..., real:] = -1e30  # the model's vocab padding
    targets = rng.integers(0, real, (8, 4)).astype(np.int32)
    mask = (rng.random((8, 4)) < 0.7).astype(np.float32)
    entropy = rng.random((8, 4)).astype(np.float32)
    aux_weight = mask * np.array([0, 1, 1, 1], np.float32)  # e.g. position 0 has no choice of scales
    aux_args = (jnp.asarray(entropy), jnp.asarray(aux_weight), mesh)

    def mean_ce(x: jax.Array) -> jax.Array:
        ce_sum, count, _ = loss_terms(x, jnp.asarray(targets), jnp.asarray(mask), *aux_args)
        return ce_sum / count

    ce_sum, count, aux_sum = jax.jit(lambda x: loss_terms(x, jnp.asarray(targets), jnp.asarray(mask),
                                                          *aux_args))(jnp.asarray(logits))
    ref_sum, ref_count = reference_terms(logits, targets, mask)
    assert float(ce_sum) == pytest.approx(ref_sum, rel=1e-6)
    assert float(count) == ref_count
    assert float(aux_sum) == pytest.approx(float(np.sum(entropy * aux_weight)), rel=1e-6)
    grad = jax.jit(jax.grad(mean_ce))(jnp.asarray(logits))

    def ref_mean(x: jax.Array) -> jax.Array:
        nll = optax.softmax_cross_entropy_with_integer_labels(x, jnp.asarray(targets))
        return jnp.sum(nll * mask) / np.sum(mask)

    np.testing.assert_allclose(np.asarray(grad), np.asarray(jax.grad(ref_mean)(jnp.asarray(logits))), atol=1e-6)


def test_eval_step_matches_dense_reference(runs):
    """eval_step on the (2,2,2) model equals a plain vmap + optax cross-entropy on the same parameters."""
    batch = runs[(2, 2, 2)]["batches"][0]
    model = runs[(2, 2, 2)]["state"].model
    metrics = eval_step(model, batch)  # no mesh given, none ambient: every device along data
    out = eqx.filter_jit(lambda m, t: jax.vmap(m)(t))(model, jnp.asarray(batch.tokens[:, :-1]))
    ce_sum, count = reference_terms(np.asarray(out.logits), batch.tokens[:, 1:], batch.loss_mask)
    assert float(metrics["tokens"]) == count
    assert float(metrics["ce_loss"]) == pytest.approx(ce_sum / count, rel=1e-5)
    seq = out.entropy.shape[-1]  # the sparsity term: entropy over masked positions that have a choice of scales
    weight = np.asarray(batch.loss_mask, np.float64) * (np.arange(seq) + 1 >= MODEL.block_sizes[1])
    expected_aux = np.sum(weight * np.asarray(out.entropy, np.float64)) / np.sum(weight)
    assert float(metrics["aux_loss"]) == pytest.approx(expected_aux, rel=1e-5)
    assert float(metrics["loss"]) == pytest.approx(
        float(metrics["ce_loss"]) + MODEL.sparsity_weight * float(metrics["aux_loss"]), rel=1e-6)


def test_the_step_logs_the_scale_use_of_its_batch(runs):
    """The first step's scale-use metrics (tests/test_scale_use.py checks them against float64 NumPy) are
    eval_step's of the model it started from on the batch it trained on, on one device and on (2, 2, 2): per
    layer and averaged over them, for the weights and the prior, and the weights' distance from the prior."""
    expected = {k: float(v) for k, v in eval_step(runs.base.model, runs.batches[0], mesh=mesh_for((1, 1, 1))).items()
                if k.startswith("scale_")}
    layers, scales = MODEL.num_layers, MODEL.num_scales
    assert len(expected) == 2 * (scales + layers * scales) + 1 + layers
    for shape in QUICK_MESHES:
        got = runs[shape]["metrics"][0]
        assert {k for k in got if k.startswith("scale_")} == set(expected), shape
        for name, value in expected.items():
            assert got[name] == pytest.approx(value, abs=1e-6), (shape, name)


# -------------------------------------------------------------------------------- accumulation
@pytest.mark.slow
def test_grad_accumulation_equals_one_large_batch(runs):
    """k = 2 strided microbatches on a (2,2,2) mesh give the single-batch step (loss, grad norm, params)."""
    mesh = make_mesh(2, 2, 2)
    state = init_train_state(MODEL, TRAIN.replace(grad_accum_steps=2), mesh, key=jax.random.key(0))
    state, metrics = train_step(state, runs[(2, 2, 2)]["batches"][0])
    ref = runs[(2, 2, 2)]["metrics"][0]
    for name in ("loss", "ce_loss", "aux_loss", "grad_norm", "tokens"):
        assert float(metrics[name]) == pytest.approx(ref[name], rel=1e-5, abs=0), name
    scale_use = [name for name in ref if name.startswith("scale_")]  # sums over the microbatches, then means
    assert scale_use and all(float(metrics[name]) == pytest.approx(ref[name], abs=1e-6) for name in scale_use)
    for a, b in zip(host(state.model), runs[(2, 2, 2)]["params"][1], strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)


def test_microbatches_are_strided():
    needs_8_devices()
    mesh = make_mesh(2, 2, 2)
    rows = jnp.arange(16)[:, None] * jnp.ones((1, 3), jnp.int32)
    split = jax.jit(lambda x: step_module._microbatches(x, 4, mesh))(rows)
    assert split.shape == (4, 4, 3)
    np.testing.assert_array_equal(np.asarray(split[1, :, 0]), [1, 5, 9, 13])


def test_batch_must_divide_over_batch_shards_and_microbatches():
    needs_8_devices()
    mesh = make_mesh(8, 1, 1)
    with pytest.raises(ValueError, match="multiple of 16"):
        step_module._check_batch(Batch(tokens=np.zeros((8, 17), np.int32)), mesh, 2)
    with pytest.raises(ValueError, match="loss_mask must have shape"):
        Batch(tokens=np.zeros((8, 17), np.int32), loss_mask=np.ones((8, 17), np.float32))


@pytest.mark.slow
def test_bfloat16_remat_and_accumulation_together(runs):
    """bf16 compute with f32 parameters, remat "dots" (ExecutionConfig), 2 microbatches: close to float32."""
    mesh = mesh_for((1, 1, 1))
    config = TRAIN.replace(grad_accum_steps=2)
    state = init_train_state(MODEL.replace(dtype="bfloat16"), config, mesh, key=jax.random.key(0))
    with ExecutionConfig(remat="dots").use():
        state, metrics = train_step(state, runs[(1, 1, 1)]["batches"][0])
    ref = runs[(1, 1, 1)]["metrics"][0]
    assert float(metrics["skipped"]) == 0.0
    assert float(metrics["ce_loss"]) == pytest.approx(ref["ce_loss"], rel=2e-2)
    assert float(metrics["grad_norm"]) == pytest.approx(ref["grad_norm"], rel=1e-1)
    assert {leaf.dtype for leaf in jax.tree.leaves(eqx.filter(state.model, eqx.is_array))} == {jnp.dtype("float32")}


# --------------------------------------------------------------------------------------- skipping
def test_non_finite_gradients_skip_the_update(runs):
    """A NaN in the loss mask: nothing changes except the skipped counter; the next good step applies."""
    run = runs[(2, 2, 2)]
    state, batch = reshard_state(run["state"], run["state"].mesh), run["batches"][0]  # a copy: the run's is kept
    before = host(state)
    step, traces = int(state.step), num_train_step_traces()
    poisoned = np.array(batch.loss_mask)
    poisoned[3, 5] = np.nan
    state, metrics = train_step(state, Batch(tokens=batch.tokens, loss_mask=poisoned))
    assert float(metrics["skipped"]) == 1.0 and not math.isfinite(float(metrics["loss"]))
    assert int(state.step) == step and int(state.skipped) == 1
    after = host(state)
    for a, b in zip(before, after, strict=True):
        if a.ndim == 0 and a.dtype == np.int32:
            continue  # step / skipped counters
        np.testing.assert_array_equal(a, b)
    state, metrics = train_step(state, batch)
    assert float(metrics["skipped"]) == 0.0 and int(state.step) == step + 1 and int(state.skipped) == 1
    assert num_train_step_traces() == traces  # same shapes: no retrace


# ----------------------------------------------------------------------------------- collectives
def collectives(jaxpr: jax.extend.core.Jaxpr, inside_shard_map: bool = False) -> set[tuple[str, tuple]]:
    """(primitive, axes) of every psum/pmax found inside a shard_map, recursively."""
    found = set()
    for eqn in jaxpr.eqns:
        inside = inside_shard_map or eqn.primitive.name == "shard_map"
        name = eqn.primitive.name
        if inside and name.startswith(("psum", "pmax")):
            axes = eqn.params.get("axes", eqn.params.get("axis_name"))
            found.add((name.split("_")[0], tuple(axes) if isinstance(axes, tuple | list) else (axes,)))
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    found |= collectives(sub.jaxpr, inside)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    found |= collectives(sub, inside)
    return found


def primitives(jaxpr: jax.extend.core.Jaxpr) -> set[str]:
    """The names of every primitive in ``jaxpr``, sub-jaxprs included."""
    return {eqn.primitive.name for eqn in equations(jaxpr)}


def test_step_contains_shard_map_collectives_and_no_tpu_branch(runs):
    """The psums of the sharded loss; and under its CPU mesh the step traces no Pallas kernel and leaves no
    platform choice to the lowering (nash_mhc.ops.dispatch.platform_dependent)."""
    state = runs[(2, 2, 2)]["state"]
    batch = shard_batch(runs[(2, 2, 2)]["batches"][0], state.mesh)
    jaxpr = eqx.filter_make_jaxpr(step_module._train_step)(batch, state)[0]
    found = collectives(jaxpr.jaxpr)
    assert ("pmax", ("tp",)) in found  # row max of the vocab-parallel softmax
    assert ("psum", ("tp",)) in found  # Σ exp and the target logit over vocab shards
    assert ("psum", ("data", "fsdp")) in found  # global loss sum / token count
    names = primitives(jaxpr.jaxpr)
    assert "custom_vjp_call" in names and "pallas_call" not in names and "platform_index" not in names


# ----------------------------------------------------------------------------------------- optimizer
def test_schedule_warmup_then_cosine_to_floor():
    config = TrainConfig(learning_rate=1.0, min_lr_ratio=0.1, warmup_steps=4, total_steps=14)
    lr = make_schedule(config)
    assert [float(lr(s)) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert float(lr(4)) == pytest.approx(1.0)
    assert float(lr(9)) == pytest.approx(0.55)
    assert float(lr(14)) == pytest.approx(0.1) and float(lr(100)) == pytest.approx(0.1)
    assert float(make_schedule(TrainConfig(warmup_steps=0, learning_rate=0.5))(0)) == pytest.approx(0.5)


def masked_paths(mask_fn, config: ModelConfig) -> set[str]:
    model = eqx.filter_eval_shape(LanguageModel, config, key=jax.random.key(0))
    params = eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    return {path_str(p) for p, leaf in jax.tree_util.tree_flatten_with_path(mask_fn(params))[0] if leaf is True}


def test_weight_decay_only_on_the_matmul_weights_and_an_untied_head():
    assert masked_paths(decay_mask, MODEL.replace(tie_embeddings=False)) == {
        "head", "blocks.attn.wq", "blocks.attn.wk", "blocks.attn.wv", "blocks.attn.wo", "blocks.ffn.w_gate",
        "blocks.ffn.w_up", "blocks.ffn.w_down"}


def test_the_coefficient_group_is_every_logit_scaled_parameter():
    hc = {f"blocks.{sub}_hc.{name}" for sub in ("attn", "ffn") for name in ("phi", "alpha", "b_pre", "b_post")}
    aggregation = {"blocks.attn.aggregation.prior"}
    assert masked_paths(coefficient_mask, MODEL) == hc | aggregation | {
        "blocks.attn.aggregation.log_temperature", "blocks.attn_hc.b_res", "blocks.ffn_hc.b_res"}
    lite = MODEL.replace(residual="mhc-lite", aggregation="gate")
    assert masked_paths(coefficient_mask, lite) == hc | aggregation | {
        "blocks.attn.aggregation.gate", "blocks.attn_hc.b_perm", "blocks.ffn_hc.b_perm"}


@pytest.mark.slow  # multi-second, not an invariant: the full run (CI) keeps it
def test_coefficient_updates_are_scaled_and_not_decayed():
    """One optimizer update from the same state and gradients: the coefficient group moves exactly
    coefficient_lr_scale times as far as with scale 1, every other parameter moves the same."""
    model = LanguageModel(MODEL, key=jax.random.key(0))
    params = eqx.filter(model, eqx.is_inexact_array)
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.01) + 0.001 * p, params)
    updates = {}
    for scale in (1.0, 7.0):
        optimizer = make_optimizer(TrainConfig(learning_rate=1e-3, warmup_steps=0, coefficient_lr_scale=scale,
                                               weight_decay=0.5, grad_clip=0.0))
        updates[scale], _ = optimizer.update(grads, optimizer.init(params), params)
    coefficient = coefficient_mask(params)
    for one, seven, is_coefficient in zip(*(jax.tree.leaves(t) for t in (updates[1.0], updates[7.0], coefficient)),
                                          strict=True):
        np.testing.assert_allclose(np.asarray(seven), np.asarray(one) * (7.0 if is_coefficient else 1.0), rtol=1e-6)


def test_train_config_defaults_and_validation():
    config = TrainConfig()
    assert config.beta2 == 0.95 and config.grad_clip == 1.0 and config.grad_accum_steps == 1
    assert TrainConfig.from_dict(config.to_dict()) == config
    for bad in [dict(batch_size=0), dict(learning_rate=0.0), dict(min_lr_ratio=1.5), dict(beta2=1.0),
                dict(warmup_steps=20, total_steps=10), dict(warmup_steps=20, total_steps=40, lr_schedule_steps=10),
                dict(batch_size=6, grad_accum_steps=4),
                dict(grad_clip=-1.0), dict(eps=0.0), dict(seed=-1)]:
        with pytest.raises(ValueError, match="TrainConfig"):
            TrainConfig(**bad)
    # Wrong types: the conftest's jaxtyping/beartype hook may reject them first (TypeError), else we do.
    for bad in [dict(total_steps=2.5), dict(batch_size=True), dict(learning_rate="big")]:
        with pytest.raises((ValueError, TypeError)):
            TrainConfig(**bad)


def test_execution_settings_resolve_per_preset_and_leave_the_configs():
    """remat, remat_group, scan_unroll and loss_chunks are ExecutionConfig's: a flag not given takes the preset's
    value of nash_mhc.execution.DEFAULTS (the pair remat / remat_group only when neither is given), else the plain
    default; ExecutionConfig.use() puts them in force for the traces within it; a format-3 checkpoint's model and
    train config, which still carry them, read back without them."""
    assert ExecutionConfig().for_preset("tiny") == ExecutionConfig("auto", "none", 1, 1, 1)
    assert ExecutionConfig().for_preset("1b") == ExecutionConfig("auto", "full", 1, 16, 8)
    assert ExecutionConfig(remat_group=2).for_preset("3b") == ExecutionConfig("auto", "none", 2, 28, 8)
    assert ExecutionConfig(remat="dots", loss_chunks=2).for_preset("1b").remat_group == 1
    with pytest.raises(ValueError, match="remat"):
        ExecutionConfig(remat="sometimes")
    with pytest.raises(ValueError, match="--remat-group 3 does not divide --num-layers 2"):
        ExecutionConfig(remat_group=3).check(2, 16)
    with pytest.raises(ValueError, match="--loss-chunks 3 does not divide --seq-len 16"):
        ExecutionConfig(loss_chunks=3).check(2, 16)
    assert execution.current() == execution.Execution()
    with ExecutionConfig(remat="full", remat_group=2, scan_unroll=2, loss_chunks=4).use():
        assert execution.current() == execution.Execution("full", 2, 2, 4)
    assert execution.current() == execution.Execution()
    old_model = {**MODEL.to_dict(), "remat": "full", "remat_group": 2, "scan_unroll": 4}
    assert ModelConfig.from_dict(old_model) == MODEL and "remat" not in MODEL.to_dict()
    assert ModelConfig.from_dict(saved_model_config(old_model)) == MODEL  # inference's read of a checkpoint
    assert config_differences(old_model, MODEL) == []  # a resume's comparison
    assert TrainConfig.from_dict({**TRAIN.to_dict(), "remat": None, "loss_chunks": 8}) == TRAIN
    with pytest.raises(ValueError, match="no field 'remat_groups'"):
        ModelConfig.from_dict({**MODEL.to_dict(), "remat_groups": 2})


# ------------------------------------------------------------------------------------ chunked cross-entropy
@pytest.mark.slow  # two compiles of the loss and its gradient
def test_chunked_cross_entropy_matches_the_full_logits_loss():
    """--loss-chunks 4 (logits of 4 positions at a time, the cross-entropy's gradient fused into its forward pass)
    gives the full-logits loss terms and gradients (float32 sums in another order: 1e-6 relative), on a (1, 1, 2)
    mesh so the vocabulary is split (tp)."""
    mesh = make_mesh(1, 1, 2, devices=jax.devices()[:2])
    model = LanguageModel(MODEL, key=jax.random.key(1))
    batch = make_batches()[0]
    tokens = jnp.asarray(batch.tokens)
    mask = jnp.asarray(batch.loss_mask)

    @eqx.filter_jit
    def terms(model: LanguageModel, chunks: int):
        def objective(m):
            ce, count, aux, _ = step_module.forward_terms(m, tokens[:, :-1], tokens[:, 1:], mask, mesh,
                                                          loss_chunks=chunks)
            return ce / 3.0 + aux, (ce, count, aux)  # a cotangent other than 1 reaches the fused gradient
        return eqx.filter_value_and_grad(objective, has_aux=True)(model)

    with jax.set_mesh(mesh):
        (_, full), full_grads = terms(model, 1)
        (_, chunked), chunked_grads = terms(model, 4)
    for a, b in zip(full, chunked, strict=True):
        np.testing.assert_allclose(float(b), float(a), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(full_grads), jax.tree.leaves(chunked_grads), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="--loss-chunks 3"):
        step_module._check_batch(batch, mesh, 1, 3)


@pytest.mark.slow
def test_mhc_lite_with_the_gate_shards_like_one_device_and_resumes_bit_identically(tmp_path):
    """The two new modes together: 4 steps on (2, 2, 2) match one device as the default mode's do, and 2 steps,
    a checkpoint, a restore into a fresh state and 2 more steps give bit-identical losses and parameters."""
    needs_8_devices()
    from helpers import run_steps, write_checkpoint

    from nash_mhc.training.checkpoint import Checkpointer

    config = MODEL.replace(residual="mhc-lite", aggregation="gate")
    # Adam eps 1e-6: at initialisation mhc-lite's permutation softmax is saturated (logits 0 and -8), so the
    # gradients of alpha_res and b_perm are ~1e-9 and float32 rounding is a large part of them; with eps 1e-8
    # Adam turns that rounding into updates of up to 0.1 x the learning rate, which differ between meshes by 2e-4
    # after 4 steps although every loss agrees to 1e-7 (seen). eps 1e-6 leaves the comparison to the computation.
    train = TRAIN.replace(eps=1e-6)
    batches = make_batches()[:4]
    base = init_train_state(config, train, mesh_for((1, 1, 1)), key=jax.random.key(0))

    one, one_losses = run_steps(reshard_state(base, mesh_for((1, 1, 1))), batches)
    many, many_losses = run_steps(reshard_state(base, mesh_for((2, 2, 2))), batches)
    np.testing.assert_allclose(many_losses, one_losses, rtol=1e-5)
    for a, b in zip(host(many.model), host(one.model), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)
    first, first_losses = run_steps(reshard_state(base, mesh_for((1, 1, 1))), batches[:2])
    write_checkpoint(tmp_path / "run", 2, first, config, train)
    fresh = init_train_state(config, train, mesh_for((1, 1, 1)), key=jax.random.key(1))
    reader = Checkpointer(tmp_path / "run", read_only=True)
    resumed, resumed_losses = run_steps(reader.restore(2, fresh), batches[2:])
    reader.close()
    assert first_losses + resumed_losses == one_losses
    for a, b in zip(host(resumed), host(one), strict=True):
        np.testing.assert_array_equal(a, b)
