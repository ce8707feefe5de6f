"""The rules of ablation v3 (:mod:`nash_mhc.study.ablation3`), as pure functions of run results.

Kept apart from the orchestration so that each rule is tested on made-up results (tests/test_study.py):

- :func:`best_rate`: a variant's learning rate is the one with the lowest *mean over seeds* of the selection
  split's bits per byte; a rate where any seed diverged (or is missing) is never chosen; a tie goes to the
  smaller rate.
- :func:`grow_grid`: the grid of one variant grows by one rate on a side (:func:`next_rate`, the 1-3 ladder: 1e-2
  -> 3e-2 -> 1e-1, 1e-3 -> 3e-4 -> 1e-4) while its best rate sits on the grid's edge, until the best is interior,
  :data:`MAX_EXTRA_RATES` rates have been added or the next rate would leave [:data:`LR_FLOOR`, :data:`LR_CEILING`]
  (a grid where every rate diverged grows downwards under the same limits).
- :func:`paired`: differences A - B paired by seed, their mean, standard error and 95 % t-interval; *null*
  when the interval includes 0.
- :func:`wallclock_step` and :func:`checkpoint_at_or_before`: the equal-wall-clock point.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

MAX_EXTRA_RATES = 3  # the hard limit of grid growth: at most this many rates added to a variant's grid
LR_FLOOR, LR_CEILING = 1e-5, 0.3  # and never a rate outside these
MISSING = object()  # lookup's answer for a (rate, seed) that has not run yet

# Two-sided 95 % quantiles of Student's t for 1..30 degrees of freedom (then the normal's 1.96).
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def best_rate(cells: dict[float, list[Any]]) -> tuple[float | None, dict[float, float | None]]:
    """(the chosen rate, {rate: mean over seeds}) from ``{rate: [selection bits per byte of each seed]}``.

    A rate whose list holds a non-finite value or None (a diverged seed) has mean None and is never chosen; a
    tie goes to the smaller rate; the chosen rate is None when no rate is eligible."""
    means = {lr: (sum(values) / len(values) if values and all(finite(v) for v in values) else None)
             for lr, values in cells.items()}
    eligible = {lr: m for lr, m in means.items() if m is not None}
    return (min(eligible, key=lambda lr: (eligible[lr], lr)) if eligible else None), means


def next_rate(lr: float, up: bool) -> float:
    """One step of the 1-3 ladder above (``up``) or below a rate (1e-2 -> 3e-2 -> 0.1; 1e-3 -> 3e-4 -> 1e-4);
    a rate off the ladder moves by sqrt(10), rounded to 3 significant digits."""
    exponent = math.floor(math.log10(lr) + 1e-9)
    mantissa = lr / 10.0**exponent
    if math.isclose(mantissa, 1.0, rel_tol=1e-6):
        value = 3 * 10.0**exponent if up else 3 * 10.0**(exponent - 1)
    elif math.isclose(mantissa, 3.0, rel_tol=1e-6):
        value = 10.0**(exponent + 1) if up else 10.0**exponent
    else:
        value = lr * math.sqrt(10) if up else lr / math.sqrt(10)
    return float(f"{value:.3g}")


def grow_grid(initial: Iterable[float], seeds: list[int], lookup: Callable[[float, int], Any],
              max_extra: int = MAX_EXTRA_RATES) -> dict[str, Any]:
    """A variant's grid under the growth rule, from its results: ``lookup(rate, seed)`` is the selection bits per
    byte of that run (None or non-finite for a diverged run, :data:`MISSING` for one not run yet).

    Returns ``{"grid": sorted rates to run, "best": rate or None, "means": {rate: mean or None}, "state": ...}``
    with state "pending" (some run of the grid has no result yet), "interior" (the best has a rate on each
    side), "edge: limit" (the best is on an edge but the grid may not grow: :data:`MAX_EXTRA_RATES` added, or
    the next rate leaves [LR_FLOOR, LR_CEILING]) or "all diverged" (and the grid may not grow). The best's side
    decides the direction; with one rate, the first step is down; a grid where every rate diverged grows down."""
    grid = sorted(set(initial))
    added = 0
    while True:
        cells = {lr: [lookup(lr, s) for s in seeds] for lr in grid}
        if any(v is MISSING for values in cells.values() for v in values):
            return {"grid": grid, "best": None, "means": {}, "state": "pending"}
        best, means = best_rate(cells)
        if best is not None and grid[0] < best < grid[-1]:
            return {"grid": grid, "best": best, "means": means, "state": "interior"}
        # on an edge (with one rate: down first); every rate diverged: down from the lowest
        new = next_rate(grid[0], up=False) if best is None else next_rate(best, up=best == grid[-1] != grid[0])
        if added >= max_extra or not LR_FLOOR <= new <= LR_CEILING or new in grid:
            return {"grid": grid, "best": best, "means": means, "state": "edge: limit" if best else "all diverged"}
        grid, added = sorted([*grid, new]), added + 1


def t975(dof: int) -> float:
    return T975[dof - 1] if dof <= len(T975) else 1.96


def paired(a: dict[int, float], b: dict[int, float]) -> dict[str, Any]:
    """A - B paired by seed over the seeds both have with a finite value: per-seed differences, their mean, the
    standard error of the mean (sample std / sqrt n), a 95 % t-interval, and ``null`` (True when the interval
    includes 0, None when there are fewer than 2 pairs and no interval)."""
    seeds = sorted(s for s in set(a) & set(b) if finite(a[s]) and finite(b[s]))
    diffs = {s: a[s] - b[s] for s in seeds}
    n = len(diffs)
    if n == 0:
        return {"n": 0, "per_seed": {}, "mean": None, "se": None, "interval": None, "null": None}
    mean = sum(diffs.values()) / n
    if n == 1:
        return {"n": 1, "per_seed": diffs, "mean": mean, "se": None, "interval": None, "null": None}
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs.values()) / (n - 1) / n)
    half = t975(n - 1) * se
    interval = [mean - half, mean + half]
    return {"n": n, "per_seed": diffs, "mean": mean, "se": se, "interval": interval,
            "null": interval[0] <= 0.0 <= interval[1]}


def wallclock_step(steps: int, base_step_time: float, step_time: float) -> int:
    """The step w at which a run whose median step takes ``step_time`` has spent the baseline's training time
    ``steps * base_step_time``: floor(S * t_base / t_v), at least 1 and at most S (a faster run is read at S)."""
    return max(1, min(steps, math.floor(steps * base_step_time / step_time + 1e-9)))


def checkpoint_at_or_before(available: Iterable[int], step: int) -> int | None:
    """The latest kept checkpoint at or before ``step`` (None when there is none): the equal-wall-clock point is
    read there, up to one checkpoint interval early."""
    return max((s for s in available if 0 < s <= step), default=None)


def coarse_weight(metrics: dict[str, Any], prefix: str = "scale_weight") -> float | None:
    """Sum over the coarse scales l >= 1 of ``<prefix>/<l>`` (averaged over layers), None without them."""
    values = [float(v) for k, v in metrics.items()
              if k.startswith(prefix + "/") and k.rsplit("/", 1)[-1].isdigit() and k.count("/") == 1
              and int(k.rsplit("/", 1)[-1]) >= 1]
    return sum(values) if values else None
