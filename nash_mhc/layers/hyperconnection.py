"""Hyper-connection residual around one sublayer: mHC (manifold-constrained), HC, or plain.

Residual state X: [T, n, D] (T tokens, n streams, D model width). For one sublayer F (attention or FFN,
including its pre-norm), per token:

    x' = RMSNorm(flatten(X))                       one statistic over all n·D values
    [a_pre | a_post | a_res] = x' Φ                one fused Φ: [n·D, 2n + n²]
    mhc: H_pre = σ(α_pre a_pre + b_pre)   H_post = 2σ(α_post a_post + b_post)
         H_res = Sinkhorn(α_res a_res + b_res)      (doubly stochastic, n×n)
    hc:  H_pre = α_pre tanh(a_pre) + b_pre   H_post = α_post tanh(a_post) + b_post
         H_res = α_res tanh(a_res) + b_res          (unconstrained, as in Hyper-Connections)
    u = Σ_k H_pre[k] X[k];   y = F(u);   X ← H_res X + H_post ⊗ y

All coefficient math is float32; α are learnable scalars initialised to 0.01.

Initialisation (step 0 behaves like a pre-norm residual transformer): the streams start as n copies of the
embedding, b_pre = logit(1/n) (mhc) or 1/n (hc) so u is the mean stream, b_post = 0 (mhc: H_post = 2σ(0) = 1)
or 1 (hc), and b_res = τ·I (mhc, τ = ``hc_identity_logit``, diag(H_res) ≈ 0.95 for τ = 4, n = 4) or I (hc).
Row-stochastic H_res maps identical streams to themselves, so every stream receives the same update y.

With n = 1 (``residual="plain"``, or "mhc"/"hc" with one stream) the module is the plain pre-norm residual
X ← X + F(X): a 1×1 doubly-stochastic matrix is exactly 1 and the scalar pre-gate is cancelled by the
sublayer's RMSNorm, so the one-stream case carries no coefficient parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from beartype import beartype
from jaxtyping import Array, Float, jaxtyped

from nash_mhc.layers.norm import RMSNorm
from nash_mhc.ops.sinkhorn import sinkhorn

ALPHA_INIT = 0.01

Sublayer = Callable[[Float[Array, "seq dim"]], Float[Array, "seq dim"]]


class HyperConnection(eqx.Module):
    """Residual connection of one sublayer over n streams (see module docstring)."""

    norm: RMSNorm | None
    phi: Float[Array, "nd coeffs"] | None
    alpha: Float[Array, "3"] | None
    b_pre: Float[Array, "n"] | None
    b_post: Float[Array, "n"] | None
    b_res: Float[Array, "n n"] | None
    mode: str = eqx.field(static=True)
    num_streams: int = eqx.field(static=True)
    sinkhorn_iters: int = eqx.field(static=True)

    def __init__(self, mode: str, num_streams: int, dim: int, *, sinkhorn_iters: int = 20,
                 identity_logit: float = 4.0, eps: float = 1e-6, key: jax.Array):
        n = num_streams
        self.mode = "plain" if n == 1 else mode
        self.num_streams = n
        self.sinkhorn_iters = sinkhorn_iters
        if self.mode == "plain":
            self.norm = self.phi = self.alpha = self.b_pre = self.b_post = self.b_res = None
            return
        self.norm = RMSNorm(n * dim, eps)
        self.phi = jax.random.normal(key, (n * dim, 2 * n + n * n), jnp.float32) / math.sqrt(n * dim)
        self.alpha = jnp.full((3,), ALPHA_INIT, jnp.float32)
        eye = jnp.eye(n, dtype=jnp.float32)
        if self.mode == "mhc":
            self.b_pre = jnp.full((n,), -math.log(n - 1), jnp.float32)  # σ(b_pre) = 1/n
            self.b_post = jnp.zeros((n,), jnp.float32)  # H_post = 2σ(0) = 1
            self.b_res = identity_logit * eye
        else:
            self.b_pre = jnp.full((n,), 1.0 / n, jnp.float32)
            self.b_post = jnp.ones((n,), jnp.float32)
            self.b_res = eye

    @jaxtyped(typechecker=beartype)
    def coefficients(self, x: Float[Array, "seq n dim"]) -> tuple[
            Float[Array, "seq n"], Float[Array, "seq n"], Float[Array, "seq n n"]]:
        """(H_pre, H_post, H_res) for every token, float32."""
        assert self.norm is not None and self.phi is not None and self.alpha is not None
        seq, n, dim = x.shape
        xf = x.astype(jnp.float32)
        # RMSNorm(flatten(X)) Φ = rsqrt(mean(X²) + eps) · (X (g ⊙ Φ)): the per-token scale is applied to the
        # [T, 2n+n²] projection, not to the [T, n·D] streams, and X is contracted in its own [T, n, D] shape,
        # so the backward pass keeps X itself and no normalised or reshaped copy of it.
        inv_rms = jax.lax.rsqrt(jnp.mean(xf * xf, axis=(1, 2)) + self.norm.eps)
        weighted_phi = (self.norm.weight[:, None] * self.phi).reshape(n, dim, -1)
        a = jnp.einsum("tnd,ndc->tc", xf, weighted_phi) * inv_rms[:, None]
        a_pre, a_post, a_res = a[:, :n], a[:, n:2 * n], a[:, 2 * n:].reshape(seq, n, n)
        if self.mode == "mhc":
            h_pre = jax.nn.sigmoid(self.alpha[0] * a_pre + self.b_pre)
            h_post = 2.0 * jax.nn.sigmoid(self.alpha[1] * a_post + self.b_post)
            h_res = sinkhorn(self.alpha[2] * a_res + self.b_res, self.sinkhorn_iters)
        else:
            h_pre = self.alpha[0] * jnp.tanh(a_pre) + self.b_pre
            h_post = self.alpha[1] * jnp.tanh(a_post) + self.b_post
            h_res = self.alpha[2] * jnp.tanh(a_res) + self.b_res
        return h_pre, h_post, h_res

    @jaxtyped(typechecker=beartype)
    def __call__(self, x: Float[Array, "seq n dim"], sublayer: Sublayer
                 ) -> tuple[Float[Array, "seq n dim"], Float[Array, "seq n n"]]:
        """Apply ``sublayer`` through the connection. Returns (new X, H_res); H_res = 1 for one stream."""
        seq, n, _ = x.shape
        if self.mode == "plain":
            y = sublayer(x[:, 0])
            return x + y.astype(x.dtype)[:, None, :], jnp.ones((seq, 1, 1), jnp.float32)
        h_pre, h_post, h_res = self.coefficients(x)
        u = jnp.einsum("tn,tnd->td", h_pre, x.astype(jnp.float32)).astype(x.dtype)
        y = sublayer(u).astype(jnp.float32)
        mixed = jnp.einsum("tij,tjd->tid", h_res, x.astype(jnp.float32))
        out = mixed + h_post[:, :, None] * y[:, None, :]
        return out.astype(x.dtype), h_res
