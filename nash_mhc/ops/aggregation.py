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
the whole loop is one Pallas kernel, :mod:`nash_mhc.ops.positions_kernel`, which runs all ``max_iters`` steps with
done positions frozen). Differentiated implicitly (a custom JVP: dz* = (I - J)^-1 dT, so reverse mode transposes one
linear solve), never through the iterations. lambda_max comes from :func:`largest_eigenvalue` (closed form for L <=
3, Jacobi sweeps above): finite (sub)gradients everywhere, including C = 0. Both the solves and lambda_max are
elementwise over positions (see :func:`solve_small`). Computed in float32 (float64 for float64 inputs), per
position: weights are never pooled over the sequence, which would leak the future.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from beartype import beartype
from jaxtyping import Array, Bool, Float, jaxtyped

from nash_mhc.ops import aggregation_kernels, jacobi
from nash_mhc.ops.dispatch import platform_dependent
from nash_mhc.ops.positions_kernel import position_rows, run_positions
from nash_mhc.sharding import per_shard

FLOOR = 1.05  # c of tau_t = tau + c lambda_max(C): every log-odds moves by < 2 / c = 1.90 nats from the prior
SCALE_FLOOR = 1e-30  # outputs with mean square below this count as all zero (their game is the prior's)
TOLERANCE = {jnp.dtype(jnp.float32): 1e-6, jnp.dtype(jnp.float64): 1e-12}  # target max_l |w - BR(w)|
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
    residual and logits (w = softmax(z) over ``available``); see the module docstring.

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
    (:func:`nash_mhc.ops.positions_kernel.run_positions`), every iteration on chip; the loop runs ``max_iters``
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
    :mod:`nash_mhc.ops.aggregation_kernels`: forward, the Gram matrix and scale in one read of the outputs and the
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


__all__ = ["FLOOR", "centred_gram", "combine", "gate_weights", "largest_eigenvalue", "masked_softmax",
           "nash_aggregate", "nash_weights",
           "normalised_entropy", "output_scale", "prior_weights", "scale_game", "solve_equilibrium",
           "solve_small"]
