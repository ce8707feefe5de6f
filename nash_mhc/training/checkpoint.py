"""Orbax checkpoints of the TrainState plus a JSON record of the run (step, data position, configs).

Layout: ``<dir>/<step>/state`` (every array leaf of the TrainState, keyed by its tree path),
``<dir>/<step>/meta`` (JSON) and ``<dir>/<step>/checksums`` (crc32c of every array slice, :mod:`.checksums`,
verified by every restore). Saves are asynchronous; a step counts once Orbax has committed it (a renamed
temporary folder locally, a ``commit_success.txt`` in a bucket), so a process killed mid-save leaves the previous
checkpoint as the latest one. The unfinished folder it leaves is removed when the run is next opened for writing,
and nothing else in ``<dir>`` ever is (:func:`unfinished_saves`): Orbax's own clean-up takes every folder of a
bucket directory without a commit marker for a failed save, neighbouring runs included. Restores place
every array with the sharding of the *current* mesh, so a run saved on one mesh resumes on any other.
Every process must call save/restore (Orbax coordinates the hosts). Directories may be local paths or bucket
URIs (``gs://bucket/run``): they go through :mod:`nash_mhc.paths` (etils.epath), as Orbax's own I/O does.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import sys
import warnings
from typing import Any

import equinox as eqx
import jax
import orbax.checkpoint as ocp
from jaxtyping import PyTree

from nash_mhc import paths
from nash_mhc.config import ModelConfig
from nash_mhc.model_format import FORMAT_CHANGES, MODEL_FORMAT
from nash_mhc.training import checksums


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, or does not fit the run that tries to resume it."""


def check_format(meta: dict[str, Any], where: str) -> None:
    """Raise :class:`CheckpointError` (one line) unless ``meta`` was written with :data:`MODEL_FORMAT`."""
    found = meta.get("model_format", 1)
    if found != MODEL_FORMAT:
        why = FORMAT_CHANGES.get(found, "it was written by a newer nash_mhc") if isinstance(found, int) else ""
        raise CheckpointError(f"checkpoint {where} has model format {found!r}, this nash_mhc reads format "
                              f"{MODEL_FORMAT}: {why}")


def _is_shape(x: object) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct | jax.Array)


MODEL_PREFIX = ".model"  # a TrainState's model: its arrays' tree paths (jax.tree_util.keystr) start ".model."


def state_arrays(state: PyTree) -> dict[str, Any]:
    """{tree path: array} of every array leaf (arrays or ShapeDtypeStructs) of ``state``."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(eqx.filter(state, _is_shape))
    return {jax.tree_util.keystr(path): leaf for path, leaf in leaves}


def with_arrays(template: PyTree, arrays: dict[str, Any]) -> PyTree:
    """``template`` with its array leaves replaced, by tree path, from ``arrays``."""
    dynamic, static = eqx.partition(template, _is_shape)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(dynamic)
    missing = [jax.tree_util.keystr(p) for p, _ in leaves if jax.tree_util.keystr(p) not in arrays]
    if missing:
        raise CheckpointError(f"checkpoint lacks {len(missing)} state arrays (e.g. {missing[0]})")
    new = [arrays[jax.tree_util.keystr(p)] for p, _ in leaves]
    return eqx.combine(jax.tree.unflatten(treedef, new), static)


# ModelConfig fields added within a model format, with the value that a checkpoint saved before them implies.
IMPLIED_FIELDS = {"scale_prior": "scale0"}


def saved_model_config(saved: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's saved model config with the fields it predates at the values it implies
    (:data:`IMPLIED_FIELDS`) and without the fields that have left the architecture (``ModelConfig.RETIRED``:
    format 3 kept the layer scan's remat and unroll there)."""
    return {k: v for k, v in {**IMPLIED_FIELDS, **saved}.items() if k not in ModelConfig.RETIRED}


def config_differences(saved: dict[str, Any], current: ModelConfig) -> list[str]:
    """Names of the architecture fields whose values differ, and of saved fields this version does not have
    (retired fields are ignored). A field the checkpoint predates counts at its implied value
    (:func:`saved_model_config`); any other field it lacks is not compared."""
    saved = saved_model_config(saved)
    now = dataclasses.asdict(current)
    changed = [k for k in now if k in saved and saved[k] != now[k]]
    return sorted(changed + [k for k in saved if k not in now])


UNFINISHED_LOCAL = re.compile(r"^\d+\.orbax-checkpoint-tmp")  # Orbax's temporary step folder before its rename
ORBAX_ENTRIES = ("state", "meta", checksums.ITEM, "_CHECKPOINT_METADATA")  # what an Orbax save writes in a step
COMMIT_MARKER = "commit_success.txt"


def unfinished_saves(directory: paths.Path) -> list[paths.Path]:
    """The folders of ``directory`` that an interrupted save left: Orbax's temporary step folders
    (``<step>.orbax-checkpoint-tmp-<time>``) and, in a bucket (no atomic rename), step folders (``<step>``) that hold
    what an Orbax save writes but no commit marker. A folder of any other name or content is never one."""
    def uncommitted_bucket_step(child: paths.Path) -> bool:
        return (paths.is_remote(directory) and child.name.isdigit() and not (child / COMMIT_MARKER).exists()
                and any((child / entry).exists() for entry in ORBAX_ENTRIES))

    children = paths.fresh(directory).iterdir() if directory.exists() else ()
    return [child for child in children if UNFINISHED_LOCAL.match(child.name) or uncommitted_bucket_step(child)]


def remove_unfinished_saves(directory: paths.Path) -> None:
    """Process 0 removes :func:`unfinished_saves` (a new save of that step would collide with one); every host
    waits for it."""
    if jax.process_index() == 0:
        for folder in unfinished_saves(directory):
            folder.rmtree(missing_ok=True)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("nash_mhc unfinished saves")


class Checkpointer:
    """Thin wrapper around ``ocp.CheckpointManager`` for TrainState + JSON metadata + checksums."""

    def __init__(self, directory: paths.PathLike, *, max_to_keep: int | None = 3, async_save: bool = True,
                 read_only: bool = False):
        self.directory = paths.as_path(directory)
        absl = logging.getLogger("absl")
        level = absl.level
        if read_only:  # Orbax warns that a read-only manager saves nothing: expected here
            absl.setLevel(max(level, logging.ERROR))
        try:
            if not read_only:
                remove_unfinished_saves(self.directory)
            # Orbax's clean-up stays off: in a bucket it deletes every folder without a commit marker
            options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=async_save,
                                                   create=not read_only, read_only=read_only,
                                                   cleanup_tmp_directories=False)
            self.manager = ocp.CheckpointManager(self.directory, options=options,
                                                 item_names=("state", "meta", checksums.ITEM))
        finally:
            absl.setLevel(level)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state: PyTree, meta: dict[str, Any], *, force: bool = True) -> bool:
        """Start an asynchronous save of ``state``, ``meta`` and the arrays' checksums at ``step`` (the device→host
        copies are made here; the hashing runs beside the writes)."""
        meta = {**meta, "model_format": MODEL_FORMAT}
        arrays = state_arrays(state)
        args = ocp.args.Composite(state=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta),
                                  **{checksums.ITEM: checksums.ChecksumSave(checksums.host_shards(arrays))})
        return self.manager.save(step, args=args, force=force)

    def wait(self) -> None:
        """Block until every pending save is complete on disk."""
        self.manager.wait_until_finished()

    def read_meta(self, step: int) -> dict[str, Any]:
        """The JSON metadata of ``step``; raises :class:`CheckpointError` if unreadable or of another format."""
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
            meta = dict(restored["meta"])
        except Exception as error:  # noqa: BLE001 - any read failure means an unusable checkpoint
            raise _read_failure(f"cannot read checkpoint metadata at {self.directory}/{step}", error) from error
        check_format(meta, f"{self.directory}/{step}")
        return meta

    def restore(self, step: int, template: PyTree) -> PyTree:
        """Restore the state at ``step`` onto the shardings of ``template`` (arrays or ShapeDtypeStructs)."""
        return with_arrays(template, self._read_arrays(step, state_arrays(template)))

    def restore_model(self, step: int, template: PyTree) -> PyTree:
        """Only ``template.model`` (a TrainState's model) of the state at ``step``: the optimizer state and
        the other arrays of the checkpoint are not read (an Orbax partial restore), so inference needs the
        model's memory and reads its bytes only."""
        wanted = {k: v for k, v in state_arrays(template).items() if k.startswith(MODEL_PREFIX + ".")}
        reader = Checkpointer(self.directory, read_only=True)  # its own manager: Orbax binds one handler per item
        try:
            arrays = reader._read_arrays(step, wanted, partial=True)
        finally:
            reader.close()
        return with_arrays(template.model, {k[len(MODEL_PREFIX):]: v for k, v in arrays.items()})

    def _read_arrays(self, step: int, wanted: dict[str, Any], *, partial: bool = False) -> dict[str, Any]:
        """``{tree path: array}`` of ``step`` for the entries of ``wanted`` (arrays or shapes; each placed on its
        sharding). ``partial``: the checkpoint may hold more entries, which are not read."""
        target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in wanted.items()}
        args = (ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                                       partial_restore=True) if partial else ocp.args.StandardRestore(target))
        _quiet_abandoned_reads()  # before the restore: a failing read's callbacks may fire while it unwinds
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(state=args))
        except Exception as error:  # noqa: BLE001
            raise _read_failure(f"cannot restore checkpoint {self.directory}/{step}", error) from error
        arrays = dict(restored["state"])
        for key, spec in target.items():
            if key in arrays and tuple(arrays[key].shape) != tuple(spec.shape):
                raise CheckpointError(f"checkpoint array {key} has shape {tuple(arrays[key].shape)}, "
                                      f"the run expects {tuple(spec.shape)}")
        try:
            checksums.verify(arrays, self.directory / str(step))
        except checksums.ChecksumMismatch as error:
            raise CheckpointError(f"checkpoint {self.directory}/{step} is corrupt: {error}") from None
        return arrays

    def close(self) -> None:
        self.manager.close()


def _read_failure(what: str, error: Exception) -> CheckpointError:
    """The one-line error of a failed checkpoint read (``what``: the error's name and first line); from here on
    asyncio's reports of that read's abandoned tasks are dropped (:func:`_quiet_abandoned_tasks`). Orbax's
    wrapper of a TensorStore read error prints a method's repr (``<bound method ...spec of TensorStore(``) where
    the details belong: the error it wraps says what failed."""
    _quiet_abandoned_tasks()
    while "<bound method" in str(error) and (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__
    return CheckpointError(f"{what}: {type(error).__name__}: {str(error).splitlines()[0][:200]}")


ABANDONED_READ = "_read_array_index_and_device_put"  # Orbax's coroutine reading one array's shard


def _quiet_abandoned_reads() -> None:
    """Installed before each restore (idempotent). After a failed restore, Python reports two kinds of
    "unraisable" exception, each with a traceback, for the reads Orbax abandoned: TensorStore completes them
    and their callbacks find Orbax's event loop closed (a RuntimeError), and each read's coroutine, closed
    unfinished when it is collected, turns that close (GeneratorExit) into an Exception naming the array. Drop
    exactly those (a failed restore is already reported in one line); anything else goes to the previous hook."""
    previous = sys.unraisablehook
    if getattr(previous, "nash_mhc_quiet", False):
        return

    def hook(unraisable: Any) -> None:
        error = unraisable.exc_value
        loop_closed = isinstance(error, RuntimeError) and str(error) == "Event loop is closed"
        read_closed = (getattr(unraisable.object, "__qualname__", None) == ABANDONED_READ
                       and type(error) is Exception and isinstance(error.__cause__, GeneratorExit))
        if not (loop_closed or read_closed):
            previous(unraisable)

    hook.nash_mhc_quiet = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


class _AbandonedTaskFilter(logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" reports (message and traceback)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Task exception was never retrieved")


UNAWAITED_COROUTINE = r"coroutine '.*' was never awaited"  # nash_mhc has no coroutines: these are Orbax's


def _quiet_abandoned_tasks() -> None:
    """Installed when a restore has failed (idempotent): Orbax's other reads of that restore fail too. When their
    asyncio tasks are collected unawaited, asyncio logs each with a traceback after the one-line error, and a
    coroutine Orbax made but never awaited (e.g. ``Store._get_array_metadatas``) draws Python's two-line
    RuntimeWarning when it is collected, often at exit. Only those reports are dropped, and only once a failed
    restore has been reported."""
    logger = logging.getLogger("asyncio")
    if not any(isinstance(f, _AbandonedTaskFilter) for f in logger.filters):
        logger.addFilter(_AbandonedTaskFilter())
    warnings.filterwarnings("ignore", message=UNAWAITED_COROUTINE, category=RuntimeWarning)


def find_checkpoint(path: paths.PathLike) -> tuple[paths.Path, int | None]:
    """Resolve ``--resume-from``: a run directory (latest step) or one step directory inside it."""
    path = paths.as_path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist")
    if path.name.isdigit() and (path / "state").exists():
        return path.parent, int(path.name)
    return path, None
