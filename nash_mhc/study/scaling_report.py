"""The scaling study's outputs: a power-law fit per variant, crossings, results.json, report.md, scaling.png."""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path
from typing import Any

from nash_mhc.study import powerlaw, report, tpu_estimate
from nash_mhc.study.runner import write_json
from nash_mhc.study.variants import label

TPU_SIZES = ("512:8:8", "768:12:12", "1024:16:16", "1536:16:16", "2048:16:16")  # around base .. 1b


def fits(variants: list[str], results: list[dict[str, Any]]) -> dict[str, powerlaw.Fit | None]:
    """Per variant, the fit over its finished runs (None with fewer than 3)."""
    out: dict[str, powerlaw.Fit | None] = {}
    for v in variants:
        done = [r for r in results if r["variant"] == v and r["status"] == "finished" and r["bits_per_byte"]]
        out[v] = powerlaw.fit_power_law([r["compute"] for r in done], [r["bits_per_byte"] for r in done]) \
            if len({r["compute"] for r in done}) >= 3 else None
    return out


def crossing_sentence(base: str, other: str, a: powerlaw.Fit, b: powerlaw.Fit, cross: dict[str, Any]) -> str:
    """What the fits say about where ``other``'s curve meets ``base``'s, with the fitted range's caveat."""
    low = min(a.compute_range[0], b.compute_range[0])
    high = max(a.compute_range[1], b.compute_range[1])
    ahead = base if a.predict(high) < b.predict(high) else other
    gap = abs(float(a.predict(high)) - float(b.predict(high)))
    text = (f"**{other} vs {base}**: slopes b = {b.slope:.4f} ± {b.slope_se:.4f} and {a.slope:.4f} ± "
            f"{a.slope_se:.4f} (difference {b.slope - a.slope:+.4f}, z = {-cross['slope_difference_z']:+.2f}); at "
            f"the largest compute fitted ({high:.3g} FLOPs) {ahead} is ahead by {gap:.4f} bits/byte on the fits. ")
    if cross["compute"] is None:
        return text + "The fitted lines are parallel: they do not cross."
    where = (f"C* = {cross['compute']:.3g} FLOPs"
             + (f" (16-84 % of bootstrap draws: {cross['interval_16_84'][0]:.3g} to {cross['interval_16_84'][1]:.3g})"
                if cross["interval_16_84"] else ""))
    if abs(cross["slope_difference_z"]) < 2:
        return text + (f"The lines cross at {where}, but the slopes differ by less than two standard errors, so "
                       "the data do not say whether the curves cross at all.")
    if cross["inside_fitted_range"]:
        return text + f"The fitted curves cross inside the fitted range [{low:.3g}, {high:.3g}], at {where}."
    side = "beyond" if cross["ahead_of_fitted_range"] else "below"
    return text + (f"The fitted curves cross {side} the fitted range [{low:.3g}, {high:.3g}] FLOPs, at {where}: an "
                   "extrapolation of a pure power law, which a floor in the loss (not identifiable from these "
                   "points) would move.")


def full_size(variants: list[str]) -> tpu_estimate.FullSize:
    """The sweep around base..1b at sequence length 2048 on a v6e-8, 2^20 tokens per update, same ratio r."""
    from nash_mhc.model import param_counts

    r, per_update = 20.0, 2**20
    flags = ["--model", "1b", "--seq-len", "2048", "--sizes", *TPU_SIZES, "--variants", *variants,
             "--tokens-per-param", f"{r:g}", "--batch-size", "128", "--learning-rate", "6e-4", "--dataset", "shards/",
             "--tokenizer", "tokenizer.json", "--checkpoint-interval", "500", "--out-dir", "runs/scaling-1b",
             "--train-args", "--grad-accum-steps 4 --remat full --remat-group 4 --loss-chunks 8 --mesh-data 1 "
             "--mesh-fsdp 8"]
    flops = 0.0
    for v in variants:
        for size in TPU_SIZES:
            d, layers, heads = map(int, size.split(":"))
            config = tpu_estimate.variant_config("1b", v, seq_len=2048, d_model=d, num_layers=layers, num_heads=heads)
            counts = param_counts(config)
            tokens = math.ceil(r * (sum(counts.values()) - counts["embedding"] - counts["head"]) / per_update) \
                * per_update
            flops += config.flops_per_token() * tokens
    return tpu_estimate.FullSize(tpu_estimate.command("scaling", flags), flops,
                                 f"{len(variants) * len(TPU_SIZES)} runs, {r:g} tokens per non-embedding parameter",
                                 tpu_estimate.v6e_8())


def write_outputs(args: argparse.Namespace, settings: Any, runs: list[Any], budgets: dict[Any, dict[str, Any]],
                  results: dict[Any, dict[str, Any]], invocation_s: float) -> None:
    """results.json, report.md and scaling.png in ``--report-dir``."""
    from nash_mhc.study import plots

    out = report.report_dir(args)
    finished = list(results.values())
    fitted = fits(args.variants, finished)
    base = args.variants[0]
    crossings = {v: powerlaw.crossing(fitted[base], fitted[v]) for v in args.variants[1:]
                 if fitted[base] is not None and fitted[v] is not None}
    info = report.machine(report.device_line([run.directory(Path(args.out_dir)) / "train.log" for run in results]))
    total_s = sum(r["wall_s"] for r in finished)
    complete = len(results) == len(runs)
    write_json(out / "results.json", {
        "command": args.command_line, "note": args.note, "machine": info, "settings": dataclasses.asdict(settings),
        "parameter_count": "non-embedding: every parameter but the token embedding and an untied LM head",
        "complete": complete, "runs_finished": len(results), "runs_total": len(runs), "run_wall_s": total_s,
        "invocation_wall_s": invocation_s, "fits": {v: f.to_dict() if f else None for v, f in fitted.items()},
        "crossings": {f"{v} vs {base}": c for v, c in crossings.items()},
        "planned": [{"variant": r.variant, "size": r.size, **budgets[r]} for r in runs], "runs": finished})
    plots.scaling_figure(finished, fitted, args.variants, out / "scaling.png")

    lines = report.header("Scaling: held-out bits per byte against training FLOPs", args, info, total_s,
                          len(results), len(runs))
    lines += [f"Every run: preset `{settings.model}` with the size's width, layers and heads, sequence length "
              f"{settings.seq_len}, {settings.batch_size} sequences per step, "
              f"{settings.tokens_per_param:g} training tokens per non-embedding parameter (every parameter but the "
              "token embedding and an untied LM head; each variant counts its own), peak learning rate "
              f"{settings.learning_rate:g} for every size (not tuned per size: a larger model may prefer a smaller "
              f"rate, which would bend its curve), warmup {settings.warmup_fraction:.0%} then cosine, data "
              f"`{settings.dataset}` / `{settings.tokenizer}`, seed {settings.seed}. Compute C = FLOPs/token "
              "(`ModelConfig.flops_per_token`, forward + backward) x tokens trained. Bits per byte on held-out "
              f"batches [0, {settings.eval_batches}) of {settings.eval_batch_size} sequences, the same windows for "
              "every run.", "",
              "Fit per variant: bpb = a · C^-b by least squares of ln bpb on ln C; ± is one standard error from the "
              "fit's covariance (residual variance, n - 2 degrees of freedom). Not a · C^-b + c: with these few "
              "sizes over this range the floor c is not identifiable.", "", "## Fits and crossings", ""]
    fit_rows = [[label(v), str(f.points), f"{f.a:.4g}", f"{f.slope:.4f} ± {f.slope_se:.4f}",
                 f"{f.compute_range[0]:.3g} – {f.compute_range[1]:.3g}", f"{f.rss:.2e}"]
                if (f := fitted[v]) else [label(v), "< 3", "n/a", "n/a", "n/a", "n/a"] for v in args.variants]
    lines += report.markdown_table(["variant", "sizes", "a", "b", "C range (FLOPs)", "RSS (ln bpb)"], fit_rows)
    lines += [""] + [f"- {crossing_sentence(base, v, fitted[base], fitted[v], c)}" for v, c in crossings.items()]
    lines += ["", "![bits per byte against compute](scaling.png)", "", "## Every run", ""]
    table = [[label(r["variant"]), r["size"], f"{r['non_embedding_params']:,}", str(r["steps"]),
              f"{r['tokens']:,}", f"{r['compute']:.3g}",
              "diverged" if r["status"] != "finished" else f"{r['bits_per_byte']:.4f}",
              f"{r['step_time_s']:.3f}" if r["step_time_s"] else "n/a", report.duration(r["wall_s"])]
             for r in finished]
    lines += report.markdown_table(["variant", "D:L:H", "non-emb. params", "steps", "tokens", "C (FLOPs)",
                                    "held-out bits/byte", "s/step", "wall"], table)
    lines += ["", "## Full size on a TPU", "", *full_size(list(args.variants)).lines(
        f"The sweep around `base`..`1b` (sizes {', '.join(TPU_SIZES)}) at sequence length 2048 on one v6e-8 host"),
        ""]
    (out / "report.md").write_text("\n".join(lines))
