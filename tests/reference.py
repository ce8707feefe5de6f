"""Float64 NumPy reference of the Nash-MHC model, written from the equations of docs/design.md (§1-§4) and the
docstrings.

Independent of the JAX code on purpose: nothing here imports ``nash_mhc``, so a mistake there cannot hide in a
helper both sides share. Every function takes plain arrays (any float dtype, converted to float64), returns
float64 arrays, and favours the most literal form of its equation (explicit loops over blocks and positions)
over speed. Shapes use the letters of nash_mhc/config.py: T tokens, D width, n streams, H heads, K head dim,
s block size.

Sections, bottom up; a new piece goes into the section it belongs to and reuses only what sits above it:

1. primitives: logsumexp, softmax, sigmoid, silu
2. ops: rms_norm, rope, attention / causal_attention, sinkhorn, downsample, upsample_shifted
3. residual connections: ``connection`` (u = Σ_k H_pre[k] X[k], y = F(u), X ← H_res X + H_post ⊗ y) is shared
   by every mode; a mode only supplies its coefficients (``mhc_coefficients``, ``mhc_lite_coefficients``). The
   published HC coefficients go next to them.
4. layers: swiglu, the scale aggregations (Nash, gate, convex), multiscale attention, one whole block.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np

Array = np.ndarray


def f64(x: object) -> Array:
    return np.asarray(x, dtype=np.float64)


# ------------------------------------------------------------------------------------------ 1. primitives
def logsumexp(x: Array, axis: int) -> Array:
    x = f64(x)
    peak = np.max(x, axis=axis, keepdims=True)
    return np.squeeze(peak, axis) + np.log(np.sum(np.exp(x - peak), axis=axis))


def softmax(x: Array, axis: int = -1) -> Array:
    x = f64(x)
    return np.exp(x - np.expand_dims(logsumexp(x, axis), axis))


def sigmoid(x: Array) -> Array:
    return 1.0 / (1.0 + np.exp(-f64(x)))


def silu(x: Array) -> Array:
    return f64(x) * sigmoid(x)


# ------------------------------------------------------------------------------------------------ 2. ops
def rms_norm(x: Array, weight: Array, eps: float) -> Array:
    """x / sqrt(mean(x²) + eps) · weight over the last axis."""
    x = f64(x)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * f64(weight)


def rope(x: Array, positions: Array, spacing: int = 1, theta: float = 10000.0) -> Array:
    """Rotate-half RoPE of x [..., T, H, K], token j at position positions[j]·spacing.

    Pairs (x[i], x[i + K/2]) rotate by the angle position · θ^(−i/(K/2)), i = 0..K/2−1.
    """
    x = f64(x)
    half = x.shape[-1] // 2
    out = np.empty_like(x)
    for j, p in enumerate(np.asarray(positions)):
        for i in range(half):
            angle = float(p) * spacing * theta ** (-i / half)
            a, b = x[..., j, :, i], x[..., j, :, i + half]
            out[..., j, :, i] = a * np.cos(angle) - b * np.sin(angle)
            out[..., j, :, i + half] = a * np.sin(angle) + b * np.cos(angle)
    return out


def attention(q: Array, k: Array, v: Array, mask: Array) -> Array:
    """softmax(q kᵀ / √K) v per head over the keys allowed by mask [Tq, Tk]; q [Tq, H, K], k, v [Tk, H, K]."""
    q, k, v = f64(q), f64(k), f64(v)
    scores = np.einsum("qhk,shk->hqs", q, k) / np.sqrt(q.shape[-1])
    scores = np.where(np.asarray(mask, bool)[None], scores, -np.inf)
    return np.einsum("hqs,shk->qhk", softmax(scores, axis=-1), v)


def causal_attention(q: Array, k: Array, v: Array) -> Array:
    """attention with query i seeing keys j ≤ i."""
    seq = q.shape[0]
    return attention(q, k, v, np.tril(np.ones((seq, seq), bool)))


def sinkhorn(logits: Array, num_iters: int) -> Array:
    """exp(z) after ``num_iters`` rounds of (columns sum to 1, then rows sum to 1), in log space; [..., n, n]."""
    z = f64(logits)
    for _ in range(num_iters):
        z = z - np.expand_dims(logsumexp(z, axis=-2), -2)  # columns
        z = z - np.expand_dims(logsumexp(z, axis=-1), -1)  # rows
    return np.exp(z)


def renormalise(x: Array, eps: float) -> Array:
    """x / sqrt(mean(x²) + eps) over the last axis, no gain (pooled coarse tokens)."""
    x = f64(x)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def downsample(x: Array, weights: Array) -> Array:
    """Coarse token j = Σ_o weights[o] ⊙ x[j·s + o] over the fine tokens of block j that exist; x [T, D]."""
    x, weights = f64(x), f64(weights)
    seq, block = x.shape[0], weights.shape[0]
    blocks = -(-seq // block)
    out = np.zeros((blocks, x.shape[1]))
    for j in range(blocks):
        for o in range(block):
            if j * block + o < seq:
                out[j] += weights[o] * x[j * block + o]
    return out


def upsample_shifted(y: Array, seq_len: int, block: int) -> tuple[Array, Array]:
    """Fine position i reads coarse y[⌊(i+1)/s⌋ − 1]; where that index is < 0: zeros and available False."""
    y = f64(y)
    out = np.zeros((seq_len, y.shape[1]))
    available = np.zeros(seq_len, bool)
    for i in range(seq_len):
        j = (i + 1) // block - 1
        if j >= 0:
            out[i] = y[j]
            available[i] = True
    return out, available


# ------------------------------------------------------------------------------- 3. residual connections
Coefficients = tuple[Array, Array, Array]  # H_pre [T, n], H_post [T, n], H_res [T, n, n]
Sublayer = Callable[[Array], Array]  # [T, D] -> [T, D]


def connection(x: Array, coefficients: Coefficients, sublayer: Sublayer) -> Array:
    """X [T, n, D] ← H_res X + H_post ⊗ F(Σ_k H_pre[k] X[k]), per token."""
    x = f64(x)
    h_pre, h_post, h_res = (f64(h) for h in coefficients)
    u = np.einsum("tk,tkd->td", h_pre, x)
    y = f64(sublayer(u))
    return np.einsum("tij,tjd->tid", h_res, x) + h_post[:, :, None] * y[:, None, :]


def mhc_coefficients(x: Array, norm_weight: Array, phi: Array, alpha: Array, b_pre: Array, b_post: Array,
                     b_res: Array, *, eps: float, sinkhorn_iters: int) -> Coefficients:
    """mHC: x' = RMSNorm(flatten X) over all n·D values, [a_pre | a_post | a_res] = x' Φ,
    H_pre = σ(α₀ a_pre + b_pre), H_post = 2σ(α₁ a_post + b_post), H_res = Sinkhorn(α₂ a_res + b_res)."""
    x = f64(x)
    seq, n, dim = x.shape
    a = rms_norm(x.reshape(seq, n * dim), norm_weight, eps) @ f64(phi)
    a_pre, a_post, a_res = a[:, :n], a[:, n:2 * n], a[:, 2 * n:].reshape(seq, n, n)
    alpha = f64(alpha)
    h_pre = sigmoid(alpha[0] * a_pre + f64(b_pre))
    h_post = 2.0 * sigmoid(alpha[1] * a_post + f64(b_post))
    h_res = sinkhorn(alpha[2] * a_res + f64(b_res), sinkhorn_iters)
    return h_pre, h_post, h_res


def mhc_lite_coefficients(x: Array, norm_weight: Array, phi: Array, alpha: Array, b_pre: Array, b_post: Array,
                          b_perm: Array, *, eps: float) -> Coefficients:
    """mHC-lite (arXiv 2601.05732): as mHC, but [a_pre | a_post | a_perm] = x' Φ with one column per permutation of
    the n streams, and H_res = Σ_k softmax(α₂ a_perm + b_perm)_k P_k over the n! permutation matrices P_k
    (P_k[i, j] = 1 iff j = π_k(i), permutations in lexicographic order, the identity first)."""
    x = f64(x)
    seq, n, dim = x.shape
    a = rms_norm(x.reshape(seq, n * dim), norm_weight, eps) @ f64(phi)
    alpha = f64(alpha)
    h_pre = sigmoid(alpha[0] * a[:, :n] + f64(b_pre))
    h_post = 2.0 * sigmoid(alpha[1] * a[:, n:2 * n] + f64(b_post))
    mix = softmax(alpha[2] * a[:, 2 * n:] + f64(b_perm), axis=-1)
    h_res = np.zeros((seq, n, n))
    for k, perm in enumerate(itertools.permutations(range(n))):
        matrix = np.zeros((n, n))
        for i, j in enumerate(perm):
            matrix[i, j] = 1.0
        h_res += mix[:, k, None, None] * matrix
    return h_pre, h_post, h_res


# --------------------------------------------------------------------------------------------- 4. layers
def swiglu(x: Array, w_gate: Array, w_up: Array, w_down: Array) -> Array:
    """(silu(x W_gate) ⊙ (x W_up)) W_down."""
    x = f64(x)
    return (silu(x @ f64(w_gate)) * (x @ f64(w_up))) @ f64(w_down)


NASH_FLOOR = 1.05  # c of the effective temperature τ + c·λmax(C) (nash_mhc.ops.aggregation docstring)


def nash_game(outputs: Array, available: Array, prior: Array, tau: float
              ) -> tuple[Callable[[Array], Array], Array, Array, float]:
    """For one position: (best response, start point softmax(prior), indices of the available scales, τ_eff).

    Consensus O* = Σ w_l O_l, error e_l = |O_l − O*|² / (D S), S = mean_l |O_l|² / D, effective temperature
    τ + 1.05·λmax(C) with C the Gram matrix of the centred outputs over D S; BR(w) = softmax(b − e(w) / τ_eff).
    """
    idx = np.flatnonzero(available)
    o = f64(outputs)[idx]
    dim = o.shape[-1]
    scale = np.mean(np.sum(o * o, axis=-1)) / dim
    centred = o - o.mean(axis=0)
    c = centred @ centred.T / (dim * scale) if scale > 0 else np.zeros((len(idx), len(idx)))
    tau_eff = tau + NASH_FLOOR * np.linalg.eigvalsh(c)[-1]
    b = f64(prior)[idx]

    def best_response(w: Array) -> Array:
        err = np.sum((o - w @ o) ** 2, axis=-1) / (dim * scale) if scale > 0 else np.zeros(len(idx))
        return softmax(b - err / tau_eff)

    return best_response, softmax(b), idx, tau_eff


def nash(outputs: Array, available: Array, prior: Array, tau: float) -> tuple[Array, Array]:
    """Equilibrium weights [T, L] (best responses from softmax(prior) until they move by < 1e-15, the contraction
    factor being < 1/1.05) and residuals max|BR(w) − w| [T]; outputs [T, L, D], available [T, L]."""
    seq, scales, _ = outputs.shape
    weights, residual = np.zeros((seq, scales)), np.zeros(seq)
    for t in range(seq):
        br, w, idx, _ = nash_game(outputs[t], available[t], prior, tau)
        for _ in range(100_000):
            new = br(w)
            if np.abs(new - w).max() < 1e-15:
                break
            w = new
        weights[t, idx] = w
        residual[t] = np.abs(br(w) - w).max()
    return weights, residual


def gate(outputs: Array, available: Array, prior: Array, gate_weights: Array) -> Array:
    """Gate weights [T, L]: softmax over the available scales of b_l + Σ_m <W_lm, O_m> / sqrt(D S), S = mean over the
    available scales of |O_m|² / D; outputs [T, L, D], W [L, L, D]."""
    seq, scales, dim = outputs.shape
    weights = np.zeros((seq, scales))
    for t in range(seq):
        idx = np.flatnonzero(available[t])
        o = f64(outputs[t])[idx]
        scale = np.mean(np.sum(o * o, axis=-1)) / dim
        o = o / np.sqrt(scale) if scale > 0 else o
        logits = [f64(prior)[scale_l] + sum(f64(gate_weights)[scale_l, m] @ o[i] for i, m in enumerate(idx))
                  / np.sqrt(dim) for scale_l in idx]
        weights[t, idx] = softmax(np.asarray(logits))
    return weights


def convex(available: Array, prior: Array) -> Array:
    """Convex weights [T, L]: softmax(b) over the available scales of each position."""
    weights = np.zeros(np.shape(available))
    for t, row in enumerate(np.asarray(available)):
        idx = np.flatnonzero(row)
        weights[t, idx] = softmax(f64(prior)[idx])
    return weights


def multiscale_attention(x: Array, wq: Array, wk: Array, wv: Array, wo: Array, down: list[Array],
                         block_sizes: tuple[int, ...], aggregate: Callable[[Array, Array], Array], *, eps: float,
                         theta: float) -> tuple[Array, Array]:
    """(y [T, D], weights [T, L]): causal multiscale attention on x [T, D], the scales combined by the weights
    ``aggregate(outputs [T, L, D], available [T, L])`` returns (e.g. ``lambda o, a: nash(o, a, prior, tau)[0]``).

    Scale 0: causal attention of RoPE'd x W_q[0], x W_k[0] and V = x W_v. Scale l ≥ 1 (block s_l):
    x_l = renormalise(downsample(x, down[l−1])), V_l = downsample(V, down[l−1]), queries/keys x_l W_{q,k}[l]
    RoPE'd at coarse positions with spacing s_l, causal over coarse indices, upsampled shifted. The available
    outputs are combined with the aggregation weights, then y = (Σ_l w_l O_l) W_o.
    """
    x = f64(x)
    seq, dim = x.shape
    heads, head_dim = f64(wv).shape[1:]
    v = np.einsum("td,dhk->thk", x, f64(wv))
    outputs, available = [], []
    for level, block in enumerate(block_sizes):
        x_l = x if level == 0 else renormalise(downsample(x, down[level - 1]), eps)
        v_l = v if level == 0 else downsample(v.reshape(seq, dim), down[level - 1]).reshape(-1, heads, head_dim)
        positions = np.arange(x_l.shape[0])
        q = rope(np.einsum("td,dhk->thk", x_l, f64(wq[level])), positions, block, theta)
        k = rope(np.einsum("td,dhk->thk", x_l, f64(wk[level])), positions, block, theta)
        o = causal_attention(q, k, v_l).reshape(-1, dim)
        up, avail = (o, np.ones(seq, bool)) if level == 0 else upsample_shifted(o, seq, block)
        outputs.append(up)
        available.append(avail)
    outputs, available = np.stack(outputs, axis=1), np.stack(available, axis=1)
    weights = aggregate(outputs, available)
    combined = np.einsum("tl,tld->td", weights, outputs).reshape(seq, heads, head_dim)
    return np.einsum("thk,hkd->td", combined, f64(wo)), weights


def block(x: Array, attn_coefficients: Callable[[Array], Coefficients],
          ffn_coefficients: Callable[[Array], Coefficients], attn_norm: Array,
          ffn_norm: Array, attention: Sublayer, ffn: Sublayer, eps: float) -> Array:
    """One block on X [T, n, D]: X ← connection(X, attention ∘ RMSNorm), then connection(X, FFN ∘ RMSNorm).

    The coefficients of the second connection depend on X after the first, so they are passed as functions
    of X: ``attn_coefficients(X)``, ``ffn_coefficients(X)``.
    """
    x = connection(x, attn_coefficients(x), lambda u: attention(rms_norm(u, attn_norm, eps)))
    return connection(x, ffn_coefficients(x), lambda u: ffn(rms_norm(u, ffn_norm, eps)))
