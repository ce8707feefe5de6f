"""JAX's splash attention as :func:`nash_mhc.ops.attention.attend` runs it on TPU (nash_mhc.kernels.tpu.splash), run in
Pallas' interpreter on the CPU (the ``pallas`` kernels setting takes attend's TPU branch here): forward and all
three gradients against the XLA path, causality bit for bit, the declared cost, and the kernel in a `tiny` train
step lowered for a TPU topology."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import declared, equations, needs_libtpu

from nash_mhc import ModelConfig, TrainConfig
from nash_mhc.kernels.tpu.splash import kernel_costs, splash_block, splash_causal_attention
from nash_mhc.ops.attention import attend, causal_attention
from nash_mhc.ops.dispatch import lowering_platform, use_kernels

pytestmark = pytest.mark.kernels  # the quick loop leaves them to the rest (docs/testing.md)

B, T, H, K = 2, 256, 2, 32  # two 128-blocks: a skipped block pair, an interior one and two diagonal ones


def inputs(dtype, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.normal(size=(B, T, H, K)), dtype) for _ in range(4))


def with_grads(attention, q, k, v, do):
    out, pullback = jax.vjp(attention, q, k, v)
    return (out, *pullback(do))


def splash_attend(q, k, v):
    """attend's TPU branch (splash per shard), interpreted on this CPU."""
    with use_kernels("pallas"):
        return attend(q, k, v)


def kernel_names(fn, *args):
    return [eqn.params["name"] for eqn in equations(jax.make_jaxpr(fn)(*args).jaxpr)
            if eqn.primitive.name == "pallas_call"]


def test_attend_runs_splash_under_the_tpu_branch():
    q, k, v, do = inputs(jnp.float32)
    names = kernel_names(lambda q, k, v: with_grads(splash_attend, q, k, v, do), q, k, v)
    assert sorted(names) == ["splash_mha_dkv_no_residuals", "splash_mha_dq_no_residuals",
                             "splash_mha_fwd_residuals"]
    with lowering_platform("cpu"):
        assert kernel_names(attend, q, k, v) == []  # the CPU's own branch: XLA


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 0.02)])
def test_forward_and_all_gradients_match_the_xla_path(dtype, tol):
    """Float32: within float32 rounding of the XLA path; bfloat16: within bfloat16 rounding (relative to each
    array's largest value: splash scales q in bfloat16 and accumulates P V from float32 probabilities)."""
    q, k, v, do = inputs(dtype, seed=1)
    got = with_grads(splash_attend, q, k, v, do)
    want = with_grads(jax.vmap(causal_attention), q, k, v, do)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert a.dtype == dtype, name
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.abs(a - b).max() <= tol * np.abs(b).max(), name


def test_the_direct_call_matches_attend():
    q, k, v, do = inputs(jnp.float32, seed=2)
    direct = with_grads(lambda q, k, v: splash_causal_attention(q, k, v, interpret=True), q, k, v, do)
    for a, b in zip(direct, with_grads(splash_attend, q, k, v, do), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_future_token_changes_no_earlier_output_or_query_gradient_bit_for_bit():
    q, k, v, do = inputs(jnp.float32, seed=3)
    out, dq, _, _ = with_grads(splash_attend, q, k, v, do)
    for cut in (37, 128 + 37, 128):  # inside the first and second diagonal blocks, and at a block edge
        q2, k2, v2 = (a.at[:, cut:].set(1e3 * sign) for a, sign in ((q, 1), (k, 1), (v, -1)))
        out2, dq2, _, _ = with_grads(splash_attend, q2, k2, v2, do.at[:, cut:].set(0.0))
        np.testing.assert_array_equal(np.asarray(out2[:, :cut]), np.asarray(out[:, :cut]))
        np.testing.assert_array_equal(np.asarray(dq2[:, :cut]), np.asarray(dq[:, :cut]))
        assert not np.array_equal(np.asarray(out2[:, cut:]), np.asarray(out[:, cut:]))


def test_under_a_mesh_each_shard_runs_splash_on_its_batch_rows_and_heads():
    """(data 2, fsdp 1, tp 2): each device's splash call sees one batch row and one head, the same output."""
    from nash_mhc.sharding import make_mesh

    q, k, v, _ = inputs(jnp.float32, seed=4)
    mesh = make_mesh(2, 1, 2, devices=jax.devices()[:4])
    with jax.set_mesh(mesh):
        sharded = jax.jit(splash_attend)(q, k, v)
        with use_kernels("pallas"):
            found = equations(jax.make_jaxpr(attend)(q, k, v).jaxpr)
    np.testing.assert_array_equal(np.asarray(sharded), np.asarray(splash_attend(q, k, v)))
    (shard,) = [e for e in found if e.primitive.name == "shard_map"]
    shapes = [a.aval.shape for a in shard.params["jaxpr"].invars if a.aval.ndim == 4]  # besides splash's mask info
    assert shapes == [(1, T, 1, K)] * 3  # [B, T, H, K] per device
    assert any(e.primitive.name == "pallas_call" for e in equations(shard.params["jaxpr"]))


def test_lengths_splash_cannot_tile_keep_the_xla_path():
    assert splash_block(384) == 128 and splash_block(2048) == 512 and splash_block(64) is None
    q = jnp.zeros((1, 64, 1, 16))
    with pytest.raises(ValueError, match="multiple of 128"):
        splash_causal_attention(q, q, q, interpret=True)
    with use_kernels("pallas"):
        assert kernel_names(attend, q, q, q) == []


@pytest.mark.parametrize("seq,dtype", [(256, jnp.bfloat16), (1024, jnp.float32)])
def test_each_splash_kernel_declares_its_cost_on_tpu(seq, dtype):
    """Lowered for TPU, attend's forward, dQ and dK/dV kernels carry kernel_costs' declarations (splash declares
    none of its own), the forward once: the backward reuses its residuals."""
    x = jax.ShapeDtypeStruct((B, seq, H, K), dtype)
    costs = kernel_costs(B, seq, H, K, jnp.dtype(dtype).itemsize, splash_block(seq))

    def loss(q, k, v):
        return attend(q, k, v).astype(jnp.float32).sum()
    with lowering_platform("tpu"):
        got = declared(jax.grad(loss, argnums=(0, 1, 2)), x, x, x, live=True)
    assert sorted(got, key=repr) == sorted(costs.values(), key=repr)
    assert all(c.flops > 0 and c.bytes_accessed > 0 and c.transcendentals > 0 for c in costs.values())
    # splash's xprof metadata would be printed over several lines of the compiled HLO, hiding the declaration from
    # nash_mhc.tpu_compile.estimate's line-by-line parser (tests/test_estimate.py's slow train-step test saw it)
    with lowering_platform("tpu"):
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(x, x, x)
    assert not any(e.params["metadata"] for e in equations(jaxpr.jaxpr) if e.primitive.name == "pallas_call")


@pytest.mark.slow  # libtpu and one TPU lowering of a `tiny` train step
@needs_libtpu
def test_a_tiny_train_step_lowered_for_tpu_runs_splash_for_full_attention():
    """The `tiny` preset at T = 256, lowered for v5e:2x2: the forward, dQ and dK/dV custom calls carry splash's
    kernel names (scale 0 at 256 and scale 1 at 128 tile; scale 2's 64 coarse tokens keep XLA)."""
    from nash_mhc.sharding import make_mesh
    from nash_mhc.tpu_compile.fit import abstract_batch, abstract_train_state, topology_devices
    from nash_mhc.training import step as step_module

    model = ModelConfig.preset("tiny", seq_len=256, d_model=128, num_heads=2)
    train = TrainConfig(batch_size=4)
    mesh = make_mesh(-1, 1, 1, devices=topology_devices("v5e:2x2"))
    state = abstract_train_state(model, train, mesh)
    batch = abstract_batch(train.batch_size, model.seq_len, mesh)
    text = jax.jit(lambda b, s: step_module._train_step_jit(b, s)).lower(batch, state).as_text()
    assert "tpu_custom_call" in text
    for phase in ("fwd_residuals", "dq_no_residuals", "dkv_no_residuals"):
        assert f"splash_mha_{phase}" in text, phase
    assert "flash" not in text.lower().replace("flash_attention_kernel", "")
