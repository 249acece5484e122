"""``threading.Lock`` and ``RLock`` handoffs that the sanitizer sees, while it is on.

Data handed from one host thread to another under a lock (the writer's
``with lock:`` publishes, the reader's later ``with lock:`` takes it) is
ordered: a release happens before every later acquire of the same lock. The
locks are C types whose methods cannot be wrapped, so while the sanitizer is
on ``threading.Lock`` and ``threading.RLock`` make a thin wrapper around a
real lock: its release reports ``before(lock)`` while still holding it, and
a successful acquire (blocking, with a timeout, as a context manager, or by
a ``Condition`` built on it) reports ``after(lock)``. The wrapper itself is
the token, weakly referenced, so nothing is kept alive. Uninstalling puts the
originals back; wrappers made meanwhile keep working and report nothing.

Only locks the user's code makes are wrapped (``threading.Condition()`` made
by it included): the private locks of the standard library's primitives
(``Queue``, ``Event``, thread pools), of installed packages (site-packages:
trio, for one, requires real locks), of generated code and of this package
stay plain, so they add no ordering beyond what each primitive promises,
whatever the timing. A reference to the factory kept past the sanitizer's end
makes plain locks.
Not seen: locks made before the sanitizer was turned on or through
``_thread`` directly. State those orderings with ``cs.happens_before(token)``
/ ``cs.happens_after(token)``.
"""

from __future__ import annotations

import _thread
import os
import sys
import threading
from typing import Any, Final

from ._sanitizer_threads import Handoffs, _tell

__all__ = ["install", "uninstall"]

_PACKAGE_DIR: Final = os.path.dirname(os.path.abspath(__file__)) + os.sep
_STDLIB_DIR: Final = os.path.dirname(os.path.abspath(threading.__file__)) + os.sep
_CONDITION_INIT: Final = threading.Condition.__init__.__code__

#: the installed reporter (None: off, every wrapper is a plain lock)
_handoffs: Handoffs | None = None
_originals: tuple[Any, Any] | None = None


class _SeenLock:
    """A ``threading.Lock`` whose handoffs the sanitizer sees."""

    __slots__ = ("__weakref__", "_lock")
    _lock: Any  # a _thread lock (an RLock in the subclass)

    def __init__(self) -> None:
        self._lock = _thread.allocate_lock()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got: bool = self._lock.acquire(blocking, timeout)
        h = _handoffs
        if got and h is not None:
            _tell(h.after, self)
        return got

    __enter__ = acquire

    def release(self) -> None:
        h = _handoffs
        if h is not None:  # reported while held: no acquirer can come between
            _tell(h.before, self)
        self._lock.release()

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def locked(self) -> bool:
        return bool(self._lock.locked())

    def _at_fork_reinit(self) -> None:
        self._lock._at_fork_reinit()

    acquire_lock, release_lock, locked_lock = acquire, release, locked

    def __repr__(self) -> str:
        return f"<sanitizer-seen {self._lock!r}>"


class _SeenRLock(_SeenLock):
    """A ``threading.RLock`` whose handoffs the sanitizer sees, including the
    full release and re-acquire a ``Condition.wait`` makes."""

    __slots__ = ()

    def __init__(self) -> None:
        self._lock = _thread.RLock()

    def _release_save(self) -> Any:
        h = _handoffs
        if h is not None:
            _tell(h.before, self)
        return self._lock._release_save()

    def _acquire_restore(self, state: Any) -> None:
        self._lock._acquire_restore(state)
        h = _handoffs
        if h is not None:
            _tell(h.after, self)

    def _is_owned(self) -> bool:
        return bool(self._lock._is_owned())

    def _recursion_count(self) -> int:
        return int(self._lock._recursion_count())


def _made_by_user() -> bool:
    """Whether the caller of ``threading.Lock()`` / ``RLock()`` (or of a
    ``Condition()`` that makes its own lock) is the user's code: neither the
    standard library (a ``Queue``'s or an ``Event``'s private lock orders more
    than what the primitive promises, and how much depends on timing) nor this
    package (its bookkeeping orders nothing the user's program relies on)."""
    if _handoffs is None:  # a reference to the factory kept past uninstall()
        return False
    frame = sys._getframe(1).f_back  # the caller of _lock / _rlock
    if frame is not None and frame.f_code is _CONDITION_INIT:
        frame = frame.f_back
    if frame is None:  # called straight from C: nobody's lock in particular
        return False
    path = frame.f_code.co_filename
    # Generated code (attrs' __init__, "<frozen ...>", "<string>") and installed
    # packages are libraries too: their locks are their own primitives (trio
    # checks that its locks are _thread's).
    return not (
        path.startswith((_PACKAGE_DIR, _STDLIB_DIR, "<"))
        or f"{os.sep}site-packages{os.sep}" in path
        or f"{os.sep}dist-packages{os.sep}" in path
    )


def _lock() -> Any:
    """``threading.Lock()`` while sanitizing."""
    return _SeenLock() if _made_by_user() else _thread.allocate_lock()


def _rlock() -> Any:
    """``threading.RLock()`` while sanitizing."""
    return _SeenRLock() if _made_by_user() else _thread.RLock()


def install(h: Handoffs) -> None:
    """Make ``threading.Lock`` / ``RLock`` report to ``h`` (once; :func:`uninstall`
    restores them)."""
    global _handoffs, _originals
    if _originals is None:
        _originals = (threading.Lock, threading.RLock)
        threading.Lock = _lock  # type: ignore[assignment]
        threading.RLock = _rlock  # type: ignore[assignment]
    _handoffs = h


def uninstall() -> None:
    global _handoffs, _originals
    _handoffs = None
    if _originals is not None:
        threading.Lock, threading.RLock = _originals
        _originals = None
