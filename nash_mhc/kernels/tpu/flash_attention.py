"""Causal flash attention for TPU: Pallas kernels that never write the [T, T] scores to HBM.

    flash_causal_attention(q, k, v)   q, k, v [B, T, H, K] → [B, T, H, K]

The same function as :func:`nash_mhc.ops.attention.causal_attention` (float32 scores, softmax and
accumulation; matmul operands in the inputs' dtype, forward and backward), computed block by block with the
online softmax: the sequence is cut into blocks of :func:`flash_block` positions and query block i visits key
blocks 0..i only (the all-masked upper blocks are skipped, inside the diagonal block the future keys are
masked to probability exactly 0). Three kernels:

  forward   grid (B, H, query block i, key block j): O and the log-sum-exp L [B, H, 1, T] of every row
  dQ        grid (B, H, query block i, key block j)
  dK, dV    grid (B, H, key block j, query block i): accumulates over the query blocks that see key block j

The backward kernels work on the transposed scores Sᵀ = K Qᵀ [key, query], so the per-query L and
D = rowsum(dO ∘ O) broadcast as rows ([1, block]) and no kernel transposes a score-sized array. D is made in
XLA, which fuses it into dO's producer where that is an XLA matmul (the output projection of full attention), or,
with ``dq_makes_d=True``, by the dQ kernel from query block i's dO and O before its first key block (it reads O
once more and writes D for the dK, dV kernel): for a dO that a Pallas kernel makes (Nash-MHC's aggregation),
where D in XLA is a pass of its own over dO and O (its cost in the `1b` step on v6e-8:
docs/results/tpu_estimate/README.md).

Each kernel declares its cost (:class:`jax.experimental.pallas.CostEstimate`): the FLOPs of the matmuls it runs
(visited block pairs only), the exponentials, and the HBM bytes its block schedule moves. Pallas re-fetches a
block only when its index changes from one grid step to the next, and the index maps hold a skipped block's
index at the last visited one, so a key block is read once per query block that sees it (:func:`kernel_costs`).
The TPU compiler gives a custom call no cycle estimate of its own; :mod:`nash_mhc.tpu_compile.estimate` costs it
from this declaration (at the chip's roofline).

Not used by the model: :func:`nash_mhc.ops.attention.attend` runs JAX's shipped, hardware-tested splash
attention on TPU (:mod:`nash_mhc.kernels.tpu.splash`), which tiles every length these kernels tile (T a multiple of 128)
and computes the same function. None of these kernels has run on a TPU. Kept only for what splash does not do:
``dq_makes_d`` (splash always makes D in XLA, a pass of its own over dO and O when a Pallas kernel made dO; the
figure above is the compiler's estimate at our declared cost, not a measurement), as the tested alternative should
a TPU show that pass to matter; otherwise a candidate for removal. ``interpret=True`` runs the kernels in Pallas'
interpreter (CPU tests).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from nash_mhc.kernels.tpu.tpu_tiles import LANES
from nash_mhc.ops.dispatch import pallas_call

F32 = jnp.float32
BLOCK_SIZES = (512, 256, 128)    # tried in this order; a block must be a multiple of the 128 lanes
_NT = (((1,), (1,)), ((), ()))   # a @ bᵀ
_NN = (((1,), (0,)), ((), ()))   # a @ b
_TN = (((0,), (0,)), ((), ()))   # aᵀ @ b


def flash_block(seq: int) -> int | None:
    """The block size (query and key blocks are equal) for a sequence of ``seq`` positions; None: no kernel."""
    return next((b for b in BLOCK_SIZES if seq % b == 0), None)


# ------------------------------------------------------------------------------------------------- cost
@dataclasses.dataclass(frozen=True)
class KernelCosts:
    """The declared cost of each kernel for one call (all batch rows and heads)."""

    forward: pl.CostEstimate
    dkv: pl.CostEstimate
    dq: pl.CostEstimate


def kernel_costs(batch: int, seq: int, heads: int, head_dim: int, itemsize: int, block: int,
                 dq_makes_d: bool = False) -> KernelCosts:
    """FLOPs, exponentials and HBM bytes of the three kernels (``dq_makes_d``: the dQ kernel makes D).

    With n = T / block blocks, P = n (n + 1) / 2 visited (query block, key block) pairs per head, b = block:
    matmul FLOPs per visited pair are 2 b² K per matmul (forward 2 matmuls, dK/dV 4, dQ 3), and dQ's D a
    multiply-add per element of O; one exponential per score. HBM bytes per head: a block whose index does not
    change between consecutive grid steps is not fetched again, so the operands indexed by the outer block are
    read once and the ones indexed by the inner block once per visited pair, less one (n > 1) where two
    consecutive outer blocks meet at the same inner index (forward and dQ: outer 0 ends and outer 1 starts at key
    block 0; dK/dV: outer n-2 ends and outer n-1 starts at query block n-1); outputs are written once. L and D
    are float32 rows of T (dK/dV reads D; dQ reads it, or reads O and writes D).
    """
    n = seq // block
    pairs = n * (n + 1) // 2
    per_pair = 2 * block * block * head_dim
    exps = pairs * block * block
    one = seq * head_dim * itemsize          # one [T, K] operand, whole
    reads = pairs - (n > 1)                  # inner-block fetches per head
    visited = reads * block * head_dim * itemsize  # one [T, K] operand read block by block per visited pair
    rows = seq * 4                           # L or D, float32 [T]
    units = batch * heads

    def cost(matmuls: int, transcendentals: int, bytes_accessed: int, flops: int = 0) -> pl.CostEstimate:
        return pl.CostEstimate(flops=units * (matmuls * per_pair * pairs + flops),
                               transcendentals=units * transcendentals, bytes_accessed=units * bytes_accessed)

    forward = cost(2, exps + seq, one + 2 * visited + one + rows)            # q, k, v | o, L (+ T logs)
    dkv = cost(4, exps, 2 * one + 2 * visited + 2 * reads * block * 4 + 2 * one)  # k, v | q, dO, L, D | dk, dv
    if dq_makes_d:
        # q, dO, O, L | D | k, v | dq, and D's multiply-add per element of O
        dq = cost(3, exps, 3 * one + 2 * rows + 2 * visited + one, flops=2 * seq * head_dim)
    else:
        dq = cost(3, exps, 2 * one + 2 * rows + 2 * visited + one)           # q, dO, L, D | k, v | dq
    return KernelCosts(forward, dkv, dq)


# -------------------------------------------------------------------------------------------- kernels
def _visible(query_block: jax.Array, key_block: jax.Array, block: int, transposed: bool) -> jax.Array:
    """[block, block] mask: key position ≤ query position (rows are queries, or keys when ``transposed``)."""
    rows = lax.broadcasted_iota(jnp.int32, (block, block), 0)
    cols = lax.broadcasted_iota(jnp.int32, (block, block), 1)
    if transposed:
        return key_block * block + rows <= query_block * block + cols
    return key_block * block + cols <= query_block * block + rows


def _forward_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, m_scratch, l_scratch, acc_scratch, *, scale, block):
    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _start():
        m_scratch[...] = jnp.full(m_scratch.shape, -jnp.inf, F32)
        l_scratch[...] = jnp.zeros(l_scratch.shape, F32)
        acc_scratch[...] = jnp.zeros(acc_scratch.shape, F32)

    @pl.when(j <= i)
    def _visit():
        s = lax.dot_general(q_ref[...], k_ref[...], _NT, preferred_element_type=F32) * scale  # [bq, bk]
        s = jnp.where(_visible(i, j, block, False), s, -jnp.inf)
        m_old = m_scratch[...]                                                       # [bq, LANES]
        m_new = jnp.maximum(m_old, jnp.max(s, axis=1, keepdims=True))
        p = jnp.exp(s - m_new[:, :1])
        correction = jnp.exp(m_old - m_new)
        l_scratch[...] = correction * l_scratch[...] + jnp.sum(p, axis=1, keepdims=True)
        m_scratch[...] = m_new
        pv = lax.dot_general(p.astype(v_ref.dtype), v_ref[...], _NN, preferred_element_type=F32)
        acc_scratch[...] = correction[:, :1] * acc_scratch[...] + pv

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        total = l_scratch[...]
        o_ref[...] = (acc_scratch[...] / total[:, :1]).astype(o_ref.dtype)
        lse_ref[...] = jnp.transpose(m_scratch[...] + jnp.log(total))[:1, :]  # [LANES, bq] → the row [1, bq]


def _transposed_probs(q_ref, k_ref, lse_ref, i, j, scale, block):
    """Pᵀ [bk, bq] of query block i and key block j from the saved log-sum-exp row."""
    s = lax.dot_general(k_ref[...], q_ref[...], _NT, preferred_element_type=F32) * scale
    return jnp.where(_visible(i, j, block, True), jnp.exp(s - lse_ref[...]), 0.0)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, d_ref, dk_ref, dv_ref, dk_scratch, dv_scratch, *, scale,
                block):
    j, i = pl.program_id(2), pl.program_id(3)

    @pl.when(i == 0)
    def _start():
        dk_scratch[...] = jnp.zeros(dk_scratch.shape, F32)
        dv_scratch[...] = jnp.zeros(dv_scratch.shape, F32)

    @pl.when(i >= j)
    def _visit():
        pt = _transposed_probs(q_ref, k_ref, lse_ref, i, j, scale, block)
        do = do_ref[...]
        dv_scratch[...] += lax.dot_general(pt.astype(do.dtype), do, _NN, preferred_element_type=F32)
        dpt = lax.dot_general(v_ref[...], do, _NT, preferred_element_type=F32)             # [bk, bq]
        dst = pt * (dpt - d_ref[...])
        dk_scratch[...] += lax.dot_general(dst.astype(q_ref.dtype), q_ref[...], _NN, preferred_element_type=F32)

    @pl.when(i == pl.num_programs(3) - 1)
    def _finish():
        dk_ref[...] = (dk_scratch[...] * scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_scratch[...].astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, od_ref, dq_ref, *refs, scale, block, makes_d):
    """``od_ref``: D's row, or with ``makes_d`` O's block, and then ``refs`` starts with D's output row."""
    i, j = pl.program_id(2), pl.program_id(3)
    d_ref, dq_scratch = refs if makes_d else (od_ref, *refs)

    @pl.when(j == 0)
    def _start():
        dq_scratch[...] = jnp.zeros(dq_scratch.shape, F32)
        if makes_d:
            d = jnp.sum(od_ref[...].astype(F32) * do_ref[...].astype(F32), axis=1, keepdims=True)  # [bq, 1]
            d_ref[...] = jnp.transpose(jnp.broadcast_to(d, (d.shape[0], LANES)))[:1, :]  # → the row [1, bq]

    @pl.when(j <= i)
    def _visit():
        pt = _transposed_probs(q_ref, k_ref, lse_ref, i, j, scale, block)
        dpt = lax.dot_general(v_ref[...], do_ref[...], _NT, preferred_element_type=F32)
        dst = pt * (dpt - d_ref[...])
        dq_scratch[...] += lax.dot_general(dst.astype(k_ref.dtype), k_ref[...], _TN, preferred_element_type=F32)

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        dq_ref[...] = (dq_scratch[...] * scale).astype(dq_ref.dtype)


# ------------------------------------------------------------------------------------------ pallas calls
def _spec(block: int, head_dim: int, index):
    """A [block, K] tile of a [B, H, T, K] array at sequence block ``index(outer, inner)``."""
    return pl.BlockSpec((None, None, block, head_dim), lambda b, h, o, i: (b, h, index(o, i), 0))


def _row_spec(block: int, index):
    """A [1, block] tile of a [B, H, 1, T] float32 row array (L, D)."""
    return pl.BlockSpec((None, None, 1, block), lambda b, h, o, i: (b, h, 0, index(o, i)))


def _outer(o, i):
    return o


def _inner_up_to_outer(o, i):
    """Inner block index held at the outer one once past it (skipped steps fetch nothing new)."""
    return jnp.minimum(i, o)


def _inner_from_outer(o, i):
    return jnp.maximum(i, o)


def _params(interpret: bool) -> dict:
    semantics = ("parallel", "parallel", "parallel", "arbitrary")
    return dict(interpret=interpret, compiler_params=pltpu.CompilerParams(dimension_semantics=semantics))


def _forward(q, k, v, block, interpret):
    """Head-major q, k, v [B, H, T, K] → (O [B, H, T, K], L [B, H, 1, T] float32)."""
    batch, heads, seq, head_dim = q.shape
    n = seq // block
    kernel = functools.partial(_forward_kernel, scale=head_dim**-0.5, block=block)
    return pallas_call(
        kernel, grid=(batch, heads, n, n),
        in_specs=[_spec(block, head_dim, _outer), _spec(block, head_dim, _inner_up_to_outer),
                  _spec(block, head_dim, _inner_up_to_outer)],
        out_specs=[_spec(block, head_dim, _outer), _row_spec(block, _outer)],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((batch, heads, 1, seq), F32)],
        scratch_shapes=[pltpu.VMEM((block, LANES), F32), pltpu.VMEM((block, LANES), F32),
                        pltpu.VMEM((block, head_dim), F32)],
        cost_estimate=kernel_costs(batch, seq, heads, head_dim, q.dtype.itemsize, block).forward,
        **_params(interpret))(q, k, v)


def _backward(q, k, v, o, lse, do, block, interpret, dq_makes_d):
    batch, heads, seq, head_dim = q.shape
    n = seq // block
    scale = head_dim**-0.5
    costs = kernel_costs(batch, seq, heads, head_dim, q.dtype.itemsize, block, dq_makes_d)
    if dq_makes_d:  # the dQ kernel reads O and writes D [B, H, 1, T]
        last, last_spec = o, _spec(block, head_dim, _outer)
        d_specs, d_shapes = [_row_spec(block, _outer)], [jax.ShapeDtypeStruct((batch, heads, 1, seq), F32)]
    else:  # D in XLA, read by the dQ kernel
        last, last_spec = jnp.sum(o.astype(F32) * do.astype(F32), axis=-1)[:, :, None, :], _row_spec(block, _outer)
        d_specs, d_shapes = [], []
    dq, *made = pallas_call(
        functools.partial(_dq_kernel, scale=scale, block=block, makes_d=dq_makes_d), grid=(batch, heads, n, n),
        in_specs=[_spec(block, head_dim, _outer), _spec(block, head_dim, _inner_up_to_outer),
                  _spec(block, head_dim, _inner_up_to_outer), _spec(block, head_dim, _outer),
                  _row_spec(block, _outer), last_spec],
        out_specs=[_spec(block, head_dim, _outer), *d_specs],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), *d_shapes],
        scratch_shapes=[pltpu.VMEM((block, head_dim), F32)],
        cost_estimate=costs.dq, **_params(interpret))(q, k, v, do, lse, last)
    d = made[0] if dq_makes_d else last
    # dK, dV: the outer grid axis walks key blocks, the inner one the query blocks that see them.
    dk, dv = pallas_call(
        functools.partial(_dkv_kernel, scale=scale, block=block), grid=(batch, heads, n, n),
        in_specs=[_spec(block, head_dim, _inner_from_outer), _spec(block, head_dim, _outer),
                  _spec(block, head_dim, _outer), _spec(block, head_dim, _inner_from_outer),
                  _row_spec(block, _inner_from_outer), _row_spec(block, _inner_from_outer)],
        out_specs=[_spec(block, head_dim, _outer), _spec(block, head_dim, _outer)],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        scratch_shapes=[pltpu.VMEM((block, head_dim), F32), pltpu.VMEM((block, head_dim), F32)],
        cost_estimate=costs.dkv, **_params(interpret))(q, k, v, do, lse, d)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _flash(q, k, v, block, interpret, dq_makes_d):
    return _forward(q, k, v, block, interpret)[0]


def _flash_fwd(q, k, v, block, interpret, dq_makes_d):
    o, lse = _forward(q, k, v, block, interpret)
    return o, (q, k, v, o, lse)


def _flash_bwd(block, interpret, dq_makes_d, residuals, do):
    q, k, v, o, lse = residuals
    return _backward(q, k, v, o, lse, do.astype(q.dtype), block, interpret, dq_makes_d)


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, block: int | None = None,
                           interpret: bool = False, dq_makes_d: bool = False) -> jax.Array:
    """Causal softmax attention of q, k, v [B, T, H, K] (one dtype) → [B, T, H, K], by the Pallas kernels.

    ``block``: the query and key block size (default :func:`flash_block`); ValueError unless it is a multiple
    of 128 that divides T. ``dq_makes_d``: the backward's dQ kernel makes D = rowsum(dO ∘ O), for an output whose
    gradient comes from a kernel XLA cannot fuse D into (module docstring); the same function either way."""
    seq = q.shape[1]
    block = flash_block(seq) if block is None else block
    if block is None or block % LANES or seq % block:
        raise ValueError(f"flash attention needs a block size that is a multiple of {LANES} and divides the "
                         f"sequence length {seq}, got {block}")
    out = _flash(_head_major(q), _head_major(k), _head_major(v), block, interpret, dq_makes_d)
    return _head_major(out)


def _head_major(a: jax.Array) -> jax.Array:
    """[B, T, H, K] ↔ [B, H, T, K]: the kernels tile the sequence of one (batch row, head) at a time."""
    return jnp.swapaxes(a, 1, 2)
