"""The consumer side: take any CUDA Array Interface object, race-free.

Every handoff is one row of :class:`Mode`, chosen once by :func:`plan` from
three facts: is the producer a tracked array, does its interface name a
stream, and does the consumer want host readiness (``stream=None``), its own
stream ordered (``stream=s``), or nothing (``sync=False``):

==================  =========================  =====================  ==================
mode                what is waited for         ``view.stream``        ``consuming()`` exit
==================  =========================  =====================  ==================
TRACKED_HOST        the host polls the         None                   nothing
                    pending writes' events
TRACKED_ENQUEUE     ``s`` waits for the        ``s``                  a read recorded
                    pending writes; a                                 on ``s``
                    consumer read is added
TRACKED_OPT_OUT     nothing on the host; the   the export stream      nothing
                    writes are joined onto     (None if nothing
                    the export stream, as      is pending)
                    ``export()`` does
UNTRACKED_HOST      the host polls an event    None                   nothing
                    recorded on the producer's
                    stream now (none if the
                    backend says it is idle)
UNTRACKED_ENQUEUE   ``s`` waits for an event   ``s``                  the producer's stream
                    recorded on the producer's                        waits for ``s``
                    stream now
UNTRACKED_OPT_OUT   nothing                    the producer's stream  nothing
READY               nothing (the producer      None, or ``s``         nothing
                    names no stream)
DLPACK_HOST         ``__dlpack__`` joins the   None                   nothing
                    producer's work onto a
                    landing stream; the host
                    polls an event there
DLPACK_ENQUEUE      ``__dlpack__`` orders      ``s``                  nothing (DLPack has
                    ``s`` after the                                   no way back to the
                    producer's work                                   producer)
DLPACK_OPT_OUT      nothing (``stream=-1``)    None, or ``s``         nothing
==================  =========================  =====================  ==================

An array tracked here is always handed off through its pending work (what its
``__dlpack__`` does too, without blocking the event loop). For any other
object the protocol is chosen by :func:`~cai_streams._dlpack_import.choose_protocol`.

A tracked producer's ``writing()`` block held open by another thread is waited
for first: awaited from a coroutine (never blocking the loop), blocked on in
``consume_blocking``. Within ``timeout``, always.
"""

from __future__ import annotations

import enum
import functools
import threading
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, ClassVar

import anyio

from . import _capture_guard, _observe
from ._access import Access
from ._backend import Backend, current_backend
from ._blocks import Blocked, OpenBlock, Owner, current_owner, wait_block_async, wait_block_sync
from ._config import settings
from ._deferred import in_collection, later
from ._device import view_stream_id
from ._dlpack_import import (
    Protocol,
    Unread,
    check_protocol,
    choose_protocol,
    cuda_device_of,
    take,
)
from ._events import EventPool, Mark, pool_for, record
from ._hold import ViewLease, hold_view_owner, view_done
from ._hold_table import tick as release_holds
from ._identity import StreamId, is_open
from ._interface import ArrayView, byte_runs, parse, parse_read
from ._pending import PendingWork
from ._poller import check_timeout, wait_blocking, wait_for_events
from ._running import checkpoint
from ._scheduler import Scheduler, any_scheduler, export_stream_of, scheduler_for
from ._stream import Stream, as_stream, lending
from ._tracebacks import release_frames
from ._tracked import BLOCK_TIMEOUT, TrackedArray, lookup

__all__ = ["Mode", "consume", "consume_all", "consume_blocking", "consuming", "plan"]


class Mode(enum.Enum):
    """The rows of the handoff table (see the module docstring)."""

    TRACKED_HOST = "tracked producer, host readiness"
    TRACKED_ENQUEUE = "tracked producer, consumer stream"
    TRACKED_OPT_OUT = "tracked producer, sync=False"
    UNTRACKED_HOST = "producer stream, host readiness"
    UNTRACKED_ENQUEUE = "producer stream, consumer stream"
    UNTRACKED_OPT_OUT = "producer stream, sync=False"
    READY = "nothing pending"
    DLPACK_HOST = "DLPack producer, host readiness"
    DLPACK_ENQUEUE = "DLPack producer, consumer stream"
    DLPACK_OPT_OUT = "DLPack producer, sync=False"

    #: members are singletons compared by identity: hashed in C (Enum's own
    #: ``__hash__`` is a Python call, and every handoff looks up its row)
    __hash__ = object.__hash__


def plan(
    *,
    tracked: bool,
    producer_stream: int | None,
    stream: object,
    synced: bool,
    dlpack: bool = False,
) -> Mode:
    """The row for a handoff. ``stream``: the consumer's stream, or None."""
    if dlpack and not tracked:
        if not synced:
            return Mode.DLPACK_OPT_OUT
        return Mode.DLPACK_HOST if stream is None else Mode.DLPACK_ENQUEUE
    if tracked:
        if not synced:
            return Mode.TRACKED_OPT_OUT
        return Mode.TRACKED_HOST if stream is None else Mode.TRACKED_ENQUEUE
    if producer_stream is None:
        return Mode.READY
    if not synced:
        return Mode.UNTRACKED_OPT_OUT
    return Mode.UNTRACKED_HOST if stream is None else Mode.UNTRACKED_ENQUEUE


def _sync_flag(sync: object) -> bool:
    if sync is None:
        return settings.sync
    if not isinstance(sync, bool):
        raise TypeError(f"sync must be True, False or None, got {type(sync).__name__}")
    return sync


class _Handoff:
    """One array being consumed: ``begin`` makes it ready (bookkeeping and
    enqueueing only), ``events`` is what the host then waits for, ``finish``
    lets go whatever happened, ``back_edge`` ends a ``consuming()`` block."""

    mode: ClassVar[Mode]
    #: the row hands the view to the consumer's stream: its owner is held until
    #: that stream passes the work enqueued while the view is in use (``_hold``)
    to_stream: ClassVar[bool] = False
    #: ``begin`` looks at who calls (another owner's open block is waited for):
    #: only then is the caller's owner asked (a few calls into the async library)
    needs_owner: ClassVar[bool] = False

    def __init__(self, sched: Scheduler, view: ArrayView, stream: Stream | None) -> None:
        self.sched = sched
        self.view = view
        self.stream = stream
        self.events: list[tuple[int, Mark | None]] = []
        #: a ``consuming()`` body: a tracked array's other owners wait to write
        self.blocking = False

    def begin(self, me: Owner) -> Blocked | None:
        return None

    def finish(self, *, complete: bool) -> None:
        """Safe to call twice."""

    def back_edge(self) -> None:
        """Only enqueues GPU work."""

    def _declare_host_read(self, complete: bool, waited: object) -> None:
        """A consume that returned orders the host after what it waited for
        (``waited``: what the library found complete for it; the events)."""
        if complete and _observe.active:
            backend = self.sched.backend
            _observe.host_access(
                "read",
                byte_runs(self.view),
                "consume(): the host's read",
                waited=[waited],
                events=[(backend, event) for event, _ in self.events],
                view=self.view,
            )

    def _declare_stream_read(self, s: Stream) -> None:
        self.sched.declare_stream_read(s, self.view, "consume(stream=...): the consumer's read")


class _Tracked(_Handoff):
    needs_owner = True

    def __init__(
        self, sched: Scheduler, view: ArrayView, stream: Stream | None, work: PendingWork
    ) -> None:
        super().__init__(sched, view, stream)
        self.work = work


class _TrackedHost(_Tracked):
    mode = Mode.TRACKED_HOST
    accesses: list[Access] | None = None
    #: what the buffer's own interface named pending, if ``_tracked_host``
    #: read it already (the first ``begin`` takes it; a retry reads it again)
    own: Stream | None | Unread = Unread.UNREAD

    def begin(self, me: Owner) -> Blocked | None:
        own, self.own = self.own, Unread.UNREAD
        if own is Unread.UNREAD:
            own = self.work.own_stream(sync=True)  # (this row synchronizes)
        got = self.work.try_pin_writes(me, own)
        if isinstance(got, Blocked):
            return got
        self.accesses = got
        backend = self.work.backend
        try:  # nothing the host cannot wait for (a write in a graph capture)
            self.events = [
                (a.event, a.mark)
                for a in got
                if not _capture_guard.host_skips(backend, a, "consume()")
            ]
        except BaseException:
            self.finish(complete=False)
            raise
        if self.view.stream is not None:  # (a tracked array's view names none: keep it)
            self.view = self.view.with_stream(None)
        return None

    def finish(self, *, complete: bool) -> None:
        accesses, self.accesses = self.accesses, None
        if accesses is not None:
            try:
                self._declare_host_read(complete, self.work)
            finally:
                if accesses:  # nothing was pinned: nothing to let go
                    self.work.unpin_writes(accesses, complete=complete)


class _TrackedEnqueue(_Tracked):
    mode = Mode.TRACKED_ENQUEUE
    to_stream = True
    #: the read block a ``consuming()`` body holds (see ``blocking``)
    block: OpenBlock | None = None

    def begin(self, me: Owner) -> Blocked | None:
        assert self.stream is not None
        got = self.work.try_read_on(self.stream, me, block=self.blocking)
        if isinstance(got, Blocked):
            return got
        self.block = got
        self.view = self.view._on_stream(self.stream.handle, self.stream._key())
        return None

    def finish(self, *, complete: bool) -> None:
        if not complete and self.block is not None:  # the body never runs: end its block
            self.back_edge()

    def back_edge(self) -> None:
        assert self.stream is not None
        block, self.block = self.block, None
        self.work.read_done_on(self.stream, block)


class _TrackedOptOut(_Tracked):
    mode = Mode.TRACKED_OPT_OUT
    #: synchronization is the caller's, but a view handed to ``stream=s`` still
    #: keeps its owner until ``s`` passes the work enqueued while it is in use
    to_stream = True

    def begin(self, me: Owner) -> Blocked | None:
        if not settings.export_stream:
            self.view = self.view.with_stream(None)
            return None
        got = self.work.try_export(export_stream_of(self.work), me)
        if isinstance(got, Blocked):
            return got
        self.view = self.view.with_stream(got)
        return None


class _UntrackedHost(_Handoff):
    mode = Mode.UNTRACKED_HOST
    pool: EventPool

    def begin(self, me: Owner) -> Blocked | None:
        backend = self.sched.backend
        key = view_stream_id(backend, self.view)
        self.view = self.view.with_stream(None)
        if _observe.active:  # (unobserved, the common case: no scope object, no enter/exit)
            with _observe.Scope(self):  # what it finds complete is this handoff's to know
                idle = _capture_guard.host_wait_idle(backend, key, "consume()")
        else:
            idle = _capture_guard.host_wait_idle(backend, key, "consume()")
        if idle:
            return None  # idle: the data is ready now, and no event is spent
        pool = self.pool = pool_for(backend, key.device)  # an event of the producer's device
        event = pool.acquire()
        try:
            mark = record(backend, event, key)
        except BaseException:
            pool.release(event)
            raise
        self.events = [(event, mark)]
        return None

    def finish(self, *, complete: bool) -> None:
        try:
            self._declare_host_read(complete, self)
        finally:
            events, self.events = self.events, []
            for event, _ in events:
                if complete:  # the wait found it done: free at once, no query
                    self.pool.reuse(event)
                else:  # the owner lives until it completes
                    self.pool.release(event, self.view)


class _Edge(enum.Enum):
    """Where the back-edge of an untracked ``consuming()`` body stands."""

    #: not made yet: at the body's exit, or when its stream closes first
    DUE = "due"
    #: made (or not to be made: the block never began)
    DONE = "done"


class _UntrackedEnqueue(_Handoff):
    mode = Mode.UNTRACKED_ENQUEUE
    to_stream = True

    def __init__(self, sched: Scheduler, view: ArrayView, stream: Stream | None) -> None:
        super().__init__(sched, view, stream)
        assert view.stream is not None
        #: the producer's stream: the view's own, replaced by begin()
        self.producer: StreamId | None = None
        self.edge = _Edge.DONE
        #: the consumer's stream as the body's back-edge records on it (a
        #: borrowed wrapper's close must not end it first: ``Stream._kept``)
        self._edge_stream: Stream | None = None
        self._edge_lock = threading.Lock()  # (a flag flip: bookkeeping only)

    def begin(self, me: Owner) -> Blocked | None:
        s = self.stream
        assert s is not None
        key, mine = view_stream_id(self.sched.backend, self.view), s._key()
        self.producer = key
        if key != mine:
            self.sched.join(
                s.handle, key, keepalive=self.view, what="consume(stream=s)", waiter_id=mine
            )
        self.view = self.view._on_stream(s.handle, mine)
        self._declare_stream_read(s)
        if self.blocking and key != mine:  # a consuming() body: its back-edge is due
            self._edge_stream = s._kept()
            self.edge = _Edge.DUE
            lifetime = s._lifetime
            if lifetime is not None and not lifetime.listen(self):
                self.stream_closing()  # closing already, in another thread
        return None

    def stream_closing(self) -> None:
        """The consumer's stream is about to close, its body still open (any
        thread): make the back-edge now, while the stream exists; it covers
        what the body enqueued so far, all it can (nothing runs on a closed
        stream after). The exit makes none."""
        self._edge_once()

    def back_edge(self) -> None:
        """At the body's exit: the producer's stream waits for what the body
        enqueued on the consumer's stream. Only enqueues GPU work."""
        try:
            self._edge_once()
        finally:  # (after: a close meanwhile still calls the listener, which waits)
            s = self._edge_stream
            if s is not None and s._lifetime is not None:
                s._lifetime.forget(self)

    def _edge_once(self) -> None:
        """The back-edge, once, by whichever comes first: the exit or the
        close. Made under the lock, so a close in another thread waits for the
        exit's record before it destroys the stream (a record, only enqueued)."""
        with self._edge_lock:
            if self.edge is _Edge.DUE:
                self.edge = _Edge.DONE
                self._join_back()

    def _join_back(self) -> None:
        s, producer = self._edge_stream, self.producer
        assert s is not None and producer is not None
        if producer.generation and not is_open(producer):
            return  # the producer's stream was closed: nothing more can write there (its
            # handle may name another stream now, which must not be made to wait)
        self.sched.join(
            producer.handle,
            s._key(),
            keepalive=self.view,
            what="consuming() exit",
            waiter_id=producer,
        )


class _UntrackedOptOut(_Handoff):
    mode = Mode.UNTRACKED_OPT_OUT
    to_stream = True  # (see _TrackedOptOut)


class _Ready(_Handoff):
    mode = Mode.READY
    to_stream = True

    def begin(self, me: Owner) -> Blocked | None:
        if self.stream is not None:
            self.view = self.view._on_stream(self.stream.handle, self.stream._key())
            self._declare_stream_read(self.stream)
        return None

    def finish(self, *, complete: bool) -> None:
        if self.stream is None:
            self._declare_host_read(complete, self)


class _DLPackHost(_UntrackedHost):
    """The view names a landing stream of the scheduler's (``landing``), onto
    which ``__dlpack__`` joined; it goes back to the scheduler when finished."""

    mode = Mode.DLPACK_HOST
    landing: Stream | None = None

    def finish(self, *, complete: bool) -> None:
        try:
            super().finish(complete=complete)
        finally:
            landing, self.landing = self.landing, None
            if landing is not None:
                self.sched.landed(landing)


class _DLPackEnqueue(_Handoff):
    """``__dlpack__`` ordered ``s`` already."""

    mode = Mode.DLPACK_ENQUEUE
    to_stream = True

    def begin(self, me: Owner) -> Blocked | None:
        assert self.stream is not None
        self.view = self.view._on_stream(self.stream.handle, self.stream._key())
        self._declare_stream_read(self.stream)
        return None


class _DLPackOptOut(_Ready):
    """A view handed to ``stream=s`` keeps its owner (see ``_TrackedOptOut``)."""

    mode = Mode.DLPACK_OPT_OUT


#: the ``me`` passed to the ``begin`` of rows that never look at it (``needs_owner``)
_NOBODY: Owner = (0, None)

_ROWS: dict[Mode, type[_Handoff]] = {
    row.mode: row
    for row in (
        _TrackedHost,
        _TrackedEnqueue,
        _TrackedOptOut,
        _UntrackedHost,
        _UntrackedEnqueue,
        _UntrackedOptOut,
        _Ready,
        _DLPackHost,
        _DLPackEnqueue,
        _DLPackOptOut,
    )
}


def _handoff(
    obj: object, stream: object, sync: object, backend: Backend, protocol: object = None
) -> _Handoff:
    """Choose the row for ``obj``: validation and lookups only, no effects but
    a DLPack producer's join (a capsule is taken here)."""
    synced = _sync_flag(sync)
    found = lookup(obj, backend, sync=synced)
    if found is not None:  # (a TrackedArray of another backend: its backend's stream)
        work, view = found
        s = None if stream is None else as_stream(stream, work.backend)
        mode = plan(tracked=True, producer_stream=None, stream=s, synced=synced)
        row = _ROWS[mode]
        assert issubclass(row, _Tracked)
        # (its own backend's: a host wait asks that backend of its events, also
        # while another backend is current)
        return row(scheduler_for(work.backend, work.device), view, s, work)
    s = None if stream is None else as_stream(stream, backend)
    dlpack, cai = choose_protocol(obj, protocol)
    if dlpack:
        return _dlpack_handoff(obj, s, synced, backend)
    view = parse(obj) if cai is Unread.UNREAD else parse_read(obj, cai)  # read once
    mode = plan(tracked=False, producer_stream=view.stream, stream=s, synced=synced)
    # An untracked row uses its scheduler for the backend's join alone (events
    # come from the producer's stream's device): neither the array's device
    # (cudaPointerGetAttributes on a GPU) nor the current one is asked.
    return _ROWS[mode](any_scheduler(backend), view, s)


def _tracked_host(t: TrackedArray, sync: object, backend: Backend) -> ArrayView | _Handoff:
    """The TRACKED_HOST row of ``t`` (``stream=None``), its common case first:
    when the buffer's own interface names no busy stream and nothing is open,
    pending or left to fence, the consume is complete, and the view comes
    back at once, with no handoff built and no owner asked. Otherwise the row,
    given the interface already read (read once). Never blocks: reads the
    interface (user code) and takes the array's lock."""
    work = t._work
    # (the sanitizer declares the host's read in the row; another backend's
    # array goes through the row, which waits on that backend)
    if not _sync_flag(sync) or _observe.active or work.backend is not backend:
        return _handoff(t, None, sync, backend)
    release_holds()  # (the lookup's bounded step)
    own = work.own_stream(sync=True)
    view = t.view
    if own is None and work.idle_for_host():  # (the view names no stream, as the row's)
        return view if view.stream is None else view.with_stream(None)
    row = _TrackedHost(scheduler_for(backend, work.device), view, None, work)
    row.own = own
    return row


def _dlpack_handoff(obj: object, s: Stream | None, synced: bool, backend: Backend) -> _Handoff:
    device = cuda_device_of(obj)  # (asked once: the capsule must be on it)
    sched = scheduler_for(backend, device)
    mode = plan(tracked=False, producer_stream=None, stream=s, synced=synced, dlpack=True)
    if mode is Mode.DLPACK_HOST:  # (a stream of its own: see Scheduler.landing)
        landing = sched.landing()
        try:
            view = take(obj, landing.handle, device)
        except BaseException:
            sched.landed(landing)
            raise
        row = _DLPackHost(sched, view, s)
        row.landing = landing
        return row
    lent = s if mode is Mode.DLPACK_ENQUEUE else None
    with lending(lent):  # (a tracked producer of ours keeps the consumer's read open on s)
        view = take(obj, None if lent is None else lent.handle, device)
    return _ROWS[mode](sched, view, s)


def _handoffs(
    objs: Sequence[object], stream: object, sync: object, protocol: object = None
) -> list[_Handoff]:
    check_protocol(protocol)  # also for tracked objects, which never ask which
    backend = current_backend()  # each lookup releases completed holds (a bounded step)
    return [_handoff(obj, stream, sync, backend, protocol) for obj in objs]


def _keep_owner(h: _Handoff, *, block: bool = False) -> ViewLease | None:
    if h.stream is None or not h.to_stream:
        return None
    return hold_view_owner(h.view, h.stream, block=block)


async def _run(handoffs: list[_Handoff], timeout: float | None) -> None:
    """Begin every handoff, then wait for them all on the host, yielding.

    Onto a stream, the cancellation point comes first: the call returns as
    soon as the handoffs have begun, with no await in between, so the
    consumer enqueues its reads before another task can write the buffer (a
    write in between would be ordered after none of them). On the host, the
    wait that follows is the cancellation point."""
    deadline = None if timeout is None else anyio.current_time() + timeout
    to_stream = bool(handoffs) and handoffs[0].stream is not None  # (one stream for all)
    if to_stream:
        await checkpoint()
    begun: list[_Handoff] = []
    complete = False
    try:
        me = _NOBODY
        for h in handoffs:  # (no generator: this is every await consume)
            if h.needs_owner:
                me = current_owner()
                break
        i = 0
        while i < len(handoffs):
            h = handoffs[i]
            blocked = h.begin(me)
            if blocked is None:
                if i == len(begun):  # (begun is always a prefix of handoffs)
                    begun.append(h)
                i += 1
                continue
            await wait_block_async(blocked.block, deadline)
            if to_stream:  # the ones begun before this await: begun again after it (a
                i = 0  # write in between is ordered then), so none returns across an await
        events = [e for h in handoffs for e in h.events]
        if events:
            left = None if deadline is None else max(0.0, deadline - anyio.current_time())
            await wait_for_events(handoffs[0].sched.backend, events, timeout=left, given=timeout)
        elif not to_stream:
            await checkpoint()
        complete = True
    finally:
        if in_collection():  # the task of a closed event loop, collected: this thread
            later(functools.partial(_finish_all, begun, complete=complete))  # may hold a lock
        else:
            _finish_all(begun, complete=complete)


def _finish_all(begun: list[_Handoff], *, complete: bool) -> None:
    """Finish every handoff begun, even when one's finish raises (a hazard the
    sanitizer names, say): the others' events and pins must be let go too.
    Once all are finished, raises the first error, or the first interrupt or
    cancellation (not an ``Exception``) if one came, with the first error as
    its context."""
    first: BaseException | None = None
    stop: BaseException | None = None
    for h in begun:
        try:
            h.finish(complete=complete)
        except BaseException as exc:  # noqa: PERF203 - each must run
            if stop is None and not isinstance(exc, Exception):
                stop = exc
            if first is None:
                first = exc
    if stop is not None and stop is not first:
        if stop.__context__ is None:
            stop.__context__ = first
        raise stop
    if first is not None:
        raise first


async def consume(
    obj: Any,
    *,
    stream: Any = None,
    sync: bool | None = None,
    timeout: float | None = None,
    protocol: Protocol | None = None,
) -> ArrayView:
    """Take ``obj`` (any CUDA Array Interface or DLPack object) once its
    producer's work allows.

    ``stream=None``: wait until the data is ready on the host, yielding to the
    event loop (the producer's stream is polled through one shared poller,
    never synchronized); ``view.stream`` is None. ``stream=s``: only enqueues
    GPU work: ``s`` waits for the producer's stream and the call returns at
    once (after one cancellation checkpoint); ``view.stream`` is ``s``'s handle.
    ``sync=False`` (or ``CAI_STREAMS_SYNC=0`` when ``sync`` is None) waits for
    nothing, and ``view.stream`` names the producer's stream (for a tracked
    array: its export stream, with the pending writes joined onto it; for a
    DLPack producer: None, or ``s``).

    A tracked array is waited for through its own pending writes, plus what
    its interface reports pending; every consumer of it is protected, not only
    the last: its next ``writing()`` waits for each. If another thread has a
    ``writing()`` block of it open, this waits (yielding) for the block to end.

    A DLPack producer (any object with ``__dlpack__`` and ``__dlpack_device__``
    whose interface, if any, is older than version 3 and so names no stream;
    ``protocol="cai"`` or ``"dlpack"`` forces one) is asked to order the stream
    the consumer uses: for ``stream=None``, a stream of the scheduler's with
    nothing else on it (a landing stream: the host waits for that producer
    alone), then polled; ``s`` otherwise; -1 (no synchronization) for
    ``sync=False``. Its tensor's deleter runs once, when ``view.owner`` is
    collected. A producer not on a CUDA device raises
    :class:`~cai_streams.InterfaceError`.

    Always a cancellation point; with ``stream=s`` it comes before the handoff,
    and the call returns as soon as ``s`` is ordered, with no await in between,
    so no other task can write the array before the reads you enqueue next.
    ``timeout`` (seconds) bounds everything and raises :class:`TimeoutError`;
    ``timeout=0`` takes data that is ready now.
    Cancelled or timed out, nothing leaks: each event goes back to the pool
    when its work completes, and the owner lives until then. A failed kernel
    before the handoff raises :class:`~cai_streams.CudaError`.
    """
    timeout = check_timeout(timeout)
    if stream is None and type(obj) is TrackedArray:
        check_protocol(protocol)
        got: ArrayView | _Handoff | None = None
        try:
            got = _tracked_host(obj, sync, current_backend())
            if isinstance(got, ArrayView):  # complete: the one cancellation point
                await checkpoint()
                return got
        except BaseException as exc:  # a kept traceback must not keep the owner
            release_frames(exc)
            got = obj = None
            raise
        handoff = got
        del got  # (only the handoff holds the view from here)
    else:
        (handoff,) = _handoffs([obj], stream, sync, protocol)
    try:
        await _run([handoff], timeout)
    except BaseException as exc:  # a kept traceback must not keep the view's owner
        release_frames(exc)
        del handoff, obj  # (the caller may have dropped it)
        raise
    _keep_owner(handoff)
    return handoff.view


async def consume_all(
    *objs: Any,
    stream: Any = None,
    sync: bool | None = None,
    timeout: float | None = None,
    protocol: Protocol | None = None,
) -> list[ArrayView]:
    """:func:`consume` for several arrays at once: their views, in order.

    One wait (yields to the event loop) covers all of them; ``timeout`` bounds
    the whole. The same array may appear more than once. If one fails or the
    call is cancelled, all are let go.
    """
    timeout = check_timeout(timeout)
    handoffs = _handoffs(objs, stream, sync, protocol)
    try:
        await _run(handoffs, timeout)
    except BaseException as exc:  # a kept traceback must not keep the views' owners
        release_frames(exc)
        del handoffs, objs  # (the caller may have dropped them)
        raise
    for h in handoffs:
        _keep_owner(h)
    return [h.view for h in handoffs]


def consume_blocking(
    obj: Any,
    *,
    stream: Any = None,
    sync: bool | None = None,
    timeout: float | None = None,
    protocol: Protocol | None = None,
) -> ArrayView:
    """:func:`consume` for synchronous code: **blocks** the calling thread.

    ``stream=None`` blocks until the data is ready on the host (at most
    ``timeout`` seconds, then :class:`TimeoutError`); ``stream=s`` only
    enqueues GPU work, as in :func:`consume` (it may block while another
    thread holds a ``writing()`` block of a tracked array). Never call it
    from a coroutine: about to wait in an event loop's thread, it gives
    :class:`~cai_streams.LoopBlockingWarning`.
    """
    timeout = check_timeout(timeout)
    check_protocol(protocol)
    if stream is None and type(obj) is TrackedArray:
        try:
            got = _tracked_host(obj, sync, current_backend())
        except BaseException as exc:  # a kept traceback must not keep the owner
            release_frames(exc)
            obj = None
            raise
        if isinstance(got, ArrayView):
            return got  # complete: nothing was waited for or pinned
        handoff = got
        del got  # (only the handoff holds the view from here)
    else:
        handoff = _handoff(obj, stream, sync, current_backend(), protocol)
    limit = BLOCK_TIMEOUT if timeout is None else timeout
    deadline = time.monotonic() + limit
    me = current_owner() if handoff.needs_owner else _NOBODY
    blocked: Blocked | None = None
    try:
        while (blocked := handoff.begin(me)) is not None:
            wait_block_sync(blocked.block, me, deadline, "consume_blocking()")
    except BaseException as exc:  # a kept traceback must not keep the view's owner
        release_frames(exc)
        del handoff, obj  # (the caller may have dropped it)
        blocked = None  # (another thread's block of the array)
        raise
    try:
        if handoff.events:  # complete work (the common case) has nothing to wait for
            left = None if timeout is None else max(0.0, deadline - time.monotonic())
            wait_blocking(
                handoff.sched.backend, handoff.events, timeout=left, keepalive=obj, given=timeout
            )
    except BaseException as exc:  # a kept traceback must not keep the view's owner
        handoff.finish(complete=False)
        release_frames(exc)
        del handoff, obj  # (the caller may have dropped it)
        raise
    handoff.finish(complete=True)
    _keep_owner(handoff)
    return handoff.view


@asynccontextmanager
async def consuming(
    obj: Any,
    *,
    stream: Any = None,
    sync: bool | None = None,
    timeout: float | None = None,
    protocol: Protocol | None = None,
) -> AsyncIterator[ArrayView]:
    """``async with consuming(obj, stream=s) as view:`` :func:`consume`, and on
    exit make the producer wait for the work enqueued on ``s`` in the block.

    On exit (also on an exception or cancellation) the producer's stream (or,
    for a tracked array, its pending reads) is ordered after ``s``, so the
    producer cannot overwrite the buffer while the consumer still reads it:
    the spec's rule. Exiting only enqueues GPU work. With ``stream=None`` the
    consumer's reads were on the host and nothing is needed.

    For a tracked array and ``stream=s``, the body is also a read block, as
    ``t.reading(s)`` is: what it enqueues on ``s`` counts as read wherever it
    comes, after an await too, and another thread's ``writing()`` of the
    array waits (bounded) until the body ends. Another task of this thread
    cannot wait without blocking the event loop: its ``writing()`` raises
    RuntimeError while the body is suspended at an await.
    """
    timeout = check_timeout(timeout)
    (handoff,) = _handoffs([obj], stream, sync, protocol)
    handoff.blocking = True
    try:
        await _run([handoff], timeout)
    except BaseException as exc:  # a kept traceback must not keep the view's owner
        release_frames(exc)
        del handoff, obj  # (the caller may have dropped it)
        raise
    lease: ViewLease | None = None
    try:
        lease = _keep_owner(handoff, block=True)
        yield handoff.view
    finally:
        try:
            handoff.back_edge()
        finally:  # (the owner's hold, whatever the back-edge met)
            if handoff.stream is not None and handoff.to_stream:
                view_done(handoff.view, handoff.stream, lease)
