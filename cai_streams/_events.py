"""A pool of timing-free events, reused only once complete; record order marks."""

from __future__ import annotations

import itertools
import threading
import warnings
from collections import deque
from collections.abc import Hashable
from typing import Final, NamedTuple

from ._backend import Backend
from ._errors import CudaError, CudaWarning

__all__ = ["EventPool", "Mark", "record"]

_order = itertools.count()


class Mark(NamedTuple):
    """Where a record landed: the stream it went to and its place in record order.

    Events recorded on one stream complete in the order they were recorded
    (a stream is a FIFO), so a poller that finds one not done need not query
    the later ones. ``key`` tells streams apart: the per-thread default stream
    (2) is a different stream in each host thread.
    """

    key: Hashable
    seq: int


def record(backend: Backend, event: int, stream: int) -> Mark:
    """Record ``event`` on ``stream`` and return its :class:`Mark`. Only enqueues."""
    backend.record(event, stream)
    key: Hashable = (stream, threading.get_ident()) if stream == 2 else stream
    return Mark(key, next(_order))


#: free events kept for reuse; beyond this they are destroyed
MAX_FREE: Final = 1024


class EventPool:
    """Events handed out for pending work and taken back when released.

    A released event returns to the free list only once it is complete, so no
    stream wait can still be reading it; until then it is held (with its
    stream) and reclaimed later. Growth is bounded by the work in flight.
    """

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._lock = threading.RLock()
        self._free: list[int] = []
        self._draining: deque[tuple[int, object]] = deque()
        self._pins: dict[int, int] = {}
        self.created = 0
        self.destroyed = 0
        self.acquired = 0

    def acquire(self) -> int:
        with self._lock:
            self.acquired += 1
            self._reclaim(limit=4)
            if self._free:
                return self._free.pop()
            self.created += 1
        return self._backend.create_event()

    def release(self, event: int, keepalive: object = None) -> None:
        """Give ``event`` back; ``keepalive`` (its stream) is held until it completes."""
        with self._lock:
            self._draining.append((event, keepalive))
            self._reclaim(limit=2)

    def pin(self, event: int) -> None:
        """Keep ``event`` from reuse while a waiter reads it, even once released."""
        with self._lock:
            self._pins[event] = self._pins.get(event, 0) + 1

    def unpin(self, event: int) -> None:
        with self._lock:
            count = self._pins.pop(event) - 1
            if count:
                self._pins[event] = count

    def reclaim(self) -> None:
        """Move every completed released event to the free list."""
        with self._lock:
            self._reclaim(limit=len(self._draining))

    def _reclaim(self, limit: int) -> None:
        for _ in range(min(limit, len(self._draining))):
            event, keepalive = self._draining[0]
            try:
                done = event not in self._pins and self._backend.query(event)
            except CudaError:
                done = None  # its work failed: never reuse it
            if done is False:
                self._draining.rotate(-1)
                continue
            self._draining.popleft()
            del keepalive
            if done and len(self._free) < MAX_FREE:
                self._free.append(event)
            else:
                self._destroy(event)

    def _destroy(self, event: int) -> None:
        self.destroyed += 1
        try:
            self._backend.destroy_event(event)
        except CudaError as exc:
            warnings.warn(f"leaked event {event:#x}: {exc}", CudaWarning, stacklevel=3)

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def in_flight(self) -> int:
        """Events handed out or released but not yet complete."""
        return self.created - self.destroyed - len(self._free)
