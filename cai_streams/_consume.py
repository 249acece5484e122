"""The consumer side: take any CUDA Array Interface object, race-free.

Three ways to be ready for an array a producer hands over:

* host readiness (``stream=None``): an event recorded on the producer's stream
  (for a tracked array: its pending writes' own events) is awaited through the
  shared poller, so the event loop keeps running;
* enqueue (``stream=s``): ``s`` waits for the producer on the GPU, the host
  does not wait at all;
* opt-out (``sync=False`` or ``CAI_STREAMS_SYNC=0``): nothing is waited for,
  and the view still names the producer's stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio.lowlevel

from . import _sanitizer
from ._backend import Backend, current_backend
from ._config import settings
from ._events import Mark, record
from ._interface import ArrayView, byte_range, parse
from ._poller import check_timeout, wait_blocking, wait_for_events
from ._scheduler import TrackedArray, _Access, _Scheduler, as_stream, lookup, scheduler_for
from ._stream import Stream

__all__ = ["consume", "consume_all", "consume_blocking", "consuming"]


def _sync_flag(sync: object) -> bool:
    if sync is None:
        return settings.sync
    if not isinstance(sync, bool):
        raise TypeError(f"sync must be True, False or None, got {sync!r}")
    return sync


class _Handoff:
    """One array being consumed: the view to return, what the host must wait
    for, and how to let go of it afterwards, whatever happened."""

    __slots__ = ("accesses", "events", "host_read", "producer", "sched", "stream", "tracked",
                 "view")  # fmt: skip

    def __init__(self, obj: object, stream: object, sync: object, backend: Backend) -> None:
        synced = _sync_flag(sync)
        self.sched: _Scheduler = scheduler_for(backend)
        self.stream = None if stream is None else as_stream(stream, backend)
        self.tracked: TrackedArray | None = lookup(obj, backend)
        self.view: ArrayView = parse(obj) if self.tracked is None else self.tracked.view
        self.events: list[tuple[int, Mark | None]] = []  # what the host waits for
        self.accesses: list[_Access] = []  # a tracked array's pending writes, pinned
        #: the untracked producer's stream, joined back at the end of consuming()
        self.producer: int | None = None
        #: the data is read on the host once ready (declared to the sanitizer)
        self.host_read = synced and self.stream is None
        if not synced:
            self.tracked = None  # no back-edge either: the caller opted out
            return
        t, s, view = self.tracked, self.stream, self.view
        if t is not None:
            if s is None:
                self.accesses = t._pending_writes()
                self.events = [(a.event, a.mark) for a in self.accesses if a.event is not None]
                self.view = view.with_stream(None)
            else:
                t._read_on(s)
                self.view = view.with_stream(s.handle)
                self._declare_stream_read(backend, s)
            return
        if view.stream is None:  # nothing pending: ready on the host and on any stream
            if s is not None:
                self.view = view.with_stream(s.handle)
                self._declare_stream_read(backend, s)
            return
        self.producer = view.stream
        if s is not None:
            if view.stream != s.handle:
                self.sched.join(s.handle, view.stream, keepalive=view)
            self.view = view.with_stream(s.handle)
            self._declare_stream_read(backend, s)
            return
        event = self.sched.pool.acquire()
        try:
            mark = record(backend, event, view.stream)
        except BaseException:
            self.sched.pool.release(event)
            raise
        self.events = [(event, mark)]
        self.view = view.with_stream(None)

    def _declare_stream_read(self, backend: Backend, s: Stream) -> None:
        if _sanitizer.active:
            _sanitizer.stream_access(backend, s.handle, reads=[byte_range(self.view)], writes=(),
                                     what="consume(stream=...): the consumer's read")  # fmt: skip

    def finish(self, *, complete: bool) -> None:
        """Let go of the events: each returns to the pool once complete, and
        the owner stays alive until then. Safe to call twice."""
        if self.accesses:
            assert self.tracked is not None
            accesses, self.accesses = self.accesses, []
            self.tracked._writes_done(accesses, complete=complete)
        elif self.tracked is None:
            for event, _ in self.events:
                self.sched.pool.release(event, self.view)
        self.events = []
        if complete and self.host_read and _sanitizer.active:
            self.host_read = False
            _sanitizer.host_access("read", [byte_range(self.view)], "consume(): the host's read")

    def back_edge(self) -> None:
        """The producer's side waits for the consumer's work on ``stream``:
        the spec's rule that the provided stream must not run ahead of the
        consumer. Only enqueues GPU work."""
        s = self.stream
        if s is None:
            return
        if self.tracked is not None:
            self.tracked._record_read(s, self.sched.new_access(s))
        elif self.producer is not None and self.producer != s.handle:
            self.sched.join(self.producer, s.handle, keepalive=self.view)


def _handoffs(objs: Sequence[object], stream: object, sync: object) -> list[_Handoff]:
    backend = current_backend()
    made: list[_Handoff] = []
    try:
        for obj in objs:
            made.append(_Handoff(obj, stream, sync, backend))
    except BaseException:
        for h in made:
            h.finish(complete=False)
        raise
    return made


async def _await_all(handoffs: list[_Handoff], timeout: float | None) -> None:
    complete = False
    try:
        events = [e for h in handoffs for e in h.events]
        if events:
            await wait_for_events(handoffs[0].sched.backend, events, timeout=timeout)
        else:
            await anyio.lowlevel.checkpoint()
        complete = True
    finally:
        for h in handoffs:
            h.finish(complete=complete)


async def consume(
    obj: Any, *, stream: Any = None, sync: bool | None = None, timeout: float | None = None
) -> ArrayView:
    """Take ``obj`` (any CUDA Array Interface object) once its producer's work allows.

    ``stream=None``: wait until the data is ready on the host, yielding to the
    event loop (the producer's stream is polled through one shared poller,
    never synchronized); ``view.stream`` is None. ``stream=s``: only enqueues
    GPU work: ``s`` waits for the producer's stream and the call returns at
    once (after one cancellation checkpoint); ``view.stream`` is ``s``'s handle.
    ``sync=False`` (or ``CAI_STREAMS_SYNC=0`` when ``sync`` is None) waits for
    nothing, and ``view.stream`` is the producer's stream. A tracked array is
    waited for through its own pending writes.

    Always a cancellation point. ``timeout`` (seconds) raises
    :class:`TimeoutError`. Cancelled or timed out, nothing leaks: the event goes
    back to the pool when its work completes, and the owner lives until then.
    A failed kernel before the handoff raises :class:`~cai_streams.CudaError`.
    """
    check_timeout(timeout)
    (handoff,) = _handoffs([obj], stream, sync)
    await _await_all([handoff], timeout)
    return handoff.view


async def consume_all(
    *objs: Any, stream: Any = None, sync: bool | None = None, timeout: float | None = None
) -> list[ArrayView]:
    """:func:`consume` for several arrays at once: their views, in order.

    One wait (yields to the event loop) covers all of them; ``timeout`` bounds
    the whole. If one fails or the call is cancelled, all are let go.
    """
    check_timeout(timeout)
    handoffs = _handoffs(objs, stream, sync)
    await _await_all(handoffs, timeout)
    return [h.view for h in handoffs]


def consume_blocking(
    obj: Any, *, stream: Any = None, sync: bool | None = None, timeout: float | None = None
) -> ArrayView:
    """:func:`consume` for synchronous code: **blocks** the calling thread.

    ``stream=None`` blocks until the data is ready on the host (at most
    ``timeout`` seconds, then :class:`TimeoutError`); ``stream=s`` only
    enqueues GPU work, as in :func:`consume`. Never call it from a coroutine.
    """
    check_timeout(timeout)
    (handoff,) = _handoffs([obj], stream, sync)
    complete = False
    try:
        events = [e for e, _ in handoff.events]
        wait_blocking(handoff.sched.backend, events, timeout=timeout, keepalive=obj)
        complete = True
    finally:
        handoff.finish(complete=complete)
    return handoff.view


@asynccontextmanager
async def consuming(
    obj: Any, *, stream: Any = None, sync: bool | None = None, timeout: float | None = None
) -> AsyncIterator[ArrayView]:
    """``async with consuming(obj, stream=s) as view:`` :func:`consume`, and on
    exit make the producer wait for the work enqueued on ``s`` in the block.

    On exit (also on an exception or cancellation) the producer's stream (or,
    for a tracked array, its pending reads) is ordered after ``s``, so the
    producer cannot overwrite the buffer while the consumer still reads it:
    the spec's rule. Exiting only enqueues GPU work. With ``stream=None`` the
    consumer's reads were on the host and nothing is needed.
    """
    check_timeout(timeout)
    (handoff,) = _handoffs([obj], stream, sync)
    await _await_all([handoff], timeout)
    try:
        yield handoff.view
    finally:
        handoff.back_edge()
