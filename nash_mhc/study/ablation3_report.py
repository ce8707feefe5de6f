"""Ablation v3's outputs: results.json (every cell, curve and scale metric) and results.md (the protocol, the
answers as paired differences, every cell of the grid), written from whatever has finished."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from nash_mhc.study import report
from nash_mhc.study.ablation3_protocol import coarse_weight, paired
from nash_mhc.study.runner import mean_std, pm, write_json
from nash_mhc.study.variants import label3, spec3

BUDGETS = {"equal_tokens": "equal tokens", "equal_flops": "equal full FLOPs", "equal_wallclock": "equal wall-clock"}


ESTIMATE = (  # written before the first full run, from docs/results/ablation_v2 and this study's smoke runs
    "Estimate for the default study on the shared 2-core VM (CPU, float32, other jobs running), made before "
    "it ran: 11 variants x 3 rates x 3 seeds = 99 runs of S = 700 steps at batch 8, plus 3 runs per added rate "
    "(v2 put 6 of its 16 variants' rates on the grid's top edge at S = 400; assuming 3 variants grow by one "
    "rate: about 108 runs). Seconds per step at batch 8, seq 256: measured in a 40-step smoke run of this study "
    "(load average 4-5) plain+full 0.065 and mhc+nash@uniform 0.218; v2's table (load 3-5) scaled by the smoke "
    "run's 1.4 for plain+full: mhc+full 0.20, mhc-lite+full 0.081, mhc+gate 0.146, mhc+convex 0.136, and 0.218 "
    "for every nash variant: 1.78 s summed over the 11 variants, so 9 x 700 x 1.78 s = 3 h 07 min of steps, "
    "plus about 16 min for the added rates. Overheads from the smoke run: a compile per variant and rate (15-35 "
    "s, about 36 of them: 18 min) and, per run, two training-session start-ups and 3-4 evaluations of 4-13 s "
    "each (about 40 s: 70 min). In all about 4 h 40 min at that load (about 3 h 15 min at v2's step times); "
    "with --steps 400 (v2's published length) about 3 h 20 min (2 h 20 min). Disk: a run keeps its checkpoints "
    "(about 2.2 MB each at tiny, 29-30 at the default interval) only until its result.json is written.")


def _get(results: dict[Any, dict[str, Any]], variant: str, lr: float | None, seed: int) -> dict[str, Any] | None:
    return next((r for k, r in results.items() if (k.variant, k.learning_rate, k.seed) == (variant, lr, seed)), None)


def per_seed(row: dict[str, Any], budget: str) -> dict[int, float]:
    """``{seed: value}`` of a row for a budget, or for ``coarse_weight`` / ``coarse_prior``."""
    return {int(s): v for s, v in row["per_seed"].get(budget, {}).items() if v is not None}


def variant_rows(variants: list[str], costs: dict[str, dict[str, Any]], grids: dict[str, dict[str, Any]],
                 results: dict[Any, dict[str, Any]], points: dict[str, dict[int, dict[str, Any]]],
                 seeds: list[int]) -> list[dict[str, Any]]:
    """Per variant: every cell of its grid, the rule's state and choice, and over the seeds at the chosen rate
    the report-split bits per byte at the three budgets and the scale use at the end."""
    rows = []
    for v in variants:
        grid, best = grids[v], grids[v]["best"]
        cells = [{"learning_rate": lr, "seed": s, "status": r["status"] if r else "pending",
                  "selection_bits_per_byte": r["selection_bits_per_byte"] if r else None,
                  "report_bits_per_byte": r["bits_per_byte"] if r else None}
                 for lr in grid["grid"] for s in seeds for r in [_get(results, v, lr, s)]]
        chosen = {s: r for s in seeds if best is not None and (r := _get(results, v, best, s))
                  and r["status"] == "finished"}
        seeds_of = {
            "equal_tokens": {s: r["bits_per_byte"] for s, r in chosen.items()},
            "equal_flops": {s: r["equal_flops_bits_per_byte"] for s, r in chosen.items()},
            "equal_wallclock": {s: p["bits_per_byte"] for s, p in points.get(v, {}).items()},
            "coarse_weight": {s: coarse_weight(r["scale_use_end"]["report"]) for s, r in chosen.items()},
            "coarse_prior": {s: coarse_weight(r["scale_use_end"]["report"], "scale_prior") for s, r in chosen.items()},
        }
        rows.append({
            "variant": v, "label": label3(v), **spec3(v), "grid": grid["grid"], "state": grid["state"],
            "chosen_learning_rate": best, "mean_selection_bits_per_byte": grid["means"], "cells": cells,
            "per_seed": seeds_of, "summary": {k: mean_std([x for x in d.values() if x is not None])
                                              for k, d in seeds_of.items()},
            "equal_flops_step": costs[v]["step"], "flops_per_token": costs[v]["flops_per_token"],
            "flops_method": costs[v]["flops_method"], "wallclock": points.get(v, {}),
            "step_time_s": mean_std([r["step_time_s"] for r in chosen.values() if r["step_time_s"]]),
        })
    return rows


def questions(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The report's comparisons as paired differences A - B (by seed): coarse-scale use uniform - scale0; nash -
    gate and nash - convex under each start; sparsity 0 - default; mhc - plain; at every budget."""
    by = {r["variant"]: r for r in rows}
    out: dict[str, list[dict[str, Any]]] = {"coarse_scales": [], "game": [], "sparsity": [], "mhc": []}

    def add(group: str, a: str, b: str, measures: tuple[str, ...]) -> None:
        if a in by and b in by:
            for m in measures:
                out[group].append({"a": a, "b": b, "measure": m,
                                   **paired(per_seed(by[a], m), per_seed(by[b], m))})

    for agg in ("nash", "gate", "convex", "nash@uniform-sp0"):
        uniform = f"mhc+{agg}" if "@" in agg else f"mhc+{agg}@uniform"
        add("coarse_scales", uniform, uniform.replace("@uniform", "@scale0"), ("coarse_weight", "equal_tokens"))
    for prior in ("scale0", "uniform"):
        for other in ("gate", "convex"):
            add("game", f"mhc+nash@{prior}", f"mhc+{other}@{prior}", tuple(BUDGETS))
        add("sparsity", f"mhc+nash@{prior}-sp0", f"mhc+nash@{prior}", ("equal_tokens", "coarse_weight"))
    add("mhc", "mhc+full", "plain+full", tuple(BUDGETS))
    add("mhc", "mhc-lite+full", "plain+full", tuple(BUDGETS))
    return out


def verdict(d: dict[str, Any], digits: int = 4) -> str:
    """One cell: mean ± SE, the 95 % interval, and what it says."""
    if d["mean"] is None:
        return "n/a (no paired seeds)"
    if d["se"] is None:
        return f"{d['mean']:+.{digits}f} (1 seed: no interval)"
    low, high = d["interval"]
    text = f"{d['mean']:+.{digits}f} ± {d['se']:.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}], n={d['n']}"
    if d["null"]:
        return text + ": **null** (interval includes 0)"
    return text + (": A lower" if d["mean"] < 0 else ": A higher")


MEASURE = {**BUDGETS, "coarse_weight": "coarse-scale weight (report eval at S)"}


def answer_lines(found: dict[str, list[dict[str, Any]]]) -> list[str]:
    titles = {"coarse_scales": "Are the coarse scales used when they are free to be? (A = uniform start, B = scale0 "
                               "start; coarse weight = 1 - scale_weight/0: 0.01 at the scale0 start, 2/3 at the "
                               "uniform one)",
              "game": "Does the game (nash) beat gate and convex? (bits per byte, A - B < 0: A better)",
              "sparsity": "Does the sparsity term matter for the game? (A = sparsity 0, B = the default)",
              "mhc": "Does mhc beat plain? (bits per byte, full attention, A - B < 0: A better)"}
    lines: list[str] = []
    for group, title in titles.items():
        lines += [f"### {title}", ""]
        rows = [[f"{d['a']} - {d['b']}", MEASURE[d["measure"]], verdict(d)] for d in found[group]]
        lines += report.markdown_table(["A - B", "measure", "paired difference: mean ± SE [95 % t-interval]"],
                                       rows) if rows else ["(not in this study's variants)"]
        lines.append("")
    return lines


def write_outputs(args: argparse.Namespace, settings: Any, variants: list[str], costs: dict[str, dict[str, Any]],
                  grids: dict[str, dict[str, Any]], results: dict[Any, dict[str, Any]],
                  points: dict[str, dict[int, dict[str, Any]]], invocation_s: float) -> None:
    """results.json and results.md in ``--report-dir``."""

    out = report.report_dir(args)
    seeds = list(args.seeds)
    rows = variant_rows(variants, costs, grids, results, points, seeds)
    found = questions(rows)
    info = report.machine(report.device_line([run.directory(Path(args.out_dir)) / "train.log" for run in results]))
    total_s = sum(r["wall_s"] for r in results.values())
    cells_total = sum(len(g["grid"]) for g in grids.values()) * len(seeds)
    complete = all(g["state"] != "pending" for g in grids.values()) and all(
        len(points.get(v, {})) == len(seeds) for v in variants if grids[v]["best"] is not None)
    S = settings.steps
    write_json(out / "results.json", {
        "command": args.command_line, "note": args.note, "machine": info, "settings": dataclasses.asdict(settings),
        "initial_learning_rates": args.learning_rates, "seeds": seeds, "baseline": variants[0],
        "complete": complete, "runs_finished": len(results), "cells_total": cells_total, "run_wall_s": total_s,
        "invocation_wall_s": invocation_s, "variants": {row["variant"]: row for row in rows}, "questions": found,
        "runs": list(results.values())})

    lines = report.header("Ablation v3: every rate on every seed, bits per byte at equal tokens, equal full FLOPs "
                          "and equal wall-clock", args, info, total_s, len(results), cells_total)
    methods = sorted({c["flops_method"] for c in costs.values()})
    sel, rep = settings.selection_batches, settings.report_batches
    lines += ["## Protocol (fixed in code before the runs: nash_mhc/study/ablation3.py)", "",
              f"- Every variant at every rate of its grid on seeds {', '.join(map(str, seeds))}; its rate is the one "
              "with the lowest mean over seeds of the selection split's bits per byte at S (a rate with a diverged "
              "seed is never chosen; ties go to the smaller rate). Starting grid "
              f"{', '.join(f'{lr:g}' for lr in args.learning_rates)}; while the best is on an edge the grid grows "
              f"by the next rate of the 1-3 ladder on that side, at most {settings.max_extra_rates} added rates per "
              "variant, within [1e-5, 0.3].",
              f"- Splits: selection batches [0, {sel}), report batches [{sel}, {sel + rep}) of "
              f"{settings.eval_batch_size} sequences, the same windows for every run; all numbers below are the "
              "report split's.",
              f"- Equal tokens: preset `{settings.model}`, sequence length {settings.seq_len}, S = {S} steps x "
              f"{settings.batch_size} sequences, one cosine schedule of S steps, data `{settings.dataset}`.",
              f"- Equal full FLOPs ({', '.join(methods)}): a costlier variant is read at s_v = floor(S F_base / "
              "F_v), mid-schedule (before its rate has decayed; this favours the baseline).",
              "- Equal wall-clock: per seed, W = S x the baseline's median step time (its chosen rate); a variant "
              "at its chosen rate is read at w = floor(W / its median step time) (at most S), on the report split "
              f"at its last checkpoint at or before w (every {settings.checkpoint_interval} steps: up to that many "
              "steps early). Step times are medians over logged windows, without compiles, start-ups and "
              "evaluations, measured while the machine ran other work too.",
              "- Differences are paired by seed (each variant at its own chosen rate): mean ± standard error, 95 % "
              "t-interval; **null** where it includes 0.", "", "## Answers", "", *answer_lines(found),
              "## Variants at their chosen rates", ""]
    table = []
    for row in rows:
        s = row["summary"]
        table.append([row["label"], f"{row['chosen_learning_rate']:g}" if row["chosen_learning_rate"] else "-",
                      row["state"], pm(*s["equal_tokens"], digits=4), str(row["equal_flops_step"]),
                      pm(*s["equal_flops"], digits=4),
                      ", ".join(f"{p['wallclock_step']}→{p['checkpoint_step']}" for p in row["wallclock"].values())
                      or "-",
                      pm(*s["equal_wallclock"], digits=4), pm(*s["coarse_weight"], digits=3),
                      report.millions(row["flops_per_token"]), pm(*row["step_time_s"], digits=3)])
    lines += report.markdown_table(["variant", "lr", "grid", "bits/byte, equal tokens", "FLOPs step",
                                    "bits/byte, equal FLOPs", "wall-clock step w→checkpoint",
                                    "bits/byte, equal wall-clock", "coarse weight", "FLOPs/token", "s/step"], table)
    lines += ["", "Mean ± sample std over seeds.", "", "## Every cell", ""]
    cell_rows = [[row["label"], f"{c['learning_rate']:g}", str(c["seed"]), c["status"],
                  "-" if c["selection_bits_per_byte"] is None else f"{c['selection_bits_per_byte']:.4f}",
                  "-" if c["report_bits_per_byte"] is None else f"{c['report_bits_per_byte']:.4f}",
                  "*" if c["learning_rate"] == row["chosen_learning_rate"] else ""]
                 for row in rows for c in row["cells"]]
    lines += report.markdown_table(["variant", "lr", "seed", "status", "selection bits/byte", "report bits/byte",
                                    "chosen"], cell_rows)
    lines += ["", "## Cost", "", ESTIMATE, ""]
    (out / "results.md").write_text("\n".join(lines))
