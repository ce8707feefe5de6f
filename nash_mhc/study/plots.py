"""The studies' figures (matplotlib, imported here only: ``pip install 'nash-mhc[study]'``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from nash_mhc.study.runner import StudyError

RESIDUAL_COLORS = {"plain": "tab:gray", "hc": "tab:red", "mhc": "tab:blue", "mhc-lite": "tab:green"}


def pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise StudyError("the study draws its figures with matplotlib: pip install 'nash-mhc[study]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def scaling_figure(results: list[dict[str, Any]], fits: dict[str, Any], variants: list[str], path: Path) -> None:
    """Held-out bits per byte against training FLOPs (log-log): each run a point, each variant's fitted power law
    solid over its fitted range and dashed out to 10x beyond it."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 5.2))
    colors = plt.get_cmap("tab10")
    for i, variant in enumerate(variants):
        mine = sorted((r["compute"], r["bits_per_byte"]) for r in results
                      if r["variant"] == variant and r["status"] == "finished" and r["bits_per_byte"])
        if mine:
            ax.plot(*zip(*mine, strict=True), "o", color=colors(i), label=variant)
        fit = fits.get(variant)
        if fit is not None:
            low, high = fit.compute_range
            inside = np.geomspace(low, high, 50)
            beyond = np.geomspace(high, 10 * high, 20)
            ax.plot(inside, fit.predict(inside), color=colors(i),
                    label=f"{variant}: {fit.a:.3g} C^-{fit.slope:.3f}")
            ax.plot(beyond, fit.predict(beyond), color=colors(i), linestyle="--", linewidth=0.9)
    ax.set(xscale="log", yscale="log", xlabel="training FLOPs C (FLOPs/token x tokens)",
           ylabel="held-out bits per byte", title="scaling: fits solid, extrapolation dashed")
    for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):  # plain numbers within a decade
        axis(plt.FormatStrFormatter("%.2f"))
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def gain_scale(ax: Any, values: list[float]) -> None:
    """Log y axis for gains spread over more than a factor 2; otherwise linear, at least 0.95-1.05 (so gains
    that are 1 up to rounding do not fill the panel with noise)."""
    finite = [v for v in values if np.isfinite(v) and v > 0]
    if finite and max(finite) / min(finite) > 2:
        ax.set_yscale("log")
    else:
        low, high = (min(finite), max(finite)) if finite else (1.0, 1.0)
        ax.set_ylim(min(0.95, low - 0.05 * (high - low)), max(1.05, high + 0.05 * (high - low)))


def _by_residual(records: list[dict[str, Any]], residuals: list[str]) -> dict[str, list[dict[str, Any]]]:
    return {r: [rec for rec in records if rec["residual"] == r] for r in residuals}


def stability_gains_figure(records: list[dict[str, Any]], residuals: list[str], path: Path, title: str) -> None:
    """Forward (top) and backward (bottom) gain of P_l against depth l, one column per residual mode, one line
    per probed step: max over tokens solid, mean over tokens dashed, each the median over seeds."""
    plt = pyplot()
    groups = _by_residual(records, residuals)
    fig, axes = plt.subplots(2, len(residuals), figsize=(4.6 * len(residuals), 7), squeeze=False, sharex=True)
    for col, residual in enumerate(residuals):
        runs = groups[residual]
        steps = sorted({int(s) for rec in runs for s in rec["probes"]})
        colors = plt.cm.viridis(np.linspace(0, 0.9, len(steps)))  # none for a mode with no finished run
        for row, direction in enumerate(("forward", "backward")):
            ax = axes[row, col]
            plotted: list[float] = []
            for color, step in zip(colors, steps, strict=True):
                probed = [rec["probes"][str(step)] for rec in runs if str(step) in rec["probes"]]
                if not probed:
                    continue
                top = np.median([p[f"{direction}_max"] for p in probed], axis=0)
                mean = np.median([p[f"{direction}_mean"] for p in probed], axis=0)
                depth = np.arange(1, len(top) + 1)
                ax.plot(depth, top, color=color, label=f"step {step}")
                ax.plot(depth, mean, color=color, linestyle="--", linewidth=0.9)
                plotted += [*top, *mean]
            ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
            gain_scale(ax, plotted)
            ax.set(title=f"{residual}: {direction} gain", xlabel="sublayer l (2 per layer)" if row else None,
                   ylabel=f"{direction} gain of H_l ... H_1" if col == 0 else None)
            ax.grid(alpha=0.3)
        if steps:
            axes[0, col].legend(fontsize=7, title="solid: max, dashed: mean over tokens", title_fontsize=7)
    fig.suptitle(f"composite residual mapping over depth ({title}; median over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def stability_curves_figure(records: list[dict[str, Any]], residuals: list[str], path: Path, title: str,
                            smooth: int) -> None:
    """Training loss and gradient norm per step for each residual mode: the mean over seeds of a trailing
    ``smooth``-step average, with the seeds' min-max band."""
    plt = pyplot()
    fig, (loss_ax, grad_ax) = plt.subplots(1, 2, figsize=(12, 4.4))
    for residual, runs in _by_residual(records, residuals).items():
        for ax, key in ((loss_ax, "loss"), (grad_ax, "grad_norm")):
            curves = [np.asarray(rec[key], dtype=np.float64) for rec in runs if rec[key]]
            if not curves:
                continue
            length = min(len(c) for c in curves)
            window = min(smooth, length)
            kernel = np.ones(window) / window
            smoothed = np.array([np.convolve(c[:length], kernel, mode="valid") for c in curves])
            steps = np.arange(window, length + 1)
            color = RESIDUAL_COLORS.get(residual)
            ax.plot(steps, smoothed.mean(0), color=color, label=f"{residual} ({len(curves)} seeds)")
            ax.fill_between(steps, smoothed.min(0), smoothed.max(0), color=color, alpha=0.15, linewidth=0)
    loss_ax.set(xlabel="step", ylabel="training loss (nats/token)", title=f"loss ({title})")
    grad_ax.set(xlabel="step", ylabel="gradient norm (before clipping)", yscale="log", title=f"grad norm ({title})")
    for ax in (loss_ax, grad_ax):
        ax.legend(fontsize=8, title=f"{smooth}-step average", title_fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def stability_sweep_figure(rows: list[dict[str, Any]], path: Path) -> None:
    """Final full-depth forward and backward gains (median, [min, max] over seeds) and final loss (mean ± std)
    against depth: one line per (residual, learning rate)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    lrs = sorted({r["learning_rate"] for r in rows})
    shades = dict(zip(lrs, np.linspace(0.45, 0.95, len(lrs)) if len(lrs) > 1 else [0.8], strict=True))
    styles = {"plain": ":", "hc": "-", "mhc": "--", "mhc-lite": "-."}
    for (residual, lr) in dict.fromkeys((r["residual"], r["learning_rate"]) for r in rows):
        mine = sorted((r for r in rows if (r["residual"], r["learning_rate"]) == (residual, lr) and r["seeds"]),
                      key=lambda r: r["depth"])
        if not mine:
            continue
        depth = [r["depth"] for r in mine]
        color = plt.get_cmap({"plain": "Greys", "hc": "Reds", "mhc": "Blues"}.get(residual, "Greens"))(shades[lr])
        for ax, key in zip(axes, ("forward_final", "backward_final", "final_loss"), strict=True):
            center = np.array([r[key][0] for r in mine])
            if key == "final_loss":  # mean ± std
                errors = np.array([0.0 if np.isnan(r[key][1]) else r[key][1] for r in mine])
            else:  # median and [min, max]
                errors = np.array([[c - r[key][1] for c, r in zip(center, mine, strict=True)],
                                   [r[key][2] - c for c, r in zip(center, mine, strict=True)]])
            ax.errorbar(depth, center, yerr=errors, color=color, linestyle=styles.get(residual, "-"), marker="o",
                        markersize=3, capsize=2, label=f"{residual} lr {lr:g}")
    axes[0].set(ylabel="forward gain at full depth (max over tokens)")
    axes[1].set(ylabel="backward gain at full depth (max over tokens)")
    axes[2].set(ylabel="final training loss")
    depths = sorted({r["depth"] for r in rows})
    for ax, key in zip(axes, ("forward_final", "backward_final", None), strict=True):
        if key:
            gain_scale(ax, [r[key][0] for r in rows if r["seeds"]])
        ax.set(xlabel="layers")
        ax.set_xscale("log", base=2)
        ax.set_xticks(depths, [str(d) for d in depths])
        ax.xaxis.set_minor_locator(plt.NullLocator())
        ax.grid(alpha=0.3)
    axes[2].legend(fontsize=7, ncol=2)
    fig.suptitle("end of training: gains as median [min, max], loss as mean ± std over seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
