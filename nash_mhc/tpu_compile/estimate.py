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
``CostEstimate`` its author declared (FLOPs, bytes). Given the device kind, a kernel is costed at its roofline
(:func:`kernel_roofline`: its matmul FLOPs at the MXU's rate, the rest of its FLOPs at the vector unit's, its bytes
at HBM bandwidth). A roofline is a lower bound on a kernel's time, so a step's estimate is a band
(:meth:`StepCost.band`): kernels at their roofline, and at :data:`KERNEL_SLOW` of it.
:attr:`StepCost.kernel_cycles` says how much of an estimate rests on the kernels.

HBM bytes per step: for every scheduled operation, the bytes of its operands and result that live in HBM
(memory space 0; VMEM ``S(1)`` and the rest are on-chip), by the same multiplicities. A fusion operand that the
fusion only slices counts the slices' bytes; a fusion whose result is an in-place dynamic-update-slice counts the
update. Logical (unpadded) sizes.

Reading the HLO text (computations, instructions, array bytes, loop trip counts, how often each computation runs)
is :mod:`nash_mhc.tpu_compile.hlo`; its names are importable from here as before.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Any

from nash_mhc.tpu_compile.hlo import (
    EstimateError,
    Instruction,
    array_bytes,
    multiplicities,
    parse_hlo,
    trip_count,
)
from nash_mhc.tpu_compile.mosaic import dot_flops

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
# FLOP/s of one device's vector unit (VPU), derived, not published per chip: (8 sublanes x 128 lanes) x ALUs per
# (sublane, lane) x TensorCores per device x CLOCK_HZ, one FLOP per ALU per cycle. The VPU's shape, v4's 2 ALUs and
# v5's 4 ALUs (the v5p example: 8 x 128 x 4 x 2 cores x 1.75 GHz = 1.4e13) are from "How to Scale Your Model", "How
# to Think About TPUs", Appendix A (jax-ml.github.io/scaling-book/tpus). v5e takes v5's 4 ALUs on its one core; v6e
# (not published) is assumed to keep them. v4: 8 x 128 x 2 x 2 x 1.05e9, v5e: 8 x 128 x 4 x 1 x 1.5e9, v5p:
# 8 x 128 x 4 x 2 x 1.75e9, v6e: 8 x 128 x 4 x 1 x 1.75e9.
VECTOR_RATE = {"TPU v4": 4.30e12, "TPU v5 lite": 6.14e12, "TPU v5": 1.43e13, "TPU v6 lite": 7.17e12}
# The slow end of the band: kernels at this fraction of their roofline (kernel time / KERNEL_SLOW).
KERNEL_SLOW = 0.6

_FREE = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all", "partition-id",
         "replica-id", "opt-barrier", "iota"}
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
                "collective-broadcast", "ragged-all-to-all")
_DECLARED = re.compile(r'"cost_estimate":\{"flops":"(\d+)","transcendentals":"\d+","bytes_accessed":"(\d+)"')


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
    kernel_cycles: int = 0              # the part spent in Pallas kernels, costed at their roofline

    def seconds(self, clock_hz: float) -> float:
        return self.cycles / clock_hz

    def band(self, clock_hz: float) -> tuple[float, float]:
        """(seconds with the kernels at their roofline, seconds with them at :data:`KERNEL_SLOW` of it)."""
        slow = self.cycles - self.kernel_cycles + self.kernel_cycles / KERNEL_SLOW
        return self.cycles / clock_hz, slow / clock_hz


def kernel_roofline(instruction: Instruction, device_kind: str | None) -> tuple[int, int, bool] | None:
    """(cycles, HBM bytes, bound by its matmuls) of a Pallas kernel from its declared ``CostEstimate``; None for
    any other operation, a kernel without a declaration, or an unknown device kind.

    The rule: of the FLOPs a kernel declares, its matmuls' (``tpu.matmul`` in the Mosaic module its custom call
    carries, counted by :func:`nash_mhc.tpu_compile.mosaic.dot_flops`, at most the declared total) are MXU work, the
    rest vector work. Its time is the roofline of three units,
    ``max(MXU FLOPs / MXU FLOP/s, vector FLOPs / VECTOR_RATE, declared bytes / HBM bytes/s)``, with libtpu's MXU
    and HBM figures (:data:`ROOFLINE`, the conversion ``cost_analysis()["optimal_seconds"]`` makes of a
    declaration, which charges every FLOP at the MXU rate) and :data:`VECTOR_RATE`. A kernel whose module cannot
    be read is charged as libtpu does (all MXU). Its declared bytes count as its HBM bytes. Matrix work (counted in
    :attr:`StepCost.matmul_cycles`) when the MXU term is the largest (flash attention); the mHC stream kernels
    are bound by their bytes or by the vector unit."""
    match = _DECLARED.search(instruction.rest) if instruction.op == "custom-call" else None
    if match is None or device_kind not in CLOCK_HZ:
        return None
    flops, moved = int(match.group(1)), int(match.group(2))
    counted = dot_flops(instruction.rest)
    matmul = flops if counted is None else min(counted, flops)
    flops_per_second, bytes_per_second = ROOFLINE[device_kind]
    mxu, vector = matmul / flops_per_second, (flops - matmul) / VECTOR_RATE[device_kind]
    memory = moved / bytes_per_second
    return math.ceil(max(mxu, vector, memory) * CLOCK_HZ[device_kind]), moved, matmul > 0 and mxu >= max(vector,
                                                                                                         memory)


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

    seconds: float                      # estimated step time, kernels at their roofline (the band's low end)
    tokens_per_second_per_chip: float
    mfu: float | None                   # model FLOPs over the peak (None: the device kind has no peak)
    peak_flops: float | None
    clock_hz: float
    slow_seconds: float                 # kernels at KERNEL_SLOW of their roofline (the band's high end)


def step_estimate(cost: StepCost, *, device_kind: str, chips: int, tokens_per_step: int,
                  flops_per_token: float) -> StepEstimate | None:
    """Step time, tokens/s per chip and MFU (the project's convention: ``ModelConfig.flops_per_token`` over the
    bf16 peak table) from a :class:`StepCost`; None for a device kind without a clock in :data:`CLOCK_HZ`."""
    from nash_mhc.training.throughput import table_peak

    clock = CLOCK_HZ.get(device_kind)
    if clock is None or cost.cycles <= 0:
        return None
    seconds, slow = cost.band(clock)
    per_chip = tokens_per_step / seconds / chips
    peak = table_peak(device_kind)
    mfu = None if peak is None else per_chip * flops_per_token / peak
    return StepEstimate(seconds, per_chip, mfu, peak, clock, slow)


def band_line(figures: StepEstimate) -> str:
    """The one line that states a step's estimate with its error: the band from :meth:`StepCost.band`."""
    return (f"estimated step: {1e3 * figures.seconds:.3f}-{1e3 * figures.slow_seconds:.3f} ms (kernels at 100 %-"
            f"{100 * KERNEL_SLOW:.0f} % of their declared roofline, vector work at the VPU rate; the TPU compiler's "
            "cost model, not a measurement)")


def estimate_lines(report: Any) -> list[str]:
    """``--compile-only``'s lines for the estimate of a :class:`nash_mhc.tpu_compile.fit.FitReport` (none off TPU)."""
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
        band_line(figures),
        f"estimated step time (the TPU compiler's cost model, not a measurement) at the band's low end: "
        f"{1e3 * figures.seconds:.2f} ms, "
        f"{figures.tokens_per_second_per_chip:,.0f} tokens/s per chip{mfu}",
        f"estimate: {cost.cycles:.4g} cycles per step at {figures.clock_hz / 1e9:.2f} GHz ({len(cost.loops)} loops "
        f"counted by their trip counts; each body once: {cost.cycles_once:.4g}); per chip per step: HBM "
        f"{cost.hbm_bytes / 2**30:.2f} GiB, collectives {cost.collective_bytes / 2**30:.2f} GiB"
        + (f"; Pallas kernels, costed at their roofline: {100 * cost.kernel_cycles / cost.cycles:.1f} % "
           "of the cycles" if cost.kernel_cycles else ""),
        f"not in the estimate (operations per step): {skipped or 'none'}",
    ]


__all__ = ["CLOCK_HZ", "KERNEL_SLOW", "ROOFLINE", "VECTOR_RATE", "EstimateError", "Instruction", "StepCost",
           "StepEstimate", "array_bytes", "band_line", "compiled_step_cost", "estimate_lines", "kernel_roofline",
           "multiplicities", "parse_hlo", "step_cost", "step_estimate", "trip_count"]
