"""Work that a finalizer leaves for the next library call.

A finalizer may call into the library: a ``__del__`` that calls
:func:`~cai_streams.hold` (what ``hold`` is for: "I am about to drop an owner
whose memory a stream still reads"), or a collected ``cs.Stream`` recording
what listens to it before it is destroyed. It runs wherever the object goes:
a cyclic garbage collection starts at any allocation, also one made while
this thread holds one of the library's locks (the record lock, an event
pool's, the lease index's), which are not re-entrant: calling in from there
would wait on this very thread, for good.

So while a collection runs in this thread (``gc.callbacks`` say when), such
work is queued here, and a collected stream with listeners always queues its
end: an append, safe in any thread inside any lock. The next library call
runs the queue outside any lock (``_hold_table.tick``, which every handoff,
export, ``track``, ``hold`` and poller pass makes). Work run later covers at
least as much: a hold recorded later keeps its owner longer, never shorter.
"""

from __future__ import annotations

import gc
import sys
import threading
from collections import deque
from collections.abc import Callable
from types import TracebackType
from typing import Any

__all__ = ["as_finalizer", "in_collection", "later", "pending", "run"]

#: threads in which a garbage collection runs now (its finalizers with it)
_collecting: set[int] = set()
_queue: deque[Callable[[], None]] = deque()


def _on_collection(phase: str, info: dict[str, Any]) -> None:
    # Called by the collector in the thread that collects, before and after.
    if phase == "start":
        _collecting.add(threading.get_ident())
    else:
        _collecting.discard(threading.get_ident())


gc.callbacks.append(_on_collection)


def in_collection() -> bool:
    """Whether a garbage collection runs in this thread now: a finalizer of
    it may have been called while this thread holds a library lock."""
    return bool(_collecting) and threading.get_ident() in _collecting


class as_finalizer:  # noqa: N801 - used as a function: ``with as_finalizer():``
    """``with as_finalizer():`` what the block lets go may run finalizers that
    call the library while this thread may hold its locks (a garbage
    collection's own hook, after the collector says it stopped): treated as
    inside a collection."""

    __slots__ = ("_added",)

    def __enter__(self) -> None:
        ident = threading.get_ident()
        self._added = ident not in _collecting
        _collecting.add(ident)

    def __exit__(self, *exc_info: object) -> None:
        if self._added:
            _collecting.discard(threading.get_ident())


def later(work: Callable[[], None]) -> None:
    """Run ``work`` at the next library call, outside any lock. Only appends."""
    _queue.append(work)


def pending() -> bool:
    return bool(_queue)


def run() -> None:
    """Run the work queued so far (nothing inside a collection): what a
    piece queues again waits for the next call. A piece that fails is
    reported as a finalizer's failure is (``sys.unraisablehook``), not raised
    into whatever library call came next; none stops the others."""
    if in_collection():
        return
    for _ in range(len(_queue)):
        try:
            work = _queue.popleft()
        except IndexError:  # another thread ran it
            return
        try:
            work()
        except Exception as exc:  # noqa: BLE001 - reported as unraisable
            sys.unraisablehook(_Unraisable(exc, work))


class _Unraisable:
    """What ``sys.unraisablehook`` reads (its own argument type cannot be made)."""

    def __init__(self, exc: BaseException, work: object) -> None:
        self.exc_type: type[BaseException] = type(exc)
        self.exc_value: BaseException | None = exc
        self.exc_traceback: TracebackType | None = exc.__traceback__
        self.err_msg: str | None = (
            "Exception ignored in work a finalizer left for the next library call"
        )
        self.object: object = work
