"""docs/tpu.md and docs/gpu.md stay true: every command in their ```bash blocks that can run here does.

- blocks preceded by ``<!-- runs-here -->`` (the CPU versions of the seed training commands) are run as
  written, in parallel, from a temporary directory;
- ``python -m nash_mhc.launch ... --dry-run`` and ``python -m nash_mhc.hardware`` lines are run as written
  (through bash, with the docs' own ``export`` line for the variables);
- every other ``python -m nash_mhc.train`` line is parsed by the real argument parser and config builder
  (and its batch checked against its mesh), every other launcher line is run with ``--dry-run``;
- every pip extra the docs name exists in pyproject.toml; the README links both pages.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import pytest
from helpers import ROOT, suite_xla_flags

from nash_mhc import launch, train

DOCS = [ROOT / "docs" / "tpu.md", ROOT / "docs" / "gpu.md"]
MARKER = "<!-- runs-here -->"


def bash_blocks(path: Path) -> list[tuple[bool, list[str]]]:
    """(marked runs-here, commands) of every ```bash block; continuation lines joined, comments dropped."""
    blocks, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```bash":
            previous = next((line.strip() for line in reversed(lines[:i]) if line.strip()), "")
            body = []
            i += 1
            while lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            commands, current = [], ""
            for line in body:
                current += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
                if not line.endswith("\\"):
                    if current.strip() and not current.strip().startswith("#"):
                        commands.append(current.strip())
                    current = ""
            blocks.append((previous == MARKER, commands))
        i += 1
    return blocks


ALL = [(doc.name, marked, command) for doc in DOCS for marked, commands in bash_blocks(doc) for command in commands]
EXPORTS = [command for _, _, command in ALL if command.startswith("export ")]


def exported() -> dict[str, str]:
    env = {}
    for line in EXPORTS:
        for word in shlex.split(line)[1:]:
            key, _, value = word.partition("=")
            env[key] = value
    return env


def program_words(command: str) -> tuple[dict[str, str], list[str]] | None:
    """(leading VAR=value assignments, remaining words) with the docs' variables expanded; None when the
    line is not a plain command (shell syntax, quotes spanning several commands)."""
    variables = exported()
    try:
        words = shlex.split(command)
    except ValueError:
        return None
    words = [re.sub(r"\$\{?(\w+)\}?", lambda m: variables.get(m.group(1), m.group(0)), w) for w in words]
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    if any(w in ("|", "||", "&&", ";", ">", "<") for w in words):
        return None
    return env, words


def commands_of(module: str, *, marked: bool | None = None) -> list[tuple[str, dict[str, str], list[str]]]:
    out = []
    for _, is_marked, command in ALL:
        parsed = program_words(command)
        if parsed and parsed[1][:3] == ["python", "-m", module] and (marked is None or is_marked == marked):
            out.append((command, *parsed))
    return out


def shell(command: str, cwd: Path, **env: str) -> subprocess.Popen:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "TPU_")) and k != "XLA_FLAGS"}
    clean["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{clean.get('PATH', '')}"  # `python` = this one
    clean["TMPDIR"] = str(cwd)  # deploy --dry-run writes its code archive there
    clean["XLA_FLAGS"] = suite_xla_flags()  # short runs: the suite's level (a command's own export wins)
    script = "\n".join([*EXPORTS, command])
    return subprocess.Popen(["bash", "-c", script], cwd=cwd, env={**clean, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_docs_exist_and_readme_links_them():
    readme = (ROOT / "README.md").read_text()
    assert "(docs/tpu.md)" in readme and "(docs/gpu.md)" in readme
    second_fence_end = readme.index("```", readme.index("```bash", readme.index("```bash") + 1) + 7)
    assert readme.index("## Running on TPU / GPU") > second_fence_end  # CI reads the first two bash blocks
    assert len(commands_of("nash_mhc.train", marked=True)) == 2
    assert len(commands_of("nash_mhc.launch")) >= 10 and commands_of("nash_mhc.hardware")


def test_every_pip_extra_named_in_the_docs_exists():
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = {extra for doc in [*DOCS, ROOT / "README.md"]
             for group in re.findall(r'"\.\[([\w,]+)\]"', doc.read_text()) for extra in group.split(",")}
    assert {"tpu", "cuda", "gcs"} <= named and named <= extras, named - extras


@pytest.mark.parametrize("command", [c for c, _, _ in commands_of("nash_mhc.train")], ids=lambda c: c[-60:])
def test_training_commands_in_the_docs_parse(command):
    _, words = program_words(command)
    configs, _ = train.configs(words[3:])
    if configs.mesh.data > 0 and configs.mesh.fsdp > 0:
        assert configs.train.microbatch_size % (configs.mesh.data * configs.mesh.fsdp) == 0, command


@pytest.mark.slow  # multi-second, not an invariant: the full run (CI) keeps it
def test_launcher_commands_in_the_docs_run(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # deploy writes its code archive there
    dry = []
    for command, _, words in commands_of("nash_mhc.launch"):
        args = words[3:]
        if "--dry-run" in args:
            dry.append(command)
        else:  # the real commands: the same, printed instead of run
            assert launch.main(["--dry-run", *args]) == 0, command
            printed = capsys.readouterr().out
            assert printed.splitlines()[-1].startswith("gcloud compute tpus tpu-vm "), command
            if args[0] == "run":  # the training flags after -- are valid too
                train.configs(args[args.index("--") + 1:])
    processes = [(command, shell(command, tmp_path)) for command in dry]
    for command, process in processes:
        output = process.communicate(timeout=120)[0]
        assert process.returncode == 0, f"{command}\n{output}"
        assert "gcloud compute tpus tpu-vm" in output


@pytest.mark.slow  # subprocesses that start JAX: seconds, and no invariant of the model
def test_hardware_command_runs(tmp_path):
    for command, _, _ in commands_of("nash_mhc.hardware"):
        process = shell(command, tmp_path, JAX_PLATFORMS="cpu")
        output = process.communicate(timeout=120)[0]
        assert process.returncode == 0 and output.startswith("devices: "), output


@pytest.mark.slow
def test_cpu_training_commands_run(tmp_path, cache_dir):
    """The runs-here block as written, both commands at once, with two flags added: no progress bar, and the
    test run's compile cache instead of the user's ~/.cache/nash_mhc/xla."""
    cache = shlex.quote(str(cache_dir))
    runs = [(command, words, shell(f"{command} --no-progress --compile-cache-dir {cache}", tmp_path))
            for command, _, words in commands_of("nash_mhc.train", marked=True)]
    for command, words, process in runs:
        output = process.communicate(timeout=300)[0]
        assert process.returncode == 0, f"{command}\n{output[-3000:]}"
        directory = tmp_path / words[words.index("--checkpoint-dir") + 1]
        records = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
        assert records[-1]["step"] == 2 and (directory / "2").is_dir() and (directory / "config.json").is_file()
        assert "layout: process 0 of 1" in output
        if "--mesh-tp" in words:
            assert "devices: 8 x cpu (cpu)" in output and "mesh data=2 fsdp=2 tp=2" in output


def test_the_readme_test_block_is_ci_s_commands_line_for_line():
    """CI runs .ci/run's own commands; the README quotes them (CI no longer extracts them from the README)."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    quoted = [line for line in blocks[1].splitlines() if line.strip()]
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith(("#", "set ", "cd ", "step", "NASH_MHC", "export ", "trap "))]
    assert quoted == ci and len(ci) == 4, (quoted, ci)
    # the two parts make the whole suite
    assert ci[2].endswith('-m "not slow and not kernels"') and ci[3].endswith('-m "slow or kernels"')


def repository_files() -> list[Path]:
    """The repository's files outside .git: tracked and untracked-but-not-ignored (git), else every file under
    folders that are not hidden or caches."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                                capture_output=True, check=True).stdout.decode().split("\0")
        return [ROOT / name for name in listed if name and (ROOT / name).is_file()]
    except (OSError, subprocess.CalledProcessError):
        return [p for p in ROOT.rglob("*") if p.is_file() and not any(
            part.startswith(".") or part == "__pycache__" for part in p.relative_to(ROOT).parts[:-1])]


DESIGN_PAGE = ROOT / "docs/design.md"
DESIGN_REFERENCE = re.compile(r"[\w./-]*design\.md", re.IGNORECASE)


def design_references(path: Path) -> list[str]:
    """The references to a design page in ``path`` that do not lead to docs/design.md (as a path from the
    repository root or from the file's folder, spelled exactly)."""
    text = path.read_bytes().decode("utf-8", errors="ignore")
    return [ref for ref in DESIGN_REFERENCE.findall(text)
            if DESIGN_PAGE not in {(ROOT / ref).resolve(), (path.parent / ref).resolve()}
            or ref.rsplit("/", 1)[-1] != DESIGN_PAGE.name]


def test_design_references_lead_to_docs_design_md(tmp_path):
    assert DESIGN_PAGE.is_file()
    stray = {str(p.relative_to(ROOT)): refs for p in repository_files() if (refs := design_references(p))}
    assert not stray, f"references to a design page other than docs/design.md: {stray}"
    wrong = tmp_path / "wrong.md"  # the check itself: the old page's name, a wrong folder, a relative link
    wrong.write_text("see " + "DESIGN" + ".md §1, docs/Design" + ".md, notes/design" + ".md")
    assert len(design_references(wrong)) == 3
    assert not design_references(ROOT / "docs" / "testing.md")
