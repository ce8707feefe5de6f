"""One training run per checkpoint directory: an exclusive ``flock`` on ``<dir>/.lock``.

The lock file holds the holder's ``host pid``, so a refused run names who holds the directory. The kernel
drops a ``flock`` when its process dies, so a lock file left behind by a killed run is taken over at once;
its recorded holder is named in a warning. Released cleanly, the file is removed (nothing left behind).
Bucket directories (``gs://``) cannot be locked this way and are not locked.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import sys
import time

from nash_mhc import paths

LOCK_NAME = ".lock"


class DirectoryInUse(ValueError):
    """Another live process holds the directory's lock (a one-line message for the CLI)."""


class RunLock:
    """Hold ``<directory>/.lock`` until :meth:`release`; raises :class:`DirectoryInUse` if another process holds
    it. ``directory`` must exist (the caller creates it only once its inputs are checked)."""

    def __init__(self, directory: paths.PathLike) -> None:
        self.path = None
        self._fd: int | None = None
        if paths.is_remote(directory):
            return
        path = os.path.join(os.fspath(paths.as_path(directory)), LOCK_NAME)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise DirectoryInUse(f"{os.path.dirname(path)} is in use by another training run ({holder}); "
                                     "wait for it to finish or use another --checkpoint-dir") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:  # not a file its previous holder unlinked while we waited for it
                break
            os.close(fd)
        previous = _read(fd)
        if previous:
            print(f"warning: taking over the stale lock of {os.path.dirname(path)} left by {previous} (that "
                  "process is no longer running)", file=sys.stderr)
        record = f"host {socket.gethostname()} pid {os.getpid()}\n".encode()
        os.pwrite(fd, record, 0)  # then cut any longer stale record: the file is never seen empty once named
        os.ftruncate(fd, len(record))
        self.path, self._fd = path, fd

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent)."""
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


def _read(fd: int) -> str:
    """The first line of the lock file ('' while it is empty)."""
    return os.pread(fd, 200, 0).decode(errors="replace").strip().split("\n")[0].strip()


def _holder(fd: int, wait_s: float = 2.0) -> str:
    """The holder named in the lock file. A holder writes its name just after it takes the lock, so a run refused
    in between waits for it (up to ``wait_s``) instead of naming nobody."""
    deadline = time.monotonic() + wait_s
    while not (holder := _read(fd)) and time.monotonic() < deadline:
        time.sleep(0.01)
    return holder or "its holder has not named itself yet"
