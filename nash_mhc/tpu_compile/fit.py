"""Compile-only fit check: compile the real train step for a TPU topology (or the local devices) and report
per-chip memory against the chip's HBM, without allocating a parameter.

What is compiled is the train step that training runs (:data:`nash_mhc.training.step._train_step_jit`, its
state donated), on abstract inputs: the TrainState's leaves are ``jax.ShapeDtypeStruct`` with the sharding
rules' ``NamedSharding`` (:func:`nash_mhc.training.state.state_initializer`, traced by ``jax.eval_shape``), and
so are the batch's tokens [B, T+1]. On a CPU host with libtpu installed, a TPU topology gives abstract TPU
devices (``jax.experimental.topologies``) and ``.compile()`` runs the real TPU compiler, as MaxText's
``train_compile.py`` does; when the step does not fit, that compiler raises ``RESOURCE_EXHAUSTED``, which
becomes a "does not fit" :class:`FitReport` here.

Topology names: ``<generation>:<shape>`` as libtpu spells them (``v5e:2x4``, ``v6e:4x4``, ``v4:2x2x2``,
``v5p:2x2x1``) or Cloud accelerator types (``v5litepod-8`` = ``v5e-8``, ``v6e-8``, ``v4-32``, ``v5p-8``; the
number counts chips for v5e/v6e and TensorCores, two per chip, for v4/v5p). v4 and v5p are compiled as one
megacore device per chip, as JAX sees them on the VM. Per chip: v4 32 GiB, v5e 16 GiB, v5p 95 GiB, v6e 32 GiB.

Memory per chip (``compiled.memory_analysis()``): arguments (parameters + optimizer state + the batch shard),
temporaries, outputs not aliased to a donated argument, and the program itself. The FLOP and byte estimates
are XLA's ``cost_analysis()``, which counts a ``lax.scan`` body once (so not a per-step total); on a TPU the
estimated step time (:mod:`nash_mhc.tpu_compile.estimate`) counts every loop by its trip count.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from nash_mhc import execution
from nash_mhc.config import ModelConfig
from nash_mhc.hardware import captured_native_stderr, detect_accelerator, libtpu_installed, tpu_chips_on_pci
from nash_mhc.model import num_params
from nash_mhc.sharding import batch_spec, make_mesh
from nash_mhc.tpu_compile import estimate
from nash_mhc.training import step as train_step_module
from nash_mhc.training.config import TrainConfig
from nash_mhc.training.state import Batch, TrainState, state_initializer

GIB = 2**30

# HBM per chip by JAX device kind (the compile-only devices expose no memory_stats()).
HBM_BYTES = {"TPU v4": 32 * GIB, "TPU v5 lite": 16 * GIB, "TPU v5": 95 * GIB, "TPU v6 lite": 32 * GIB}


class TopologyError(ValueError):
    """An unknown or impossible TPU topology name (a one-line message listing the valid names)."""


# ------------------------------------------------------------------------------------ topology names
@dataclasses.dataclass(frozen=True)
class Generation:
    """A TPU generation as libtpu names it: its shape rank, chip configuration and chips per host."""

    name: str                   # libtpu topology prefix: v4, v5e, v5p, v6e
    cloud: tuple[str, ...]      # Cloud accelerator-type prefixes (v5litepod-8, v5e-8, ...)
    dims: int                   # 2 (v5e, v6e) or 3 (v4, v5p)
    cores_per_chip: int         # what the number in a Cloud name counts: chips (1) or TensorCores (2)
    chip_config: str            # "default", or "megacore" (both TensorCores of a chip as one device)
    cloud_chips: tuple[int, ...]  # the chip counts of the Cloud names listed as valid


GENERATIONS = (
    Generation("v4", ("v4",), 3, 2, "megacore", tuple(2**k for k in range(2, 12))),
    Generation("v5e", ("v5litepod", "v5e"), 2, 1, "default", (1, 4, 8, 16, 32, 64, 128, 256)),
    Generation("v5p", ("v5p",), 3, 2, "megacore", tuple(2**k for k in range(2, 13))),
    Generation("v6e", ("v6e",), 2, 1, "default", (1, 4, 8, 16, 32, 64, 128, 256)),
)


@dataclasses.dataclass(frozen=True)
class TpuSlice:
    """A resolved TPU slice: libtpu topology name, chip grid and the options :func:`topology_devices` passes."""

    topology: str                       # e.g. "v5e:2x4"
    generation: Generation
    shape: tuple[int, ...]              # chips along each axis
    chips_per_host: tuple[int, int, int]

    @property
    def chips(self) -> int:
        return math.prod(self.shape)


def _cloud_shape(generation: Generation, chips: int) -> tuple[int, ...]:
    """Chip grid of a power-of-two Cloud slice, short axes first: v5e/v6e 1x1, 2x2, 2x4, 4x4, 4x8, ...;
    v4/v5p 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, 4x4x8, ... (grown by doubling the last of the shortest axes)."""
    shape = [1, 1] if generation.dims == 2 else [2, 2, 1]
    while math.prod(shape) < chips:
        shortest = min(shape)
        shape[max(i for i, size in enumerate(shape) if size == shortest)] *= 2
    return tuple(shape)


def valid_topology_names() -> str:
    """The names :func:`resolve_topology` accepts, written out for an error message (one line)."""
    cloud = []
    for gen in GENERATIONS:
        counts = [chips * gen.cores_per_chip for chips in gen.cloud_chips]
        cloud.append(f"{'/'.join(gen.cloud)}-{{{','.join(map(str, counts))}}}")
    return ("Cloud accelerator types " + ", ".join(cloud) + "; or topologies v5e:AxB, v6e:AxB (e.g. v5e:2x2, "
            "v6e:2x4), v4:AxBxC, v5p:AxBxC (e.g. v4:2x2x2, v5p:2x2x1) whose chips divide into hosts of 2x2 "
            "(or one host of up to 8 v5e/v6e chips)")


def resolve_topology(name: str) -> TpuSlice:
    """Parse a topology or Cloud accelerator-type name; raises :class:`TopologyError` listing the valid names."""
    text = name.strip().lower()

    def fail(problem: str) -> TopologyError:
        return TopologyError(f"unknown TPU topology {name!r} ({problem}); valid: {valid_topology_names()}")

    by_prefix = {prefix: gen for gen in GENERATIONS for prefix in (gen.name, *gen.cloud)}
    if match := re.fullmatch(r"([a-z0-9]+)-(\d+)", text):
        gen = by_prefix.get(match[1])
        count = int(match[2])
        if gen is None:
            raise fail(f"no TPU generation {match[1]!r}")
        if count % gen.cores_per_chip or count // gen.cores_per_chip not in gen.cloud_chips:
            raise fail(f"no {gen.name} slice of {count} {'TensorCores' if gen.cores_per_chip > 1 else 'chips'}")
        shape = _cloud_shape(gen, count // gen.cores_per_chip)
    elif match := re.fullmatch(r"([a-z0-9]+):(\d+(?:x\d+)*)", text):
        gen = by_prefix.get(match[1])
        if gen is None:
            raise fail(f"no TPU generation {match[1]!r}")
        shape = tuple(int(size) for size in match[2].split("x"))
        if len(shape) != gen.dims or min(shape) < 1:
            raise fail(f"{gen.name} topologies have {gen.dims} positive axes")
    else:
        raise fail("expected e.g. v5e:2x4 or v5litepod-8")
    grid = (*shape, 1)[:3]
    if gen.dims == 2 and math.prod(shape) <= 8:
        hosts = grid  # one host holds the whole slice (v5e/v6e: up to 8 chips)
    else:
        hosts = (2, 2, 1)
        if any(size % host for size, host in zip(grid, hosts, strict=True)):
            raise fail(f"the {'x'.join(map(str, shape))} chips do not divide into hosts of 2x2x1")
    return TpuSlice(f"{gen.name}:{'x'.join(map(str, shape))}", gen, shape, hosts)


def topology_devices(name: str) -> list[Any]:
    """Abstract TPU devices of a topology, one per chip, ordered by id (needs libtpu, not a TPU)."""
    tpu = resolve_topology(name)
    if not libtpu_installed():
        raise TopologyError(f"compiling for TPU topology {tpu.topology} needs libtpu: pip install -e \".[tpu]\"")
    if detect_accelerator() != "tpu" and not tpu_chips_on_pci():
        # No TPU here to protect: let several compile-only processes load libtpu at once (it otherwise holds
        # /tmp/libtpu_lockfile for the life of the process and refuses a second one).
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    try:
        with captured_native_stderr():  # libtpu's start-up complaints about the missing TPU VM metadata
            description = topologies.get_topology_desc(
                platform="tpu", topology_name=tpu.topology, chip_config_name=tpu.generation.chip_config,
                chips_per_host_bounds=tpu.chips_per_host)
    except Exception as error:  # noqa: BLE001 - libtpu refusing the topology (JaxRuntimeError)
        detail = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise TopologyError(f"libtpu cannot build TPU topology {tpu.topology} ({name}): {detail}; "
                            f"valid: {valid_topology_names()}") from error
    return sorted(description.devices, key=lambda device: device.id)


# ---------------------------------------------------------------------------------------- abstract inputs
def abstract_train_state(model_config: ModelConfig, train_config: TrainConfig, mesh: Mesh) -> TrainState:
    """The TrainState as ``ShapeDtypeStruct`` leaves carrying the rules' shardings on ``mesh`` (nothing allocated)."""
    key = jax.random.key(0)
    init_leaves, finish = state_initializer(model_config, train_config, mesh, key=key)
    leaves = jax.eval_shape(init_leaves, key)  # carry init_leaves' out_shardings
    structure = jax.tree.structure(jax.eval_shape(lambda k: finish(init_leaves(k)), key))  # shardings dropped
    return jax.tree.unflatten(structure, leaves)


def abstract_batch(batch_size: int, seq_len: int, mesh: Mesh) -> Batch:
    """A Batch of ``ShapeDtypeStruct`` tokens [B, T+1] int32, rows split over the batch axes."""
    tokens = jax.ShapeDtypeStruct((batch_size, seq_len + 1), jnp.int32,
                                  sharding=NamedSharding(mesh, batch_spec(2)))
    return jax.tree.map(lambda _: tokens, jax.eval_shape(lambda t: Batch(tokens=t), tokens))


def per_device_bytes(tree: Any) -> int:
    """Bytes of one device's shard of every ``ShapeDtypeStruct`` leaf (the largest shard where uneven)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            continue
        shard = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shard) * np.dtype(leaf.dtype).itemsize
    return total


# ------------------------------------------------------------------------------------------------ report
@dataclasses.dataclass(frozen=True)
class FitReport:
    """Per-chip memory of one compiled train step (bytes), against the chip's HBM.

    ``fits`` is False when the total exceeds ``hbm_bytes`` or the compiler ran out of memory (then
    ``compiler_error`` holds its message, ``temp_bytes`` and ``available_bytes`` the figures it gives, and
    the other compiled sizes are None); None when the devices' memory is unknown (CPU) and the compiler did
    not refuse.
    """

    target: str                     # "v5e-8 = v5e:2x4" or "local"
    device_kind: str
    num_devices: int
    mesh_shape: tuple[int, int, int]
    batch_size: int
    seq_len: int
    grad_accum_steps: int
    preset: str                     # short model description
    state_bytes: int                # parameters + optimizer state per chip, from the shardings
    argument_bytes: int | None      # everything the step takes per chip (state + batch shard)
    temp_bytes: int | None
    output_bytes: int | None        # outputs not aliased to a donated argument
    code_bytes: int | None
    hbm_bytes: int | None           # memory of one chip (device limit where JAX exposes it, else HBM_BYTES)
    hbm_source: str                 # "device", "table" or "unknown"
    fits: bool | None
    flops: float | None
    bytes_accessed: float | None
    lower_seconds: float
    compile_seconds: float
    compiler_error: str | None = None
    available_bytes: int | None = None  # what the compiler says it may use, when it ran out of memory
    flops_per_token: float = 0.0        # model FLOPs per token (ModelConfig.flops_per_token), for the MFU
    step_cost: estimate.StepCost | None = None  # the compiler's per-step cost (TPU), loops by trip count
    estimate_error: str | None = None   # why there is no step_cost on a TPU
    pallas_calls: int | None = None     # Pallas (Mosaic) kernel calls in the compiled step's text, per site

    @property
    def total_bytes(self) -> int | None:
        parts = (self.argument_bytes, self.temp_bytes, self.output_bytes, self.code_bytes)
        return None if any(p is None for p in parts) else sum(parts)

    @property
    def headroom_bytes(self) -> int | None:
        total = self.total_bytes
        return None if total is None or self.hbm_bytes is None else self.hbm_bytes - total


def hbm_of(device: Any) -> tuple[int | None, str]:
    """(memory per device in bytes, where it comes from): the device's own limit, else the HBM table."""
    try:
        limit = (device.memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001 - abstract and CPU devices have no memory_stats
        limit = None
    if limit:
        return int(limit), "device"
    if device.device_kind in HBM_BYTES:
        return HBM_BYTES[device.device_kind], "table"
    return None, "unknown"


_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _size(text: str) -> int:
    number, unit = re.fullmatch(r"([\d.]+)\s*([KMGT]?)i?B?", text.strip()).groups()
    return int(float(number) * _UNITS[unit])


def parse_out_of_memory(message: str) -> tuple[str, int | None, int | None] | None:
    """(first line, required bytes, available bytes) of an XLA "Ran out of memory" error, else None.

    Understands "the total memory required for HLO temporaries (17.99G) exceeds available HBM (15.75G)" and
    "Used 20.50G of 15.48G hbm".
    """
    if "RESOURCE_EXHAUSTED" not in message and "Ran out of memory" not in message:
        return None
    size = r"([\d.]+\s*[KMGT]?i?B?)"
    line = next((ln.strip() for ln in message.splitlines() if "memory" in ln.lower()), message.splitlines()[0])
    if match := re.search(rf"required for HLO temporaries \({size}\) exceeds available HBM \({size}\)", message):
        return line, _size(match[1]), _size(match[2])
    if match := re.search(rf"Used {size} of {size} hbm", message):
        return line, _size(match[1]), _size(match[2])
    return line, None, None


def describe_model(config: ModelConfig) -> str:
    scan = execution.current()  # the step is compiled under ExecutionConfig.use()
    return (f"{num_params(config):,} parameters, d_model {config.d_model}, {config.num_layers} layers, "
            f"{config.num_streams} streams, {config.dtype}, remat {scan.remat}"
            + (f" in groups of {scan.remat_group}" if scan.remat != "none" and scan.remat_group > 1 else ""))


def check_fit(model_config: ModelConfig, train_config: TrainConfig, *, topology: str | None = None,
              data: int = -1, fsdp: int = 1, tp: int = 1, devices: Sequence[Any] | None = None) -> FitReport:
    """Compile the train step for ``topology`` (or ``devices``, default the local ones) and report its fit.

    The global batch is ``train_config.batch_size`` sequences of ``model_config.seq_len`` tokens, split into
    ``train_config.grad_accum_steps`` microbatches, on a (data, fsdp, tp) mesh (one axis may be -1). Raises
    :class:`TopologyError` for a bad topology name and :class:`nash_mhc.MeshError` for a bad mesh; a compiler
    that runs out of memory gives a report with ``fits=False``.
    """
    if topology is not None:
        tpu = resolve_topology(topology)
        devices = topology_devices(topology)
        target = tpu.topology if tpu.topology == topology.strip().lower() else f"{topology} = {tpu.topology}"
    else:
        devices = list(jax.devices() if devices is None else devices)
        target = "local"
    mesh = make_mesh(data, fsdp, tp, devices=devices)
    state = abstract_train_state(model_config, train_config, mesh)
    batch = abstract_batch(train_config.batch_size, model_config.seq_len, mesh)
    train_step_module._check_batch(batch, mesh, train_config.grad_accum_steps, execution.current().loss_chunks)
    state_bytes = per_device_bytes(state)
    hbm, hbm_source = hbm_of(devices[0])
    common = dict(target=target, device_kind=devices[0].device_kind, num_devices=len(devices),
                  mesh_shape=tuple(mesh.shape.values()), batch_size=train_config.batch_size,
                  seq_len=model_config.seq_len, grad_accum_steps=train_config.grad_accum_steps,
                  preset=describe_model(model_config), state_bytes=state_bytes,
                  flops_per_token=model_config.flops_per_token())

    start = time.perf_counter()
    # The step training runs (filter_jit over _train_step, state donated), traced inside a jit that takes the
    # abstract arguments: equinox's own .lower() treats ShapeDtypeStruct leaves as static values.
    lowered = jax.jit(lambda b, s: train_step_module._train_step_jit(b, s), donate_argnums=1).lower(batch, state)
    lowered_at = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as error:  # noqa: BLE001 - XLA raises JaxRuntimeError; anything else is re-raised
        oom = parse_out_of_memory(str(error))
        if oom is None:
            raise
        line, required, available = oom
        return FitReport(**common, argument_bytes=None, temp_bytes=required, output_bytes=None, code_bytes=None,
                         hbm_bytes=hbm, hbm_source=hbm_source, fits=False, flops=None, bytes_accessed=None,
                         lower_seconds=lowered_at - start, compile_seconds=time.perf_counter() - lowered_at,
                         compiler_error=line, available_bytes=available)
    compiled_at = time.perf_counter()
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else (cost or {})
    report = FitReport(
        **common, argument_bytes=int(memory.argument_size_in_bytes), temp_bytes=int(memory.temp_size_in_bytes),
        output_bytes=int(memory.output_size_in_bytes - memory.alias_size_in_bytes),
        code_bytes=int(memory.generated_code_size_in_bytes), hbm_bytes=hbm, hbm_source=hbm_source, fits=None,
        flops=cost.get("flops"), bytes_accessed=cost.get("bytes accessed"), lower_seconds=lowered_at - start,
        compile_seconds=compiled_at - lowered_at)
    fits = None if hbm is None else report.total_bytes <= hbm
    step_cost, error = estimate.compiled_step_cost(compiled, devices[0].device_kind)
    return dataclasses.replace(report, fits=fits, step_cost=step_cost, estimate_error=error,
                               pallas_calls=compiled.as_text().count('custom_call_target="tpu_custom_call"'))


def _gib(value: int | None) -> str:
    if value is None:
        return "?"
    return f"{value / GIB:.2f} GiB" if abs(value) >= GIB else f"{value / 2**20:.1f} MiB"


def report_lines(report: FitReport) -> list[str]:
    """The lines ``--compile-only`` prints for a report."""
    data, fsdp, tp = report.mesh_shape
    chips = report.num_devices
    per_chip = report.batch_size // max(1, data * fsdp)
    lines = [
        f"compile-only: train step for {report.target}: {chips} x {report.device_kind}, "
        f"mesh data={data} fsdp={fsdp} tp={tp}",
        f"model: {report.preset}",
        f"batch: {report.batch_size} x {report.seq_len} tokens ({per_chip} x {report.seq_len} per data shard, "
        f"{report.grad_accum_steps} microbatch(es))",
    ]
    hbm = "unknown memory" if report.hbm_bytes is None else f"{_gib(report.hbm_bytes)} ({report.hbm_source})"
    if report.compiler_error is not None:
        lines += [
            f"per chip: parameters + optimizer state {_gib(report.state_bytes)}; the compiler ran out of memory: "
            f"temporaries need {_gib(report.temp_bytes)}, it may use {_gib(report.available_bytes)} of {hbm}",
            f"compiler: {report.compiler_error}",
        ]
    else:
        lines += [
            f"per chip: parameters + optimizer state {_gib(report.state_bytes)} (arguments "
            f"{_gib(report.argument_bytes)}), temporaries {_gib(report.temp_bytes)}, outputs "
            f"{_gib(report.output_bytes)}, program {_gib(report.code_bytes)}",
            f"total {_gib(report.total_bytes)} of {hbm}"
            + ("" if report.headroom_bytes is None else f", headroom {_gib(report.headroom_bytes)}"),
            f"compiler estimates per chip: {report.flops or 0:.3e} FLOP, {report.bytes_accessed or 0:.3e} bytes "
            "accessed (a scan body counted once)",
            *estimate.estimate_lines(report),
            f"Pallas kernel calls in the compiled step: {report.pallas_calls} (none under --kernels xla)",
        ]
    lines.append(f"compile time: {report.lower_seconds + report.compile_seconds:.1f} s (trace and lower "
                 f"{report.lower_seconds:.1f} s, compile {report.compile_seconds:.1f} s)")
    verdict = {True: "fits", False: "DOES NOT FIT", None: "fit unknown (no memory figure for these devices)"}
    lines.append(f"result: {verdict[report.fits]}")
    return lines


__all__ = ["FitReport", "GENERATIONS", "HBM_BYTES", "TopologyError", "TpuSlice", "abstract_batch",
           "abstract_train_state", "check_fit", "hbm_of", "parse_out_of_memory", "per_device_bytes",
           "report_lines", "resolve_topology", "topology_devices", "valid_topology_names"]
