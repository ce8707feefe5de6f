"""The machine a benchmark runs on, in words, for the tables and results it writes."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows of it."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine() -> str:
    """The cores and CPU model, e.g. ``2 cores, Intel(R) Xeon(R) Processor``."""
    return f"{os.cpu_count()} cores, {cpu_model()}"
