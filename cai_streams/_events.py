"""A pool of timing-free events, reused only once complete; record order marks."""

from __future__ import annotations

import itertools
import threading
import warnings
from collections import deque
from collections.abc import Callable, Hashable
from typing import Final, NamedTuple, TypeVar

from . import _capture_guard
from ._backend import LEGACY_DEFAULT_STREAM, PER_THREAD_DEFAULT_STREAM, Backend
from ._capture_guard import StreamPhase
from ._device import OnDevice
from ._errors import CaptureError, CudaError, CudaWarning
from ._identity import StreamId, thread_serial

__all__ = [
    "EventPool",
    "Mark",
    "lone",
    "of_backend",
    "pool_for",
    "pools_of",
    "record",
    "record_asked",
    "registered",
]

_order = itertools.count()
#: a record and its place in record order are taken together: two threads
#: recording on one stream must not get places in the other order (the
#: doorbell takes a bell for proof that everything placed before it is done)
_record_lock = threading.Lock()


class Mark(NamedTuple):
    """Where a record landed: the stream it went to and its place in record order.

    Events recorded on one stream complete in the order they were recorded
    (a stream is a FIFO), so a poller that finds one not done need not query
    the later ones. ``key`` is the stream's identity (handle 2 is a different
    stream in each thread; a reused handle is a different stream).
    ``captured``: the stream was capturing a graph, so the event stands for
    work that has not run, and must never be queried (``_capture_guard``).
    """

    key: StreamId
    seq: int
    captured: bool = False


def record(backend: Backend, event: int, key: StreamId) -> Mark:
    """Record ``event`` on the stream ``key`` names and return its :class:`Mark`.

    Only enqueues. For handle 2 the caller must be ``key``'s thread.
    """
    return record_asked(backend, event, key, _capture_guard.capturing(backend, key))


def record_asked(backend: Backend, event: int, key: StreamId, state: bool | None) -> Mark:
    """:func:`record` for a caller that has just asked ``state``, what
    :func:`~cai_streams._capture_guard.capturing` says of ``key``, with no
    backend call since (so that another thread's capture beginning or ending
    in between has the same narrow window as in :func:`record`). Only enqueues."""
    if key.handle == PER_THREAD_DEFAULT_STREAM and key.thread != thread_serial():
        # another thread's per-thread stream cannot be named from here; the
        # legacy stream waits for it (a blocking stream): the event is that one's
        legacy = StreamId(key.backend, key.device, LEGACY_DEFAULT_STREAM, 0, 0)
        # asked again, of the legacy stream: while a blocking stream captures, a
        # record there would invalidate that capture (CaptureError first, instead)
        try:
            state = _capture_guard.capturing(backend, legacy)
        except CaptureError as exc:  # (say whose stream it stands in for)
            raise CaptureError(
                f"work on the per-thread default stream (2) of another thread "
                f"({key.describe()}) can be waited for only through the legacy default "
                "stream (1), which cannot be used while a blocking stream captures a "
                "graph: wait until that capture ends, or hand the array to a cs.Stream()"
            ) from exc
        key = legacy
    with _record_lock:
        if key.handle <= PER_THREAD_DEFAULT_STREAM:  # (1, 2: the current device's streams)
            with OnDevice(backend, key.device, key.handle):
                backend.record(event, key.handle)
        else:
            backend.record(event, key.handle)
        seq = next(_order)
    return Mark(key, seq, state is True)


#: the generations of lone marks' keys (negative: no stream the library made has one)
_lone = itertools.count(1)


def lone(key: StreamId) -> Mark:
    """A :class:`Mark` for an event recorded on ``key``'s stream outside the
    record lock (by a finalizer: see ``_deferred``), whose place among that
    stream's other records is not known. It gets a key of its own (the same
    stream's handle, device and thread, a generation no record shares), so
    nothing is inferred from it: a hold table that releases every hold
    recorded before one found done (record order) releases it by its own
    query alone, and it releases no other."""
    own = StreamId(key.backend, key.device, key.handle, -next(_lone), key.thread)
    return Mark(own, next(_order), False)


#: free events kept for reuse; beyond this they are destroyed
MAX_FREE: Final = 1024
#: every this many releases, a release reclaims, in one relaxed capture scope:
#: two capture-mode exchanges per batch, not per release (driver calls on a
#: GPU), and one query per completed event plus one for the first found
#: pending. What a completed event keeps alive is let go at most this many
#: releases late (or at an acquire that finds no free event, or ``stats()``).
RECLAIM_AT: Final = 4
#: an acquire with no free event stops reclaiming at this many found pending
#: (the ones behind the first may be another stream's, complete)
ACQUIRE_MISSES: Final = 2


class EventPool:
    """Events handed out for pending work and taken back when released.

    A released event returns to the free list only once it is complete, so no
    stream wait can still be reading it; until then it is held (with what it
    keeps alive) and reclaimed later. Growth is bounded by the work in flight.
    An event a waiter still reads is never released here: its access holds it
    (see ``_pending.Access``). An event recorded in a graph capture is never
    queried: it is held until its stream stops capturing, then asked like any
    other (the capture may have ended before the record; a record the capture
    took answers as such, and a record makes the event valid again).
    """

    def __init__(self, backend: Backend, device: int = 0) -> None:
        self._backend = backend
        self.device = device
        self._lock = threading.Lock()
        self._free: list[int] = []
        self._draining: deque[tuple[int, object]] = deque()
        self._captured: deque[tuple[int, object, StreamId]] = deque()
        self.created = 0
        self.destroyed = 0
        self.acquired = 0
        #: releases since the last batch (one every RECLAIM_AT releases)
        self._released = 0

    def acquire(self) -> int:
        gone: list[object] = []  # dropped on return, after the lock (see _reclaim)
        with self._lock:
            # Queries only when there is nothing to hand out and a batch waits
            # (fewer: the pool grows instead, to the batch a release reclaims),
            # past a pending one: not to create.
            if not self._free and len(self._draining) + len(self._captured) >= RECLAIM_AT:
                self._reclaim(RECLAIM_AT, gone, misses=ACQUIRE_MISSES)
            if self._free:
                self.acquired += 1
                return self._free.pop()
        event = self._backend.create_event(self.device)  # may raise: count only what exists
        with self._lock:
            self.created += 1
            self.acquired += 1
        return event

    def release(self, event: int, keepalive: object = None, mark: Mark | None = None) -> None:
        """Give ``event`` back; ``keepalive`` (its stream, an owner) is held until it
        completes. ``mark``: where it was last recorded, if it was."""
        gone: list[object] = []
        with self._lock:
            self._released += 1
            if self._released >= RECLAIM_AT:  # before this one: it is likely pending
                self._released = 0
                # every completed event up to the first found pending (a
                # backlog, after a burst, at once), and the captured records
                # of a batch's worth of streams (a capture-state ask each)
                waiting = len(self._draining) + len(self._captured)
                self._reclaim(waiting, gone, capture_asks=RECLAIM_AT)
            if mark is not None and mark.captured:
                self._captured.append((event, keepalive, mark.key))
            else:
                self._draining.append((event, keepalive))

    def adopt(self, event: int) -> None:
        """Count ``event``, made elsewhere (by a finalizer, see ``_deferred``)
        and handed out already, as one of this pool's: it comes back as the
        others do."""
        with self._lock:
            self.created += 1
            self.acquired += 1

    def unacquire(self, event: int) -> None:
        """Give back ``event``, acquired and never recorded: free at once, and
        not counted as handed out."""
        with self._lock:
            self.acquired -= 1
        self.reuse(event)

    def reuse(self, event: int) -> None:
        """Give back ``event``, which the caller saw complete: free at once, no query."""
        with self._lock:
            if len(self._free) < MAX_FREE:
                self._free.append(event)
                return
        self._destroy(event)

    def reclaim(self) -> None:
        """Move every completed released event to the free list."""
        gone: list[object] = []
        with self._lock:
            limit = max(len(self._draining), len(self._captured))
            self._reclaim(limit, gone, misses=limit)

    def _reclaim(
        self,
        limit: int,
        gone: list[object],
        *,
        misses: int = 1,
        capture_asks: int | None = None,
    ) -> None:
        """Look at up to ``limit`` released events, until ``misses`` were found
        pending; of those recorded in a capture, as many as the streams whose
        capture state is asked allow (each stream once a call, and at most
        ``capture_asks`` streams if given). What completed events kept alive
        goes to ``gone``, for the caller to drop once the lock is released: a
        finalizer it runs may call the library."""
        asks = limit if capture_asks is None else min(limit, capture_asks)
        phases: dict[StreamId, StreamPhase] = {}
        for _ in range(min(limit, len(self._captured))):
            event, keepalive, key = self._captured[0]
            phase = phases.get(key)
            if phase is None:
                if asks == 0:
                    break
                asks -= 1
                phase = phases[key] = _capture_guard.stream_phase(self._backend, key)
            if phase is StreamPhase.CAPTURING or phase is StreamPhase.UNNAMED:
                self._captured.rotate(-1)  # its capture is under way: never query it
                continue
            self._captured.popleft()
            taken: bool | None = True
            if phase is StreamPhase.NOT_CAPTURING:  # (gone: a capture it was forked
                # into may still run, and a query would invalidate it: taken back)
                try:  # the capture may have ended before the record: asked, not assumed
                    taken = _capture_guard.taken_or_complete(self._backend, event)
                except CudaError:
                    taken = None  # its work failed: never reuse it
            if taken is False:  # an ordinary record, behind pending work
                self._draining.append((event, keepalive))
                continue
            gone.append(keepalive)
            self._keep(event, taken is True)
        if not self._draining:
            return
        with _capture_guard.relaxed(self._backend):
            for _ in range(min(limit, len(self._draining))):
                event, keepalive = self._draining[0]
                try:
                    done: bool | None = self._backend.query(event)
                except CudaError:
                    done = None  # its work failed: never reuse it
                if done is False:
                    # Events complete in record order on each stream, and the
                    # queue is in release order: the ones behind it are
                    # likely pending too. A query found so ends the call (or
                    # ``misses`` of them); it goes to the back, so a long
                    # kernel holds up no one else's reuse.
                    self._draining.rotate(-1)
                    misses -= 1
                    if misses > 0:
                        continue
                    break
                self._draining.popleft()
                gone.append(keepalive)
                self._keep(event, done is True)

    def _keep(self, event: int, reusable: bool) -> None:
        if reusable and len(self._free) < MAX_FREE:
            self._free.append(event)
        else:
            self._destroy(event)

    def _destroy(self, event: int) -> None:
        self.destroyed += 1
        try:
            self._backend.destroy_event(event)
        except CudaError as exc:
            warnings.warn(f"leaked event {event:#x}: {exc}", CudaWarning, stacklevel=4)

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def in_flight(self) -> int:
        """Events handed out, or released but not yet complete."""
        return self.created - self.destroyed - len(self._free)


K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


def registered(table: dict[K, V], lock: threading.Lock, key: K, make: Callable[[], V]) -> V:
    """``table[key]``, made by ``make()`` once even when threads race. Does not block
    beyond bookkeeping."""
    found = table.get(key)
    if found is None:
        with lock:
            found = table.get(key)
            if found is None:
                found = table[key] = make()
    return found


def of_backend(table: dict[tuple[Backend, int], V], backend: Backend) -> list[V]:
    """The values of ``table`` (keyed by backend and device) for ``backend``."""
    return [value for (b, _), value in list(table.items()) if b is backend]


_pools: dict[tuple[Backend, int], EventPool] = {}
_pools_lock = threading.Lock()


def pool_for(backend: Backend, device: int) -> EventPool:
    """The event pool of ``backend``'s ``device``: an event records only on
    streams of its own device (cudaErrorInvalidResourceHandle otherwise), so
    each device has its own pool. Does not block."""
    return registered(_pools, _pools_lock, (backend, device), lambda: EventPool(backend, device))


def pools_of(backend: Backend) -> list[EventPool]:
    """Every event pool made so far for ``backend`` (one per device used)."""
    return of_backend(_pools, backend)
