"""A background thread that computes per-step values (batches) ahead of the training loop."""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Generic, TypeVar

__all__ = ["Prefetcher"]

T = TypeVar("T")

_POLL_S = 0.05


class _Failure:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _produce(fn: Callable[[int], object], out: queue.Queue, stop: threading.Event, step: int) -> None:
    # A plain function, not a method: the thread must not keep the Prefetcher alive (its finalizer stops it).
    while not stop.is_set():
        try:
            item: object = fn(step)
        except BaseException as error:  # noqa: BLE001 - handed to the consumer
            item = _Failure(error)
        while not stop.is_set():
            try:
                out.put((step, item), timeout=_POLL_S)
                break
            except queue.Full:
                continue
        if isinstance(item, _Failure):
            return
        step += 1


class Prefetcher(Generic[T]):
    """Computes ``fn(step)`` for step = start_step, start_step + 1, ... on a daemon thread.

    At most ``buffer_size`` results wait in the queue; ``next()`` returns ``(step, value)`` in step order. An
    exception raised by ``fn`` is re-raised by ``next()`` (and by every later call). ``close()`` stops the thread
    promptly (it finishes at most the ``fn`` call in progress); the object is also a context manager and an
    iterator. ``buffer_size=0`` runs ``fn`` synchronously inside ``next()``, with no thread.
    """

    def __init__(self, fn: Callable[[int], T], start_step: int = 0, buffer_size: int = 2) -> None:
        self._stop = threading.Event()
        # Dropping the Prefetcher without close() still stops the thread (which holds no reference to it).
        weakref.finalize(self, self._stop.set)
        if buffer_size < 0:
            raise ValueError(f"buffer_size must be >= 0, got {buffer_size}")
        self._fn = fn
        self._next_step = start_step
        self.buffer_size = buffer_size
        self._closed = False
        self._failure: BaseException | None = None
        self._queue: queue.Queue[tuple[int, object]] | None = None
        self._thread: threading.Thread | None = None
        if buffer_size > 0:
            self._queue = queue.Queue(maxsize=buffer_size)
            self._thread = threading.Thread(
                target=_produce, args=(fn, self._queue, self._stop, start_step), name="nash_mhc-prefetch", daemon=True
            )
            self._thread.start()

    def next(self) -> tuple[int, T]:
        """The next ``(step, fn(step))``."""
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise RuntimeError("Prefetcher is closed")
        if self._queue is None:
            step = self._next_step
            try:
                value = self._fn(step)
            except BaseException as error:
                self._failure = error
                raise
            self._next_step += 1
            return step, value
        assert self._thread is not None
        while True:
            try:
                step, item = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if self._closed:
                    raise RuntimeError("Prefetcher is closed") from None
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("Prefetcher thread stopped unexpectedly") from None
        if isinstance(item, _Failure):
            self._failure = item.error
            raise item.error
        self._next_step = step + 1
        return step, item  # type: ignore[return-value]

    def __next__(self) -> tuple[int, T]:
        return self.next()

    def __iter__(self) -> Prefetcher[T]:
        return self

    def close(self, timeout: float | None = 5.0) -> None:
        """Stop the thread and drop buffered values; safe to call more than once."""
        self._closed = True
        self._stop.set()
        if self._queue is not None:
            while True:
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """Whether the background thread is running."""
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
