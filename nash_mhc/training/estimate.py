"""The TPU compiler's step-time estimate of a compiled train step, with every loop counted by its trip count.

libtpu's ``compiled.cost_analysis()`` totals (``flops``, ``bytes accessed``, ``optimal_seconds``) count each
``while`` body once, whatever its trip count, and ``optimal_seconds`` adds -1 for every operation it cannot cost
(a SparseCore offload, ...), so a whole train step can come out negative. What the compiler does give per
operation: every scheduled TensorCore operation of the optimised program (``compiled.as_text()``) carries
``"estimated_cycles"`` in its backend config, the TPU backend's own cost model of that operation (a fusion, a
copy, a convolution). This module reads the optimised HLO and sums

    step cycles = sum over scheduled operations of  estimated_cycles x (product of the trip counts of the loops
                  around it)

where the loops are the ``while`` operations the compiler kept (the layer scan and its transpose, grouped remat's
nested scans, the gradient-accumulation and loss-chunk scans, Sinkhorn's and the Nash solver's iterations, ...),
each trip count read from its condition (``counter < N``, counter starting at a constant and stepping by a
constant; the Nash solver, which may stop early, counted at its most iterations). The estimated step time is step
cycles / the chip's clock (:data:`CLOCK_HZ`). It is the compiler's estimate of the TensorCore's busy time, never a
measurement. Not in it (listed by :func:`estimate_lines`): collectives (bytes per chip are counted; on TPU they
run asynchronously next to the compute), SparseCore offloads, asynchronous copies between memory spaces, and the
few array operations without a cycle estimate (gathers and scatters; their HBM bytes are counted).

Pallas kernels (``tpu_custom_call``) get no cycle estimate from the compiler; each carries the
``CostEstimate`` its author declared (FLOPs, bytes). Given the device kind, a kernel is costed at the chip's
roofline, ``clock x max(FLOPs / FLOP/s, bytes / HBM bytes/s)`` with libtpu's own figures (:data:`ROOFLINE`):
the conversion its ``cost_analysis()["optimal_seconds"]`` makes of the same declaration. Its declared bytes
count as its HBM bytes. A roofline is a lower bound on a kernel's time: :attr:`StepCost.kernel_cycles` says how much of
an estimate rests on it.

HBM bytes per step: for every scheduled operation, the bytes of its operands and result that live in HBM
(memory space 0; VMEM ``S(1)`` and the rest are on-chip), by the same multiplicities. A fusion operand that the
fusion only slices counts the slices' bytes; a fusion whose result is an in-place dynamic-update-slice counts the
update. Logical (unpadded) sizes.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import re
from typing import Any

# Clock of one JAX device (a chip; a v4/v5p megacore device is both TensorCores of a chip): the bf16 peak of
# nash_mhc.training.throughput.PEAK_FLOPS over the FLOPs per cycle of the chip's matrix units in the compiler's
# cost model (2 x MXU rows x columns x MXUs): v4 275e12 / (2 x 128² x 8) = 1.05 GHz, v5e 197e12 / (2 x 128² x 4)
# = 1.5 GHz, v5p 459e12 / (2 x 128² x 8) = 1.75 GHz, v6e 918e12 / (2 x 256² x 4) = 1.75 GHz (not published; the
# compiler's estimate of a large matmul reaches 483,046 FLOP per cycle, so at most 918e12 / 483046 = 1.9 GHz).
# tests/test_estimate.py checks that a large matmul's estimate lies between 85 % and 100 % of the peak.
CLOCK_HZ = {"TPU v4": 1.05e9, "TPU v5 lite": 1.5e9, "TPU v5": 1.75e9, "TPU v6 lite": 1.75e9}
# (FLOP/s, HBM bytes/s) of one device in libtpu's cost model: the FLOPs and bytes per second its optimal_seconds
# gives a Pallas kernel declaring only FLOPs or only bytes (tests/test_estimate.py checks them). v5e's and v4's
# bandwidths are 90 % and 82 % of the vendors' 819 and 1,200 GB/s; v5p's FLOP/s are 86 % of its 459 TFLOP/s.
ROOFLINE = {"TPU v4": (2.74e14, 9.825e11), "TPU v5 lite": (1.97e14, 7.377e11), "TPU v5": (3.94e14, 2.350e12),
            "TPU v6 lite": (9.18e14, 1.638e12)}

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
_FREE = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all", "partition-id",
         "replica-id", "opt-barrier", "iota"}
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
                "collective-broadcast", "ragged-all-to-all")
_HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) \(.*\) -> .* \{$")
_INSTRUCTION = re.compile(r"^\s+(ROOT )?%([\w.\-]+) = (.*?) ([a-z][a-z0-9\-]*)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([\d,]*)\](\{[^}]*\})?")
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_DECLARED = re.compile(r'"cost_estimate":\{"flops":"(\d+)","transcendentals":"\d+","bytes_accessed":"(\d+)"')


class EstimateError(ValueError):
    """The optimised HLO has a construct this estimate cannot account for (the reason says which)."""


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    type: str       # the result type text: "bf16[8,128]{1,0:T(8,128)(2,1)}" or a tuple "(s32[], ...)"
    op: str
    rest: str       # operands and attributes
    root: bool

    @property
    def operands(self) -> list[str]:
        depth, end = 0, len(self.rest)
        for i, ch in enumerate(self.rest):  # the operand list ends at the parenthesis that closes the call
            depth += ch == "("
            if ch == ")":
                if depth == 0:
                    end = i
                    break
                depth -= 1
        return re.findall(r"%([\w.\-]+)", self.rest[:end])

    def attr(self, key: str) -> str | None:
        match = re.search(rf"\b{key}=%([\w.\-]+)", self.rest)
        return match.group(1) if match else None

    @property
    def cycles(self) -> int | None:
        match = _CYCLES.search(self.rest)
        return int(match.group(1)) if match else None


def parse_hlo(text: str) -> tuple[dict[str, list[Instruction]], str]:
    """({computation name: its instructions}, the entry computation's name) of an HLO module's text."""
    computations: dict[str, list[Instruction]] = {}
    entry, current = None, None
    for line in text.splitlines():
        if header := _HEADER.match(line):
            current = header.group(2)
            computations[current] = []
            entry = current if header.group(1) else entry
        elif line.strip() == "}":
            current = None
        elif current is not None and (match := _INSTRUCTION.match(line)):
            root, name, type_, op, rest = match.groups()
            computations[current].append(Instruction(name, type_, op, rest, bool(root)))
    if entry is None:
        raise EstimateError("no ENTRY computation in the HLO text")
    return computations, entry


def array_bytes(type_text: str, *, hbm_only: bool = False) -> int:
    """Bytes of every array in a (tuple) type text; with ``hbm_only`` only those in memory space 0."""
    total = 0
    for dtype, dims, layout in _ARRAY.findall(type_text):
        if dtype not in _BYTES or (hbm_only and re.search(r"S\((?!0\))\d+\)", layout or "")):
            continue
        total += math.prod(int(d) for d in dims.split(",") if d) * _BYTES[dtype]
    return total


def _constant(instruction: Instruction) -> int | None:
    match = re.match(r"(-?\d+)\)", instruction.rest)
    return int(match.group(1)) if instruction.op == "constant" and match else None


def trip_count(computations: dict[str, list[Instruction]], loop: Instruction,
               owner: list[Instruction]) -> int:
    """Iterations of ``while`` instruction ``loop`` (in a computation whose instructions are ``owner``).

    Its condition must compare one tuple element (the counter) with a constant; the counter's initial value
    must be a constant in the while's operand tuple (0 is assumed when it cannot be found: JAX's loops count
    from 0) and the body must add a constant to it (1 assumed likewise). A condition that ands it with other
    tests (the Nash solver's ``i < max_iters & some position unsettled``) counts its most iterations, an upper
    bound.
    """
    condition = computations[loop.attr("condition")]
    names = {i.name: i for i in condition}
    root = next(i for i in condition if i.root)
    if root.op != "and":
        return _compare_trip_count(computations, loop, owner, names, root)
    bounds = []
    for part in (names[o] for o in root.operands if o in names):
        with contextlib.suppress(EstimateError):  # a data-dependent test (positions unsettled) bounds nothing
            bounds.append(_compare_trip_count(computations, loop, owner, names, part))
    if not bounds:
        raise EstimateError(f"loop {loop.name}: no part of its condition compares a counter with a constant")
    return min(bounds)


def _compare_trip_count(computations: dict[str, list[Instruction]], loop: Instruction, owner: list[Instruction],
                        names: dict[str, Instruction], root: Instruction) -> int:
    """Trip count of ``loop`` as far as the comparison ``root`` of its condition allows."""
    direction = re.search(r"direction=(\w+)", root.rest)
    if root.op != "compare" or direction is None or len(root.operands) != 2:
        raise EstimateError(f"loop {loop.name}: its condition is not a comparison ({root.op})")
    left, right = (names.get(o) for o in root.operands)
    flip = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE"}
    if left is not None and _constant(left) is not None and right is not None:
        left, right, op = right, left, flip.get(direction.group(1), "?")
    else:
        op = direction.group(1)
    bound = None if right is None else _constant(right)
    if left is None or left.op != "get-tuple-element" or bound is None or op not in ("LT", "LE", "GT", "GE"):
        raise EstimateError(f"loop {loop.name}: its condition does not compare a counter with a constant")
    index = int(re.search(r"index=(\d+)", left.rest).group(1))
    start = _tuple_element_constant(owner, loop.operands[0], index)
    step = _counter_step(computations[loop.attr("body")], index)
    start = 0 if start is None else start
    step = (1 if op in ("LT", "LE") else -1) if step is None else step
    if step == 0:
        raise EstimateError(f"loop {loop.name}: its counter does not move")
    span = {"LT": bound - start, "LE": bound - start + 1, "GT": start - bound, "GE": start - bound + 1}[op]
    return max(0, -(-span // abs(step)))


def _tuple_element_constant(owner: list[Instruction], tuple_name: str, index: int) -> int | None:
    names = {i.name: i for i in owner}
    tuple_ = names.get(tuple_name)
    if tuple_ is None or tuple_.op != "tuple" or index >= len(tuple_.operands):
        return None
    element = names.get(tuple_.operands[index])
    while element is not None and element.op == "copy":
        element = names.get(element.operands[0])
    return None if element is None else _constant(element)


def _counter_step(body: list[Instruction], index: int) -> int | None:
    """The constant the body adds to tuple element ``index`` (None when the pattern is not found)."""
    names = {i.name: i for i in body}
    root = next((i for i in body if i.root), None)
    if root is None or root.op != "tuple" or index >= len(root.operands):
        return None
    update = names.get(root.operands[index])
    if update is None or update.op not in ("add", "subtract"):
        return None
    constants = [_constant(names[o]) for o in update.operands if o in names and _constant(names[o]) is not None]
    if len(constants) != 1:
        return None
    return constants[0] if update.op == "add" else -constants[0]


def _fusion_bytes(computations: dict[str, list[Instruction]], instruction: Instruction,
                  types: dict[str, str]) -> int:
    """HBM bytes a fusion reads and writes: sliced operands count their slices, an in-place dynamic-update-slice
    result its update."""
    fused = computations.get(instruction.attr("calls") or "", [])
    params = {int(re.match(r"(\d+)\)", i.rest).group(1)): i.name for i in fused if i.op == "parameter"}
    users = collections.defaultdict(list)
    for i in fused:
        for operand in i.operands:
            users[operand].append(i)
    total = 0
    for position, operand in enumerate(instruction.operands):
        full = array_bytes(types.get(operand, ""), hbm_only=True)
        readers = users.get(params.get(position, ""), [])
        if full and readers and all(r.op in ("dynamic-slice", "slice", "gather") for r in readers):
            full = min(full, sum(array_bytes(r.type) for r in readers))
        total += full
    root = next((i for i in fused if i.root), None)
    written = array_bytes(instruction.type, hbm_only=True)
    if written and root is not None and root.op == "dynamic-update-slice" and len(root.operands) > 1:
        update = next((i for i in fused if i.name == root.operands[1]), None)
        written = min(written, array_bytes(update.type)) if update is not None else written
    return total + written


def _matmul_finder(computations: dict[str, list[Instruction]]) -> Any:
    """A predicate: does an instruction run a matmul (a convolution or dot, itself or in what it calls)?"""
    memo: dict[str, bool] = {}

    def computation_has(name: str) -> bool:
        if name not in memo:
            memo[name] = False  # (no recursion in HLO; guards against malformed text)
            memo[name] = any(instruction_has(i) for i in computations.get(name, []))
        return memo[name]

    def instruction_has(instruction: Instruction) -> bool:
        if instruction.op in ("convolution", "dot"):
            return True
        called = instruction.attr("calls") if instruction.op == "fusion" else None
        return called is not None and computation_has(called)

    return instruction_has


def _kind(computations: dict[str, list[Instruction]], instruction: Instruction) -> str:
    """An operation's kind for the list of what is not costed: a fusion is named by its root operation."""
    if instruction.op != "fusion":
        return instruction.op
    root = next((i for i in computations.get(instruction.attr("calls") or "", []) if i.root), None)
    return f"{root.op if root is not None else 'other'} fusion"


@dataclasses.dataclass(frozen=True)
class StepCost:
    """What the compiler's optimised program costs per step on one chip, loops counted by their trip counts."""

    cycles: int                         # sum of estimated_cycles x multiplicity
    matmul_cycles: int                  # the part spent in operations that contain a matmul (convolution/dot)
                                        # and in Pallas kernels bound by their FLOPs (kernel_roofline)
    hbm_bytes: int                      # HBM bytes read and written by the scheduled operations
    collective_bytes: int               # operand + result bytes of the collectives, per chip
    loops: tuple[tuple[str, int, int], ...]  # (while instruction, trip count, times the loop itself runs)
    uncosted: dict[str, int]            # operations without a cycle estimate, per step, by kind
    uncosted_bytes: int                 # their HBM bytes (collectives and asynchronous copies excluded)
    cycles_once: int                    # every operation once (what cost_analysis's loop-once view adds up)
    kernel_cycles: int = 0              # the part spent in Pallas kernels, costed at their declared roofline

    def seconds(self, clock_hz: float) -> float:
        return self.cycles / clock_hz


def multiplicities(computations: dict[str, list[Instruction]], entry: str
                   ) -> tuple[collections.Counter[str], list[tuple[str, int, int]]]:
    """({computation: times it runs per step, loops counted by their trip counts}, the loops as (while
    instruction, trip count, times the loop itself runs)), from the entry computation ``entry``."""
    multiplicity: collections.Counter[str] = collections.Counter()
    loops: list[tuple[str, int, int]] = []

    def walk(name: str, times: int) -> None:
        multiplicity[name] += times
        owner = computations[name]
        for instruction in owner:
            if instruction.op == "while":
                trips = trip_count(computations, instruction, owner)
                loops.append((instruction.name, trips, times))
                walk(instruction.attr("body"), times * trips)
                walk(instruction.attr("condition"), times * (trips + 1))
            elif instruction.op == "conditional":
                # one branch runs whatever the index (XLA runs the last branch for an index out of range): a
                # conditional the compiler kept around a single computation; a real choice cannot be counted
                branches = re.search(r"branch_computations=\{([^}]*)\}", instruction.rest)
                names = [b.strip().lstrip("%") for b in branches.group(1).split(",")] if branches else []
                if len(names) != 1:
                    raise EstimateError(f"{instruction.name}: conditionals are not supported")
                walk(names[0], times)
            elif instruction.op == "call":
                walk(instruction.attr("to_apply") or instruction.attr("calls"), times)

    walk(entry, 1)
    return multiplicity, loops


def kernel_roofline(instruction: Instruction, device_kind: str | None) -> tuple[int, int, bool] | None:
    """(cycles, HBM bytes, bound by its FLOPs) of a Pallas kernel from its declared ``CostEstimate`` at the
    roofline of ``device_kind``; None for any other operation, a kernel without a declaration, or an unknown
    device kind. A kernel whose FLOPs at the chip's matrix peak outlast its bytes is matrix work (flash
    attention); one bound by its bytes is not, whatever multiply-adds it declares (the mHC stream kernels)."""
    match = _DECLARED.search(instruction.rest) if instruction.op == "custom-call" else None
    if match is None or device_kind not in CLOCK_HZ:
        return None
    flops, moved = int(match.group(1)), int(match.group(2))
    flops_per_second, bytes_per_second = ROOFLINE[device_kind]
    compute, memory = flops / flops_per_second, moved / bytes_per_second
    return math.ceil(max(compute, memory) * CLOCK_HZ[device_kind]), moved, flops > 0 and compute >= memory


def step_cost(hlo_text: str, device_kind: str | None = None) -> StepCost:
    """The per-step cost of an optimised TPU HLO module (``compiled.as_text()``); with ``device_kind``,
    Pallas kernels are costed at its roofline (:func:`kernel_roofline`), without it they are listed as
    uncosted."""
    computations, entry = parse_hlo(hlo_text)
    multiplicity, loops = multiplicities(computations, entry)
    cycles = once = hbm = collective = uncosted_bytes = matmul = kernel = 0
    has_matmul = _matmul_finder(computations)
    uncosted: collections.Counter[str] = collections.Counter()
    for name, times in multiplicity.items():
        types = {i.name: i.type for i in computations[name]}
        for instruction in computations[name]:
            op = instruction.op
            if op in _FREE or op == "while" or "AllocateBuffer" in instruction.rest:
                continue
            if op.startswith(_COLLECTIVES):
                if not op.endswith("-done"):
                    collective += times * (array_bytes(instruction.type)
                                           + sum(array_bytes(types.get(o, "")) for o in instruction.operands))
                uncosted["collective"] += times
                continue
            if op.startswith(("copy-start", "copy-done", "call-start", "call-done", "async-", "send", "recv")):
                uncosted["asynchronous copy" if op.startswith("copy") else "asynchronous/offloaded"] += times
                continue
            roofline = kernel_roofline(instruction, device_kind)
            if roofline is not None:
                cost, moved, compute_bound = roofline
                kernel += times * cost
            else:
                if op == "fusion":
                    moved = _fusion_bytes(computations, instruction, types)
                elif op == "dynamic-update-slice" and len(instruction.operands) > 1:
                    moved = 2 * array_bytes(types.get(instruction.operands[1], ""), hbm_only=True)
                else:
                    moved = array_bytes(instruction.type, hbm_only=True) + sum(
                        array_bytes(types.get(o, ""), hbm_only=True) for o in instruction.operands)
                cost = instruction.cycles
            hbm += times * moved
            if cost is None:
                if array_bytes(instruction.type) > 8:  # scalar bookkeeping (loop counters) is not listed
                    uncosted[_kind(computations, instruction)] += times
                    uncosted_bytes += times * moved
                continue
            cycles += times * cost
            once += cost
            if compute_bound if roofline is not None else has_matmul(instruction):
                matmul += times * cost
    return StepCost(cycles=cycles, matmul_cycles=matmul, hbm_bytes=hbm, collective_bytes=collective,
                    loops=tuple(loops), uncosted=dict(uncosted), uncosted_bytes=uncosted_bytes, cycles_once=once,
                    kernel_cycles=kernel)


def compiled_step_cost(compiled: Any, device_kind: str) -> tuple[StepCost | None, str | None]:
    """(the :class:`StepCost` of a compiled step, None) on a device kind with a clock; (None, why) when its HLO
    has something the estimate cannot count; (None, None) elsewhere (CPU, GPU: no cycle estimates)."""
    if device_kind not in CLOCK_HZ:
        return None, None
    try:
        return step_cost(compiled.as_text(), device_kind), None
    except EstimateError as problem:
        return None, str(problem)


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    """The figures of one step's estimate on ``chips`` chips (per chip where it says so)."""

    seconds: float                      # estimated step time
    tokens_per_second_per_chip: float
    mfu: float | None                   # model FLOPs over the peak (None: the device kind has no peak)
    peak_flops: float | None
    clock_hz: float


def step_estimate(cost: StepCost, *, device_kind: str, chips: int, tokens_per_step: int,
                  flops_per_token: float) -> StepEstimate | None:
    """Step time, tokens/s per chip and MFU (the project's convention: ``ModelConfig.flops_per_token`` over the
    bf16 peak table) from a :class:`StepCost`; None for a device kind without a clock in :data:`CLOCK_HZ`."""
    from nash_mhc.training.throughput import table_peak

    clock = CLOCK_HZ.get(device_kind)
    if clock is None or cost.cycles <= 0:
        return None
    seconds = cost.seconds(clock)
    per_chip = tokens_per_step / seconds / chips
    peak = table_peak(device_kind)
    mfu = None if peak is None else per_chip * flops_per_token / peak
    return StepEstimate(seconds, per_chip, mfu, peak, clock)


def estimate_lines(report: Any) -> list[str]:
    """``--compile-only``'s lines for the estimate of a :class:`nash_mhc.training.fit.FitReport` (none off TPU)."""
    if report.estimate_error is not None:
        return [f"estimated step time: unavailable ({report.estimate_error})"]
    cost = report.step_cost
    figures = None if cost is None else step_estimate(
        cost, device_kind=report.device_kind, chips=report.num_devices,
        tokens_per_step=report.batch_size * report.seq_len, flops_per_token=report.flops_per_token)
    if figures is None:
        return []
    mfu = "" if figures.mfu is None else (f", MFU {100 * figures.mfu:.1f} % of {figures.peak_flops / 1e12:.0f} "
                                          "TFLOP/s per chip")
    skipped = ", ".join(f"{count:,} {kind}" for kind, count in sorted(cost.uncosted.items()))
    return [
        f"estimated step time (the TPU compiler's cost model, not a measurement): {1e3 * figures.seconds:.2f} ms, "
        f"{figures.tokens_per_second_per_chip:,.0f} tokens/s per chip{mfu}",
        f"estimate: {cost.cycles:.4g} cycles per step at {figures.clock_hz / 1e9:.2f} GHz ({len(cost.loops)} loops "
        f"counted by their trip counts; each body once: {cost.cycles_once:.4g}); per chip per step: HBM "
        f"{cost.hbm_bytes / 2**30:.2f} GiB, collectives {cost.collective_bytes / 2**30:.2f} GiB"
        + (f"; Pallas kernels, costed at their declared roofline: {100 * cost.kernel_cycles / cost.cycles:.1f} % "
           "of the cycles" if cost.kernel_cycles else ""),
        f"not in the estimate (operations per step): {skipped or 'none'}",
    ]


__all__ = ["CLOCK_HZ", "ROOFLINE", "EstimateError", "Instruction", "StepCost", "StepEstimate", "array_bytes",
           "compiled_step_cost", "estimate_lines", "kernel_roofline", "multiplicities", "parse_hlo", "step_cost",
           "step_estimate", "trip_count"]
