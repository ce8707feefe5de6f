"""What mHC's Sinkhorn projection is given and what it leaves, measured on a trained model without changing it.

For every sublayer's H_res on every token of a probe batch:

- the **logit spread**: max - min of the n x n pre-Sinkhorn logits ``alpha * a_res + b_res`` (the larger it is,
  the more iterations the projection needs to make the columns sum to 1);
- the **column-sum deviation** ``max_j |sum_i H[i, j] - 1|`` of the model's H_res (``sinkhorn_iters``
  iterations, 20 by default) and of the same logits projected with 200 iterations; rows are normalised last, so
  every row sums to 1 in both;
- the composite gains (:mod:`nash_mhc.study.gains`) of the 200-iteration matrices, next to the model's own.

The logits are read where the model passes them to :func:`nash_mhc.ops.sinkhorn.sinkhorn`: while the probe is
traced, :mod:`nash_mhc.layers.hyperconnection`'s reference to it is swapped for a wrapper that hands its input to
the host (an ordered ``jax.debug.callback``, in sublayer order) and returns the same projection, so the forward
pass is unchanged (the test checks that the captured logits, projected, are the model's H_res).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from nash_mhc.study.gains import composite_gains

CHECK_ITERS = 200


@contextmanager
def sinkhorn_inputs(captured: list[np.ndarray]) -> Iterator[None]:
    """While open, the hyper-connections' Sinkhorn projection is traced with a recording wrapper: a function
    compiled then appends every call's logits ``[tokens, n, n]`` to ``captured`` each time it runs."""
    import jax

    from nash_mhc.layers import hyperconnection

    original = hyperconnection.sinkhorn

    def recording(logits: Any, num_iters: int = 20) -> Any:
        jax.debug.callback(lambda x: captured.append(np.asarray(x)), logits, ordered=True)
        return original(logits, num_iters)

    hyperconnection.sinkhorn = recording
    try:
        yield
    finally:
        hyperconnection.sinkhorn = original


def make_probe(mode: str) -> Callable[[Any, Any], dict[str, list[float]]]:
    """``probe(model, tokens) -> {metric: [per sublayer]}`` for a residual ``mode``: the composite gains always;
    for mhc also the logit spread, column-sum deviations and 200-iteration gains; for mhc-lite the column-sum
    deviation of its (exactly doubly stochastic) H_res."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from nash_mhc.ops.sinkhorn import sinkhorn

    project = jax.jit(lambda z: sinkhorn(z, CHECK_ITERS))
    forward = eqx.filter_jit(lambda model, tokens: model(tokens, return_residual_maps=True).residual_maps)
    captured: list[np.ndarray] = []

    def probe(model: Any, tokens: Any) -> dict[str, list[float]]:
        captured.clear()
        with sinkhorn_inputs(captured):  # in force when ``forward`` is traced (its first call)
            maps = np.asarray(jax.device_get(forward(model, tokens)))  # [B, S, T, n, n]
            jax.effects_barrier()
        out = {k: v.tolist() for k, v in composite_gains(maps).items()}
        if mode in ("mhc", "mhc-lite"):
            out["colsum_dev"] = column_deviation(maps).tolist()
        if mode == "mhc":
            if len(captured) != maps.shape[1]:
                raise RuntimeError(f"captured {len(captured)} Sinkhorn inputs for {maps.shape[1]} sublayers")
            logits = np.stack(captured)  # [S, B*T, n, n] in sublayer order
            spread = logits.max(axis=(-1, -2)) - logits.min(axis=(-1, -2))
            out["logit_spread_max"], out["logit_spread_mean"] = spread.max(1).tolist(), spread.mean(1).tolist()
            batch, seq = maps.shape[0], maps.shape[2]
            checked = np.asarray(project(jnp.asarray(logits)))  # [S, B*T, n, n]
            checked = np.moveaxis(checked.reshape(len(logits), batch, seq, *logits.shape[-2:]), 0, 1)
            out["colsum_dev_200"] = column_deviation(checked).tolist()
            out.update({f"{k}_200": v.tolist() for k, v in composite_gains(checked).items()})
        return out

    return probe


def column_deviation(maps: np.ndarray) -> np.ndarray:
    """``[S]``: per sublayer, the largest ``|column sum - 1|`` of H_res over the tokens (maps ``[B, S, T, n, n]``)."""
    sums = maps.astype(np.float64).sum(axis=-2)  # [B, S, T, n]
    return np.abs(sums - 1.0).max(axis=(0, 2, 3))
