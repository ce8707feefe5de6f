"""The pod launcher: the gcloud commands it builds for a v4-32, the code-only archive, and that its real mode
runs exactly those commands (a fake ``gcloud`` on PATH records its argv) — no Google Cloud involved."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

from nash_mhc import launch

TPU = ["--name", "nash-pod", "--zone", "us-central2-b", "--project", "my-proj"]
TRAIN = ["--model", "base", "--mesh-fsdp", "16", "--mesh-data", "1", "--batch-size", "64",
         "--checkpoint-dir", "gs://my-bucket/runs/base", "--compile-cache-dir", "gs://my-bucket/xla"]
POD = {"create": ["--accelerator-type", "v4-32", "--spot"], "deploy": [],
       "run": ["--env", "WANDB_MODE=offline", "--", *TRAIN], "logs": [], "stop": [], "delete": []}


def dry_run(capsys, command: str, *extra: str) -> tuple[list[list[str]], list[str]]:
    """(commands, comment lines) printed by ``--dry-run``."""
    assert launch.main(["--dry-run", command, *TPU, *extra]) == 0
    lines = capsys.readouterr().out.splitlines()
    notes = [line for line in lines if line.startswith("#")]
    return [shlex.split(line) for line in lines if not line.startswith("#")], notes


def flag(command: list[str], name: str) -> str:
    values = [arg.split("=", 1)[1] for arg in command if arg.startswith(f"--{name}=")]
    assert len(values) == 1, (name, command)
    return values[0]


def test_dry_run_for_a_v4_32_pod(capsys, tmp_path):
    (create,), _ = dry_run(capsys, "create", *POD["create"])
    assert create[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "create", "nash-pod"]
    assert flag(create, "accelerator-type") == "v4-32" and flag(create, "version") == "tpu-ubuntu2204-base"
    assert "--spot" in create

    archive = tmp_path / "code.tar.gz"
    (scp, install), notes = dry_run(capsys, "deploy", "--archive", str(archive))
    assert scp[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "scp"]
    assert scp[5:7] == [str(archive), "nash-pod:nash_mhc-code.tar.gz"] and flag(scp, "worker") == "all"
    assert install[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "nash-pod"]
    assert flag(install, "worker") == "all"
    script = flag(install, "command")
    assert "tar -xzf ~/nash_mhc-code.tar.gz" in script and '-e ".[tpu]"' in script
    assert "--python 3.11" in script and script.endswith("python -m nash_mhc.hardware")
    assert str(archive) in notes[0]

    (run,), _ = dry_run(capsys, "run", *POD["run"])
    assert run[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "nash-pod"]
    assert flag(run, "worker") == "all"  # one ssh: the same command on every worker
    remote = flag(run, "command")
    words = shlex.split(remote.split("nohup ", 1)[1].split(" >> ")[0])
    assert words[:5] == ["env", "PYTHONUNBUFFERED=1", "JAX_PLATFORMS=tpu", "NASH_MHC_DISTRIBUTED=1",
                         "WANDB_MODE=offline"]
    assert words[5:9] == [".venv/bin/python", "-m", "nash_mhc.train", "--no-progress"] and words[9:] == TRAIN
    assert remote.startswith("cd ~/nash_mhc && ") and ">> ~/nash_mhc/logs/train.log 2>&1 < /dev/null &" in remote

    (logs,), _ = dry_run(capsys, "logs")
    assert flag(logs, "worker") == "0" and flag(logs, "command") == "tail -n 100 -F ~/nash_mhc/logs/train.log"
    (stop,), _ = dry_run(capsys, "stop")
    assert stop[4:6] == ["stop", "nash-pod"]
    (job,), _ = dry_run(capsys, "stop", "--job-only")
    assert flag(job, "worker") == "all" and "kill -TERM" in flag(job, "command")
    (delete,), _ = dry_run(capsys, "delete")
    assert delete[4:6] == ["delete", "nash-pod"] and "--quiet" in delete
    for command in (create, scp, install, run, logs, stop, job, delete):
        assert flag(command, "zone") == "us-central2-b" and flag(command, "project") == "my-proj"


def test_deployed_archive_of_this_repository_is_code_only(capsys, tmp_path):
    archive = tmp_path / "code.tar.gz"
    dry_run(capsys, "deploy", "--archive", str(archive))
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    assert "pyproject.toml" in names and "nash_mhc/train.py" in names and "docs/tpu.md" in names
    assert {name.split("/")[0] for name in names} <= set(launch.ARCHIVE_INCLUDE)
    assert not [n for n in names if n.startswith("tests/") or "__pycache__" in n or n.endswith(".ckpt")]


def test_archive_excludes_data_checkpoints_runs_and_environments(tmp_path):
    files = ["pyproject.toml", "README.md", "nash_mhc/__init__.py", "nash_mhc/data/windows.py", "docs/tpu.md",
             "examples/quickstart.py",
             # never shipped:
             "data/corpus.txt", "runs/r1/metrics.jsonl", "checkpoints/1/state", "nash_mhc/runs/x.json",
             ".venv/bin/python", "nash_mhc/__pycache__/x.pyc", "model.ckpt", "nash_mhc/weights.safetensors",
             "examples/out/events.out.tfevents.1.host", "tests/test_x.py", "notes.txt"]
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    (tmp_path / "docs" / "big.txt").write_bytes(b"0" * (launch.ARCHIVE_MAX_FILE_BYTES + 1))
    members = launch.build_archive(tmp_path / "out.tar.gz", root=tmp_path)
    assert members == sorted(["README.md", "docs/tpu.md", "examples/quickstart.py", "nash_mhc/__init__.py",
                              "nash_mhc/data/windows.py", "pyproject.toml"])
    with tarfile.open(tmp_path / "out.tar.gz") as tar:
        assert sorted(tar.getnames()) == members

    (tmp_path / "pyproject.toml").unlink()
    with pytest.raises(launch.LaunchError, match="does not look like the nash_mhc project"):
        launch.archive_members(tmp_path)


def fake_gcloud(directory: Path, log: Path, exit_code: int = 0) -> None:
    script = directory / "gcloud"
    script.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import json, sys
        with open({str(log)!r}, "a") as f:
            f.write(json.dumps(sys.argv[1:]) + "\\n")
        sys.exit({exit_code})
        """))
    script.chmod(0o755)


def test_real_mode_calls_gcloud_with_the_dry_run_commands(capsys, tmp_path, monkeypatch):
    bin_dir, log = tmp_path / "bin", tmp_path / "gcloud.jsonl"
    bin_dir.mkdir()
    fake_gcloud(bin_dir, log)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    archive = str(tmp_path / "code.tar.gz")
    expected = []
    for command, extra in POD.items():
        extra = [*extra, "--archive", archive] if command == "deploy" else extra
        commands, _ = dry_run(capsys, command, *extra)
        expected += [c[1:] for c in commands]
        assert launch.main([command, *TPU, *extra]) == 0
        assert capsys.readouterr().out == ""  # real mode narrates on stderr only
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls == expected and len(calls) == 7


@pytest.mark.slow  # out of the quick loop (its 5-minute budget): no invariant, the full run keeps it
def test_gcloud_failure_and_missing_gcloud_are_one_line_errors(capsys, tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_gcloud(bin_dir, tmp_path / "log", exit_code=3)
    monkeypatch.setenv("PATH", str(bin_dir))
    assert launch.main(["delete", *TPU]) == 3
    assert capsys.readouterr().err.splitlines()[-1].startswith("error: gcloud exited with 3")

    empty = tmp_path / "empty"
    empty.mkdir()
    result = subprocess.run([sys.executable, "-m", "nash_mhc.launch", "create", *TPU, "--accelerator-type", "v4-32"],
                            env={**os.environ, "PATH": str(empty)}, capture_output=True, text=True)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("error: gcloud not found on PATH") and result.stderr.count("\n") == 1


def test_run_refuses_local_checkpoints_and_bad_env(capsys):
    assert launch.main(["--dry-run", "run", *TPU, "--", "--model", "base"]) == 2
    assert "--checkpoint-dir gs://BUCKET/RUN" in capsys.readouterr().err
    assert launch.main(["--dry-run", "run", *TPU, "--allow-local-checkpoints", "--", "--model", "base"]) == 0
    assert launch.main(["--dry-run", "run", *TPU, "--env", "NOVALUE", "--", *TRAIN]) == 2
    assert "expected KEY=VALUE" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ create --check-fit
def test_check_fit_runs_compile_only_for_the_accelerator_type_before_create(capsys):
    train = ["--model", "1b", "--mesh-fsdp", "8", "--mesh-data", "1", "--batch-size", "64"]
    (check, create), _ = dry_run(capsys, "create", "--accelerator-type", "v5litepod-8", "--check-fit", "--", *train)
    assert check[1:] == ["-m", "nash_mhc.train", *train, "--compile-only", "--topology", "v5litepod-8"]
    assert create[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "create"]
    assert launch.main(["--dry-run", "create", *TPU, "--accelerator-type", "v6e-8", "--", *train]) == 2
    assert "are for --check-fit" in capsys.readouterr().err


@pytest.mark.slow  # a real TPU compile that fails fast (about 10 s)
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu")
def test_check_fit_that_does_not_fit_creates_nothing(capsys, tmp_path, monkeypatch):
    bin_dir, log = tmp_path / "bin", tmp_path / "gcloud.jsonl"
    bin_dir.mkdir()
    fake_gcloud(bin_dir, log)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    too_big = ["--model", "tiny", "--mesh-data", "1", "--mesh-fsdp", "4", "--batch-size", str(4 * 65536)]
    assert launch.main(["create", *TPU, "--accelerator-type", "v5litepod-4", "--check-fit", "--", *too_big]) == 4
    assert capsys.readouterr().err.splitlines()[-1] == "error: the train step does not fit: nothing created"
    assert not log.exists()  # gcloud never ran
