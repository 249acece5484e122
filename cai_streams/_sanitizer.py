"""Happens-before hazard detection for stream-ordered memory access.

The model is ThreadSanitizer's (FastTrack): every actor (a stream, or a host
thread) has a vector clock.

* Stream order: each operation on a stream ticks that stream's own entry;
  work a host thread enqueues on a stream is ordered after what that thread
  did before (the stream's clock joins the thread's).
* An event captures the recording stream's clock when it is recorded (a
  re-record replaces it); a stream waiting on the event joins that clock; a
  host thread joins it when it synchronizes the event or a query says it is
  complete. A stream synchronize joins the stream's clock into the thread.
* The legacy default stream (1) and the blocking per-thread default streams
  (2) wait for each other, as in CUDA; ``Stream()`` streams are non-blocking.

Each access (a read or a write of a byte range, by a stream operation or by
the host) is checked against the last write and the reads since, of every
overlapping range: an access is ordered after an earlier one when the
accessor's clock has reached the earlier access's tick. An unordered pair
where at least one is a write raises :class:`~cai_streams.HazardError` at
the second access, before it is enqueued, whatever the timing.

Granularity and what is not modelled: byte ranges as declared (a kernel that
declares a whole array is checked as touching all of it, strided or not);
accesses only where the program declares them (``sim.launch`` reads/writes,
``to_host``, ``writing``/``reading`` blocks, ``consume``, ``export``), so work
another library enqueues without declaring it is invisible; ordering between
host threads through Python (locks, queues, ``to_thread``) is not seen unless
the program says so with ``happens_before(token)`` / ``happens_after(token)``
(the library's own locks are seen), so a host thread is otherwise ordered only
after what it waited for itself; memory freed and reused is forgotten on the
simulated device only.

Actors are stream identities (``_identity.StreamId``): a stream closed and
its handle reused is a new actor, and handle 2 is one actor per host thread.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from collections.abc import Hashable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any, Final

from . import _observe
from ._backend import LEGACY_DEFAULT_STREAM, PER_THREAD_DEFAULT_STREAM, Backend
from ._errors import HazardError
from ._identity import StreamId, stream_id_now, thread_serial
from ._observe import Observer

__all__ = ["happens_after", "happens_before", "sanitize", "sanitizing"]

_PACKAGE_DIR: Final = os.path.dirname(os.path.abspath(__file__))
_BUCKET: Final = 1 << 20  # shadow ranges are indexed by 1 MiB bucket

Clock = dict[Hashable, int]
Actor = tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class Access:
    """One recorded access: who, when (its tick), where in the program."""

    kind: str  # "read" or "write"
    actor: Actor
    tick: int
    lo: int
    hi: int
    what: str  # "kernel 'fill'", "writing() block", "to_host()", ...
    site: str  # "file.py:12"

    def describe(self) -> str:
        return (
            f"{self.kind} of {self.hi - self.lo} bytes at {self.lo:#x} by "
            f"{actor_name(self.actor)} ({self.what}, {self.site})"
        )


def actor_name(actor: Actor) -> str:
    if actor[0] == "host":
        return f"host thread {actor[2]!r}"
    key: StreamId = actor[1]
    return key.describe()


class _Shadow:
    __slots__ = ("hi", "lo", "reads", "write")

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.write: Access | None = None
        self.reads: dict[Actor, Access] = {}


class _State:
    """Everything the sanitizer knows; one lock guards it all."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.clocks: dict[Actor, Clock] = {}
        self.events: dict[tuple[Backend, int], Clock] = {}
        self.shadows: dict[tuple[int, int], _Shadow] = {}
        self.buckets: dict[int, set[tuple[int, int]]] = {}
        self.blocking: set[Actor] = set()
        self.locks: weakref.WeakKeyDictionary[object, Clock] = weakref.WeakKeyDictionary()
        self.tokens: dict[Hashable, Clock] = {}
        self.checked = 0

    # -- actors and clocks -------------------------------------------------

    @staticmethod
    def host() -> Actor:
        return ("host", thread_serial(), threading.current_thread().name)

    @staticmethod
    def stream(backend: Backend, handle: int) -> Actor:
        """The stream ``handle`` is for work the calling thread enqueues now."""
        return ("stream", stream_id_now(backend, handle))

    def clock(self, actor: Actor) -> Clock:
        c = self.clocks.get(actor)
        if c is None:
            c = self.clocks[actor] = {actor: 0}
        return c

    @staticmethod
    def join(into: Clock, other: Clock) -> None:
        for k, v in other.items():
            mine = into.get(k)
            if mine is None or mine < v:  # a 0 is kept: "ordered after its start"
                into[k] = v

    def enqueue(self, backend: Backend, handle: int) -> Clock:
        """The calling host thread enqueues on ``handle``: the stream's clock,
        joined with the thread's and by the legacy/blocking-stream rule."""
        actor = self.stream(backend, handle)
        key: StreamId = actor[1]
        c = self.clock(actor)
        self.join(c, self.clock(self.host()))
        if handle == LEGACY_DEFAULT_STREAM:
            for b in self.blocking:
                other: StreamId = b[1]
                if other.backend is backend and other.device == key.device:
                    self.join(c, self.clock(b))
        elif handle == PER_THREAD_DEFAULT_STREAM:
            self.blocking.add(actor)
            self.join(c, self.clock(self.stream(backend, LEGACY_DEFAULT_STREAM)))
        return c

    # -- shadow memory -----------------------------------------------------

    def overlapping(self, lo: int, hi: int) -> Iterator[_Shadow]:
        seen: set[tuple[int, int]] = set()
        for b in range(lo // _BUCKET, (hi - 1) // _BUCKET + 1):
            for key in list(self.buckets.get(b, ())):
                if key not in seen:
                    seen.add(key)
                    shadow = self.shadows[key]
                    if shadow.lo < hi and lo < shadow.hi:
                        yield shadow

    def shadow(self, lo: int, hi: int) -> _Shadow:
        s = self.shadows.get((lo, hi))
        if s is None:
            s = self.shadows[(lo, hi)] = _Shadow(lo, hi)
            for b in range(lo // _BUCKET, (hi - 1) // _BUCKET + 1):
                self.buckets.setdefault(b, set()).add((lo, hi))
        return s

    def drop(self, shadow: _Shadow) -> None:
        key = (shadow.lo, shadow.hi)
        del self.shadows[key]
        for b in range(shadow.lo // _BUCKET, (shadow.hi - 1) // _BUCKET + 1):
            keys = self.buckets[b]
            keys.discard(key)
            if not keys:
                del self.buckets[b]

    def forget(self, lo: int, hi: int) -> None:
        """Memory was freed: what was known about it no longer applies."""
        with self.lock:
            for shadow in list(self.overlapping(lo, hi)):
                if lo <= shadow.lo and shadow.hi <= hi:
                    self.drop(shadow)

    def access(self, actor: Actor, clock: Clock, items: Iterable[tuple[str, int, int]],
               what: str, site: str) -> None:  # fmt: skip
        """Check, then record, one operation's accesses by ``actor`` at its next tick."""
        tick = clock.get(actor, 0) + 1
        new = [Access(kind, actor, tick, lo, hi, what, site) for kind, lo, hi in items if hi > lo]
        for a in new:
            self.checked += 1
            for shadow in self.overlapping(a.lo, a.hi):
                w = shadow.write
                if w is not None and clock.get(w.actor, 0) < w.tick:
                    raise _hazard(w, a, clock)
                if a.kind == "write":
                    for r in shadow.reads.values():
                        if r.actor != actor and clock.get(r.actor, 0) < r.tick:
                            raise _hazard(r, a, clock)
        clock[actor] = tick
        for a in new:
            shadow = self.shadow(a.lo, a.hi)
            if a.kind == "read":
                shadow.reads[a.actor] = a
            else:
                # Every older access inside this range is ordered before this
                # write (or we raised): the write alone now stands for them.
                for inner in list(self.overlapping(a.lo, a.hi)):
                    if inner is not shadow and a.lo <= inner.lo and inner.hi <= a.hi:
                        self.drop(inner)
                shadow.write, shadow.reads = a, {}


def _hazard(first: Access, second: Access, clock: Clock) -> HazardError:
    missing = f"nothing orders {actor_name(second.actor)} after that access"
    if first.actor in clock:
        missing = (
            f"{actor_name(second.actor)} is ordered after earlier work of "
            f"{actor_name(first.actor)} (an event recorded, or a synchronization made, "
            "before that access) but not after the access itself"
        )
    if second.what.startswith("to_host"):
        fix = (
            "to_host() copies on the legacy default stream, which does not wait for "
            "non-blocking streams: synchronize the writer first, or copy on it with "
            "`x.to_host(stream=s)`"
        )
    elif second.actor[0] == "host":
        fix = (
            "wait on the host before touching the data: `await cs.consume(arr)`, "
            "`cs.consume_blocking(arr)`, or synchronize an event recorded after that work"
        )
    elif first.kind == "read" and second.kind == "write":
        fix = (
            "the buffer is reused while a reader may still run: write inside "
            "`with t.writing(s)` on a tracked array (it waits for pending reads), or read "
            "inside `async with cs.consuming(arr, stream=r)` (it joins the reader back)"
        )
    else:
        fix = (
            "order the streams: `cs.export()` joins pending work onto one stream, "
            "`cs.consume(arr, stream=s)` orders s after the producer, "
            "`with t.writing(s)` / `t.reading(s)` order s after conflicting work, "
            "or record an event after the first access and make the second stream wait on it"
        )
    return HazardError(
        f"{second.describe()}\n  is not ordered after\n{first.describe()}:\n"
        f"  {missing}.\n  Fix: {fix}.",
        first=first,
        second=second,
    )


_state = _State()
_switch = threading.Lock()

#: True while the sanitizer is on (the hooks test it first; cheap when off)
active = False


_shown: dict[str, str | None] = {}  # code file -> how a site in it is shown (None: skip)


def _shown_as(path: str) -> str | None:
    found = _shown.get(path, "")
    if found == "":
        if os.path.abspath(path).startswith(_PACKAGE_DIR) or path.endswith("contextlib.py"):
            found = None
        elif path.startswith("<"):
            found = path
        else:
            try:
                found = os.path.relpath(path)
            except ValueError:  # another drive, on Windows
                found = path
        _shown[path] = found
    return found


def _site() -> str:
    """File and line of the first caller outside this package."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        shown = _shown_as(frame.f_code.co_filename)
        if shown is not None:
            return f"{shown}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


# -- hooks called by the rest of the library --------------------------------


def stream_access(backend: Backend, handle: int, reads: Iterable[tuple[int, int]],
                  writes: Iterable[tuple[int, int]], what: str) -> None:  # fmt: skip
    """Work about to be enqueued on ``handle`` reads and writes these byte ranges."""
    site = _site()
    items = [("read", lo, hi) for lo, hi in reads] + [("write", lo, hi) for lo, hi in writes]
    state = _state
    with state.lock:
        clock = state.enqueue(backend, handle)
        state.access(state.stream(backend, handle), clock, items, what, site)


def host_access(kind: str, ranges: Iterable[tuple[int, int]], what: str) -> None:
    """The calling host thread reads or writes these byte ranges now."""
    site = _site()
    state = _state
    with state.lock:
        actor = state.host()
        items = [(kind, lo, hi) for lo, hi in ranges]
        state.access(actor, state.clock(actor), items, what, site)


def acquired(lock_owner: object) -> None:
    """The calling thread took a library lock: it is ordered after whatever
    the threads that held it before had done (a mutex, as ThreadSanitizer
    models one). The library's own bookkeeping is real ordering between host
    threads: a write another thread saw complete and then forgot is behind
    this thread too."""
    state = _state
    with state.lock:
        found = state.locks.get(lock_owner)
        if found is not None:
            state.join(state.clock(state.host()), found)


def released(lock_owner: object) -> None:
    """The calling thread lets go of a library lock (see :func:`acquired`)."""
    _join_host_into(_state.locks, lock_owner)


def happens_before(token: Hashable) -> None:
    """Tell the sanitizer that this thread hands over to whoever calls
    :func:`happens_after` with ``token`` (a queue put, a lock release, an
    event set: orderings between host threads it cannot see).

    Everything this thread did before is then ordered before what the
    receiving thread does after. ``token`` is any hashable value; calls with
    the same one accumulate. Does not block; a no-op while the sanitizer is off.
    """
    if active:
        _state.tokens.setdefault(token, {})
        _join_host_into(_state.tokens, token)


def happens_after(token: Hashable) -> None:
    """The receiving side of :func:`happens_before`: this thread is ordered
    after every ``happens_before(token)`` made so far. Does not block."""
    if active:
        state = _state
        with state.lock:
            found = state.tokens.get(token)
            if found is not None:
                state.join(state.clock(state.host()), found)


def _join_host_into(table: Any, key: Any) -> None:
    state = _state
    with state.lock:
        clock = table.get(key)
        host = state.clock(state.host())
        if clock is None:
            table[key] = dict(host)
        else:
            state.join(clock, host)


def forget(lo: int, hi: int) -> None:
    """Device memory ``[lo, hi)`` was freed."""
    if active:
        _state.forget(lo, hi)


class _Watcher(Observer):
    """Turns the backend's ordering calls into vector-clock joins."""

    def enqueue(self, backend: Backend, stream: int) -> None:
        with _state.lock:
            _state.enqueue(backend, stream)

    def recorded(self, backend: Backend, event: int, stream: int) -> None:
        with _state.lock:
            # enqueue() already joined the host into the stream: capture its clock
            _state.events[(backend, event)] = dict(_state.clock(_state.stream(backend, stream)))

    def waited(self, backend: Backend, stream: int, event: int) -> None:
        with _state.lock:
            captured = _state.events.get((backend, event))
            if captured is not None:  # a never-recorded event orders nothing
                _state.join(_state.clock(_state.stream(backend, stream)), captured)

    def completed(self, backend: Backend, event: int) -> None:
        with _state.lock:
            captured = _state.events.get((backend, event))
            if captured is not None:
                _state.join(_state.clock(_state.host()), captured)

    def before_stream_sync(self, backend: Backend, stream: int) -> object:
        with _state.lock:
            return dict(_state.clock(_state.stream(backend, stream)))

    def stream_synced(self, backend: Backend, stream: int, token: object) -> None:
        assert isinstance(token, dict)
        with _state.lock:
            _state.join(_state.clock(_state.host()), token)

    def destroyed(self, backend: Backend, event: int) -> None:
        with _state.lock:
            _state.events.pop((backend, event), None)


_watcher = _Watcher()


def _switch_to(on: bool) -> None:
    global active, _state
    from ._backend import _sim

    if on and not active:
        _state = _State()
        _observe.add(_watcher)
        _sim.free_hooks.append(forget)
        active = True
    elif not on and active:
        active = False
        _observe.remove(_watcher)
        _sim.free_hooks.remove(forget)


@contextmanager
def sanitize(enabled: bool = True) -> Iterator[None]:
    """Check every declared access for missing ordering inside the block.

    ``with cs.sanitize():`` turns the sanitizer on (``CAI_STREAMS_SANITIZE=1``
    turns it on for the whole process); ``with cs.sanitize(False):`` turns it
    off for a block, such as a test that races on purpose. An unordered pair
    of accesses raises :class:`~cai_streams.HazardError` at the second one,
    before it is enqueued, on every run whatever the timing. Turning it on
    starts from a clean slate. Process-wide; blocks nest. Does not block and
    enqueues nothing.
    """
    with _switch:
        before = active
        _switch_to(enabled)
    try:
        yield
    finally:
        with _switch:
            _switch_to(before)


def sanitizing() -> bool:
    """Whether the sanitizer is on now. Does not block."""
    return active


def checks() -> int:
    """Accesses checked since the sanitizer was last turned on."""
    return _state.checked


def _from_environment() -> None:
    value = os.environ.get("CAI_STREAMS_SANITIZE", "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        with _switch:
            _switch_to(True)
    elif value not in ("", "0", "false", "no", "off"):
        raise ValueError(f"CAI_STREAMS_SANITIZE={value!r}: expected 0 or 1")


_from_environment()
