"""Batches computed ahead of the training loop on one background thread."""

from __future__ import annotations

import collections
import concurrent.futures
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Prefetcher(Generic[T]):
    """``next()`` returns ``(step, fn(step))`` for step = start_step, start_step + 1, ...; up to ``buffer_size``
    later steps are computed ahead on a thread (``buffer_size=0``: synchronously, no thread). An exception of
    ``fn`` is raised by the ``next()`` that reaches its step. ``close()`` (or leaving the ``with`` block) drops
    the queued work and waits at most for the ``fn`` call in progress."""

    def __init__(self, fn: Callable[[int], T], start_step: int = 0, buffer_size: int = 2) -> None:
        if buffer_size < 0:
            raise ValueError(f"buffer_size must be >= 0, got {buffer_size}")
        self.fn, self.step, self.buffer_size = fn, start_step, buffer_size
        self.pool = concurrent.futures.ThreadPoolExecutor(1, "nash_mhc-prefetch") if buffer_size else None
        self.queue: collections.deque[concurrent.futures.Future[T]] = collections.deque()
        self.closed = False

    def next(self) -> tuple[int, T]:
        if self.closed:
            raise RuntimeError("Prefetcher is closed")
        if self.pool is None:
            value = self.fn(self.step)
        else:
            while len(self.queue) <= self.buffer_size:
                self.queue.append(self.pool.submit(self.fn, self.step + len(self.queue)))
            value = self.queue[0].result()  # a failed step stays at the head: every later next() raises again
            self.queue.popleft()
        self.step += 1
        return self.step - 1, value

    __next__ = next

    def __iter__(self) -> Prefetcher[T]:
        return self

    def close(self) -> None:
        """Cancel what has not started and wait for the call in progress; safe to call more than once."""
        self.closed = True
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
