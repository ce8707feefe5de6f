"""RoPE as a Pallas TPU kernel: x read and written once, the half swap a lane rotation.

For head-major sequences x [N, T, K] (K a multiple of 128) and the float32 tables cos = [c, c] and sin = [−s, s]
[T, K] (:func:`nash_mhc.ops.rope.rope`'s angles, the halves concatenated):

    y = x ⊙ cos + roll(x, K/2) ⊙ sin        roll(x, K/2) = [x₂, x₁]: the halves swapped

in float32, rounded once to x's dtype (the numbers of :func:`nash_mhc.ops.rope.rotate_tpu`). RoPE is a rotation
per token, so the backward pass is the same kernel with −sin (the rotation by the opposite angle).

Why a kernel: in XLA the swap was a one-hot [K, K] matmul (slicing the halves leaves each (8, 128) tile half
empty), and on v6e, whose matrix units are 256 x 256, a contraction of 128 with 128 outputs fills a quarter of
one: the TPU compiler's cost model charged each rotation of the `1b` step about 3 x its bandwidth time
(docs/tpu.md). Here the swap is ``pltpu.roll`` along the 128 lanes, and the kernel streams x once.

The grid walks row tiles of the positions (outer) and the sequences (inner), so a tile of the tables is fetched
once and stays resident while every sequence passes under it. Each ``pallas_call`` declares its cost
(:func:`kernel_cost`); the kernel runs on each device's sequences (:func:`nash_mhc.sharding.per_shard`: batch over
data x fsdp, heads over tp, positions and head dim whole). On TPU only (:func:`nash_mhc.ops.rope.rope` dispatches
with ``dispatch.platform_dependent``); ``interpret=True`` runs it in Pallas' interpreter (CPU tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from nash_mhc.kernels.tpu.tpu_tiles import LANES, SUBLANES
from nash_mhc.ops.dispatch import pallas_call
from nash_mhc.sharding import per_shard

F32 = jnp.float32
ROW_TILES = (512, 256, 128, 64, 32, 16)      # positions per tile, largest first (16: one bfloat16 (16, 128) tile)
NAMES, TABLE = ("batch", "seq", "heads", "head_dim"), ("seq", "head_dim")  # for per_shard


def row_tile(seq: int, head_dim: int) -> int | None:
    """Positions per tile for ``seq`` positions of ``head_dim``: the largest of :data:`ROW_TILES` dividing ``seq``;
    None where the kernel does not apply (``head_dim`` not a multiple of 128, or no tile divides ``seq``)."""
    if head_dim % LANES:
        return None
    return next((rows for rows in ROW_TILES if seq % rows == 0), None)


def kernel_cost(sequences: int, seq: int, head_dim: int, itemsize: int) -> pl.CostEstimate:
    """FLOPs and HBM bytes of one call on x [sequences, seq, head_dim] of ``itemsize``: two products and a sum per
    element; x read and y written once, each float32 table [seq, head_dim] read once."""
    elems = sequences * seq * head_dim
    return pl.CostEstimate(flops=3 * elems, transcendentals=0,
                           bytes_accessed=2 * elems * itemsize + 2 * seq * head_dim * 4)


def _rotate_kernel(x_ref, cos_ref, sin_ref, y_ref):
    x = x_ref[...].astype(F32)
    swapped = pltpu.roll(x, x.shape[-1] // 2, 1)  # [x₂, x₁]
    y_ref[...] = (x * cos_ref[...] + swapped * sin_ref[...]).astype(y_ref.dtype)


def _rotate_shard(x, cos, sin, *, rows, interpret):
    """x [B, T, H, K] (this device's shard) → y, by one ``pallas_call`` over the head-major [B H, T, K]."""
    batch, seq, heads, head_dim = x.shape
    xh = jnp.swapaxes(x, 1, 2).reshape(batch * heads, seq, head_dim)
    tile = pl.BlockSpec((None, rows, head_dim), lambda t, n: (n, t, 0))
    table = pl.BlockSpec((rows, head_dim), lambda t, n: (t, 0))
    y = pallas_call(
        _rotate_kernel, grid=(seq // rows, batch * heads), in_specs=[tile, table, table], out_specs=tile,
        out_shape=jax.ShapeDtypeStruct(xh.shape, xh.dtype),
        cost_estimate=kernel_cost(batch * heads, seq, head_dim, x.dtype.itemsize), interpret=interpret,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")))(xh, cos, sin)
    return jnp.swapaxes(y.reshape(batch, heads, seq, head_dim), 1, 2)


def _run(x, cos, sin, rows, interpret):
    return per_shard(functools.partial(_rotate_shard, rows=rows, interpret=interpret), (NAMES, TABLE, TABLE),
                     NAMES)(x, cos, sin)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _rotate(x, cos, sin, rows, interpret):
    return _run(x, cos, sin, rows, interpret)


def _rotate_forward(x, cos, sin, rows, interpret):
    return _run(x, cos, sin, rows, interpret), (cos, sin)


def _rotate_backward(rows, interpret, residuals, g):
    cos, sin = residuals  # the angles get no gradient
    return _run(g, cos, -sin, rows, interpret), jnp.zeros_like(cos), jnp.zeros_like(sin)


_rotate.defvjp(_rotate_forward, _rotate_backward)


def rotate_kernel(x: jax.Array, cos: jax.Array, sin: jax.Array, *, rows: int | None = None,
                  interpret: bool = False) -> jax.Array:
    """RoPE of x [B, T, H, K] with the float32 tables cos = [c, c], sin = [−s, s] [T, K] (module docstring), in
    x's dtype, by the kernel, forward and backward. ``rows``: positions per tile, default :func:`row_tile`;
    ValueError where no tile fits (the caller's XLA form applies there)."""
    seq, _, head_dim = x.shape[-3:]
    rows = row_tile(seq, head_dim) if rows is None else rows
    if x.ndim != 4 or rows is None or seq % rows or rows % SUBLANES or head_dim % LANES \
            or cos.shape != (seq, head_dim) or sin.shape != (seq, head_dim):
        raise ValueError(f"rope kernel needs x [B, T, H, K] with K a multiple of {LANES}, a row tile dividing T "
                         f"(a multiple of {SUBLANES}) and tables [T, K]; got x {x.shape}, rows {rows}, "
                         f"tables {cos.shape} {sin.shape}")
    return _rotate(x, cos.astype(F32), sin.astype(F32), rows, interpret)
