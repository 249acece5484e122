"""Watching a backend's ordering calls: the sanitizer and the tracer use this.

While at least one :class:`Observer` is registered, every backend carries
instance attributes that shadow its record, wait, query, query_stream, synchronize, destroy
and launch methods, call the real method, and tell each observer. With none
registered the attributes are gone and nothing is paid.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from . import _backend
from ._backend import Backend

__all__ = ["Observer", "add", "remove", "saw_complete"]


class Observer:
    """What an observer can hear of; every method does nothing by default."""

    def enqueue(self, backend: Backend, stream: int) -> None:
        """The calling thread enqueues something on ``stream`` (before it does)."""

    def recorded(self, backend: Backend, event: int, stream: int) -> None:
        """``event`` was recorded on ``stream``."""

    def waited(self, backend: Backend, stream: int, event: int) -> None:
        """``stream`` was made to wait for ``event``."""

    def completed(self, backend: Backend, event: int) -> None:
        """The calling thread saw ``event`` complete (a synchronize or a query)."""

    def before_stream_sync(self, backend: Backend, stream: int) -> object:
        """The calling thread is about to synchronize ``stream``; returns a token."""
        return None

    def stream_synced(self, backend: Backend, stream: int, token: object) -> None:
        """The synchronize of ``stream`` returned."""

    def destroyed(self, backend: Backend, event: int) -> None:
        """``event`` was destroyed."""

    def kernel(self, backend: Backend, stream: int, fn: Callable[[], object],
               name: str) -> Callable[[], object]:  # fmt: skip
        """A simulated kernel is about to be enqueued; may return a wrapper of ``fn``."""
        return fn


_lock = threading.RLock()
_observers: tuple[Observer, ...] = ()
_wrapped: dict[int, tuple[Backend, list[str]]] = {}


def add(observer: Observer) -> None:
    global _observers
    with _lock:
        _observers = (*_observers, observer)
        for backend in list(_backend._instances.values()):
            _wrap(backend)
        _backend.instrument = _wrap


def remove(observer: Observer) -> None:
    global _observers
    with _lock:
        _observers = tuple(o for o in _observers if o is not observer)
        if not _observers:
            _backend.instrument = None
            for backend, names in _wrapped.values():
                for name in names:
                    backend.__dict__.pop(name, None)
            _wrapped.clear()


def saw_complete(backend: Backend, event: int) -> None:
    """The calling thread learnt, without a query, that ``event`` is complete
    (its doorbell rang): tell the observers as a query would have."""
    for o in _observers:
        o.completed(backend, event)


def _wrap(backend: Backend) -> None:
    if id(backend) in _wrapped:
        return
    cls = type(backend)

    def record(event: int, stream: int) -> None:
        for o in _observers:
            o.enqueue(backend, stream)
        cls.record(backend, event, stream)
        for o in _observers:
            o.recorded(backend, event, stream)

    def stream_wait_event(stream: int, event: int) -> None:
        for o in _observers:
            o.enqueue(backend, stream)
        cls.stream_wait_event(backend, stream, event)
        for o in _observers:
            o.waited(backend, stream, event)

    def query(event: int) -> bool:
        done = cls.query(backend, event)
        if done:
            for o in _observers:
                o.completed(backend, event)
        return done

    def synchronize_event(event: int) -> None:
        cls.synchronize_event(backend, event)
        for o in _observers:
            o.completed(backend, event)

    def synchronize_stream(stream: int) -> None:
        tokens = [(o, o.before_stream_sync(backend, stream)) for o in _observers]
        cls.synchronize_stream(backend, stream)
        for o, token in tokens:
            o.stream_synced(backend, stream, token)

    def query_stream(stream: int) -> bool:
        # a stream that says "all done" orders the caller after its work so far,
        # as a synchronize would (the clock is taken before the query)
        tokens = [(o, o.before_stream_sync(backend, stream)) for o in _observers]
        done = cls.query_stream(backend, stream)
        if done:
            for o, token in tokens:
                o.stream_synced(backend, stream, token)
        return done

    def destroy_event(event: int) -> None:
        cls.destroy_event(backend, event)
        for o in _observers:
            o.destroyed(backend, event)

    wrappers: dict[str, Any] = {
        "record": record,
        "stream_wait_event": stream_wait_event,
        "query": query,
        "synchronize_event": synchronize_event,
        "synchronize_stream": synchronize_stream,
        "query_stream": query_stream,
        "destroy_event": destroy_event,
    }
    real_launch = getattr(cls, "launch", None)
    if real_launch is not None:

        def launch(stream: int, fn: Callable[[], object], name: str, duration: float) -> None:
            for o in _observers:
                o.enqueue(backend, stream)
                fn = o.kernel(backend, stream, fn, name)
            real_launch(backend, stream, fn, name, duration)

        wrappers["launch"] = launch
    for name, fn in wrappers.items():
        setattr(backend, name, fn)
    _wrapped[id(backend)] = (backend, list(wrappers))
