"""The ``(data, fsdp, tp)`` device mesh: axis names, shape validation, :class:`MeshConfig` and :func:`make_mesh`
(the axes and why they are ``Auto``: :mod:`nash_mhc.sharding`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from nash_mhc.settings import setting

AXES = ("data", "fsdp", "tp")
BATCH_AXES = ("data", "fsdp")
AXIS_TYPE = AxisType.Auto

FSDP = "fsdp"
TP = "tp"
FSDP_TP = ("fsdp", "tp")


class MeshError(ValueError):
    """A mesh shape that does not fit the available devices."""


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


def batch_shards(mesh: Mesh) -> int:
    """How many ways the batch dimension is split."""
    return math.prod(mesh.shape[a] for a in BATCH_AXES)
