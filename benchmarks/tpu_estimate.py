"""The estimate table of docs/results/tpu_estimate/README.md: the TPU compiler's estimated step time, tokens/s
per chip, MFU and HBM bytes per step of presets x model variants on TPU slices, from libtpu on this CPU host (no
TPU; every figure is the compiler's cost model, never a measurement).

    python benchmarks/tpu_estimate.py [--presets base 1b 3b] [--slices v5e-8 v6e-8 v4-32] \\
        [--variants plain+full mhc+full mhc+multiscale+nash] [--results docs/results/tpu_estimate.jsonl] \\
        [--doc docs/results/tpu_estimate/README.md] [--label before] [--earlier-labels LABEL ...] \\
        [--hlo-dir DIR] [--remat-group N] [--table-only]

Each (preset, slice) runs at the fit table's batch (the largest per-chip batch that fits, from
docs/results/tpu_fit.jsonl: remat full in groups of 4 layers, 8 loss chunks, fsdp over every chip, data 1, tp 1)
with the same memory flags (``--remat-group`` compiles other groups; a row's group is a column of the table and its
ratio is to plain + full at the same group), and each variant is one ``python -m nash_mhc.train --compile-only``
configuration (built by the training program's own parser) compiled once: :mod:`nash_mhc.tpu_compile.estimate` counts
the loops of the compiled step by their trip counts, so no variant compiles are needed. Every compile is appended
to the results file (JSON lines) as soon as it ends and the table between the ``tpu-estimate`` markers of the doc
is rewritten from all results with the run's ``--label``, so an interrupted run keeps its rows and a rerun skips
what it has; ``--earlier-labels`` fills the rows this run has not compiled from earlier runs (a change that leaves
those programs as they were need not recompile them), each row naming its run. ``--hlo-dir`` keeps each optimised
HLO module (gzip) to recompute the figures without compiling.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from host import cpu_model, table_host

from nash_mhc.tpu_compile.estimate import KERNEL_SLOW

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- tpu-estimate start -->", "<!-- tpu-estimate end -->"
DOC = ROOT / "docs" / "results" / "tpu_estimate" / "README.md"  # the study's record; docs/tpu.md links it
GIB = 2**30
PRESETS = ["base", "1b", "3b"]
SLICES = ["v5e-8", "v6e-8", "v4-32"]
VARIANTS = {"plain+full": ["--residual", "plain", "--attention", "full"],
            "mhc+full": ["--residual", "mhc", "--attention", "full"],
            "mhc+multiscale+nash": ["--residual", "mhc", "--attention", "multiscale", "--aggregation", "nash"]}
FIT_REMAT_GROUP, FIT_LOSS_CHUNKS = 4, 8  # the fit table's memory settings (its batches hold for these)


def memory_flags(remat_group: int) -> list[str]:
    """The fit table's memory flags, with layers rematerialised in groups of ``remat_group``."""
    return ["--remat", "full", "--remat-group", str(remat_group), "--loss-chunks", str(FIT_LOSS_CHUNKS)]


def fit_batches(path: Path) -> dict[tuple[str, str], int]:
    """{(preset, slice): the largest per-chip batch that fits} from the fit table's results (at its memory
    settings)."""
    best: dict[tuple[str, str], int] = {}
    for line in path.read_text().splitlines():
        r = json.loads(line) if line.strip() else None
        if r and r["fits"] and r.get("remat_group", 1) == FIT_REMAT_GROUP and r["loss_chunks"] == FIT_LOSS_CHUNKS:
            best[r["preset"], r["slice"]] = max(best.get((r["preset"], r["slice"]), 0), r["per_chip"])
    return best


def key(preset: str, slice_name: str, variant: str, per_chip: int, label: str) -> str:
    return f"{preset}|{slice_name}|{variant}|{per_chip}|{label}"


def row_remat_group(result: dict) -> int | None:
    """Layers per rematerialised group of one result, read from its training-program flags (None without)."""
    words = result.get("flags", "").split()
    return int(words[words.index("--remat-group") + 1]) if "--remat-group" in words else None


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def flags(preset: str, slice_name: str, variant: str, per_chip: int, remat_group: int) -> list[str]:
    """The training program's flags of one table entry (its --compile-only command, less --topology)."""
    from nash_mhc.tpu_compile.fit import resolve_topology

    chips = resolve_topology(slice_name).chips
    return ["--model", preset, *VARIANTS[variant], *memory_flags(remat_group), "--batch-size", str(per_chip * chips),
            "--mesh-data", "1", "--mesh-fsdp", str(chips), "--mesh-tp", "1"]


def estimate_configs(configs: Any, slice_name: str, hlo_path: Path | None = None) -> tuple[Any, Any, float]:
    """(fit report, its :class:`nash_mhc.tpu_compile.estimate.StepEstimate` or None, compile seconds) of the training
    program's ``configs`` (its RunConfig, ``nash_mhc.train.configs(argv)[0]``: without ``--compile-only``, which
    would size the vocabulary from the tokenizer, they keep the preset's) compiled for ``slice_name`` under its
    execution settings. ``hlo_path`` keeps the optimised HLO module the estimate reads (gzip)."""
    from nash_mhc.tpu_compile import estimate, fit

    original = estimate.step_cost
    if hlo_path is not None:
        hlo_path.parent.mkdir(parents=True, exist_ok=True)

        def saving(text: str, device_kind: str | None = None) -> estimate.StepCost:
            hlo_path.write_bytes(gzip.compress(text.encode()))
            return original(text, device_kind)

        estimate.step_cost = saving
    start = time.perf_counter()
    try:
        with configs.execution.use():  # --remat, --loss-chunks, ...: as the training program compiles its step
            report = fit.check_fit(configs.model, configs.train, topology=slice_name, data=configs.mesh.data,
                                   fsdp=configs.mesh.fsdp, tp=configs.mesh.tp)
    finally:
        estimate.step_cost = original
    seconds = time.perf_counter() - start
    cost = report.step_cost
    figures = None if cost is None else estimate.step_estimate(
        cost, device_kind=report.device_kind, chips=report.num_devices,
        tokens_per_step=report.batch_size * report.seq_len, flops_per_token=report.flops_per_token)
    return report, figures, seconds


def compile_once(preset: str, slice_name: str, variant: str, per_chip: int, label: str,
                 hlo_dir: Path | None, remat_group: int) -> dict:
    import jax

    from nash_mhc import train as train_program

    argv = flags(preset, slice_name, variant, per_chip, remat_group)
    hlo_path = None if hlo_dir is None else hlo_dir / f"{preset}_{slice_name}_{variant}_{per_chip}_{label}.hlo.gz"
    report, figures, seconds = estimate_configs(train_program.configs(argv)[0], slice_name, hlo_path)
    jax.clear_caches()
    cost = report.step_cost
    return {"preset": preset, "slice": slice_name, "variant": variant, "per_chip": per_chip, "label": label,
            "flags": " ".join(argv), "seq_len": report.seq_len, "chips": report.num_devices,
            "fits": report.fits, "total_bytes": report.total_bytes, "estimate_error": report.estimate_error,
            "seconds": figures and figures.seconds, "slow_seconds": figures and figures.slow_seconds,
            "tokens_per_second_per_chip":
            figures and figures.tokens_per_second_per_chip, "mfu": figures and figures.mfu,
            "cycles": cost and cost.cycles, "matmul_cycles": cost and cost.matmul_cycles,
            "cycles_once": cost and cost.cycles_once, "kernel_cycles": cost and cost.kernel_cycles,
            "hbm_bytes": cost and cost.hbm_bytes,
            "collective_bytes": cost and cost.collective_bytes, "loops": cost and len(cost.loops),
            "uncosted": cost and cost.uncosted, "flops_per_token": report.flops_per_token,
            "compile_seconds": round(seconds, 1),
            "machine": f"{os.uname().nodename}, {os.cpu_count()} CPU cores, {cpu_model()}", "commit": commit(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def table(results: dict[str, dict], presets: list[str], slices: list[str], variants: list[str],
          batches: dict[tuple[str, str], int], labels: list[str]) -> tuple[list[str], list[str]]:
    """(markdown rows, the entries with no result yet). Each entry comes from the first of ``labels`` that has it
    (the run's label first, then the ``--earlier-labels``); the "run" column names it."""
    rows = ["| preset | slice | tokens per chip | variant | remat group | memory per chip | est. step time | "
            f"kernels at {100 * KERNEL_SLOW:.0f} % | est. tokens/s per chip | est. MFU | HBM per chip per step | "
            "step time ÷ plain+full | Pallas kernels (roofline) | compile | run |",
            "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]

    def first(preset: str, slice_name: str, variant: str, per_chip: int, group: object = "any") -> dict | None:
        return next((r for r in (results.get(key(preset, slice_name, variant, per_chip, label)) for label in labels)
                     if r is not None and group in ("any", row_remat_group(r))), None)
    missing = []
    for preset in presets:
        for slice_name in slices:
            per_chip = batches.get((preset, slice_name))
            if per_chip is None:
                missing.append(f"{preset} on {slice_name} (no fit-table batch)")
                continue
            found = {v: first(preset, slice_name, v, per_chip) for v in variants}
            for variant, r in found.items():
                if r is None:
                    missing.append(f"{preset} {variant} on {slice_name}")
                    continue
                memory = "" if r.get("total_bytes") is None else f"{r['total_bytes'] / GIB:.1f} GiB"
                head = (f"| {preset} | {slice_name} | {per_chip} x {r['seq_len']} | {variant} | "
                        f"{row_remat_group(r) or ''} | {memory} | ")
                if r["seconds"] is None:
                    why = "does not fit" if r["fits"] is False else r["estimate_error"]
                    rows.append(head + f"{why} | | | | | | | | `{r['label']}` |")
                    continue
                base = first(preset, slice_name, "plain+full", per_chip, row_remat_group(r))  # at the same memory flags
                ratio = (f"{r['seconds'] / base['seconds']:.2f}" if base and base.get("seconds") else "")
                kernels = (f"{100 * r['kernel_cycles'] / r['cycles']:.1f} %" if r.get("kernel_cycles") is not None
                           else "not costed")
                slow = "predates the band" if r.get("slow_seconds") is None else f"{1e3 * r['slow_seconds']:,.0f} ms"
                rows.append(head + f"{1e3 * r['seconds']:,.0f} ms | {slow} | {r['tokens_per_second_per_chip']:,.0f} | "
                            f"{100 * r['mfu']:.1f} % | {r['hbm_bytes'] / GIB:,.0f} GiB | {ratio} | {kernels} | "
                            f"{r['compile_seconds'] / 60:.0f} min | `{r['label']}` |")
    return rows, missing


def write_doc(doc: Path, rows: list[str], missing: list[str], command: str, compiled_here: bool,
              labels: list[str]) -> None:
    """Rewrite the table between the markers, naming this host if the run compiled (:func:`host.table_host`)."""
    text = doc.read_text()
    if START not in text:
        raise SystemExit(f"{doc} has no {START} ... {END} markers")
    machine = table_host(text, START, END, compiled_here)
    earlier = (f"; the rows it did not compile come from the earlier runs {', '.join(f'`{x}`' for x in labels[1:])}"
               ", first found (the \"run\" column)" if len(labels) > 1 else "")
    body = [START, "", f"Produced by (run label `{labels[0]}`{earlier})", "", "```bash", command, "```", "",
            f"on {machine} (no TPU: libtpu's compiler and its cost model; every figure is the compiler's estimate, "
            "not a measurement). Each row is one `--compile-only` of the preset with the variant's `--residual` / "
            "`--attention` flags, `--remat full --loss-chunks " + str(FIT_LOSS_CHUNKS) + "` and layers rematerialised "
            "in groups of the \"remat group\" column (the fit table's " + str(FIT_REMAT_GROUP) + " unless the run "
            "gave `--remat-group`), fsdp over every chip, at the fit table's batch (the largest per-chip batch "
            "that fits at its memory settings); \"memory per chip\" is the compiler's arguments + temporaries, "
            "\"step time ÷ plain+full\" is to plain + full at the same remat group. The results file holds the "
            "exact flags, cycles and commit of each. \"Pallas kernels\": the "
            "share of the estimate that is Pallas kernels (flash attention; RoPE; mHC's stream update, collapse and "
            "Sinkhorn; the Nash aggregation's passes over the scale outputs and its game's Newton loop; multiscale "
            "down- and upsampling) "
            "costed at their roofline (matmul FLOPs at the MXU's rate, the rest at the vector unit's), a lower bound "
            f"on their time: \"est. step time\" is the band's low end, \"kernels at {100 * KERNEL_SLOW:.0f} %\" "
            f"its high end, the kernels' part divided by {KERNEL_SLOW} (docs/tpu.md, How to read a band). "
            "Rows whose high end reads \"predates the band\" were compiled before it and charged every kernel FLOP "
            "at the MXU's rate.", "",
            *(rows + [""] if len(rows) > 2 else [])]
    if missing:
        body += [f"No estimate yet: {', '.join(missing)}.", ""]
    body.append(END)
    doc.write_text(text[:text.index(START)] + "\n".join(body) + text[text.index(END) + len(END):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", nargs="+", default=PRESETS, help="presets to compile")
    parser.add_argument("--slices", nargs="+", default=SLICES, help="TPU slices to compile for")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                        help="model variants (residual + attention)")
    parser.add_argument("--results", default=str(ROOT / "docs" / "results" / "tpu_estimate.jsonl"))
    parser.add_argument("--fit-results", default=str(ROOT / "docs" / "results" / "tpu_fit.jsonl"),
                        help="the fit table's results: where the batches come from")
    parser.add_argument("--doc", default=str(DOC))
    parser.add_argument("--label", default="before", help="names this run's rows (a rerun after a model change "
                        "takes another label)")
    parser.add_argument("--earlier-labels", nargs="*", default=[], help="the table takes the rows this run has "
                        "not compiled from these labels' results, first found (after a change that leaves those "
                        "programs as they were)")
    parser.add_argument("--hlo-dir", default=None, help="keep each compiled step's optimised HLO here (gzip)")
    parser.add_argument("--table-only", action="store_true", help="rewrite the table from the results only")
    parser.add_argument("--remat-group", type=int, default=None, help="layers per rematerialised group (default: "
                        "the fit table's; give the run its own --label)")
    args = parser.parse_args()
    results_path, doc = Path(args.results), Path(args.doc)
    batches = fit_batches(Path(args.fit_results))
    results = {}
    if results_path.exists():
        for line in results_path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                results[key(r["preset"], r["slice"], r["variant"], r["per_chip"], r["label"])] = r
    chosen = [f"--{name} {' '.join(value)}" for name, value, default in (
        ("presets", args.presets, PRESETS), ("slices", args.slices, SLICES), ("variants", args.variants,
                                                                             list(VARIANTS))) if value != default]
    if args.remat_group is not None:
        chosen.append(f"--remat-group {args.remat_group}")
    chosen += [f"--earlier-labels {' '.join(args.earlier_labels)}"] if args.earlier_labels else []
    command = " ".join(["python benchmarks/tpu_estimate.py", *chosen, f"--label {args.label}"])
    labels = [args.label, *args.earlier_labels]

    def refresh() -> None:
        rows, missing = table(results, PRESETS, SLICES, list(VARIANTS), batches, labels)
        write_doc(doc, rows, missing, command, not args.table_only, labels)

    refresh()
    if args.table_only:
        return
    for preset in args.presets:  # cheapest first
        for slice_name in args.slices:
            per_chip = batches.get((preset, slice_name))
            for variant in args.variants:
                name = key(preset, slice_name, variant, per_chip or 0, args.label)
                if per_chip is None or name in results:
                    continue
                results[name] = compile_once(preset, slice_name, variant, per_chip, args.label,
                                             Path(args.hlo_dir) if args.hlo_dir else None,
                                             args.remat_group or FIT_REMAT_GROUP)
                results_path.parent.mkdir(parents=True, exist_ok=True)
                with results_path.open("a") as f:
                    f.write(json.dumps(results[name]) + "\n")
                r = results[name]
                seconds = "-" if r["seconds"] is None else (f"{1e3 * r['seconds']:.1f}-{1e3 * r['slow_seconds']:.1f} "
                                                            f"ms (kernels at 100 %-{100 * KERNEL_SLOW:.0f} %)")
                print(f"{preset} {slice_name} {variant} {per_chip}/chip: {seconds} "
                      f"({r['compile_seconds']:.0f} s)", flush=True)
                refresh()


if __name__ == "__main__":
    main()
