"""The stability study's protocol answers (issue 73, part 5), as pure functions of its run records.

Per depth and residual mode, on each finished run's held-out ``eval_bits_per_byte`` (the same windows for every
run, :mod:`nash_mhc.study.stability_runs`):

- the best rate: :func:`~nash_mhc.study.ablation3_protocol.best_rate` (lowest mean over seeds; a rate with a
  diverged, missing or unevaluated seed is never chosen; a tie goes to the smaller rate), with its mean ± SE;
- the usable range (:func:`usable_rates`): the rates at which no seed diverged and whose mean is within
  :data:`TOLERANCE_BPB` of the best mean; its width (:func:`width`) is max / min of those rates; :func:`edge`
  says whether the best sits on the grid's edge (the true best may then lie outside the grid);
- the composite gains at full depth at the last step, at the best rate, as median [min, max] over seeds;
- paired differences vs plain by seed (:func:`~nash_mhc.study.ablation3_protocol.paired`), each mode at its own
  best rate and at every rate of the grid.

Selection and report read the same held-out batches, so the best rate's figure is optimistic by the selection.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from nash_mhc.study import report
from nash_mhc.study.ablation3_protocol import best_rate, finite, paired
from nash_mhc.study.ablation3_report import verdict

TOLERANCE_BPB = 0.05  # a rate is usable when its mean is within this many bits per byte of the best mean
MEASURE = "eval_bits_per_byte"
GAIN_KEYS = ("forward_final", "forward_mean_final", "backward_final", "backward_mean_final")
GAIN_LABELS = ("fwd final (max)", "fwd final (mean)", "bwd final (max)", "bwd final (mean)")
BASELINE = "plain"

# a seed's point: {"status": ..., MEASURE: value or absent, and the GAIN_KEYS}; None for a run not (yet) recorded
Cells = dict[float, dict[int, dict[str, Any] | None]]


def value(point: dict[str, Any] | None) -> float | None:
    """The held-out bits per byte of a finished run; None for a missing, diverged or unevaluated one."""
    if point is None or point.get("status") != "finished" or not finite(point.get(MEASURE)):
        return None
    return float(point[MEASURE])


def mean_se(values: list[float]) -> tuple[float, float | None]:
    """Mean and standard error of the mean (sample std / sqrt n; None for one value)."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values))


def usable_rates(means: dict[float, float | None], best: float | None,
                 tolerance: float = TOLERANCE_BPB) -> list[float]:
    """The rates whose mean exists (no seed diverged or missing) and is within ``tolerance`` of the best's."""
    if best is None:
        return []
    return sorted(lr for lr, m in means.items() if m is not None and m <= means[best] + tolerance)


def width(usable: list[float]) -> float | None:
    """max / min of the usable rates (1.0 for one rate, None for none)."""
    return max(usable) / min(usable) if usable else None


def edge(grid: list[float], best: float | None) -> str | None:
    """"low" or "high" when the best is the grid's smallest or largest rate, "only rate" for a one-rate grid,
    None when it is interior (or there is no best)."""
    grid = sorted(grid)
    if best is None or grid[0] < best < grid[-1]:
        return None
    if len(grid) == 1:
        return "only rate"
    return "low" if best == grid[0] else "high"


def spread(values: list[float]) -> list[float] | None:
    """[median, min, max] over the finite values, None without any."""
    values = [v for v in values if finite(v)]
    return [float(np.median(values)), min(values), max(values)] if values else None


def answer(cells: Cells, tolerance: float = TOLERANCE_BPB) -> dict[str, Any]:
    """One depth and residual mode: per-rate means (and why a rate has none), the best rate, its mean ± SE,
    the usable rates, their width, the edge flag and the gains at the best rate."""
    values = {lr: {s: value(p) for s, p in seeds.items()} for lr, seeds in cells.items()}
    best, means = best_rate({lr: list(v.values()) for lr, v in values.items()})
    rates = []
    for lr in sorted(cells):
        seeds = cells[lr]
        rates.append({"rate": lr, "mean": means[lr],
                      "se": mean_se(list(values[lr].values()))[1] if means[lr] is not None else None,
                      "seeds": len(seeds),
                      "missing": sum(p is None for p in seeds.values()),
                      "diverged": sum(p is not None and p.get("status") == "diverged" for p in seeds.values()),
                      "unevaluated": sum(p is not None and p.get("status") == "finished" and value(p) is None
                                         for p in seeds.values())})
    usable = usable_rates(means, best, tolerance)
    at_best = [p for p in cells[best].values() if p is not None] if best is not None else []
    mean, se = mean_se([v for v in values[best].values() if v is not None]) if best is not None else (None, None)
    return {"best_rate": best, "best_mean": mean, "best_se": se, "rates": rates, "usable_rates": usable,
            "width": width(usable), "edge": edge(list(cells), best),
            "gains": {k: spread([p.get(k, math.nan) for p in at_best]) for k in GAIN_KEYS}}


def versus(cells: Cells, base: Cells, mine: dict[str, Any], theirs: dict[str, Any]) -> list[dict[str, Any]]:
    """Paired differences (this mode - the baseline) in held-out bits per byte, by seed: each at its own best
    rate, then at every rate both have; with the number of seeds each side lost to divergence there."""
    def by_seed(c: Cells, lr: float | None) -> dict[int, float]:
        return {s: v for s, p in (c.get(lr) or {}).items() if (v := value(p)) is not None}

    def diverged(c: Cells, lr: float | None) -> int:
        return sum(p is not None and p.get("status") == "diverged" for p in (c.get(lr) or {}).values())

    def entry(at: str, a: float | None, b: float | None) -> dict[str, Any]:
        return {"at": at, "rate": a, "baseline_rate": b, "diverged": diverged(cells, a),
                "baseline_diverged": diverged(base, b), **paired(by_seed(cells, a), by_seed(base, b))}

    return [entry("own best", mine["best_rate"], theirs["best_rate"]),
            *(entry("common rate", lr, lr) for lr in sorted(set(cells) & set(base)))]


def protocol(table: dict[tuple[int, str], Cells], tolerance: float = TOLERANCE_BPB) -> dict[str, Any] | None:
    """Every answer from ``{(depth, residual): {rate: {seed: point or None}}}``; None when no record carries
    the held-out measure (older studies), so the section is left out."""
    if not any(p is not None and MEASURE in p for c in table.values() for s in c.values() for p in s.values()):
        return None
    answers = {key: answer(cells, tolerance) for key, cells in table.items()}
    depths = sorted({d for d, _ in table})
    rows = []
    for depth in depths:
        modes = [r for d, r in table if d == depth]
        row = {"depth": depth, "residuals": [{"residual": r, **answers[(depth, r)]} for r in modes],
               "vs_plain": []}
        if (depth, BASELINE) in table:
            row["vs_plain"] = [{"residual": r, **d} for r in modes if r != BASELINE
                               for d in versus(table[(depth, r)], table[(depth, BASELINE)], answers[(depth, r)],
                                               answers[(depth, BASELINE)])]
        rows.append(row)
    return {"measure": MEASURE, "tolerance_bits_per_byte": tolerance, "selection_split": "held-out (eval)",
            "report_split": "held-out (eval), the same batches as the selection", "depths": rows}


def _rate(lr: float | None) -> str:
    return "-" if lr is None else f"{lr:g}"


def _cell(rate: dict[str, Any]) -> str:
    if rate["mean"] is not None:
        return f"{rate['mean']:.4f}" + ("" if rate["se"] is None else f" ± {rate['se']:.4f}")
    why = [f"{rate[k]}/{rate['seeds']} {k}" for k in ("diverged", "missing", "unevaluated") if rate[k]]
    return "none (" + ", ".join(why or ["no seed"]) + ")"


def _width(usable: list[float], ratio: float | None) -> str:
    if ratio is None:
        return "-"
    return "1 rate" if len(usable) == 1 else f"{ratio:.3g}x"


def _spread(value: list[float] | None) -> str:
    return "n/a" if value is None else f"{value[0]:.3g} [{value[1]:.3g}, {value[2]:.3g}]"


def _diverged(d: dict[str, Any]) -> str:
    """The seeds a paired difference leaves out because they diverged, said beside it."""
    parts = [f"{d['residual']} {d['diverged']}"] * bool(d["diverged"])
    parts += [f"plain {d['baseline_diverged']}"] * bool(d["baseline_diverged"])
    return f" (diverged seeds left out: {', '.join(parts)})" if parts else ""


def lines(found: dict[str, Any], grid: list[float]) -> list[str]:
    """The "## Protocol answers" section of report.md."""
    tol = found["tolerance_bits_per_byte"]
    out = ["## Protocol answers", "",
           "Measure: each finished run's bits per byte on the held-out evaluation batches at its last step (the same "
           "windows for every run). **Protocol:** per depth and residual mode, the best rate has the lowest mean "
           "over seeds; a rate where a seed diverged, is missing or was not evaluated is never chosen; a tie goes "
           f"to the smaller rate. The usable range is the rates where no seed diverged and the mean is within "
           f"{tol:g} bits/byte of the best mean; its width is max / min of those rates. **Selection and report "
           "use the same held-out batches**, so the best rate's figure is optimistic by the selection. Differences "
           "vs plain are paired by seed, mean ± SE with a 95 % t-interval, **null** where the interval includes 0 "
           "(A - B < 0: A lower, i.e. better).", "",
           f"### Best rate and usable rate range (mean ± SE over seeds; tolerance {tol:g} bits/byte)", ""]
    body = []
    for row in found["depths"]:
        for r in row["residuals"]:
            by_rate = {x["rate"]: x for x in r["rates"]}
            body.append([str(row["depth"]), r["residual"],
                         *(_cell(by_rate[lr]) if lr in by_rate else "-" for lr in grid), _rate(r["best_rate"]),
                         ", ".join(map(_rate, r["usable_rates"])) or "-", _width(r["usable_rates"], r["width"]),
                         {None: "no", "only rate": "only rate"}.get(r["edge"], f"yes ({r['edge']})")
                         if r["best_rate"] is not None else "-"])
    out += report.markdown_table(["depth", "residual", *(f"lr {lr:g}" for lr in grid), "best rate",
                                  "usable rates", "width", "best on the grid's edge"], body)
    out += ["", "A best on the grid's edge means the true best may lie outside the grid.", "",
            "### Composite gains at the best rate (full depth, last step; median [min, max] over seeds)", ""]
    body = [[str(row["depth"]), r["residual"], _rate(r["best_rate"]), *(_spread(r["gains"][k]) for k in GAIN_KEYS)]
            for row in found["depths"] for r in row["residuals"]]
    out += report.markdown_table(["depth", "residual", "best rate", *GAIN_LABELS], body)
    out += ["", "### Paired differences vs plain (held-out bits per byte, A - plain)", ""]
    body = [[str(row["depth"]), f"{d['residual']} - plain",
             (f"own best ({_rate(d['rate'])} vs {_rate(d['baseline_rate'])})" if d["at"] == "own best"
              else f"lr {d['rate']:g}"), verdict(d) + _diverged(d)]
            for row in found["depths"] for d in row["vs_plain"]]
    out += report.markdown_table(["depth", "A - B", "rates", "paired difference: mean ± SE [95 % t-interval]"],
                                 body) if body else ["(plain is not in this study's modes)"]
    return [*out, ""]
