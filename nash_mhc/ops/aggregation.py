"""Per-position aggregation of the multiscale attention outputs: the scales' Nash (quantal response)
equilibrium, an input-dependent gate, or the prior alone (convex).

The game at one position (L scales, a <= L of them available there, outputs O_l in R^D, weights w on the
simplex of the available scales, prior logits b, learned temperature tau > 0):

    consensus    O* = sum_l w_l O_l
    utility      u_l(w) = b_l - e_l(w) / tau_t,   e_l(w) = |O_l - O*|^2 / (D S)
    scale        S = mean over the available l of |O_l|^2 / D       (the outputs' own scale)
    equilibrium  w = BR(w) = softmax over the available scales of u(w)   (logit quantal response)

e is the squared distance to the consensus *relative to the outputs' own scale*: multiplying every O_l by c
leaves e, the weights and their entropy unchanged, so rescaling V and W_o cannot move them. Distances do not
change when every output is shifted alike, so the game depends on the outputs only through C, the Gram matrix of
the centred outputs O_l - mean_m O_m over D S: e_l(w) = (delta_l - w)^T C (delta_l - w).

The effective temperature is tau_t = tau + c lambda_max(C) with c = :data:`FLOOR` (just above 1): the equilibrium
is then unique for every learned tau > 0, and at it each log-odds log(w_l / w_m) lies within
2 lambda_max max((1 - w_l)^2, (1 - w_m)^2) / tau_t < 2 / c of the prior's b_l - b_m. The proofs, the tightness of
the bound and the Jacobian of the best response are in docs/design.md §4 (The Nash game).

Solver: safeguarded Newton in logit space (each step takes whichever of the Newton step and the plain best-response
step leaves the smaller residual; L <= a few, so the L x L solves are cheap), from z = b; each position stops one
step after its first iterate with max_l |w - BR(w)| <= the dtype's tolerance (at most ``max_iters`` steps; on TPU
the whole loop is one Pallas kernel, :mod:`kernels.tpu.positions_kernel`, which runs all ``max_iters`` steps with
done positions frozen). Differentiated implicitly (a custom JVP: dz* = (I - J)^-1 dT, so reverse mode transposes one
linear solve), never through the iterations. lambda_max comes from :func:`nash_mhc.ops.game.largest_eigenvalue`
(closed form for L <= 3, Jacobi sweeps above): finite (sub)gradients everywhere, including C = 0. Both the solves
and lambda_max are elementwise over positions (see :func:`nash_mhc.ops.equilibrium.solve_small`). Computed in
float32 (float64 for float64 inputs), per position: weights are never pooled over the sequence, which would leak
the future.

The game's pieces (C, lambda_max, the other aggregations) are in :mod:`nash_mhc.ops.game`, the solver in
:mod:`nash_mhc.ops.equilibrium`; this module holds the Nash weights and the aggregation with its backward pass.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from beartype import beartype
from jaxtyping import Array, Bool, Float, jaxtyped

from nash_mhc.kernels.tpu import aggregation_kernels
from nash_mhc.ops.dispatch import platform_dependent
from nash_mhc.ops.equilibrium import solve_equilibrium
from nash_mhc.ops.game import SCALE_FLOOR, _compute_dtype, centred_gram, combine, largest_eigenvalue

FLOOR = 1.05  # c of tau_t = tau + c lambda_max(C): every log-odds moves by < 2 / c = 1.90 nats from the prior


@jaxtyped(typechecker=beartype)
def nash_weights(
    outputs: Sequence[Float[Array, "*batch dim"]],
    available: Bool[Array, "*#batch scales"],
    prior: Float[Array, "scales"],
    temperature: Float[Array, ""],
    *,
    num_iters: int,
) -> tuple[Float[Array, "*batch scales"], Float[Array, "*batch"]]:
    """(weights, residual): the scales' quantal-response equilibrium at every position, and how far from it.

    ``outputs``: the L scale outputs O_l [..., D], one array each.
    ``temperature`` is the learned tau > 0; the game uses tau + :data:`FLOOR` lambda_max(C) (module docstring),
    solved by at most ``num_iters`` safeguarded Newton steps to the dtype's :data:`TOLERANCE`. Unavailable
    scales get weight exactly 0; a position with one available scale gets weight 1 on it and residual 0.
    Gradients reach the outputs (through C), the prior and the temperature.
    """
    if num_iters < 1:
        raise ValueError(f"nash_weights needs num_iters >= 1, got {num_iters}")
    return _equilibrium(*centred_gram(outputs, available), available, prior, temperature, num_iters)


def _equilibrium(raw: jax.Array, scale: jax.Array, available: jax.Array, prior: jax.Array, temperature: jax.Array,
                 num_iters: int) -> tuple[jax.Array, jax.Array]:
    """(weights, residual) of the game whose centred Gram matrix is ``raw`` / ``scale`` (:func:`centred_gram`)."""
    dtype = _compute_dtype(raw, prior, temperature)
    gram = (raw / scale[..., None, None]).astype(dtype)
    effective = temperature.astype(dtype) + FLOOR * largest_eigenvalue(gram, available)
    available = jnp.broadcast_to(available, gram.shape[:-1])
    weights, residual, _ = solve_equilibrium(gram, jnp.broadcast_to(prior.astype(dtype), available.shape),
                                             effective, available, num_iters)
    return weights, residual


@jaxtyped(typechecker=beartype)
def nash_aggregate(
    outputs: Sequence[Float[Array, "..."]],
    available: Bool[Array, "*#batch scales"],
    prior: Float[Array, "scales"],
    temperature: Float[Array, ""],
    *,
    num_iters: int,
    kernels: bool = False,
    interpret: bool = False,
) -> tuple[Float[Array, "..."], Float[Array, "*batch scales"], Float[Array, "*batch"]]:
    """(sum_l w_l O_l, weights, residual): :func:`combine` of :func:`nash_weights`, with a hand-written backward
    pass over the outputs O_l [..., D].

    The same function and gradients as composing the two, but the reverse pass reads the outputs, never a
    float32 copy of them: the forward saves only the outputs (in their dtype) and the game's few per-position
    numbers, and the backward adds both paths to each output's gradient (through the weights of the sum, and
    through the Gram matrix of the game) in float32 before rounding it once to the outputs' dtype. Autodiff of
    the composition shared float32 copies of the outputs between the sum, the game and their gradients, which XLA
    wrote to memory and copied between layouts (the largest item of the multiscale layer's cost on TPU,
    docs/tpu.md). Both passes read the outputs through an optimisation barrier: without it XLA still moved their
    float32 conversions ahead of the layout copies it inserts, and copied twice the bytes. Reverse mode only (a
    ``custom_vjp``).

    ``kernels=True`` (the TPU's form): every pass over the outputs runs in the Pallas kernels of
    :mod:`kernels.tpu.aggregation_kernels`: forward, the Gram matrix and scale in one read of the outputs and the
    weighted sum in another; backward, the dots with the sum's cotangent, then every output's gradient in one pass
    (:func:`_pullback_coefficients`). ``interpret=True`` runs those kernels in Pallas' interpreter.

    The first output may be a multi-head attention output [B, T, H, K] (then every other one is [B, T, H K]): the
    kernels read it, and write the combined output and its gradient, head-major, the layout flash attention's
    kernels leave it in, so no copy turns it into rows and back (docs/tpu.md); the combined output is then [B, T,
    H, K]. The XLA form reshapes it to rows.
    """
    if num_iters < 1:
        raise ValueError(f"nash_aggregate needs num_iters >= 1, got {num_iters}")
    first = outputs[0].shape
    if len(first) == 4 and (len(outputs) < 2 or any(o.shape != (*first[:2], first[2] * first[3]) for o in outputs[1:])):
        raise ValueError(f"nash_aggregate: a [B, T, H, K] first output needs the others [B, T, H K], got "
                         f"{[o.shape for o in outputs]}")
    available = jnp.broadcast_to(available, (*outputs[-1].shape[:-1], len(outputs)))
    if len(first) == 4 and not kernels:
        outputs = [o.reshape(outputs[-1].shape) for o in outputs]
        out, weights, residual = _nash_aggregate(tuple(outputs), available, prior, temperature, num_iters,
                                                 (kernels, interpret))
        return out.reshape(first), weights, residual
    return _nash_aggregate(tuple(outputs), available, prior, temperature, num_iters, (kernels, interpret))


def platform_nash_aggregate(outputs: Sequence[jax.Array], available: jax.Array, prior: jax.Array,
                            temperature: jax.Array, *, num_iters: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`nash_aggregate` chosen for the step's platform (``dispatch.platform_dependent``, named
    ``nash_aggregate``): its Pallas kernels (``kernels=True``) lowered for TPU, its XLA form elsewhere. What
    :class:`nash_mhc.layers.aggregation.ScaleAggregation` calls."""
    nash = functools.partial(nash_aggregate, num_iters=num_iters)
    return platform_dependent(outputs, available, prior, temperature, tpu=functools.partial(nash, kernels=True),
                              default=nash, name="nash_aggregate")


def _gram_from_sums(sums: jax.Array, available: jax.Array, dim: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(raw, scale) of :func:`centred_gram` from the gram kernel's sums [..., K]
    (:func:`aggregation_kernels.gram_sums`), and whether the scale was kept (above :data:`SCALE_FLOOR`)."""
    scales = available.shape[-1]
    count = jnp.maximum(jnp.sum(available, axis=-1), 1)
    scale = sum(sums[..., s] / dim for s in range(scales)) / count
    entries = {pair: sums[..., scales + k] / dim for k, pair in enumerate(aggregation_kernels.pairs(scales))}
    rows = [jnp.stack([entries[min(i, j), max(i, j)] for j in range(scales)], axis=-1) for i in range(scales)]
    kept = scale > SCALE_FLOOR
    return jnp.stack(rows, axis=-2), jnp.where(kept, scale, 1.0), kept


def _pullback_coefficients(available: jax.Array, weights: jax.Array, kept: jax.Array, d_raw: jax.Array,
                           d_scale: jax.Array, dim: int) -> jax.Array:
    """The per-position coefficients [..., P] of :func:`aggregation_kernels.gram_pullback` (a, A row-major, w, s,
    count: its module docstring) from the game's backward pass: A = (d_raw + d_rawᵀ) / D and s = 2 d_scale /
    (D count) where the scale was ``kept``, else 0. Then dO_l = a_l (dc_l - sum_m a_m dc_m / count + s o_l) + w_l g
    is the outputs' gradient through the weighted sum and through (raw, scale) = :func:`centred_gram`."""
    mask = available.astype(d_raw.dtype)
    count = jnp.maximum(jnp.sum(mask, axis=-1), 1.0)
    symmetric = (d_raw + jnp.swapaxes(d_raw, -1, -2)) / dim
    square = (jnp.where(kept, d_scale, 0.0) * 2.0 / dim) / count
    return jnp.concatenate([mask, symmetric.reshape(*symmetric.shape[:-2], -1), weights, square[..., None],
                            count[..., None]], axis=-1)


def _nash_forward(outputs: tuple[jax.Array, ...], available: jax.Array, prior: jax.Array, temperature: jax.Array,
                  num_iters: int, kernels: tuple[bool, bool]) -> tuple[jax.Array, jax.Array, jax.Array, Any, Any]:
    """(combined, weights, residual, the game's pullback, whether the scale was kept: kernels only, else None)."""
    kept = None
    if kernels[0]:
        sums = aggregation_kernels.gram_sums(outputs, available, interpret=kernels[1])
        raw, scale, kept = _gram_from_sums(sums, available, outputs[-1].shape[-1])
    else:
        outputs = jax.lax.optimization_barrier(outputs)
        raw, scale = centred_gram(outputs, available)
    (weights, residual), game_vjp = jax.vjp(
        lambda r, s, p, t: _equilibrium(r, s, available, p, t, num_iters), raw, scale, prior, temperature)
    if kernels[0]:
        return (aggregation_kernels.weighted_sum(outputs, weights, interpret=kernels[1]), weights, residual, game_vjp,
                kept)
    return combine(outputs, weights), weights, residual, game_vjp, kept


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _nash_aggregate(outputs: tuple[jax.Array, ...], available: jax.Array, prior: jax.Array, temperature: jax.Array,
                    num_iters: int, kernels: tuple[bool, bool]) -> tuple[jax.Array, jax.Array, jax.Array]:
    return _nash_forward(outputs, available, prior, temperature, num_iters, kernels)[:3]


def _nash_aggregate_fwd(outputs: tuple[jax.Array, ...], available: jax.Array, prior: jax.Array,
                        temperature: jax.Array, num_iters: int, kernels: tuple[bool, bool]
                        ) -> tuple[tuple[jax.Array, ...], tuple[Any, ...]]:
    combined, weights, residual, game_vjp, kept = _nash_forward(outputs, available, prior, temperature, num_iters,
                                                                kernels)
    return (combined, weights, residual), (outputs, available, weights, game_vjp, kept)


def _nash_aggregate_bwd(num_iters: int, kernels: tuple[bool, bool], saved: tuple[Any, ...],
                        cotangents: tuple[jax.Array, ...]) -> tuple[Any, ...]:
    del num_iters
    outputs, available, weights, game_vjp, kept = saved
    d_combined, d_weights, d_residual = cotangents
    if kernels[0]:  # the weights' gradient through sum_l w_l O_l, the game's, then the outputs' in one pass
        d_weights = d_weights + aggregation_kernels.output_dots(outputs, d_combined, interpret=kernels[1])
        d_raw, d_scale, d_prior, d_temperature = game_vjp((d_weights, d_residual))
        coefficients = _pullback_coefficients(available, weights, kept, d_raw, d_scale, outputs[-1].shape[-1])
        d_outputs = aggregation_kernels.gram_pullback(outputs, d_combined, coefficients, interpret=kernels[1])
        return d_outputs, None, d_prior, d_temperature
    d_sum = d_combined.astype(weights.dtype)
    wide = [x.astype(weights.dtype) for x in jax.lax.optimization_barrier(outputs)]
    d_weights = d_weights + jnp.stack([jnp.sum(x * d_sum, axis=-1) for x in wide], axis=-1)  # sum_l w_l O_l
    d_raw, d_scale, d_prior, d_temperature = game_vjp((d_weights, d_residual))
    d_wide = jax.vjp(lambda o: centred_gram(o, available), wide)[1]((d_raw, d_scale))[0]
    d_outputs = tuple((d + weights[..., s, None] * d_sum).astype(x.dtype)
                      for s, (d, x) in enumerate(zip(d_wide, outputs, strict=True)))
    return d_outputs, None, d_prior, d_temperature


_nash_aggregate.defvjp(_nash_aggregate_fwd, _nash_aggregate_bwd)


__all__ = ["FLOOR", "nash_aggregate", "nash_weights", "platform_nash_aggregate"]
