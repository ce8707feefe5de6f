"""The residual streams at the two ends of the layer stack: X = n copies of the embedding h [B, T, D] and the
final h = sum_i X_i in float32, each the other's backward pass.

    copies:  X_i = h (in the streams' dtype)          its backward: dh = sum_i dX_i (float32, rounded once)
    sum:     h = X_0 + X_1 + ... + X_{n-1} (float32)  its backward: dX_i = dh (rounded to X's dtype)

Both sums are n - 1 slab additions in this order, in float32 (:func:`slab_sum`). The TPU compiler's cost model
charges a reduce over the streams axis of a bfloat16 [n, B, T, D] about 7 x the time of an addition of the same
slabs, and a broadcast into n slabs about 8 x the HBM time of its bytes (`1b`, v6e: 2.1e6 and 1.5e6 cycles
against 2.9e5 and 1.8e5; docs/tpu.md). So on TPU the copies are one Pallas kernel per call, each token tile of h
read once and written n times (declared cost: those bytes, no FLOPs), and the copies' gradient is another, each
token tile of the n slabs read once and their float32 sum written once in h's dtype (declared: those bytes, n - 1
additions per element), which also keeps the sum in row-major tiles (summed by XLA, it was fused after a
transposing copy of all n slabs that the embedding's scatter-add asked for). Elsewhere, and where no tile divides
a device's shard, the broadcast and :func:`slab_sum` in XLA. The kernels are in
:mod:`nash_mhc.kernels.tpu.stream_copies_kernel`; ``interpret=True`` runs them in Pallas' interpreter (CPU tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from nash_mhc.kernels.tpu.stream_copies_kernel import copies_kernel, sum_kernel
from nash_mhc.kernels.tpu.stream_mix_kernel import mix_blocks
from nash_mhc.ops.dispatch import platform_dependent
from nash_mhc.ops.stream_slabs import slab_sum
from nash_mhc.sharding import per_shard

NAMES = ("batch", "seq", "features")  # h's logical names for per_shard; X adds "streams" in front


def _broadcast(h: jax.Array, n: int, dtype) -> jax.Array:
    return jnp.broadcast_to(h.astype(dtype)[None], (n, *h.shape))


def _copies_shard(h: jax.Array, *, n: int, dtype, interpret: bool) -> jax.Array:
    """One device's h [B, T, D] → [n, B, T, D]: the kernel, or a broadcast where no tile divides the shard."""
    batch, seq, dim = h.shape
    if mix_blocks(batch * seq, dim) is None:
        return _broadcast(h, n, dtype)
    return copies_kernel(h.reshape(batch * seq, dim), n, dtype, interpret=interpret).reshape(n, batch, seq, dim)


def _sum_shard(x: jax.Array, *, dtype, interpret: bool) -> jax.Array:
    """One device's X [n, B, T, D] → [B, T, D]: the kernel, or :func:`slab_sum` where no tile divides the shard."""
    n, batch, seq, dim = x.shape
    if mix_blocks(batch * seq, dim) is None:
        return slab_sum(x).astype(dtype)
    return sum_kernel(x.reshape(n, batch * seq, dim), dtype, interpret=interpret).reshape(batch, seq, dim)


def copies(h: jax.Array, n: int, dtype, *, interpret: bool = False) -> jax.Array:
    """h [B, T, D] → [n, B, T, D] in ``dtype``: the kernel on each device's shard on TPU, a broadcast elsewhere
    (chosen when the step is lowered); ``interpret=True``: the TPU form in Pallas' interpreter on any platform.
    Not differentiable itself: :func:`stream_copies` and :func:`stream_sum` give the gradients."""
    tpu = per_shard(functools.partial(_copies_shard, n=n, dtype=dtype, interpret=interpret), (NAMES,),
                    ("streams", *NAMES))
    if interpret:
        return tpu(h)
    return platform_dependent(h, tpu=tpu, default=functools.partial(_broadcast, n=n, dtype=dtype),
                              name="stream_copies")


def summed(x: jax.Array, dtype, *, interpret: bool = False) -> jax.Array:
    """X [n, B, T, D] → :func:`slab_sum` rounded to ``dtype`` [B, T, D]: the kernel on each device's shard on TPU,
    XLA's slab additions elsewhere; ``interpret`` as :func:`copies`'. Not differentiable itself."""
    tpu = per_shard(functools.partial(_sum_shard, dtype=dtype, interpret=interpret), (("streams", *NAMES),), NAMES)
    if interpret:
        return tpu(x)
    return platform_dependent(x, tpu=tpu, default=lambda x: slab_sum(x).astype(dtype), name="stream_sum")


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def stream_copies(h: jax.Array, n: int) -> jax.Array:
    """The n residual streams of the embedding h [B, T, D]: [n, B, T, D] in h's dtype, each stream h."""
    return h[None] if n == 1 else copies(h, n, h.dtype)


def _stream_copies_forward(h, n):
    return stream_copies(h, n), None


def _stream_copies_backward(n, _, g):
    return (g[0] if n == 1 else summed(g, g.dtype),)


stream_copies.defvjp(_stream_copies_forward, _stream_copies_backward)


def stream_sum(x: jax.Array) -> jax.Array:
    """The streams X [n, B, T, D] summed: [B, T, D] float32 (:func:`slab_sum`)."""
    return _stream_sum(x, x.shape[0], x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _stream_sum(x: jax.Array, n: int, dtype) -> jax.Array:
    return slab_sum(x)


def _stream_sum_forward(x, n, dtype):
    return slab_sum(x), None


def _stream_sum_backward(n, dtype, _, g):
    return (g.astype(dtype)[None] if n == 1 else copies(g, n, dtype),)


_stream_sum.defvjp(_stream_sum_forward, _stream_sum_backward)


__all__ = ["copies", "stream_copies", "stream_sum", "summed"]
