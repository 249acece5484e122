"""The one observation channel: the sanitizer and the tracer hear of the device here.

Two kinds of news come through it. What the library declares: the byte
ranges each operation reads and writes (:func:`stream_access`,
:func:`host_access`), the buffer it works for (:class:`Scope`) and the held
owners it lets go once their work is done (:func:`hold_released`); a
declaration site tests :data:`active` first, so it costs nothing while nobody
observes. And what the device is told: while at least one :class:`Observer`
is registered, every backend carries
instance attributes that shadow the methods named in :data:`_CALLS`, call the
real method and tell each observer; the simulator's kernel and free hooks are
routed here too. With none registered the attributes and hooks are gone and
nothing is paid. A new backend call that orders anything is one row of
:data:`_CALLS`.

Each completion (an event query that says done, a synchronize) says whether
the user's program made it (``user=True``) or the library did for its own
bookkeeping (the poller, the event pool, ``stats()``, the scheduler's
elisions). A call is the user's when it comes from outside this package or
from its user-facing handles (``Stream.synchronize``, ``Event.is_done``,
``Event.synchronize``, ``SimArray.to_host``): the sanitizer orders the host
after the user's own synchronization only, so its verdict does not depend on
what the library happened to find complete.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any, Final

from . import _backend
from ._backend import Backend

__all__ = [
    "Observer",
    "Scope",
    "acquired",
    "add",
    "hold_released",
    "host_access",
    "released",
    "remove",
    "saw_complete",
    "stream_access",
    "stream_ordered",
]

_PACKAGE_DIR: Final = os.path.dirname(os.path.abspath(__file__))
#: modules of this package whose backend calls are the user's own (public handles)
_USER_FACING: Final = ("_stream.py", "sim.py", "_demo.py")


class Observer:
    """What an observer can hear of; every method does nothing by default."""

    def enqueue(self, backend: Backend, stream: int) -> None:
        """The calling thread enqueues something on ``stream`` (before it does)."""

    def recorded(self, backend: Backend, event: int, stream: int) -> None:
        """``event`` was recorded on ``stream``."""

    def waited(self, backend: Backend, stream: int, event: int) -> None:
        """``stream`` was made to wait for ``event``."""

    def completed(self, backend: Backend, event: int, user: bool) -> None:
        """The calling thread saw ``event`` complete (a synchronize or a query)."""

    def before_stream_sync(self, backend: Backend, stream: int) -> object:
        """The calling thread is about to synchronize or query ``stream``; returns a token."""
        return None

    def stream_synced(self, backend: Backend, stream: int, token: object, user: bool) -> None:
        """The synchronize of ``stream`` returned, or a query found it idle."""

    def destroyed(self, backend: Backend, event: int) -> None:
        """``event`` was destroyed."""

    def kernel(
        self, backend: Backend, stream: int, fn: Callable[[], object], name: str
    ) -> Callable[[], object]:
        """A simulated kernel is about to be enqueued; may return a wrapper of ``fn``."""
        return fn

    def capture_began(self, backend: Backend, stream: int) -> None:
        """``stream`` began capturing: what is enqueued on it is recorded, not run."""

    def capture_ended(self, backend: Backend, stream: int, graph: int) -> None:
        """The capture on ``stream`` ended, as ``graph``."""

    def capture_abandoned(self, backend: Backend, stream: int) -> None:
        """The capture on ``stream`` ended with no graph (it was invalidated):
        what it took never runs, and what comes next on the stream runs."""

    def instantiated(self, backend: Backend, graph: int, graph_exec: int) -> None:
        """``graph`` was instantiated as ``graph_exec``."""

    def graph_launch(self, backend: Backend, graph_exec: int, stream: int) -> None:
        """``graph_exec`` is about to be replayed on ``stream`` (before it is)."""

    def graph_destroyed(self, backend: Backend, graph: int, executable: bool) -> None:
        """A graph (or, ``executable``, an instantiated one) was destroyed."""

    def stream_access(
        self,
        backend: Backend,
        stream: int,
        reads: list[tuple[int, int]],
        writes: list[tuple[int, int]],
        what: str,
    ) -> None:
        """Work about to be enqueued on ``stream`` reads and writes these byte ranges."""

    def host_access(
        self,
        kind: str,
        ranges: list[tuple[int, int]],
        what: str,
        waited: list[object],
        events: list[tuple[Backend, int]],
        view: object = None,
    ) -> None:
        """The calling host thread reads or writes these byte ranges now, after
        ``waited`` / ``events`` when a call of the user's waited for them.
        ``kind`` "ready": the library says the data is ready to read now (checked
        as a read, but nobody reads it yet: not kept as one); "fill": the
        simulator writes a new block's pattern (checked as a write, not kept:
        on a GPU nothing is written). A read through ``view`` lasts while the
        view lives (a ``consume``'s); else the access is over on return."""

    def scope_entered(self, scope: object) -> None:
        """The calling thread starts working for ``scope`` (a buffer's pending work)."""

    def scope_left(self, scope: object) -> None:
        """The calling thread's work for ``scope`` ended."""

    def stream_ordered(self, backend: Backend, stream: int) -> None:
        """The library ordered ``stream`` after the work of the scope it works for."""

    def kernel_ran(self, stream: int, name: str, start: float, end: float) -> None:
        """A simulated kernel ran, on its stream's worker thread."""

    def freed(self, lo: int, hi: int) -> None:
        """Simulated device memory ``[lo, hi)`` went back to its pool."""

    def hold_released(self, backend: Backend, event: int, ranges: list[tuple[int, int]]) -> None:
        """The library saw a hold's ``event`` complete and lets go of its owner,
        whose memory is ``ranges``: that memory is freed after this."""


_lock = threading.RLock()
_observers: tuple[Observer, ...] = ()
#: True while anyone observes: a declaration site tests it first, so it is free when off
active = False
_wrapped: dict[int, tuple[Backend, list[str]]] = {}
_users: dict[str, bool] = {}  # code file -> whether its backend calls are the user's


def _by_user(frame_depth: int = 2) -> bool:
    """Whether the backend call being made comes from the user's program."""
    path = sys._getframe(frame_depth).f_code.co_filename
    found = _users.get(path)
    if found is None:
        inside = os.path.abspath(path).startswith(_PACKAGE_DIR)
        found = _users[path] = not inside or os.path.basename(path) in _USER_FACING
    return found


def _kernel_ran(stream: int, name: str, start: float, end: float) -> None:
    for o in _observers:
        o.kernel_ran(stream, name, start, end)


def _freed(lo: int, hi: int) -> None:
    for o in _observers:
        o.freed(lo, hi)


# -- what the library declares: the accesses it makes and the scope it works in ---


def stream_access(backend: Backend, stream: int, reads: Iterable[tuple[int, int]],
                  writes: Iterable[tuple[int, int]], what: str) -> None:  # fmt: skip
    reads, writes = list(reads), list(writes)
    for o in _observers:
        o.stream_access(backend, stream, reads, writes, what)


def host_access(kind: str, ranges: Iterable[tuple[int, int]], what: str, *,
                waited: Iterable[object] = (),
                events: Iterable[tuple[Backend, int]] = (),
                view: object = None) -> None:  # fmt: skip
    """``waited`` and ``events``: what a call of the user's that returned (a
    ``consume``) waited for: the scopes the library worked in, the events;
    ``view``: what the host reads through, for as long as it lives."""
    ranges, waited, events = list(ranges), list(waited), list(events)
    for o in _observers:
        o.host_access(kind, ranges, what, waited, events, view)


def acquired(scope: object) -> None:
    """The calling thread starts working for ``scope`` (it took a buffer's lock)."""
    for o in _observers:
        o.scope_entered(scope)


def released(scope: object) -> None:
    for o in _observers:
        o.scope_left(scope)


def hold_released(backend: Backend, event: int, ranges: Iterable[tuple[int, int]]) -> None:
    """The calling thread saw a hold's ``event`` complete and lets go of its
    owner now (see :meth:`Observer.hold_released`)."""
    ranges = list(ranges)
    for o in _observers:
        o.hold_released(backend, event, ranges)


def stream_ordered(backend: Backend, stream: int) -> None:
    """The library ordered ``stream`` after its scope's work, by waits or by
    finding that work complete."""
    for o in _observers:
        o.stream_ordered(backend, stream)


class Scope:
    """``with Scope(obj):`` the library works for ``obj`` (see :func:`acquired`);
    nothing while nobody observes. A class: cheaper than a generator."""

    __slots__ = ("_obj",)

    def __init__(self, obj: object) -> None:
        self._obj: object | None = obj if active else None

    def __enter__(self) -> None:
        if self._obj is not None:
            acquired(self._obj)

    def __exit__(self, *exc_info: object) -> None:
        if self._obj is not None:
            released(self._obj)


def add(observer: Observer) -> None:
    global _observers, active
    from ._backend import _sim

    with _lock:
        if not _observers:
            _sim.kernel_hooks.append(_kernel_ran)
            _sim.free_hooks.append(_freed)
        _observers = (*_observers, observer)
        active = True
        for backend in list(_backend._instances.values()):
            _wrap(backend)
        _backend.instrument = _wrap


def remove(observer: Observer) -> None:
    global _observers, active
    from ._backend import _sim

    with _lock:
        _observers = tuple(o for o in _observers if o is not observer)
        if not _observers:
            active = False
            _backend.instrument = None
            _sim.kernel_hooks.remove(_kernel_ran)
            _sim.free_hooks.remove(_freed)
            for backend, names in _wrapped.values():
                for name in names:
                    backend.__dict__.pop(name, None)
            _wrapped.clear()


def saw_complete(backend: Backend, event: int) -> None:
    """The calling thread learnt, without a query, that ``event`` is complete
    (its doorbell rang): tell the observers as a library query would have."""
    for o in _observers:
        o.completed(backend, event, False)


# -- the backend calls that order anything: one wrapper each ---------------------

Wrapper = Callable[[Backend, Any], Callable[..., Any]]


def _record(backend: Backend, real: Any) -> Callable[..., Any]:
    def record(event: int, stream: int) -> None:
        for o in _observers:
            o.enqueue(backend, stream)
        real(backend, event, stream)
        for o in _observers:
            o.recorded(backend, event, stream)

    return record


def _stream_wait_event(backend: Backend, real: Any) -> Callable[..., Any]:
    def stream_wait_event(stream: int, event: int) -> None:
        for o in _observers:
            o.enqueue(backend, stream)
        real(backend, stream, event)
        for o in _observers:
            o.waited(backend, stream, event)

    return stream_wait_event


def _query(backend: Backend, real: Any) -> Callable[..., Any]:
    def query(event: int) -> bool:
        done: bool = real(backend, event)
        if done:
            user = _by_user()
            for o in _observers:
                o.completed(backend, event, user)
        return done

    return query


def _synchronize_event(backend: Backend, real: Any) -> Callable[..., Any]:
    def synchronize_event(event: int) -> None:
        real(backend, event)
        user = _by_user()
        for o in _observers:
            o.completed(backend, event, user)

    return synchronize_event


def _synchronize_stream(backend: Backend, real: Any) -> Callable[..., Any]:
    def synchronize_stream(stream: int) -> None:
        tokens = [(o, o.before_stream_sync(backend, stream)) for o in _observers]
        real(backend, stream)
        user = _by_user()
        for o, token in tokens:
            o.stream_synced(backend, stream, token, user)

    return synchronize_stream


def _query_stream(backend: Backend, real: Any) -> Callable[..., Any]:
    def query_stream(stream: int) -> bool:
        # a stream that says "all done" orders the caller after its work so
        # far, as a synchronize would (the clock is taken before the query)
        tokens = [(o, o.before_stream_sync(backend, stream)) for o in _observers]
        done: bool = real(backend, stream)
        if done:
            user = _by_user()
            for o, token in tokens:
                o.stream_synced(backend, stream, token, user)
        return done

    return query_stream


# Destroys tell the observers first, while the handle is still the caller's:
# once destroyed, another thread may be handed the same handle (the driver and
# the simulator reuse them) and record it, and that record must not be forgotten.


def _destroy_event(backend: Backend, real: Any) -> Callable[..., Any]:
    def destroy_event(event: int) -> None:
        for o in _observers:
            o.destroyed(backend, event)
        real(backend, event)

    return destroy_event


def _launch(backend: Backend, real: Any) -> Callable[..., Any]:
    def launch(stream: int, fn: Callable[[], object], name: str, duration: float) -> None:
        for o in _observers:
            o.enqueue(backend, stream)
            fn = o.kernel(backend, stream, fn, name)
        real(backend, stream, fn, name, duration)

    return launch


def _begin_capture(backend: Backend, real: Any) -> Callable[..., Any]:
    def begin_capture(stream: int, mode: Any) -> None:
        real(backend, stream, mode)
        for o in _observers:
            o.capture_began(backend, stream)

    return begin_capture


def capture_abandoned(backend: Backend, stream: int) -> None:
    """Tell every observer that the capture on ``stream`` ended with no graph
    (a device reset ended it)."""
    for o in _observers:
        o.capture_abandoned(backend, stream)


def _end_capture(backend: Backend, real: Any) -> Callable[..., Any]:
    def end_capture(stream: int) -> int:
        try:
            graph: int = real(backend, stream)
        except BaseException:
            # an invalidated capture ends in an error, and the stream has left
            # capture mode all the same: what it took never runs
            if not backend.is_capturing(stream):
                capture_abandoned(backend, stream)
            raise
        for o in _observers:
            o.capture_ended(backend, stream, graph)
        return graph

    return end_capture


def _instantiate_graph(backend: Backend, real: Any) -> Callable[..., Any]:
    def instantiate_graph(graph: int) -> int:
        graph_exec: int = real(backend, graph)
        for o in _observers:
            o.instantiated(backend, graph, graph_exec)
        return graph_exec

    return instantiate_graph


def _launch_graph(backend: Backend, real: Any) -> Callable[..., Any]:
    def launch_graph(graph_exec: int, stream: int) -> None:
        for o in _observers:
            o.enqueue(backend, stream)
            o.graph_launch(backend, graph_exec, stream)
        real(backend, graph_exec, stream)

    return launch_graph


def _destroy_graph(backend: Backend, real: Any) -> Callable[..., Any]:
    def destroy_graph(graph: int) -> None:
        for o in _observers:
            o.graph_destroyed(backend, graph, False)
        real(backend, graph)

    return destroy_graph


def _destroy_graph_exec(backend: Backend, real: Any) -> Callable[..., Any]:
    def destroy_graph_exec(graph_exec: int) -> None:
        for o in _observers:
            o.graph_destroyed(backend, graph_exec, True)
        real(backend, graph_exec)

    return destroy_graph_exec


#: backend method -> how its wrapper tells the observers (methods a backend lacks are skipped)
_CALLS: Final[dict[str, Wrapper]] = {
    "record": _record,
    "stream_wait_event": _stream_wait_event,
    "query": _query,
    "synchronize_event": _synchronize_event,
    "synchronize_stream": _synchronize_stream,
    "query_stream": _query_stream,
    "destroy_event": _destroy_event,
    "launch": _launch,
    "begin_capture": _begin_capture,
    "end_capture": _end_capture,
    "instantiate_graph": _instantiate_graph,
    "launch_graph": _launch_graph,
    "destroy_graph": _destroy_graph,
    "destroy_graph_exec": _destroy_graph_exec,
}


def _wrap(backend: Backend) -> None:
    if id(backend) in _wrapped:
        return
    cls = type(backend)
    names = []
    for name, make in _CALLS.items():
        real = getattr(cls, name, None)
        if real is not None:
            setattr(backend, name, make(backend, real))
            names.append(name)
    _wrapped[id(backend)] = (backend, names)
