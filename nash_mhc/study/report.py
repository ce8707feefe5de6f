"""What a study writes: results.json, a markdown report headed by the command, machine, code commit and wall
time."""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
from pathlib import Path
from typing import Any


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--report-dir", help="where results.json, the markdown report and the figures go (default: "
                   "--out-dir; e.g. docs/results/<study> to publish them without the runs)")
    p.add_argument("--note", default="", help="a line under the report's title (e.g. 'shared 2-core VM')")
    p.add_argument("--no-progress", action="store_true", help="no progress bar over the runs")


def report_dir(args: argparse.Namespace) -> Path:
    """The directory the report files go to (created)."""
    directory = Path(args.report_dir or args.out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def machine(devices: str | None = None) -> dict[str, Any]:
    """Where the study ran: OS, Python, CPU cores, the code's commit and (when known) the training program's
    device line."""
    return {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "devices": devices, "commit": code_commit()}


def code_commit() -> str:
    """The git commit of the nash_mhc package that runs (short hash), naming its files that differ from it;
    "unknown (not a git checkout)" for an installed package."""
    package = Path(__file__).resolve().parents[1]

    def git(*argv: str) -> str:
        return subprocess.run(["git", *argv], cwd=package, capture_output=True, text=True, check=True).stdout
    try:
        commit = git("rev-parse", "--short", "HEAD").strip()
        changed = git("status", "--porcelain", "--", ".").splitlines()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    files = sorted(line[3:] for line in changed)
    return f"{commit} with uncommitted changes to {', '.join(files)}" if files else commit


def device_line(logs: list[Path]) -> str | None:
    """The ``devices: ...`` start-up line of the first training log that has one."""
    for log in logs:
        if log.exists():
            for line in log.read_text().splitlines():
                if line.startswith("devices: "):
                    return line.removeprefix("devices: ")
    return None


def header(title: str, args: argparse.Namespace, info: dict[str, Any], wall_s: float, finished: int,
           total: int) -> list[str]:
    """The report's first lines: title, command, note, machine, commit and the runs' summed wall time."""
    rerun = "" if finished == total else "; rerun the command to continue"
    wall_line = f"Wall time: {duration(wall_s)} summed over the runs ({finished} of {total} finished{rerun})."
    lines = [f"# {title}", "", "Produced by:", "", "```bash", args.command_line, "```", ""]
    if args.note:
        lines += [args.note, ""]
    devices = f", devices: {info['devices']}" if info.get("devices") else ""
    lines += [f"Machine: {info['platform']}, Python {info['python']}, {info['cpu_count']} CPU cores{devices}.",
              f"Code: commit {info.get('commit') or code_commit()}.", wall_line, ""]
    return lines


def markdown_table(headers: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|",
            *("| " + " | ".join(row) + " |" for row in rows)]


def millions(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 1e6:.2f}M"


def duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"
