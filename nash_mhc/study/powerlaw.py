"""Power-law fits of held-out bits per byte against training compute, and where two fitted curves cross.

The fitted form is a pure power law, linear in log-log coordinates:

    ln bpb = ln a - b ln C        (bpb = a C^-b; C training FLOPs)

fitted by ordinary least squares, with the parameters' covariance ``s^2 (X^T X)^-1`` from the residual variance
``s^2 = RSS / (n - 2)``. Not the saturating ``a C^-b + c``: with 4-5 sizes over two decades of compute the floor
``c`` is not identified (it trades off against ``a`` and ``b``; its covariance is unbounded on such data), while
the log-log line has two parameters and n - 2 residual degrees of freedom. The price: a floor, if the curves
have one, bends them, so a crossing predicted beyond the fitted range is an extrapolation.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

CROSSING_SAMPLES = 20_000  # parametric-bootstrap draws behind the crossing's interval


@dataclasses.dataclass(frozen=True)
class Fit:
    """``ln bpb = intercept - slope * ln C``: the parameters, their 2 x 2 covariance (intercept, slope) and the
    fitted compute range."""

    intercept: float
    slope: float
    covariance: tuple[tuple[float, float], tuple[float, float]]
    points: int
    compute_range: tuple[float, float]
    rss: float

    @property
    def slope_se(self) -> float:
        return math.sqrt(self.covariance[1][1])

    @property
    def intercept_se(self) -> float:
        return math.sqrt(self.covariance[0][0])

    @property
    def a(self) -> float:
        return math.exp(self.intercept)

    def predict(self, compute: float | np.ndarray) -> float | np.ndarray:
        return np.exp(self.intercept - self.slope * np.log(compute))

    def to_dict(self) -> dict[str, object]:
        return {"form": "bpb = a * C^-b (least squares of ln bpb on ln C)", "a": self.a, "b": self.slope,
                "b_se": self.slope_se, "ln_a": self.intercept, "ln_a_se": self.intercept_se,
                "covariance_ln_a_b": self.covariance, "points": self.points,
                "compute_range": self.compute_range, "rss": self.rss}


def fit_power_law(compute: list[float], bpb: list[float]) -> Fit:
    """Least-squares fit of ``ln bpb`` on ``ln C`` (at least 3 points, so the covariance is defined)."""
    x, y = np.log(np.asarray(compute, np.float64)), np.log(np.asarray(bpb, np.float64))
    if len(x) < 3 or len(set(x.tolist())) < 2:
        raise ValueError(f"a power-law fit needs at least 3 points at 2 or more compute values, got {len(x)}")
    design = np.stack([np.ones_like(x), -x], axis=1)
    (intercept, slope), *_ = np.linalg.lstsq(design, y, rcond=None)
    residual = y - design @ np.array([intercept, slope])
    rss = float(residual @ residual)
    covariance = rss / (len(x) - 2) * np.linalg.inv(design.T @ design)
    return Fit(float(intercept), float(slope), tuple(map(tuple, covariance.tolist())), len(x),
               (float(min(compute)), float(max(compute))), rss)


def crossing(first: Fit, second: Fit, *, seed: int = 0) -> dict[str, object]:
    """Where the two fitted lines cross: ``ln C* = (ln a1 - ln a2) / (b1 - b2)`` (None when they are parallel to
    float precision); the z-score of the slope
    difference; and the 16th-84th percentile of C* over parametric-bootstrap draws of both fits' parameters
    (independent Gaussians with the fits' covariances; draws whose lines do not cross are left out)."""
    gap = first.slope - second.slope
    se = math.sqrt(first.slope_se**2 + second.slope_se**2)
    z = gap / se if se > 0 else math.copysign(math.inf, gap) if gap else 0.0
    log_point = (first.intercept - second.intercept) / gap if gap else math.inf
    point = math.exp(log_point) if abs(log_point) < 700 else None  # None: parallel to float precision
    rng = np.random.default_rng(seed)
    draws = [rng.multivariate_normal([f.intercept, f.slope], np.asarray(f.covariance), CROSSING_SAMPLES)
             for f in (first, second)]
    slopes = draws[0][:, 1] - draws[1][:, 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        log_c = (draws[0][:, 0] - draws[1][:, 0]) / slopes
    log_c = log_c[np.isfinite(log_c)]
    low, high = (np.percentile(log_c, [16, 84]) if len(log_c) else (math.nan, math.nan))
    lo_c, hi_c = min(first.compute_range[0], second.compute_range[0]), max(first.compute_range[1],
                                                                            second.compute_range[1])
    return {"compute": point, "slope_difference": gap, "slope_difference_z": z,
            "inside_fitted_range": point is not None and lo_c <= point <= hi_c,
            "ahead_of_fitted_range": point is not None and point > hi_c,
            "interval_16_84": (math.exp(low), math.exp(high)) if max(abs(low), abs(high)) < 700 else None}
