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

Sharding rules (:data:`PARAM_RULES`) are keyed on a leaf's attribute path and give the mesh axes of the
leaf's *trailing* dimensions; leading dimensions not covered (the stacked layer axis of ``blocks``, the scale
axis of ``wq``/``wk``) are unsplit. The same rules serve the optimizer state, whose moment trees repeat the
parameter paths as suffixes (``opt_state...mu.blocks.attn.wq``). A dimension that does not divide by its
mesh axes is replicated on them (the last axis is dropped first) and reported by
:func:`sharding_fallbacks` / :func:`sharding_summary`. A non-scalar leaf that matches no rule is replicated
with a warning (``strict=True`` raises instead; the test-suite runs strict over every model variant, so a
new parameter without a rule fails CI rather than somebody's training run).
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree

from nash_mhc.settings import setting

AXES = ("data", "fsdp", "tp")
BATCH_AXES = ("data", "fsdp")
AXIS_TYPE = AxisType.Auto

FSDP = "fsdp"
TP = "tp"
FSDP_TP = ("fsdp", "tp")

Axes = str | tuple[str, ...] | None

# (path regex matched at the end of the leaf path on a component boundary, mesh axes of trailing dims).
# Shapes are the per-layer shapes; ``blocks`` leaves carry a leading layer axis that stays unsplit.
PARAM_RULES: tuple[tuple[str, tuple[Axes, ...]], ...] = (
    (r"embedding", (TP, FSDP)),                    # [V, D]          vocab over tp, d_model over fsdp
    (r"head", (FSDP, TP)),                         # [D, V]          untied LM head
    (r"attn\.w[qk]", (FSDP, TP, None)),            # [S, D, H, K]    per-scale Q/K: heads over tp
    (r"attn\.wv", (FSDP, TP, None)),               # [D, H, K]
    (r"attn\.wo", (TP, None, FSDP)),               # [H, K, D]
    (r"attn\.down\[\d+\]", (None, FSDP)),          # [s, D]          depthwise downsampling kernels
    (r"attn\.aggregation\.(?:prior|log_temperature)", ()),  # [S], []  tiny: replicated
    (r"ffn\.w_(?:gate|up)", (FSDP, TP)),           # [D, F]          FFN hidden over tp
    (r"ffn\.w_down", (TP, FSDP)),                  # [F, D]
    (r"\w*hc\.phi", (FSDP_TP, None)),              # mhc [nD, 2n+n²], hc [D, 2+n]: rows over fsdp x tp
    (r"\w*hc\.(?:alpha|b_pre|b_post|b_res)", ()),  # mHC scalars and biases: replicated
    (r"\w*norm\.weight", ()),                      # RMSNorm gains (incl. the mHC one): replicated
)
_COMPILED_RULES = tuple((re.compile(r"(?:^|\.)" + pattern + r"$"), axes) for pattern, axes in PARAM_RULES)


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
    out = ""
    for entry in path:
        if isinstance(entry, jax.tree_util.GetAttrKey):
            out += f".{entry.name}"
        elif isinstance(entry, jax.tree_util.DictKey):
            out += f".{entry.key}"
        elif isinstance(entry, jax.tree_util.SequenceKey):
            out += f"[{entry.idx}]"
        elif isinstance(entry, jax.tree_util.FlattenedIndexKey):
            out += f"[{entry.key}]"
        else:
            out += f".{entry}"
    return out.lstrip(".")


def match_rule(path: str) -> tuple[Axes, ...] | None:
    """The trailing-dimension mesh axes of the first rule matching ``path``, or None."""
    for pattern, axes in _COMPILED_RULES:
        if pattern.search(path):
            return axes
    return None


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


def leaf_spec(path: str, shape: Sequence[int], mesh: Mesh, *, strict: bool = False
              ) -> tuple[P, list[ShardingFallback]]:
    """PartitionSpec of one leaf (and the divisibility fallbacks taken). Scalars are replicated."""
    if len(shape) == 0:
        return P(), []
    rule = match_rule(path)
    if rule is None:
        message = f"no sharding rule for parameter {path!r} with shape {tuple(shape)}"
        if strict:
            raise ValueError(message + "; add one to nash_mhc.sharding.PARAM_RULES")
        warnings.warn(message + "; replicating it", stacklevel=3)
        return P(), []
    if len(rule) > len(shape):
        raise ValueError(f"sharding rule for {path!r} names {len(rule)} dims, leaf has shape {tuple(shape)}")
    full = (None,) * (len(shape) - len(rule)) + tuple(rule)
    spec, fallbacks = [], []
    for dim, (size, axes) in enumerate(zip(shape, full, strict=True)):
        wanted = _as_tuple(axes)
        kept = wanted
        while kept and size % math.prod(mesh.shape[a] for a in kept):
            kept = kept[:-1]
        if kept != wanted:
            fallbacks.append(ShardingFallback(path, dim, int(size), wanted, kept,
                                              math.prod(mesh.shape[a] for a in wanted)))
        spec.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    while spec and spec[-1] is None:
        spec.pop()
    return P(*spec), fallbacks


def _array_leaves_with_path(tree: PyTree) -> list[tuple[str, Any]]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [(path_str(p), leaf) for p, leaf in leaves if hasattr(leaf, "shape") and hasattr(leaf, "dtype")]


def _map_array_leaves(fn: Any, tree: PyTree) -> PyTree:
    def visit(path: Any, leaf: Any) -> Any:
        return fn(path_str(path), leaf) if hasattr(leaf, "shape") and hasattr(leaf, "dtype") else None

    return jax.tree_util.tree_map_with_path(visit, tree)


def partition_specs(tree: PyTree, mesh: Mesh, *, strict: bool = False) -> PyTree:
    """A PartitionSpec for every array leaf of ``tree`` (model, optimizer state or whole train state).

    Non-array leaves map to None. Works on concrete arrays, tracers and ``jax.ShapeDtypeStruct``.
    """
    return _map_array_leaves(lambda path, leaf: leaf_spec(path, leaf.shape, mesh, strict=strict)[0], tree)


def constrain(tree: PyTree, mesh: Mesh) -> PyTree:
    """``with_sharding_constraint`` on every array leaf of ``tree`` by the rules (inside jit)."""
    def apply(path: Any, leaf: Any) -> Any:
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            return leaf
        sharding = NamedSharding(mesh, leaf_spec(path_str(path), leaf.shape, mesh)[0])
        return jax.lax.with_sharding_constraint(leaf, sharding)

    return jax.tree_util.tree_map_with_path(apply, tree)


def sharding_fallbacks(model: PyTree, mesh: Mesh) -> list[ShardingFallback]:
    """Every dimension of ``model`` that is replicated on its mesh axes because it does not divide."""
    out = []
    for path, leaf in _array_leaves_with_path(model):
        out.extend(leaf_spec(path, leaf.shape, mesh)[1])
    return out


def sharding_summary(model: PyTree, mesh: Mesh) -> list[str]:
    """Start-up summary lines: mesh, per-device parameter share, and every divisibility fallback."""
    lines = [describe_mesh(mesh)]
    total = per_device = 0
    for path, leaf in _array_leaves_with_path(model):
        spec = leaf_spec(path, leaf.shape, mesh)[0]
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


def constrain_batch(x: jax.Array) -> jax.Array:
    """Pin an activation's leading (batch or token) dimension to ``("data", "fsdp")`` under the ambient mesh.

    The model code calls this on the outputs of its large matmuls; the training step traces the model under
    its mesh (``jax.sharding.use_abstract_mesh``). Without the pin, the compiler may contract a matmul whose
    weight is split over fsdp on its contracted d_model by resharding the *activation* instead (every device
    then holds partial sums over the global batch's tokens, e.g. an FFN hidden state [B·T, F] eight times
    one chip's share) rather than gathering the weight. The other dimensions are left to the compiler
    (``UNCONSTRAINED``), so tensor-parallel splits still propagate. The identity without an ambient mesh (or
    one lacking the batch axes) and for a leading dimension that does not divide by data x fsdp; a constraint
    never changes values.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not all(axis in mesh.axis_names for axis in BATCH_AXES):
        return x
    if x.ndim == 0 or x.shape[0] % math.prod(mesh.shape[axis] for axis in BATCH_AXES):
        return x
    return jax.lax.with_sharding_constraint(x, P(BATCH_AXES, *([P.UNCONSTRAINED] * (x.ndim - 1))))


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
    "AXES", "AXIS_TYPE", "BATCH_AXES", "PARAM_RULES", "MeshConfig", "MeshError", "ShardingFallback", "batch_shards",
    "batch_spec", "constrain", "constrain_batch", "describe_mesh", "leaf_spec", "make_mesh", "match_rule",
    "partition_specs", "path_str", "resolve_mesh_shape", "shard_batch", "sharding_fallbacks",
    "sharding_summary", "valid_mesh_shapes",
]

