"""Per-array pending work across streams, and the export-time join.

Each tracked array remembers, per stream, the last write and the last read
still pending, each as an event recorded after that work. A new access on
stream ``s`` first makes ``s`` wait for the conflicting ones on other streams
(write after write, read after write, write after read); an export makes the
export stream wait for all of them (the spec's 7/9/15 -> 3 rule). Completed
events are dropped instead of waited on.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from . import _sanitizer
from ._backend import Backend, current_backend
from ._config import settings
from ._events import EventPool, Mark, record
from ._interface import ArrayView, byte_range, parse
from ._poller import counters as poll_counters
from ._stream import Stream

__all__ = ["TrackedArray", "export", "stats", "track"]

#: seconds a writing()/reading() block waits for another thread's block on the same array
BLOCK_TIMEOUT = 60.0


class _Access:
    """Pending work of one stream on one array: ``event`` follows it.

    ``event`` None means "whatever the stream will have enqueued when someone
    needs to wait": an export hands the stream to a consumer whose work is not
    known yet, so the event is recorded at the next conflicting access.
    """

    __slots__ = ("event", "mark", "stream", "waited_by")

    def __init__(self, stream: Stream, event: int | None, mark: Mark | None = None) -> None:
        self.stream = stream
        self.event = event
        self.mark = mark
        self.waited_by: set[int] = set()


class _Scheduler:
    """Per-backend state: the event pool, the default export stream, counters."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.pool = EventPool(backend)
        self.registry: weakref.WeakValueDictionary[int, TrackedArray] = (
            weakref.WeakValueDictionary()
        )
        self.lock = threading.Lock()
        self._export_stream: Stream | None = None
        self.joins = 0
        self.waits = 0
        self.waits_elided = 0
        self.exports = 0

    @property
    def export_stream(self) -> Stream:
        stream = self._export_stream
        if stream is None:
            with self.lock:
                if self._export_stream is None:
                    self._export_stream = Stream()
                stream = self._export_stream
        return stream

    def order_after(self, stream: Stream, accesses: list[_Access], *, join: bool) -> list[_Access]:
        """Make ``stream`` wait for each access on another stream; return those
        still pending (completed ones are dropped and their events released)."""
        backend = self.backend
        handle = stream.handle
        pending = []
        for access in accesses:
            if access.stream == stream or handle in access.waited_by:
                pending.append(access)
                continue
            if access.event is None:
                event = self.materialize(access)
            elif backend.query(access.event):
                self.waits_elided += 1
                self.release(access)
                continue
            else:
                event = access.event
            backend.stream_wait_event(handle, event)
            access.waited_by.add(handle)
            if join:
                self.joins += 1
            else:
                self.waits += 1
            pending.append(access)
        return pending

    def materialize(self, access: _Access) -> int:
        """Record the event of a lazy access now (see :class:`_Access`)."""
        if access.event is None:
            event = self.pool.acquire()
            access.mark = record(self.backend, event, access.stream.handle)
            access.event = event
        return access.event

    def new_access(self, stream: Stream) -> _Access:
        """An access covering everything enqueued on ``stream`` so far."""
        access = _Access(stream, None)
        self.materialize(access)
        return access

    def join(self, waiter: int, producer: int, *, keepalive: object) -> None:
        """Stream ``waiter`` waits for all work enqueued so far on ``producer``
        (one pooled event; ``keepalive`` is held until it completes)."""
        event = self.pool.acquire()
        try:
            record(self.backend, event, producer)
            self.backend.stream_wait_event(waiter, event)
        finally:
            self.pool.release(event, keepalive)

    def release(self, access: _Access) -> None:
        if access.event is not None:
            self.pool.release(access.event, access.stream)
            access.event = None
            access.mark = None


_schedulers: dict[int, _Scheduler] = {}
_schedulers_lock = threading.Lock()


def scheduler_for(backend: Backend) -> _Scheduler:
    found = _schedulers.get(id(backend))
    if found is None or found.backend is not backend:
        with _schedulers_lock:
            found = _schedulers.get(id(backend))
            if found is None or found.backend is not backend:
                found = _schedulers[id(backend)] = _Scheduler(backend)
    return found


def as_stream(stream: object, backend: Backend) -> Stream:
    """``stream`` (a Stream or anything Stream.wrap takes) as a Stream of ``backend``."""
    s = stream if isinstance(stream, Stream) else Stream.wrap(stream)
    if s.backend is not backend:
        raise ValueError(f"{s!r} is on the {s.backend.name!r} backend, not {backend.name!r}")
    return s


class TrackedArray:
    """An array whose pending work is tracked across streams (see :func:`track`)."""

    __slots__ = ("__weakref__", "_base", "_block", "_block_owner", "_lock", "_reads", "_sched",
                 "_writes", "array", "export_stream", "view")  # fmt: skip

    array: Any
    export_stream: Stream
    view: ArrayView
    _base: dict[str, Any]
    _block: threading.Lock
    _block_owner: int | None
    _lock: threading.RLock
    _reads: dict[int, _Access]
    _sched: _Scheduler
    _writes: dict[int, _Access]

    def __init__(self) -> None:
        raise TypeError("use cai_streams.track(obj) to track an array")

    @property
    def _cai_streams_array(self) -> Any:
        return self.array

    @contextmanager
    def _exclusive(self, what: str) -> Iterator[None]:
        """One writing()/reading() block at a time per array.

        A block's access becomes visible to others only when it is recorded at
        exit, so two blocks open at once (from two threads) would not be
        ordered. The wait is for the other block to finish enqueueing: short,
        and bounded.
        """
        me = threading.get_ident()
        if self._block_owner == me:
            raise RuntimeError(
                f"{what} opened inside another writing()/reading() block of the same array "
                "in the same thread (nested, or two tasks interleaving across an await): "
                "close the first block before opening the next"
            )
        if not self._block.acquire(timeout=BLOCK_TIMEOUT):
            raise TimeoutError(
                f"{what}: another thread held this array's block for {BLOCK_TIMEOUT} s"
            )
        self._block_owner = me
        try:
            yield
        finally:
            self._block_owner = None
            self._block.release()

    def __del__(self) -> None:
        sched = getattr(self, "_sched", None)
        if sched is None:
            return
        for access in [
            *getattr(self, "_writes", {}).values(),
            *getattr(self, "_reads", {}).values(),
        ]:
            sched.release(access)

    @contextmanager
    def writing(self, stream: object, *, disjoint: bool = False) -> Iterator[TrackedArray]:
        """Work enqueued on ``stream`` inside the block writes this array.

        On enter, ``stream`` waits for all pending reads and writes on other
        streams; on exit, the write is recorded as pending. ``disjoint=True``
        declares that the block writes a part no other pending write touches
        (the spec's streams 7, 9 and 15 each filling a third): it is then not
        ordered after other writes, so the writers run concurrently, and an
        export joins them all. Only enqueues GPU work; never blocks the host.
        """
        s = as_stream(stream, self._sched.backend)
        with self._exclusive("writing()"):
            with self._lock:
                conflicting = [*self._reads.values()]
                if not disjoint:
                    conflicting += self._writes.values()
                pending = self._sched.order_after(s, conflicting, join=False)
                covered = {id(a) for a in pending}
                if disjoint:
                    self._reads = {h: a for h, a in self._reads.items() if id(a) in covered}
                else:
                    self._keep_only(pending)
                if _sanitizer.active and not disjoint:  # a disjoint block does not say which part
                    _sanitizer.stream_access(self._sched.backend, s.handle, reads=(),
                                             writes=[byte_range(self.view)],
                                             what="writing() block")  # fmt: skip
            try:
                yield self
            finally:
                with self._lock:
                    self._record_write(s, covered)

    def _record_write(self, s: Stream, covered: set[int]) -> None:
        new = self._sched.new_access(s)
        for access in [*self._writes.values(), *self._reads.values()]:
            if id(access) in covered:
                self._sched.release(access)
        self._writes = {h: a for h, a in self._writes.items() if id(a) not in covered}
        self._reads = {h: a for h, a in self._reads.items() if id(a) not in covered}
        old = self._writes.pop(s.handle, None)
        if old is not None:
            self._sched.release(old)
        self._writes[s.handle] = new

    @contextmanager
    def reading(self, stream: object) -> Iterator[TrackedArray]:
        """Work enqueued on ``stream`` inside the block reads this array.

        On enter, ``stream`` waits for pending writes on other streams; on exit,
        the read is recorded as pending, so a later write elsewhere waits for it
        (write after read). Only enqueues GPU work; never blocks the host.
        """
        s = as_stream(stream, self._sched.backend)
        with self._exclusive("reading()"):
            with self._lock:
                writes = list(self._writes.values())
                self._keep_only(self._sched.order_after(s, writes, join=False) + [
                    *self._reads.values()])  # fmt: skip
                if _sanitizer.active:
                    _sanitizer.stream_access(self._sched.backend, s.handle,
                                             reads=[byte_range(self.view)], writes=(),
                                             what="reading() block")  # fmt: skip
            try:
                yield self
            finally:
                self._record_read(s, self._sched.new_access(s))

    def _record_read(self, s: Stream, access: _Access) -> None:
        """``access`` (on ``s``) is now this array's pending read on ``s``."""
        with self._lock:
            old = self._reads.pop(s.handle, None)
            if old is not None:
                self._sched.release(old)
            self._reads[s.handle] = access

    # -- consumer side (used by _consume) ---------------------------------------

    def _pending_writes(self) -> list[_Access]:
        """The pending writes, each with its event recorded and pinned, for a
        host wait. Unpin with :meth:`_writes_done`."""
        with self._exclusive("consume()"), self._lock:
            accesses = list(self._writes.values())
            for access in accesses:
                self._sched.pool.pin(self._sched.materialize(access))
            return accesses

    def _writes_done(self, accesses: list[_Access], *, complete: bool) -> None:
        """Unpin what :meth:`_pending_writes` gave; forget it when ``complete``."""
        with self._lock:
            for access in accesses:
                if access.event is not None:
                    self._sched.pool.unpin(access.event)
            if complete:
                done = {id(a) for a in accesses}
                for handle, access in list(self._writes.items()):
                    if id(access) in done:
                        del self._writes[handle]
                        self._sched.release(access)

    def _read_on(self, s: Stream) -> None:
        """Order ``s`` after the pending writes; what ``s`` enqueues from now on
        reads this array (a lazy read: its event is recorded when needed)."""
        with self._exclusive("consume()"), self._lock:
            writes = list(self._writes.values())
            self._keep_only(self._sched.order_after(s, writes, join=False) + [
                *self._reads.values()])  # fmt: skip
            self._record_read(s, _Access(s, None))

    def _keep_only(self, pending: list[_Access]) -> set[int]:
        """Forget the reads and writes not in ``pending`` (found complete)."""
        kept = {id(a) for a in pending}
        if len(kept) != len(self._writes) + len(self._reads):
            self._writes = {h: a for h, a in self._writes.items() if id(a) in kept}
            self._reads = {h: a for h, a in self._reads.items() if id(a) in kept}
        return kept

    def export(self, stream: object = None) -> dict[str, Any]:
        """A version 3 CAI dict with all pending work joined onto one stream.

        ``stream`` defaults to this array's export stream. No pending work:
        ``stream`` is None. Otherwise the export stream waits for an event on
        each other stream with pending work (none when all of it is already on
        the export stream). Only enqueues GPU work; never blocks.
        """
        cai = dict(self._base)
        if not settings.export_stream:
            return cai
        sched = self._sched
        x = self.export_stream if stream is None else as_stream(stream, sched.backend)
        with self._lock:
            sched.exports += 1
            pending = sched.order_after(x, [*self._writes.values(), *self._reads.values()],
                                        join=True)  # fmt: skip
            if not pending:
                self._writes, self._reads = {}, {}
                if _sanitizer.active:  # stream None says "ready now, anywhere"
                    _sanitizer.host_access(
                        "read",
                        [byte_range(self.view)],
                        "export() with nothing pending: stream None",
                    )
                return cai
            for access in pending:
                sched.release(access)
            # The consumer's work lands on x (enqueued there, or joined back to
            # it as the spec requires), so the next conflicting access waits for x.
            self._writes, self._reads = {x.handle: _Access(x, None)}, {}
            if _sanitizer.active:  # under the lock: before any later access sees x
                _sanitizer.stream_access(
                    sched.backend,
                    x.handle,
                    reads=[byte_range(self.view)],
                    writes=(),
                    what="export(): the consumer's read",
                )
        cai["stream"] = x.handle
        return cai

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return self.export()

    def pending_streams(self) -> dict[str, list[int]]:
        """Stream handles with pending writes and reads (for inspection)."""
        with self._lock:
            return {"writes": list(self._writes), "reads": list(self._reads)}

    def __repr__(self) -> str:
        return (
            f"<TrackedArray of {type(self.array).__name__}, export stream {self.export_stream!r}>"
        )


_setters = {
    n: getattr(TrackedArray, n).__set__ for n in TrackedArray.__slots__ if n != "__weakref__"
}


def track(obj: object, stream: object = None) -> TrackedArray:
    """Track pending work on ``obj`` (any object exposing the CUDA Array Interface).

    ``stream`` is the export stream; None means the scheduler's own stream,
    which lives as long as the process. Tracking an object again while its
    TrackedArray is alive returns that same TrackedArray. Work the object's own
    CAI ``stream`` reports is pending from the start. Does not block.
    """
    if isinstance(obj, TrackedArray):
        return obj
    backend = current_backend()
    sched = scheduler_for(backend)
    found = sched.registry.get(id(obj))
    if found is not None and found.array is obj:
        if stream is not None and as_stream(stream, backend) != found.export_stream:
            raise ValueError(
                f"{obj!r} is already tracked with export stream {found.export_stream!r}"
            )
        return found
    view = parse(obj)
    t: TrackedArray = object.__new__(TrackedArray)
    s = _setters
    s["array"](t, obj)
    s["view"](t, view)
    s["export_stream"](t, sched.export_stream if stream is None else as_stream(stream, backend))
    s["_sched"](t, sched)
    s["_lock"](t, threading.RLock())
    s["_block"](t, threading.Lock())
    s["_block_owner"](t, None)
    base = view.with_stream(None).__cuda_array_interface__
    s["_base"](t, base)
    writes: dict[int, _Access] = {}
    if view.stream is not None and settings.sync:
        producer = Stream.wrap(view.stream)
        writes[producer.handle] = _Access(producer, None)
    s["_writes"](t, writes)
    s["_reads"](t, {})
    sched.registry[id(obj)] = t
    return t


def lookup(obj: object, backend: Backend) -> TrackedArray | None:
    """The TrackedArray of ``obj`` (or ``obj`` itself) if it is tracked."""
    if isinstance(obj, TrackedArray):
        return obj
    found = scheduler_for(backend).registry.get(id(obj))
    if found is not None and found.array is obj:
        return found
    return None


def export(obj: object, *, stream: object = None) -> dict[str, Any]:
    """A version 3 CAI dict for ``obj`` whose ``stream`` entry covers its pending work.

    A tracked object (or TrackedArray): its pending work is joined onto
    ``stream``. Any other object: its own CAI stream is joined onto ``stream``
    with one event. ``stream`` None: the scheduler's own stream.
    ``CAI_STREAMS_EXPORT_STREAM=0`` exports ``stream: None`` and joins nothing.
    Only enqueues GPU work; never blocks.
    """
    if isinstance(obj, TrackedArray):
        return obj.export(stream)
    backend = current_backend()
    sched = scheduler_for(backend)
    found = sched.registry.get(id(obj))
    if found is not None and found.array is obj:
        return found.export(stream)
    view = parse(obj)
    cai = view.with_stream(None).__cuda_array_interface__
    if not settings.export_stream or view.stream is None:
        return cai
    x = sched.export_stream if stream is None else as_stream(stream, backend)
    sched.exports += 1
    if view.stream != x.handle:
        sched.join(x.handle, view.stream, keepalive=x)
        sched.joins += 1
    if _sanitizer.active:
        _sanitizer.stream_access(backend, x.handle, reads=[byte_range(view)], writes=(),
                                 what="export(): the consumer's read")  # fmt: skip
    cai["stream"] = x.handle
    return cai


def stats() -> dict[str, int]:
    """Counters of the current backend's scheduler (for tests and benchmarks).

    ``events_created``, ``events_acquired`` (handed out: the difference was
    reused), ``events_pooled`` (free for reuse), ``events_in_flight``
    (handed out or not yet complete), ``joins`` (export waits), ``waits``
    (waits made by writing/reading blocks), ``waits_elided`` (pending work
    found complete), ``exports``, ``tracked``; and, for the shared poller of
    every event loop, ``poll_passes``, ``poll_queries`` (event queries made)
    and ``poll_wakes`` (waiters woken). Does not block.
    """
    sched = scheduler_for(current_backend())
    sched.pool.reclaim()
    return {
        "poll_passes": poll_counters.passes,
        "poll_queries": poll_counters.queries,
        "poll_wakes": poll_counters.wakes,
        "events_created": sched.pool.created,
        "events_acquired": sched.pool.acquired,
        "events_pooled": sched.pool.free,
        "events_in_flight": sched.pool.in_flight,
        "joins": sched.joins,
        "waits": sched.waits,
        "waits_elided": sched.waits_elided,
        "exports": sched.exports,
        "tracked": len(sched.registry),
    }
