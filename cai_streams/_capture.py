"""Graph capture: ``Stream.begin_capture`` / ``end_capture`` and :class:`Graph`.

Work enqueued on a capturing stream is recorded into a graph, not run;
``Graph.launch(stream)`` replays it. Tracked arrays written or read inside a
capture are remembered with it: their accesses in the capture stand for work
that runs only when the graph is launched, so each launch is ordered like a
``writing()`` (or ``reading()``) block of those arrays on the launch stream,
and a consumer after the launch waits for it. How the rest of the library
keeps a capture valid is ``_capture_guard``'s job.
"""

from __future__ import annotations

import enum
import itertools
import sys
import threading
import warnings
import weakref
from contextlib import ExitStack
from typing import Any

from ._backend import CAPTURE_MODES, Backend, CaptureMode
from ._capture_guard import capturing
from ._errors import CudaError, CudaWarning
from ._identity import StreamId
from ._stream import Stream, as_stream
from ._unique import Unique

__all__ = ["Graph", "GraphState", "begin_capture", "end_capture", "note_captured"]


class _Capture:
    """A capture begun through :meth:`Stream.begin_capture`: the tracked buffers
    accessed in it (id -> (buffer state, whether it writes)). Its :class:`Graph`
    keeps it, and reads ``touched`` at each launch: a block whose stream's
    capture ended while it was open adds its buffer at its end."""

    __slots__ = ("__weakref__", "backend", "device", "origin", "serial", "touched")

    def __init__(self, backend: Backend, origin: StreamId, serial: int) -> None:
        self.backend = backend
        self.device = origin.device
        self.origin = origin
        self.serial = serial
        self.touched: dict[int, tuple[weakref.ref[Any], bool]] = {}


_lock = threading.Lock()  # bookkeeping only
_active: dict[StreamId, _Capture] = {}
#: the newest capture begun on each stream, under way or ended (while its Graph lives)
_recent: weakref.WeakValueDictionary[StreamId, _Capture] = weakref.WeakValueDictionary()
_serials = itertools.count(1)
_newest = 0  # the serial of the newest capture begun
#: streams joined to a capture under way through :meth:`Stream.wait` (forked
#: into it): the capture, so a record on them is told apart from another's
_forks: dict[StreamId, _Capture] = {}
#: the owned :class:`Stream` of each capture under way in ``_active``: a
#: capturing stream cannot close (``close()`` refuses), so a dropped one must
#: not be collected either, whose close would record its consumers' open
#: reads inside the capture (covering the captured work only). A capture
#: ended behind the library's back is forgotten, and its stream let go, when
#: the next capture begins or ends, or a consumer read is noted in one.
_capturing_streams: dict[StreamId, Stream] = {}
#: captures whose end_capture is under way (the driver's end is made outside
#: ``_lock``): another thread's ``_forget_ended`` leaves them to it
_ending: set[_Capture] = set()


def joined(waiter: StreamId, source: StreamId) -> None:
    """``waiter``'s stream now waits for work of ``source``'s (``Stream.wait``):
    if that is a stream of a capture under way, ``waiter`` has joined it."""
    with _lock:
        capture = _active.get(source) or _forks.get(source)
        if capture is not None and _active.get(capture.origin) is capture:
            _forks[waiter] = capture


def serial_now() -> int:
    """The newest capture's serial (0: none yet). Asks no driver, takes no lock."""
    return _newest


def ended_in(
    work: object, writes: bool, key: StreamId, serial: int, at_open: object | None = None
) -> None:
    """A block (or a consumer's lazy read) of ``work`` on ``key``'s stream,
    opened when the newest capture's serial was ``serial`` (and inside the
    capture ``at_open``, if any), ended with an ordinary record. A capture of
    its stream that was under way while it was open and has ended since (one
    begun in it, or the one it opened in) has its captured work in its graph
    but never named the buffer: it does now. (``end_capture`` also looks for
    open blocks and reads, but one may end between the driver's end and that
    look.) Takes no lock when no capture began since (a hot path)."""
    if at_open is None and serial == _newest:
        return  # no capture began since it opened, nor was one under way then
    with _lock:  # (the record was ordinary: no capture of the stream was under way then)
        capture = _recent.get(key)
        if capture is not None and (capture.serial > serial or capture is at_open):
            _touch(capture, work, writes)


def note_captured(work: object, writes: bool, key: StreamId) -> None:
    """A tracked buffer's access was recorded on the capturing stream ``key``.

    It belongs to the capture ``key`` began or, for a stream forked into a
    capture through :meth:`Stream.wait`, to that one; for a stream forked
    otherwise, to the one capture under way on that backend and device, or
    with none there, to the one under way on the backend (a fork from another
    device). Several at once: it cannot be told which, and a launch does not
    order it."""
    dropped: list[Stream] = []  # (let go after the lock: the last reference may close one)
    with _lock:
        capture = _active.get(key)
        if capture is None:
            fork = _forks.get(key)
            if (
                fork is not None
                and _active.get(fork.origin) is fork
                and capturing(fork.backend, fork.origin) is True  # (not ended unseen: a reset)
            ):
                _touch(fork, work, writes)
                return
            dropped.extend(_forget_ended())
            found = [c for c in _active.values() if c.backend is key.backend]
            here = [c for c in found if c.device == key.device]
            if len(here) == 1 or (not here and len(found) == 1):
                capture = (here or found)[0]
            else:
                return
        _touch(capture, work, writes)


def _forget_ended() -> list[Stream]:
    """``_lock`` held: forget the captures that ended or were destroyed behind
    the library's back (another library's end on the handle, a reset), and
    the forks into them; the owned streams kept for them are returned, for
    the caller to let go of once it has released the lock."""
    dropped = []
    for gone in [k for k, c in _active.items() if c not in _ending and _ended(k)]:
        del _active[gone]
        kept = _capturing_streams.pop(gone, None)
        if kept is not None:
            dropped.append(kept)
    for joined_key in [k for k, c in _forks.items() if _active.get(c.origin) is not c]:
        del _forks[joined_key]
    return dropped


def _ended(key: StreamId) -> bool:
    """Whether the capture under way on ``key`` is over, as far as can be
    told (a failed ask, a faulted device say: not known, kept)."""
    try:
        return capturing(key.backend, key) is False
    except CudaError:
        return False


def _touch(capture: _Capture, work: object, writes: bool) -> None:
    """``_lock`` held: ``capture`` accessed ``work`` (wrote it, if ``writes``)."""
    ref, wrote = capture.touched.get(id(work), (None, False))
    if ref is None or ref() is not work:
        ref, wrote = weakref.ref(work), False
    capture.touched[id(work)] = (ref, wrote or writes)


def _note_open_on(capture: _Capture, key: StreamId) -> None:
    """At the end of ``capture``, begun on ``key``'s stream: the tracked
    buffers with a ``writing()`` / ``reading()`` block (a ``consuming()`` body)
    or a consumer's read still open on that stream. Their work from inside the
    capture is in the graph, but their record comes after the capture ended,
    an ordinary one that orders nothing about a launch, so the capture itself
    never named them. Asks no driver; one pass over the backend's tracked
    buffers, taking no buffer's lock (a copy of each list is one step under
    the GIL: a block opened or closed meanwhile is a race of the caller's)."""
    from ._access import AccessState, Kind  # late: _access imports this module
    from ._scheduler import schedulers_of

    found: list[tuple[object, bool]] = []
    for sched in schedulers_of(key.backend):
        with sched.lock:
            works = [*sched.buffers.values(), *sched._orphans]
        for work in works:
            on = [b.kind for b in list(work.blocks) if b.key == key]
            if any(a.key == key and a.state is AccessState.LAZY for a in list(work.reads)):
                on.append(Kind.READ)
            if on:
                found.append((work, Kind.WRITE in on))
    with _lock:
        for buffer, writes in found:
            _touch(capture, buffer, writes)


def any_under_way() -> bool:
    """Whether a capture this library began may be under way (none has been
    seen to end). Asks no driver: a handoff's cheap first question."""
    return bool(_active)


def under_way(key: StreamId) -> object | None:
    """The capture this library began on ``key``'s stream and has not seen
    end, if any: a token that another capture never equals. Asks no driver."""
    return _active.get(key)


def begin_capture(stream: Stream, mode: object) -> None:
    if not isinstance(mode, str):
        raise TypeError(f"capture mode must be a str, got {type(mode).__name__}")
    if mode not in CAPTURE_MODES:
        raise ValueError(
            f"capture mode must be one of {', '.join(map(repr, CAPTURE_MODES))}, got {mode!r}"
        )
    checked: CaptureMode = mode
    global _newest
    stream.backend.begin_capture(stream.handle, checked)
    key = stream._key()
    with _lock:
        dropped = _forget_ended()  # (each capture begun or ended looks: see its docstring)
        capture = _active[key] = _recent[key] = _Capture(stream.backend, key, next(_serials))
        _newest = capture.serial
        if stream._owned:
            _capturing_streams[key] = stream
    del dropped  # (outside the lock: the last reference may close one)


def end_capture(stream: Stream) -> Graph:
    backend, handle, key = stream.backend, stream.handle, stream._key()
    kept = None
    ended = False  # (whether the capture this ends is over, for its Graph)
    with _lock:
        mine = _active.get(key)
        if mine is not None:
            _ending.add(mine)
    over = False  # (the driver's end returned: the capture is over, whatever begins next)
    try:
        graph = backend.end_capture(handle)
        over = True
    finally:
        still = not over and _still_capturing(backend, handle)
        with _lock:
            if mine is not None:
                _ending.discard(mine)
                now = _active.get(key)
                if now is mine and not still:
                    del _active[key]
                    kept = _capturing_streams.pop(key, None)
                    ended = True
                elif now is not mine:  # another thread began one on the stream since
                    ended = True  # the driver ended this one: that one keeps the stream
                if ended:
                    for fork in [k for k, c in _forks.items() if c is mine]:
                        del _forks[fork]
            dropped = _forget_ended()
        del kept, dropped  # (outside the lock: the last reference may close one)
    capture = mine if ended else None
    if capture is not None:
        _note_open_on(capture, key)
    return Graph._made(backend, graph, capture)


def _still_capturing(backend: Backend, handle: int) -> bool:
    try:
        return backend.is_capturing(handle)
    except CudaError:
        return False


class GraphState(enum.Enum):
    """A :class:`Graph`'s phases: captured; instantiated (an executable made
    by the first launch, kept for the next); closed."""

    CAPTURED = "captured"
    INSTANTIATED = "instantiated"
    CLOSED = "closed"


class Graph(Unique):
    """The work captured between :meth:`Stream.begin_capture` and
    :meth:`Stream.end_capture`, to replay with :meth:`launch`.

    :meth:`close` (or leaving a ``with`` block, or collection) releases the
    graph and its executable; a launch already enqueued still runs.
    """

    __slots__ = ("__weakref__", "_backend", "_capture", "_exec", "_graph", "_lock", "_state")

    _backend: Backend
    _capture: _Capture | None
    _exec: int
    _graph: int
    _lock: threading.Lock
    _state: GraphState

    def __init__(self) -> None:
        raise TypeError("Graphs are made by Stream.end_capture()")

    @classmethod
    def _made(cls, backend: Backend, graph: int, capture: _Capture | None) -> Graph:
        self = cls.__new__(cls)
        self._backend = backend
        self._graph = graph
        self._exec = 0
        self._lock = threading.Lock()  # the first launch instantiates, once
        self._capture = capture  # (None: not begun through Stream.begin_capture)
        self._state = GraphState.CAPTURED
        return self

    @property
    def handle(self) -> int:
        """The graph's handle (a ``cudaGraph_t``)."""
        self._check_open()
        return self._graph

    def _check_open(self) -> None:
        if self._state is GraphState.CLOSED:
            raise ValueError("this Graph is closed")

    def launch(self, stream: object) -> None:
        """Replay the captured work on ``stream``, after the work enqueued on it
        so far and after earlier launches of this graph. Only enqueues GPU work.

        The first launch makes the executable graph (cudaGraphInstantiate; kept
        for the next launches). Tracked arrays the capture wrote or read are
        ordered as by ``writing(stream)`` / ``reading(stream)`` blocks around
        the launch: the launch waits for their pending conflicting work, and
        their next consumers wait for the launch. May wait (bounded) for
        another thread's open ``writing()`` block of one of them.
        """
        self._check_open()
        s = as_stream(stream, self._backend)
        with self._lock:
            if self._state is GraphState.CAPTURED:
                self._exec = self._backend.instantiate_graph(self._graph)
                self._state = GraphState.INSTANTIATED
        from ._access import Kind  # late: _access imports this module
        from ._tracked import _enter

        found = [] if self._capture is None else list(self._capture.touched.values())
        touched = [(work, writes) for ref, writes in found if (work := ref()) is not None]
        touched.sort(key=lambda pair: id(pair[0]))  # one order for every launch: no
        with ExitStack() as blocks:  # two launches hold a block each the other waits for
            for work, writes in touched:
                kind = Kind.WRITE if writes else Kind.READ
                block = _enter(work, kind, False, s, "Graph.launch()")
                blocks.callback(work.leave, block)
            self._backend.launch_graph(self._exec, s.handle)

    def close(self) -> None:
        """Destroy the graph and its executable. Safe to call twice. Does not block."""
        with self._lock:
            if self._state is GraphState.CLOSED:
                return
            graph_exec, self._exec = self._exec, 0
            self._state = GraphState.CLOSED
        try:
            if graph_exec:
                self._backend.destroy_graph_exec(graph_exec)
        finally:
            self._backend.destroy_graph(self._graph)

    def __enter__(self) -> Graph:
        """The graph itself. Does not block."""
        return self

    def __exit__(self, *exc_info: object) -> None:
        """:meth:`close`, as that says."""
        self.close()

    def __repr__(self) -> str:
        return f"<Graph {self._graph:#x} on {self._backend.name} ({self._state.value})>"

    def __del__(self) -> None:
        if getattr(self, "_state", GraphState.CLOSED) is GraphState.CLOSED:
            return
        if sys.is_finalizing():
            self._state = GraphState.CLOSED
            return
        try:
            self.close()
        except Exception as exc:  # never raise from a destructor
            warnings.warn(f"leaked graph {self._graph:#x}: {exc}", CudaWarning, stacklevel=1)
