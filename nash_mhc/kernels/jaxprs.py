"""The Pallas kernels a traced program holds, read from its jaxpr (after JAX dropped what the program does not use,
such as the primal trace of a ``custom_vjp`` that is differentiated by its own rule)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jax.extend.core import ClosedJaxpr, Jaxpr


def _jaxprs(value: Any) -> Iterator[Jaxpr]:
    for item in value if isinstance(value, tuple | list) else (value,):
        if isinstance(item, ClosedJaxpr):
            yield item.jaxpr
        elif isinstance(item, Jaxpr):
            yield item


def kernel_id(params: dict[str, Any]) -> str:
    """``module.function`` of a ``pallas_call`` equation's kernel (``sinkhorn_kernel._forward_kernel``): the
    function's name is the ``kernel_name`` of its custom call in a TPU module, the module tells apart kernels that
    share it."""
    source = params["jaxpr"].debug_info.func_src_info or ""
    function, _, where = source.partition(" at ")
    name = params.get("name") or function or "kernel"
    module = Path(where.rsplit(":", 1)[0]).stem if where else ""
    return f"{module}.{name}" if module else name


def short_name(kernel: str) -> str:
    """The kernel's function name: what a TPU module's custom call names it by."""
    return kernel.rsplit(".", 1)[-1]


def pallas_kernels(jaxpr: Jaxpr | ClosedJaxpr) -> list[str]:
    """:func:`kernel_id` of every ``pallas_call`` in ``jaxpr`` and its sub-jaxprs, in order, with repeats."""
    jaxpr = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    found = []
    for equation in jaxpr.eqns:
        if equation.primitive.name == "pallas_call":
            found.append(kernel_id(equation.params))
        for value in equation.params.values():
            for sub in _jaxprs(value):
                found.extend(pallas_kernels(sub))
    return found


__all__ = ["kernel_id", "pallas_kernels", "short_name"]
