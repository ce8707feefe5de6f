"""Forward and backward gains of the composite residual mapping over depth (the mHC paper's Amax gains).

Every sublayer updates the residual streams as ``X <- H_res X + H_post y``, so the part of the stream state
that is carried through sublayers 1..l unchanged by the sublayers' outputs is ``P_l X_0`` with the composite

    P_l = H_l H_{l-1} ... H_1            (per token; H_k the k-th sublayer's n x n H_res)

Its forward gain is the largest absolute row sum ``max_i sum_j |P_l[i, j]|`` (the infinity norm: how much a
signal can grow on its way up) and its backward gain the largest absolute column sum ``max_j sum_i |P_l[i, j]|``
(the 1-norm, the infinity norm of the transpose that gradients pass through on the way down). Both are 1 for
every product of doubly stochastic matrices (mHC) and for the plain residual (n = 1, H = 1).
"""

from __future__ import annotations

import numpy as np
from beartype import beartype
from jaxtyping import Float, jaxtyped

GAIN_KEYS = ("forward_max", "forward_mean", "backward_max", "backward_mean")


@jaxtyped(typechecker=beartype)
def composite_gains(maps: Float[np.ndarray, "batch sublayers seq n n"]) -> dict[str, Float[np.ndarray, " sublayers"]]:
    """Gains of ``P_l`` for every depth l = 1..S: ``{forward,backward}_{max,mean}``, each ``[S]``.

    ``maps`` are the per-token H_res of the S sublayers in order (``ModelOutput.residual_maps``). Products
    are accumulated in float64; ``*_max`` / ``*_mean`` are the max / mean over the batch's B*T tokens.
    """
    maps = maps.astype(np.float64)
    batch, sublayers, seq, n, _ = maps.shape
    tokens = np.moveaxis(maps, 1, 0).reshape(sublayers, batch * seq, n, n)  # [S, B*T, n, n]
    product = np.broadcast_to(np.eye(n), (batch * seq, n, n))
    out = {key: np.empty(sublayers) for key in GAIN_KEYS}
    for depth in range(sublayers):
        product = tokens[depth] @ product  # P_l = H_l P_{l-1}
        magnitude = np.abs(product)
        forward = magnitude.sum(axis=-1).max(axis=-1)  # [B*T] largest row sum
        backward = magnitude.sum(axis=-2).max(axis=-1)  # [B*T] largest column sum
        out["forward_max"][depth], out["forward_mean"][depth] = forward.max(), forward.mean()
        out["backward_max"][depth], out["backward_mean"][depth] = backward.max(), backward.mean()
    return out
