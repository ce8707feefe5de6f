"""Placement: the device mesh, every parameter's PartitionSpec, and batch sharding.

Mesh axes (always all three, size-1 axes kept, in this order):

  data   pure data parallelism: the batch is split, parameters are replicated
  fsdp   fully-sharded data parallelism: the batch is split *and* parameters/optimizer state are split on
         their d_model dimension (gathered by GSPMD where a matmul needs them)
  tp     tensor parallelism: attention heads, the FFN hidden dimension and the vocabulary are split

The batch is split over ``("data", "fsdp")`` (:data:`BATCH_AXES`); sequence positions are never split.

Axis types: every axis is ``AxisType.Auto``. The model code is written mesh-agnostic (plain einsums over a
leading batch axis) and GSPMD propagates the shardings we pin on parameters, batch and logits; the places where
communication matters for correctness or memory (vocab-parallel cross-entropy, the global token count) are
written by hand in ``jax.shard_map`` (see :mod:`nash_mhc.training.step`). This is MaxText's arrangement.
``Explicit`` axes would make every op whose output sharding is ambiguous (e.g. a contraction over an
fsdp-sharded d_model) a trace-time error, i.e. force sharding annotations into every layer. Note that
``jax.make_mesh`` defaults to Explicit in JAX 0.10, so the axis types are passed explicitly here.

Sharding rules: every parameter declares the logical name of each of its dimensions where it is created
(:func:`nash_mhc.params.param`); :data:`LOGICAL_AXIS_RULES` maps each logical name to mesh axes (None: unsplit).
The same declarations serve the optimizer state, whose moment trees repeat the model's classes, and the whole
train state. A dimension that does not divide by its mesh axes is replicated on them (the last axis is dropped
first) and reported by :func:`sharding_fallbacks` / :func:`sharding_summary`. A non-scalar leaf that is not a
declared parameter is replicated with a warning (``strict=True`` raises instead); a parameter-declaring module
with an undeclared array field always raises (:class:`nash_mhc.params.UndeclaredParameter`).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree

from nash_mhc.params import dotted, map_declared
from nash_mhc.settings import setting

AXES = ("data", "fsdp", "tp")
BATCH_AXES = ("data", "fsdp")
AXIS_TYPE = AxisType.Auto

FSDP = "fsdp"
TP = "tp"
FSDP_TP = ("fsdp", "tp")

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


class MeshError(ValueError):
    """A mesh shape that does not fit the available devices."""


# ------------------------------------------------------------------------------------------------ mesh
def valid_mesh_shapes(num_devices: int, local_device_count: int | None = None) -> list[tuple[int, int, int]]:
    """Every (data, fsdp, tp) whose product is ``num_devices`` (tp dividing the per-host device count)."""
    shapes = []
    for data in range(num_devices, 0, -1):
        if num_devices % data:
            continue
        rest = num_devices // data
        for fsdp in range(rest, 0, -1):
            if rest % fsdp:
                continue
            tp = rest // fsdp
            if local_device_count is None or local_device_count % tp == 0:
                shapes.append((data, fsdp, tp))
    return shapes


def _format_shapes(shapes: Sequence[tuple[int, int, int]], limit: int = 12) -> str:
    text = ", ".join(f"({d},{f},{t})" for d, f, t in shapes[:limit])
    return text + (f", ... ({len(shapes) - limit} more)" if len(shapes) > limit else "")


def resolve_mesh_shape(data: int, fsdp: int, tp: int, num_devices: int,
                       local_device_count: int | None = None) -> tuple[int, int, int]:
    """Validate a requested (data, fsdp, tp) against ``num_devices`` and fill one ``-1`` axis.

    ``local_device_count`` (devices per host, multi-host only) must be divisible by ``tp`` so that
    tensor-parallel groups never span hosts. Raises :class:`MeshError` naming the device count and listing
    the valid shapes.
    """
    requested = {"data": data, "fsdp": fsdp, "tp": tp}
    valid = valid_mesh_shapes(num_devices, local_device_count)
    hint = (f"valid (data, fsdp, tp) shapes for {num_devices} devices: {_format_shapes(valid)}; "
            f"one axis may be -1 to use the remaining devices")

    def fail(problem: str) -> MeshError:
        return MeshError(f"mesh {problem}; {hint}")

    for name, size in requested.items():
        if not isinstance(size, int | np.integer) or isinstance(size, bool) or (size < 1 and size != -1):
            raise fail(f"axis {name}={size!r} must be a positive integer or -1")
    fill = [name for name, size in requested.items() if size == -1]
    if len(fill) > 1:
        raise fail(f"axes {' and '.join(fill)} are both -1; at most one axis can fill the rest")
    known = math.prod(size for size in requested.values() if size != -1)
    shape_text = " x ".join(f"{name}={size}" for name, size in requested.items())
    if fill:
        if num_devices % known:
            raise fail(f"{shape_text}: {num_devices} devices do not divide by {known}")
        requested[fill[0]] = num_devices // known
    elif known != num_devices:
        raise fail(f"{shape_text} = {known} devices, but {num_devices} devices are available")
    shape = (int(requested["data"]), int(requested["fsdp"]), int(requested["tp"]))
    if local_device_count is not None and local_device_count % shape[2]:
        raise fail(f"tp={shape[2]} does not divide the {local_device_count} devices of one host "
                   f"(tensor-parallel groups must stay within a host)")
    return shape


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The ``(data, fsdp, tp)`` mesh a program runs on (``--mesh-data --mesh-fsdp --mesh-tp``)."""

    data: int = setting(-1, "data-parallel axis size (-1: the devices the other axes leave)")
    fsdp: int = setting(1, "FSDP axis size (parameters and optimizer state split; -1: the rest)")
    tp: int = setting(1, "tensor-parallel axis size (heads, FFN hidden and vocabulary split; -1: the rest)")

    def make(self, *, devices: Sequence[Any] | None = None) -> Mesh:
        """:func:`make_mesh` of these sizes (validated there)."""
        return make_mesh(self.data, self.fsdp, self.tp, devices=devices)


def make_mesh(data: int = MeshConfig.data, fsdp: int = MeshConfig.fsdp, tp: int = MeshConfig.tp, *,
              devices: Sequence[Any] | None = None) -> Mesh:
    """A ``(data, fsdp, tp)`` mesh with ``AxisType.Auto`` axes over ``devices`` (default: all devices).

    The product of the axes must equal the number of devices (``jax.make_mesh`` would silently use a
    prefix); one axis may be ``-1`` to take the remaining devices. Size-1 axes are kept, so specs naming
    any axis are valid on every mesh.
    """
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise MeshError("mesh: no devices given")
    multi_host = jax.process_count() > 1
    local = jax.local_device_count() if multi_host else None
    shape = resolve_mesh_shape(data, fsdp, tp, len(devices), local)
    return jax.make_mesh(shape, AXES, axis_types=(AXIS_TYPE,) * len(AXES), devices=devices)


def describe_mesh(mesh: Mesh) -> str:
    sizes = " ".join(f"{name}={size}" for name, size in mesh.shape.items())
    return f"mesh {sizes} ({mesh.size} devices, {AXIS_TYPE.name} axes, batch over {'+'.join(BATCH_AXES)})"


# ---------------------------------------------------------------------------------------- param specs
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


def constrain(tree: PyTree, mesh: Mesh) -> PyTree:
    """``with_sharding_constraint`` on every array leaf of ``tree`` by the rules (inside jit)."""
    def apply(path: str, leaf: Any, decl: Any, logical: tuple[str, ...] | None) -> Any:
        if not _is_array(leaf):
            return leaf
        return jax.lax.with_sharding_constraint(leaf, NamedSharding(mesh, _spec(path, leaf, logical, mesh, False)[1]))

    return map_declared(apply, tree)


def gather_fsdp(params: PyTree) -> PyTree:
    """One layer's parameters constrained to their specs without the fsdp axis (inside jit, under the ambient
    mesh): FSDP's just-in-time all-gather, written down instead of left to the compiler.

    Without it the TPU compiler contracts ``x [tokens, d_model] @ w [d_model/fsdp, F]`` as a windowed
    ("collective") matmul: it passes the weight's shards around the ring and adds each shard's partial product
    into the full ``[tokens, F]`` output, reading and writing that activation-sized buffer once per step of the
    ring. Gathering the weight (a few MB per layer) and running one local matmul moves a fraction of those bytes;
    in the backward pass the gather's transpose is the reduce-scatter of the weight gradient. ``params`` holds
    unstacked leaves (one layer, inside the layer scan).

    Only the matmul weights (role ``cast_once``) split over fsdp are constrained. The small coefficient and
    kernel leaves are left to the compiler: constraining the multiscale downsampling kernels ``attn.down`` the
    same way changed the loss on the CPU backend's (data 2, fsdp 2, tp 2) mesh (5.5667 → 5.5612 nats in
    tests/test_step.py's first step), which a sharding constraint must never do. Values never change; the
    identity without an ambient mesh or with fsdp = 1.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or FSDP not in mesh.axis_names or mesh.shape[FSDP] == 1:
        return params

    def apply(path: str, leaf: Any, decl: Any, logical: tuple[str, ...] | None) -> Any:
        if decl is None or not decl.role.cast_once or not _is_array(leaf):
            return leaf
        gathered, _ = logical_spec(logical, leaf.shape, mesh, path, without=(FSDP,))
        if gathered == logical_spec(logical, leaf.shape, mesh, path)[0]:  # not split over fsdp
            return leaf
        return jax.lax.with_sharding_constraint(leaf, gathered)
    return map_declared(apply, params)


def rows_to_batch(rows: jax.Array) -> jax.Array:
    """Embedding rows [B, T, D] looked up from a table split (vocab over tp, d_model over fsdp), moved to the
    batch split over data x fsdp under the ambient mesh in two steps: batch over data with d_model still over fsdp
    (the lookup's own split), then fsdp moved from d_model to the batch (an all-to-all over fsdp)."""
    mesh = _batch_pin_mesh(rows, 0)
    if mesh is None:
        return rows
    if mesh.shape[FSDP] > 1 and rows.shape[-1] % mesh.shape[FSDP] == 0:
        data = BATCH_AXES[0]
        rows = jax.lax.with_sharding_constraint(rows, P(data, *[P.UNCONSTRAINED] * (rows.ndim - 2), FSDP))
    return constrain_batch(rows)


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


# ---------------------------------------------------------------------------------------------- batch
def batch_spec(ndim: int) -> P:
    """Leading (batch) dimension over ``("data", "fsdp")``, the rest unsplit."""
    return P(BATCH_AXES, *([None] * (ndim - 1)))


def constrain_batch(x: jax.Array, dim: int = 0) -> jax.Array:
    """Pin an activation's batch (or token) dimension ``dim`` (the leading one by default; 1 for the model's
    streams-major state [n, B, T, D]) to ``("data", "fsdp")`` under the ambient mesh.

    The model code calls this on the outputs of its large matmuls; the training step traces the model under
    its mesh (``jax.sharding.use_abstract_mesh``). Without the pin, the compiler may contract a matmul whose
    weight is split over fsdp on its contracted d_model by resharding the *activation* instead (every device
    then holds partial sums over the global batch's tokens, e.g. an FFN hidden state [B·T, F] eight times
    one chip's share) rather than gathering the weight. The other dimensions are left to the compiler
    (``UNCONSTRAINED``), so tensor-parallel splits still propagate. The identity without an ambient mesh (or
    one lacking the batch axes) and for a dimension ``dim`` that does not divide by data x fsdp; a constraint
    never changes values.
    """
    if _batch_pin_mesh(x, dim) is None:
        return x
    spec = [P.UNCONSTRAINED] * x.ndim
    spec[dim] = BATCH_AXES
    return jax.lax.with_sharding_constraint(x, P(*spec))


def _batch_pin_mesh(x: jax.Array, dim: int) -> AbstractMesh | None:
    """The ambient mesh where :func:`constrain_batch` pins ``x``'s dimension ``dim`` (the mesh has the batch axes
    and data x fsdp divides that dimension), else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not all(axis in mesh.axis_names for axis in BATCH_AXES):
        return None
    if x.ndim <= dim or x.shape[dim] % math.prod(mesh.shape[axis] for axis in BATCH_AXES):
        return None
    return mesh


def per_shard(function: Any, in_axes: Sequence[tuple[str, ...]], out_axes: Any,
              sums: Sequence[str | None] = ()) -> Any:
    """``function`` (of arrays whose dimensions have the logical names ``in_axes``, returning one array named
    ``out_axes``, or a tuple of arrays named by the tuple ``out_axes``) run on each device's shard under the
    ambient mesh, in ``jax.shard_map``: each dimension split as :func:`logical_spec` splits it (as far as it
    divides). For an operation the partitioner cannot split itself (a Pallas kernel is one opaque custom call)
    that needs no communication under this split, except that output k of a tuple whose ``sums[k]`` is a
    logical name is a partial sum over that dimension of the operands (a weight gradient summed over a shard's
    tokens): it is summed over the mesh axes that split the operands' dimensions of that name (``psum``, so the
    sum is replicated; for a gradient of a few MB per call, where a partitioned output summed by XLA would let it
    reduce-scatter instead). Without an ambient mesh, ``function`` itself."""
    def run(*operands: jax.Array) -> Any:
        mesh = jax.sharding.get_abstract_mesh()
        sharded = not mesh.empty and all(axis in mesh.axis_names for axis in AXES)
        out = jax.eval_shape(function, *operands) if sharded or sums else None
        if sums and (not isinstance(out, tuple) or len(sums) != len(out)):
            raise ValueError(f"per_shard: sums= names {len(sums)} outputs; the function returns "
                             f"{len(out) if isinstance(out, tuple) else 'one array, not a tuple'}")
        if not sharded:
            return function(*operands)
        specs = tuple(logical_spec(names, a.shape, mesh)[0] for names, a in zip(in_axes, operands, strict=True))
        if isinstance(out, tuple):
            out_specs = tuple(logical_spec(names, o.shape, mesh)[0] for names, o in zip(out_axes, out, strict=True))
        else:
            out_specs = logical_spec(out_axes, out.shape, mesh)[0]
        summed = {k: _split_axes(name, in_axes, specs) for k, name in enumerate(sums) if name is not None}

        def summing(*shards: jax.Array) -> tuple[jax.Array, ...]:
            return tuple(jax.lax.psum(o, summed[k]) if summed.get(k) else o for k, o in enumerate(function(*shards)))
        return jax.shard_map(summing if summed else function, mesh=mesh, in_specs=specs, out_specs=out_specs,
                             check_vma=False)(*operands)
    return run


def _split_axes(name: str, in_axes: Sequence[tuple[str, ...]], specs: Sequence[P]) -> tuple[str, ...]:
    """The mesh axes that split the operands' dimensions named ``name`` (ValueError when they disagree or none has
    the name): what :func:`per_shard` sums a partial-sum output over."""
    found = {_as_tuple(spec[dim] if dim < len(spec) else None)
             for names, spec in zip(in_axes, specs, strict=True) for dim, n in enumerate(names) if n == name}
    if len(found) != 1:
        raise ValueError(f"per_shard: the operands' {name!r} dimensions split over {sorted(found)}, not one way")
    return found.pop()


def per_shard_attention(attention: Any) -> Any:
    """``attention(q, k, v)`` on arrays [B, T, H, K] run on each device's shard (:func:`per_shard`): batch over
    ``("data", "fsdp")`` and heads over tp, sequence and head dim whole; causal attention needs no communication
    under this split."""
    names = ("batch", "seq", "heads", "head_dim")
    return per_shard(attention, (names, names, names), names)


def batch_shards(mesh: Mesh) -> int:
    """How many ways the batch dimension is split."""
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def shard_batch(batch: PyTree, mesh: Mesh) -> PyTree:
    """Place host arrays as global arrays split over the batch axes.

    Single process: ``batch`` holds the global batch. Multi-host: every process passes its own rows
    (``jax.make_array_from_process_local_data``). Leaves that already are ``jax.Array`` on this mesh's
    batch sharding are returned as they are.
    """
    def place(leaf: Any) -> Any:
        if leaf is None:
            return None
        sharding = NamedSharding(mesh, batch_spec(np.ndim(leaf)))
        if isinstance(leaf, jax.Array) and leaf.sharding.is_equivalent_to(sharding, leaf.ndim):
            return leaf
        if jax.process_count() > 1:
            return jax.make_array_from_process_local_data(sharding, np.asarray(leaf))
        return jax.device_put(leaf, sharding)

    return jax.tree.map(place, batch)


__all__ = [
    "AXES", "AXIS_TYPE", "BATCH_AXES", "LOGICAL_AXIS_RULES", "MeshConfig", "MeshError", "ShardingFallback",
    "batch_shards", "batch_spec", "constrain", "constrain_batch", "describe_mesh", "gather_fsdp", "logical_spec",
    "make_mesh", "mesh_axes", "named_shardings", "per_shard", "per_shard_attention",
    "partition_specs", "path_str", "resolve_mesh_shape", "shard_batch", "sharding_fallbacks",
    "rows_to_batch", "sharding_summary", "valid_mesh_shapes",
]

