"""The fit table of docs/tpu.md: the largest per-chip batch (a power of two, at the preset's sequence length)
whose train step fits each TPU slice, found by the real TPU compiler on this CPU host (libtpu, no TPU).

    python benchmarks/fit_table.py [--presets base medium 1b 3b] [--slices v5e-8 v6e-8 v4-32 v5p-8] \
        [--max-batch 64] [--loss-chunks 8] [--remat-group 4] [--results docs/results/tpu_fit.jsonl] \
        [--doc docs/tpu.md]

For every (preset, slice), cheapest first, it searches the exponents of 1, 2, 4, ..., --max-batch
sequences per chip (mesh: fsdp over every chip, data 1, tp 1; remat full in groups of --remat-group layers
where that divides the layer count; the preset's dtype; cross-entropy over --loss-chunks slices) with
:func:`nash_mhc.tpu_compile.fit.check_fit`. The search is a bisection whose probe is, once the preset has any
compile, the exponent predicted from those compiles (temporaries grow linearly with the per-chip batch, the
sharded state shrinks with the chip count), so a row usually costs two compiles; a wrong prediction only
costs more compiles, never a wrong answer: a row is settled only by a compile that fits next to one at
twice the batch that does not. Every compile is appended to the results file (JSON lines) as soon as it
ends, and the table between the ``fit-table`` markers of the doc is rewritten from all the results so far,
so an interrupted run keeps its rows and a rerun skips the compiles it already has. A row records how long
its compiles took on the machine that ran them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import time
from pathlib import Path

from host import table_host

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- fit-table start -->", "<!-- fit-table end -->"
DOC = ROOT / "docs" / "tpu.md"  # the guide keeps the fit table: users need it
GIB = 2**30
PRESETS = ["base", "medium", "1b", "3b"]
SLICES = ["v5e-8", "v6e-8", "v4-32", "v5p-8"]


def key(preset: str, slice_name: str, per_chip: int, loss_chunks: int, remat_group: int) -> str:
    return f"{preset}|{slice_name}|{per_chip}|{loss_chunks}|{remat_group}"


def load(path: Path) -> dict[str, dict]:
    """Every recorded compile by its key; records written before groups existed compiled without them (1)."""
    if not path.exists():
        return {}
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for r in records:
        r.setdefault("remat_group", 1)
    return {key(r["preset"], r["slice"], r["per_chip"], r["loss_chunks"], r["remat_group"]): r for r in records}


def settings(preset: str, loss_chunks: int, remat_group: int) -> tuple[int, int]:
    """(loss chunks, remat group) as compiled: each falls back to 1 where it does not divide the preset."""
    from nash_mhc import ModelConfig

    model = ModelConfig.preset(preset)
    return (loss_chunks if model.seq_len % loss_chunks == 0 else 1,
            remat_group if model.num_layers % remat_group == 0 else 1)


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def compile_once(preset: str, slice_name: str, per_chip: int, loss_chunks: int, remat_group: int) -> dict:
    import jax

    from nash_mhc import ExecutionConfig, ModelConfig, TrainConfig
    from nash_mhc.tpu_compile.fit import check_fit, resolve_topology

    chips = resolve_topology(slice_name).chips
    model = ModelConfig.preset(preset)
    train = TrainConfig(batch_size=per_chip * chips)
    start = time.perf_counter()
    with ExecutionConfig(remat="full", remat_group=remat_group, loss_chunks=loss_chunks).use():
        report = check_fit(model, train, topology=slice_name, data=1, fsdp=-1, tp=1)
    jax.clear_caches()
    return {"preset": preset, "slice": slice_name, "per_chip": per_chip, "loss_chunks": loss_chunks,
            "remat_group": remat_group, "seq_len": model.seq_len, "dtype": model.dtype, "fits": report.fits,
            "total_bytes": report.total_bytes, "temp_bytes": report.temp_bytes, "state_bytes": report.state_bytes,
            "hbm_bytes": report.hbm_bytes, "chips": chips, "seconds": round(time.perf_counter() - start, 1),
            "machine": f"{platform.node()}, {os.cpu_count()} CPU cores", "commit": commit(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def hbm_of_slice(slice_name: str) -> int | None:
    """One chip's HBM in bytes, from the slice's abstract devices (no compile)."""
    from nash_mhc.tpu_compile.fit import hbm_of, topology_devices

    return hbm_of(topology_devices(slice_name)[0])[0]


def predicted_exponent(results: dict[str, dict], preset: str, slice_name: str, loss_chunks: int,
                       remat_group: int, max_exp: int) -> int | None:
    """The largest exponent predicted to fit ``slice_name`` from this preset's compiles so far (any slice).

    Temporaries per chip are modelled as a + b * per_chip (b from the two largest distinct batches that
    compiled, a = 0 with one), the rest of the total (state, batch, code) as this slice's own figure, else
    another slice's state scaled by its chip count over this one's (fsdp shards the state over every chip).
    """
    from nash_mhc.tpu_compile.fit import resolve_topology

    same = [r for r in results.values() if r["preset"] == preset and r["loss_chunks"] == loss_chunks
            and r["remat_group"] == remat_group and r.get("temp_bytes")]
    if not same:
        return None
    complete = [r for r in same if r.get("total_bytes")]  # a refusal's temporaries are the compiler's estimate
    temps = sorted({r["per_chip"]: r["temp_bytes"] for r in (complete or same)}.items())
    if len(temps) >= 2:
        (b0, t0), (b1, t1) = temps[-2], temps[-1]
        slope = (t1 - t0) / (b1 - b0)
        intercept = t0 - slope * b0
    else:
        slope, intercept = temps[0][1] / temps[0][0], 0.0
    chips = resolve_topology(slice_name).chips
    here = [r for r in same if r["slice"] == slice_name and r.get("total_bytes")]
    if here:
        rest = here[0]["total_bytes"] - here[0]["temp_bytes"]
    else:
        other = next((r for r in same if r.get("total_bytes")), same[0])
        other_chips = other.get("chips") or resolve_topology(other["slice"]).chips
        rest = other["state_bytes"] * other_chips / chips
    hbm = hbm_of_slice(slice_name)
    if hbm is None or slope <= 0:
        return None
    room = (hbm - rest - intercept) / slope
    return max(0, min(max_exp, math.floor(math.log2(room)))) if room >= 1 else 0


def largest_fitting(results: dict[str, dict], preset: str, slice_name: str, loss_chunks: int, remat_group: int,
                    max_exp: int, record) -> None:
    """Search exponents 0..max_exp; ``record`` compiles (or recalls) one batch and returns its result.

    A bisection: 2**low fits, 2**high does not, and each probe lies strictly between them, at the predicted
    exponent when there is one, else halfway.
    """
    low, high = -1, max_exp + 1  # 2**low fits (or low = -1: nothing known to fit), 2**high does not
    while high - low > 1:
        guess = predicted_exponent(results, preset, slice_name, loss_chunks, remat_group, max_exp)
        mid = (low + high) // 2 if guess is None else min(max(guess, low + 1), high - 1)
        if record(preset, slice_name, 2**mid, loss_chunks, remat_group)["fits"]:
            low = mid
        else:
            high = mid


def table(results: dict[str, dict], presets: list[str], slices: list[str], loss_chunks: int, remat_group: int,
          max_batch: int) -> tuple[list[str], list[str]]:
    """(markdown rows, the (preset, slice) pairs with no answer yet)."""
    rows = ["| preset | slice | dtype | remat group | largest batch per chip that fits | per chip at that batch "
            "(of HBM) | next power of two | compiles | compile time |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    missing = []
    for preset in presets:
        chunks, group = settings(preset, loss_chunks, remat_group)
        for slice_name in slices:
            tried = sorted((r for r in results.values() if r["preset"] == preset and r["slice"] == slice_name
                            and r["loss_chunks"] == chunks and r["remat_group"] == group),
                           key=lambda r: r["per_chip"])
            fit = [r for r in tried if r["fits"]]
            over = [r for r in tried if not r["fits"]]
            best = max(fit, key=lambda r: r["per_chip"]) if fit else None
            smallest_over = min(over, key=lambda r: r["per_chip"]) if over else None
            settled = (best is None and smallest_over is not None and smallest_over["per_chip"] == 1) or (
                best is not None and (best["per_chip"] >= max_batch or (
                    smallest_over is not None and smallest_over["per_chip"] == 2 * best["per_chip"])))
            if not settled:
                missing.append(f"{preset} on {slice_name}")
                continue
            seconds = sum(r["seconds"] for r in tried)
            if best is None:
                answer, memory = "none (1 does not fit)", "-"
            else:
                answer = f"{best['per_chip']} x {best['seq_len']} tokens"
                memory = f"{best['total_bytes'] / GIB:.2f} GiB of {best['hbm_bytes'] / GIB:.0f} GiB"
            nxt = (f"not tried (--max-batch {max_batch})" if smallest_over is None
                   else f"{smallest_over['per_chip']}: does not fit")
            rows.append(f"| {preset} | {slice_name} | {tried[0]['dtype']} | {group} | {answer} | {memory} | {nxt} | "
                        f"{len(tried)} | {seconds / 60:.0f} min |")
    return rows, missing


def write_doc(doc: Path, rows: list[str], missing: list[str], command: str, compiled_here: bool) -> None:
    """Rewrite the table between the markers, naming this host if the run compiled (:func:`host.table_host`)."""
    text = doc.read_text()
    if START not in text:
        raise SystemExit(f"{doc} has no {START} ... {END} markers")
    machine = table_host(text, START, END, compiled_here)
    body = [START, "", "Produced by", "", "```bash", command, "```", "",
            f"on {machine} (no TPU: libtpu's compiler, `--compile-only`'s numbers). Mesh: fsdp over every chip; "
            "remat full, in groups of the *remat group* layers (`--remat-group`); the preset's dtype and sequence "
            "length.", "", *(rows + [""] if len(rows) > 2 else [])]
    if missing:
        body += [f"No answer yet (each compile takes 2-30 minutes on this machine; the results file holds the "
                 f"compiles done so far): {', '.join(missing)}.", ""]
    body.append(END)
    doc.write_text(text[:text.index(START)] + "\n".join(body) + text[text.index(END) + len(END):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", nargs="+", default=PRESETS, help="presets to compile (the table shows all)")
    parser.add_argument("--slices", nargs="+", default=SLICES, help="slices to compile (the table shows all)")
    parser.add_argument("--max-batch", type=int, default=64, help="largest per-chip batch tried (a power of two)")
    parser.add_argument("--loss-chunks", type=int, default=8, help="cross-entropy slices (1 where seq_len "
                        "does not divide)")
    parser.add_argument("--remat-group", type=int, default=4, help="layers per rematerialised group (1 where it "
                        "does not divide the preset's layer count)")
    parser.add_argument("--results", default=str(ROOT / "docs" / "results" / "tpu_fit.jsonl"))
    parser.add_argument("--doc", default=str(DOC))
    parser.add_argument("--table-only", action="store_true", help="rewrite the table from the results only")
    parser.add_argument("--recompile", action="store_true", help="compile the --presets x --slices searches again "
                        "at this commit instead of recalling recorded batches (the newest record of a batch wins)")
    args = parser.parse_args()
    max_exp = args.max_batch.bit_length() - 1
    results_path, doc = Path(args.results), Path(args.doc)
    results = load(results_path)
    full_command = (f"python benchmarks/fit_table.py --max-batch {args.max_batch} --loss-chunks {args.loss_chunks} "
                    f"--remat-group {args.remat_group}")

    def refresh() -> None:  # the doc's table always covers the whole default grid (a run may do part of it)
        presets = [*PRESETS, *(p for p in args.presets if p not in PRESETS)]
        slices = [*SLICES, *(s for s in args.slices if s not in SLICES)]
        rows, missing = table(results, presets, slices, args.loss_chunks, args.remat_group, args.max_batch)
        write_doc(doc, rows, missing, full_command, not args.table_only)

    compiled_now: set[str] = set()

    def record(preset: str, slice_name: str, per_chip: int, loss_chunks: int, remat_group: int) -> dict:
        name = key(preset, slice_name, per_chip, loss_chunks, remat_group)
        if name not in results or (args.recompile and name not in compiled_now):
            compiled_now.add(name)
            results[name] = compile_once(preset, slice_name, per_chip, loss_chunks, remat_group)
            results_path.parent.mkdir(parents=True, exist_ok=True)
            with results_path.open("a") as f:
                f.write(json.dumps(results[name]) + "\n")
            r = results[name]
            print(f"{preset} {slice_name} {per_chip}/chip: fits={r['fits']} "
                  f"total={(r['total_bytes'] or 0) / GIB:.2f} GiB ({r['seconds']:.0f} s)", flush=True)
            refresh()
        return results[name]

    refresh()
    if args.table_only:
        return
    for preset in args.presets:  # cheapest first: small models, then small slices
        for slice_name in args.slices:
            largest_fitting(results, preset, slice_name, *settings(preset, args.loss_chunks, args.remat_group),
                            max_exp, record)


if __name__ == "__main__":
    main()
