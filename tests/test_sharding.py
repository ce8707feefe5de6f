"""Mesh construction, the PartitionSpec rule table, fallbacks and born-sharded initialisation.

Runs on the 8 fake CPU devices that tests/conftest.py requests (XLA_FLAGS) before JAX starts.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import equations, needs_libtpu
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from nash_mhc import ExecutionConfig, ModelConfig
from nash_mhc.model import Block, LanguageModel
from nash_mhc.params import UndeclaredParameter, declared_parameters, param
from nash_mhc.sharding import (
    AXES,
    LOGICAL_AXIS_RULES,
    MeshError,
    batch_spec,
    make_mesh,
    named_shardings,
    partition_specs,
    path_str,
    per_shard,
    resolve_mesh_shape,
    shard_batch,
    sharding_fallbacks,
    sharding_summary,
    valid_mesh_shapes,
)
from nash_mhc.training import Batch, TrainConfig
from nash_mhc.training.optim import coefficient_mask, decay_mask
from nash_mhc.training.state import init_train_state, reshard_state, state_initializer

# Every dimension that a rule splits divides by 8: heads 8, F 256, V 384, D 64, n·D 256.
SHARDABLE = dict(d_model=64, num_heads=8, ffn_hidden=256, seq_len=16, num_layers=2)


def needs_8_devices() -> None:
    if jax.device_count() < 8:
        pytest.skip("needs 8 (fake) devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")


def abstract_model(config: ModelConfig) -> LanguageModel:
    return eqx.filter_eval_shape(LanguageModel, config, key=jax.random.key(0))


def array_leaves(tree: object) -> list[tuple[str, jax.ShapeDtypeStruct]]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [(path_str(p), leaf) for p, leaf in flat if hasattr(leaf, "shape")]


def spec_table(tree: object, mesh) -> dict[str, P]:
    """{dotted path: PartitionSpec} of every array leaf of ``tree`` by the rules."""
    flat = jax.tree_util.tree_flatten_with_path(partition_specs(tree, mesh), is_leaf=lambda x: isinstance(x, P))[0]
    return {path_str(p): spec for p, spec in flat}


# ------------------------------------------------------------------------------------------------ mesh
def test_make_mesh_rejects_wrong_product_naming_devices_and_valid_shapes():
    needs_8_devices()
    with pytest.raises(MeshError) as info:
        make_mesh(3, 1, 1)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "8" in message
    assert "(8,1,1)" in message and "(2,2,2)" in message


@pytest.mark.parametrize("axes", [(0, 1, 1), (1, -2, 1), (-1, -1, 2), (-1, 3, 1), (True, 1, 8)])
def test_make_mesh_rejects_bad_axes(axes):
    needs_8_devices()
    with pytest.raises(MeshError, match="8 devices"):
        make_mesh(*axes)
    with pytest.raises((MeshError, TypeError)):  # the test-suite's beartype hook may see it first
        make_mesh(1.5, 1, 1)


def test_make_mesh_shapes_fill_and_axis_types():
    needs_8_devices()
    for requested, expected in [((-1, 1, 1), (8, 1, 1)), ((-1, 2, 2), (2, 2, 2)), ((1, -1, 2), (1, 4, 2)),
                                ((1, 1, 8), (1, 1, 8)), ((2, 4, -1), (2, 4, 1))]:
        mesh = make_mesh(*requested)
        assert mesh.axis_names == AXES
        assert tuple(mesh.shape.values()) == expected  # size-1 axes are kept
        assert mesh.axis_types == (AxisType.Auto,) * 3
        assert mesh.size == 8
    assert tuple(make_mesh().shape.values()) == (8, 1, 1)  # the CLI default: data = -1
    one = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    assert one.size == 1 and one.devices.flat[0] == jax.devices()[0]
    with pytest.raises(MeshError, match="1 devices"):
        make_mesh(2, 1, 1, devices=jax.devices()[:1])


def test_valid_shapes_and_multi_host_divisibility():
    shapes = valid_mesh_shapes(8)
    assert len(shapes) == 10 and all(math.prod(s) == 8 for s in shapes)
    assert resolve_mesh_shape(-1, 2, 4, 16, local_device_count=4) == (2, 2, 4)
    with pytest.raises(MeshError, match="tp=8 does not divide the 4 devices of one host"):
        resolve_mesh_shape(1, 2, 8, 16, local_device_count=4)
    assert all(t in (1, 2, 4) for _, _, t in valid_mesh_shapes(16, local_device_count=4))


# ----------------------------------------------------------------------------------------- spec rules
VARIANTS = [
    dict(),
    dict(residual="hc"),
    dict(residual="mhc-lite"),
    dict(residual="plain", attention="full"),
    dict(aggregation="convex", tie_embeddings=False),
    dict(aggregation="gate"),
    dict(num_streams=2, num_scales=2),
]


@pytest.mark.parametrize("overrides", VARIANTS)
def test_every_parameter_declares_a_role_and_logical_axes(overrides):
    """Every array leaf of every model variant is a declared parameter (role + one logical name per dimension,
    each with a sharding rule): strict=True raises on a leaf without a declaration."""
    needs_8_devices()
    config = ModelConfig.preset("tiny", **{**SHARDABLE, **overrides})
    model = abstract_model(config)
    assert len(declared_parameters(model)) == len(array_leaves(model))
    for _, _, decl in declared_parameters(model):
        assert all(name in LOGICAL_AXIS_RULES for name in decl.axes)
    mesh = make_mesh(2, 2, 2)
    specs = partition_specs(model, mesh, strict=True)
    assert jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, P)) == jax.tree.structure(
        eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct)))
    assert sharding_fallbacks(model, make_mesh(1, 4, 2)) == []


def test_rule_table():
    needs_8_devices()
    config = ModelConfig.preset("tiny", **SHARDABLE, tie_embeddings=False)
    specs = spec_table(abstract_model(config), make_mesh(2, 2, 2))
    expected = {
        "embedding": P("tp", "fsdp"),
        "head": P("fsdp", "tp"),
        "final_norm.weight": P(),
        "blocks.attn.wq": P(None, None, "fsdp", "tp"),
        "blocks.attn.wk": P(None, None, "fsdp", "tp"),
        "blocks.attn.wv": P(None, "fsdp", "tp"),
        "blocks.attn.wo": P(None, "tp", None, "fsdp"),
        "blocks.attn.down[0]": P(None, None, "fsdp"),
        "blocks.attn.aggregation.prior": P(),
        "blocks.ffn.w_gate": P(None, "fsdp", "tp"),
        "blocks.ffn.w_up": P(None, "fsdp", "tp"),
        "blocks.ffn.w_down": P(None, "tp", "fsdp"),
        "blocks.attn_hc.phi": P(None, ("fsdp", "tp")),
        "blocks.ffn_hc.b_res": P(),
        "blocks.attn_hc.alpha": P(),
        "blocks.attn_hc.norm.weight": P(),
        "blocks.attn_norm.weight": P(),
    }
    for path, spec in expected.items():
        assert specs[path] == spec, path


def test_indivisible_dimensions_fall_back_and_are_reported():
    needs_8_devices()
    config = ModelConfig.preset("tiny", **SHARDABLE)  # 8 heads, F=256, n·D=256: none divide by 3
    mesh = make_mesh(1, 2, 3, devices=jax.devices()[:6])
    model = abstract_model(config)
    fallbacks = {(fb.path, fb.dim): fb for fb in sharding_fallbacks(model, mesh)}
    assert ("blocks.attn.wq", 3) in fallbacks  # heads 8 over tp=3 → replicated
    assert ("blocks.ffn.w_up", 2) in fallbacks  # F=256 over tp=3
    assert fallbacks[("blocks.attn_hc.phi", 1)].kept == ("fsdp",)  # 256 over fsdp·tp=6 → fsdp only
    assert ("embedding", 0) not in fallbacks  # 384 = 3·128
    specs = spec_table(model, mesh)
    assert specs["blocks.attn.wq"] == P(None, None, "fsdp")
    assert specs["blocks.attn_hc.phi"] == P(None, "fsdp")
    summary = "\n".join(sharding_summary(model, mesh))
    assert "data=1 fsdp=2 tp=3" in summary
    assert "blocks.attn.wq dim 3 (size 8) does not divide by tp=3; using replicated" in summary
    clean = sharding_summary(model, make_mesh(2, 2, 2))
    assert any("every parameter dimension divides" in line for line in clean)


def test_unknown_leaf_warns_or_raises():
    needs_8_devices()
    mesh = make_mesh(8, 1, 1)
    tree = {"mystery": jax.ShapeDtypeStruct((4, 4), jnp.float32), "count": jax.ShapeDtypeStruct((), jnp.int32)}
    with pytest.warns(UserWarning, match="'mystery' with shape .4, 4. is not a declared parameter"):
        specs = partition_specs(tree, mesh)
    assert specs == {"mystery": P(), "count": P()}
    with pytest.raises(ValueError, match="declare it with nash_mhc.params.param"):
        partition_specs(tree, mesh, strict=True)


class Half(eqx.Module):
    """A layer that declares one of its two arrays."""

    declared: jax.Array = param("matmul", "embed", "mlp")
    forgotten: jax.Array


def test_an_undeclared_array_beside_declared_ones_is_an_error_wherever_roles_are_read():
    needs_8_devices()
    layer = Half(jnp.zeros((8, 8)), jnp.zeros((8,)))
    for read in (lambda: partition_specs(layer, make_mesh(8, 1, 1)), lambda: declared_parameters(layer),
                 lambda: decay_mask(layer), lambda: coefficient_mask(layer)):
        with pytest.raises(UndeclaredParameter, match="Half.forgotten"):
            read()


def test_shard_batch_splits_rows_over_data_and_fsdp():
    needs_8_devices()
    mesh = make_mesh(2, 2, 2)
    batch = shard_batch(Batch(tokens=np.zeros((8, 5), np.int32), loss_mask=np.ones((8, 4), bool)), mesh)
    for leaf in (batch.tokens, batch.loss_mask):
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, batch_spec(2)), 2)
        assert {s.data.shape[0] for s in leaf.addressable_shards} == {2}


@pytest.mark.parametrize("tokens", [8, 6])  # 6: split over data only (fsdp's 2 x 2 = 4 does not divide it)
def test_per_shard_sums_a_partial_sum_output_over_the_axes_that_split_its_dimension(tokens):
    """A per-shard function returning (a per-token array, a sum over its tokens): the second output is summed
    over the mesh axes that split the tokens, so both equal the unsharded function's."""
    needs_8_devices()
    x = jnp.asarray(np.random.default_rng(0).normal(size=(tokens, 3)), jnp.float32)
    names = ("tokens", "features")

    def function(a):
        return 2.0 * a, a.sum(axis=0)
    sharded = per_shard(function, (names,), (names, ("features",)), sums=(None, "tokens"))
    with jax.set_mesh(make_mesh(2, 2, 2)):
        doubled, total = jax.jit(sharded)(x)
    np.testing.assert_allclose(np.asarray(doubled), 2.0 * np.asarray(x))
    np.testing.assert_allclose(np.asarray(total), np.asarray(x).sum(axis=0), rtol=1e-6)
    with jax.set_mesh(make_mesh(2, 2, 2)), pytest.raises(ValueError, match="'seq' dimensions split over"):
        jax.jit(per_shard(function, (names,), (names, ("features",)), sums=(None, "seq")))(x)
    with pytest.raises(ValueError, match="sums= names 1 outputs; the function returns one array, not a tuple"):
        per_shard(lambda a: a.sum(axis=0), (names,), ("features",), sums=("tokens",))(x)


# ---------------------------------------------------------------------------------- born sharded
def device_bytes(leaves: list[jax.Array], device: jax.Device) -> int:
    return sum(s.data.nbytes for leaf in leaves for s in leaf.addressable_shards if s.device == device)


# (1, 4, 2) splits both parameter axes; the single-axis meshes run with the slow tests (each is a compile)
@pytest.mark.parametrize("shape", [pytest.param((1, 8, 1), marks=pytest.mark.slow), (1, 4, 2),
                                   pytest.param((1, 1, 8), marks=pytest.mark.slow)])
def test_state_is_born_sharded_within_ten_percent_of_ideal(shape):
    """Parameters + optimizer state: every device holds ≤ 1.10 × total / 8 bytes, laid out by the rules."""
    needs_8_devices()
    mesh = make_mesh(*shape)
    config = ModelConfig.preset("tiny", **SHARDABLE)
    init_leaves, finish = state_initializer(config, TrainConfig(), mesh, key=jax.random.key(0))
    compiled = init_leaves.lower(jax.random.key(0)).compile()
    state = finish(compiled(jax.random.key(0)))
    leaves = jax.tree.leaves(eqx.filter(state, eqx.is_array))
    total = sum(leaf.nbytes for leaf in leaves)
    worst = max(device_bytes(leaves, device) for device in mesh.devices.flat)
    assert worst <= 1.10 * total / 8, (worst, total / 8)
    expected = jax.tree.leaves(named_shardings(state, mesh))
    for (path, _), array, sharding in zip(array_leaves(eqx.filter(state, eqx.is_array)), leaves, expected,
                                          strict=True):
        assert array.sharding.is_equivalent_to(sharding, array.ndim), path
    # The init program never holds the whole state on one device: per-device outputs + temporaries stay well
    # below the total (an init with replicated outputs needs more than the total for temporaries alone).
    stats = compiled.memory_analysis()
    if stats is not None:
        assert stats.output_size_in_bytes + stats.temp_size_in_bytes < total / 2


def test_reshard_state_moves_a_state_between_meshes():
    needs_8_devices()
    config = ModelConfig.preset("tiny", **SHARDABLE)
    one = init_train_state(config, TrainConfig(), make_mesh(1, 1, 1, devices=jax.devices()[:1]),
                           key=jax.random.key(3))
    mesh = make_mesh(2, 2, 2)
    many = reshard_state(one, mesh)
    assert many.mesh is mesh and one.mesh.size == 1
    for (path, leaf), sharding in zip(array_leaves(eqx.filter(many, eqx.is_array)),
                                      jax.tree.leaves(named_shardings(many, mesh)), strict=True):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), path
    for a, b in zip(jax.tree.leaves(eqx.filter(one, eqx.is_array)),
                    jax.tree.leaves(eqx.filter(many, eqx.is_array)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------------------------ activations
def sharding_constraints(jaxpr: object) -> list[tuple[tuple[int, ...], P]]:
    """(shape, spec) of every ``sharding_constraint`` in a (closed) jaxpr and the jaxprs nested in it."""
    return [(tuple(eqn.outvars[0].aval.shape), eqn.params["sharding"].spec) for eqn in equations(jaxpr)
            if eqn.primitive.name == "sharding_constraint"]


@pytest.mark.slow  # out of the quick loop (its 5-minute budget): no invariant, the full run keeps it
def test_model_pins_the_batch_dimension_of_its_matmul_outputs_under_a_mesh():
    """Under an ambient mesh the FFN hidden state and output, Q/K/V, the attention output (before and after the
    output projection) and the stream state keep their batch/token dimension over data x fsdp (without
    it the TPU compiler made the 1b FFN hidden state [B·T, F] for the global batch on every chip); without a
    mesh the model has no constraints."""
    needs_8_devices()
    c = ModelConfig.preset("tiny", **SHARDABLE, dtype="bfloat16")
    model = LanguageModel(c, key=jax.random.key(0))
    tokens = jnp.zeros((8, c.seq_len), jnp.int32)
    assert sharding_constraints(jax.make_jaxpr(model)(tokens)) == []
    with jax.sharding.use_abstract_mesh(make_mesh(1, 8, 1).abstract_mesh):
        found = sharding_constraints(jax.make_jaxpr(model)(tokens))
    rows, heads = 8 * c.seq_len, c.num_heads
    pinned = {shape for shape, spec in found
              if spec == P(("data", "fsdp"), *[P.UNCONSTRAINED] * (len(shape) - 1))}
    streams = (c.num_streams, 8, c.seq_len, c.d_model)  # the layer scan's streams-major state, batch on dim 1
    assert (streams, P(P.UNCONSTRAINED, ("data", "fsdp"), P.UNCONSTRAINED, P.UNCONSTRAINED)) in found
    gathered = [(shape, spec) for shape, spec in found if shape not in pinned and shape != streams]
    assert gathered and all("fsdp" not in str(spec) for _, spec in gathered)  # the weights' gathers (below)
    for shape in [(rows, c.ffn_hidden), (rows, c.d_model), (8, c.seq_len, heads, c.d_model // heads),
                  (8, c.seq_len, c.d_model)]:
        assert shape in pinned, shape


def test_each_layer_gathers_its_weights_over_fsdp_and_keeps_tp():
    """Inside the layer scan every matmul weight of the block (attention, FFN; all split over fsdp on d_model) is
    constrained once to its sharding without fsdp (the just-in-time all-gather of FSDP, instead of the
    compiler's windowed matmul over weight shards), tensor-parallel splits kept: the FFN weights [d_model, F]
    become P(None, "tp"), [F, d_model] P("tp")."""
    needs_8_devices()
    c = ModelConfig.preset("tiny", **SHARDABLE, dtype="bfloat16")
    model = LanguageModel(c, key=jax.random.key(0))
    tokens = jnp.zeros((8, c.seq_len), jnp.int32)
    with jax.sharding.use_abstract_mesh(make_mesh(1, 4, 2).abstract_mesh):
        found = sharding_constraints(jax.make_jaxpr(model)(tokens))
    # the weights' constraints: not the batch pins, nor the embedding rows' first step (batch over data alone)
    weights = [(shape, spec) for shape, spec in found if ("data", "fsdp") not in tuple(spec) and "data" not in spec]
    block_params = declared_parameters(Block(c, key=jax.random.key(0)))  # one layer's parameters
    matmul = [tuple(leaf.shape) for _, leaf, decl in block_params if decl.role.name == "matmul"]
    assert len(matmul) == 7 and sorted(shape for shape, _ in weights) == sorted(matmul)  # q k v o gate up down
    assert all("fsdp" not in str(spec) for _, spec in weights)
    specs = dict(weights)
    assert specs[(c.d_model, c.ffn_hidden)] == P(None, "tp")
    assert specs[(c.ffn_hidden, c.d_model)] == P("tp")
    with jax.sharding.use_abstract_mesh(make_mesh(8, 1, 1).abstract_mesh):  # no fsdp: nothing to gather
        assert all(("data", "fsdp") in tuple(spec) for _, spec in sharding_constraints(jax.make_jaxpr(model)(tokens)))


@pytest.mark.slow  # out of the quick loop (its 5-minute budget): no invariant, the full run keeps it
def test_train_step_traces_the_model_under_its_mesh():
    """The train step's forward and backward see the mesh: its lowered program pins the FFN hidden state."""
    needs_8_devices()
    from nash_mhc.tpu_compile.fit import abstract_batch, abstract_train_state
    from nash_mhc.training import step as step_module

    c = ModelConfig.preset("tiny", **SHARDABLE, dtype="bfloat16")
    mesh = make_mesh(1, 8, 1)
    state = abstract_train_state(c, TrainConfig(batch_size=8), mesh)
    batch = abstract_batch(8, c.seq_len, mesh)
    with ExecutionConfig(remat="full").use():
        text = jax.jit(lambda b, s: step_module._train_step_jit(b, s)).lower(batch, state).as_text()
    hidden = f": tensor<{8 * c.seq_len}x{c.ffn_hidden}xbf16>"  # Shardy: sdy.sharding_constraint %x <@mesh, ...>
    pins = [line for line in text.splitlines() if "sharding_constraint" in line and line.endswith(hidden)]
    assert len(pins) >= 4, pins  # gate and up, forward and backward (each pin constrains the cotangent too)
    assert all('[{"data", "fsdp"}, {?}]' in line for line in pins), pins


def test_the_embedding_rows_come_out_split_by_batch_without_replicating_the_activation(capfd):
    """(data 2, fsdp 2, tp 2): the looked-up rows go from the table's split (d_model over fsdp) to the batch's in
    two constrained steps, and the compiled forward and backward of a plain + full model replicate nothing. Left
    to the compiler, the partitioner logged "Involuntary full rematerialization" twice here (the rows and their
    gradient: the whole [B, T, D] activation replicated on every device), and in every train step on a mesh with
    data > 1 and fsdp > 1."""
    needs_8_devices()
    config = ModelConfig.preset("tiny", **SHARDABLE, residual="plain", attention="full")
    mesh = make_mesh(2, 2, 2)
    model = LanguageModel(config, key=jax.random.key(0))
    model = eqx.filter_shard(model, named_shardings(model, mesh))
    tokens = jax.device_put(jnp.zeros((8, config.seq_len), jnp.int32), NamedSharding(mesh, P(("data", "fsdp"))))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        found = sharding_constraints(jax.make_jaxpr(model.embed_tokens)(tokens))
    rows = (8, config.seq_len, config.d_model)
    assert found == [(rows, P("data", P.UNCONSTRAINED, "fsdp")), (rows, P(("data", "fsdp"), P.UNCONSTRAINED,
                                                                          P.UNCONSTRAINED))]
    capfd.readouterr()
    with jax.set_mesh(mesh):
        grad = eqx.filter_jit(eqx.filter_grad(lambda m, t: jnp.sum(m(t).logits[..., :8])))
        grad.lower(model, tokens).compile()
    assert "Involuntary full rematerialization" not in capfd.readouterr().err


@needs_libtpu
def test_a_lookup_lowered_for_tpu_is_left_to_the_tpu_compiler():
    """Under a mesh of TPU chips (abstract, from libtpu) the lookup carries no constraint: the TPU compiler moves
    the rows itself, and the two steps only added to its estimate (the model's ``embed_tokens``)."""
    from nash_mhc.tpu_compile.fit import topology_devices

    config = ModelConfig.preset("tiny", **SHARDABLE, residual="plain", attention="full")
    model = LanguageModel(config, key=jax.random.key(0))
    tokens = jnp.zeros((8, config.seq_len), jnp.int32)
    with jax.sharding.use_abstract_mesh(make_mesh(2, 2, 2, devices=topology_devices("v5e-8")).abstract_mesh):
        assert sharding_constraints(jax.make_jaxpr(model.embed_tokens)(tokens)) == []
