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

Modules: :mod:`~nash_mhc.sharding.mesh` (the mesh), :mod:`~nash_mhc.sharding.rules` (parameter specs and
fallbacks), :mod:`~nash_mhc.sharding.constraints` (constraints, per-shard kernels, batch placement); every name is
re-exported here.
"""

from nash_mhc.sharding.constraints import (
    batch_spec,
    constrain,
    constrain_batch,
    gather_fsdp,
    per_shard,
    per_shard_attention,
    rows_to_batch,
    shard_batch,
)
from nash_mhc.sharding.mesh import (
    AXES,
    AXIS_TYPE,
    BATCH_AXES,
    FSDP,
    FSDP_TP,
    TP,
    MeshConfig,
    MeshError,
    batch_shards,
    describe_mesh,
    make_mesh,
    resolve_mesh_shape,
    valid_mesh_shapes,
)
from nash_mhc.sharding.rules import (
    LOGICAL_AXIS_RULES,
    Axes,
    ShardingFallback,
    logical_spec,
    mesh_axes,
    named_shardings,
    partition_specs,
    path_str,
    sharding_fallbacks,
    sharding_summary,
)

__all__ = [
    "AXES", "AXIS_TYPE", "BATCH_AXES", "FSDP", "FSDP_TP", "LOGICAL_AXIS_RULES", "TP", "Axes", "MeshConfig",
    "MeshError", "ShardingFallback", "batch_shards", "batch_spec", "constrain", "constrain_batch", "describe_mesh",
    "gather_fsdp", "logical_spec", "make_mesh", "mesh_axes", "named_shardings", "per_shard", "per_shard_attention",
    "partition_specs", "path_str", "resolve_mesh_shape", "rows_to_batch", "shard_batch", "sharding_fallbacks",
    "sharding_summary", "valid_mesh_shapes",
]
