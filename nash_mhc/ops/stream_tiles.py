"""The stream update's tile math on float32 lists of [tm, td] tiles: the one definition of its sums, which the
Pallas kernels (:mod:`nash_mhc.kernels.tpu.stream_mix_kernel`, :mod:`nash_mhc.kernels.tpu.stream_collapse_kernels`)
and the XLA slab forms (:mod:`nash_mhc.ops.stream_slabs`) share.

    X' = H_res X + H_post (x) y:    out[i] = sum_j res[:, i n + j] x[j] + post[:, i] y
    its backward, from g = dX':     dx[j] = sum_i res[:, i n + j] g[i]      dy = sum_i post[:, i] g[i]
                                    dres[:, i n + j] = sum_d g[i] x[j]      dpost[:, i] = sum_d g[i] y

(res [tm, n·n]: H_res [tm, n, n] row-major; post [tm, n]: H_post.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32


def mix_tile(xs: list[jax.Array], y: jax.Array, res: jax.Array, post: jax.Array) -> list[jax.Array]:
    """The n updated streams of one tile, float32 before rounding: sum_j res[:, i n + j] xs[j] + post[:, i] y, from
    the n float32 tiles xs, y, res [tm, n·n] and post [tm, n]. The one definition of the update's sums in the
    kernels (the update, the collapse that makes it, and the collapse's backward that makes it again)."""
    n = len(xs)
    out = []
    for i in range(n):
        acc = res[:, i * n:i * n + 1] * xs[0]
        for j in range(1, n):
            acc = acc + res[:, i * n + j:i * n + j + 1] * xs[j]
        out.append(acc + post[:, i:i + 1] * y)
    return out


def res_transpose(res: jax.Array, gs: list[jax.Array], j: int, offset: int = 0) -> jax.Array:
    """sum_i H_res[:, i, j] g_i [T, D] (float32): stream j's cotangent through H_res X, from the n cotangents g_i
    [T, D] and H_res [T, n, n] held row-major as the n² columns of ``res`` from ``offset`` on. The one definition
    of H_resᵀ g, in the Pallas kernels (the update's and the collapse's dx) and their XLA forms."""
    n = len(gs)
    acc = res[:, offset + j:offset + j + 1] * gs[0]
    for i in range(1, n):
        k = offset + i * n + j
        acc = acc + res[:, k:k + 1] * gs[i]
    return acc


def _columns(columns: list[jax.Array]) -> jax.Array:
    """[tm, k] from k columns [tm, 1] (a lane select per column: no lane concatenation in the kernel)."""
    lane = lax.broadcasted_iota(jnp.int32, (columns[0].shape[0], len(columns)), 1)
    out = jnp.zeros(lane.shape, F32)
    for k, column in enumerate(columns):
        out = jnp.where(lane == k, column, out)
    return out


def update_grads_tile(xs: list[jax.Array], gs: list[jax.Array], y: jax.Array, post: jax.Array
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(dy [tm, td] before rounding, dh_res [tm, n·n], dh_post [tm, n]: this tile's column sums) of the update from
    the n float32 tiles of X and of the updated X's cotangent g, y and post [tm, n]."""
    n = len(xs)
    dy = post[:, 0:1] * gs[0]
    for i in range(1, n):
        dy = dy + post[:, i:i + 1] * gs[i]
    dres = _columns([jnp.sum(gs[i] * xs[j], axis=1, keepdims=True) for i in range(n) for j in range(n)])
    dpost = _columns([jnp.sum(gs[i] * y, axis=1, keepdims=True) for i in range(n)])
    return dy, dres, dpost


__all__ = ["F32", "mix_tile", "res_transpose", "update_grads_tile"]
