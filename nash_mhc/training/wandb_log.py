"""Weights & Biases logging (``--wandb-project``): every scalar TensorBoard gets, from process 0 only.

The run id is kept in ``<checkpoint-dir>/wandb_run_id``, so a resumed run (same ``--checkpoint-dir``) continues
the same W&B run (``resume="allow"``). W&B's own files go under ``<checkpoint-dir>/wandb/`` for a local
directory (W&B's default, ``./wandb`` or ``$WANDB_DIR``, for a bucket). ``WANDB_MODE=offline`` needs no network
and no key (``wandb sync <checkpoint-dir>/wandb/offline-run-*`` uploads it later). Steps W&B already holds are
not rewritten: after resuming from an older checkpoint, W&B ignores the repeated steps (``metrics.jsonl`` has
them).
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from typing import Any

import jax

from nash_mhc import paths
from nash_mhc.settings import check_settings, setting

ID_FILE = "wandb_run_id"
OFFLINE_MODES = ("offline", "dryrun", "disabled")
PROJECT_CHARACTERS = "/\\#?%:"  # W&B refuses project names with any of these (and over 128 characters)
RUN_ID_CHARACTERS = ":;,#?/'"  # ... and run ids with any of these


@dataclasses.dataclass(frozen=True)
class WandbConfig:
    """Where the run is logged in Weights & Biases (nothing is logged without ``--wandb-project``)."""

    wandb_project: str | None = setting(None, "log every TensorBoard scalar to this W&B project too (needs the "
                                              "wandb extra; WANDB_MODE=offline works without network or key)")
    wandb_entity: str | None = setting(None, "W&B entity (user or team) of --wandb-project (default: yours)")
    wandb_run_name: str | None = setting(None, "W&B display name of the run (default: W&B's)")
    wandb_tags: str | None = setting(None, "comma-separated W&B tags of the run")

    def __post_init__(self) -> None:
        check_settings(self)
        given = [f for f in ("wandb_entity", "wandb_run_name", "wandb_tags") if getattr(self, f) is not None]
        if given and self.wandb_project is None:
            raise ValueError(f"--{given[0].replace('_', '-')} needs --wandb-project")
        project = self.wandb_project
        if project is not None and (not project.strip() or len(project) > 128
                                    or set(project) & set(PROJECT_CHARACTERS)):
            raise ValueError(f"--wandb-project {project!r} is not a W&B project name (1 to 128 characters, none of "
                             f"{' '.join(PROJECT_CHARACTERS)})")

    @property
    def tags(self) -> list[str]:
        return [t.strip() for t in (self.wandb_tags or "").split(",") if t.strip()]


def check_available(config: WandbConfig, directory: paths.PathLike) -> None:
    """One-line ``ValueError`` before anything starts: the package is missing, ``directory``'s
    ``wandb_run_id`` holds no usable run id, or (online) no API key."""
    if config.wandb_project is None or jax.process_index() != 0:
        return
    id_file = paths.as_path(directory) / ID_FILE
    run_id = id_file.read_text().strip() if id_file.exists() else None
    if run_id is not None and (not run_id or set(run_id) & set(RUN_ID_CHARACTERS) or len(run_id.split()) > 1):
        held = f"holds {run_id!r}, not a W&B run id" if run_id else "is empty"
        raise ValueError(f"{id_file} {held}: write the id of the W&B run this directory logs to into it, or "
                         "delete it to start a new W&B run")
    try:
        import wandb
    except ImportError:
        raise ValueError("--wandb-project needs the 'wandb' package: pip install 'nash-mhc[wandb]'") from None
    if os.environ.get("WANDB_MODE", "online").lower() in OFFLINE_MODES:
        return
    try:
        wandb.login(verify=False)  # reads WANDB_API_KEY or ~/.netrc; never prompts without a terminal
    except Exception as error:  # noqa: BLE001 - wandb's UsageError and friends: no key
        raise ValueError(f"--wandb-project: no W&B API key ({str(error).strip().splitlines()[0]}); set "
                         "WANDB_API_KEY, run `wandb login`, or set WANDB_MODE=offline") from None


class WandbSink:
    """A :class:`~nash_mhc.training.logger.RunLogger` sink that logs to one W&B run."""

    def __init__(self, run: Any) -> None:
        self.run = run

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


def start(config: WandbConfig, directory: paths.PathLike, run_config: dict[str, Any]) -> WandbSink | None:
    """On process 0 with a project set: start (or resume) the directory's W&B run; else None."""
    if config.wandb_project is None or jax.process_index() != 0:
        return None
    import wandb

    directory = paths.as_path(directory)
    id_file = directory / ID_FILE
    run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
    id_file.write_text(run_id + "\n")
    local = None
    if not paths.is_remote(directory):
        local = os.fspath(directory)  # W&B makes <dir>/wandb/ below it
    run = wandb.init(project=config.wandb_project, entity=config.wandb_entity, name=config.wandb_run_name,
                     tags=config.tags or None, id=run_id, resume="allow", dir=local, config=run_config)
    return WandbSink(run)
