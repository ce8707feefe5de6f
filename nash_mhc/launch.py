"""``python -m nash_mhc.launch``: create a Cloud TPU VM (one host or a pod slice), ship the code, train on it.

Every subcommand builds ``gcloud compute tpus tpu-vm ...`` commands and runs them (``--dry-run`` prints
them instead, one shell-quoted command per line, and needs no gcloud):

    create   gcloud ... create NAME --accelerator-type=v4-32 --version=tpu-ubuntu2204-base [--spot]; with
             ``--check-fit -- <training flags>`` it first runs ``python -m nash_mhc.train <training flags>
             --compile-only --topology <accelerator type>`` here (libtpu, no TPU needed) and creates nothing
             unless the train step fits the slice's memory (exit 4 when it does not)
    deploy   build a code-only archive (nash_mhc/, pyproject.toml, README.md, docs/, examples/ — never data,
             checkpoints, runs/ or a virtual environment), scp it to every worker, and on every worker unpack
             it into ~/nash_mhc and install it (uv venv with Python 3.11 + ``pip install -e ".[tpu]"``)
    run      start the same ``python -m nash_mhc.train ...`` on every worker (--worker=all), in the
             background under nohup, with the environment set; output in ~/nash_mhc/logs/train.log
    logs     follow worker 0's log (the one that prints; the others log nothing by design)
    stop     stop the TPU VM (or, with --job-only, send SIGTERM to the training processes: they finish the
             step, save a checkpoint and exit 0)
    delete   delete the TPU VM (checkpoints in the bucket stay)

Every worker runs the same command with NASH_MHC_DISTRIBUTED=1, so each calls ``jax.distributed.initialize()``
and the TPU runtime's auto-detection connects them. Checkpoints must go to a bucket
(``--checkpoint-dir gs://...``) that every worker can reach and that outlives a preempted VM.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from nash_mhc.cli import OneLineParser, fail

ROOT = Path(__file__).resolve().parents[1]
REMOTE_DIR = "nash_mhc"  # on each worker, relative to the home directory
REMOTE_ARCHIVE = "nash_mhc-code.tar.gz"
REMOTE_LOG = f"{REMOTE_DIR}/logs/train.log"
REMOTE_PID = f"{REMOTE_DIR}/logs/train.pid"
EXIT_DOES_NOT_FIT = 4  # python -m nash_mhc.train --compile-only: the step does not fit the slice

# The archive holds these top-level entries (when present) and nothing else ...
ARCHIVE_INCLUDE = ("nash_mhc", "pyproject.toml", "README.md", "LICENSE", "docs", "examples")
# ... minus anything below whose path has one of these parts, or whose name matches one of these patterns.
ARCHIVE_EXCLUDE_PARTS = ("runs", "checkpoints", "checkpoint", ".venv", "venv", "__pycache__", ".git",
                         "wandb", ".pytest_cache", ".ruff_cache", "logs")
ARCHIVE_EXCLUDE_NAMES = ("*.ckpt", "*.pt", "*.pth", "*.npy", "*.npz", "*.safetensors", "*.msgpack", "*.bin",
                         "*.arrow", "*.parquet", "*.tar", "*.tar.gz", "*.tgz", "*.zip", "events.out.tfevents*",
                         "*.orbax-checkpoint-tmp*", "*.pyc", "*.egg-info", "*.so")
ARCHIVE_MAX_FILE_BYTES = 5 * 2**20  # code and docs are small; anything bigger is data that slipped in

# JAX_PLATFORMS=tpu fails loudly instead of a CPU fallback; NASH_MHC_DISTRIBUTED=1 makes every worker call
# jax.distributed.initialize() (cluster auto-detection), which multi-host slices need.
DEFAULT_ENV = {"PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "tpu", "NASH_MHC_DISTRIBUTED": "1"}



def setup_script(extra: str, python: str | None) -> str:
    """The one-line shell script ``deploy`` runs on every worker: unpack the code, install it, check devices.

    Without ``python``, uv creates the venv with Python 3.11 (TPU images ship an older Python 3.10)."""
    if python:
        install = (f"{shlex.quote(python)} -m venv .venv; .venv/bin/pip install -q -U pip; "
                   f'.venv/bin/pip install -q -e ".[{extra}]"')
    else:
        install = ("python3 -m pip install -q --user uv || "
                   "python3 -m pip install -q --user --break-system-packages uv; "
                   "~/.local/bin/uv venv -q --seed --allow-existing --python 3.11 .venv; "
                   f'~/.local/bin/uv pip install -q --python .venv/bin/python -e ".[{extra}]"')
    return (f"set -e; mkdir -p ~/{REMOTE_DIR}/logs; cd ~/{REMOTE_DIR}; rm -rf nash_mhc docs examples; "
            f"tar -xzf ~/{REMOTE_ARCHIVE}; {install}; JAX_PLATFORMS=tpu .venv/bin/python -m nash_mhc.hardware")



class LaunchError(Exception):
    """A user-facing problem: one line on stderr, exit code 2."""


# ------------------------------------------------------------------------------------------------ archive
def _candidates(root: Path) -> list[str]:
    """Files under ``root`` as relative POSIX paths: git's tracked + untracked-not-ignored files when ``root``
    is a git work tree, otherwise every file."""
    if (root / ".git").exists() and shutil.which("git"):
        result = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                cwd=root, capture_output=True, text=True)
        if result.returncode == 0:
            return sorted({name for name in result.stdout.split("\0") if name and (root / name).is_file()})
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def archive_members(root: Path = ROOT) -> list[str]:
    """The relative paths that ``deploy`` ships: code, packaging and docs only (see ARCHIVE_*)."""
    members = []
    for name in _candidates(root):
        parts = name.split("/")
        if parts[0] not in ARCHIVE_INCLUDE or any(p in ARCHIVE_EXCLUDE_PARTS for p in parts[:-1]):
            continue
        if any(fnmatch.fnmatch(part, pattern) for part in parts for pattern in ARCHIVE_EXCLUDE_NAMES):
            continue
        if (root / name).stat().st_size > ARCHIVE_MAX_FILE_BYTES:
            continue
        members.append(name)
    if "pyproject.toml" not in members or not any(m.startswith("nash_mhc/") for m in members):
        raise LaunchError(f"{root} does not look like the nash_mhc project (no pyproject.toml or nash_mhc/)")
    return members


def build_archive(destination: Path, root: Path = ROOT) -> list[str]:
    """Write the code-only ``.tar.gz`` to ``destination``; returns its member names."""
    members = archive_members(root)
    with tarfile.open(destination, "w:gz") as archive:
        for name in members:
            archive.add(root / name, arcname=name, recursive=False)
    return members


# ----------------------------------------------------------------------------------------------- commands
def _tpu(args: argparse.Namespace, verb: str, *extra: str) -> list[str]:
    command = ["gcloud", "compute", "tpus", "tpu-vm", verb]
    if verb != "scp":
        command.append(args.name)
    command += list(extra) + [f"--zone={args.zone}"]
    if args.project:
        command.append(f"--project={args.project}")
    return command


def check_fit_command(accelerator_type: str, train_args: Sequence[str]) -> list[str]:
    """The local compile-only run of the training flags for the slice (exit 0 fits, 4 does not, 2 bad flags)."""
    return [sys.executable, "-m", "nash_mhc.train", *train_args, "--compile-only", "--topology", accelerator_type]


def create_commands(args: argparse.Namespace) -> list[list[str]]:
    extra = [f"--accelerator-type={args.accelerator_type}", f"--version={args.version}"]
    if args.spot:
        extra.append("--spot")
    if args.network:
        extra.append(f"--network={args.network}")
    train_args = list(args.train_args)
    if train_args[:1] == ["--"]:
        train_args = train_args[1:]
    if train_args and not args.check_fit:
        raise LaunchError("training flags after -- are for --check-fit (give it, or drop the flags)")
    check = [check_fit_command(args.accelerator_type, train_args)] if args.check_fit else []
    return [*check, _tpu(args, "create", *extra)]


def deploy_commands(args: argparse.Namespace, archive: str) -> list[list[str]]:
    script = setup_script(args.extra, args.python)
    return [_tpu(args, "scp", archive, f"{args.name}:{REMOTE_ARCHIVE}", "--worker=all"),
            _tpu(args, "ssh", "--worker=all", f"--command={script}")]


def train_command(train_args: Sequence[str], env: dict[str, str]) -> str:
    """The shell line every worker runs: the training program in the background, logging to REMOTE_LOG."""
    assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    program = shlex.join([".venv/bin/python", "-m", "nash_mhc.train", "--no-progress", *train_args])
    return (f"cd ~/{REMOTE_DIR} && mkdir -p logs && "
            f"nohup env {assignments} {program} >> ~/{REMOTE_LOG} 2>&1 < /dev/null & "
            f"echo $! > ~/{REMOTE_PID}")


def _checkpoint_dir(train_args: Sequence[str]) -> str | None:
    value = None
    for i, arg in enumerate(train_args):
        if arg == "--checkpoint-dir" and i + 1 < len(train_args):
            value = train_args[i + 1]
        elif arg.startswith("--checkpoint-dir="):
            value = arg.split("=", 1)[1]
    return value


def check_train_flags(train_args: Sequence[str]) -> None:
    """Parse and check the training flags here, as every worker will, so a typo or a bad value is a one-line error
    before any pod job starts (LaunchError). Checks that need the workers' devices or data happen there."""
    from nash_mhc import train as train_module  # imports JAX: only for ``run``

    def refuse(message: str) -> NoReturn:
        raise LaunchError(f"the training flags: {message}")

    parser = train_module.build_parser()
    parser.error = refuse  # argparse's errors (unknown flag, bad value) as a LaunchError, not an exit
    try:
        train_module.configs(list(train_args), parser)
    except ValueError as error:
        refuse(str(error).splitlines()[0])


def run_commands(args: argparse.Namespace) -> list[list[str]]:
    train_args = list(args.train_args)
    if train_args[:1] == ["--"]:
        train_args = train_args[1:]
    check_train_flags(train_args)
    checkpoint_dir = _checkpoint_dir(train_args)
    if not args.allow_local_checkpoints and not (checkpoint_dir or "").startswith("gs://"):
        raise LaunchError("give the training program --checkpoint-dir gs://BUCKET/RUN: every worker writes its "
                          "part of each checkpoint there and it must outlive a preempted VM "
                          "(--allow-local-checkpoints to override)")
    env = dict(DEFAULT_ENV)
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise LaunchError(f"--env {item!r}: expected KEY=VALUE")
        env[key] = value
    return [_tpu(args, "ssh", "--worker=all", f"--command={train_command(train_args, env)}")]


def logs_commands(args: argparse.Namespace) -> list[list[str]]:
    tail = ["tail", "-n", str(args.lines), *(["-F"] if args.follow else []), f"~/{REMOTE_LOG}"]
    return [_tpu(args, "ssh", f"--worker={args.worker}", f"--command={' '.join(tail)}")]


def stop_commands(args: argparse.Namespace) -> list[list[str]]:
    if args.job_only:
        return [_tpu(args, "ssh", "--worker=all",
                     f"--command=test -f ~/{REMOTE_PID} && kill -TERM $(cat ~/{REMOTE_PID}) || true")]
    return [_tpu(args, "stop")]


def delete_commands(args: argparse.Namespace) -> list[list[str]]:
    return [_tpu(args, "delete", "--quiet")]


# ------------------------------------------------------------------------------------------------- driver
def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m nash_mhc.launch", description=__doc__.splitlines()[0],
                      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="print the commands (one per line) instead of running")
    common = OneLineParser(add_help=False)
    common.add_argument("--name", required=True, help="TPU VM name")
    common.add_argument("--zone", required=True, help="zone of the TPU (and, ideally, of the bucket's region)")
    common.add_argument("--project", help="Google Cloud project (default: gcloud's configured project)")
    common.add_argument("--dry-run", action="store_true", default=argparse.SUPPRESS,
                        help="print the commands instead of running them")
    sub = p.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    s = sub.add_parser("create", parents=[common], help="create a TPU VM or pod slice")
    s.add_argument("--accelerator-type", required=True, help="e.g. v5litepod-8, v6e-8, v4-32")
    s.add_argument("--version", default="tpu-ubuntu2204-base", help="TPU software (runtime) version")
    s.add_argument("--spot", action="store_true", help="spot capacity: cheaper, may be preempted at any time")
    s.add_argument("--network", help="VPC network (default: the project's default network)")
    s.add_argument("--check-fit", action="store_true",
                   help="first compile the train step of the flags after -- for this accelerator type here "
                        "(python -m nash_mhc.train ... --compile-only; needs libtpu) and create nothing unless "
                        "it fits (exit 4 when it does not)")
    s.add_argument("train_args", nargs=argparse.REMAINDER, help="with --check-fit: -- then the flags of "
                   "python -m nash_mhc.train")

    s = sub.add_parser("deploy", parents=[common], help="ship the code to every worker and install it")
    s.add_argument("--extra", default="tpu", help="pip extra to install (tpu, or tpu,data)")
    s.add_argument("--python", help="an existing Python >= 3.11 on the workers for the venv (default: uv "
                   "installs Python 3.11)")
    s.add_argument("--archive", help="where to write the code archive locally (default: a temporary file)")

    s = sub.add_parser("run", parents=[common], help="start training on every worker; flags after -- go to "
                       "python -m nash_mhc.train")
    s.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help=f"environment for the training processes, on top of {DEFAULT_ENV}")
    s.add_argument("--allow-local-checkpoints", action="store_true",
                   help="allow a --checkpoint-dir that is not a gs:// bucket")
    s.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then the flags of python -m nash_mhc.train")

    s = sub.add_parser("logs", parents=[common], help="show the training log of one worker (default 0)")
    s.add_argument("--worker", default="0", help="worker index")
    s.add_argument("--lines", type=int, default=100, help="lines of history to show")
    s.add_argument("--no-follow", dest="follow", action="store_false", help="print and exit instead of tail -F")

    s = sub.add_parser("stop", parents=[common], help="stop the TPU VM (or only the training job)")
    s.add_argument("--job-only", action="store_true", help="SIGTERM the training processes: they save and exit")

    sub.add_parser("delete", parents=[common], help="delete the TPU VM")
    return p


def plan(args: argparse.Namespace) -> tuple[list[list[str]], list[str]]:
    """(gcloud commands, comment lines) of one invocation; ``deploy`` writes the archive here."""
    if args.command == "deploy":
        if args.archive:
            archive = Path(args.archive)
        else:
            archive = Path(tempfile.mkdtemp(prefix="nash_mhc-deploy-")) / REMOTE_ARCHIVE
        members = build_archive(archive)
        size = archive.stat().st_size
        notes = [f"# code archive {archive}: {len(members)} files, {size / 1024:.0f} KiB "
                 f"(top level: {', '.join(sorted({m.split('/')[0] for m in members}))})"]
        return deploy_commands(args, str(archive)), notes
    builders = {"create": create_commands, "run": run_commands, "logs": logs_commands, "stop": stop_commands,
                "delete": delete_commands}
    return builders[args.command](args), []


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if not args.dry_run and shutil.which("gcloud") is None:
            raise LaunchError("gcloud not found on PATH: install the Google Cloud CLI "
                              "(https://cloud.google.com/sdk/docs/install), run `gcloud auth login`, or use --dry-run")
        commands, notes = plan(args)
    except LaunchError as error:
        return fail(error)
    if args.dry_run:
        for line in notes:
            print(line)
        for command in commands:
            print(shlex.join(command))
        return 0
    for line in notes:
        print(line, file=sys.stderr)
    for command in commands:
        print(f"+ {shlex.join(command)}", file=sys.stderr, flush=True)
        code = subprocess.run(command).returncode
        if code:
            what = "the train step does not fit: nothing created" if code == EXIT_DOES_NOT_FIT else \
                f"{Path(command[0]).name} exited with {code}: {shlex.join(command[:5])} ..."
            print(f"error: {what}", file=sys.stderr)
            return code
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
