"""Stream-ordered lifetime: ``hold(owner, until=stream)``, and views that keep
their owner until the consumer's stream has passed the work enqueued while the
view was in use.

A hold records one pooled event on the stream and keeps the owner until the
event completes (see ``_hold_table``); it only enqueues. A view handed to a
stream (``consume(stream=s)``) gets a :class:`ViewLease`, counted in its
owner's lease on ``s``: the lease keeps the owner too, and once its last view
is let go a hold is recorded on ``s``, which covers everything enqueued while
its views were in use. The record is made:

* on ``consuming()`` exit, in the consumer's thread (the stream is alive);
* when the view is released: a weakref callback only queues the lease (it
  runs in any thread, inside any lock); the next library call or poller pass
  records it, from whatever thread that is. That is safe only on streams
  whose life the library sees (``Stream._records_later``): a stream it made
  (closing it records first), the legacy stream, a wrapped stream object the
  lease keeps alive, and handle 2 (from another thread: on the legacy stream,
  which waits for it). A bare handle of another library's stream may be gone
  or reused by then: no lease is made, and the owner lives as long as the view;
* when the consumer's stream (one the library made) closes with the view alive.

The views of one owner handed to one stream share one lease, which counts
the views in use and records once, when the last is let go: a later record on
the same stream covers the earlier views' work in stream order (a released
view while another is in use is counted in ``holds_merged``). The queue
settles a view only at the second library call after its release
(``_hold_table``), which lets the common "consume, drop, consume again" loop
record no hold per handoff: the next view has joined the lease by then.

A stream that is capturing a graph cannot take a record whose event is then
queried: ``hold`` raises :class:`~cai_streams.CaptureError`, and a lease waits
until the capture has ended.
"""

from __future__ import annotations

import enum
import functools
import sys
import threading
import warnings
import weakref
from typing import Final

from . import _capture_guard, _observe
from ._backend import LEGACY_DEFAULT_STREAM, PER_THREAD_DEFAULT_STREAM, current_backend
from ._deferred import in_collection, later
from ._device import OnDevice
from ._errors import CaptureError, CudaError, CudaWarning, DeviceFaultError
from ._events import EventPool, Mark, lone, pool_for, record
from ._hold_table import Hold, Ranges, table, tick
from ._identity import Lifetime, StreamId, is_open, lifetime_of, thread_serial
from ._interface import ArrayView, _set_leases, byte_range, parse
from ._stream import Stream, as_stream

__all__ = ["LeaseState", "ViewLease", "hold", "hold_view_owner", "view_done"]

#: owners whose hold could not be recorded (a driver error): kept for good,
#: as a leak is better than a block reused under pending work
_kept: list[object] = []


def nbytes_of(owner: object) -> int:
    """The bytes ``owner`` says it has (``nbytes``), else 0. Reads no interface."""
    nbytes = getattr(owner, "nbytes", 0)
    return nbytes if isinstance(nbytes, int) and not isinstance(nbytes, bool) else 0


def _view_ranges(view: ArrayView) -> Ranges:
    """The memory ``view`` touches, for the sanitizer: a released hold vouches
    that the work before it on that memory is done before the memory is freed.
    Empty while nobody observes (it costs nothing then)."""
    if not _observe.active or not view.nbytes:
        return ()
    return (byte_range(view),)


def _owner_ranges(owner: object) -> Ranges:
    """:func:`_view_ranges` of what ``owner`` exposes: a tracked array's wrapped
    array (not exported), a view, or what its CUDA Array Interface says;
    empty when there is none to read (a DLPack-only producer, any object)."""
    if not _observe.active:
        return ()
    inner = getattr(owner, "_cai_streams_array", None)
    try:
        view = parse(owner if inner is None else inner)
    except Exception:  # noqa: BLE001 - no interface: nothing to vouch for
        return ()
    return _view_ranges(view)


def _record_hold(
    key: StreamId, owner: object, nbytes: int, *, stacklevel: int, ranges: Ranges = ()
) -> None:
    """Record one pooled event on ``key`` (the calling thread's for handle 2)
    and keep ``owner`` (its memory: ``ranges``) until it completes. Only enqueues."""
    pool = pool_for(key.backend, key.device)
    event = pool.acquire()  # its queries run in the relaxed capture mode
    try:
        with OnDevice(key.backend, key.device, key.handle):
            mark = record(key.backend, event, key)
    except CaptureError:  # the legacy stream, a blocking stream's capture begun meanwhile
        _CapturedRecord(pool, event, key, owner, nbytes, ranges, recorded=False).wait()
        return
    except BaseException:
        pool.release(event)
        raise
    if _taken_by_a_capture(mark, key):  # asked once more: either way, it waits
        _CapturedRecord(pool, event, key, owner, nbytes, ranges, recorded=True).wait()
        return
    table.add(Hold(pool, event, mark, owner, nbytes, ranges), stacklevel=stacklevel + 1)


def _taken_by_a_capture(mark: Mark, on: StreamId) -> bool:
    """Whether a capture may have the record just made at ``mark`` on ``on``:
    its mark says so, or the stream captures now (one begun by another thread
    between record()'s ask and the record). A record on the legacy stream that
    succeeded is in no capture."""
    return mark.captured or (on.handle != LEGACY_DEFAULT_STREAM and _waits_for_capture(on))


class _Retry(enum.Enum):
    """Where a :class:`_CapturedRecord` is."""

    WAITING = "waiting for the capture to end"
    DONE = "recorded again, or given up"


class _CapturedRecord:
    """A hold whose record landed in a graph capture that another thread began
    between the caller's capture check and the record: the event stands for
    nothing that runs on the stream, and a query of it would invalidate the
    capture. It waits with the released views (``settle``); once the stream
    has stopped capturing, the event is recorded again, after everything
    enqueued there so far (the work the hold is for among it), and the hold
    joins the table. The owner is kept meanwhile. A stream of this library's
    that closes first records it while it still exists (``stream_closing``);
    one whose end the library cannot see (another library's handle) keeps the
    owner for good: its handle may name another stream by the time it could."""

    __slots__ = (
        "_lock",
        "event",
        "key",
        "lifetime",
        "nbytes",
        "owner",
        "pool",
        "ranges",
        "recorded",
        "state",
    )

    def __init__(
        self,
        pool: EventPool,
        event: int,
        key: StreamId,
        owner: object,
        nbytes: int,
        ranges: Ranges,
        *,
        recorded: bool,
    ) -> None:
        self.pool, self.event, self.key = pool, event, key
        self.owner, self.nbytes, self.ranges = owner, nbytes, ranges
        #: whether the event may be recorded in a capture (never to be queried then)
        self.recorded = recorded
        self.state = _Retry.WAITING
        self._lock = threading.RLock()  # (a limit passed while adding may settle it)
        self.lifetime: Lifetime | None = None

    def wait(self) -> None:
        """Queue it for :meth:`settle`, listening for its stream's close."""
        key = self.key
        if key.generation > 0:
            lifetime = lifetime_of(key.backend, key.handle)
            if lifetime is not None and lifetime.generation == key.generation:
                if lifetime.listen(self):
                    self.lifetime = lifetime
        elif key.handle not in (LEGACY_DEFAULT_STREAM, PER_THREAD_DEFAULT_STREAM):
            # another library's stream: its handle may name another stream by the
            # time the capture ends, and a record there would let the owner go early
            self._give_up("a graph capture began on it meanwhile, and its end cannot be seen")
            return
        table.released_views.append(self)

    def _give_up(self, why: object) -> None:
        self.state = _Retry.DONE
        self._release_event()
        _keep_for_good(self.owner, self.key, why, stacklevel=3)

    def _release_event(self) -> None:
        """Back to the pool: one the capture may hold is taken back once the
        stream stops capturing (never queried before: that would invalidate it)."""
        if self.recorded:
            self.pool.release(self.event, None, Mark(self.key, 0, captured=True))
        else:
            self.pool.release(self.event)

    def settle(self) -> bool:
        """Record again if the stream no longer captures; False to be asked later.
        Where a view's lease would record (another thread's handle 2: the
        legacy stream), and with the same outcomes when it cannot."""
        with self._lock:
            if self.state is _Retry.DONE:
                return True
            if self.key.generation > 0 and not is_open(self.key):
                self._give_up("the stream closed while a capture kept its record")
                return True
            return self._record()

    def stream_closing(self) -> None:
        """Its stream is about to close (no capture is under way on it then):
        record while it exists."""
        with self._lock:
            if self.state is _Retry.WAITING and not self._record():
                self._give_up("the stream closed while a capture kept its record")

    def _record(self) -> bool:
        """``_lock`` held: record again now if the stream does not capture."""
        on = _record_target(self.key)
        if _waits_for_capture(on):
            return False
        try:
            with OnDevice(on.backend, on.device, on.handle):
                mark = record(on.backend, self.event, on)
        except CaptureError:  # the legacy stream, while a blocking stream began one
            return False
        except DeviceFaultError:  # the device faulted: the work after the fault never runs
            self.state = _Retry.DONE
            self._release_event()
            self._forget()
            return True
        except CudaError as exc:  # the stream is gone: its work may still run
            self._give_up(exc)
            self._forget()
            return True
        self.recorded = True
        if _taken_by_a_capture(mark, on):  # a capture begun again meanwhile
            return False
        self.state = _Retry.DONE  # first: the add may settle the queue, this among it
        self._forget()
        hold = Hold(self.pool, self.event, mark, self.owner, self.nbytes, self.ranges)
        table.add(hold, stacklevel=3)
        return True

    def _forget(self) -> None:
        if self.lifetime is not None:
            self.lifetime.forget(self)
            self.lifetime = None


def hold(owner: object, *, until: object) -> None:
    """Keep ``owner`` alive until the work enqueued on ``until`` so far has completed.

    Only enqueues GPU work (one pooled event recorded on ``until``); never
    blocks, needs no event loop, and may be called from any thread. ``until``
    is anything :meth:`Stream.wrap` takes; handle 2 is the calling thread's
    per-thread default stream. The owner is let go by the shared poller, or
    at a later library call, once the event is complete.

    Use it when work enqueued on a stream reads memory whose owner you are
    about to drop: a caching allocator (CuPy's, PyTorch's, the simulator's)
    hands the block to the next allocation at once, whatever is pending on
    it. Past ``hold_limit_count`` or ``hold_limit_bytes``
    (:func:`configure`), completed holds are released first, then a
    :class:`HoldWarning` is given once. Raises :class:`CaptureError` when
    ``until`` is capturing a graph: hold the owner for as long as the graph
    lives instead (or call ``hold`` on the stream the graph is launched on,
    after the launch). Safe in a finalizer: run by a garbage collection (which
    may start inside the library, holding its locks), it records through the
    backend alone, and the hold joins the others at the next library call.
    """
    tick()
    if owner is None:
        raise TypeError("hold() needs the object to keep alive, got None")
    backend = current_backend()
    s = as_stream(until, backend)
    lifetime = s._lifetime
    # A closed Stream refuses, unless collected or closed in this collection,
    # before the finalizer calling this: its end waits for the next library
    # call, and it exists till then
    if not (in_collection() and s._closed and lifetime is not None and not lifetime.closed):
        s.handle  # noqa: B018 - (raises)
    key = s._key()
    # (asked as every handoff asks: the legacy stream while a blocking stream
    # captures raises CaptureError with advice, not the driver's error)
    if _capture_guard.capturing(backend, key) is True:
        raise CaptureError(
            f"hold() cannot record on {s!r}: it is capturing a graph, and an event "
            "recorded in a capture cannot be queried. Keep the owner alive as long "
            "as the graph, or call hold(owner, until=stream) after the graph's "
            "launch on the stream it was launched on."
        )
    ranges = _owner_ranges(owner)
    if in_collection():  # a finalizer, maybe inside a library lock
        _record_in_collection(key, owner, nbytes_of(owner), ranges)
        return
    _record_hold(key, owner, nbytes_of(owner), stacklevel=2, ranges=ranges)


def _record_target(key: StreamId) -> StreamId:
    """Where to record from this thread for work on ``key``: that stream, or
    for another thread's handle 2, the legacy stream (which waits for it)."""
    if key.handle == PER_THREAD_DEFAULT_STREAM and key.thread != thread_serial():
        return StreamId(key.backend, key.device, LEGACY_DEFAULT_STREAM, 0, 0)
    return key


def _waits_for_capture(on: StreamId) -> bool:
    """Whether a record on ``on`` must wait for a capture to end: ``on``
    captures, or it is the legacy stream while a blocking stream of its device
    captures (another thread's handle 2, say: any use of the legacy stream
    would invalidate that capture). A stream that cannot say (gone, faulted)
    need not: the record that follows fails the same way, and deals with it."""
    try:
        with OnDevice(on.backend, on.device, on.handle):
            return _capture_guard.capturing(on.backend, on) is True
    except CaptureError:  # the legacy stream, while a blocking stream captures
        return True
    except CudaError:
        return False


def _keep_for_good(owner: object, key: StreamId, why: object, stacklevel: int) -> None:
    """A hold that cannot be recorded: its stream's work may still run, and a
    leak is better than a block reused under it."""
    _kept.append(owner)
    warnings.warn(
        f"kept {type(owner).__name__} alive for good: could not record a "
        f"hold on {key.describe()}: {why}",
        CudaWarning,
        stacklevel=stacklevel + 1,
    )


def _record_in_collection(key: StreamId, owner: object, nbytes: int, ranges: Ranges) -> None:
    """``hold()`` inside a garbage collection (a finalizer, maybe while this
    thread holds a library lock): the record is made now, on a new event and
    by the backend alone (no library lock), so it lands where it was asked
    for, whatever becomes of the stream or its handle; the hold joins the
    table at the next library call (``_deferred``), alone: where its record
    landed among the stream's others is not known (``_events.lone``)."""
    if sys.is_finalizing():  # the process is ending: its streams with it
        return
    backend = key.backend
    try:
        with OnDevice(backend, key.device, key.handle):
            event = backend.create_event(key.device)
            try:
                backend.record(event, key.handle)
            except BaseException:
                backend.destroy_event(event)
                raise
            # a capture another thread began since hold()'s check has the record
            # (the legacy stream's is in none: a capture never takes it)
            captured = (
                key.handle != LEGACY_DEFAULT_STREAM and backend.capture_status(key.handle) != "none"
            )
    except DeviceFaultError:  # the device faulted: work after the fault never runs
        return
    except CudaError as exc:
        _keep_for_good(owner, key, exc, stacklevel=3)
        return
    later(functools.partial(_join_table, key, event, owner, nbytes, ranges, captured))


def _wait_again(hold: Hold) -> None:
    """A hold in the table whose query says a capture took its record (one
    begun and ended between the checks around the record): it waits again,
    keeping its owner, and records again once no capture is under way."""
    _CapturedRecord(
        hold.pool, hold.event, hold.mark.key, hold.owner, hold.nbytes, hold.ranges, recorded=True
    ).wait()


table.taken_again = _wait_again


def _join_table(
    key: StreamId, event: int, owner: object, nbytes: int, ranges: Ranges, captured: bool
) -> None:
    pool = pool_for(key.backend, key.device)  # the event returns to it once complete
    pool.adopt(event)
    if captured:
        _CapturedRecord(pool, event, key, owner, nbytes, ranges, recorded=True).wait()
        return
    table.add(Hold(pool, event, lone(key), owner, nbytes, ranges), stacklevel=3)


class LeaseState(enum.Enum):
    """Where the lease of one owner on one stream stands."""

    #: a view of it may still be in use: the lease keeps its owner as well
    IN_USE = "in use"
    #: a hold is recorded for everything enqueued while its views were in use
    HELD = "held"
    #: nothing left to record (the stream closed during a capture, or the
    #: device faulted): the lease let go
    DROPPED = "dropped"


class _Use(enum.Enum):
    """Where one view handed to a stream stands with its lease."""

    #: counted among the lease's views in use
    COUNTED = "counted"
    #: let go of (its release was settled, or its ``consuming()`` block ended)
    DONE = "done"
    #: let go of, its record waiting for a capture to end: not counted yet
    UNCOUNTED = "uncounted"


def _view_released(ref: weakref.ref[ArrayView]) -> None:
    # A weakref callback: any thread, inside any lock. Only queue.
    table.released_views.append(ref)  # type: ignore[arg-type]


#: objects a lease keeps alive for the views that joined it (see _Lease.others);
#: past this, a view starts a new lease, and the full one records on its own
MAX_KEPT: Final = 8

#: leases in use, by (stream, id of owner): while one is here it keeps its
#: owner (so the id names one object), and every view of that owner handed to
#: that stream joins it; it records once, after its last view is let go
_in_use: dict[tuple[StreamId, int], _Lease] = {}
_in_use_lock = threading.Lock()  # bookkeeping only


class _Lease:
    """The views of one owner handed to one stream: the owner is held until
    the stream passes the work enqueued while any of them was in use. One
    record covers them all (stream order), made when the last is let go."""

    __slots__ = (
        "_lock",
        "index",
        "key",
        "keepalive",
        "lifetime",
        "nbytes",
        "others",
        "owner",
        "ranges",
        "refs",
        "state",
        "stream",
        "views",
    )

    def __init__(self, view: ArrayView, stream: Stream, key: StreamId) -> None:
        #: serializes recording against the stream's close in another thread
        self._lock = threading.RLock()
        self.key = key  # for handle 2: the consumer's thread's stream
        self.index = (key, id(view.owner))
        self.lifetime: Lifetime | None = stream._lifetime
        # an owned stream must not be destroyed by its collection before the
        # record; a wrapped stream object stays alive even if the wrapper is closed
        self.stream: Stream | None = stream
        self.keepalive: object = stream._keepalive
        #: what else views joined through keeps alive (a Stream that owns the
        #: stream, another library's stream object), when the first was a bare
        #: handle, say: each may be all that keeps the stream alive
        self.others: list[object] = []
        self.owner: object = view.owner
        self.nbytes = view.nbytes
        #: the memory of its views, for the sanitizer (see _view_ranges)
        self.ranges: Ranges = ()
        self.state = LeaseState.IN_USE
        #: its views counted in use, and their weak references: a weakref
        #: calls back only while it lives (``_in_use_lock``)
        self.views = 0
        self.refs: dict[int, ViewLease] = {}

    def keeps(self, obj: object) -> bool:
        """``_in_use_lock`` held: whether ``obj`` is kept alive already."""
        return obj is self.stream or obj is self.keepalive or any(obj is x for x in self.others)

    def _target(self) -> StreamId:
        return _record_target(self.key)

    def record_unless_used(self, *, released: bool = False) -> bool:
        """``_lock`` held: record the hold now unless a view is in use again
        (its later record covers this work; counted as merged when ``released``,
        the caller's view being the one let go). False when the stream is
        capturing (asked again later)."""
        if self.state is not LeaseState.IN_USE:
            if released and self.state is LeaseState.HELD:
                with _in_use_lock:
                    table.merged += 1  # a later view's record covered it
            return True
        on = self._target()
        if _waits_for_capture(on):  # a driver call: another thread may join meanwhile
            return False
        with _in_use_lock:
            if self.views:
                if released:
                    table.merged += 1
                return True
            self._leave()
        self._record(on)
        return True

    def _leave(self) -> None:
        """``_in_use_lock`` held: no view joins it from now on."""
        if _in_use.get(self.index) is self:
            del _in_use[self.index]

    def _record(self, on: StreamId) -> None:
        """``_lock`` held, out of ``_in_use``: IN_USE -> HELD (or DROPPED)."""
        owner, stream, others, lifetime = self.owner, self.stream, self.others, self.lifetime
        try:
            # Done first: a limit passed while recording settles the queued
            # views, and may come back to this lease (the lock is re-entrant).
            # It still listens: the stream's owner closing it in another thread
            # waits for this lease's lock before destroying it.
            self._end(LeaseState.HELD)
            _record_hold(on, owner, self.nbytes, stacklevel=5, ranges=self.ranges)
        except DeviceFaultError:  # the device faulted: work after the fault never runs
            self._end(LeaseState.DROPPED)
        except CudaError as exc:  # the stream is gone: its work may still run
            self._end(LeaseState.DROPPED)
            _keep_for_good(owner, self.key, exc, stacklevel=5)
        finally:
            if lifetime is not None:
                lifetime.forget(self)  # (recorded: an owned stream may be destroyed now)
        del stream, others

    def _end(self, state: LeaseState) -> None:
        self.state = state
        self.owner = None
        self.stream = self.keepalive = None
        self.others = []

    def stream_closing(self) -> None:
        """The consumer's stream is closing: record while it exists, whatever
        view is still in use (nothing more runs on the stream)."""
        with self._lock:
            if self.state is not LeaseState.IN_USE:
                return
            with _in_use_lock:
                self._leave()
            on = self._target()
            if _waits_for_capture(on):
                self._end(LeaseState.DROPPED)  # no work of a capture will run on it
                if self.lifetime is not None:
                    self.lifetime.forget(self)
                return
            self._record(on)


class _InLease:
    """A view's uses counted in one lease (an entry of ``ArrayView._leases``:
    one per lease, however often the view is handed to its stream)."""

    __slots__ = ("kept", "lease", "uses")

    def __init__(self, lease: _Lease) -> None:
        self.lease = lease
        self.uses = 0
        #: the use that lasts until the view is collected (a handoff outside
        #: a ``consuming()`` block), once there is one: a view handed to the
        #: same stream again is counted by it, not by one more reference each
        #: time (a long-lived view handed on every request would grow the lease)
        self.kept: ViewLease | None = None


class ViewLease(weakref.ref[ArrayView]):
    """A view handed to a stream, counted in its owner's lease on that stream
    until it is released (collected) or its ``consuming()`` block ends."""

    __slots__ = ("entry", "lease", "use")

    def __new__(cls, view: ArrayView, lease: _Lease) -> ViewLease:
        return super().__new__(cls, view, _view_released)

    def __init__(self, view: ArrayView, lease: _Lease) -> None:
        """``_in_use_lock`` held: counts one use of ``view`` in ``lease``."""
        self.lease = lease
        self.use = _Use.COUNTED
        lease.views += 1
        lease.refs[id(self)] = self
        leases = view._leases
        for entry in leases:  # (one per lease it is counted in: a short list)
            if entry.lease is lease:
                break
        else:
            entry = _InLease(lease)
            if leases:  # the entries no use counts any more go (a lease per round
                leases[:] = [e for e in leases if e.uses]  # of a consuming() loop)
                leases.append(entry)
            else:
                _set_leases(view, [entry])
        entry.uses += 1
        self.entry: _InLease = entry

    def _let_go(self) -> bool:
        """COUNTED -> DONE; whether it was the lease's last view in use."""
        lease = self.lease
        with _in_use_lock:
            self.use = _Use.DONE
            lease.views -= 1
            self.entry.uses -= 1
            del lease.refs[id(self)]
            if lease.views or lease.state is not LeaseState.IN_USE:
                if lease.views:
                    table.merged += 1  # under the lock, as in record_unless_used
                return False
        return True

    def settle(self) -> bool:
        """The view was collected: record the hold now, from this thread, if
        it was the last of its lease in use. False when the stream is capturing."""
        lease = self.lease
        with lease._lock:
            if self.use is not _Use.COUNTED:
                released = self.use is _Use.UNCOUNTED
            elif not self._let_go():
                return True
            else:
                released = True
            done = lease.record_unless_used(released=released)
            if released:
                self.use = _Use.DONE if done else _Use.UNCOUNTED
            return done

    def end_use(self) -> None:
        """``consuming()`` exit, in the consumer's thread: record the hold now
        if this was the lease's last view in use (while capturing, the view's
        release records it instead)."""
        lease = self.lease
        with lease._lock:
            if self.use is not _Use.COUNTED or lease.state is not LeaseState.IN_USE:
                return
            if _waits_for_capture(lease._target()):
                return
            if self._let_go() and not lease.record_unless_used(released=True):
                self.use = _Use.UNCOUNTED
                table.released_views.append(self)  # retried once the capture ends

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other


def hold_view_owner(view: ArrayView, stream: Stream, *, block: bool = False) -> ViewLease | None:
    """``view`` was handed to ``stream``: keep ``view.owner`` until ``stream``
    has passed what is enqueued while the view is in use (until it is collected,
    or for ``block``, until :meth:`ViewLease.end_use`: a ``consuming()`` block).

    Call it in the thread of the handoff (handle 2 is that thread's stream).
    Only bookkeeping; nothing is enqueued now. None when nothing will be
    recorded: no owner, or a bare handle of a stream the library cannot see
    the end of (the owner then lives exactly as long as the view).
    """
    owner = view.owner
    if owner is None or not stream._records_later():
        return None
    key = stream._key()
    index = (key, id(owner))
    # what may end the stream when collected: a Stream that owns it, or the
    # object a wrapper keeps alive (another library's stream); a bare handle's
    # wrapper keeps nothing
    keep = stream if stream._owned else stream._keepalive
    with _in_use_lock:
        lease = _in_use.get(index)
        if lease is not None and keep is not None and not lease.keeps(keep):
            if len(lease.others) >= MAX_KEPT:  # a new object each handoff: bound the list
                lease._leave()  # it records once its own views are let go
                lease = None
            else:
                lease.others.append(keep)
        new = lease is None
        if lease is None:
            lease = _in_use[index] = _Lease(view, stream, key)
        lease.nbytes = max(lease.nbytes, view.nbytes)
        if not new and not block:
            kept = _kept_in(view, lease)
            if kept is not None:  # counted until collected already
                return kept
        ref = ViewLease(view, lease)
        if not block:
            ref.entry.kept = ref
        if _observe.active:
            ranges = _view_ranges(view)
            lease.ranges += tuple(r for r in ranges if r not in lease.ranges)
    if new and lease.lifetime is not None and not lease.lifetime.listen(lease):
        # the stream is closing: nothing more will run on it
        with lease._lock:
            with _in_use_lock:
                lease._leave()
            if lease.state is LeaseState.IN_USE:
                lease._end(LeaseState.DROPPED)  # (the owner may go: outside the index lock)
        return None
    return ref


def _kept_in(view: ArrayView, lease: _Lease) -> ViewLease | None:
    """``_in_use_lock`` held: the use counting ``view`` in ``lease`` until it
    is collected, if one still does."""
    for entry in view._leases:
        if entry.lease is lease:
            kept = entry.kept
            return kept if kept is not None and kept.use is _Use.COUNTED else None
    return None


def join_leases(source: ArrayView, derived: ArrayView) -> None:
    """``derived`` was made from ``source`` (``with_stream``): it joins each
    lease still counting ``source`` (once each), so the owner is held until
    each stream passes the work enqueued while ``derived`` is in use too. A
    lease whose ``consuming()`` block ended, or that recorded already, is not
    joined."""
    for entry in list(source._leases):
        lease = entry.lease
        with lease._lock, _in_use_lock:  # (as settle: no record in between)
            if entry.uses and lease.state is LeaseState.IN_USE:
                ref = ViewLease(derived, lease)
                ref.entry.kept = ref


def view_done(view: ArrayView, stream: Stream, lease: ViewLease | None) -> None:
    """``consuming()`` exit: the stream is known alive, so record the hold now,
    on a bare handle too. Only enqueues."""
    if lease is not None:
        lease.end_use()
    elif view.owner is not None and not stream.closed:
        key = stream._key()
        if not stream.backend.is_capturing(key.handle):
            _record_hold(key, view.owner, view.nbytes, stacklevel=3, ranges=_view_ranges(view))
