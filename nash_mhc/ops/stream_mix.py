"""mHC's stream update X <- H_res X + H_post (x) y, by its Pallas TPU kernels or the XLA slab form, with one backward
rule for both.

    stream_mix(x, y, h_res, h_post)    x [n, T, D], y [T, D], h_res [T, n, n], h_post [T, n] → [n, T, D]

    out[i, t] = sum_j h_res[t, i, j] x[j, t] + h_post[t, i] y[t]        (float32, rounded once to x's dtype)

The kernels (:mod:`nash_mhc.kernels.tpu.stream_mix_kernel`) read each stream once and write it once, where the TPU
compiler's fusions of the slab form read every input slab once per output slab. They run on TPU only
(:func:`mix_streams` chooses with ``dispatch.platform_dependent``); ``interpret=True`` runs them in Pallas'
interpreter (CPU tests). Elsewhere ``kernels=False`` computes the same sums and the same backward rule in XLA over
the n slabs (:func:`nash_mhc.ops.stream_slabs.mix_slabs`, :func:`nash_mhc.ops.stream_slabs.mix_backward_slabs`):
JAX's autodiff of the slab form padded each stream's gradient to [n, T, D] and added the n pads, and on the CPU
those pads were the largest item of the mix (``benchmarks/cpu_profile.py --residual mhc``).
"""

from __future__ import annotations

import functools

import jax
from jaxtyping import Array, Float

from nash_mhc.kernels.tpu.stream_mix_kernel import mix_backward_kernel, mix_blocks, mix_forward_kernel
from nash_mhc.ops.dispatch import platform_dependent
from nash_mhc.ops.stream_slabs import mix_backward_slabs, mix_slabs
from nash_mhc.ops.stream_tiles import F32
from nash_mhc.sharding import per_shard

# logical names of (x, y, h_res, h_post) and of the result, for nash_mhc.sharding.per_shard: tokens split over
# the batch axes, streams and features whole (the mix is per token)
SHARD_AXES = ((("streams", "tokens", "features"), ("tokens", "features"), ("tokens", "streams", "streams"),
               ("tokens", "streams")), ("streams", "tokens", "features"))


def _forward(x, y, res, post, blocks, interpret):
    if blocks is None:
        return mix_slabs(x, y, res, post)
    return mix_forward_kernel(x, y, res, post, blocks, interpret)


def _backward(x, y, res, post, g, blocks, interpret, defer):
    """(dx, dy, dres, dpost) by the backward kernel on tiles ``blocks``, or (g, dy, dres, dpost) with ``defer``; the
    XLA form where ``blocks`` is None."""
    if blocks is None:
        return mix_backward_slabs(x, y, res, post, g, defer)
    return mix_backward_kernel(x, y, res, post, g, blocks, interpret, defer)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _mix(x, y, res, post, blocks, interpret, defer):
    return _forward(x, y, res, post, blocks, interpret)


def _mix_fwd(x, y, res, post, blocks, interpret, defer):
    return _forward(x, y, res, post, blocks, interpret), (x, y, res, post)


def _mix_bwd(blocks, interpret, defer, residuals, g):
    x, y, res, post = residuals
    return _backward(x, y, res, post, g.astype(x.dtype), blocks, interpret, defer)


_mix.defvjp(_mix_fwd, _mix_bwd)


def stream_mix(x: jax.Array, y: jax.Array, h_res: jax.Array, h_post: jax.Array, *,
               blocks: tuple[int, int] | None = None, interpret: bool = False, kernels: bool = True,
               defer: bool = False) -> jax.Array:
    """H_res X + H_post (x) y by the Pallas kernels: x [n, T, D] (any float dtype), y [T, D], h_res [T, n, n] and
    h_post [T, n] (float32) → [n, T, D] in x's dtype, computed in float32.

    ``blocks``: (token tile, column tile), default :func:`nash_mhc.kernels.tpu.stream_mix_kernel.mix_blocks`;
    ValueError when they do not divide (T, D) or the token tile is not a multiple of 8. ``kernels=False``: the
    same sums and the same backward rule in XLA over the n slabs (any T, D; ``blocks`` ignored), the CPU's and
    GPU's form.

    ``defer=True``: the backward rule hands back the output's cotangent g itself as x's, for the consumer that
    made x to apply H_resᵀ (saves writing dx = H_resᵀ g and reading it back). Only for an x that is the pass-
    through X of :func:`nash_mhc.ops.stream_collapse.collapse_streams`, which does that; anywhere else x's
    gradient would be wrong."""
    n, tokens, dim = x.shape
    res = h_res.astype(F32).reshape(tokens, n * n)
    if not kernels:
        return _mix(x, y, res, h_post.astype(F32), None, interpret, defer)
    blocks = mix_blocks(tokens, dim) if blocks is None else blocks
    if blocks is None or tokens % blocks[0] or blocks[0] % 8 or dim % blocks[1]:
        raise ValueError(f"stream_mix needs tiles that divide (tokens, dim) = ({tokens}, {dim}) with a token tile "
                         f"that is a multiple of 8, got {blocks}")
    return _mix(x, y, res, h_post.astype(F32), blocks, interpret, defer)


def mix_streams(xs: Float[Array, "n seq dim"], y: Float[Array, "seq dim"], h_res: Float[Array, "seq n n"],
                h_post: Float[Array, "seq n"], *, defer: bool = False) -> Float[Array, "n seq dim"]:
    """X <- H_res X + H_post (x) y on the streams-major state, in float32, rounded once to X's dtype: the update
    the hyper-connections (:mod:`nash_mhc.layers.hyperconnection`) call.

    Lowered for TPU, the Pallas kernels of :func:`stream_mix` on each device's token shard (the compiler's fusions
    of the slab form read every input slab once per output slab); elsewhere (CPU, GPU), and where no token tile
    divides T, the slab form in XLA with the kernels' backward rule (``kernels=False``). Chosen for the step's
    platform (``dispatch.platform_dependent``); both compute the same float32 sums in the same order. ``defer``:
    the backward rule of :func:`stream_mix` with ``defer=True``, only for the pass-through X of the mhc
    collapse."""
    xla = functools.partial(stream_mix, kernels=False, defer=defer)
    if mix_blocks(xs.shape[1], xs.shape[2]) is None:
        return xla(xs, y, h_res, h_post)
    shard = functools.partial(_mix_shard, defer=defer)
    return platform_dependent(xs, y, h_res, h_post, tpu=per_shard(shard, *SHARD_AXES), default=xla,
                              name="mix_streams")


def _mix_shard(xs: jax.Array, y: jax.Array, h_res: jax.Array, h_post: jax.Array, defer: bool = False) -> jax.Array:
    """One device's tokens: the kernels, or the slab form where no token tile divides the shard."""
    return stream_mix(xs, y, h_res, h_post, kernels=mix_blocks(xs.shape[1], xs.shape[2]) is not None, defer=defer)


__all__ = ["SHARD_AXES", "mix_streams", "stream_mix"]
