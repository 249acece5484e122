"""TrackedArray: the producer's view of a buffer whose pending work is tracked.

The state lives in the buffer's :class:`~cai_streams._pending.PendingWork`,
held by the scheduler; a TrackedArray is a handle on it. ``writing()`` and
``reading()`` declare the work enqueued in their block; an export joins the
pending writes onto one stream and adds the consumer's read.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Final

from ._access import Kind
from ._backend import Backend, current_backend
from ._blocks import Blocked, Owner, current_owner, wait_block_sync
from ._config import settings
from ._device import device_of, view_stream_id
from ._dlpack_export import export_view
from ._dlpack_import import cuda_device_of, has_dlpack
from ._errors import InterfaceError
from ._hold_table import tick as release_holds
from ._interface import ArrayView, byte_range, parse
from ._pending import PendingWork, ViewStream
from ._scheduler import export_stream_of, find_work, scheduler_for
from ._stream import Stream, as_stream
from ._unique import Unique

__all__ = ["TrackedArray", "export", "lookup", "track"]

#: seconds a synchronous call waits for another thread's writing()/reading() block
BLOCK_TIMEOUT: Final = 60.0


class TrackedArray(Unique):
    """An array whose pending work is tracked across streams (see :func:`track`).

    ``array`` is the wrapped object, ``view`` its validated interface and
    ``export_stream`` the stream exports join onto by default. The pending work
    belongs to the array, not to this object: dropping it forgets nothing, and
    ``cs.track(array)`` gives a TrackedArray over the same state. Its blocks
    and exports only enqueue GPU work; each waits only for another thread's
    conflicting open block, bounded (each method says so).
    """

    __slots__ = ("__weakref__", "_work", "array", "view")

    array: Any
    view: ArrayView
    _work: PendingWork

    def __init__(self) -> None:
        raise TypeError("use cai_streams.track(obj) to track an array")

    @property
    def _cai_streams_array(self) -> Any:
        return self.array

    @property
    def export_stream(self) -> Stream:
        """The stream :meth:`export` joins onto when given none: the one given
        to :func:`track` while it is open, else the device's shared export
        stream, which cai_streams owns (what is returned for it is a borrowed
        wrapper: closing it only forgets it). Does not block."""
        work = self._work
        stream = export_stream_of(work)
        if stream is scheduler_for(work.backend, work.device).export_stream:
            return stream._same_stream()  # (its identity; never closes the shared one)
        return stream

    @contextmanager
    def writing(self, stream: object, *, disjoint: bool = False) -> Iterator[TrackedArray]:
        """Work enqueued on ``stream`` inside the block writes this array.

        On enter, ``stream`` waits for all pending reads and writes on other
        streams; on exit, the write is recorded as pending. ``disjoint=True``
        declares that the block writes a part no other disjoint write touches
        (the spec's streams 7, 9 and 15 each filling a third): it is not
        ordered after other disjoint writes, so the writers run concurrently,
        but it is after every read and every whole-array write; an export
        joins them all.

        Only enqueues GPU work. If another thread has a conflicting block of
        this array open, waits for it to end (bounded); inside your own block,
        what it enqueued so far counts. A read-only array (its interface's
        ``data`` says so, as JAX's do) raises ValueError.
        """
        s = as_stream(stream, self._work.backend)
        if self._work.layout.readonly:
            raise ValueError(
                f"writing() of a read-only array ({type(self.array).__qualname__}: its "
                "__cuda_array_interface__ data[1] is True): its producer does not allow "
                "writes; copy it to a writable array, or use reading()"
            )
        block = _enter(self._work, Kind.WRITE, disjoint, s, "writing()")
        try:
            yield self
        finally:
            self._work.leave(block)

    @contextmanager
    def reading(self, stream: object) -> Iterator[TrackedArray]:
        """Work enqueued on ``stream`` inside the block reads this array.

        On enter, ``stream`` waits for pending writes on other streams; on exit,
        the read is recorded as pending, so a later write elsewhere waits for it
        (write after read). Only enqueues GPU work; waits only for another
        thread's open ``writing()`` block of this array (bounded).
        """
        s = as_stream(stream, self._work.backend)
        block = _enter(self._work, Kind.READ, False, s, "reading()")
        try:
            yield self
        finally:
            self._work.leave(block)

    def export(self, stream: object = None) -> dict[str, Any]:
        """A version 3 CAI dict with all pending writes joined onto one stream.

        ``stream`` defaults to this array's export stream. No pending work:
        ``stream`` is None. Otherwise the export stream waits for an event on
        each other stream with pending writes (none when they are all on the
        export stream), and what the consumer enqueues there counts as a read
        of this array, so the next ``writing()`` waits for it; earlier
        consumers stay protected too. Only enqueues GPU work; waits only for
        another thread's open ``writing()`` block of this array (bounded).
        """
        return _export_work(self._work, stream)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """:meth:`export` onto the export stream: reading it enqueues the join
        and adds a consumer read, as a consumer reading it is about to do."""
        return self.export()

    def __dlpack__(
        self,
        *,
        stream: int | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        """A DLPack capsule, with all pending writes joined onto ``stream``.

        ``stream`` is the consumer's, as the array API standard says for CUDA:
        None or 1 the legacy default stream, 2 the per-thread default stream,
        a ``cudaStream_t``, or -1 for no synchronization; 0 raises ValueError.
        What the consumer enqueues on ``stream`` from now on counts as a read,
        as for :meth:`export`. A versioned capsule when ``max_version`` is
        (1, 0) or newer. BufferError for another ``dl_device`` or ``copy=True``
        (the memory is shared, never copied). Only enqueues GPU work; waits
        only for another thread's open ``writing()`` block (bounded).
        """
        work = self._work
        return export_view(
            self.view,
            work.backend,
            work.device,
            self,
            stream=stream,
            max_version=max_version,
            dl_device=dl_device,
            copy=copy,
            join=dlpack_join(self, work.backend),
        )

    def __dlpack_device__(self) -> tuple[int, int]:
        """``(2, device)``: kDLCUDA and the device holding the array. Does not block."""
        return (2, self._work.device)

    def pending_streams(self) -> dict[str, list[int]]:
        """Stream handles with pending writes and reads (for inspection). Does
        not block: takes the array's lock only as long as bookkeeping takes."""
        return self._work.pending_streams()

    def __repr__(self) -> str:
        return (
            f"<TrackedArray of {type(self.array).__name__}, export stream {self.export_stream!r}>"
        )


_setters: dict[str, Any] = {
    name: getattr(TrackedArray, name).__set__
    for name in TrackedArray.__slots__
    if name != "__weakref__"
}


def _enter(work: PendingWork, kind: Kind, disjoint: bool, s: Stream, what: str) -> Any:
    me = current_owner()
    deadline = time.monotonic() + BLOCK_TIMEOUT
    while True:
        got = work.try_enter(kind, disjoint, s, me)
        if not isinstance(got, Blocked):
            return got
        wait_block_sync(got.block, me, deadline, what)


def _sync_handoff(attempt: Any, what: str) -> Any:
    """Run ``attempt(me)`` until no other thread's block is in the way."""
    me: Owner = current_owner()
    deadline = time.monotonic() + BLOCK_TIMEOUT
    while True:
        got = attempt(me)
        if not isinstance(got, Blocked):
            return got
        wait_block_sync(got.block, me, deadline, what)


def _export_work(work: PendingWork, stream: object) -> dict[str, Any]:
    given = _given(stream, work.backend)
    cai = work.layout._v3()  # (its own dict: whatever its stream names now)
    if not settings.export_stream:  # None always: not the stream the array was tracked on
        cai["stream"] = None
        return cai
    if given is not None:
        cai["stream"] = _export_onto(work, given)
        return cai
    x = export_stream_of(work)
    try:
        cai["stream"] = _export_onto(work, x)
    except ValueError:
        if not (x.closed and x is work.export_stream):
            raise
        # closed meanwhile, in another thread: the shared export stream takes it
        cai["stream"] = _export_onto(work, export_stream_of(work))
    return cai


def _given(stream: object, backend: Backend) -> Stream | None:
    """An export's ``stream`` argument, checked whether or not anything is
    pending (a closed Stream raises ValueError, as a wrong type TypeError)."""
    if stream is None:
        return None
    s = as_stream(stream, backend)
    s.handle  # noqa: B018 - (a closed Stream raises)
    return s


def _export_onto(work: PendingWork, x: Stream) -> int | None:
    return _sync_handoff(lambda me: work.try_export(x, me), "export()")  # type: ignore[no-any-return]


_wrap_lock = threading.Lock()


def _wrapper(work: PendingWork, obj: object, layout: ArrayView, backend: Backend) -> TrackedArray:
    """The one live TrackedArray of ``work`` (made if there is none)."""
    with _wrap_lock:
        ref = work.wrapper
        found = None if ref is None else ref()
        if found is not None:
            return found  # type: ignore[no-any-return]
        t: TrackedArray = object.__new__(TrackedArray)
        _setters["array"](t, obj)
        _setters["view"](t, layout._with_owner(obj))
        _setters["_work"](t, work)
        sched = scheduler_for(backend, work.device)
        work_ref = weakref.ref(work)

        def gone(_: object) -> None:
            w = work_ref()
            if w is not None:
                sched.wrapper_gone(w)

        work.wrapper = weakref.ref(t, gone)
        return t


def track(obj: object, stream: object = None) -> TrackedArray:
    """Track pending work on ``obj`` (any object exposing the CUDA Array Interface).

    ``stream`` is the export stream; None means the device's shared export
    stream, which lives as long as the process (and takes the exports once
    ``stream`` is closed; tracking the object again may then name another).
    The tracked state belongs to ``obj``: tracking it again, from any thread,
    gives the same TrackedArray while one is alive, and a new one over the
    same pending work after it was dropped. Work the object's own CAI
    ``stream`` reports is pending from the start, and again at every access
    and handoff. A view of a tracked array (``consume(t, stream=s)``) gives
    that array's TrackedArray. Does not block.
    """
    if isinstance(obj, TrackedArray):
        return obj
    backend = current_backend()
    export_stream = None if stream is None else as_stream(stream, backend)
    if type(obj) is ArrayView and obj.owner is not None:
        found = lookup(obj, backend)  # a view of a tracked array is that array's
        if found is not None and found[1] is obj:
            owner = obj.owner
            return track(owner) if stream is None else track(owner, stream)
    work = find_work(backend, obj)
    if (
        type(obj) is ArrayView
        and obj.stream is not None
        and (work is None or work.view_stream is ViewStream.NONE)
    ):  # (also when tracked before, if its stream closed before it was followed)
        view_stream_id(backend, obj)  # ValueError: its stream closed (work may be pending)
    if work is None:
        view = parse(obj)
        sched = scheduler_for(backend, _device_holding(backend, view, obj))
        work, made = sched.work_for(obj, view._with_owner(None), export_stream)
        if made:
            if type(obj) is ArrayView:  # its stream's close records that stream's work
                work.follow_view_stream(obj)
            own = work.own_stream()
            with work._locked():
                work._note(own)
    if export_stream is not None and export_stream != work.export_stream:
        with _wrap_lock:
            live = work.wrapper is not None and work.wrapper() is not None
            if live and not work.export_stream.closed:
                raise ValueError(
                    f"{obj!r} is already tracked with export stream {work.export_stream!r}"
                )
            work.export_stream = export_stream  # no TrackedArray names the old one
    return _wrapper(work, obj, work.layout, backend)


def lookup(
    obj: object, backend: Backend, *, sync: bool | None = None
) -> tuple[PendingWork, ArrayView] | None:
    """The pending work of ``obj`` (or of a TrackedArray) and its view, if
    tracked. A view whose owner is tracked, within the owner's memory (what
    ``consume(t, stream=s)`` returns, handed on to another consumer), is that
    owner's: its next consumer is ordered after the pending writes, and its
    read counts, so the owner's next ``writing()`` waits for it too. The
    view's own stream is noted as pending on the owner (recorded now), as
    the owner's own interface stream is at every access: the first consumer
    may have written the view there (unless ``sync`` is False: None, the
    global setting). ValueError if that stream was closed."""
    if isinstance(obj, TrackedArray):
        release_holds()  # as find_work does: a bounded step
        return obj._work, obj.view
    work = find_work(backend, obj)
    if work is not None:
        return work, work.layout._with_owner(obj)
    if type(obj) is ArrayView and obj.owner is not None:
        work = find_work(backend, obj.owner)
        if work is not None and _within(byte_range(obj), byte_range(work.layout)):
            key = obj._stream_key
            if (
                obj.stream is not None
                and (key is None or key != work.layout._stream_key)
                and (settings.sync if sync is None else sync)
            ):  # where the view says its data is ready: its consumer may have written
                # (the tracked view's own stream is noted by the handoff: own_stream)
                work.note_stream(view_stream_id(backend, obj))
            return work, obj
    return None


def _within(inner: tuple[int, int], outer: tuple[int, int]) -> bool:
    return inner[0] == inner[1] or outer[0] <= inner[0] <= inner[1] <= outer[1]


def dlpack_join(obj: object, backend: Backend) -> Callable[[Stream], None] | None:
    """For ``obj.__dlpack__``: the join of ``obj``'s tracked pending writes
    onto the consumer's stream (adding the consumer's read), if ``obj`` is
    tracked or a view of a tracked array; None otherwise (its own
    interface's stream is joined then). Only bookkeeping until called."""
    found = lookup(obj, backend)
    if found is None:
        return None
    work = found[0]
    return lambda s: _sync_handoff(lambda me: work.try_export(s, me), "__dlpack__()")


def _device_holding(backend: Backend, view: ArrayView, obj: object) -> int:
    """The device holding ``obj``, asked by pointer; a zero-size array (no
    pointer) says it itself if it has ``__dlpack_device__``, else the current
    device is taken. Does not block."""
    if not view.ptr and has_dlpack(obj):
        try:
            return cuda_device_of(obj)
        except InterfaceError:
            pass
    return device_of(backend, view)


def export(obj: object, *, stream: object = None) -> dict[str, Any]:
    """A version 3 CAI dict for ``obj`` whose ``stream`` entry covers its pending work.

    A tracked object (or TrackedArray): its pending writes are joined onto
    ``stream`` and the consumer's read is added. Any other object: its own CAI
    stream is joined onto ``stream`` with one event recorded now. ``stream``
    None: the scheduler's own stream. ``CAI_STREAMS_EXPORT_STREAM=0`` exports
    ``stream: None`` and joins nothing. Only enqueues GPU work; waits only for
    another thread's open ``writing()`` block of a tracked array (bounded).
    The dict names ``stream`` by its handle: keep ``stream`` referenced while
    the consumer uses that handle (a dropped stream is closed, and a new one
    may get its handle).
    """
    backend = current_backend()
    found = lookup(obj, backend)
    if found is not None:
        return _export_work(found[0], stream)
    view = parse(obj)
    given = _given(stream, backend)
    cai = view._v3()  # (a copy: no throwaway view, which would
    cai["stream"] = None  # join a lease of a view handed to a stream)
    if not settings.export_stream or view.stream is None:
        return cai
    sched = scheduler_for(backend, device_of(backend, view))  # the array's device
    x = sched.export_stream if given is None else given
    sched.counters.add(exports=1)
    producer = view_stream_id(backend, view)
    if producer != x._key():
        sched.join(x.handle, producer, keepalive=x, what="export()")
        sched.counters.add(joins=1)
    sched.declare_stream_read(x, view, "export(): the consumer's read")
    cai["stream"] = x.handle
    return cai
