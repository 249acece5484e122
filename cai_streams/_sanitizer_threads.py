"""Orderings between host threads that the sanitizer sees, while it is on.

A handoff between host threads orders everything the giving thread did
before it before everything the receiving thread does after it. These are
seen, by wrapping the Python-level calls while the sanitizer is on (and only
then): ``Thread.start`` / ``Thread.join``, ``queue.Queue`` ``put`` / ``get``
(and its subclasses), ``concurrent.futures`` (``submit`` into a thread pool,
``set_result`` / ``result``), ``threading.Event`` ``set`` / ``wait``,
``threading.Condition`` ``notify`` / ``wait``, ``asyncio.to_thread``, an
asyncio loop's ``call_soon_threadsafe`` (and so ``run_coroutine_threadsafe``),
``anyio.to_thread.run_sync`` and ``trio.to_thread.run_sync`` (called through
their modules). ``threading.Lock`` and ``RLock`` are C types whose methods
cannot be wrapped: ``_sanitizer_locks`` makes seen ones instead. A function
imported by name before the sanitizer was turned on is not wrapped: say such
orderings with ``cs.happens_before(token)`` and ``cs.happens_after(token)``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import queue
import sys
import threading
import types
from collections.abc import Callable
from typing import Any, Protocol

import anyio.to_thread  # noqa: F401 - whole before install() wraps its run_sync

__all__ = ["Handoffs", "Token", "install", "registered", "uninstall", "unseen"]


class Token:
    """A fresh handoff token (weakly referenced by the sanitizer)."""

    __slots__ = ("__weakref__",)


class Handoffs(Protocol):
    def before(self, token: object) -> None:
        """The calling thread hands over through ``token``."""

    def after(self, token: object) -> None:
        """The calling thread receives what was handed over through ``token``."""

    def started(self, thread: threading.Thread) -> None:
        """The calling thread starts ``thread``."""

    def joined(self, thread: threading.Thread) -> None:
        """The calling thread saw ``thread`` end."""


_saved: list[tuple[Any, str, Any]] = []
_local = threading.local()
_registered: dict[int, threading.Thread] = threading._active  # type: ignore[attr-defined]


def registered() -> threading.Thread | None:
    """The calling thread, or None while it is still starting. Unlike
    ``threading.current_thread()``, it never makes a ``_DummyThread``: one made
    for a thread that is starting (a garbage collection in ``Thread.start``
    runs a hook there) takes its place, and hides the real thread, with what
    its starter handed it, from the sanitizer."""
    return _registered.get(threading.get_ident())


def _tell(report: Callable[[Any], None], arg: Any) -> None:
    """Call ``report`` unless this thread is already inside one (``current_thread()``
    of a foreign thread makes a ``_DummyThread``, which sets an ``Event``)."""
    if getattr(_local, "busy", False) or threading.get_ident() not in _registered:
        return  # (a thread still starting: current_thread() would make a dummy)
    _local.busy = True
    try:
        report(arg)
    finally:
        _local.busy = False


class _Receipt:
    """The callback a thread hands an event loop through
    ``call_soon_threadsafe``, which reports the handoff in the loop's thread
    just before it runs. asyncio's reports name the callback: its name, or
    asyncio's own formatting of it, made only when a report asks."""

    def __init__(
        self, callback: Callable[..., Any], after: Callable[[Any], None], there: Token
    ) -> None:
        self.__wrapped__ = callback  # (asyncio finds its source through it)
        self._after = after
        self._there = there
        if isinstance(callback, (types.FunctionType, types.MethodType)):
            # asyncio prints a function's name, and a Task's method as the task
            self.__qualname__ = callback.__qualname__
            if isinstance(callback, types.MethodType):
                self.__self__ = callback.__self__

    def __call__(self, *args: Any) -> Any:
        _tell(self._after, self._there)
        return self.__wrapped__(*args)

    def __repr__(self) -> str:  # (a partial, a callable object: only when printed)
        helpers = getattr(asyncio, "format_helpers", None)
        fmt = getattr(helpers, "_format_callback", None)
        if fmt is None:
            return repr(self.__wrapped__)
        return str(fmt(self.__wrapped__, (), None)).removesuffix("()")


def unseen(fn: Callable[..., object], *args: Any) -> object:
    """``fn(*args)``, whose use of a wrapped primitive is the library's own
    (a poll policy change waking a loop): no handoff of the user's."""
    previous = getattr(_local, "busy", False)
    _local.busy = True
    try:
        return fn(*args)
    finally:
        _local.busy = previous


def _patch(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
    real = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    _saved.append((owner, name, real))
    setattr(owner, name, make(real))


def _to_thread(h: Handoffs, real: Any, keywords_to_func: bool) -> Any:
    """``real(func, *args, ...)`` runs ``func`` in another thread and awaits it."""

    @functools.wraps(real)
    async def to_thread(func: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        there, back = Token(), Token()
        _tell(h.before, there)
        if keywords_to_func and kwargs:
            func, kwargs = functools.partial(func, **kwargs), {}

        def run(*a: Any) -> Any:
            _tell(h.after, there)
            try:
                return func(*a)
            finally:
                _tell(h.before, back)

        try:
            return await real(run, *args, **kwargs)
        finally:
            _tell(h.after, back)

    return to_thread


def install(h: Handoffs) -> None:
    """Wrap the calls above (once; :func:`uninstall` restores them)."""
    if _saved:
        return

    def start(real: Any) -> Any:
        def wrapped(self: threading.Thread) -> None:
            _tell(h.started, self)
            real(self)

        return wrapped

    def join(real: Any) -> Any:
        def wrapped(self: threading.Thread, timeout: float | None = None) -> None:
            real(self, timeout)
            if not self.is_alive():
                _tell(h.joined, self)

        return wrapped

    def giving(real: Any) -> Any:
        def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            _tell(h.before, self)
            return real(self, *args, **kwargs)

        return wrapped

    def receiving(real: Any) -> Any:
        def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            got = real(self, *args, **kwargs)
            _tell(h.after, self)
            return got

        return wrapped

    def waiting(real: Any) -> Any:  # returns whether it was woken
        def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            got = real(self, *args, **kwargs)
            if got:
                _tell(h.after, self)
            return got

        return wrapped

    def resulting(real: Any) -> Any:
        def wrapped(self: concurrent.futures.Future[Any], *args: Any, **kwargs: Any) -> Any:
            try:
                return real(self, *args, **kwargs)
            finally:
                if self.done():
                    _tell(h.after, self)

        return wrapped

    def submit(real: Any) -> Any:
        def wrapped(self: Any, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
            there = Token()
            _tell(h.before, there)

            def run(*a: Any, **kw: Any) -> Any:
                _tell(h.after, there)
                return fn(*a, **kw)

            return real(self, run, *args, **kwargs)

        return wrapped

    def soon(real: Any) -> Any:  # a thread hands a callback to an event loop's thread
        def wrapped(
            self: Any, callback: Callable[..., Any], *args: Any, context: Any = None
        ) -> Any:
            if getattr(_local, "busy", False):  # (the library's own: see unseen)
                return real(self, callback, *args, context=context)
            if self.get_debug():  # asyncio's own checks, in its order, on the callback
                closed = getattr(self, "_check_closed", None)
                check = getattr(self, "_check_callback", None)
                if closed is not None and check is not None:
                    closed()
                    check(callback, "call_soon_threadsafe")
            there = Token()
            _tell(h.before, there)
            # one handle: a cancel drops the receipt too
            handle = real(self, _Receipt(callback, h.after, there), *args, context=context)
            source = getattr(handle, "_source_traceback", None)
            if source:  # (debug mode: "created at" the caller's line, not this one)
                del source[-1]
            return handle

        return wrapped

    _patch(threading.Thread, "start", start)
    _patch(threading.Thread, "join", join)
    _patch(queue.Queue, "put", giving)
    _patch(queue.Queue, "get", receiving)
    _patch(threading.Event, "set", giving)
    _patch(threading.Event, "wait", waiting)
    _patch(threading.Condition, "notify", giving)
    _patch(threading.Condition, "wait", waiting)
    _patch(concurrent.futures.Future, "set_result", giving)
    _patch(concurrent.futures.Future, "set_exception", giving)
    _patch(concurrent.futures.Future, "result", resulting)
    _patch(concurrent.futures.Future, "exception", resulting)
    _patch(concurrent.futures.ThreadPoolExecutor, "submit", submit)
    _patch(asyncio.BaseEventLoop, "call_soon_threadsafe", soon)
    _patch(asyncio, "to_thread", lambda real: _to_thread(h, real, keywords_to_func=True))
    for name in ("anyio.to_thread", "trio.to_thread"):
        module = sys.modules.get(name)
        # (anyio's is imported with this module; one another thread is importing
        # now has no run_sync yet, and is left alone)
        if module is not None and hasattr(module, "run_sync"):  # (its keywords are
            _patch(module, "run_sync", lambda real: _to_thread(h, real, keywords_to_func=False))


def uninstall() -> None:
    while _saved:
        owner, name, real = _saved.pop()
        setattr(owner, name, real)
