"""Per-position aggregation of the multiscale attention outputs: the scales' Nash (quantal response)
equilibrium, or a convex (prior-only) average.

The game at one position (L scales, a <= L of them available there, outputs O_l in R^D, weights w on the
simplex of the available scales, prior logits b, learned temperature tau > 0):

    consensus    O* = sum_l w_l O_l
    utility      u_l(w) = b_l - e_l(w) / tau_t,   e_l(w) = |O_l - O*|^2 / (D S)
    scale        S = mean over the available l of |O_l|^2 / D       (the outputs' own scale)
    equilibrium  w = BR(w) = softmax over the available scales of u(w)   (logit quantal response)

e is the squared distance to the consensus *relative to the outputs' own scale*: multiplying every O_l by c
leaves e, the weights and their entropy unchanged, so rescaling V and W_o cannot move them. The game depends
on the outputs only through the normalised Gram matrix G_lm = <O_l, O_m> / (D S), since
e_l(w) = G_ll - 2 (G w)_l + w^T G w; the iterations therefore cost O(L^2) per position after one O(L^2 D)
Gram product.

Uniqueness and convergence. On the simplex the Jacobian of BR is (2 / tau_t) Sigma_p C, where
Sigma_p = diag(p) - p p^T (norm <= 1/2) and C is G centred over the available scales (the Gram matrix of the
centred outputs O_l - mean_l O_l, normalised by D S). So BR is a contraction with factor
<= lambda_max(C) / tau_t. The code uses the *effective* temperature tau_t = tau + 2 |C|_F (|C|_F >=
lambda_max(C), smooth, scale-invariant), which makes the factor <= 1/2 at every position for every input:
the equilibrium exists, is unique (it is also the unique maximiser of the strictly concave potential
<b, w> - V(w) / (tau_t D S) + H(w), V(w) = sum_l w_l |O_l|^2 - |O*|^2), and k iterations from the prior
leave a residual max_l |w_k - BR(w_k)|_l <= sqrt(2) 2^-k. The Jacobian's eigenvalues are real and lie in
[0, 1/2] (a product of two positive semi-definite matrices), so the iteration is run undamped: a damping
factor < 1 could only slow it. The learned tau sets how strongly the weights follow the game beyond that
floor; where the scales agree (C ~ 0) the weights fall back to softmax(b).

All of it is smooth (no sqrt at 0: |C|_F = sqrt(sum C^2 + 1e-12); all-zero outputs, S = 0, give G = 0 and the
prior's weights with finite gradients), computed in float32 (or float64 for
float64 inputs), differentiated by unrolling the fixed number of iterations, and per position: weights are
never pooled over the sequence, which would leak the future. Leading axes are batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from beartype import beartype
from jaxtyping import Array, Bool, Float, jaxtyped

SPREAD_EPS = 1e-12  # inside |C|_F's sqrt: keeps its gradient finite when every scale agrees (C = 0)
SCALE_FLOOR = 1e-30  # outputs with mean square below this count as all zero (their game is the prior's)


def _compute_dtype(*arrays: jax.Array) -> jnp.dtype:
    """float32, or float64 when an input is float64 (for float64 gradient checks)."""
    return jnp.result_type(jnp.float32, *(a.dtype for a in arrays))


@jaxtyped(typechecker=beartype)
def masked_softmax(logits: Float[Array, "*batch scales"], available: Bool[Array, "*#batch scales"]
                   ) -> Float[Array, "*batch scales"]:
    """Softmax over the available entries; unavailable entries get exactly 0 (rows with none: all 0)."""
    logits = logits.astype(_compute_dtype(logits))
    logits = jnp.where(available, logits, -jnp.inf)
    peak = jnp.max(logits, axis=-1, keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    unnorm = jnp.where(available, jnp.exp(logits - peak), 0.0)
    total = jnp.sum(unnorm, axis=-1, keepdims=True)
    return unnorm / jnp.where(total > 0, total, 1.0)


@jaxtyped(typechecker=beartype)
def scale_game(outputs: Float[Array, "*batch scales dim"], available: Bool[Array, "*#batch scales"]
               ) -> tuple[Float[Array, "*batch scales scales"], Float[Array, "*batch"]]:
    """(G, |C|_F): the normalised Gram matrix of the available outputs and the spread bound of the game.

    G_lm = <O_l, O_m> / (D S) over available l, m (0 elsewhere), S = mean of |O_l|^2 / D over the available
    scales. C = G centred over the available scales; |C|_F >= lambda_max(C) bounds the best-response
    map's Lipschitz constant (module docstring).
    """
    dtype = _compute_dtype(outputs)
    o = outputs.astype(dtype)
    mask = jnp.broadcast_to(available, o.shape[:-1]).astype(dtype)
    pair = mask[..., :, None] * mask[..., None, :]
    gram = jnp.einsum("...ld,...md->...lm", o, o) / o.shape[-1] * pair
    count = jnp.maximum(jnp.sum(mask, axis=-1), 1.0)
    scale = jnp.sum(jnp.diagonal(gram, axis1=-2, axis2=-1), axis=-1) / count
    # All-zero outputs (S = 0) give G = 0; dividing by 1 there keeps the gradient finite (no 1/tiny).
    gram = gram / jnp.where(scale > SCALE_FLOOR, scale, 1.0)[..., None, None]
    row = jnp.sum(gram, axis=-1) / count[..., None]  # mean over m of G_lm
    total = jnp.sum(row, axis=-1) / count  # mean over l, m
    centred = (gram - row[..., :, None] - row[..., None, :] + total[..., None, None]) * pair
    spread = jnp.sqrt(jnp.sum(jnp.square(centred), axis=(-2, -1)) + SPREAD_EPS)
    return gram, spread


def best_response(weights: jax.Array, gram: jax.Array, prior: jax.Array, temperature: jax.Array,
                  available: jax.Array) -> jax.Array:
    """BR(w) = softmax(prior - e(w) / temperature) over the available scales, e from the Gram matrix.

    weights [..., L], gram [..., L, L], prior [L], temperature [...] (the effective one), available [..., L].
    """
    gw = jnp.einsum("...lm,...m->...l", gram, weights)
    err = jnp.diagonal(gram, axis1=-2, axis2=-1) - 2.0 * gw + jnp.sum(weights * gw, axis=-1, keepdims=True)
    return masked_softmax(prior - err / temperature[..., None], available)


@jaxtyped(typechecker=beartype)
def nash_weights(
    outputs: Float[Array, "*batch scales dim"],
    available: Bool[Array, "*#batch scales"],
    prior: Float[Array, "scales"],
    temperature: Float[Array, ""],
    *,
    num_iters: int,
) -> tuple[Float[Array, "*batch scales"], Float[Array, "*batch"]]:
    """(weights, residual): the scales' quantal-response equilibrium at every position, and how far from it.

    ``temperature`` is the learned tau > 0; the game uses tau + 2 |C|_F (module docstring), so ``num_iters``
    undamped best-response steps from w_0 = softmax(prior) leave a residual max_l |w - BR(w)| <=
    sqrt(2) 2^-num_iters. Unavailable scales get weight exactly 0; a position with one available scale gets
    weight 1 on it and residual 0. Gradients reach the outputs (through G), the prior and the temperature.
    """
    if num_iters < 1:
        raise ValueError(f"nash_weights needs num_iters >= 1, got {num_iters}")
    dtype = _compute_dtype(outputs, prior, temperature)
    gram, spread = scale_game(outputs, available)
    effective = temperature.astype(dtype) + 2.0 * spread
    prior = prior.astype(dtype)
    weights = masked_softmax(jnp.broadcast_to(prior, gram.shape[:-1]), available)

    def step(w: jax.Array, _: None) -> tuple[jax.Array, None]:
        return best_response(w, gram, prior, effective, available), None

    weights, _ = jax.lax.scan(step, weights, None, length=num_iters)
    residual = jnp.max(jnp.abs(best_response(weights, gram, prior, effective, available) - weights), axis=-1)
    return weights, residual


@jaxtyped(typechecker=beartype)
def prior_weights(prior: Float[Array, "scales"], available: Bool[Array, "*batch scales"]
                  ) -> Float[Array, "*batch scales"]:
    """The convex aggregation: softmax of the learned per-scale logits over the available scales."""
    return masked_softmax(jnp.broadcast_to(prior, available.shape), available)


@jaxtyped(typechecker=beartype)
def combine(outputs: Float[Array, "*batch scales dim"], weights: Float[Array, "*batch scales"]
            ) -> Float[Array, "*batch dim"]:
    """sum_l w_l O_l in float32, returned in the outputs' dtype."""
    out = jnp.einsum("...l,...ld->...d", weights, outputs.astype(weights.dtype))
    return out.astype(outputs.dtype)


@jaxtyped(typechecker=beartype)
def normalised_entropy(weights: Float[Array, "*batch scales"], available: Bool[Array, "*#batch scales"]
                       ) -> Float[Array, "*batch"]:
    """Per position H(w) / log(#available) in [0, 1]; 0 where fewer than 2 scales are available.

    The sparsity term: 0 when a position picks one scale, 1 when its weights are uniform. It inherits the
    weights' scale invariance. Positions without a choice are excluded by :func:`choice_mask`.
    """
    count = jnp.sum(jnp.broadcast_to(available, weights.shape), axis=-1)
    safe = jnp.where(weights > 0, weights, 1.0)
    entropy = -jnp.sum(jnp.where(weights > 0, weights * jnp.log(safe), 0.0), axis=-1)
    choice = count >= 2
    return jnp.where(choice, entropy / jnp.log(jnp.where(choice, count, 2).astype(weights.dtype)), 0.0)


__all__ = ["best_response", "combine", "masked_softmax", "nash_weights", "normalised_entropy", "prior_weights",
           "scale_game"]
