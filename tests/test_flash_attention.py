"""The Pallas flash attention kernels (nash_mhc.kernels.tpu.flash_attention), run in Pallas' interpreter on the CPU:
forward and gradients against float64 NumPy written from the equations, causality bit for bit, the per-shard
split under a mesh, and the declared cost against an independent count of the block schedule. The TPU compile
of the kernels and their roofline costing are in tests/test_estimate.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import declared
from jax.sharding import PartitionSpec as P

from nash_mhc.kernels.tpu.flash_attention import BLOCK_SIZES, flash_block, flash_causal_attention, kernel_costs
from nash_mhc.sharding import make_mesh, per_shard_attention

pytestmark = pytest.mark.kernels  # the quick loop leaves them to the rest (docs/testing.md)

B, T, H, K, BLOCK = 2, 384, 2, 64, 128  # three blocks: skipped, interior and diagonal block pairs


def reference(q, k, v, do):
    """(O, dQ, dK, dV) in float64 from the equations: S = Q Kᵀ/√K masked to key ≤ query, P = softmax(S) per
    row, O = P V; dV = Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP − rowsum(dP ∘ P)), dQ = dS K/√K, dK = dSᵀ Q/√K."""
    q, k, v, do = (np.asarray(a, np.float64).transpose(0, 2, 1, 3) for a in (q, k, v, do))  # [B, H, T, K]
    seq, dim = q.shape[2], q.shape[3]
    s = q @ k.swapaxes(-1, -2) / np.sqrt(dim)
    s = np.where(np.tril(np.ones((seq, seq), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = do @ v.swapaxes(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    out = (p @ v, ds @ k / np.sqrt(dim), ds.swapaxes(-1, -2) @ q / np.sqrt(dim), p.swapaxes(-1, -2) @ do)
    return tuple(a.transpose(0, 2, 1, 3) for a in out)


def inputs(dtype, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.normal(size=(B, T, H, K)), dtype) for _ in range(4))


def flash_with_grads(q, k, v, do, **kw):
    out, pullback = jax.vjp(lambda q, k, v: flash_causal_attention(q, k, v, block=BLOCK, interpret=True, **kw),
                            q, k, v)
    return (out, *pullback(do))


@pytest.fixture(scope="module")
def float32_case():
    q, k, v, do = inputs(jnp.float32)
    return (q, k, v, do), flash_with_grads(q, k, v, do), reference(q, k, v, do)


def test_forward_and_gradients_match_float64_reference(float32_case):
    _, got, want = float32_case
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float64), b, atol=2e-5, rtol=2e-5, err_msg=name)


def test_the_dq_kernel_making_d_gives_the_reference_gradients(float32_case):
    """dq_makes_d: D = rowsum(dO ∘ O) made in the dQ kernel instead of XLA, the same gradients."""
    (q, k, v, do), _, want = float32_case
    got = flash_with_grads(q, k, v, do, dq_makes_d=True)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float64), b, atol=2e-5, rtol=2e-5, err_msg=name)


@pytest.mark.parametrize("dq_makes_d", [False, True])
def test_bfloat16_inputs_stay_within_bfloat16_rounding_of_the_reference(dq_makes_d):
    q, k, v, do = inputs(jnp.bfloat16, seed=1)
    got = flash_with_grads(q, k, v, do, dq_makes_d=dq_makes_d)
    want = reference(q, k, v, do)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert a.dtype == jnp.bfloat16, name
        scale = np.abs(b).max()
        assert np.abs(np.asarray(a, np.float64) - b).max() < 0.02 * scale, name


def test_a_future_key_or_value_changes_no_earlier_output_or_query_gradient_bit_for_bit(float32_case):
    (q, k, v, do), (out, dq, _, _), _ = float32_case
    cut = BLOCK + 37  # inside the second block: the diagonal block's masking is what keeps it causal
    k2 = k.at[:, cut:].set(1e3)
    v2 = v.at[:, cut:].set(-1e3)
    out2, dq2, _, _ = flash_with_grads(q, k2, v2, do.at[:, cut:].set(0.0))
    np.testing.assert_array_equal(np.asarray(out2[:, :cut]), np.asarray(out[:, :cut]))
    np.testing.assert_array_equal(np.asarray(dq2[:, :cut]), np.asarray(dq[:, :cut]))
    assert not np.array_equal(np.asarray(out2[:, cut:]), np.asarray(out[:, cut:]))


def test_under_a_mesh_each_shard_runs_the_kernels_on_its_batch_rows_and_heads(float32_case):
    """(data 2, fsdp 2, tp 2): batch over data x fsdp = 4 does not divide B = 2, so it falls back to data."""
    (q, k, v, _), (out, *_), _ = float32_case
    mesh = make_mesh(2, 2, 2)
    attention = per_shard_attention(lambda q, k, v: flash_causal_attention(q, k, v, block=BLOCK, interpret=True))
    seen = []

    def traced(q, k, v):
        seen.append(q.shape)
        return attention(q, k, v)

    with jax.set_mesh(mesh):
        sharded = jax.jit(traced)(q, k, v)
    np.testing.assert_array_equal(np.asarray(sharded), np.asarray(out))
    jaxpr = jax.make_jaxpr(traced)  # the per-shard shapes inside shard_map
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        inner = [e for e in jaxpr(q, k, v).eqns if e.primitive.name == "shard_map"]
    assert [e.params["in_specs"][0] for e in inner] == [P("data", None, "tp")]


def test_bad_block_sizes_are_refused_with_one_line():
    q = jnp.zeros((1, 384, 1, 64))
    for block in (96, 256):
        with pytest.raises(ValueError, match="multiple of 128 and divides the sequence length 384"):
            flash_causal_attention(q, q, q, block=block, interpret=True)
    assert flash_block(384) == 128 and flash_block(2048) == 512 and flash_block(64) is None
    assert tuple(sorted(BLOCK_SIZES, reverse=True)) == BLOCK_SIZES


# ---------------------------------------------------------------------------------------------- cost
def schedule(n: int, outer_index, inner_index):
    """Fetches of an operand tiled by the outer and one tiled by the inner block of an (outer, inner) grid of
    one head, where a block is fetched only when its index differs from the previous grid step's."""
    fetched = {"outer": 0, "inner": 0}
    last = {"outer": None, "inner": None}
    for o in range(n):
        for i in range(n):
            for name, index in (("outer", outer_index(o, i)), ("inner", inner_index(o, i))):
                fetched[name] += index != last[name]
                last[name] = index
    return fetched


@pytest.mark.parametrize("dq_makes_d", [False, True])
@pytest.mark.parametrize("seq,block,itemsize", [(384, 128, 4), (2048, 512, 2), (128, 128, 2)])
def test_declared_cost_is_the_schedules_flops_exponentials_and_bytes(seq, block, itemsize, dq_makes_d):
    """Counted independently: visited block pairs by position (a pair is visited when its first key is at or
    before its last query), fetches by walking the grid, and the pallas_calls' own declarations by jaxpr."""
    n = seq // block
    visited = sum(j * block <= (i + 1) * block - 1 for i in range(n) for j in range(n))
    tile = block * K * itemsize
    fwd = schedule(n, lambda o, i: o, lambda o, i: min(i, o))  # forward and dQ: queries outer
    dkv = schedule(n, lambda o, i: o, lambda o, i: max(i, o))  # dK, dV: keys outer
    units = B * H
    per_pair = 2 * block * block * K
    want = {
        "forward": (2 * per_pair * visited, visited * block**2 + seq,
                    (2 * fwd["outer"] * tile + 2 * fwd["inner"] * tile + seq * 4)),
        "dkv": (4 * per_pair * visited, visited * block**2,
                4 * dkv["outer"] * tile + 2 * dkv["inner"] * (tile + block * 4)),
        "dq": (3 * per_pair * visited, visited * block**2,
               3 * fwd["outer"] * tile + 2 * seq * 4 + 2 * fwd["inner"] * tile),
    }
    if dq_makes_d:  # dQ reads O as well and writes D instead of reading it: a multiply-add per element of O
        want["dq"] = (3 * per_pair * visited + 2 * seq * K, visited * block**2,
                      4 * fwd["outer"] * tile + 2 * seq * 4 + 2 * fwd["inner"] * tile)
    costs = kernel_costs(B, seq, H, K, itemsize, block, dq_makes_d)
    for name, (flops, exps, moved) in want.items():
        got = getattr(costs, name)
        assert (got.flops, got.transcendentals, got.bytes_accessed) == (units * flops, units * exps,
                                                                         units * moved), name

    dtype = jnp.float32 if itemsize == 4 else jnp.bfloat16
    x = jax.ShapeDtypeStruct((B, seq, H, K), dtype)

    def loss(q, k, v):
        return flash_causal_attention(q, k, v, block=block, dq_makes_d=dq_makes_d).astype(jnp.float32).sum()
    assert declared(jax.grad(loss, argnums=(0, 1, 2)), x, x, x) == [costs.forward, costs.dq, costs.dkv]


def test_cudnn_attention_only_where_it_can_run(monkeypatch):
    """cuDNN's fused attention is chosen only on an NVIDIA GPU that runs it (CUDA, compute capability ≥ 8.0: a
    cuDNN call cannot be traced without one), for bfloat16 / float16 operands (it takes no float32), a head dim ≤
    128 divisible by 8 and T a multiple of 64. benchmarks/gpu_attention_check.py checks its numerics and
    causality on a GPU (operator-level causality and numerics were checked on an H100)."""
    from nash_mhc.ops import attention

    q = jnp.zeros((2, 64, 4, 64), jnp.bfloat16)
    assert not attention.cuda_flash_device() and not attention.cudnn_usable(q)  # this CPU
    monkeypatch.setattr(attention, "cuda_flash_device", lambda: True)
    assert attention.cudnn_usable(q) and attention.cudnn_usable(q.astype(jnp.float16))
    assert not attention.cudnn_usable(q.astype(jnp.float32))
    assert not attention.cudnn_usable(jnp.zeros((2, 64, 4, 12), jnp.bfloat16))
    assert not attention.cudnn_usable(jnp.zeros((2, 64, 4, 256), jnp.bfloat16))
    assert attention.cudnn_usable(jnp.zeros((2, 64, 4, 128), jnp.bfloat16))
    assert not attention.cudnn_usable(jnp.zeros((2, 96, 4, 64), jnp.bfloat16))  # T not a multiple of 64


def test_a_gpu_backend_without_cuda_keeps_the_xla_attention(monkeypatch):
    """A "gpu" default backend that is not CUDA (ROCm; here the CPU client posing as one) never picks cuDNN, so a
    bfloat16 step still traces and lowers there (tracing the cuDNN call raises "cuDNN is not detected")."""
    from nash_mhc.ops.attention import attend

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    q = jax.random.normal(jax.random.key(0), (2, 64, 4, 16), jnp.float32).astype(jnp.bfloat16)
    text = jax.jit(attend).lower(q, q, q).as_text()
    assert "cudnn" not in text.lower()
