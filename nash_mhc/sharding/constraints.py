"""Placement inside and around jit: sharding constraints (the rules' specs, FSDP's gather, the batch pin), per-shard
execution of kernels (``shard_map``) and the batch's placement on the mesh (see :mod:`nash_mhc.sharding`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree

from nash_mhc.params import map_declared
from nash_mhc.sharding.mesh import AXES, BATCH_AXES, FSDP
from nash_mhc.sharding.rules import _as_tuple, _is_array, _spec, logical_spec


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
