"""Where a CPU train step spends its time: XLA CPU thunk time per step by the nash_mhc source line behind each op.

    python benchmarks/cpu_profile.py [--residual mhc] [--attention multiscale] [--steps 3] [--out DIR] \
        [--top 30] [--match TEXT]

Compiles the ``small`` train step that ``nanogpt_compare.py`` times (:func:`nanogpt_compare.nash_step`: batch 8,
one device, the variant's ``--residual`` / ``--attention``), runs two steps, then traces ``--steps`` more with
``jax.profiler`` while XLA dumps the optimised HLO (``--xla_dump_to``). Each profiler event named after an HLO
instruction of the step's module is charged to the innermost ``nash_mhc`` frame of that instruction's stack trace
(the HLO's stack-frame tables, read as in ``benchmarks/estimate_breakdown.py``). Prints milliseconds and thunks per
step by source line, largest first; ``--match TEXT`` also lists the largest instructions of the lines containing
TEXT.

The times are the runtime's per-thunk events: a ``while`` loop's event covers the thunks of its body, which are
counted again under their own lines, and the step runs on several threads, so the column adds up to more than the
step's wall time. Read it as a ranking and as thunk counts (each thunk costs the XLA CPU runtime some microseconds
whatever its size), not as a partition of the step.

Then how the runtime's threads were occupied (milliseconds per step with two or more thunks running at once, one,
none, from the union of each thread's events) and the matmuls of the step's module (``dot`` instructions, alone
or inside a library fusion such as YNNPACK's), largest first, with each one's GFLOP/s over its own events: set
against the same shapes timed alone, a matmul that runs slower inside the step is sharing the cores.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--residual", default=None, help="default: the preset's")
    parser.add_argument("--attention", default=None, help="default: the preset's")
    parser.add_argument("--steps", type=int, default=3, help="traced steps")
    parser.add_argument("--out", type=Path, default=None, help="keep the trace and HLO dump here")
    parser.add_argument("--top", type=int, default=30, help="source lines to print")
    parser.add_argument("--match", default=None, help="also list the largest instructions of these lines")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    out = args.out or Path(tempfile.mkdtemp(prefix="cpu_profile_"))
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={out / 'dump'}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import estimate_breakdown
    import jax
    from jax.profiler import ProfileData
    from nanogpt_compare import nash_step

    import nash_mhc
    from nash_mhc import ModelConfig

    defaults = ModelConfig.preset("small")
    step, config = nash_step(args.residual or defaults.residual, args.attention or defaults.attention, 8)
    for _ in range(2):  # compile, then one more step outside the trace
        step()
    jax.profiler.start_trace(str(out / "trace"))
    for _ in range(args.steps):
        step()
    jax.profiler.stop_trace()

    time_ns: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    profile = ProfileData.from_file(str(max((out / "trace").rglob("*.xplane.pb"), key=os.path.getmtime)))
    for plane in profile.planes:
        for line in plane.lines:
            for event in line.events:
                time_ns[event.name] += event.duration_ns
                count[event.name] += 1
    module = max((out / "dump").glob("*train_step*cpu_after_optimizations.txt"), key=os.path.getsize)
    text = module.read_text()
    frames = estimate_breakdown.source_lines(text)
    instructions = {m.group(1): m.group(2) for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = ([^\n]*)", text, re.M)}
    source = {}
    for name, rest in instructions.items():
        frame = re.search(r"stack_frame_id=(\d+)", rest)
        source[name] = frames.get(int(frame.group(1)), "?") if frame else "(no stack frame)"
    by_line: collections.Counter[str] = collections.Counter()
    thunks: collections.Counter[str] = collections.Counter()
    for name in time_ns.keys() & source.keys():
        by_line[source[name]] += time_ns[name]
        thunks[source[name]] += count[name]
    steps = args.steps
    print(f"small ({config.residual} + {config.attention}), batch 8, one CPU device, {steps} traced steps; "
          f"nash_mhc from {Path(nash_mhc.__file__).parent.parent}; module {module.name}")
    print(f"thunks per step {sum(thunks.values()) / steps:,.0f}; events by source line, per step:")
    for line, ns in by_line.most_common(args.top):
        print(f"{ns / steps / 1e6:9.2f} ms {thunks[line] / steps:7.0f} thunks  {line}")
    if args.match:
        rows = sorted(((time_ns[n], n) for n in time_ns.keys() & source.keys() if args.match in source[n]),
                      reverse=True)
        print(f"largest instructions of the lines matching {args.match!r}:")
        for ns, name in rows[:args.top]:
            print(f"{ns / steps / 1e6:9.2f} ms x{count[name] / steps:<4.0f} {name}: {instructions[name][:140]}")
    threads = [[(e.start_ns, e.start_ns + e.duration_ns) for e in line.events if not _bookkeeping(e.name)]
               for plane in profile.planes for line in plane.lines if line.name.startswith(RUNTIME_THREADS)]
    both, one, none = occupancy([t for t in threads if t])
    print(f"runtime threads ({sum(map(bool, threads))}): two or more busy {both / steps / 1e6:.1f} ms per step, "
          f"one {one / steps / 1e6:.1f} ms, none {none / steps / 1e6:.1f} ms")
    rates = sorted(((time_ns[name], name, flops) for name, flops in matmul_flops(text).items() if name in time_ns),
                   reverse=True)
    total_ns, total_flops = sum(r[0] for r in rates), sum(flops * count[name] for _, name, flops in rates)
    print(f"matmuls: {len(rates)} instructions, {total_ns / steps / 1e6:.1f} ms of events and "
          f"{total_flops / steps / 1e9:.2f} GFLOP per step, {total_flops / max(total_ns, 1):.1f} GFLOP/s; "
          "the largest (ms per step, GFLOP/s over their own events, shape):")
    for ns, name, flops in rates[:args.top]:
        print(f"{ns / steps / 1e6:9.2f} ms {flops * count[name] / ns:7.1f} GFLOP/s  {name}: "
              f"{instructions[name].split(' ')[0]}")
    print(f"trace and HLO in {out}")


RUNTIME_THREADS = "tf_XLAEigen"  # the XLA CPU runtime's intra-op pool, which runs the step's thunks


def _bookkeeping(name: str) -> bool:
    """Profiler events that are not a thunk's work: the executor's own span, pool markers, end stamps."""
    return name.startswith(("ThunkExecutor", "ThreadpoolListener", "SlinkyThreadPool", "end: "))


def occupancy(threads: list[list[tuple[int, int]]]) -> tuple[int, int, int]:
    """(time with two or more threads busy, with exactly one, with none) between the first event's start and the
    last one's end; each thread's events (start, end) are merged first, so nested events count once."""
    edges = []
    for events in threads:
        for start, end in _merged(events):
            edges += [(start, 1), (end, -1)]
    edges.sort()
    spans = [0, 0, 0]  # none, one, two or more
    busy, last = 0, edges[0][0] if edges else 0
    for time, step in edges:
        spans[min(busy, 2)] += time - last
        busy, last = busy + step, time
    return spans[2], spans[1], spans[0]


def _merged(events: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for start, end in sorted(events):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def matmul_flops(text: str) -> dict[str, int]:
    """FLOPs of each top-level instruction of the entry computation that is a ``dot`` or calls a fused computation
    holding dots (2 x output elements x contracted size, summed over the computation's dots), read with the
    estimate's HLO parser (:func:`nash_mhc.tpu_compile.estimate.parse_hlo`)."""
    from nash_mhc.tpu_compile.estimate import parse_hlo

    computations, entry = parse_hlo(text)
    types = {i.name: i.type for instructions in computations.values() for i in instructions}

    def dims(type_text: str) -> list[int]:
        found = re.match(r"\w+\[([\d,]*)\]", type_text)
        return [int(d) for d in found.group(1).split(",") if d] if found else []

    def dot_flops(dot) -> int:
        lhs = dims(types.get(dot.operands[0], ""))
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", dot.rest).group(1)
        return 2 * math.prod(dims(dot.type)) * math.prod(lhs[int(d)] for d in contracting.split(",") if d)

    def flops(instruction) -> int:
        if instruction.op == "dot":
            return dot_flops(instruction)
        called = instruction.attr("calls")
        return sum(dot_flops(i) for i in computations.get(called, []) if i.op == "dot") if called else 0

    return {i.name: f for i in computations[entry] if (f := flops(i))}

if __name__ == "__main__":
    main()
