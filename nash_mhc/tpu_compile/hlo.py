"""The optimised HLO text of a compiled program, read for :mod:`nash_mhc.tpu_compile.estimate`: its computations and
instructions, the bytes of an array type, each ``while`` loop's trip count, and how many times each computation
runs per step."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import re

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
_HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) \(.*\) -> .* \{$")
_INSTRUCTION = re.compile(r"^\s+(ROOT )?%([\w.\-]+) = (.*?) ([a-z][a-z0-9\-]*)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([\d,]*)\](\{[^}]*\})?")
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')

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
