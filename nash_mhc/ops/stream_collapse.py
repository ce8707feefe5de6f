"""mHC's stream collapse as Pallas TPU kernels, each stream read once per kernel, and its backward pass.

For one hyper-connection, from the streams X [n, T, D], the weighted projection W [n, D, C] (g ⊙ Φ, per stream)
and the per-token coefficient function of the connection (``coefficients``: raw projection and sum of squares →
H_pre, H_post, H_res):

    raw = sum_j X_j W_j  [T, C]      ss = sum_j sum_d X_j²  [T]        kernel "collapse"  (reads X once)
    H_pre = pre.weights(raw, ss, pre.operand(params))                   kernel "collapse"  (per token)
    u = sum_j H_pre[:, j] X_j  [T, D]    (rounded once to X's dtype)    kernel "collapse"  (the same read of X)
    (H_pre, H_post, H_res) = coefficients(raw, ss)                                      (XLA, [T, C]-sized)

The collapse kernel walks token tiles of whole rows ([n, tokens, D]), so a tile's statistics are complete before
its u is summed: X is read once in the forward pass, where separate stats and u kernels read it twice (one pass
over the streams more per sublayer, three per layer under grouped remat; docs/tpu.md). Given the sublayer's
RMSNorm gain (``norm_weight``), the kernel also normalises each tile of u where it writes it and returns
y = RMSNorm(u) in u's place, with the norm's statistic inv [T, 1] beside it for the backward pass, whose "dh_pre"
kernel then also walks token tiles of whole rows and runs the norm's backward before its own sums (du written
once, where an XLA pass wrote it and the kernel read it back): XLA's passes over u for the norm's statistic and
output, and for its backward, are not made. ``pre`` gives the kernel
H_pre's part of ``coefficients`` (a per-token function of raw, ss and a small float32 operand made from the
parameters), which must equal ``coefficients``'s H_pre.

:func:`collapse_streams` returns (X, u, H_post, H_res): X passes through unchanged for the stream update
X' = H_res X + H_post (x) y that consumes it (:func:`nash_mhc.ops.stream_mix.stream_mix` with ``defer=True``),
whose backward rule hands back the cotangent g of X' itself in X's place; this backward rule applies H_resᵀ to
it, inside the same write as the collapse's own terms (so the update's dX = H_resᵀ g is never written and read
back: one pass over the streams less per sublayer). The pass-through X may feed only that update. Backward, from
(g, du, dH_post, dH_res):

    du = RMSNorm's backward from y's cotangent, when the collapse normalised u   kernel "dh_pre"  (reads u, dy)
    dH_pre[:, j] = sum_d du X_j                                       kernel "dh_pre"  (reads X, du)
    (d_raw, d_ss, d_params) = vjp(coefficients)(dH_pre, dH_post, dH_res)            (XLA, [T, C]-sized)
    dX_j = sum_i H_res[:, i, j] g_i + H_pre[:, j] du + 2 d_ss X_j + d_raw W_jᵀ   kernel "dx"  (reads X, g, du)
    dW_j = X_jᵀ d_raw                                                 kernel "dx"  (the same read of X)

Given the previous sublayer's update (``update`` = (y, H_res, H_post), for X the pass-through X of that
sublayer's collapse), the collapse kernel first makes it, X' = H_res X + H_post (x) y on its tile of whole rows
(:func:`nash_mhc.kernels.tpu.stream_mix_kernel.mix_kernel`), writes X' once and collapses it from VMEM, so X' is
not read back from HBM; the backward rule is the collapse's for X', then the update's deferred one (stream_mix's
``defer``), in one "dx" kernel that reads the previous X and y in X''s place, makes X' again on its tile and
computes dy, dH_res and dH_post from the tile's dX' (never written and read back). The model's layers chain their
sublayers this way (:func:`nash_mhc.layers.hyperconnection.connect_pair`): each FFN's collapse makes its attention's
update and, on TPU, each attention's collapse the previous layer's FFN update.

In XLA the sum of squares and the projection read X in separate fusions (about three reads' worth), and XLA's
own backward of the slab form writes float32 copies of the streams and sums the n stream gradients in separate
passes (compiler estimates, docs/results/tpu_estimate/README.md). The kernels, their tiles and declared costs are in
:mod:`nash_mhc.kernels.tpu.stream_collapse_kernels` (each ``pallas_call`` declares its cost, ``kernel_costs``), the slab
forms' sums in :mod:`nash_mhc.ops.stream_slabs`; this module holds the function and its backward rule. The kernels
run on TPU only (:func:`connection_collapse` chooses them for a hyper-connection); ``interpret=True`` runs
them in Pallas' interpreter (CPU tests). ``kernels=False`` (the CPU's and GPU's form) computes the same
functions and backward rule with each kernel's slab form in XLA, so the n stream gradients are written once,
stacked, with the mix's cotangent added, instead of padded and summed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from nash_mhc.kernels.tpu.stream_collapse_kernels import _collapse_rows, _dh_pre, _dx, _norm_dh_pre
from nash_mhc.kernels.tpu.stream_mix_kernel import mix_blocks
from nash_mhc.ops.dispatch import platform_dependent, tpu_kernels
from nash_mhc.ops.rms_norm import rms_inverse, rms_norm
from nash_mhc.ops.stream_mix import stream_mix
from nash_mhc.ops.stream_slabs import mix_slabs, stream_stats, weighted_sum
from nash_mhc.ops.stream_tiles import F32
from nash_mhc.sharding import per_shard

STREAMS, TOKENS = ("streams", "tokens", "features"), ("tokens", "features")  # logical names for per_shard


class PreWeights(NamedTuple):
    """H_pre inside the collapse kernel: ``operand(params)`` → a small float32 [k, n] array (XLA, once per call);
    ``weights(raw [tm, C], ss [tm, 1], operand)`` → H_pre [tm, n] (per token, inside the kernel)."""

    operand: Callable[..., jax.Array]
    weights: Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


# ------------------------------------------------------------------------------------------ the function
Coefficients = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]


def _on_shards(kernels: bool, function, in_names, out_names, sums=()):
    """``function`` on each device's token shard (the kernels' tiles are a shard's), or whole (the XLA forms)."""
    return per_shard(function, in_names, out_names, sums) if kernels else function


def _forward(coefficients, pre, x, w, params, gain, eps, blocks, interpret, kernels, pullback=False, update=()):
    """(X, u (or y = RMSNorm(u) with a ``gain``), H_post, H_res) and (H_pre, the coefficients' pullback when
    ``pullback``, else None, u and RMSNorm's inv [T, 1] (None without a gain)). With ``update`` = (y, H_res [T, n²],
    H_post [T, n]) of the previous sublayer, X is first updated (in the collapse kernel on TPU) and the X returned
    is the updated one."""
    inv = None
    if kernels:  # TPU: raw, ss and u (and y) from one read of X, on each device's tokens
        collapse = functools.partial(_collapse_rows, pre_weights=pre.weights, eps=None if gain is None else eps,
                                     update=bool(update), blocks=blocks, interpret=interpret)
        mixing = (TOKENS, ("tokens", "streams"), ("tokens", "streams")) if update else ()
        in_names = (STREAMS, *mixing, ("streams", "features", "hc_coeffs"), ("hc_coeffs", "streams"))
        out_names = (STREAMS,) * bool(update) + (("tokens", "hc_coeffs"), ("tokens",), TOKENS)
        operands = (x, *update, w, pre.operand(params))
        if gain is None:
            *updated, raw, ss, u = per_shard(collapse, in_names, out_names)(*operands)
            # u written once. Fused into each of its consumers (the norm's statistics, the normalised input in two
            # layouts under multiscale attention), XLA wrote float32 copies of the streams for them instead
            u = lax.optimization_barrier(u)
        else:
            *updated, raw, ss, u, inv, y = per_shard(collapse, (*in_names, ("norm",)),
                                                     (*out_names, ("tokens", "norm"), TOKENS))(*operands, gain)
            y = lax.optimization_barrier(y)  # written once, as RMSNorm's output on TPU (nash_mhc.layers.norm)
        x = updated[0] if update else x
    else:
        x = mix_slabs(x, *update) if update else x
        slabs = [a.astype(F32) for a in x]
        raw, ss = stream_stats(slabs, w)
    if pullback:
        (h_pre, h_post, h_res), vjp = jax.vjp(coefficients, raw, ss, params)
    else:
        (h_pre, h_post, h_res), vjp = coefficients(raw, ss, params), None
    if not kernels:
        u = weighted_sum(slabs, h_pre).astype(x.dtype)
        if gain is not None:
            inv = rms_inverse(u, eps)
            y = rms_norm(u, gain, eps, inv)
    return (x, u if gain is None else y, h_post, h_res), (h_pre, vjp, u, inv)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 6, 7, 8, 9))
def _collapse(coefficients, pre, x, w, params, gain, eps, blocks, interpret, kernels):
    return _forward(coefficients, pre, x, w, params, gain, eps, blocks, interpret, kernels)[0]


def _collapse_fwd(coefficients, pre, x, w, params, gain, eps, blocks, interpret, kernels, update=()):
    """Saves the collapsed X (the updated one with ``update``) and the coefficients' pullback (their own residuals:
    Sinkhorn's saved iterates on CPU and GPU, its logits on TPU), so the backward pass does not recompute them; with
    a gain also u and RMSNorm's inv."""
    out, (h_pre, pullback, u, inv) = _forward(coefficients, pre, x, w, params, gain, eps, blocks, interpret, kernels,
                                              pullback=True, update=update)
    norm = None if gain is None else (u, gain, inv)
    return out, (out[0], w, h_pre, out[3], pullback, norm)


def _collapse_bwd(coefficients, pre, eps, blocks, interpret, kernels, residuals, cotangents, update=()):
    """The collapse's gradients (dX, dW, d_params, d_gain); with ``update`` = (X_prev, y, H_res [T, n²], H_post) of
    the update that made X, also that update's (dy, dH_res, dH_post) (:func:`_dx`; dX then goes back as X_prev's,
    the deferred rule)."""
    del coefficients, pre, eps
    x, w, h_pre, h_res, pullback, norm = residuals
    g, du, dh_post, dh_res = cotangents  # g: the stream update's output cotangent (module docstring)
    dgain = None
    if norm is None:
        du = du.astype(x.dtype)
        dh_pre = _on_shards(kernels, functools.partial(_dh_pre, blocks=blocks, interpret=interpret, kernels=kernels),
                            (STREAMS, TOKENS), ("tokens", "streams"))(x, du)
    else:  # du is y's cotangent: RMSNorm's backward pass from the forward's inv, then dH_pre, in one kernel on TPU
        u, gain, inv = norm
        du, dh_pre, dgain = _on_shards(
            kernels, functools.partial(_norm_dh_pre, blocks=blocks, interpret=interpret, kernels=kernels),
            (STREAMS, TOKENS, TOKENS, ("tokens", "norm"), ("norm",)), (TOKENS, ("tokens", "streams"), ("norm",)),
            sums=(None, None, "tokens"))(x, u, du, inv, gain)
    draw, dss, dparams = pullback((dh_pre, dh_post.astype(F32), dh_res.astype(F32)))
    scalars = jnp.concatenate([h_pre, 2.0 * dss[:, None], h_res.reshape(h_res.shape[0], -1)], axis=1)
    mixing = (TOKENS, ("tokens", "streams"), ("tokens", "streams")) if update else ()  # y / dy, H_res, H_post
    dx, dw, *update_grads = _on_shards(
        kernels, functools.partial(_dx, blocks=blocks, interpret=interpret, kernels=kernels),
        (STREAMS, STREAMS, TOKENS, ("tokens", "streams"), ("tokens", "hc_coeffs"), ("streams", "hc_coeffs", "features"),
         *((STREAMS, *mixing) if update else ())), (STREAMS, ("streams", "features", "hc_coeffs"), *mixing),
        sums=(None, "tokens", *(None,) * len(mixing)))(x, g.astype(x.dtype), du, scalars, draw,
                                                       jnp.swapaxes(w, 1, 2), *update)
    return dx, dw, dparams, dgain, *update_grads


_collapse.defvjp(_collapse_fwd, _collapse_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 9, 10, 11, 12))
def _update_collapse(coefficients, pre, x, y, res, post, w, params, gain, eps, blocks, interpret, kernels):
    return _forward(coefficients, pre, x, w, params, gain, eps, blocks, interpret, kernels, update=(y, res, post))[0]


def _update_collapse_fwd(coefficients, pre, x, y, res, post, w, params, gain, eps, blocks, interpret, kernels):
    """The collapse's residuals for the updated X, and the update's (X, y, H_res, H_post)."""
    out, collapsed = _collapse_fwd(coefficients, pre, x, w, params, gain, eps, blocks, interpret, kernels,
                                   update=(y, res, post))
    return out, (collapsed, (x, y, res, post))


def _update_collapse_bwd(coefficients, pre, eps, blocks, interpret, kernels, residuals, cotangents):
    """The collapse's backward rule for the updated X, then the update's deferred one (stream_mix's ``defer``), in
    one kernel on TPU (:func:`_dx` with the update): the updated X's cotangent goes back as X's, for the collapse
    that made X to apply H_resᵀ."""
    collapsed, update = residuals
    dx, dw, dparams, dgain, dy, dres, dpost = _collapse_bwd(coefficients, pre, eps, blocks, interpret, kernels,
                                                            collapsed, cotangents, update)
    return dx, dy, dres, dpost, dw, dparams, dgain


_update_collapse.defvjp(_update_collapse_fwd, _update_collapse_bwd)


def collapse_streams(coefficients: Coefficients, pre: PreWeights, x: jax.Array, w: jax.Array, params, *,
                     norm_weight: jax.Array | None = None, norm_eps: float = 1e-6,
                     blocks: tuple[int, int] | None = None, interpret: bool = False, kernels: bool = True,
                     update: tuple[jax.Array, jax.Array, jax.Array] | None = None
                     ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(X, u, H_post, H_res) of the module docstring, with the Pallas backward kernels on each device's token
    shard (:func:`nash_mhc.sharding.per_shard`). With ``norm_weight`` [D] (float32) the second output is the
    sublayer's normalised input y = RMSNorm(u) (:func:`nash_mhc.ops.rms_norm.rms_norm`, ``norm_eps``) instead of u:
    the collapse kernel normalises each tile of u where it writes it (y and the statistic written beside u, which
    the backward pass keeps, running the norm's backward inside the dH_pre kernel), so XLA's passes over u for the
    norm's statistic, output and backward are not made.

    ``x`` [n, T, D] (any float dtype), ``w`` [n, D, C] float32, ``params`` a pytree of arrays that
    ``coefficients(raw [T, C], ss [T], params)`` reads (it returns H_pre [T, n], H_post [T, n], H_res [T, n, n]);
    ``coefficients`` must be a hashable function of those arguments only, and ``pre`` (hashable too) must compute
    its H_pre (the forward kernel's; the XLA form, ``kernels=False``, takes H_pre from ``coefficients``).
    ``blocks``: (token tile, column tile) of the backward kernels, the forward kernel taking the token tile with
    whole rows; by default :func:`nash_mhc.kernels.tpu.stream_mix_kernel.mix_blocks` of each shard's (T, D)
    backward and the largest token tile within ``stream_collapse_kernels.ROW_TILE_BYTES`` forward, and the XLA
    slab forms where none divides. ValueError when given tiles do not divide (T, D).

    ``update`` = (y [T, D], H_res [T, n, n], H_post [T, n]): the previous sublayer's output and coefficients, for
    ``x`` the pass-through X of that sublayer's collapse. The streams are first updated, X' = H_res X + H_post (x)
    y (float32, rounded once to X's dtype: :func:`nash_mhc.ops.stream_mix.stream_mix`'s update), and collapsed;
    the pass-through output is X'. On TPU the collapse kernel makes the update and writes X' on its way, so X' is
    not read back from HBM (one pass over the streams less per pair of sublayers). The backward rule is the
    collapse's for X', then the update's deferred one (``stream_mix(defer=True)``): X''s cotangent goes back as
    X's, for the previous collapse to apply H_resᵀ."""
    n, tokens, dim = x.shape
    if blocks is not None and (tokens % blocks[0] or blocks[0] % 8 or dim % blocks[1]):
        raise ValueError(f"collapse_streams needs tiles that divide (tokens, dim) = ({tokens}, {dim}) with a token "
                         f"tile that is a multiple of 8, got {blocks}")
    if update is None:
        return _collapse(coefficients, pre, x, w, params, norm_weight, norm_eps, blocks, interpret, kernels)
    y, h_res, h_post = update
    return _update_collapse(coefficients, pre, x, y, h_res.astype(F32).reshape(tokens, n * n), h_post.astype(F32),
                            w, params, norm_weight, norm_eps, blocks, interpret, kernels)


# ------------------------------------------------------------------------------- one connection's collapse
def connection_collapse(coefficients: Coefficients, pre: PreWeights, xs: jax.Array, w: jax.Array, params, *,
                        norm: tuple[jax.Array, float] | None = None,
                        update: tuple[jax.Array, jax.Array, jax.Array] | None = None
                        ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """:func:`collapse_streams` of one hyper-connection (:mod:`nash_mhc.layers.hyperconnection`), chosen for the
    step's platform (``dispatch.platform_dependent``, named ``collapse_streams``): lowered for TPU its Pallas
    kernels on each device's token shard; elsewhere, and where no token tile divides T, its XLA form
    (``kernels=False``). ``norm`` = (gain [D], eps) of the sublayer's RMSNorm, applied to u inside the collapse.
    ``update`` = (y, H_res, H_post) of the previous sublayer: made inside the collapse's kernel on TPU, else first
    by :func:`nash_mhc.ops.stream_mix.stream_mix`'s XLA form with ``defer=True``, then the collapse."""
    gain = () if norm is None else (norm[0],)
    operands = (xs, *(update or ()), w, params, *gain)
    collapse = functools.partial(_connection_collapse, coefficients, pre, None if norm is None else norm[1],
                                 update is not None)
    if mix_blocks(xs.shape[1], xs.shape[2]) is None:
        return collapse(*operands, kernels=False)
    return platform_dependent(*operands, tpu=collapse, default=functools.partial(collapse, kernels=False),
                              name="collapse_streams")


def _connection_collapse(coefficients: Coefficients, pre: PreWeights, eps: float | None, update: bool, xs: jax.Array,
                         *operands: jax.Array | tuple, kernels: bool = True) -> tuple[jax.Array, ...]:
    """:func:`collapse_streams` of the connection's operands (xs, [y, H_res, H_post,] w, params[, gain]),
    normalising u with ``gain`` [D] and ``eps`` when a gain is given. With ``update``, the previous sublayer's
    update of xs first: inside the collapse's kernel with ``kernels``, else by stream_mix's XLA form."""
    mixing, (w, params, *gain) = (operands[:3], operands[3:]) if update else ((), operands)
    norm = {"norm_weight": gain[0], "norm_eps": eps} if gain else {}
    if update and not kernels:
        xs, mixing = stream_mix(xs, *mixing, kernels=False, defer=True), ()
    return collapse_streams(coefficients, pre, xs, w, params, kernels=kernels, update=mixing or None, **norm)


def updates_in_collapse(tokens: int, dim: int) -> bool:
    """Whether :func:`connection_collapse` on streams [n, tokens, dim] makes a previous sublayer's update inside
    the collapse kernel: where the step takes the TPU kernels (:func:`nash_mhc.ops.dispatch.tpu_kernels`) and the
    kernels' token tiles (:func:`nash_mhc.kernels.tpu.stream_mix_kernel.mix_blocks`) divide the tokens."""
    return tpu_kernels() and mix_blocks(tokens, dim) is not None
