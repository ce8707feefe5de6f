"""Residual connection of one sublayer over n streams: mHC (manifold-constrained), mHC-lite (exactly doubly
stochastic), HC (as published), or plain.

Residual state X: [T, n, D] (T tokens, n streams, D model width). For one sublayer F (attention or FFN,
including its own pre-norm), per token, both connections compute (H_pre [n], H_post [n], H_res [n, n]) and

    u = sum_k H_pre[k] X[k];   y = F(u);   X <- H_res X + H_post (x) y

mhc (Xie et al., arXiv 2512.24880), from one statistic over all n*D values:
    x' = RMSNorm(flatten(X))                   [a_pre | a_post | a_res] = x' Phi,  Phi: [n*D, 2n + n^2]
    H_pre = sigma(alpha_pre a_pre + b_pre)    H_post = 2 sigma(alpha_post a_post + b_post)
    H_res = Sinkhorn(alpha_res reshape(a_res, n x n) + b_res)          (doubly stochastic)
  Init: b_pre = logit(1/n) (u is the mean stream), b_post = 0 (H_post = 1), b_res = tau I (tau =
  ``hc_identity_logit``; diag(H_res) ~ 0.95 for tau = 4, n = 4), alpha = 0.01, Phi ~ N(0, 1/(n D)).

mhc-lite (Yang & Gao, arXiv 2601.05732): as mhc, but H_res an exact convex combination of the n! permutation
matrices P_k (doubly stochastic by construction, no Sinkhorn):
    [a_pre | a_post | a_perm] = x' Phi,  Phi: [n*D, 2n + n!]
    H_res = sum_k softmax(alpha_res a_perm + b_perm)_k P_k          (P_0 = I, then itertools order)
  Init as the paper's code: b_perm = 0 for the identity and -8 for every other permutation (H_res = 0.9923 I +
  0.0077 x the average of the others: diag ~ 0.994); b_pre, b_post, alpha and Phi as mhc.

hc: dynamic Hyper-Connections (Zhu et al., arXiv 2409.19606, as restated in the mHC paper's eq. 5), from each
stream normalised on its own:
    x~_i = RMSNorm(X[i])                        [c_pre | c_post | c_res] = x~_i Theta,  Theta: [D, 2 + n]
    H_pre[i] = alpha_pre tanh(c_pre_i) + b_pre[i]        H_post[i] = alpha_post tanh(c_post_i) + b_post[i]
    H_res[j, i] = alpha_res tanh(c_res_i[j]) + b_res[j, i]               (unconstrained)
  i.e. stream i's own normalised state sets its input weight, its output weight and column i of H_res
  (the paper's A_m[i], B[i], A_r[i, :]). Init as published: dynamic weights Theta = 0, alpha = 0.01, static
  b_pre = one-hot(k mod n) for the k-th sublayer of the network (attention of layer l is k = 2l, its FFN
  k = 2l + 1), b_post = 1, b_res = I: the network starts as a pre-norm residual transformer.

All coefficient math is float32; the alpha are learnable scalars. Row-stochastic H_res (mhc), or the identity
(hc at init), maps identical streams to themselves, so every stream receives the same update y at step 0.

With n = 1 (``residual="plain"``, or mhc/hc with one stream) the module is the plain pre-norm residual
X <- X + F(X) and carries no coefficient parameters (a 1x1 doubly-stochastic matrix is exactly 1; HC's
one-stream scalars are dropped).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from beartype import beartype
from einops import rearrange
from jaxtyping import Array, Float, Int, jaxtyped

from nash_mhc.layers.norm import RMSNorm
from nash_mhc.ops.sinkhorn import sinkhorn
from nash_mhc.ops.stream_collapse import PreWeights, connection_collapse, updates_in_collapse
from nash_mhc.ops.stream_mix import mix_streams
from nash_mhc.ops.stream_slabs import stream_stats, weighted_sum
from nash_mhc.params import param

ALPHA_INIT = 0.01
MHC_MODES = ("mhc", "mhc-lite")  # the connections whose collapse is collapse_streams (and can take an update)
LITE_OTHER_LOGIT = -8.0  # mhc-lite: b_perm of every permutation but the identity (which gets 0)


def permutation_matrices(n: int) -> np.ndarray:
    """float32[n!, n, n]: every n x n permutation matrix, P_k[i, j] = 1 iff j = perm_k(i); the identity first."""
    return np.eye(n, dtype=np.float32)[np.asarray(list(itertools.permutations(range(n))))]

Sublayer = Callable[[Float[Array, "seq dim"]], Float[Array, "seq dim"]]


class HyperConnection(eqx.Module):
    """Residual connection of one sublayer over n streams (see module docstring).

    ``sublayer_index`` (the k of HC's one-hot H_pre initialisation) may be a traced integer, so a stack
    of layers can be built under ``vmap``.
    """

    norm: RMSNorm | None
    phi: Float[Array, "rows coeffs"] | None = param("coefficient", "hc_rows", "hc_coeffs", group="hc_projection")
    alpha: Float[Array, "3"] | None = param("coefficient", "hc_alpha", group="hc_alpha")
    b_pre: Float[Array, "n"] | None = param("coefficient", "streams", group="hc_bias")
    b_post: Float[Array, "n"] | None = param("coefficient", "streams", group="hc_bias")
    b_res: Float[Array, "n n"] | None = param("coefficient", "streams", "streams", group="hc_bias")
    b_perm: Float[Array, "perms"] | None = param("coefficient", "permutations", group="hc_bias")
    mode: str = eqx.field(static=True)
    num_streams: int = eqx.field(static=True)
    sinkhorn_iters: int = eqx.field(static=True)

    def __init__(self, mode: str, num_streams: int, dim: int, *, sinkhorn_iters: int = 20,
                 identity_logit: float = 4.0, eps: float = 1e-6, sublayer_index: int | Int[Array, ""] = 0,
                 key: jax.Array):
        n = num_streams
        self.mode = "plain" if n == 1 else mode
        self.num_streams = n
        self.sinkhorn_iters = sinkhorn_iters
        self.b_perm = None
        if self.mode == "plain":
            self.norm = self.phi = self.alpha = self.b_pre = self.b_post = self.b_res = None
            return
        self.alpha = jnp.full((3,), ALPHA_INIT, jnp.float32)
        eye = jnp.eye(n, dtype=jnp.float32)
        if self.mode in MHC_MODES:
            res_columns = n * n if self.mode == "mhc" else math.factorial(n)
            self.norm = RMSNorm(n * dim, eps)
            self.phi = jax.random.normal(key, (n * dim, 2 * n + res_columns), jnp.float32) / math.sqrt(n * dim)
            self.b_pre = jnp.full((n,), -math.log(n - 1), jnp.float32)  # sigma(b_pre) = 1/n
            self.b_post = jnp.zeros((n,), jnp.float32)  # H_post = 2 sigma(0) = 1
            if self.mode == "mhc":
                self.b_res = identity_logit * eye
            else:
                self.b_res = None
                self.b_perm = jnp.full((res_columns,), LITE_OTHER_LOGIT, jnp.float32).at[0].set(0.0)
        else:
            self.norm = RMSNorm(dim, eps)
            self.phi = jnp.zeros((dim, 2 + n), jnp.float32)  # dynamic weights start at 0
            self.b_pre = jax.nn.one_hot(jnp.asarray(sublayer_index) % n, n, dtype=jnp.float32)
            self.b_post = jnp.ones((n,), jnp.float32)
            self.b_res = eye

    @jaxtyped(typechecker=beartype)
    def coefficients(self, x: Float[Array, "seq n dim"]) -> tuple[
            Float[Array, "seq n"], Float[Array, "seq n"], Float[Array, "seq n n"]]:
        """(H_pre, H_post, H_res) for every token, float32."""
        assert self.norm is not None and self.phi is not None and self.alpha is not None
        if self.mode != "hc":
            return self._mhc_coefficients(jnp.swapaxes(x, 0, 1))
        xf = x.astype(jnp.float32)
        c = jnp.einsum("tnd,dc->tnc", self.norm(xf), self.phi)  # per stream: [T, n, 2 + n]
        h_pre = self.alpha[0] * jnp.tanh(c[..., 0]) + self.b_pre
        h_post = self.alpha[1] * jnp.tanh(c[..., 1]) + self.b_post
        h_res = self.alpha[2] * jnp.swapaxes(jnp.tanh(c[..., 2:]), -1, -2) + self.b_res  # [t, j, i]
        return h_pre, h_post, h_res

    def _mhc_coefficients(self, xs: Float[Array, "n seq dim"]) -> tuple[
            Float[Array, "seq n"], Float[Array, "seq n"], Float[Array, "seq n n"]]:
        """mhc / mhc-lite coefficients from the streams-major state (one [T, D] slab per stream).

        RMSNorm(flatten(X)) Φ = rsqrt(mean(X²) + eps) · (X (g ⊙ Φ)): the per-token scale is applied to the
        [T, 2n+n²] projection, not to the [T, n·D] streams, and X is contracted in its own shape, so the
        backward pass keeps X itself and no normalised or reshaped copy of it."""
        raw, ss = stream_stats([a.astype(jnp.float32) for a in xs], self._weighted_phi())
        return self._coefficient_function()(raw, ss, self._coefficient_params())

    def _weighted_phi(self) -> Float[Array, "n dim coeffs"]:
        """g ⊙ Φ per stream, [n, D, C]: the projection of the streams' slabs before the per-token norm."""
        assert self.norm is not None and self.phi is not None
        return rearrange(self.norm.weight[:, None] * self.phi, "(n d) c -> n d c", n=self.num_streams)

    def _coefficient_params(self) -> tuple[jax.Array, ...]:
        """The parameters the coefficient function reads: (alpha, b_pre, b_post, b_res or b_perm)."""
        return self.alpha, self.b_pre, self.b_post, self.b_res if self.mode == "mhc" else self.b_perm

    def _coefficient_function(self) -> Callable[..., tuple[jax.Array, jax.Array, jax.Array]]:
        """(raw projection [T, C], sum of squares [T], :meth:`_coefficient_params`) → (H_pre, H_post, H_res)."""
        assert self.norm is not None and self.phi is not None
        return functools.partial(_mhc_coefficients, self.mode, self.num_streams, self.phi.shape[0] // self.num_streams,
                                 self.norm.eps, self.sinkhorn_iters)

    @jaxtyped(typechecker=beartype)
    def __call__(self, x: Float[Array, "seq n dim"], sublayer: Sublayer, norm: RMSNorm | None = None
                 ) -> tuple[Float[Array, "seq n dim"], Float[Array, "seq n n"]]:
        """Apply ``sublayer`` through the connection, to ``norm(u)`` when a norm is given (the sublayer's
        pre-norm). Returns (new X, H_res); H_res = 1 for one stream."""
        out, h_res = self.streams_major(jnp.swapaxes(x, 0, 1), sublayer, norm)
        return jnp.swapaxes(out, 0, 1), h_res

    @jaxtyped(typechecker=beartype)
    def streams_major(self, xs: Float[Array, "n seq dim"], sublayer: Sublayer, norm: RMSNorm | None = None
                      ) -> tuple[Float[Array, "n seq dim"], Float[Array, "seq n n"]]:
        """:meth:`__call__` on the streams-major state X [n, T, D] (what the model's layer scan carries).

        Every per-token stream operation is written over the n [T, D] slabs, not as a reduction over a stream
        axis: on TPU the token-major [T, n, D] puts the n streams in one (n, 128) tile, and the compiler's cost
        model charges a reduction over them about 8 x the slab form (docs/results/tpu_estimate/README.md).
        The float32 math is that of the module docstring."""
        n, seq, _ = xs.shape
        normed = (lambda u: u) if norm is None else norm
        if self.mode == "plain":
            y = sublayer(normed(xs[0]))
            return xs + y.astype(xs.dtype)[None], jnp.ones((seq, 1, 1), jnp.float32)
        if self.mode == "hc":
            h_pre, h_post, h_res = self.coefficients(jnp.swapaxes(xs, 0, 1))
            u = weighted_sum([xs[i].astype(jnp.float32) for i in range(n)], h_pre).astype(xs.dtype)
            return mix_streams(xs, sublayer(normed(u)), h_res, h_post), h_res
        # the collapse's pass-through X feeds only the update, whose backward rule leaves H_resᵀ to the collapse's
        xs, u, h_post, h_res = self._mhc_collapse(xs, norm)
        return mix_streams(xs, sublayer(u), h_res, h_post, defer=True), h_res

    def _mhc_collapse(self, xs: Float[Array, "n seq dim"], norm: RMSNorm | None = None,
                      update: tuple[jax.Array, jax.Array, jax.Array] | None = None) -> tuple[
            Float[Array, "n seq dim"], Float[Array, "seq dim"], Float[Array, "seq n"], Float[Array, "seq n n"]]:
        """(X, u = sum_k H_pre[k] X[k], or norm(u) when a norm is given, H_post, H_res) of mhc / mhc-lite:
        :func:`nash_mhc.ops.stream_collapse.collapse_streams` with the norm's gain inside its custom VJP on every
        platform. Lowered for TPU, its Pallas kernels (the raw projection and sum of squares, then u and its norm,
        forward, in one kernel; the stream gradients and dW backward); elsewhere (and where no token tile divides
        T) its XLA form (``kernels=False``: the same functions and backward rule with the kernels' slab forms).

        ``update`` = (y, H_res, H_post) of the previous mhc sublayer, whose collapse's pass-through X ``xs`` is:
        the streams are first updated, X' = H_res X + H_post (x) y, and X' is collapsed and passed through. On TPU
        the collapse kernel makes the update (``collapse_streams(update=...)``); elsewhere the update is
        :func:`mix_streams`' XLA form, then the collapse, as two separate calls."""
        n, dim = self.num_streams, xs.shape[2]
        pre = PreWeights(_pre_operand, functools.partial(_mhc_pre_weights, n, dim, self.norm.eps))
        return connection_collapse(self._coefficient_function(), pre, xs, self._weighted_phi(),
                                   self._coefficient_params(), norm=None if norm is None else (norm.weight, norm.eps),
                                   update=update)


Update = tuple[jax.Array, jax.Array, jax.Array]  # (y [T, D], H_res [T, n, n], H_post [T, n]): a stream update


def identity_update(tokens: int, streams: int, dim: int, dtype: jnp.dtype) -> Update:
    """The update that leaves X as it is (y = 0, H_res = I, H_post = 0: X' = X bit for bit, each stream plus
    exact zeros), for the first :func:`connect_pair` of a stack whose pairs leave their last update unmade."""
    eye = jnp.broadcast_to(jnp.eye(streams, dtype=jnp.float32), (tokens, streams, streams))
    return jnp.zeros((tokens, dim), dtype), eye, jnp.zeros((tokens, streams), jnp.float32)


def leaves_updates(mode: str, tokens: int, dim: int) -> bool:
    """Whether a stack of :func:`connect_pair` calls on [n, tokens, dim] streams leaves each pair's last update to
    the next pair's first collapse: for mhc / mhc-lite where the step takes the collapse kernels
    (:func:`nash_mhc.ops.stream_collapse.updates_in_collapse`), where each update is then made inside the next
    collapse's kernel, whose operand y has the streams' dtype as stream_mix's kernel's has: the same bits.
    Elsewhere each pair makes its own last update: in XLA's forms a y carried across the layer scan is rounded to
    its dtype where one sublayer's program may keep it in float32 (XLA CPU's excess precision), so the bfloat16
    full forward would no longer give cached decoding's numbers (which makes each update within its sublayer)."""
    return mode in MHC_MODES and updates_in_collapse(tokens, dim)


def connect_pair(xs: Float[Array, "n seq dim"], first: tuple[HyperConnection, Sublayer, RMSNorm | None],
                 second: tuple[HyperConnection, Sublayer, RMSNorm | None], update: Update | None = None,
                 leave_update: bool = False) -> tuple:
    """Two sublayers in a row, each (connection, sublayer, its pre-norm): (X, first H_res, second H_res), what
    ``second[0].streams_major(first[0].streams_major(xs, ...)[0], ...)`` gives. When both connections are mhc or
    mhc-lite, the first's stream update is made by the second's collapse (:meth:`HyperConnection._mhc_collapse`
    with ``update``), which on TPU writes the updated streams on its way instead of reading them back.

    Across pairs (mhc / mhc-lite only): ``leave_update`` returns the second's update unmade, (X, (y, H_res,
    H_post), first H_res, second H_res), and the next pair takes it as ``update``, made by its first collapse; X
    is then the pass-through X of the collapse that made the update's coefficients (whose backward rule applies
    H_resᵀ to the cotangent the update hands back), or for the stack's first pair X with :func:`identity_update`
    (H_res = I: the cotangent is X's own). The last update is :func:`mix_streams`' with ``defer=True``."""
    (hc1, sublayer1, norm1), (hc2, sublayer2, norm2) = first, second
    if hc1.mode not in MHC_MODES or hc2.mode not in MHC_MODES:
        if update is not None or leave_update:
            raise ValueError(f"connect_pair: an update left unmade needs mhc or mhc-lite connections, got "
                             f"{hc1.mode} and {hc2.mode}")
        xs, res1 = hc1.streams_major(xs, sublayer1, norm1)
        xs, res2 = hc2.streams_major(xs, sublayer2, norm2)
        return xs, res1, res2
    xs, u, h_post, h_res = hc1._mhc_collapse(xs, norm1, update=update)
    xs, u2, h_post2, h_res2 = hc2._mhc_collapse(xs, norm2, update=(sublayer1(u), h_res, h_post))
    pending = (sublayer2(u2), h_res2, h_post2)
    if leave_update:
        return xs, pending, h_res, h_res2
    return mix_streams(xs, *pending, defer=True), h_res, h_res2


def _mhc_coefficients(mode: str, n: int, dim: int, eps: float, sinkhorn_iters: int, raw: jax.Array, ss: jax.Array,
                      params: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """mhc / mhc-lite (H_pre [T, n], H_post [T, n], H_res [T, n, n]) from the raw projection X (g ⊙ Φ) [T, C] and
    the sum of squares [T] of the n·D values of each token (module docstring)."""
    alpha, b_pre, b_post, b_res = params
    a = raw * jax.lax.rsqrt(ss / (n * dim) + eps)[:, None]
    a_post, a_res = a[:, n:2 * n], a[:, 2 * n:]
    h_pre = _mhc_pre_weights(n, dim, eps, raw, ss[:, None], _pre_operand(params))
    h_post = 2.0 * jax.nn.sigmoid(alpha[1] * a_post + b_post)
    if mode == "mhc-lite":
        mix = jax.nn.softmax(alpha[2] * a_res + b_res, axis=-1)
        return h_pre, h_post, jnp.einsum("tk,kij->tij", mix, jnp.asarray(permutation_matrices(n)))
    return h_pre, h_post, sinkhorn(alpha[2] * rearrange(a_res, "t (i j) -> t i j", i=n) + b_res, sinkhorn_iters)


def _pre_operand(params: tuple[jax.Array, ...]) -> jax.Array:
    """[2, n] float32: alpha_pre in every column, then b_pre (what :func:`_mhc_pre_weights` reads)."""
    alpha, b_pre = params[0], params[1]
    return jnp.stack([jnp.broadcast_to(alpha[0], b_pre.shape), b_pre])


def _mhc_pre_weights(n: int, dim: int, eps: float, raw: jax.Array, ss: jax.Array, operand: jax.Array) -> jax.Array:
    """mhc / mhc-lite H_pre [T, n] = sigma(alpha_pre a_pre + b_pre) from raw [T, C], ss [T, 1] and
    :func:`_pre_operand`: the one definition, in XLA (:func:`_mhc_coefficients`) and inside the TPU collapse
    kernel (per token tile)."""
    a_pre = raw[:, :n] * jax.lax.rsqrt(ss / (n * dim) + eps)
    return jax.nn.sigmoid(operand[0:1] * a_pre + operand[1:2])
