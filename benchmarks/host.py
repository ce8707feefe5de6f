"""The machine a benchmark runs on, in words, for the tables and results it writes."""

from __future__ import annotations

import os
import platform
import re
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


def compiling_host() -> str:
    """This host as the TPU compile tables name it: ``a shared 2-core VM (<CPU model>), CPU only``."""
    return f"a shared {os.cpu_count()}-core VM ({cpu_model()}), CPU only"


def table_host(text: str, start: str, end: str, compiled_here: bool) -> str:
    """The host a table between the ``start`` and ``end`` markers of ``text`` is to name: this one where the run
    compiled, else (a ``--table-only`` rewrite, which compiled nothing) the one its ``on ... (no TPU:`` line
    already names."""
    if compiled_here:
        return compiling_host()
    found = re.search(r"\non (.+?) \(no TPU: ", text[text.index(start):text.index(end)])
    return found.group(1) if found else "an unrecorded machine"
