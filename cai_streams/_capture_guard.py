"""The library never invalidates a graph capture, its own or another thread's.

A CUDA stream capture forbids "potentially unsafe" calls (an event or stream
query, a host synchronize) in every thread whose capture interaction mode is
"global" while any global capture is under way, and in the capturing thread
itself. The shared poller, the event pool and the consumers' elisions are
exactly such calls, made from threads that know nothing of the capture (the
bug PyTorch hit with its watchdog thread, pytorch #104555, fixed by exchanging
that thread's mode, #148594). So, here:

* every query or host wait of the library's own runs inside :func:`relaxed`:
  the calling thread's mode exchanged to "relaxed" and restored before any
  await (another coroutine of the thread may begin a capture of its own);
* an event recorded on a capturing stream is never queried or waited for on
  the host: while its capture is under way that is cudaErrorCapturedEvent and
  invalidates the capture, and after it ended the event is unusable until
  recorded again. The :class:`~cai_streams._events.Mark` of such a record says
  ``captured``. The mark is decided by asking the stream before the record, so
  a capture that another thread ends in between leaves an ordinary record
  marked captured: once the capture has ended, such a record is asked of the
  driver (:func:`taken_or_complete`), never taken for done. (A capture another
  thread begins in between takes a record marked otherwise: not closed yet,
  see docs/capture.md);
* a join that cannot be made raises :class:`~cai_streams.CaptureError` before
  anything is enqueued, saying what to do instead; a join among streams of one
  capture is made, and becomes a graph edge.

User calls on their own objects (``Event.is_done``, ``Stream.synchronize``)
keep the user's mode: they are the user's to make or not.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Final, Protocol, TypeVar

from ._backend import LEGACY_DEFAULT_STREAM, PER_THREAD_DEFAULT_STREAM, Backend, CaptureMode
from ._device import make_current
from ._errors import CaptureError, CudaError, DeviceFaultError
from ._identity import StreamId, is_open, thread_serial

if TYPE_CHECKING:
    from ._events import Mark

__all__ = [
    "RelaxedScope",
    "StreamPhase",
    "capturing",
    "check_host_wait",
    "host_wait_idle",
    "check_wait",
    "event_complete",
    "host_skips",
    "in_capture",
    "must_wait",
    "query_event",
    "relaxed",
    "stream_idle",
    "stream_phase",
    "taken_or_complete",
    "TAKEN_BY_A_CAPTURE",
]

T = TypeVar("T")

#: cudaErrorStreamCaptureImplicit: the legacy stream used while a blocking stream captures
_IMPLICIT = 906
#: cudaErrorInvalidResourceHandle: the stream is gone
_INVALID_HANDLE = 400
#: what a query of an event says when a graph capture took its last record
#: (cudaErrorInvalidValue, "recorded in a capture that has ended", on the driver
#: and the simulator; the capture errors 900-908): not an answer about its stream
TAKEN_BY_A_CAPTURE: Final = frozenset({1, *range(900, 909)})

_AFTER_LAUNCH = "consume after end_capture() and Graph.launch, or pass a stream in the same capture"
_BEFORE_BEGIN = "wait for the producer before begin_capture: await cs.consume(arr) first"


class relaxed:  # noqa: N801 - used as a function: ``with relaxed(backend):``
    """The calling thread's capture mode is "relaxed" inside the block, and
    what it was after. Never put an await inside: the mode is per thread.
    (A class: cheaper than a generator context, and the poller enters one per pass.)"""

    __slots__ = ("_backend", "_previous")

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._previous: CaptureMode = "relaxed"

    def __enter__(self) -> None:
        self._previous = self._backend.exchange_capture_mode("relaxed")

    def __exit__(self, *exc_info: object) -> None:
        self._backend.exchange_capture_mode(self._previous)


class RelaxedScope:
    """:func:`relaxed` for each backend entered, until :meth:`restore`: for a
    loop of queries (the poller's pass) that hands the thread back at each
    checkpoint and enters again after it."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: list[tuple[Backend, AbstractContextManager[None]]] = []

    def enter(self, backend: Backend) -> None:
        for held, _ in self._held:
            if held is backend:
                return
        scope = relaxed(backend)
        scope.__enter__()
        self._held.append((backend, scope))

    def restore(self) -> None:
        held, self._held = self._held, []
        for _, scope in reversed(held):
            scope.__exit__(None, None, None)


def query_event(backend: Backend, event: int) -> bool:
    """The library's own query of an event recorded outside any capture."""
    previous = backend.exchange_capture_mode("relaxed")  # (inline: :class:`relaxed`,
    try:  # without its object and calls, on every host wait's poll)
        return backend.query(event)
    finally:
        backend.exchange_capture_mode(previous)


class StreamPhase(enum.Enum):
    """What one ask of a stream's capture state found."""

    CAPTURING = "capturing"
    NOT_CAPTURING = "not capturing"
    #: closed by this library, or destroyed: a capture it was forked into may
    #: still be under way in the stream it was forked from, which nothing names
    GONE = "gone"
    #: another thread's per-thread default stream: this thread cannot name it
    UNNAMED = "unnamed"


def capturing(backend: Backend, key: StreamId) -> bool | None:
    """Whether the stream ``key`` names is capturing now (valid or invalidated);
    None when this thread cannot name it (another thread's per-thread default
    stream); False for a stream this library made and closed since, or one
    destroyed. Asking invalidates nothing. The legacy stream while a blocking
    stream of its device captures: :class:`CaptureError`, since any use of it
    would invalidate that capture. (On every handoff: :func:`stream_phase` is
    the same ask, telling a stream that is gone apart.)"""
    if key.handle == PER_THREAD_DEFAULT_STREAM and key.thread != thread_serial():
        return None
    if key.generation and not is_open(key):  # a stream this library made, closed since
        return False  # (never ask the driver about a destroyed handle)
    try:
        return _on_its_device(backend, key, backend.capture_status) != "none"
    except CudaError as exc:
        _gone_or_raise(exc, key)
        return False


def _on_its_device(backend: Backend, key: StreamId, call: Callable[[int], T]) -> T:
    """``call(key.handle)``. Handles 1 and 2 name the current device's default
    streams: ``key``'s device is made current around the call (else another
    device's stream would answer)."""
    if key.handle > PER_THREAD_DEFAULT_STREAM:
        return call(key.handle)
    previous = make_current(backend, key.device)
    try:
        return call(key.handle)
    finally:
        if previous is not None:
            backend.set_device(previous)


def stream_phase(backend: Backend, key: StreamId) -> StreamPhase:
    """:func:`capturing`, telling a stream that is gone from one that does not
    capture (one ask of the driver at most)."""
    state = None
    if key.generation and not is_open(key):
        return StreamPhase.GONE
    if key.handle != PER_THREAD_DEFAULT_STREAM or key.thread == thread_serial():
        try:
            state = _on_its_device(backend, key, backend.capture_status) != "none"
        except CudaError as exc:
            _gone_or_raise(exc, key)
            return StreamPhase.GONE
    if state is None:
        return StreamPhase.UNNAMED
    return StreamPhase.CAPTURING if state else StreamPhase.NOT_CAPTURING


def _gone_or_raise(exc: CudaError, key: StreamId) -> None:
    """A capture-state ask failed: returns if the stream is gone (destroyed),
    else raises (:class:`CaptureError` for the legacy stream while a blocking
    stream captures)."""
    if exc.code == _INVALID_HANDLE:
        return
    if exc.code == _IMPLICIT and key.handle == LEGACY_DEFAULT_STREAM:
        raise CaptureError(
            "the legacy default stream (1) cannot be used while a blocking stream "
            "(such as the per-thread default stream, 2) captures a graph: capture on "
            "a cs.Stream(), which is non-blocking, or use the legacy stream after "
            "end_capture()"
        ) from exc
    raise exc


def in_capture(backend: Backend, mark: Mark | None) -> bool:
    """Whether ``mark`` is a record made in a capture that is still under way
    (conservatively True when the stream cannot be named from this thread)."""
    return mark is not None and mark.captured and capturing(backend, mark.key) is not False


def event_complete(backend: Backend, event: int, mark: Mark | None) -> bool:
    """Whether the work before a recorded event is done, never invalidating a
    capture. A record made in a capture stands for work that runs only when a
    graph is launched: not done while the capture is under way, and nothing
    pending on any stream once it ended (which the driver is asked: see
    :func:`taken_or_complete`). Never blocks; a failure raises."""
    if mark is not None and mark.captured:
        return not in_capture(backend, mark) and taken_or_complete(backend, event)
    return query_event(backend, event)


def taken_or_complete(backend: Backend, event: int) -> bool:
    """For a record whose mark says captured, once that capture has ended:
    whether nothing before it is pending. A capture took the record (the query
    answers one of :data:`TAKEN_BY_A_CAPTURE`: its work runs only when a graph
    is launched), or the capture ended between the mark's ask and the record,
    which then is an ordinary one, complete or not like any other. Never
    blocks; a failure of the work before it raises."""
    try:
        return query_event(backend, event)
    except CudaError as exc:
        if exc.code in TAKEN_BY_A_CAPTURE and not isinstance(exc, DeviceFaultError):
            return True
        raise


def stream_idle(backend: Backend, key: StreamId) -> bool:
    """Whether all work enqueued on ``key``'s stream so far is done: False for a
    capturing stream (never queried) or one this thread cannot name."""
    return capturing(backend, key) is False and _query_idle(backend, key)


def _query_idle(backend: Backend, key: StreamId) -> bool:
    """cudaStreamQuery of a stream known not to capture, in relaxed mode."""
    previous = backend.exchange_capture_mode("relaxed")  # (inline, as in query_event:
    try:  # every host consume of an idle producer comes here)
        return _on_its_device(backend, key, backend.query_stream)
    finally:
        backend.exchange_capture_mode(previous)


def check_wait(
    waiter: StreamId,
    waiter_capturing: bool,
    producer: StreamId,
    *,
    producer_capturing: bool,
    done: Callable[[], bool],
    what: str,
) -> bool:
    """One wait of ``waiter`` on pending work of ``producer``: whether to make
    it (False: ``done()`` says the work is complete, so the capturing waiter
    needs nothing); :class:`CaptureError` when it cannot be made."""
    if producer_capturing and not waiter_capturing:
        raise CaptureError(
            f"{what}: the pending work is on {producer.describe()}, which is "
            f"capturing a graph, and {waiter.describe()} is not: that work has not "
            f"run and runs only when the graph is launched; {_AFTER_LAUNCH}"
        )
    if waiter_capturing and not producer_capturing:
        if done():
            return False
        raise CaptureError(
            f"{what}: {waiter.describe()} is capturing a graph and cannot wait "
            f"for work still pending on {producer.describe()} outside the capture "
            f"(that would invalidate it); {_BEFORE_BEGIN}"
        )
    return True


class PendingAccess(Protocol):
    """What :func:`must_wait` needs of an access (``_access.Access``)."""

    key: StreamId
    #: None until recorded (a consumer's read whose end is not known yet)
    mark: Mark | None
    #: the event recorded at ``mark`` (0 until recorded)
    event: int

    @property
    def unfenced(self) -> bool:
        """A captured record standing for ordinary work not recorded yet: its
        stream captured when last asked, whatever it does now (``_pending``)."""

    def is_complete(self) -> bool: ...


def must_wait(
    backend: Backend, waiter: StreamId, waiter_capturing: bool, access: PendingAccess, what: str
) -> bool:
    """:func:`check_wait` for a tracked buffer's pending ``access``."""
    mark = access.mark

    def idle() -> bool:
        return stream_idle(backend, access.key)

    if mark is None:  # not recorded yet: its stream has the answer
        producer_capturing = capturing(backend, access.key) is True
        done = idle
    else:  # (unfenced: one ask found its stream capturing; a later one must not undo it)
        producer_capturing = access.unfenced or in_capture(backend, mark)
        done = access.is_complete
    return check_wait(
        waiter,
        waiter_capturing,
        access.key,
        producer_capturing=producer_capturing,
        done=done,
        what=what,
    )


def check_host_wait(backend: Backend, producer: StreamId, mark: Mark | None, what: str) -> None:
    """The host is about to wait for work on ``producer`` (or for the record
    ``mark``): :class:`CaptureError` if that work is in a capture under way."""
    live = in_capture(backend, mark) if mark is not None else capturing(backend, producer) is True
    if live:
        raise _host_wait_refused(producer, what)


def host_wait_idle(backend: Backend, producer: StreamId, what: str) -> bool:
    """:func:`check_host_wait` for the work enqueued on ``producer`` so far, then
    :func:`stream_idle`, asking the capture state once. Never blocks."""
    state = capturing(backend, producer)
    if state is True:
        raise _host_wait_refused(producer, what)
    return state is False and _query_idle(backend, producer)


def _host_wait_refused(producer: StreamId, what: str) -> CaptureError:
    return CaptureError(
        f"{what}: the pending work is on {producer.describe()}, which is "
        "capturing a graph: it has not run, so the host cannot wait for it; "
        "wait after end_capture() and Graph.launch, or pass stream= a stream in the "
        "same capture"
    )


def host_skips(backend: Backend, access: PendingAccess, what: str) -> bool:
    """Whether the host need not wait for a recorded ``access``: True when it
    was recorded in a capture that has ended (that work runs only when a graph
    is launched; :func:`taken_or_complete`); :class:`CaptureError` when its
    capture is still under way, or was when the record's block was last
    fenced (``access.unfenced``: the work from before it is not recorded)."""
    mark = access.mark
    if access.unfenced:
        raise _host_wait_refused(access.key, what)
    check_host_wait(backend, access.key, mark, what)
    return mark is not None and mark.captured and taken_or_complete(backend, access.event)
