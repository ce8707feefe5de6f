"""Sharding rules: each parameter's PartitionSpec from its declared logical axes (:data:`LOGICAL_AXIS_RULES`), the
divisibility fallbacks, and the start-up summary (see :mod:`nash_mhc.sharding`)."""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree

from nash_mhc.params import dotted, map_declared
from nash_mhc.sharding.mesh import BATCH_AXES, FSDP, FSDP_TP, TP, describe_mesh

Axes = str | tuple[str, ...] | None

# Logical axis → mesh axes. Every logical name a parameter declares must be listed (a typo fails loudly).
LOGICAL_AXIS_RULES: dict[str, Axes] = {
    "vocab": TP,           # embedding rows / LM-head columns
    "embed": FSDP,         # d_model of every weight
    "heads": TP,           # attention heads
    "mlp": TP,             # FFN hidden
    "hc_rows": FSDP_TP,    # rows of the hyper-connection projection Φ (n·D for mhc, D for hc)
    "head_dim": None, "layers": None, "scales": None, "block": None, "norm": None, "streams": None,
    "hc_coeffs": None, "hc_alpha": None, "permutations": None,
    # activations, for per-shard kernels (:func:`per_shard`): "tokens" is batch x seq flattened, "features" the
    # model width of an activation (whole on every device)
    "batch": BATCH_AXES, "seq": None, "tokens": BATCH_AXES, "features": None,
}


def path_str(path: Sequence[Any]) -> str:
    """Dotted attribute path of a pytree leaf: ``blocks.attn.down[0]``, ``opt_state.inner_state[1][0].mu.head``."""
    return dotted(tuple(path))


def mesh_axes(logical: Sequence[str]) -> tuple[Axes, ...]:
    """The mesh axes of each logical axis name (:data:`LOGICAL_AXIS_RULES`); ValueError naming an unknown one."""
    unknown = [name for name in logical if name not in LOGICAL_AXIS_RULES]
    if unknown:
        raise ValueError(f"logical axis {unknown[0]!r} has no entry in nash_mhc.sharding.LOGICAL_AXIS_RULES")
    return tuple(LOGICAL_AXIS_RULES[name] for name in logical)


@dataclasses.dataclass(frozen=True)
class ShardingFallback:
    """A dimension replicated on (some of) its mesh axes because its size does not divide by them."""

    path: str
    dim: int
    size: int
    wanted: tuple[str, ...]
    kept: tuple[str, ...]
    mesh_size: int

    def __str__(self) -> str:
        kept = "x".join(self.kept) if self.kept else "replicated"
        return (f"{self.path} dim {self.dim} (size {self.size}) does not divide by {'x'.join(self.wanted)}="
                f"{self.mesh_size}; using {kept}")


def _as_tuple(axes: Axes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def logical_spec(logical: Sequence[str], shape: Sequence[int], mesh: Mesh | AbstractMesh, path: str = "",
                 without: tuple[str, ...] = ()) -> tuple[P, list[ShardingFallback]]:
    """PartitionSpec of a leaf whose dimensions have the logical names ``logical`` (and the divisibility
    fallbacks taken; ``path`` names the leaf in them). ``without``: mesh axes dropped from the spec after the
    fallbacks (:func:`gather_fsdp`'s gathered copy of a parameter)."""
    spec, fallbacks = [], []
    for dim, (size, axes) in enumerate(zip(shape, mesh_axes(logical), strict=True)):
        wanted = _as_tuple(axes)
        kept = wanted
        while kept and size % math.prod(mesh.shape[a] for a in kept):
            kept = kept[:-1]
        if kept != wanted:
            fallbacks.append(ShardingFallback(path, dim, int(size), wanted, kept,
                                              math.prod(mesh.shape[a] for a in wanted)))
        kept = tuple(a for a in kept if a not in without)
        spec.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    while spec and spec[-1] is None:
        spec.pop()
    return P(*spec), fallbacks


def _spec(path: str, leaf: Any, logical: tuple[str, ...] | None, mesh: Mesh, strict: bool
          ) -> tuple[str, P, list[ShardingFallback]]:
    """(path, PartitionSpec, fallbacks) of one array leaf; a leaf that is not a declared parameter is replicated
    (with a warning, or ValueError when ``strict``, unless it is a scalar or has one element)."""
    if logical is None:
        if len(leaf.shape) and math.prod(leaf.shape) > 1:
            message = f"{path!r} with shape {tuple(leaf.shape)} is not a declared parameter"
            if strict:
                raise ValueError(message + "; declare it with nash_mhc.params.param(role, *logical_axes)")
            warnings.warn(message + "; replicating it", stacklevel=5)
        return path, P(), []
    return (path, *logical_spec(logical, leaf.shape, mesh, path))


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _leaf_specs(tree: PyTree, mesh: Mesh, strict: bool) -> PyTree:
    """(path, PartitionSpec, fallbacks) for every array leaf of ``tree`` (None elsewhere)."""
    return map_declared(lambda path, leaf, decl, logical: _spec(path, leaf, logical, mesh, strict)
                        if _is_array(leaf) else None, tree)


def _is_entry(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 3 and isinstance(x[1], P)


def partition_specs(tree: PyTree, mesh: Mesh, *, strict: bool = False) -> PyTree:
    """A PartitionSpec for every array leaf of ``tree`` (model, gradients, optimizer state or a whole train
    state), from the parameters' declared logical axes. Non-array leaves map to None. Works on concrete arrays,
    tracers and ``jax.ShapeDtypeStruct``."""
    return jax.tree.map(lambda e: e[1], _leaf_specs(tree, mesh, strict), is_leaf=_is_entry)


def named_shardings(tree: PyTree, mesh: Mesh) -> PyTree:
    """``NamedSharding`` of every array leaf of ``tree`` by the rules (None for non-array leaves)."""
    return jax.tree.map(lambda e: NamedSharding(mesh, e[1]), _leaf_specs(tree, mesh, False), is_leaf=_is_entry)


def sharding_fallbacks(model: PyTree, mesh: Mesh) -> list[ShardingFallback]:
    """Every dimension of ``model`` that is replicated on its mesh axes because it does not divide."""
    entries = jax.tree.leaves(_leaf_specs(model, mesh, False), is_leaf=_is_entry)
    return [fallback for entry in entries for fallback in entry[2]]


def sharding_summary(model: PyTree, mesh: Mesh) -> list[str]:
    """Start-up summary lines: mesh, per-device parameter share, and every divisibility fallback."""
    lines = [describe_mesh(mesh)]
    total = per_device = 0
    entries = jax.tree.leaves(_leaf_specs(model, mesh, False), is_leaf=_is_entry)
    for (_, spec, _), leaf in zip(entries, [x for x in jax.tree.leaves(model) if _is_array(x)], strict=True):
        size = math.prod(leaf.shape)
        shards = math.prod(math.prod(mesh.shape[a] for a in _as_tuple(axes)) for axes in spec)
        total += size
        per_device += size // shards
    if total:
        lines.append(f"parameters: {total:,} total, {per_device:,} per device "
                     f"({per_device / total:.1%}; ideal {1 / mesh.size:.1%})")
    fallbacks = sharding_fallbacks(model, mesh)
    lines.extend(f"sharding fallback: {fb}" for fb in fallbacks)
    if not fallbacks:
        lines.append("sharding: every parameter dimension divides by its mesh axes")
    return lines
