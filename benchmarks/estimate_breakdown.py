"""Where the TPU compiler's estimated step time goes: the estimate's cycles by kind of operation, and its largest
operations, from an optimised HLO module that ``benchmarks/tpu_estimate.py --hlo-dir DIR`` kept.

    python benchmarks/estimate_breakdown.py DIR/1b_v6e-8_plain+full_16_main.hlo.gz [--top 12] \
        [--device-kind "TPU v6 lite"] [--by-source | --by-part] [--against OTHER.hlo.gz]

Each operation counts estimated_cycles x the trip counts of the loops around it (as
:func:`nash_mhc.tpu_compile.estimate.step_cost` does); a Pallas kernel counts its declared cost at the roofline of
``--device-kind`` (:func:`nash_mhc.tpu_compile.estimate.kernel_roofline`, kind "Pallas kernel"). Kind: the
operation, or for a fusion the root operation of the fused computation; "matmul" says whether the operation
contains a convolution or dot, or for a kernel whether its FLOPs (not its bytes) set its roofline.
``--by-source`` adds the cycles up by the line of nash_mhc that each operation comes from (the innermost frame
of its HLO stack trace inside the package); ``--by-part`` by part of the model (:func:`part`: layout copies first,
then by source file); ``--against`` prints either table beside another module's (before / after a change, or one
variant against another).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import re
from pathlib import Path

from nash_mhc.tpu_compile import estimate


def breakdown(text: str, device_kind: str | None = None) -> list[tuple[int, int, int, str, bool, str, str]]:
    """(cycles per step, times per step, cycles once, kind, matmul, result type, name) of every costed
    operation, largest first."""
    computations, entry = estimate.parse_hlo(text)
    times, _ = estimate.multiplicities(computations, entry)
    has_matmul = estimate._matmul_finder(computations)
    rows = []
    for name, count in times.items():
        for op in computations[name]:
            if (kernel := estimate.kernel_roofline(op, device_kind)) is not None:
                rows.append((count * kernel[0], count, kernel[0], "Pallas kernel", kernel[2], op.type, op.name))
            elif op.cycles:
                rows.append((count * op.cycles, count, op.cycles, estimate._kind(computations, op), has_matmul(op),
                             op.type, op.name))
    return sorted(rows, reverse=True)


def source_lines(text: str) -> dict[int, str]:
    """{stack frame id: "file.py:line function"} of the innermost nash_mhc frame of each of the module's stack
    frames (the FileNames / FunctionNames / FileLocations / StackFrames tables at the top of its text); frames
    with none inside the package map to their innermost frame."""
    tables: dict[str, dict[int, str]] = {}
    current = None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
        elif current is not None and (match := re.match(r"^(\d+) (.*)$", line)):
            current[int(match.group(1))] = match.group(2)
        else:
            current = None
    fields = {name: {k: dict((a, int(b)) for a, b in re.findall(r"(\w+)=(\d+)", v)) for k, v in rows.items()}
              for name, rows in tables.items() if name in ("FileLocations", "StackFrames")}
    files = {k: v.strip('"') for k, v in tables.get("FileNames", {}).items()}
    functions = {k: v.strip('"') for k, v in tables.get("FunctionNames", {}).items()}

    def where(location: int) -> tuple[str, str]:
        loc = fields["FileLocations"][location]
        path = files[loc["file_name_id"]]
        short = path.split("/nash_mhc/", 1)[1] if "/nash_mhc/" in path and "site-packages" not in path else ""
        return short, f"{short or path.rsplit('/', 1)[-1]}:{loc['line']} {functions[loc['function_name_id']]}"

    lines = {}
    for frame in fields.get("StackFrames", {}):
        current_frame, innermost, seen = frame, None, set()
        while current_frame in fields["StackFrames"] and current_frame not in seen:  # parents: id - 1, 0 none
            seen.add(current_frame)
            entry = fields["StackFrames"][current_frame]
            package, label = where(entry["file_location_id"])
            innermost = innermost or label
            if package:
                innermost = label
                break
            current_frame = entry["parent_frame_id"] - 1
        lines[frame] = innermost or "?"
    return lines


def sourced(text: str, device_kind: str | None) -> list[tuple[str, tuple[int, int, int, str, bool, str, str]]]:
    """(source line, :func:`breakdown` row) of every costed operation (see :func:`source_lines`)."""
    frames = source_lines(text)
    computations, _ = estimate.parse_hlo(text)
    ops = {op.name: op for ops in computations.values() for op in ops}
    rows = []
    for row in breakdown(text, device_kind):
        match = re.search(r"stack_frame_id=(\d+)", ops[row[-1]].rest)
        rows.append((frames.get(int(match.group(1)), "?") if match else "(no source)", row))
    return rows


def by_source(text: str, device_kind: str | None) -> collections.Counter[str]:
    """{source line: estimated cycles per step} of the module."""
    totals: collections.Counter[str] = collections.Counter()
    for source, row in sourced(text, device_kind):
        totals[source] += row[0]
    return totals


# (part, source files): an operation belongs to the first part one of whose files its source line is in
PARTS = (
    ("Nash aggregation: kernels", ()),  # Pallas kernels of the aggregation files below
    ("Nash aggregation: XLA", ("ops/aggregation.py", "kernels/tpu/aggregation_kernels.py", "ops/game.py",
                               "ops/equilibrium.py", "layers/aggregation.py")),
    ("mHC streams", ("ops/stream_collapse", "ops/stream_slabs.py", "ops/stream_tiles.py", "ops/stream_mix.py",
                     "ops/sinkhorn", "kernels/tpu/stream_collapse_kernels.py", "kernels/tpu/stream_mix_kernel.py",
                     "kernels/tpu/sinkhorn_kernel.py", "layers/hyperconnection.py")),
    ("multiscale resampling", ("ops/multiscale.py", "kernels/tpu/downsample_kernel.py",
                               "kernels/tpu/upsample_kernel.py")),
    ("attention: flash kernels", ()),  # Pallas kernels of kernels/tpu/flash_attention.py
    ("attention: projections", ("layers/attention.py",)),  # their matmuls; the rest is "attention: other"
    ("attention: other", ("kernels/tpu/flash_attention.py", "ops/attention.py")),
    ("RoPE", ("ops/rope", "kernels/tpu/rope_kernel.py")),
    ("FFN", ("layers/ffn.py", "ops/swiglu.py")),
    ("norms", ("layers/norm.py", "ops/rms_norm.py")),
    ("train step: loss, clipping, update", ("training/step.py",)),
)
LAYOUT = "layout copies (copy, transpose, bitcast roots; no matmul)"
OTHER = "everything else (model.py: embedding, LM head, residual adds; no source line)"


def part(source: str, kind: str, matmul: bool, name: str) -> str:
    """The part of the model an operation belongs to: a copy, transpose or bitcast-rooted fusion without a matmul
    is a layout copy wherever it comes from; otherwise its source file (:data:`PARTS`), a Pallas kernel of the
    aggregation or flash attention to its own part, the attention layer's non-matmul operations to "attention:
    other"."""
    if not matmul and kind != "Pallas kernel" and re.search(r"copy|transpose|bitcast", kind + " " + name):
        return LAYOUT
    path = source.split(" ", 1)[0]
    for label, files in PARTS:
        if any(path.startswith(f) for f in files):
            if label == "Nash aggregation: XLA" and kind == "Pallas kernel":
                return "Nash aggregation: kernels"
            if label == "attention: other" and kind == "Pallas kernel" and "flash" in path:
                return "attention: flash kernels"
            if label == "attention: projections" and not matmul:
                return "attention: other"
            return label
    return OTHER


def by_part(text: str, device_kind: str | None) -> collections.Counter[str]:
    """{part of the model: estimated cycles per step} of the module (:func:`part`)."""
    totals: collections.Counter[str] = collections.Counter()
    for source, (cycles, _, _, kind, matmul, _, name) in sourced(text, device_kind):
        totals[part(source, kind, matmul, name)] += cycles
    return totals


def read(path: str) -> str:
    """The module's text, gzip-compressed or not (told by gzip's magic bytes, not by the file's name)."""
    raw = Path(path).read_bytes()
    return (gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw).decode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("hlo", help="an optimised HLO module (.hlo.gz from tpu_estimate.py --hlo-dir, or text)")
    parser.add_argument("--top", type=int, default=12, help="how many kinds and operations to list")
    parser.add_argument("--device-kind", default="TPU v6 lite", choices=sorted(estimate.CLOCK_HZ),
                        help="the chip whose roofline costs Pallas kernels")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--by-source", action="store_true", help="cycles by the nash_mhc source line instead")
    group.add_argument("--by-part", action="store_true", help="cycles by part of the model instead")
    parser.add_argument("--against", default=None, help="with --by-source or --by-part: a second module to compare "
                        "with")
    args = parser.parse_args()
    if args.against and not (args.by_source or args.by_part):
        parser.error("--against needs --by-source or --by-part")
    text = read(args.hlo)
    if args.by_source or args.by_part:
        tally = by_source if args.by_source else by_part
        totals = tally(text, args.device_kind)
        other = tally(read(args.against), args.device_kind) if args.against else None
        total = sum(totals.values())
        print(f"{total:.4g} cycles per step" + (f" ({sum(other.values()):.4g} in --against)" if other else ""))
        if other is None:
            for line, cycles in totals.most_common(args.top):
                print(f"{cycles / total:6.2%} {cycles:>12.4g}  {line}")
        else:
            changes = sorted(set(totals) | set(other), key=lambda k: -abs(totals[k] - other[k]))
            for line in changes[:args.top]:
                print(f"{totals[line]:>12.4g} {other[line]:>12.4g} {totals[line] - other[line]:>+12.4g}  {line}")
        return
    rows = breakdown(text, args.device_kind)
    total = sum(r[0] for r in rows)
    print(f"{total:.4g} cycles per step")
    kinds: collections.Counter[tuple[str, bool]] = collections.Counter()
    for r in rows:
        kinds[r[3], r[4]] += r[0]
    for (kind, matmul), cycles in kinds.most_common(args.top):
        print(f"{cycles / total:6.1%}  {kind}{' (matmul)' if matmul else ''}")
    print()
    for cycles, count, once, kind, _, type_, name in rows[:args.top]:
        print(f"{cycles / total:6.2%}  x{count:<5} {once:>10} cycles  {kind:<22} {type_[:60]}  {name}")


if __name__ == "__main__":
    main()
