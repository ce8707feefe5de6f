"""One recorded choice run standalone: its TPU form (the Pallas kernels) and its XLA form on the same random
operands, forward and VJP, compared and timed."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from nash_mhc.ops import dispatch

# Largest error allowed, relative to the largest magnitude of the XLA form's result, by the operands' lowest
# floating precision.
TOLERANCE = {"float64": 1e-6, "float32": 2e-3, "bfloat16": 5e-2, "float16": 2e-2}


def _floating(leaf: Any) -> bool:
    return hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating)


def vjp_function(form: Callable[..., Any], args: tuple[Any, ...]) -> Callable[..., Any]:
    """``run(*args, cotangent) = (form(*args), the VJP of the cotangent in args' floating leaves)`` (the
    cotangent has form's output structure; its non-floating leaves are ignored)."""
    leaves, tree = jax.tree.flatten(args)
    wrt = [k for k, leaf in enumerate(leaves) if _floating(leaf)]

    def run(*operands: Any) -> tuple[Any, list[jax.Array]]:
        *given, cotangent = operands
        flat = jax.tree.leaves(tuple(given))

        def of(floats: list[jax.Array]) -> Any:
            values = list(flat)
            for k, value in zip(wrt, floats, strict=True):
                values[k] = value
            return form(*jax.tree.unflatten(tree, values))

        out, pull = jax.vjp(of, [flat[k] for k in wrt])
        cotangent = jax.tree.map(
            lambda o, c: c.astype(o.dtype) if _floating(o) else np.zeros(o.shape, jax.dtypes.float0), out, cotangent)
        return out, pull(cotangent)[0]
    return run


def runner(form: Callable[..., Any], args: tuple[Any, ...], vjp: bool) -> Callable[..., Any]:
    """``run(*args, cotangent)``: :func:`vjp_function`'s (form's output, VJP), or with ``vjp`` False the output
    alone (the cotangent unused)."""
    return vjp_function(form, args) if vjp else lambda *operands: form(*operands[:-1])


def has_vjp(choice: dispatch.Choice) -> bool:
    """Whether ``choice``'s TPU form is differentiable (traced under the settings and mesh in force): some are
    differentiated by their callers' own rules (the stream copies and sums)."""
    out = jax.eval_shape(choice.tpu, *choice.args)
    try:
        jax.eval_shape(vjp_function(choice.tpu, choice.args), *choice.args, out)
    except (ValueError, TypeError, NotImplementedError):
        return False
    return True


def random_like(spec: Any, key: jax.Array) -> Any:
    """A random array of ``spec``'s shape and dtype: floating N(0, 1), booleans True with probability 3/4,
    integers in [0, 4); non-array leaves as they are."""
    if not hasattr(spec, "shape"):
        return spec
    if jnp.issubdtype(spec.dtype, jnp.floating):
        return jax.random.normal(key, spec.shape, jnp.float32).astype(spec.dtype)
    if spec.dtype == jnp.bool_:
        return jax.random.bernoulli(key, 0.75, spec.shape)
    return jax.random.randint(key, spec.shape, 0, 4).astype(spec.dtype)


def random_tree(tree: Any, key: jax.Array) -> Any:
    leaves, structure = jax.tree.flatten(tree)
    keys = jax.random.split(key, max(len(leaves), 1))
    return jax.tree.unflatten(structure, [random_like(leaf, k) for leaf, k in zip(leaves, keys, strict=False)])


def error(got: Any, want: Any) -> tuple[float, float]:
    """(max abs error, that error over the largest |want|) over the floating leaves; NaN where only one has one
    counts as infinite."""
    worst, scale = 0.0, 0.0
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        if not _floating(w):
            continue
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        diff = np.where(np.isnan(g) & np.isnan(w), 0.0, np.abs(g - w))
        worst = max(worst, float(np.nan_to_num(diff, nan=np.inf).max(initial=0.0)))
        scale = max(scale, float(np.nanmax(np.abs(w), initial=0.0)))
    return worst, worst / scale if scale else worst


@dataclasses.dataclass(frozen=True)
class Result:
    """One choice checked: errors of the kernel form against the XLA form (VJP None where the TPU form has none)."""

    name: str
    kernels: tuple[str, ...]
    shapes: str
    forward: tuple[float, float]
    vjp: tuple[float, float] | None
    tolerance: float
    kernel_ms: float
    xla_ms: float

    @property
    def ok(self) -> bool:
        return all(e[1] <= self.tolerance for e in (self.forward, self.vjp) if e is not None)


def _timed(function: Callable[..., Any], operands: tuple[Any, ...], repeats: int) -> tuple[Any, float]:
    out = jax.block_until_ready(function(*operands))  # compiles
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(function(*operands))
        best = min(best, time.perf_counter() - start)
    return out, best * 1e3


def shapes_text(args: Any) -> str:
    return " ".join(f"{jnp.dtype(leaf.dtype).name}{list(leaf.shape)}" for leaf in jax.tree.leaves(args)
                    if hasattr(leaf, "shape"))


def check_choice(choice: dispatch.Choice, kernels: tuple[str, ...], mesh: Mesh, key: jax.Array, repeats: int = 3
                 ) -> Result:
    """Run ``choice``'s TPU form (under ``pallas``: interpreted off TPU) and XLA form (under ``xla``) on the same
    random operands under ``mesh``; compare outputs and VJPs."""
    operands = random_tree(choice.args, key)
    out = jax.eval_shape(choice.tpu, *choice.args)
    cotangent = random_tree(out, jax.random.fold_in(key, 1))
    floats = [leaf for leaf in jax.tree.leaves(choice.args) if _floating(leaf)]
    lowest = max((jnp.finfo(leaf.dtype).eps for leaf in floats), default=jnp.finfo(jnp.float32).eps)
    dtype = min(TOLERANCE, key=lambda name: abs(float(jnp.finfo(name).eps) - float(lowest)))
    results = {}
    with jax.set_mesh(mesh):
        with dispatch.use_kernels("pallas"):
            vjp = has_vjp(choice)
        for setting, form in (("pallas", choice.tpu), ("xla", choice.default)):
            with dispatch.use_kernels(setting):
                results[setting] = _timed(jax.jit(runner(form, choice.args, vjp)), (*operands, cotangent), repeats)
    (got, kernel_ms), (want, xla_ms) = results["pallas"], results["xla"]
    if vjp:
        forward, vjp_error = error(got[0], want[0]), error(got[1], want[1])
    else:
        forward, vjp_error = error(got, want), None
    return Result(choice.name, kernels, shapes_text(choice.args), forward, vjp_error, TOLERANCE[dtype], kernel_ms,
                  xla_ms)


__all__ = ["TOLERANCE", "Result", "check_choice", "error", "has_vjp", "random_like", "random_tree", "runner",
           "shapes_text", "vjp_function"]
