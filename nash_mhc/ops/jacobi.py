"""The largest eigenvalue of small symmetric matrices, elementwise over positions: cyclic Jacobi sweeps.

For a symmetric M [..., L, L] (L small, one matrix per position), each Jacobi rotation in the plane (p, q) zeroes
M_pq (Golub and Van Loan's symmetric Schur decomposition of the 2 x 2 block: tau = (M_qq - M_pp) / (2 M_pq),
t = sign(tau) / (|tau| + sqrt(1 + tau^2)), the smaller of the two angles, c = 1 / sqrt(1 + t^2), s = t c), and a
cyclic sweep rotates every plane once. The off-diagonal mass falls quadratically once it is small; the diagonal
then holds the eigenvalues and the accumulated rotations V their eigenvectors. :data:`EXTRA_SWEEPS` beyond L:
a float64 NumPy check of the same sweeps on 20,000 random centred Gram matrices (spreads over six decades) left an
off-diagonal norm of 1.6e-16 of the trace after 5 sweeps at L = 4, 6 at L = 5, 7 at L = 6.

Every operation is elementwise over the positions (the matrix is held as L x L arrays [...]): on a TPU the positions
stay in the vector lanes. For the `3b` preset's 4 x 4 games the TPU compiler estimates the sweeps, forward and
backward, at a fiftieth of a batched ``jnp.linalg.eigvalsh`` (beside two custom calls it does not cost;
docs/results/tpu_estimate/README.md). Differentiated by a custom JVP, never through the sweeps:
d lambda = v^T dM v for the eigenvector v of the largest diagonal entry (where the largest eigenvalue is repeated, v
is one unit vector of its eigenspace, and v v^T a subgradient).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

EXTRA_SWEEPS = 2  # sweeps = L + EXTRA_SWEEPS (module docstring)


def _sweep(a: list[list[jax.Array]], v: list[list[jax.Array]]) -> None:
    """One cyclic sweep, in place on the L x L nested lists ``a`` (symmetric: a[i][j] is a[j][i]) and ``v``."""
    size = len(a)
    zero = jnp.zeros_like(a[0][0])
    for p in range(size):
        for q in range(p + 1, size):
            apq = a[p][q]
            rotate = apq != 0
            tau = (a[q][q] - a[p][p]) / (2 * jnp.where(rotate, apq, 1))
            # |tau| overflowing tau^2 gives t = 0, the rotation M_pq that small needs
            t = jnp.where(tau >= 0, 1.0, -1.0) / (jnp.abs(tau) + jnp.sqrt(1 + tau * tau))
            t = jnp.where(rotate, t, 0)
            c = jax.lax.rsqrt(1 + t * t)
            s = t * c
            app, aqq = a[p][p] - t * apq, a[q][q] + t * apq
            for k in range(size):
                if k not in (p, q):
                    akp, akq = a[k][p], a[k][q]
                    a[k][p] = a[p][k] = c * akp - s * akq
                    a[k][q] = a[q][k] = s * akp + c * akq
                vkp, vkq = v[k][p], v[k][q]
                v[k][p], v[k][q] = c * vkp - s * vkq, s * vkp + c * vkq
            a[p][p], a[q][q] = app, aqq
            a[p][q] = a[q][p] = zero


def _rotations(matrix: jax.Array) -> tuple[list[list[jax.Array]], list[list[jax.Array]]]:
    """(D, V) after the sweeps, as L x L nested lists of arrays [...]: D nearly diagonal, V orthogonal, V^T M V = D,
    M = (matrix + matrix^T) / 2. The sweeps are a loop (one sweep unrolled in its body): unrolled, the `3b` step's
    28 layers of them took the TPU compile past 23 GB of host memory."""
    size = matrix.shape[-1]
    upper = [(i, j) for i in range(size) for j in range(i, size)]

    def symmetric(entries: list[jax.Array]) -> list[list[jax.Array]]:
        """The L x L nested list whose upper triangle (row-major) is ``entries``, mirrored below."""
        a = [[None] * size for _ in range(size)]
        for (i, j), x in zip(upper, entries, strict=True):
            a[i][j] = a[j][i] = x
        return a

    def body(_, carry):
        entries, v = carry
        a, v = symmetric(entries), [list(row) for row in v]
        _sweep(a, v)
        return [a[i][j] for i, j in upper], v

    entries = [(matrix[..., i, j] + matrix[..., j, i]) / 2 for i, j in upper]
    zero, one = jnp.zeros_like(entries[0]), jnp.ones_like(entries[0])
    identity = [[one if i == j else zero for j in range(size)] for i in range(size)]
    entries, v = jax.lax.fori_loop(0, size + EXTRA_SWEEPS, body, (entries, identity))
    return symmetric(entries), v


def _largest_pair(matrix: jax.Array) -> tuple[jax.Array, list[jax.Array]]:
    """(lambda_max [...], its eigenvector as L arrays [...]): the largest diagonal entry after the sweeps and its
    column of V (the first of equal entries)."""
    a, v = _rotations(matrix)
    size = len(a)
    value, vector = a[0][0], [v[k][0] for k in range(size)]
    for j in range(1, size):
        larger = a[j][j] > value
        value = jnp.where(larger, a[j][j], value)
        vector = [jnp.where(larger, v[k][j], x) for k, x in enumerate(vector)]
    return value, vector


@jax.custom_jvp
def largest_eigenvalue(matrix: jax.Array) -> jax.Array:
    """lambda_max [...] of the symmetric part of ``matrix`` [..., L, L], in its dtype (module docstring)."""
    return _largest_pair(matrix)[0]


@largest_eigenvalue.defjvp
def _largest_eigenvalue_jvp(primals, tangents):
    (matrix,), (d_matrix,) = primals, tangents
    value, vector = _largest_pair(matrix)
    size = matrix.shape[-1]
    d_value = sum(vector[i] * vector[j] * d_matrix[..., i, j] for i in range(size) for j in range(size))
    return value, d_value


__all__ = ["EXTRA_SWEEPS", "largest_eigenvalue"]
