"""Stream and Event: handle wrappers over the backend that made them, with one identity.

A :class:`Stream` knows its :class:`~cai_streams._identity.StreamId` (backend,
device, handle, generation, and for handle 2 its thread); equality, the
scheduler, the poller, the sanitizer and the tracer all use it.
"""

from __future__ import annotations

import enum
import functools
import numbers
import sys
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, cast

from anyio.lowlevel import checkpoint

from . import _capture_guard
from ._backend import LEGACY_DEFAULT_STREAM, PER_THREAD_DEFAULT_STREAM, Backend, current_backend
from ._deferred import in_collection, later
from ._errors import CaptureError, CudaError, CudaWarning
from ._events import Mark, record
from ._identity import (
    ClosingListener,
    Lifetime,
    StreamId,
    backend_serial,
    lifetime_of,
    new_lifetime,
    stream_id_now,
    thread_serial,
)
from ._loop_thread import loop_running, warn_if_loop_blocked
from ._poller import wait_for_event
from ._unique import Unique

if TYPE_CHECKING:
    from ._capture import Graph

__all__ = ["Event", "Stream", "as_stream", "stream_handle_of"]

#: handles and pointers are 64-bit values in CUDA
MAX_HANDLE = (1 << 64) - 1

_EXPECTED = (
    "an int stream handle (1 legacy default, 2 per-thread default, or a cudaStream_t), "
    "an object with __cuda_stream__, or a CuPy, PyTorch, Numba or cuda.core stream"
)


def _checked_handle(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int stream handle, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{what} must be a non-negative stream handle, got {value}")
    if value > MAX_HANDLE:
        raise ValueError(f"{what} must fit in 64 bits, got {value:#x}")
    return value


def stream_handle_of(obj: object) -> int:
    """The integer handle of a stream-like object, without importing its library.

    A library's default stream (handle 0 on a CuPy, PyTorch or Numba object)
    is the legacy default stream, 1. A bare int 0 is refused: it is ambiguous,
    as the CUDA Array Interface says.
    """
    if isinstance(obj, Stream):
        return obj.handle
    if isinstance(obj, numbers.Integral) and not isinstance(obj, bool):
        handle = _checked_handle(int(obj), "a stream handle")  # (NumPy's integers too)
        if handle == 0:
            raise ValueError(
                "stream handle 0 is ambiguous: use 1 for the legacy default stream, "
                "2 for the per-thread default stream, or a cudaStream_t"
            )
        return handle
    protocol = getattr(type(obj), "__cuda_stream__", None)
    if protocol is not None:
        result = obj.__cuda_stream__()  # type: ignore[attr-defined]
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(
                f"{type(obj).__name__}.__cuda_stream__() must return (version, handle), "
                f"got {result!r}"
            )
        handle = _checked_handle(result[1], "__cuda_stream__()[1]")
        return handle or 1
    module = type(obj).__module__ or ""
    root = module.partition(".")[0]
    raw: object
    if root == "cupy":
        raw = getattr(obj, "ptr", None)
    elif root == "torch":
        raw = getattr(obj, "cuda_stream", None)
    elif root in ("numba", "numba_cuda") or module.startswith("cuda.bindings"):
        raw = _int_of(obj)
    else:
        raise TypeError(f"cannot use {type(obj).__qualname__} as a stream: expected {_EXPECTED}")
    if raw is None:
        raise TypeError(f"{module}.{type(obj).__qualname__} has no stream handle")
    return _checked_handle(raw, f"the handle of {type(obj).__qualname__}") or 1


def _int_of(obj: object) -> int | None:
    handle = getattr(obj, "handle", obj)
    value = getattr(handle, "value", handle)  # ctypes.c_void_p
    if value is None:
        return 0
    try:
        return int(value)  # type: ignore[call-overload, no-any-return]
    except TypeError:
        return None


def _done(query: Callable[[int], bool], handle: int) -> bool:
    """Whether a synchronize of ``handle`` would return at once, asked before
    it waits in an event loop's thread; a query that fails says yes, and the
    synchronize raises its own error."""
    try:
        return query(handle)
    except CudaError:
        return True


class Stream(Unique):
    """A CUDA stream on the backend that was current when it was made.

    ``Stream()`` owns a new non-blocking stream and destroys it on :meth:`close`
    (or when collected). :meth:`wrap` borrows one that something else owns.

    Two Streams are equal when they are the same live stream: same backend,
    same device, same handle, and, for a stream this library made, the same
    stream and not a later one that CUDA gave the closed one's handle to.
    Handle 2 (the per-thread default stream) is a different stream in each
    host thread: ``Stream.wrap(2)`` names the wrapping thread's.
    """

    __slots__ = (
        "__weakref__",
        "_backend",
        "_closed",
        "_handle",
        "_id",
        "_keepalive",
        "_lifetime",
        "_owned",
    )

    _backend: Backend
    _closed: bool
    _handle: int
    _id: StreamId
    _keepalive: object
    _lifetime: Lifetime | None
    _owned: bool

    def __init__(self, device: int | None = None) -> None:
        """Create a new non-blocking stream on ``device`` (None: the current device).

        Does not block; enqueues nothing.
        """
        self._make(current_backend(), device)

    @classmethod
    def _on(cls, backend: Backend, device: int) -> Stream:
        """A new stream the library owns on ``backend`` (current or not)."""
        self = cls.__new__(cls)
        self._make(backend, device)
        return self

    def _make(self, backend: Backend, device: int | None) -> None:
        self._owned = False  # until the stream exists: __del__ must not destroy anything
        self._closed = True
        if device is None:
            device = backend.current_device()
        elif isinstance(device, bool) or not isinstance(device, int):
            raise TypeError(f"device must be None or an int, got {type(device).__name__}")
        elif not 0 <= device < backend.device_count():
            raise ValueError(
                f"device {device} does not exist: the {backend.name!r} backend has "
                f"{backend.device_count()} device(s)"
            )
        self._backend = backend
        self._handle = backend.create_stream(device)
        self._owned = True
        self._closed = False
        self._keepalive = None
        self._lifetime = lifetime = new_lifetime(backend, device, self._handle)
        self._id = StreamId(backend, device, self._handle, lifetime.generation, 0)

    @classmethod
    def wrap(cls, obj: object) -> Stream:
        """Borrow an existing stream: an int handle, a ``__cuda_stream__`` object,
        or a CuPy, PyTorch, Numba or cuda.core stream (kept alive by the result).

        Never destroys what it borrows. Does not block.
        """
        if isinstance(obj, Stream):
            return obj._borrowed(obj)
        return cls._borrow(stream_handle_of(obj), current_backend(), obj)

    @classmethod
    def _borrow(cls, handle: int, backend: Backend, keepalive: object) -> Stream:
        if not backend.is_stream(handle):
            raise ValueError(f"{handle:#x} is not a stream on the {backend.name!r} backend")
        self = cls.__new__(cls)
        self._backend = backend
        self._handle = handle
        self._owned = False
        self._closed = False
        self._keepalive = keepalive
        self._id = key = stream_id_now(backend, handle)
        self._lifetime = None if key.generation == 0 else lifetime_of(backend, handle)
        return self

    @classmethod
    def _borrow_key(cls, key: StreamId, backend: Backend) -> Stream:
        """A borrowed wrapper of the stream ``key`` names, with that identity
        as given (another thread's handle 2, another device's 1), keeping
        nothing alive: for a record made on it now."""
        self = Stream.__new__(_KeyedStream)
        self._backend = backend
        self._handle = key.handle
        self._owned = False
        self._closed = False
        self._keepalive = None
        self._id = key
        self._lifetime = None if key.generation == 0 else lifetime_of(backend, key.handle)
        return self

    def _borrowed(self, keepalive: object) -> Stream:
        """A borrowed wrapper of this very stream (same identity)."""
        self.handle  # noqa: B018 - a closed stream cannot be borrowed
        return self._same_stream(keepalive)

    @property
    def _recordable(self) -> bool:
        """Whether the stream still exists to record on: a stream this library
        made until its close has told its listeners (closed in a garbage
        collection, its own wrapper says closed first; a borrowed wrapper's
        close only forgets it); another library's while this wrapper is open."""
        lifetime = self._lifetime
        if lifetime is not None:
            return lifetime.ending or not lifetime.closed
        return not self._closed

    def _open_for_records(self) -> None:
        """ValueError unless :attr:`_recordable`."""
        if not self._recordable:
            self.handle  # noqa: B018 - raises, saying which stream is closed

    def _kept(self) -> Stream:
        """This stream as the library keeps it for records to come (an access,
        an open block): an owned stream itself (its close tells what listens
        first); for a borrowed wrapper, a copy of its own that keeps alive
        what the wrapper keeps, since the user's close of the wrapper only
        forgets the stream and must not end what the library still records
        there. (A wrapper closed already, and a bare handle's, stay themselves:
        records on them refuse once closed.)"""
        if self._owned or self._closed or type(self) is _KeptStream:
            return self
        if not self._records_later():  # a bare handle: it may be gone, or another
            return self  # stream, once the wrapper is closed; records on it refuse then
        # a stream the library made tells what listens when it closes: the copy
        # need not keep its owner alive (else closing the wrapper would not let
        # the stream be collected); another library's stays with its object
        keep = None if self._lifetime is not None else self._keepalive
        return self._same_stream(keep, _KeptStream)

    def _same_stream(self, keepalive: object = None, kind: type[Stream] | None = None) -> Stream:
        """A borrowed wrapper of this very stream, unchecked: also for what
        records on it while its close runs (in a garbage collection this
        wrapper says closed first, and its listeners record later, before the
        stream is destroyed). ``kind``: the class of the wrapper made."""
        cls = Stream if kind is None else kind
        other = cls.__new__(cls)
        other._backend = self._backend
        other._handle = self._handle
        other._owned = False
        other._closed = False
        other._keepalive = keepalive
        other._lifetime = self._lifetime
        other._id = self._id
        return other

    @property
    def handle(self) -> int:
        """The handle as it goes into a CAI ``stream`` entry. A default stream
        (1, 2) names the current device's: one of another device raises
        ValueError (make its device current first, as CUDA requires)."""
        if self._closed:
            raise ValueError("this Stream is closed")
        lifetime = self._lifetime
        if lifetime is not None and lifetime.closed:
            raise ValueError("the stream this Stream borrows was closed")
        handle = self._handle
        if handle <= PER_THREAD_DEFAULT_STREAM:  # (1 or 2: never 0)
            self._check_default_device()
        return handle

    def _check_default_device(self) -> None:
        device, now = self._id.device, self._backend.current_device()
        if device != now:
            which = "legacy" if self._handle == LEGACY_DEFAULT_STREAM else "per-thread"
            raise ValueError(
                f"{self!r} is device {device}'s {which} default stream, and handle "
                f"{self._handle} names the current device's: device {now} is current "
                f"in this thread; call cs.set_device({device}) first, or use a stream "
                f"made with cs.Stream(device={device})"
            )

    @property
    def backend(self) -> Backend:
        """The backend this stream belongs to."""
        return self._backend

    @property
    def device(self) -> int:
        """The ordinal of the device this stream belongs to."""
        return self._id.device

    @property
    def closed(self) -> bool:
        """Whether this wrapper was closed, or the stream it names was (by its
        owner, in any thread). Does not block."""
        lifetime = self._lifetime
        return self._closed or (lifetime is not None and lifetime.closed)

    def _key(self) -> StreamId:
        """The identity of the stream that work enqueued now by this thread goes to."""
        key = self._id
        if key.handle == PER_THREAD_DEFAULT_STREAM:
            serial = thread_serial()
            if serial != key.thread:
                return StreamId(key.backend, key.device, key.handle, 0, serial)
        return key

    def _records_later(self) -> bool:
        """Whether an event may be recorded on this stream later, from any
        thread, to mark the end of work enqueued until then. True when the
        library sees the stream's end (a stream it made: closing it records
        first), when it never ends (the legacy stream), when this wrapper
        keeps the object that owns it alive, and for the per-thread stream 2
        (another thread records on the legacy stream, which waits for it).
        A bare handle of another library's stream may be gone, or another
        stream, by then: its events are recorded at the handoff.
        """
        handle = self._handle
        if handle in (LEGACY_DEFAULT_STREAM, PER_THREAD_DEFAULT_STREAM):
            return True
        if self._lifetime is not None:
            return True
        keepalive = self._keepalive
        return keepalive is not None and not isinstance(keepalive, int)

    def record(self) -> Event:
        """A new event capturing the work enqueued on this stream so far.

        Only enqueues GPU work.
        """
        return Event._recorded_on(self)

    def wait(self, event_or_stream: Event | Stream) -> None:
        """Make later work on this stream wait for an event, or for all work
        enqueued so far on another stream. Only enqueues GPU work; never blocks.
        """
        handle = self.handle  # a closed stream refuses, even if its handle was reused
        if isinstance(event_or_stream, Stream):
            self._same_backend(event_or_stream._backend)
            if event_or_stream._key() == self._key():
                return
            event = event_or_stream.record()
            try:
                self._backend.stream_wait_event(handle, event.handle)
            finally:
                event.close()
        elif isinstance(event_or_stream, Event):
            self._same_backend(event_or_stream._backend)
            self._backend.stream_wait_event(handle, event_or_stream.handle)
        else:
            raise TypeError(
                f"Stream.wait() takes an Event or a Stream, got {type(event_or_stream).__name__}"
            )
        from . import _capture  # late: it builds on Stream

        if _capture.any_under_way():  # (a fork into a capture: which one, for its records)
            if isinstance(event_or_stream, Stream):
                _capture.joined(self._key(), event_or_stream._key())
            elif (mark := event_or_stream._mark) is not None and mark.captured:
                _capture.joined(self._key(), mark.key)

    def begin_capture(self, mode: str = "global") -> None:
        """Start capturing the work enqueued on this stream into a graph
        (cudaStreamBeginCapture): from now on it is recorded, not run.

        ``mode`` ("global", "thread_local" or "relaxed") says which calls in
        other threads (global) or this one may invalidate the capture. The
        library's own queries never do, in any thread. Does not block.
        """
        from ._capture import begin_capture  # late: it builds on Stream

        begin_capture(self, mode)

    @property
    def is_capturing(self) -> bool:
        """Whether this stream is capturing a graph (valid or invalidated). Does not block."""
        return self._backend.is_capturing(self.handle)

    def end_capture(self) -> Graph:
        """End the capture begun on this stream and return its :class:`Graph`
        (cudaStreamEndCapture); the stream runs its work again from now on.

        Raises :class:`~cai_streams.CudaError` if the capture was invalidated
        (the stream has left capture mode either way). Does not block.
        """
        from ._capture import end_capture

        return end_capture(self)

    def synchronize(self) -> None:
        """Block the calling thread until all work on this stream is done.

        Blocks: in async code use ``await stream.record().wait()`` instead
        (called with work pending in an event loop's thread, it gives
        :class:`~cai_streams.LoopBlockingWarning`; for a default stream,
        whose synchronize also waits for other streams, always there).
        """
        handle = self.handle  # (a closed stream raises first)
        if loop_running() is not None:
            if handle in (LEGACY_DEFAULT_STREAM, PER_THREAD_DEFAULT_STREAM):
                # its synchronize also waits for other streams' work (the
                # legacy stream's implicit ordering), which a query of it
                # does not see: said whether or not anything is pending
                warn_if_loop_blocked(
                    "Stream.synchronize() of a default stream may wait for any blocking "
                    "stream's pending GPU work",
                    "`await stream.record().wait()`",
                )
            elif not _done(self._backend.query_stream, handle):
                warn_if_loop_blocked(
                    "Stream.synchronize() is about to wait for pending GPU work",
                    "`await stream.record().wait()`",
                )
        self._backend.synchronize_stream(handle)

    def close(self) -> None:
        """Destroy an owned stream (work already enqueued still completes).

        Work a consumer enqueued on it after a handoff is recorded first, so
        the producer's next write still waits for it. Safe to call twice; a
        borrowed stream is only forgotten. Does not block. An owned stream that
        is capturing a graph raises :class:`~cai_streams.CaptureError` and stays
        open: end the capture first. On a device whose kernel faulted, the
        record raises the :class:`~cai_streams.KernelError` after the stream
        is destroyed, and the consumer's read is dropped with it (none of its
        work runs any more).
        """
        if self._closed:
            return
        if self._owned and self._backend.is_capturing(self._handle):
            raise CaptureError(
                f"cannot close stream {self._handle:#x}: it is capturing a graph (the capture "
                "would be left under way, refusing the host syncs it forbids); call "
                "end_capture() first"
            )
        lifetime = self._lifetime
        if self._owned and lifetime is not None and not lifetime.claim_close():
            # another thread closes it now: it records what listens (through the
            # lifetime, not this wrapper), then destroys it; closed for this caller
            self._closed = True
            return
        if self._owned and in_collection():  # a finalizer, maybe inside a library lock
            self._closed = True
            self._keepalive = None
            self._end_later()
            return
        try:
            if self._owned:
                self._end_lifetime()
        finally:
            self._closed = True
            self._keepalive = None
            if self._owned:
                self._backend.destroy_stream(self._handle)

    def _end_later(self) -> None:
        """What listens records, then the stream is destroyed: at the next
        library call, outside any lock (see _deferred). Only appends."""
        lifetime = self._lifetime
        listeners = lifetime.closing() if lifetime is not None else ()
        later(functools.partial(_end_stream, self._backend, self._handle, lifetime, listeners))

    def _end_lifetime(self) -> None:
        lifetime = self._lifetime
        if lifetime is None:
            return
        try:
            _tell_closing(lifetime.closing())
        finally:
            lifetime.close()

    def __cuda_stream__(self) -> tuple[int, int]:
        """``(0, handle)``: the stream protocol other libraries take a stream
        by (ValueError once closed). Does not block."""
        return (0, self.handle)

    def __enter__(self) -> Stream:
        """The stream itself. Does not block."""
        return self

    def __exit__(self, *exc_info: object) -> None:
        """:meth:`close` (an owned stream is destroyed, consumer reads on it
        recorded first). Does not block."""
        self.close()

    def _same_backend(self, other: Backend) -> None:
        if other is not self._backend:
            raise ValueError(
                f"{self!r} cannot be ordered with work on another backend "
                f"({other.name!r} #{backend_serial(other)})"
            )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Stream):
            return NotImplemented
        return self._id == other._id

    def __hash__(self) -> int:
        return hash(self._id)

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("owned" if self._owned else "borrowed")
        return f"<Stream {self._handle:#x} on {self._backend.name} ({state})>"

    def __del__(self, _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
        # (bound at definition: at shutdown this module's globals may be None)
        if getattr(self, "_owned", False) and not self._closed:
            self._closed = True
            if _finalizing():  # the driver frees it with the context; its
                return  # bindings may already be torn down
            lifetime = self._lifetime
            # What listens (a consumer's read, a view's lease) may hold only a
            # borrowed wrapper of its bare handle: it records while the stream
            # exists, as at close(); at the next library call, since this may
            # run inside one, holding its locks (see _deferred); so does all of
            # it in a garbage collection.
            if lifetime is not None and not lifetime.claim_close():
                return  # (a close() under way: it destroys the stream)
            listeners = lifetime.closing() if lifetime is not None else ()
            end = functools.partial(_end_stream, self._backend, self._handle, lifetime, listeners)
            if listeners or in_collection():
                later(end)
            else:
                end()


class _KeptStream(Stream):
    """A borrowed wrapper the library keeps for its own records (see
    :meth:`Stream._kept`); never handed to the user."""

    __slots__ = ()


class _KeyedStream(Stream):
    """A borrowed wrapper of one stream identity, whichever thread uses it
    (another thread's handle 2 stays that thread's: see
    :meth:`Stream._borrow_key`); never handed to the user."""

    __slots__ = ()

    def _key(self) -> StreamId:
        return self._id


def _tell_closing(listeners: Iterable[ClosingListener]) -> None:
    """Let each listener record while the stream exists; the first error
    raises once every other one has been told."""
    errors: list[BaseException] = []
    for listener in listeners:
        try:
            listener.stream_closing()
        except Exception as exc:  # record every other one first
            errors.append(exc)
    if errors:
        raise errors[0]


def _end_stream(
    backend: Backend,
    handle: int,
    lifetime: Lifetime | None,
    listeners: Iterable[ClosingListener],
) -> None:
    """A collected owned stream: what listened records, then it is destroyed.
    A failure is a warning (from a destructor, or a later library call)
    saying what failed: the records (the stream is destroyed all the same),
    or the destroy (the stream leaked)."""
    try:
        try:
            _tell_closing(listeners)
        finally:
            if lifetime is not None:
                lifetime.close()
            try:
                backend.destroy_stream(handle)
            except Exception as exc:
                warnings.warn(f"leaked stream {handle:#x}: {exc}", CudaWarning, stacklevel=1)
    except Exception as exc:
        warnings.warn(
            f"stream {handle:#x} was collected, and recording the work enqueued on it "
            f"for what listened failed (the stream is destroyed): {exc}",
            CudaWarning,
            stacklevel=1,
        )


#: streams this thread is handing, by handle, to a producer's ``__dlpack__``
#: (:func:`lending`): handle -> the library's wrapper
_lent = threading.local()


@contextmanager
def lending(s: Stream | None) -> Iterator[None]:
    """In the block, :func:`as_stream` of ``s``'s handle in this thread gives
    ``s`` itself: a producer's ``__dlpack__(stream=handle)`` called by the
    library then sees the stream object the library keeps alive (the
    consumer's read stays open), not a bare handle. Does not block."""
    if s is None:
        yield
        return
    table: dict[int, Stream] = _lent.__dict__.setdefault("streams", {})
    handle = s.handle
    previous = table.get(handle)
    table[handle] = s
    try:
        yield
    finally:
        if previous is None:
            del table[handle]
        else:
            table[handle] = previous


def as_stream(stream: object, backend: Backend) -> Stream:
    """``stream`` (a Stream or anything :meth:`Stream.wrap` takes) as a Stream of
    ``backend``; ValueError when it belongs to another backend."""
    if isinstance(stream, Stream):
        s = stream
    elif (
        type(stream) is int
        and (lent := _lent.__dict__.get("streams"))
        and (found := lent.get(stream)) is not None
        and found.backend is backend
    ):
        return cast(Stream, found)
    else:
        s = Stream._borrow(stream_handle_of(stream), backend, stream)
    if s.backend is not backend:
        if s.backend.name != backend.name:
            where = f"the {s.backend.name!r} backend"
        else:
            where = (
                f"another {backend.name!r} backend instance (#{backend_serial(s.backend)}, "
                f"not #{backend_serial(backend)})"
            )
        raise ValueError(
            f"{s!r} belongs to {where}; the array is on the {backend.name!r} backend "
            f"#{backend_serial(backend)}: make the stream while that backend is current"
        )
    return s


class _EventState(enum.Enum):
    OPEN = "open"
    #: closed while a task awaited it: destroyed when the last wait ends, so
    #: that its handle cannot be given to another event under a waiter
    CLOSING = "closing"
    DESTROYED = "destroyed"


#: guards Event's count of waits (tasks of several threads may await one)
_waits_lock = threading.Lock()


class Event(Unique):
    """A point in a stream's work: complete once everything before it ran.

    Made by :meth:`Stream.record`; destroyed by :meth:`close` or when collected
    (a pending record still completes). Keeps its stream alive. Only
    :meth:`synchronize` blocks; :meth:`wait` yields to the event loop; the
    rest never blocks.
    """

    __slots__ = ("__weakref__", "_backend", "_handle", "_mark", "_state", "_stream", "_waits")

    _backend: Backend
    _handle: int
    _mark: Mark
    _state: _EventState
    _stream: Stream
    _waits: int

    def __init__(self) -> None:
        raise TypeError("Events are made by Stream.record()")

    @classmethod
    def _recorded_on(cls, stream: Stream) -> Event:
        self = cls.__new__(cls)
        backend = stream._backend
        self._backend = backend
        self._state = _EventState.DESTROYED
        self._waits = 0
        self._stream = stream
        stream.handle  # noqa: B018 - a closed stream refuses
        key = stream._key()
        self._handle = backend.create_event(key.device)  # events record on their device only
        self._state = _EventState.OPEN
        try:
            self._mark = record(backend, self._handle, key)
        except BaseException:
            self.close()
            raise
        return self

    @property
    def handle(self) -> int:
        if self._state is not _EventState.OPEN:
            raise ValueError("this Event is closed")
        return self._handle

    @property
    def stream(self) -> Stream:
        """The stream this event was recorded on."""
        return self._stream

    @property
    def is_done(self) -> bool:
        """Whether the work before this event is complete. Never blocks.

        Raises :class:`~cai_streams.CudaError` if that work failed.
        """
        return self._backend.query(self.handle)

    def synchronize(self) -> None:
        """Block the calling thread until the work before this event is done.

        Blocks: in async code use ``await event.wait()`` instead (called with
        the work pending in an event loop's thread, it gives
        :class:`~cai_streams.LoopBlockingWarning`).
        """
        if loop_running() is not None and not _done(self._backend.query, self.handle):
            warn_if_loop_blocked(
                "Event.synchronize() is about to wait for pending GPU work", "`await event.wait()`"
            )
        self._backend.synchronize_event(self.handle)

    async def wait(self, *, timeout: float | None = None) -> None:
        """Wait for the work before this event, yielding to the event loop.

        Polls (never blocks the loop); a cancellation point. ``timeout`` in
        seconds raises :class:`TimeoutError` when it runs out. An event recorded
        in a graph capture under way raises :class:`~cai_streams.CaptureError`
        (its work has not run; polling it would invalidate the capture); one
        recorded in a capture that has ended returns at once (its work runs only
        when a graph is launched: nothing is pending on any stream).
        Closing the event meanwhile (from another task) does not end the wait:
        the event is destroyed once the last wait on it ends.
        """
        mark = self._mark
        _capture_guard.check_host_wait(self._backend, mark.key, mark, "Event.wait()")
        with _waits_lock:  # the check and the count as one: close() sees either
            handle = self.handle
            self._waits += 1
        try:
            if mark.captured and _capture_guard.taken_or_complete(self._backend, handle):
                await checkpoint()  # (its capture has ended: check_host_wait)
            else:
                await wait_for_event(
                    self._backend, handle, mark=mark, timeout=timeout, keepalive=self
                )
        finally:
            with _waits_lock:
                self._waits -= 1
                last = self._waits == 0 and self._state is _EventState.CLOSING
                if last:
                    self._state = _EventState.DESTROYED
            if last:
                try:
                    self._backend.destroy_event(handle)
                except CudaError as exc:  # never in place of the wait's own outcome
                    warnings.warn(f"leaked event {handle:#x}: {exc}", CudaWarning, stacklevel=2)

    def close(self) -> None:
        """Destroy the event (once the waits on it under way have ended). Safe
        to call twice. Does not block."""
        with _waits_lock:
            if self._state is not _EventState.OPEN:
                return
            waited = self._waits > 0
            self._state = _EventState.CLOSING if waited else _EventState.DESTROYED
        if not waited:
            self._backend.destroy_event(self._handle)

    def __repr__(self) -> str:
        return f"<Event {self._handle:#x} on stream {self._stream._handle:#x}>"

    def __del__(
        self,
        _finalizing: Callable[[], bool] = sys.is_finalizing,
        _open: _EventState = _EventState.OPEN,
        _destroyed: _EventState = _EventState.DESTROYED,
    ) -> None:
        # (bound at definition, as Stream.__del__: at shutdown globals may be None)
        if getattr(self, "_state", None) is _open:
            self._state = _destroyed
            if _finalizing():
                return
            try:
                self._backend.destroy_event(self._handle)
            except Exception as exc:
                warnings.warn(f"leaked event {self._handle:#x}: {exc}", CudaWarning, stacklevel=1)
