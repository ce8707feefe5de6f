"""crc32c checksums of a checkpoint's arrays: recorded by each host for the shards it writes, verified by each host
for the shards it reads. Orbax checks a checkpoint's structure, not its content; this catches flipped bytes.

Record: ``<step>/checksums/process_<i>.json`` (one per host), ``{tree path: [[[start, stop] per dim], crc32c]}``
for every shard with ``replica_id == 0`` on that host, so each distinct slice of every array is recorded by the
one host that writes it. The checksum is crc32c (what GCS itself uses, ``google-crc32c``) of the slice's C-order
bytes. It is an Orbax item of the step, written beside the arrays: the step is committed only when every host's
record is.

Verification: after a restore, each host checks every recorded slice that lies inside one shard it holds. On the
mesh that wrote the checkpoint that is every slice; on another mesh, a recorded slice that spans two hosts'
shards is not checked (on one host, every slice is).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import jax
import numpy as np
from etils import epath
from orbax.checkpoint import checkpoint_args
from orbax.checkpoint._src.futures import future
from orbax.checkpoint._src.handlers import async_checkpoint_handler

from nash_mhc.exported import crc32c

ITEM = "checksums"
Slice = tuple[tuple[int, int], ...]  # [start, stop) per dimension


class ChecksumMismatch(ValueError):
    """An array's bytes differ from the crc32c recorded when it was saved."""


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> Slice:
    return tuple(tuple(s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))


def host_shards(arrays: dict[str, Any]) -> list[tuple[str, Slice, np.ndarray]]:
    """``(tree path, slice, host copy)`` of every shard this host writes (``replica_id == 0``). The copies are made
    now, so the device buffers may be donated to the next step while the hashing runs in the background."""
    shards = [(key, _bounds(s.index, a.shape), s.data) for key, a in arrays.items() if isinstance(a, jax.Array)
              for s in a.addressable_shards if s.replica_id == 0]
    for _, _, data in shards:
        data.copy_to_host_async()
    return [(key, bounds, _host_copy(data)) for key, bounds, data in shards]


def _host_copy(data: jax.Array) -> np.ndarray:
    """A host array that outlives ``data``: an accelerator's transfer is one already; on the CPU the NumPy view
    of the buffer is copied (``np.array(data, copy=True)`` goes through a slow path: about 30 x slower)."""
    host = np.asarray(data)
    return host.copy() if data.platform() == "cpu" else host


def record(shards: list[tuple[str, Slice, np.ndarray]]) -> dict[str, list[Any]]:
    """``{tree path: [[slice, crc32c], ...]}`` of ``shards`` (:func:`host_shards`)."""
    table: dict[str, list[Any]] = {}
    for key, bounds, data in shards:
        table.setdefault(key, []).append([[list(b) for b in bounds], crc32c(data)])
    return table


def read_records(step_dir: epath.Path) -> dict[str, list[tuple[Slice, int]]] | None:
    """Every host's records of ``step_dir`` merged, or None for a checkpoint saved without them."""
    folder = step_dir / ITEM
    if not folder.exists():
        return None
    merged: dict[str, list[tuple[Slice, int]]] = {}
    for file in sorted(folder.glob("process_*.json")):
        for key, entries in json.loads(file.read_text()).items():
            merged.setdefault(key, []).extend((tuple(tuple(b) for b in bounds), crc) for bounds, crc in entries)
    return merged


def mismatches(arrays: dict[str, Any], records: dict[str, list[tuple[Slice, int]]]) -> list[str]:
    """``"<path>[slice]"`` for each recorded slice inside one of this host's shards whose crc32c differs (each
    slice is read once, from the first shard that holds it)."""
    bad = []
    for key, array in arrays.items():
        held = [(_bounds(s.index, array.shape), s.data) for s in array.addressable_shards] if key in records else []
        for bounds, crc in records.get(key, []):
            for shard_bounds, data in held:
                if all(a <= b and e <= f for (b, e), (a, f) in zip(bounds, shard_bounds, strict=True)):
                    local = tuple(slice(b - a, e - a) for (b, e), (a, _) in zip(bounds, shard_bounds, strict=True))
                    if crc32c(np.asarray(data)[local]) != crc:
                        bad.append(f"{key}[{', '.join(f'{b}:{e}' for b, e in bounds)}]")
                    break
    return bad


def verify(arrays: dict[str, Any], step_dir: epath.Path) -> None:
    """Raise :class:`ChecksumMismatch` (one line) if any host finds a restored slice whose bytes differ from its
    record; every host raises together (so a pod takes one decision). No record: nothing to check."""
    records = read_records(step_dir)
    bad = mismatches(arrays, records) if records is not None else []
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.int32(len(bad)))
        if int(np.sum(flags)) and not bad:
            bad = [f"{int(np.sum(flags))} slices on other hosts"]
    if bad:
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        raise ChecksumMismatch(f"crc32c of {bad[0]}{more} differs from the one recorded at save time")


class ChecksumHandler(async_checkpoint_handler.AsyncCheckpointHandler):
    """Orbax item handler: every host hashes its host copies in the background and writes its own record."""

    async def _write(self, shards: list[tuple[str, Slice, np.ndarray]], directory: epath.Path) -> None:
        table = await asyncio.to_thread(record, shards)
        (directory / f"process_{jax.process_index()}.json").write_text(json.dumps(table))

    async def async_save(self, directory: epath.Path, args: ChecksumSave) -> list[future.Future]:
        return [future.CommitFutureAwaitingContractedSignals(self._write(args.shards, directory),
                                                             name="nash_mhc_checksums")]

    def save(self, directory: epath.Path, args: ChecksumSave) -> None:
        asyncio.run(self._write(args.shards, directory))

    def restore(self, directory: epath.Path, args: ChecksumRestore | None = None) -> Any:
        return read_records(directory.parent)


@checkpoint_args.register_with_handler(ChecksumHandler, for_save=True)
@dataclasses.dataclass
class ChecksumSave(checkpoint_args.CheckpointArgs):
    shards: list[tuple[str, Slice, np.ndarray]]


@checkpoint_args.register_with_handler(ChecksumHandler, for_restore=True)
@dataclasses.dataclass
class ChecksumRestore(checkpoint_args.CheckpointArgs):
    pass
