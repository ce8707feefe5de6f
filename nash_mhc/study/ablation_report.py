"""The ablation's outputs: one row per variant, results.json, results.md and ablation.png (whatever has finished)."""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path
from typing import Any

from nash_mhc.study import report, tpu_estimate
from nash_mhc.study.runner import mean_std, pm, write_json
from nash_mhc.study.variants import BASELINE, FULL_MODEL, label

FIRST_STEP = [BASELINE, "plain+nash", "mhc+full", FULL_MODEL]  # what each half of Nash-MHC adds, and both
SELECTION_RULE = ("For each variant, one run per learning rate of the grid at the first seed; the chosen rate is "
                  "the one whose run has the lowest held-out bits per byte on the selection split at step S. A "
                  "run whose loss diverged is never chosen; a tie goes to the smaller rate. The remaining seeds "
                  "train at the chosen rate. Only the report split's numbers appear in the results table.")


def _run(results: dict[Any, dict[str, Any]], variant: str, lr: float | None, seed: int) -> dict[str, Any] | None:
    return next((r for k, r in results.items() if (k.variant, k.learning_rate, k.seed) == (variant, lr, seed)), None)


def variant_rows(variants: list[str], costs: dict[str, dict[str, Any]], chosen: dict[str, float | None],
                 results: dict[Any, dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per variant: its sweep, chosen rate, and over the seeds at that rate the equal-token and equal-FLOP bits
    per byte with their deltas to the baseline (the first variant) paired by seed, and coefficient travel."""
    base = variants[0]
    base_bpb = {s: r["bits_per_byte"] for s in args.seeds if (r := _run(results, base, chosen.get(base), s))
                and r["status"] == "finished"}
    rows = []
    for v in variants:
        sweep = [{"learning_rate": lr, "status": r["status"], "selection_bits_per_byte": r["selection_bits_per_byte"],
                  "report_bits_per_byte": r["bits_per_byte"]}
                 for lr in args.learning_rates if (r := _run(results, v, lr, args.seeds[0]))]
        lr = chosen.get(v)
        done = [r for s in args.seeds if (r := _run(results, v, lr, s))] if lr is not None else []
        ok = [r for r in done if r["status"] == "finished"]
        paired = [r for r in ok if r["seed"] in base_bpb]
        groups = sorted({g for r in ok for g in r["travel"]})
        report_pick = min((s for s in sweep if s["report_bits_per_byte"] is not None),
                          key=lambda s: (s["report_bits_per_byte"], s["learning_rate"]), default=None)
        rows.append({
            "variant": v, "label": label(v), "learning_rates": sweep, "chosen_learning_rate": lr,
            "chosen_at_grid_edge": lr is not None and lr in (min(args.learning_rates), max(args.learning_rates)),
            "report_split_would_choose": report_pick["learning_rate"] if report_pick else None,
            "seeds": [r["seed"] for r in ok], "diverged_seeds": [r["seed"] for r in done if r["status"] != "finished"],
            "bits_per_byte": mean_std([r["bits_per_byte"] for r in ok]),
            "equal_tokens": {"step": args.steps, "tokens": ok[0]["tokens_trained"] if ok else None,
                             "bits_per_byte": mean_std([r["bits_per_byte"] for r in ok]),
                             "delta": mean_std([r["bits_per_byte"] - base_bpb[r["seed"]] for r in paired])},
            "equal_flops": {"step": costs[v]["step"], "mid_schedule": costs[v]["step"] < args.steps,
                            "cheaper_than_baseline": costs[v]["cheaper_than_baseline"],
                            "training_flops": costs[v]["step"] * costs[v]["flops_per_token"] * (
                                ok[0]["tokens_per_step"] if ok else math.nan),
                            "bits_per_byte": mean_std([r["equal_flops_bits_per_byte"] for r in ok]),
                            "delta": mean_std([r["equal_flops_bits_per_byte"] - base_bpb[r["seed"]] for r in paired])},
            "travel": {g: mean_std([r["travel"][g] for r in ok if g in r["travel"]]) for g in groups},
            "per_seed": [{k: r[k] for k in ("seed", "bits_per_byte", "equal_flops_bits_per_byte", "travel",
                                            "final_train_loss")} for r in ok],
            "params": ok[0]["params"] if ok else None, "flops_per_token": costs[v]["flops_per_token"],
            "flops_per_token_all": costs[v].get("flops_per_token_all"),  # every op (absent in older studies)
            "step_time_s": mean_std([r["step_time_s"] for r in done if r["step_time_s"] is not None]),
            "wall_s": mean_std([r["wall_s"] for r in done]),
        })
    return rows


def full_size(residuals: list[str], attentions: list[str]) -> tpu_estimate.FullSize:
    """The 1b version of this study on a v6e-8 for a grid: 2^20 tokens per update (16 sequences of 2048 per chip,
    the largest batch docs/results/tpu_fit.jsonl found to fit, x 8 chips x 4 accumulation steps), 5000 updates
    per run, 3 learning rates around the mHC paper's (4e-4 to 9e-4 at 3B-27B) and 3 seeds: 5 runs a variant."""
    steps, per_update, seq_len = 5000, 2**20, 2048
    flags = ["--model", "1b", "--seq-len", str(seq_len), "--steps", str(steps), "--batch-size", "128",
             "--learning-rates", "3e-4", "6e-4", "1.2e-3", "--seeds", "0", "1", "2", "--residual", *residuals,
             "--attention", *attentions, "--dataset", "shards/", "--tokenizer", "tokenizer.json", "--mesh-data", "1",
             "--mesh-fsdp", "8", "--checkpoint-interval", "500", "--out-dir", "runs/ablation-1b",
             "--train-args", "--grad-accum-steps 4 --remat full --remat-group 4 --loss-chunks 8"]
    variants = [f"{r}+{a}" for r in residuals for a in attentions]
    flops = sum(5 * tpu_estimate.variant_config("1b", v, seq_len=seq_len).flops_per_token() * steps * per_update
                for v in variants)
    return tpu_estimate.FullSize(tpu_estimate.command("ablation", flags), flops,
                                 f"{5 * len(variants)} runs of {steps * per_update / 1e9:.2f} B tokens",
                                 tpu_estimate.v6e_8())


def travel_text(travel: dict[str, tuple[float, float]]) -> str:
    return ", ".join(f"{g} {m:.3g}" for g, (m, _) in travel.items()) or "none (no coefficients)"


def write_outputs(args: argparse.Namespace, settings: Any, variants: list[str], costs: dict[str, dict[str, Any]],
                  chosen: dict[str, float | None], results: dict[Any, dict[str, Any]], invocation_s: float) -> None:
    """results.json, results.md and ablation.png in ``--report-dir``."""
    from nash_mhc.study import plots

    out = report.report_dir(args)
    rows = variant_rows(variants, costs, chosen, results, args)
    info = report.machine(report.device_line([run.directory(Path(args.out_dir)) / "train.log" for run in results]))
    total_s = sum(r["wall_s"] for r in results.values())
    runs_total = len(variants) * (len(args.learning_rates) + len(args.seeds) - 1)
    complete = len(results) == runs_total
    S, sel, rep = settings.steps, settings.selection_batches, settings.report_batches
    write_json(out / "results.json", {
        "command": args.command_line, "note": args.note, "machine": info, "settings": dataclasses.asdict(settings),
        "learning_rates": args.learning_rates, "seeds": args.seeds, "baseline": variants[0],
        "selection_rule": SELECTION_RULE, "splits": {"selection_batches": [0, sel],
                                                     "report_batches": [sel, sel + rep]},
        "complete": complete, "runs_finished": len(results), "runs_total": runs_total, "run_wall_s": total_s,
        "invocation_wall_s": invocation_s, "variants": {row["variant"]: row for row in rows},
        "runs": [{k: v for k, v in r.items() if k != "curve"} for r in results.values()]})
    plots.ablation_figure(rows, args.learning_rates, variants[0], out / "ablation.png")

    tokens = S * settings.batch_size * settings.seq_len
    lines = report.header("Ablation: each variant at its own learning rate, bits per byte at equal tokens and "
                          "equal FLOPs", args, info, total_s, len(results), runs_total)
    lines += ["## Design (fixed in code before the runs)", "",
              f"- **Selection rule.** {SELECTION_RULE} Learning rates: "
              f"{', '.join(f'{lr:g}' for lr in args.learning_rates)}; seeds {', '.join(map(str, args.seeds))} "
              f"(the sweep at seed {args.seeds[0]}).",
              f"- **Held-out splits.** Selection: evaluation batches [0, {sel}); report: batches [{sel}, {sel + rep})"
              f" of {settings.eval_batch_size} sequences of the held-out part, disjoint windows read in one fixed "
              "order by every run (`python -m nash_mhc.evaluate --first-batch K --window-seed 0`).",
              f"- **Equal tokens.** Every run: preset `{settings.model}` at sequence length {settings.seq_len}, "
              f"S = {S} steps x {settings.batch_size} sequences = {tokens:,} tokens, one cosine schedule of S steps"
              f" (warmup {settings.warmup_steps if settings.warmup_steps is not None else '10 % of it'}), data "
              f"`{settings.dataset}` / `{settings.tokenizer}`"
              + (f", extra flags `{' '.join(settings.train_args)}`" if settings.train_args else "") + ".",
              f"- **Equal FLOPs.** A variant with FLOPs/token F_v above the baseline's F_base ({variants[0]}) is "
              "also read at step s_v = floor(S x F_base / F_v), where its training FLOPs equal the baseline's "
              "total. It trains as two sessions (`--total-steps s_v --lr-schedule-steps S`, evaluate, then resume "
              "to S), so **its equal-FLOPs point is read mid-schedule, before its learning rate has decayed**, "
              "while the baseline's is read at the end of its schedule; this favours the baseline.",
              f"- Δ: each seed's bits per byte minus {variants[0]}'s at the same seed (both at their chosen "
              "rates), mean ± sample std over seeds. Travel: RMS distance of each coefficient group from its "
              "initialisation at step S (`travel/<group>`), mean over seeds.", "", "## Results", ""]
    table = []
    for row in rows:
        et, ef = row["equal_tokens"], row["equal_flops"]
        edge = " (edge)" if row["chosen_at_grid_edge"] else ""
        table.append([row["label"], f"{row['chosen_learning_rate']:g}{edge}" if row["chosen_learning_rate"]
                      else "pending" if row["variant"] not in chosen else "all diverged",
                      str(len(row["seeds"])) + (f" ({len(row['diverged_seeds'])} diverged)"
                                                if row["diverged_seeds"] else ""),
                      pm(*et["bits_per_byte"], digits=4), pm(*et["delta"], digits=4), str(ef["step"]),
                      pm(*ef["bits_per_byte"], digits=4), pm(*ef["delta"], digits=4), travel_text(row["travel"]),
                      report.millions(row["params"]), report.millions(row["flops_per_token"]),
                      pm(*row["step_time_s"], digits=3)])
    lines += report.markdown_table(["variant", "chosen lr", "seeds", "bits/byte, equal tokens", f"Δ vs {variants[0]}",
                                    "equal-FLOPs step", "bits/byte, equal FLOPs", f"Δ vs {variants[0]}",
                                    "coefficient travel", "params", "FLOPs/token", "s/step"], table)
    lines += ["", f"Learning-rate sweeps: selection-split bits per byte at step {S}, seed {args.seeds[0]} "
              "(* the chosen rate; an edge choice means the best rate may lie outside the grid).", ""]
    sweep_rows = []
    for row in rows:
        by_lr = {s["learning_rate"]: s for s in row["learning_rates"]}
        cells = [("diverged" if by_lr[lr]["status"] != "finished" else f"{by_lr[lr]['selection_bits_per_byte']:.4f}"
                  + ("*" if lr == row["chosen_learning_rate"] else "")) if lr in by_lr else "n/a"
                 for lr in args.learning_rates]
        sweep_rows.append([row["label"], *cells])
    lines += report.markdown_table(["variant", *(f"lr {lr:g}" for lr in args.learning_rates)], sweep_rows)
    agree = [r for r in rows if r["chosen_learning_rate"] is not None and r["report_split_would_choose"] is not None]
    same = sum(r["chosen_learning_rate"] == r["report_split_would_choose"] for r in agree)
    lines += ["", f"Check of the selection: the report split would have chosen the same rate for {same} of "
              f"{len(agree)} variants.", "", "![sweeps and deltas](ablation.png)", "",
              "## Full size on a TPU", "", "Data: `shards/` are prepared shards of a large corpus (`python -m "
              "nash_mhc.data.prepare`) and `tokenizer.json` a tokenizer of at most 49,152 ids; 5.2 B tokens per run "
              "is about 4 tokens per parameter, enough for the coefficients to travel (the mHC paper trains 30k-100k "
              "steps).", "", *full_size(list(args.residual), list(args.attention)).lines(
                  f"The same study at the `1b` preset on one v6e-8 host ({len(variants)} variants)"), ""]
    if sorted(variants) != sorted(FIRST_STEP):
        lines += [*full_size(["plain", "mhc"], ["full", "nash"]).lines(
            f"A first step: {', '.join(FIRST_STEP)} only"), ""]
    (out / "results.md").write_text("\n".join(lines))

