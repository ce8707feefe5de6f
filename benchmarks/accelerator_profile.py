"""Where a train step spends an accelerator's time: device kernel time per step by the nash_mhc source line behind
each HLO instruction, and the matrix products with their operand types.

    python benchmarks/accelerator_profile.py [--preset base] [--variant plain+full] [--dtype bfloat16] \
        [--batch-size 16] [--steps 3] [--scan-unroll N] [--out DIR] [--top 30]

Builds the step that ``accelerator_step.py`` times (one device, random tokens), runs three steps, then traces
``--steps`` more with ``jax.profiler`` while XLA dumps the optimised HLO. Device events (the GPU's kernels: events
of the ``/device:`` planes carrying an ``hlo_op`` stat; on a CPU, whose "device" is the host, the runtime's
thunks) are charged to the innermost ``nash_mhc`` frame of their HLO instruction's stack trace, as
``cpu_profile.py`` does on the CPU. Prints per step: the wall time, the device's busy time, milliseconds by source
line, and the largest matrix products (custom calls and ``dot`` fusions) with their operand shapes and types.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def kernel_family(name: str) -> str:
    """The library or runtime behind a kernel that no HLO instruction is named after."""
    lowered = name.lower()
    if lowered.startswith(("nvjet", "sm90_xmma", "sm80_xmma", "cutlass", "ampere", "gemm")):
        return "cuBLAS matmul kernels"
    if "cudnn" in lowered or "fmha" in lowered or "flash" in lowered or lowered.startswith("sm90_fprop"):
        return "cuDNN kernels"
    if lowered.startswith(("memcpy", "memset")):
        return "copies and memsets"
    return "other kernels"


def summarise(xplane: Path, hlo_text: str, steps: int, host_device: bool, top: int) -> list[str]:
    """Report lines of a trace of ``steps`` steps: device time by source line, by kernel family, largest kernels.

    An event is charged to the HLO instruction its ``hlo_op`` stat names or, inside a GPU command buffer (whose
    events carry the buffer's name there), the instruction its kernel is named after (XLA names a fusion's kernel
    after the fusion, "." and "-" as "_"); other kernels (cuBLAS's, cuDNN's) go by :func:`kernel_family`.
    """
    import estimate_breakdown
    from jax.profiler import ProfileData

    frames = estimate_breakdown.source_lines(hlo_text)
    instructions = {m.group(1): m.group(2)
                    for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = ([^\n]*)", hlo_text, re.M)}
    by_kernel_name = {re.sub(r"[.\-]", "_", name): name for name in instructions}
    device_plane = "/host:CPU" if host_device else "/device:"
    time_ns: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    families: collections.Counter[str] = collections.Counter()
    for plane in ProfileData.from_file(str(xplane)).planes:
        if not plane.name.startswith(device_plane):
            continue
        for line in plane.lines:
            for event in line.events:
                op = dict(event.stats).get("hlo_op")
                if op not in instructions:
                    op = event.name if event.name in instructions else by_kernel_name.get(event.name)
                if host_device and op is None:
                    continue  # the host's own events (Python, the runtime's bookkeeping)
                key = op if op is not None else f"[{kernel_family(event.name)}] {event.name}"
                time_ns[key] += event.duration_ns
                count[key] += 1
                families["HLO instructions" if op is not None else kernel_family(event.name)] += event.duration_ns
    by_line: collections.Counter[str] = collections.Counter()
    for name, ns in time_ns.items():
        if name not in instructions:
            continue
        frame = re.search(r"stack_frame_id=(\d+)", instructions[name])
        by_line[frames.get(int(frame.group(1)), "?") if frame else "(no stack frame)"] += ns
    ms = lambda ns: f"{ns / steps / 1e6:8.2f} ms"  # noqa: E731
    lines = [f"device events {sum(time_ns.values()) / steps / 1e6:.1f} ms per step in "
             f"{sum(count.values()) / steps:,.0f} events (on a CPU the runtime's thunks, overlapping)",
             "by kind: " + "; ".join(f"{name} {ns / steps / 1e6:.1f} ms" for name, ns in families.most_common()),
             "by source line (HLO instructions only), per step:"]
    lines += [f"{ms(ns)}  {line}" for line, ns in by_line.most_common(top)]
    lines.append("largest kernels / instructions, per step:")
    for name, ns in time_ns.most_common(top):
        text = re.sub(r"\s+", " ", instructions.get(name, ""))[:200]
        lines.append(f"{ms(ns)} x{count[name] / steps:<4.0f} {name} {text}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="base")
    parser.add_argument("--variant", default="plain+full")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: the preset's")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3, help="traced steps")
    parser.add_argument("--scan-unroll", type=int, default=None,
                        help="layers per iteration of the layer scan (default: the preset's)")
    parser.add_argument("--out", type=Path, default=None, help="keep the trace and HLO dump here")
    parser.add_argument("--top", type=int, default=30, help="source lines and kernels to print")
    parser.add_argument("--from-files", nargs=2, type=Path, metavar=("XPLANE", "HLO"), default=None,
                        help="only report a saved trace (.xplane.pb) with its optimised HLO text (of --steps steps)")
    args = parser.parse_args()
    if args.from_files is not None:
        xplane, hlo = args.from_files
        for line in summarise(xplane, hlo.read_text(), args.steps, "cpu_after" in hlo.name, args.top):
            print(line)
        return
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if args.scan_unroll is not None and args.scan_unroll < 1:
        parser.error(f"--scan-unroll must be at least 1, got {args.scan_unroll}")
    out = args.out or Path(tempfile.mkdtemp(prefix="accelerator_profile_"))
    for stale in (out / "dump", out / "trace"):  # a reused --out: only this run's module and trace
        shutil.rmtree(stale, ignore_errors=True)
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={out / 'dump'}".strip()

    import jax
    from accelerator_step import VARIANTS, execution_of, ours

    if args.variant not in VARIANTS:
        parser.error(f"--variant must be one of {', '.join(VARIANTS)}")
    step, config, device = ours(args.preset, args.variant, args.dtype, args.batch_size, args.scan_unroll)
    tokens = args.batch_size * config.seq_len
    for _ in range(3):
        jax.block_until_ready(step())
    jax.profiler.start_trace(str(out / "trace"))
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    jax.block_until_ready(loss)
    wall = (time.perf_counter() - start) / args.steps
    jax.profiler.stop_trace()

    module = max((out / "dump").glob("*train_step*after_optimizations.txt"), key=os.path.getsize)
    xplane = max((out / "trace").rglob("*.xplane.pb"), key=os.path.getmtime)
    print(f"{args.preset} {args.variant}, batch {args.batch_size}, dtype {args.dtype or 'preset'}, scan_unroll "
          f"{execution_of(args.preset, args.scan_unroll).scan_unroll}, one "
          f"{device.device_kind}; {args.steps} traced steps; module {module.name}")
    print(f"wall {wall * 1e3:.1f} ms per step, {tokens / wall:,.0f} tokens/s")
    for line in summarise(xplane, module.read_text(), args.steps, device.platform == "cpu", args.top):
        print(line)
    print(f"trace and HLO in {out}")


if __name__ == "__main__":
    main()
