"""The matrix-unit FLOPs of a Pallas kernel, read from the Mosaic module its ``tpu_custom_call`` carries.

A compiled TPU program keeps each kernel's Mosaic module, serialized (MLIR bytecode, base64), as the ``body`` of its
custom call's backend config. :func:`dot_flops` deserializes it and counts its ``tpu.matmul`` operations, each
``2 x (result elements) x (contracted length)``, times the kernel's grid (``iteration_bounds``) and the trip counts
of the constant-bound ``scf.for`` loops around it. A matmul inside a loop without constant bounds counts once, so the
count is a lower bound there. :mod:`nash_mhc.tpu_compile.estimate` charges these FLOPs to the MXU and the rest of the
kernel's declared FLOPs to the vector unit.
"""

from __future__ import annotations

import base64
import functools
import math
import re

_BODY = re.compile(r'"body":"([A-Za-z0-9+/=]*)"')
_CONTRACTING = re.compile(r"dot_dimension_numbers<\[([\d, ]*)\]")


@functools.cache
def _context():
    from jax._src.interpreters import mlir
    from jax._src.lib import tpu

    context = mlir.make_ir_context()
    tpu.register_dialect(context)
    context.allow_unregistered_dialects = True
    return context


def _shape(value) -> list[int]:
    return list(value.type.shape)


def _constant(value) -> int | None:
    """The integer ``value`` holds if it is a constant, or a sum, difference or product of constants (a
    ``fori_loop``'s bound is ``lower + trips``); else None."""
    owner = value.owner
    name = getattr(owner, "name", None)
    if name == "arith.constant":
        match = re.match(r"(-?\d+)", str(owner.attributes["value"]))
        return int(match.group(1)) if match else None
    folds = {"arith.addi": int.__add__, "arith.subi": int.__sub__, "arith.muli": int.__mul__}
    if name not in folds:
        return None
    left, right = (_constant(v) for v in owner.operands)
    return None if left is None or right is None else folds[name](left, right)


def _matmul_flops(operation) -> int:
    lhs, result = _shape(operation.operands[0]), _shape(operation.results[0])
    numbers = _CONTRACTING.search(str(operation.attributes["dimension_numbers"])) \
        if "dimension_numbers" in operation.attributes else None
    dims = [int(d) for d in numbers.group(1).split(",") if d.strip()] if numbers else [len(lhs) - 1]
    return 2 * math.prod(result) * math.prod(lhs[d] for d in dims)


def _walk(operation, times: int) -> int:
    """Matmul FLOPs of ``operation`` and everything nested in it, run ``times`` times."""
    name = operation.name
    if name == "tpu.matmul":
        return times * _matmul_flops(operation)
    if name == "scf.for":
        bounds = [_constant(v) for v in list(operation.operands)[:3]]
        if None not in bounds and bounds[2] > 0:
            times *= max(0, -(-(bounds[1] - bounds[0]) // bounds[2]))
    return sum(_walk(inner, times) for region in operation.regions for block in region for inner in block)


def module_dot_flops(module_bytes: bytes) -> int | None:
    """Matmul FLOPs of one whole run (every grid step) of a serialized Mosaic module; None if it cannot be read."""
    from jaxlib.mlir import ir
    from jaxlib.mlir.passmanager import PassManager

    try:
        with _context(), ir.Location.unknown():
            module = ir.Module.parse(module_bytes)
            PassManager.parse("builtin.module(mosaic-serde{serialize=false})").run(module.operation)
            total = 0
            for function in module.body.operations:
                if "iteration_bounds" not in function.attributes:
                    continue  # the index maps of the kernel's blocks
                grid = math.prod(int(b) for b in re.findall(r"-?\d+", str(function.attributes["iteration_bounds"])
                                                            .split(":", 1)[-1]))
                total += _walk(function, max(grid, 1))
            return total
    except Exception:  # noqa: BLE001 - a module this jaxlib cannot read: the caller falls back to its declaration
        return None


@functools.lru_cache(maxsize=256)
def dot_flops(backend_config: str) -> int | None:
    """Matmul FLOPs of the kernel whose custom-call text (its backend config) is ``backend_config``; None when the
    text carries no Mosaic body or the body cannot be read."""
    match = _BODY.search(backend_config)
    return None if match is None else module_dot_flops(base64.b64decode(match.group(1)))


__all__ = ["dot_flops", "module_dot_flops"]
