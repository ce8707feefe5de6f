"""The scales' game at each position, and the other aggregations: the centred Gram matrix C of the scale outputs
over their own scale, lambda_max(C), the masked softmax, and the prior's and the gate's weights, the weighted sum and
the weights' entropy. The game itself, its bound and its solver are in :mod:`nash_mhc.ops.aggregation`'s docstring.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from beartype import beartype
from jaxtyping import Array, Bool, Float, jaxtyped

from nash_mhc.kernels.tpu import aggregation_kernels
from nash_mhc.ops import jacobi
from nash_mhc.ops.equilibrium import _entries, _softmax_entries

SCALE_FLOOR = 1e-30  # outputs with mean square below this count as all zero (their game is the prior's)
# The scale outputs come as L separate [..., D] slabs, never stacked into [..., L, D]: on a TPU the few scales of a
# stacked array share each (8, 128) tile (a bfloat16 [..., 3, D] fills 3 of its 16 rows), so writing the stack, and
# every sum over its scales axis, moves several times the outputs' bytes (docs/tpu.md).


def _compute_dtype(*arrays: jax.Array) -> jnp.dtype:
    """float32, or float64 when an input is float64 (for float64 gradient checks)."""
    return jnp.result_type(jnp.float32, *(a.dtype for a in arrays))


@jaxtyped(typechecker=beartype)
def masked_softmax(logits: Float[Array, "*batch scales"], available: Bool[Array, "*#batch scales"]
                   ) -> Float[Array, "*batch scales"]:
    """Softmax over the available entries; unavailable entries get exactly 0 (rows with none: all 0)."""
    logits = logits.astype(_compute_dtype(logits))
    entries = _softmax_entries(_entries(logits), _entries(jnp.broadcast_to(available, logits.shape)))
    return jnp.stack(entries, axis=-1)


@jaxtyped(typechecker=beartype)
def output_scale(outputs: Sequence[Float[Array, "*batch dim"]], available: Bool[Array, "*#batch scales"]
                 ) -> tuple[list[Float[Array, "*batch dim"]], Float[Array, "*batch"]]:
    """(the L outputs O_l [..., D] in the compute dtype, 0 on unavailable scales; their scale S [...], the mean over
    the available scales of |O_l|^2 / D). The game and the gate read the outputs over sqrt(S), so rescaling every
    output alike moves nothing; both divide their reductions by S instead of the outputs (one pass over the
    outputs). All-zero outputs (S below :data:`SCALE_FLOOR`) get S = 1: they stay zero, with finite gradients."""
    dtype = _compute_dtype(*outputs)
    available = jnp.broadcast_to(available, (*outputs[0].shape[:-1], len(outputs)))
    o = [jnp.where(available[..., s, None], x.astype(dtype), 0.0) for s, x in enumerate(outputs)]
    count = jnp.maximum(jnp.sum(available, axis=-1), 1)
    scale = sum(jnp.mean(x * x, axis=-1) for x in o) / count
    return o, jnp.where(scale > SCALE_FLOOR, scale, 1.0)


@jaxtyped(typechecker=beartype)
def centred_gram(outputs: Sequence[Float[Array, "*batch dim"]], available: Bool[Array, "*#batch scales"]
                 ) -> tuple[Float[Array, "*batch scales scales"], Float[Array, "*batch"]]:
    """(D S C, S): the Gram matrix over D of the available outputs O_l [..., D] centred over the available scales (0
    on unavailable rows and columns), and S (:func:`output_scale`). Every reduction over D in one pass."""
    o, scale = output_scale(outputs, available)
    mask = jnp.broadcast_to(available, (*o[0].shape[:-1], len(o))).astype(o[0].dtype)
    count = jnp.maximum(jnp.sum(mask, axis=-1), 1.0)
    mean = sum(o) / count[..., None]
    centred = [(x - mean) * mask[..., s, None] for s, x in enumerate(o)]
    rows = [jnp.stack([jnp.mean(a * b, axis=-1) for b in centred], axis=-1) for a in centred]
    return jnp.stack(rows, axis=-2), scale


@jaxtyped(typechecker=beartype)
def scale_game(outputs: Sequence[Float[Array, "*batch dim"]], available: Bool[Array, "*#batch scales"]
               ) -> tuple[Float[Array, "*batch scales scales"], Float[Array, "*batch"]]:
    """(C, lambda_max(C)): the Gram matrix of the centred available outputs O_l [..., D] over D S (0 on unavailable
    rows and columns) and its largest eigenvalue."""
    raw, scale = centred_gram(outputs, available)
    gram = raw / scale[..., None, None]
    return gram, largest_eigenvalue(gram, available)


def largest_eigenvalue(gram: jax.Array, available: jax.Array) -> jax.Array:
    """lambda_max of the centred Gram matrix ``gram`` [..., L, L] of the ``available`` scales, per position.

    Centring over the a available scales leaves C 1_available = 0, so C has rank <= a - 1 and is PSD:
    a <= 2 gives lambda_max = trace(C) exactly. For L = 3 with all three available, the two nonzero eigenvalues
    are those of B = U^T C U, U an orthonormal basis of the complement of 1 (u1 = (1, -1, 0) / sqrt 2, u2 =
    (1, 1, -2) / sqrt 6): lambda_max = tr(B) / 2 + sqrt(((B11 - B22) / 2)^2 + B12^2), a sum of squares under the
    root (no cancellation). Elementwise over positions, so on a TPU the positions stay in the vector lanes; a
    batched ``eigvalsh`` of 3 x 3 matrices costs the TPU about 1,300 times as much (the compiler's estimate,
    docs/tpu.md), on CPU a LAPACK call per matrix. Where the two eigenvalues are equal (C = 0 included) the
    gradient is that of tr(C) / 2, a subgradient. L > 3: cyclic Jacobi sweeps, also elementwise
    (:func:`nash_mhc.ops.jacobi.largest_eigenvalue`), where at least three scales are available; the trace where
    fewer are.
    """
    size = gram.shape[-1]
    trace = jnp.trace(gram, axis1=-2, axis2=-1)
    if size > 3:
        count = jnp.sum(jnp.broadcast_to(available, gram.shape[:-1]), axis=-1)
        return jnp.where(count > 2, jacobi.largest_eigenvalue(gram), trace)
    if size < 3:
        return trace
    c = [[gram[..., i, j] for j in range(3)] for i in range(3)]
    b11 = (c[0][0] + c[1][1] - 2.0 * c[0][1]) / 2.0
    b22 = (c[0][0] + c[1][1] + 4.0 * c[2][2] + 2.0 * c[0][1] - 4.0 * c[0][2] - 4.0 * c[1][2]) / 6.0
    b12 = (c[0][0] - c[1][1] - 2.0 * c[0][2] + 2.0 * c[1][2]) / (2.0 * 3.0 ** 0.5)
    gap = ((b11 - b22) / 2.0) ** 2 + b12 ** 2
    root = jnp.where(gap > 0, jnp.sqrt(jnp.where(gap > 0, gap, 1.0)), 0.0)
    every = jnp.all(jnp.broadcast_to(available, gram.shape[:-1]), axis=-1)
    return jnp.where(every, (b11 + b22) / 2.0 + root, trace)

@jaxtyped(typechecker=beartype)
def prior_weights(prior: Float[Array, "scales"], available: Bool[Array, "*batch scales"]
                  ) -> Float[Array, "*batch scales"]:
    """The convex aggregation: softmax of the learned per-scale logits over the available scales."""
    return masked_softmax(jnp.broadcast_to(prior, available.shape), available)


@jaxtyped(typechecker=beartype)
def gate_weights(outputs: Sequence[Float[Array, "*batch dim"]], available: Bool[Array, "*#batch scales"],
                 prior: Float[Array, "scales"], gate: Float[Array, "scales scales dim"]
                 ) -> Float[Array, "*batch scales"]:
    """The gate aggregation: softmax over the available scales of b_l + sum_m <W_lm, O_m> / sqrt(D S).

    The logits read every available scale's output over sqrt(S), like the game (:func:`output_scale`, so
    rescaling V or W_o cannot move them); ``gate`` W [L, L, D] starts at 0, so the weights start at the prior.
    """
    o, scale = output_scale(outputs, available)
    gate = gate.astype(o[0].dtype)
    scores = sum(jnp.einsum("...d,ld->...l", x, gate[:, m]) for m, x in enumerate(o))
    scores = scores * jax.lax.rsqrt(scale * o[0].shape[-1])[..., None]
    return masked_softmax(prior.astype(o[0].dtype) + scores, available)


@jaxtyped(typechecker=beartype)
def combine(outputs: Sequence[Float[Array, "*batch dim"]], weights: Float[Array, "*batch scales"]
            ) -> Float[Array, "*batch dim"]:
    """sum_l w_l O_l of the L outputs O_l [..., D] in float32, returned in the outputs' dtype."""
    return aggregation_kernels.weighted_sum_xla(outputs, weights)


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


__all__ = ["SCALE_FLOOR", "centred_gram", "combine", "gate_weights", "largest_eigenvalue", "masked_softmax",
           "normalised_entropy", "output_scale", "prior_weights", "scale_game"]
