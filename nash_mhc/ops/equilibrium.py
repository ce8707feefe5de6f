"""The Nash game's equilibrium solver: safeguarded Newton in logit space on per-scale entries, elementwise over
the positions (in XLA, or as one Pallas kernel on TPU), differentiated implicitly by a custom JVP; see
:mod:`nash_mhc.ops.aggregation`'s docstring (Solver)."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from nash_mhc.kernels.tpu.positions_kernel import position_rows, run_positions
from nash_mhc.ops.dispatch import platform_dependent
from nash_mhc.sharding import per_shard

TOLERANCE = {jnp.dtype(jnp.float32): 1e-6, jnp.dtype(jnp.float64): 1e-12}  # target max_l |w - BR(w)|


def solve_small(matrix: jax.Array, rhs: jax.Array) -> jax.Array:
    """x with ``matrix`` [..., L, L] x = ``rhs`` [..., L]: Gaussian elimination with partial pivoting unrolled
    over the L x L entries, each an array over the positions (L <= 6; ``linalg.solve`` above). A batched
    ``linalg.solve`` of 3 x 3 systems keeps the scales axis minor: on a TPU every matrix is padded to a tile and
    transposed for the solver, about 150 times the elementwise cost (the compiler's estimate, docs/tpu.md).
    Linear in ``rhs``, so reverse mode transposes it like any elementwise program."""
    size = matrix.shape[-1]
    rows = [[matrix[..., i, j] for j in range(size)] for i in range(size)]
    return jnp.stack(_solve_entries(rows, _entries(rhs)), axis=-1)


# The game's per-position math on entries: a vector [..., L] as L arrays [...], a matrix [..., L, L] as an L x L
# nested list of them. Every operation is elementwise over the positions, so the Newton loop has no reduction or
# stack over the scales axis: XLA fuses an iteration into a few loops (on CPU each reduction over L = 3 and each
# stack was its own thunk, about 60 per iteration), and on a TPU the positions stay in the vector lanes.
Entries = list[jax.Array]


def _entries(vector: jax.Array) -> Entries:
    """[..., L] → L arrays [...]."""
    return [vector[..., k] for k in range(vector.shape[-1])]


def _matrix_entries(matrix: jax.Array) -> list[Entries]:
    """[..., L, L] → L x L nested list of arrays [...]."""
    return [_entries(matrix[..., i, :]) for i in range(matrix.shape[-1])]


def _largest(values: Entries) -> jax.Array:
    """Elementwise max over the entries (NaN propagates, as in ``jnp.max``)."""
    return functools.reduce(jnp.maximum, values)


def _solve_entries(rows: list[Entries], right: Entries) -> Entries:
    """:func:`solve_small` on entries."""
    size = len(right)
    if size > 6:
        matrix = jnp.stack([jnp.stack(row, axis=-1) for row in rows], axis=-2)
        return _entries(jnp.linalg.solve(matrix, jnp.stack(right, axis=-1)[..., None])[..., 0])
    rows, right = [list(row) for row in rows], list(right)
    for k in range(size):
        for i in range(k + 1, size):  # bring the largest |entry| of column k (rows k..) to row k
            swap = jnp.abs(rows[i][k]) > jnp.abs(rows[k][k])
            rows[k], rows[i] = ([jnp.where(swap, x, y) for x, y in zip(rows[i], rows[k], strict=True)],
                                [jnp.where(swap, y, x) for x, y in zip(rows[i], rows[k], strict=True)])
            right[k], right[i] = jnp.where(swap, right[i], right[k]), jnp.where(swap, right[k], right[i])
        for i in range(k + 1, size):
            factor = rows[i][k] / rows[k][k]
            rows[i] = [rows[i][j] - factor * rows[k][j] for j in range(size)]
            right[i] = right[i] - factor * right[k]
    solution: Entries = [jnp.zeros_like(right[0])] * size
    for i in reversed(range(size)):
        known = sum((rows[i][j] * solution[j] for j in range(i + 1, size)), jnp.zeros_like(right[i]))
        solution[i] = (right[i] - known) / rows[i][i]
    return solution


def _finite(x: jax.Array) -> jax.Array:
    """``jnp.isfinite`` as |x| < inf (False for ±inf and NaN), which the TPU kernel compiler lowers."""
    return jnp.abs(x) < jnp.inf


def _softmax_entries(logits: Entries, available: Entries) -> Entries:
    """:func:`masked_softmax` on entries: shifted by the largest available logit (0 where none is finite)."""
    logits = [jnp.where(a, x, -jnp.inf) for x, a in zip(logits, available, strict=True)]
    peak = _largest(logits)
    peak = jnp.where(_finite(peak), peak, 0.0)
    unnorm = [jnp.where(a, jnp.exp(x - peak), 0.0) for x, a in zip(logits, available, strict=True)]
    total = sum(unnorm)
    return [u / jnp.where(total > 0, total, 1.0) for u in unnorm]


def _matvec(matrix: list[Entries], vector: Entries) -> Entries:
    """``matrix`` times ``vector`` as L x L elementwise multiply-adds over the positions (a batched matmul of
    L x L matrices would pad each to a TPU tile)."""
    return [sum(m * v for m, v in zip(row, vector, strict=True)) for row in matrix]


def _best_response(z: Entries, gram: list[Entries], prior: Entries, temperature: jax.Array, available: Entries
                   ) -> tuple[Entries, Entries]:
    """(T(z), w): the best-response logits b - e(w) / tau_t at w = softmax(z) (0 on unavailable scales)."""
    w = _softmax_entries(z, available)
    cw = _matvec(gram, w)
    spread = sum(a * b for a, b in zip(w, cw, strict=True))
    return [jnp.where(available[k], prior[k] - (gram[k][k] - 2.0 * cw[k] + spread) / temperature, 0.0)
            for k in range(len(z))], w


def _newton_entries(w: Entries, gram: list[Entries], temperature: jax.Array, available: Entries) -> list[Entries]:
    """I - dT/dz at weights w: I - (2 / tau_t) (C - 1 (C w)^T) Sigma_w on the available rows (identity rows on
    the others, whose residual is z itself)."""
    size = len(w)
    cw = _matvec(gram, w)
    scale = 2.0 / temperature
    rows = []
    for i in range(size):
        left = [gram[i][k] - cw[k] for k in range(size)]  # row i of C - 1 (C w)^T
        # (left Sigma_w)[i, m] = left[i, m] w_m - (sum_k left[i, k] w_k) w_m, Sigma_w = diag(w) - w w^T
        weighted = sum(left[k] * w[k] for k in range(size))
        rows.append([float(i == m) - jnp.where(available[i], scale * ((left[m] - weighted) * w[m]), 0.0)
                     for m in range(size)])
    return rows


def _distance(logits: Entries, w: Entries, available: Entries) -> jax.Array:
    """max_l |w - BR(w)| per position, from the best-response logits T(z) and w = softmax(z)."""
    return _largest([jnp.abs(b - a) for b, a in zip(_softmax_entries(logits, available), w, strict=True)])


def _best_logits(z: jax.Array, gram: jax.Array, prior: jax.Array, temperature: jax.Array, available: jax.Array
                 ) -> tuple[jax.Array, jax.Array]:
    """:func:`_best_response` on arrays [..., L] (gram [..., L, L]): (T(z), w)."""
    logits, w = _best_response(_entries(z), _matrix_entries(gram), _entries(prior), temperature,
                               _entries(available))
    return jnp.stack(logits, axis=-1), jnp.stack(w, axis=-1)


def _newton_matrix(w: jax.Array, gram: jax.Array, temperature: jax.Array, available: jax.Array) -> jax.Array:
    """:func:`_newton_entries` on arrays: [..., L, L]."""
    rows = _newton_entries(_entries(w), _matrix_entries(gram), temperature, _entries(available))
    return jnp.stack([jnp.stack(row, axis=-1) for row in rows], axis=-2)


@functools.partial(jax.custom_jvp, nondiff_argnums=(4,))
def solve_equilibrium(gram: jax.Array, prior: jax.Array, temperature: jax.Array, available: jax.Array,
                      max_iters: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(w, max_l |w - BR(w)|, z) of the game of centred Gram matrix ``gram`` [..., L, L], prior logits ``prior``
    [..., L], effective temperature ``temperature`` [...] (> lambda_max(gram)): the equilibrium weights, their
    residual and logits (w = softmax(z) over ``available``); see :mod:`nash_mhc.ops.aggregation`'s docstring.

    Each position stops one step after its first iterate within the tolerance (:func:`_equilibrium_entries`), so its
    iterates never depend on the other positions (in any batch, on one device or split over many; XLA may still
    round the same arithmetic differently for another shape), and the iterations run on each device's own
    positions (:func:`nash_mhc.sharding.per_shard`, batch over the batch axes): the loop's stopping test needs no
    communication. A test over the whole batch put an all-reduce in every iteration of the loop, a synchronisation
    per Newton step on a pod.
    """
    positions = ("batch", *["seq"] * (temperature.ndim - 1)) if temperature.ndim else ()
    solve = per_shard(functools.partial(_solve_positions, max_iters=max_iters),
                      ((*positions, "scales", "scales"), (*positions, "scales"), positions, (*positions, "scales")),
                      ((*positions, "scales"), positions, (*positions, "scales")))
    return solve(gram, prior, temperature, available)


def _solve_positions(gram: jax.Array, prior: jax.Array, temperature: jax.Array, available: jax.Array,
                     max_iters: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`solve_equilibrium` on one device's positions: :func:`_equilibrium_entries` in XLA, or lowered for TPU
    (float32, positions in multiples of 1,024) as one Pallas kernel (:func:`_equilibrium_kernel`)."""
    xla = functools.partial(_equilibrium_xla, max_iters=max_iters)
    if gram.dtype != jnp.float32 or position_rows(temperature.size) is None:
        return xla(gram, prior, temperature, available)
    kernel = functools.partial(_equilibrium_kernel, max_iters=max_iters, interpret=False)
    return platform_dependent(gram, prior, temperature, available, tpu=kernel, default=xla,
                              name="equilibrium")


def _equilibrium_xla(gram: jax.Array, prior: jax.Array, temperature: jax.Array, available: jax.Array,
                     max_iters: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(w, residual, z) by :func:`_equilibrium_entries` on XLA arrays, the loop stopping once every position is
    done."""
    tol = TOLERANCE.get(jnp.dtype(gram.dtype), 1e-6)
    w, distance, z = _equilibrium_entries(_matrix_entries(gram), _entries(prior), temperature, _entries(available),
                                          tol, max_iters, fixed=False)
    return jnp.stack(w, axis=-1), distance, jnp.stack(z, axis=-1)


def _equilibrium_kernel(gram: jax.Array, prior: jax.Array, temperature: jax.Array, available: jax.Array,
                        max_iters: int, interpret: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(w, residual, z) by :func:`_equilibrium_entries` in one Pallas kernel over the positions
    (:func:`nash_mhc.kernels.tpu.positions_kernel.run_positions`), every iteration on chip; the loop runs ``max_iters``
    steps, a done position frozen (the same values as the XLA loop's early stop). Float32 positions, in
    multiples of 1,024."""
    size = prior.shape[-1]
    shape = temperature.shape
    tol = TOLERANCE[jnp.dtype(jnp.float32)]

    def rows(a: jax.Array, k: int) -> jax.Array:  # [..., k] -> [k, P]: the positions minor, in the lanes
        return jnp.moveaxis(a.reshape(-1, k), 0, 1)

    def solve(game: Entries, base: Entries, temp: Entries, mask: Entries) -> list[Entries]:
        matrix = [game[i * size:(i + 1) * size] for i in range(size)]
        w, distance, z = _equilibrium_entries(matrix, base, temp[0], [m > 0 for m in mask], tol, max_iters,
                                              fixed=True)
        return [w, [distance], z]

    w, distance, z = run_positions(solve, [rows(gram, size * size), rows(prior, size), temperature.reshape(1, -1),
                                           rows(available.astype(jnp.float32), size)], [size, 1, size],
                                   interpret=interpret)
    return w.T.reshape(*shape, size), distance.reshape(shape), z.T.reshape(*shape, size)


def _equilibrium_entries(game: list[Entries], base: Entries, temperature: jax.Array, mask: Entries, tol: float,
                         max_iters: int, fixed: bool) -> tuple[Entries, jax.Array, Entries]:
    """(w, max_l |w - BR(w)|, z) per position: safeguarded Newton steps; a position takes one more step from its
    first iterate with max_l |w - BR(w)| <= the tolerance (or not finite), then its logits are frozen. The extra
    step (quadratic near the solution) brings the log-odds to float32 precision: the tolerance bounds
    |w - BR(w)|, not log(w_l / w_m), and a small weight's log-odds can still be 4e-4 off at it. On entries (one
    array per scale; the loop's flags are 1.0 / 0.0, not booleans, which a TPU kernel cannot carry through a loop).
    ``fixed``: run all ``max_iters`` steps (a fori loop, as in a kernel); else stop once every position is done
    (the same values)."""

    def residual_of(z: Entries) -> tuple[Entries, jax.Array]:
        """(z - T(z) on the available scales (z elsewhere), whether w = softmax(z) is within the tolerance:
        max_l |w - BR(w)| <= tol, 1.0 or 0.0; NaN counts as within, more steps cannot mend it)."""
        logits, w = _best_response(z, game, base, temperature, mask)
        within = jnp.where(_distance(logits, w, mask) > tol, 0.0, 1.0)
        return [jnp.where(a, x - t, x) for x, t, a in zip(z, logits, mask, strict=True)], within

    Carry = tuple[Entries, Entries, jax.Array, jax.Array]

    def step(carry: Carry) -> Carry:
        z, r, within, done = carry
        w = _softmax_entries(z, mask)
        newton = [a - b for a, b in zip(z, _solve_entries(_newton_entries(w, game, temperature, mask), r),
                                         strict=True)]
        plain = [a - b for a, b in zip(z, r, strict=True)]
        (r_newton, within_newton), (r_plain, within_plain) = residual_of(newton), residual_of(plain)
        better = _largest([jnp.abs(x) for x in r_newton]) <= _largest([jnp.abs(x) for x in r_plain])
        better &= functools.reduce(jnp.logical_and, [_finite(x) for x in newton])

        def pick(old: Entries, new: Entries, other: Entries) -> Entries:
            # a done position keeps its z; its next ``within`` is never read (done stays done)
            return [jnp.where(done > 0, a, jnp.where(better, b, c)) for a, b, c in zip(old, new, other, strict=True)]

        within_next = jnp.where(better, within_newton, within_plain)
        return pick(z, newton, plain), pick(r, r_newton, r_plain), within_next, jnp.maximum(done, within)

    z0 = [jnp.where(a, p, 0.0) for p, a in zip(base, mask, strict=True)]
    start = (z0, *residual_of(z0), jnp.zeros_like(temperature))
    if fixed:
        z = jax.lax.fori_loop(0, max_iters, lambda _, carry: step(carry), start)[0]
    else:
        def unconverged(carry: tuple[Carry, jax.Array]) -> jax.Array:
            return (carry[1] < max_iters) & ~jnp.all(carry[0][3] > 0)

        z = jax.lax.while_loop(unconverged, lambda carry: (step(carry[0]), carry[1] + 1), (start, 0))[0][0]
    logits, w = _best_response(z, game, base, temperature, mask)
    return w, _distance(logits, w, mask), z


@solve_equilibrium.defjvp
def _solve_equilibrium_jvp(max_iters: int, primals: tuple[Any, ...], tangents: tuple[Any, ...]
                           ) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Implicit differentiation at the equilibrium z* = T(z*; theta): dz* = (I - dT/dz)^-1 dT/dtheta dtheta."""
    gram, prior, temperature, available = primals
    d_gram, d_prior, d_temperature, _ = tangents
    w, residual, z = solve_equilibrium(gram, prior, temperature, available, max_iters)

    def best(g: jax.Array, p: jax.Array, t: jax.Array) -> jax.Array:
        return _best_logits(z, g, p, t, available)[0]

    _, rhs = jax.jvp(best, (gram, prior, temperature), (d_gram, d_prior, d_temperature))
    dz = solve_small(_newton_matrix(w, gram, temperature, available), rhs)
    dw = jnp.where(available, w * (dz - jnp.sum(w * dz, axis=-1, keepdims=True)), 0.0)  # softmax's Jacobian
    return (w, residual, z), (dw, jnp.zeros_like(residual), jnp.where(available, dz, 0.0))


__all__ = ["TOLERANCE", "solve_equilibrium", "solve_small"]
