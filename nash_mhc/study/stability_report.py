"""The stability study's outputs: per-setting summaries, results.json, report.md and three figures."""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any

import numpy as np

from nash_mhc.config import ModelConfig
from nash_mhc.study import plots, report, stability_protocol
from nash_mhc.study.runner import mean_std, pm, write_json
from nash_mhc.study.stability_runs import Run, Settings
from nash_mhc.study.variants import ATTENTION_LABELS

SMOOTH = 10  # steps of the moving average behind "loss rise"
FINAL_FRACTION = 0.1  # "final loss": mean over this last fraction of a run's steps
SPREAD_KEYS = ("forward_final", "backward_final", "forward_mean_final", "backward_mean_final", "logit_spread_final",
               "logit_spread_mean_final", "colsum_dev_final", "colsum_dev_200_final", "backward_200_final",
               "backward_mean_200_final")  # per-run finals summarised as median [min, max] over seeds
PAPER_LEARNING_RATES = ("The mHC paper (arXiv 2512.24880, Table 5) trains its 3B, 9B and 27B models at base learning "
                        "rates 8.6e-4, 5.9e-4 and 4.0e-4 (9.0e-4 for 3B on 1T tokens), AdamW with step decay")


def moving_average(values: list[float], window: int = SMOOTH) -> np.ndarray:
    """Trailing mean over up to ``window`` steps (shorter at the start)."""
    array = np.asarray(values, dtype=np.float64)
    if not len(array):
        return array
    sums = np.cumsum(np.insert(array, 0, 0.0))
    idx = np.arange(1, len(array) + 1)
    low = np.maximum(idx - window, 0)
    return (sums[idx] - sums[low]) / (idx - low)


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max) over seeds: gains spread over orders of magnitude, where a mean ± std says little."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return math.nan, math.nan, math.nan
    return float(np.median(finite)), min(finite), max(finite)


def range_text(value: tuple[float, float, float]) -> str:
    """``median [min, max]`` with 3 significant digits."""
    median, low, high = value
    return "n/a" if math.isnan(median) else f"{median:.3g} [{low:.3g}, {high:.3g}]"


def run_summary(record: dict[str, Any], settings: Settings) -> dict[str, float]:
    """Scalars of one run: final loss, loss rise, max grad norm, final and peak gains at full depth."""
    losses = np.asarray(record["loss"], dtype=np.float64)
    finite = losses[np.isfinite(losses)]
    tail = finite[-max(1, int(FINAL_FRACTION * len(finite))):] if len(finite) else finite
    smooth = moving_average(list(finite))
    above = (smooth - np.minimum.accumulate(smooth))[settings.warmup_steps:] if len(smooth) else smooth
    rise = float(above.max()) if len(above) else math.nan
    norms = np.asarray(record["grad_norm"], dtype=np.float64)
    norms = norms[np.isfinite(norms)]
    probes = record["probes"]
    last = probes[max(probes, key=int)]

    def final(key: str, how: Any = max) -> float:  # at the last probe; NaN for a mode that does not record it
        return float(how(last[key])) if key in last else math.nan

    return {
        "final_loss": float(tail.mean()) if len(tail) else math.nan, "loss_rise": rise,
        "max_grad_norm": float(norms.max()) if len(norms) else math.nan,
        "forward_final": last["forward_max"][-1], "backward_final": last["backward_max"][-1],
        "forward_mean_final": last["forward_mean"][-1], "backward_mean_final": last["backward_mean"][-1],
        "forward_peak": max(max(p["forward_max"]) for p in probes.values()),
        "backward_peak": max(max(p["backward_max"]) for p in probes.values()),
        "logit_spread_final": final("logit_spread_max"), "logit_spread_mean_final": final("logit_spread_mean"),
        "colsum_dev_final": final("colsum_dev"), "colsum_dev_200_final": final("colsum_dev_200"),
        "backward_200_final": final("backward_max_200", lambda v: v[-1]),
        "backward_mean_200_final": final("backward_mean_200", lambda v: v[-1]),
    }


def setting_rows(runs: list[Run], results: dict[Run, dict[str, Any]], settings: Settings) -> list[dict[str, Any]]:
    """One row per (depth, learning rate, residual): mean ± std over seeds, and the worst seed's values."""
    keys = list(dict.fromkeys((r.depth, r.learning_rate, r.residual) for r in runs))
    rows = []
    for depth, lr, residual in keys:
        done = [results[r] for r in runs if (r.depth, r.learning_rate, r.residual) == (depth, lr, residual)
                and r in results]
        summaries = [run_summary(record, settings) for record in done]
        finished = [s for s, record in zip(summaries, done, strict=True) if record["status"] == "finished"]

        def stat(name: str, of: list[dict[str, float]]) -> tuple[float, float]:
            return mean_std([s[name] for s in of])

        def worst(name: str, of: list[dict[str, float]]) -> float:
            values = [s[name] for s in of if math.isfinite(s[name])]
            return max(values) if values else math.nan

        rows.append({
            "depth": depth, "learning_rate": lr, "residual": residual, "seeds": len(done),
            "diverged": sum(r["status"] == "diverged" for r in done),
            "with_nonfinite_steps": sum(bool(r["nonfinite_steps"]) for r in done),
            "final_loss": stat("final_loss", finished), "loss_rise_max": worst("loss_rise", summaries),
            "max_grad_norm": worst("max_grad_norm", summaries),
            **{key: spread([x[key] for x in summaries]) for key in SPREAD_KEYS},
            "forward_peak": worst("forward_peak", summaries), "backward_peak": worst("backward_peak", summaries),
            "step_time_s": mean_std([r["step_time_s"] for r in done]),
        })
    return rows


def protocol_table(runs: list[Run], results: dict[Run, dict[str, Any]],
                   settings: Settings) -> dict[tuple[int, str], stability_protocol.Cells]:
    """``{(depth, residual): {rate: {seed: point or None}}}`` for :func:`stability_protocol.protocol`: a point is
    a run's status, held-out bits per byte (when recorded) and final gains; None for a run not recorded yet."""
    table: dict[tuple[int, str], stability_protocol.Cells] = {}
    for run in runs:
        record = results.get(run)
        point = None if record is None else {
            "status": record["status"], **{k: v for k, v in record.items() if k == stability_protocol.MEASURE},
            **{k: v for k, v in run_summary(record, settings).items() if k in stability_protocol.GAIN_KEYS}}
        table.setdefault((run.depth, run.residual), {}).setdefault(run.learning_rate, {})[run.seed] = point
    return table


def verdict(rows: list[dict[str, Any]], settings: Settings, args: argparse.Namespace) -> list[str]:
    """Plain sentences built from the rows: divergences, loss rises and gains per residual mode."""
    lines = []
    for residual in args.residual:
        mine = [r for r in rows if r["residual"] == residual and r["seeds"]]
        if not mine:
            continue
        runs = sum(r["seeds"] for r in mine)
        diverged = sum(r["diverged"] for r in mine)
        nonfinite = sum(r["with_nonfinite_steps"] for r in mine)
        rise = max(mine, key=lambda r: -math.inf if math.isnan(r["loss_rise_max"]) else r["loss_rise_max"])
        fwd = max(mine, key=lambda r: r["forward_peak"])
        bwd = max(mine, key=lambda r: r["backward_peak"])
        lines.append(
            f"- **{residual}**: {diverged} of {runs} runs diverged ({settings.max_nonfinite_steps} non-finite "
            f"steps in a row), {nonfinite} had a non-finite step; the largest rise of the {SMOOTH}-step average "
            f"loss above its running minimum after warmup is {rise['loss_rise_max']:.3f} nats "
            f"(depth {rise['depth']}, lr {rise['learning_rate']:g}); the largest composite gain seen is "
            f"{fwd['forward_peak']:.3g} forward (depth {fwd['depth']}, lr {fwd['learning_rate']:g}) and "
            f"{bwd['backward_peak']:.3g} backward (depth {bwd['depth']}, lr {bwd['learning_rate']:g}).")
    hc = [r for r in rows if r["residual"] == "hc" and r["seeds"]]
    if hc and not any(r["diverged"] or r["with_nonfinite_steps"] for r in hc):
        lines += ["", f"No hc run diverged or produced a non-finite loss at any setting reached here (depths "
                  f"{', '.join(map(str, args.depths))}; learning rates "
                  f"{', '.join(f'{lr:g}' for lr in args.learning_rates)}; {settings.steps} steps). The tables "
                  "below and `sweep.png` show how its composite gains change with depth and learning rate."]
    mhc = [r for r in rows if r["residual"] == "mhc" and r["seeds"]]
    if mhc:
        top = max(mhc, key=lambda r: r["backward_final"][0])
        lines += ["", f"mHC (`sinkhorn_iters` = 20): at depth {top['depth']}, lr {top['learning_rate']:g} the final "
                  f"backward gain at full depth is {top['backward_final'][0]:.3g} as the max over tokens and "
                  f"{top['backward_mean_final'][0]:.3g} as the mean over tokens (the paper's measure; medians over "
                  f"seeds). Its H_res logits spread up to {top['logit_spread_final'][0]:.3g} (token mean "
                  f"{top['logit_spread_mean_final'][0]:.3g}); 20 iterations leave column sums up to "
                  f"{top['colsum_dev_final'][0]:.3g} away from 1, 200 iterations of the same logits "
                  f"{top['colsum_dev_200_final'][0]:.3g}, and with those matrices the backward gain would be "
                  f"{top['backward_200_final'][0]:.3g} (max) and {top['backward_mean_200_final'][0]:.3g} (mean)."]
    lite = [r for r in rows if r["residual"] == "mhc-lite" and r["seeds"]]
    if lite:
        worst_gain = max(max(r["forward_peak"], r["backward_peak"]) for r in lite)
        worst_sum = max(r["colsum_dev_final"][2] for r in lite)
        lines += ["", f"mhc-lite: H_res is a convex combination of permutation matrices, so exactly doubly "
                  f"stochastic: its largest column-sum deviation is {worst_sum:.2g} and its largest gain "
                  f"{worst_gain:.6g} over every setting (1 up to float32 rounding)."]
    return lines


def pivot(rows: list[dict[str, Any]], residual: str, keys: tuple[str, str], args: argparse.Namespace) -> list[str]:
    """A depth x learning-rate table of two keys' medians over seeds (``max / mean``) for one residual mode."""
    cells = {(r["depth"], r["learning_rate"]): r for r in rows if r["residual"] == residual}

    def cell(row: dict[str, Any]) -> str:
        first, second = row[keys[0]][0], row[keys[1]][0]
        return "n/a" if math.isnan(first) else f"{first:.3g} / {second:.3g}"

    body = [[str(d), *(cell(cells[(d, lr)]) if (d, lr) in cells and cells[(d, lr)]["seeds"] else "n/a"
                       for lr in args.learning_rates)] for d in args.depths]
    return report.markdown_table(["depth \\ lr", *(f"{lr:g}" for lr in args.learning_rates)], body)


def bound_lines(n: int) -> list[str]:
    """The ≤ n bound on the composite gains of mHC's H_res, stated."""
    return [f"**The bound.** Every Sinkhorn output is non-negative and its rows sum to 1 (rows are normalised "
            f"last), so every product P_l of them is too: its forward gain (largest row sum) is exactly 1, and as "
            f"its n² entries sum to n, no column sums to more than n: **the backward gain of mhc is at most n = {n} "
            "at any depth**, whatever the logits. It is 1 only when the columns sum to 1 as well (doubly "
            "stochastic), which 20 Sinkhorn iterations reach only for logits of small spread; mhc-lite's convex "
            "combinations of permutation matrices are doubly stochastic exactly. hc's matrices are unconstrained: "
            "no bound."]


def write_outputs(args: argparse.Namespace, settings: Settings, runs: list[Run], results: dict[Run, dict[str, Any]],
                  invocation_s: float) -> None:
    """results.json (per-setting rows and per-run summaries; the per-step curves stay in the run files),
    report.md and the three figures, in ``--report-dir``."""
    out = report.report_dir(args)
    rows = setting_rows(runs, results, settings)
    info = report.machine(None)
    try:
        import jax

        devices = jax.devices()
        info["devices"] = f"{len(devices)} x {devices[0].device_kind} ({devices[0].platform})"
    except Exception:  # noqa: BLE001 - the device line is informative only
        pass
    total_s = sum(r["wall_s"] for r in results.values())
    found = stability_protocol.protocol(protocol_table(runs, results, settings))
    main_depth, main_lr = max(args.depths), max(args.learning_rates)
    write_json(out / "results.json", {
        "command": args.command_line, "note": args.note, "machine": info,
        "settings": dataclasses.asdict(settings), "complete": len(results) == len(runs),
        "runs_finished": len(results), "runs_total": len(runs), "run_wall_s": total_s,
        "invocation_wall_s": invocation_s, "protocol": found, "settings_rows": rows,
        "runs": [{**{k: record[k] for k in ("residual", "depth", "learning_rate", "seed", "status", "steps_done",
                                           "nonfinite_steps", "params", "step_time_s", "wall_s")},
                  **run_summary(record, settings)} for record in results.values()]})
    main_runs = [results[r] for r in runs if r in results and (r.depth, r.learning_rate) == (main_depth, main_lr)]
    plots.stability_gains_figure(main_runs, args.residual, out / "gains_depth.png",
                                 f"depth {main_depth}, lr {main_lr:g}")
    plots.stability_curves_figure(main_runs, args.residual, out / "curves.png",
                                  f"depth {main_depth}, lr {main_lr:g}", SMOOTH)
    plots.stability_sweep_figure(rows, out / "sweep.png")

    width = settings.d_model or ModelConfig.preset(settings.model).d_model
    lines = report.header("Stability: composite residual gains, loss and gradient norm over depth", args, info,
                          total_s, len(results), len(runs))
    lines += [f"Every run: preset `{settings.model}` at width {width} with {ATTENTION_LABELS[settings.attention]} "
              f"attention, {settings.steps} steps x "
              f"{settings.batch_size} sequences, warmup {settings.warmup_steps}, weight decay "
              f"{settings.weight_decay:g}, gradient clip {settings.grad_clip:g} (0: none), coefficient learning rate "
              f"{settings.coefficient_lr_scale:g} x the peak, data "
              f"`{settings.dataset}`; depths {', '.join(map(str, args.depths))}; learning rates "
              f"{', '.join(f'{lr:g}' for lr in args.learning_rates)}; seeds {', '.join(map(str, args.seeds))}. "
              f"Gains of the composite residual mapping P_l = H_l ... H_1 (forward: largest absolute row sum; "
              f"backward: largest absolute column sum) per token of {settings.probe_batch} fixed held-out "
              f"sequences, at steps {', '.join(map(str, settings.probe_steps()))}, summarised two ways: the max "
              "over the tokens, and the mean over the tokens (the mHC paper's measure, its Fig. 3).", "",
              f"{PAPER_LEARNING_RATES}; the learning rates here include that range beside the higher ones that "
              "stress the residual stream.", "", *bound_lines(ModelConfig.preset(settings.model).num_streams), "",
              *(stability_protocol.lines(found, sorted(args.learning_rates)) if found else []),
              "## Findings", "", *verdict(rows, settings, args), "", "## Every setting", "",
              f"Mean ± sample std over seeds; final loss: mean over the last {100 * FINAL_FRACTION:g} % of steps "
              "(finished runs); loss rise, max grad norm and peak gains (max over tokens): the worst seed; final "
              "gains at full depth at the last step, max and mean over tokens, as median [min, max] over seeds.", ""]
    table = [[str(r["depth"]), f"{r['learning_rate']:g}", r["residual"], str(r["seeds"]), str(r["diverged"]),
              pm(*r["final_loss"]), f"{r['loss_rise_max']:.3f}", f"{r['max_grad_norm']:.3g}",
              range_text(r["forward_final"]), range_text(r["forward_mean_final"]), f"{r['forward_peak']:.3g}",
              range_text(r["backward_final"]), range_text(r["backward_mean_final"]), f"{r['backward_peak']:.3g}",
              pm(*r["step_time_s"], digits=3)] for r in rows if r["seeds"]]
    lines += report.markdown_table(["depth", "lr", "residual", "seeds", "diverged", "final loss", "loss rise",
                                    "max grad norm", "fwd final (max)", "fwd final (mean)", "fwd peak",
                                    "bwd final (max)", "bwd final (mean)", "bwd peak", "s/step"], table)
    sinkhorn = [[str(r["depth"]), f"{r['learning_rate']:g}", range_text(r["logit_spread_final"]),
                 range_text(r["logit_spread_mean_final"]), range_text(r["colsum_dev_final"]),
                 range_text(r["colsum_dev_200_final"]), range_text(r["backward_final"]),
                 range_text(r["backward_200_final"]), range_text(r["backward_mean_final"]),
                 range_text(r["backward_mean_200_final"])] for r in rows if r["seeds"] and r["residual"] == "mhc"]
    if sinkhorn:
        lines += ["", "mhc at the last step, per sublayer the worst: the spread (max - min) of the pre-Sinkhorn "
                  "logits (max and mean over tokens), the largest |column sum - 1| of H_res after the model's 20 "
                  "Sinkhorn iterations and after 200 iterations of the same logits, and the backward gain at full "
                  "depth (max and mean over tokens) with each; median [min, max] over seeds.", "",
                  *report.markdown_table(["depth", "lr", "logit spread (max)", "logit spread (mean)",
                                          "col-sum dev, 20 it.", "col-sum dev, 200 it.", "bwd gain max, 20 it.",
                                          "bwd gain max, 200 it.", "bwd gain mean, 20 it.",
                                          "bwd gain mean, 200 it."], sinkhorn)]
    for residual in [r for r in args.residual if r != "plain"]:
        for keys, name in ((("forward_final", "forward_mean_final"), "forward"),
                           (("backward_final", "backward_mean_final"), "backward")):
            lines += ["", f"{residual}: final {name} gain at full depth, max / mean over tokens (medians over "
                      "seeds)", "", *pivot(rows, residual, keys, args)]
    lines += ["", f"## Figures (depth {main_depth}, learning rate {main_lr:g})", "",
              "![gains over depth](gains_depth.png)", "", "![loss and gradient norm](curves.png)", "",
              "## Trend over the sweep", "", "![gains and loss against depth and learning rate](sweep.png)", ""]
    (out / "report.md").write_text("\n".join(lines))
