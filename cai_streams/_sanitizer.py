"""Happens-before hazard detection for stream-ordered memory access.

The model is ThreadSanitizer's (FastTrack): every actor (a stream, or a host
thread) has a vector clock.

* Stream order: each operation on a stream ticks that stream's own entry;
  work a host thread enqueues on a stream is ordered after what that thread
  did before (the stream's clock joins the thread's).
* An event captures the recording stream's clock when it is recorded (a
  re-record replaces it); a stream waiting on the event joins that clock, on
  any device. A host thread joins it when the user's program synchronizes the
  event, or a query of the user's says it is complete; a stream synchronize
  (or a stream query that finds it idle) joins the stream's clock.
* The legacy default stream (1) and the blocking per-thread default streams
  (2) wait for each other, as in CUDA; ``Stream()`` streams are non-blocking.
* Host threads are ordered by the handoffs ``_sanitizer_threads`` sees
  (thread start and join, queues, futures, ``to_thread``, events) and by
  ``happens_before(token)`` / ``happens_after(token)``.

Only the user's program orders the host. The library's own queries (the
poller, the event pool, ``stats()``, elisions) order only what the library
does on their strength: a completion it sees while working for one buffer
(its pending work's lock held, or one handoff) is credited to that buffer,
and carried by the work the library enqueues for it and by the host read of a
``consume`` that returned, never by the thread as a whole. So a host read
that nothing in the program orders is named on every run, however the
timing fell and whatever library call came in between.

Each access (a read or a write of a byte range, by a stream operation or by
the host) is checked against the last write and the reads since, of every
overlapping range (``_sanitizer_ranges``): an access is ordered after an
earlier one when the accessor's clock has reached the earlier access's tick.
An unordered pair where at least one is a write raises
:class:`~cai_streams.HazardError` at the second access, before it is
enqueued, whatever the timing.

Bounded state: an actor that can no longer act (a closed stream, an ended
host thread, a per-thread default stream of an ended thread) is retired when
actors have doubled since the last sweep; once no shadow names it any more
its entry leaves every clock. A read ordered after an earlier read of the
same bytes replaces it (a FastTrack read epoch), a write replaces every
access it covers, and at each sweep an access every host thread is ordered
after is forgotten (whatever comes next is made or enqueued by one of them, or
by a thread started and not seen yet, which counts from its start).
A host thread that Python did not start (``_DummyThread``) is never retired.

Granularity and what is not modelled: byte ranges as declared (a kernel that
declares a whole array is checked as touching all of it, strided or not);
accesses only where the program declares them (``sim.launch`` reads/writes,
``to_host``, ``writing``/``reading`` blocks, ``consume``, ``export``), so work
another library enqueues without declaring it is invisible. Memory freed to
the simulator's caching pool keeps the accesses the freeing thread did not know
complete, marked freed: a new owner of the block that is not ordered after
one of them is told the block was reused while that work could still run.
The library's hold of an owner, let go once its event is seen complete,
vouches for the accesses to the owner's memory before that event (``held``):
the memory is freed after the hold let go, whichever thread frees it.
Work declared on a capturing stream (or on a stream that joined its capture)
is checked each time the graph is replayed, as work of the stream it is
launched on, after that executable's earlier launches (cudaGraphLaunch's
rule); a graph launched into a capture is that capture's work (a child
graph); a launch of a graph that accesses memory freed since its capture
ended, or during it and not taken again by a later access of the capture (a
temporary that got the block), is refused. The order of the nodes inside one
graph is not checked.

Actors are stream identities (``_identity.StreamId``, with the stream's own
device): a stream closed and its handle reused is a new actor, and handle 2
is one actor per host thread.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import os
import sys
import threading
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, Final

from . import _backend, _observe, _sanitizer_locks, _sanitizer_threads
from ._backend import LEGACY_DEFAULT_STREAM, PER_THREAD_DEFAULT_STREAM, Backend
from ._errors import HazardError
from ._identity import StreamId, stream_id_now, thread_serial
from ._observe import Observer
from ._sanitizer_ranges import Access, ShadowMap
from ._sanitizer_report import _is_host, actor_name, hazard

__all__ = ["Access", "happens_after", "happens_before", "sanitize", "sanitizing"]

_PACKAGE_DIR: Final = os.path.dirname(os.path.abspath(__file__))
#: simulated stream workers are the device, not host threads
_WORKER_PREFIX: Final = "cai-streams-"
_FIRST_SWEEP: Final = 64

Clock = dict[Hashable, int]
Actor = tuple[Any, ...]
#: one operation's accesses declared in a capture: (kind, lo, hi) items, what, where
Captured = tuple[list[tuple[str, int, int]], str, str]


def join(into: Clock, other: Clock) -> None:
    for k, v in other.items():
        mine = into.get(k)
        if mine is None or mine < v:  # a 0 is kept: "ordered after its start"
            into[k] = v


def _seen_end(c: Clock, a: Access) -> bool:
    """Whether what ``c`` has seen is ordered after ``a`` (by its actor's tick,
    or by the host thread that vouched for it)."""
    if c.get(a.actor, 0) >= a.tick:
        return True
    return any(c.get(actor, 0) >= tick for actor, tick in a.vouched)


def _before_all(a: Access, clocks: list[Clock]) -> bool:
    return all(_seen_end(c, a) for c in clocks)


class _StateLock:
    """The state's re-entrant lock. A garbage collection can run a hook (a
    freed block, a destroyed event) in the middle of a change to the state, on
    the thread that holds this lock: such a hook is deferred until that thread
    lets go, instead of changing the state under the change in progress."""

    __slots__ = ("_lock", "deferred", "depth", "owner")

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.depth = 0
        self.owner = 0
        self.deferred: list[Callable[[], None]] = []

    def __enter__(self) -> None:
        self._lock.acquire()
        self.depth += 1
        self.owner = threading.get_ident()

    def __exit__(self, *exc_info: object) -> None:
        try:
            if self.depth == 1:
                while self.deferred:
                    self.deferred.pop(0)()
        finally:
            self.depth -= 1
            if self.depth == 0:
                self.owner = 0
            self._lock.release()

    def run_or_defer(self, fn: Callable[[], None]) -> None:
        if self.depth and self.owner == threading.get_ident():
            self.deferred.append(fn)
        else:
            with self:
                fn()


class _State:
    """Everything the sanitizer knows; one lock guards it all."""

    def __init__(self) -> None:
        self.lock = _StateLock()
        self.clocks: dict[Actor, Clock] = {}  # actors that may still act
        self.threads: dict[Actor, weakref.ref[threading.Thread]] = {}
        self.serials: dict[int, Actor] = {}  # thread serial -> its host actor
        self.retired: set[Actor] = set()  # can no longer act, still named by a shadow
        self.events: dict[tuple[Backend, int], Clock] = {}
        #: per host thread, what the library's own queries in it found complete
        #: (real, but not the program's ordering: it only lets go of freed memory)
        self.library: dict[Actor, Clock] = {}
        self.shadows = ShadowMap()
        self.blocking: set[Actor] = set()
        #: per (backend, device): the final clocks of retired blocking streams
        #: (another thread's per-thread stream, that thread gone): the legacy
        #: stream still waits for what they enqueued
        self.retired_blocking: dict[tuple[Backend, int], Clock] = {}
        #: what the library learnt while working for one object (a buffer's
        #: pending work, one handoff): credited to that object only
        self.scopes: weakref.WeakKeyDictionary[object, Clock] = weakref.WeakKeyDictionary()
        self.tokens: dict[Hashable, Clock] = {}
        self.weak_tokens: weakref.WeakKeyDictionary[object, Clock] = weakref.WeakKeyDictionary()
        self.started: weakref.WeakKeyDictionary[threading.Thread, Clock] = (
            weakref.WeakKeyDictionary()
        )
        self.ended: weakref.WeakKeyDictionary[threading.Thread, Clock] = weakref.WeakKeyDictionary()
        # graph capture: accesses declared on a capturing stream wait in their
        # capture (keyed by the stream that began it) and are checked when the
        # graph is replayed, as accesses of the stream it is launched on
        self.capture_of: dict[Actor, Actor] = {}  # capturing stream -> its capture
        self.captured: dict[Actor, list[Captured]] = {}
        self.capture_events: dict[tuple[Backend, int], Actor] = {}
        self.graphs: dict[tuple[Backend, int, bool], list[Captured]] = {}
        #: an executable's last launch: the launch stream's clock after it (each
        #: launch of an executable is ordered behind the earlier ones)
        self.launches: dict[tuple[Backend, int], Clock] = {}
        #: captures and graphs (keyed as above) with an access to memory freed
        #: since it was captured: (what, where, the freed range), the first one
        self.stale: dict[Any, tuple[str, str, int, int]] = {}
        #: the lowest and highest byte each graph, or capture under way, accesses
        self.spans: dict[Any, tuple[int, int]] = {}
        #: frees during a capture of memory it accessed: (lo, hi, operations before it)
        self.freed_in: dict[Actor, list[tuple[int, int, int]]] = {}
        self.local = threading.local()
        self.checked = 0
        self.sweeps = 0
        self.sweep_at = _FIRST_SWEEP

    # -- actors and clocks -------------------------------------------------

    def host(self) -> Actor:
        serial = thread_serial()
        actor = self.serials.get(serial)
        if actor is None:
            thread = threading.current_thread()
            actor = ("host", serial, thread.name)
            self.serials[serial] = actor
            self.threads[actor] = weakref.ref(thread)
            clock = self.clocks[actor] = {actor: 0}
            start = self.started.pop(thread, None)
            if start is not None:  # ordered after what the starting thread had done
                join(clock, start)
            self._grew()
        return actor

    def host_clock(self) -> Clock:
        return self.clocks[self.host()]

    @staticmethod
    def stream(backend: Backend, handle: int) -> Actor:
        """The stream ``handle`` is for work the calling thread enqueues now."""
        return ("stream", stream_id_now(backend, handle))  # keyed with its own device

    def clock(self, actor: Actor) -> Clock:
        c = self.clocks.get(actor)
        if c is None:
            c = self.clocks[actor] = {actor: 0}
            self.retired.discard(actor)
            self._grew()
        return c

    def scope_stack(self) -> list[object]:
        stack: list[object] | None = getattr(self.local, "scopes", None)
        if stack is None:
            stack = self.local.scopes = []
        return stack

    def scope_clock(self, obj: object) -> Clock:
        c = self.scopes.get(obj)
        if c is None:
            c = self.scopes[obj] = {}
        return c

    def enqueue(self, backend: Backend, handle: int) -> tuple[Actor, Clock]:
        """The calling host thread enqueues on ``handle``: the stream's clock,
        joined with the thread's, with what the library knows for the buffer
        it works for, and by the legacy/blocking-stream rule."""
        actor = self.stream(backend, handle)
        key: StreamId = actor[1]
        c = self.clock(actor)
        join(c, self.host_clock())
        for obj in self.scope_stack():
            join(c, self.scope_clock(obj))
        if handle == LEGACY_DEFAULT_STREAM:
            for b in self.blocking:
                other: StreamId = b[1]
                if other.backend is backend and other.device == key.device:
                    join(c, self.clock(b))
            retired = self.retired_blocking.get((backend, key.device))
            if retired is not None:
                join(c, retired)
        elif handle == PER_THREAD_DEFAULT_STREAM:
            self.blocking.add(actor)
            join(c, self.clock(self.stream(backend, LEGACY_DEFAULT_STREAM)))
        return actor, c

    def completed(self, captured: Clock, user: bool) -> None:
        """The calling thread saw work complete, up to ``captured``."""
        if user:
            join(self.host_clock(), captured)
        else:
            for obj in self.scope_stack():
                join(self.scope_clock(obj), captured)
            join(self.library.setdefault(self.host(), {}), captured)

    # -- retiring what can no longer act -----------------------------------

    def _grew(self) -> None:
        if len(self.clocks) >= self.sweep_at:
            self.sweep()
            self.sweep_at = max(_FIRST_SWEEP, 2 * len(self.clocks))

    def _dead(self, actor: Actor) -> bool:
        if actor[0] == "host":
            thread = self.threads[actor]()
            return thread is None or not thread.is_alive()
        key: StreamId = actor[1]
        if key.handle == LEGACY_DEFAULT_STREAM:
            return False
        if key.handle == PER_THREAD_DEFAULT_STREAM:
            owner = self.serials.get(key.thread)
            return owner is None or self._dead(owner)
        try:
            return stream_id_now(key.backend, key.handle) != key
        except Exception:  # noqa: BLE001 - a backend that cannot say: keep it
            return False

    def sweep(self) -> None:
        """Retire actors that can no longer act; forget those no shadow names."""
        self.sweeps += 1
        dead = [a for a in self.clocks if self._dead(a)]
        for actor in dead:
            final = self.clocks.pop(actor)
            self.library.pop(actor, None)
            if actor in self.blocking:
                self.blocking.discard(actor)
                gone_stream: StreamId = actor[1]
                join(
                    self.retired_blocking.setdefault((gone_stream.backend, gone_stream.device), {}),
                    final,
                )
            if actor[0] == "host":
                self.serials.pop(actor[1], None)
                thread = self.threads.pop(actor)()
                if thread is not None:  # for a join() still to come
                    self.ended[thread] = final
        self.retired.update(dead)
        # an access every host thread is ordered after can race with nothing
        # any more: whatever comes next is enqueued (or made) by one of them,
        # or by a thread started but not seen yet, which starts from what its
        # starter had done then (an access after that start stays)
        hosts = [c for a, c in self.clocks.items() if a[0] == "host"]
        hosts += [c for t, c in list(self.started.items()) if t.ident is None or t.is_alive()]
        if hosts:
            self.shadows.keep(0, 1 << 64, lambda a: None if _before_all(a, hosts) else a)
        named = {a.actor for segment in self.shadows for a in segment.accesses()}
        named |= {
            actor for segment in self.shadows for a in segment.accesses() for actor, _ in a.vouched
        }
        gone = self.retired - named
        if not gone:
            return
        self.retired -= gone
        for table in (self.clocks, self.events, self.tokens, self.library, self.retired_blocking):
            for c in table.values():
                for actor in gone:
                    c.pop(actor, None)
        for weak in (self.scopes, self.weak_tokens, self.started, self.ended):
            for c in list(weak.values()):
                for actor in gone:
                    c.pop(actor, None)

    # -- shadow memory -----------------------------------------------------

    def freed(self, lo: int, hi: int) -> None:
        """Memory went back to the caching pool. What the freeing thread knows
        complete (its own synchronization, or a library query, as when the
        library held the owner until its work was done) and what a released
        hold vouched for (:meth:`hold_released`, in any thread) is forgotten;
        anything else may still run, and a new owner not ordered after it is
        told that the block was reused too early. A host thread's write is over
        when its call returns, and a read through views ``consume`` returned
        once they are all gone, before the owner was let go: whichever thread
        frees the block (a garbage collection may run in any), it is forgotten."""
        known: Clock = {}
        actor = None
        thread = _sanitizer_threads.registered()  # (None: a hook run in a starting thread)
        if thread is not None and not thread.name.startswith(_WORKER_PREFIX):
            actor = self.serials.get(thread_serial())
        if actor is not None:  # (read only: this may run inside a change of the state)
            known = dict(self.clocks.get(actor, {}))
            join(known, self.library.get(actor, {}))

        def keep(a: Access) -> Access | None:
            if _lasts(a):
                pass  # a read through a live view lasts: no ordering or hold ends it
            elif a.held or _seen_end(known, a) or (_is_host(a) and _over(a)):
                return None
            return a if a.freed else dataclasses.replace(a, freed=True)

        def change() -> None:
            self.shadows.keep(lo, hi, keep)
            self._graphs_lose(lo, hi)

        self.lock.run_or_defer(change)

    def widen(self, origin: Actor, items: list[tuple[str, int, int]]) -> None:
        """Lock held: the span of the capture ``origin`` takes in ``items``."""
        ends = [(a, b) for _, a, b in items if b > a]
        if ends:
            lo, hi = self.spans.get(origin, (ends[0][0], ends[0][1]))
            self.spans[origin] = (min(lo, *(a for a, _ in ends)), max(hi, *(b for _, b in ends)))

    def _graphs_lose(self, lo: int, hi: int) -> None:
        """Lock held: memory ``[lo, hi)`` was freed. A graph that accesses it
        keeps the raw pointer: any later launch of it uses memory that is gone,
        or another owner's.
        Each graph's span is found once, so a free looks into the graphs
        around it only. A capture under way notes the free with how many of
        its operations came before it (see :meth:`_stale_at_end`)."""
        for origin, operations in self.captured.items():
            span = self.spans.get(origin)
            if span is None or not (span[1] > lo and span[0] < hi):
                continue  # (nothing of the capture is near it)
            if any(b > lo and a < hi for items, _, _ in operations for _, a, b in items):
                self.freed_in.setdefault(origin, []).append((lo, hi, len(operations)))
        for key, operations in self.graphs.items():
            if key in self.stale:
                continue
            span = self.spans.get(key)
            if span is None:
                ends = [(a, b) for items, _, _ in operations for _, a, b in items if b > a]
                span = self.spans[key] = (
                    (min(a for a, _ in ends), max(b for _, b in ends)) if ends else (0, 0)
                )
            if not (span[1] > lo and span[0] < hi):
                continue
            for items, what, site in operations:
                if any(b > lo and a < hi for _, a, b in items):
                    self.stale[key] = (what, site, lo, hi)
                    break

    def hold_released(self, backend: Backend, event: int, ranges: list[tuple[int, int]]) -> None:
        """The library lets go of a hold's owner, having seen ``event`` complete.
        The owner kept its memory (``ranges``) alive until now, so that memory
        is freed after this, in whatever thread its last reference goes (the
        reference count orders the two): the accesses to it that the event's
        record was ordered after are done by then. Only frees count on it; the
        program's own accesses are checked as before."""
        captured = self.events.get((backend, event))  # (read only: may run inside a change)
        if captured is None:  # recorded while the sanitizer was off
            return
        done = dict(captured)

        def vouch(a: Access) -> Access:
            if a.held or a.freed or not _seen_end(done, a):
                return a
            return dataclasses.replace(a, held=True)

        def mark() -> None:
            for lo, hi in ranges:
                self.shadows.keep(lo, hi, vouch)

        self.lock.run_or_defer(mark)

    def access(self, actor: Actor, clock: Clock, items: Iterable[tuple[str, int, int]],
               what: str, site: str, *, also: Clock | None = None,
               record: bool = True,
               until: tuple[weakref.ref[Any], ...] | None = None) -> None:  # fmt: skip
        """Check, then record, one operation's accesses by ``actor`` at its next
        tick (``also``: more the check may count as ordered before, this once;
        ``record`` False: only check, as for data said to be ready now;
        ``until``: a host read that lasts while that view lives)."""
        tick = clock.get(actor, 0) + 1
        new = [
            Access(kind, actor, tick, lo, hi, what, site, until=until)
            for kind, lo, hi in items
            if hi > lo
        ]
        seen = clock
        if also is not None:
            seen = dict(clock)
            join(seen, also)
        for a in new:
            self.checked += 1
            for segment in self.shadows.overlapping(a.lo, a.hi):
                w = segment.write
                if w is not None and w.actor != actor and not _seen_end(seen, w):
                    raise self._hazard(w, a, seen)
                if a.kind == "write":
                    for r in segment.reads.values():
                        if r.actor != actor and not _seen_end(seen, r):
                            raise self._hazard(r, a, seen)
        if not record:
            return
        clock[actor] = tick
        seen[actor] = tick
        for a in new:
            if a.kind == "write":
                # every access it covers is ordered before it (or we raised);
                # a host read through a live view outlasts it (see freed)
                if not any(
                    _lasts(r)
                    for g in self.shadows.overlapping(a.lo, a.hi)
                    for r in g.reads.values()
                ):
                    self.shadows.assign(a.lo, a.hi, a)
                    continue
                for segment in self.shadows.cover(a.lo, a.hi):
                    segment.write = a
                    segment.reads = {k: r for k, r in segment.reads.items() if _lasts(r)}
                continue
            for segment in self.shadows.cover(a.lo, a.hi):
                reads = segment.reads
                until = a.until
                for r in [r for r in reads.values() if _seen_end(seen, r)]:
                    if a.until is None and _is_host(r) and not _over(r):
                        continue  # (a read not known to end cannot carry a host read's views)
                    del reads[r.actor]  # this read stands for it from now on
                    if _is_host(r):  # (a stream's read it is ordered after is done)
                        until = _views_of_both(until, r.until)
                reads[actor] = a if until is a.until else dataclasses.replace(a, until=until)

    def _hazard(self, first: Access, second: Access, clock: Clock) -> HazardError:
        ordered_host = None
        for other, c in self.clocks.items():
            if other[0] == "host" and other != second.actor and other != first.actor:
                if _seen_end(c, first):
                    ordered_host = actor_name(other)
                    break
        return hazard(first, second, clock, ordered_host)


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


def _device_thread() -> bool:
    return threading.current_thread().name.startswith(_WORKER_PREFIX)


def _tokens(token: object) -> Any:
    try:
        weakref.ref(token)
    except TypeError:
        return _state.tokens
    return _state.weak_tokens


def happens_before(token: Hashable) -> None:
    """Tell the sanitizer that this thread hands over to whoever calls
    :func:`happens_after` with ``token`` (an ordering between host threads
    that it cannot see: a lock, a socket, a shared flag).

    Everything this thread did before is then ordered before what the
    receiving thread does after. ``token`` is any hashable value; calls with
    the same one accumulate. Does not block; a no-op while the sanitizer is off.
    Queues, futures, thread start and join, ``threading.Event``, locks made
    with ``threading.Lock`` / ``RLock`` while it is on, and the
    ``to_thread`` of asyncio and anyio are seen without it.
    """
    if active:
        _before(token)


def happens_after(token: Hashable) -> None:
    """The receiving side of :func:`happens_before`: this thread is ordered
    after every ``happens_before(token)`` made so far. Does not block; a no-op
    while the sanitizer is off."""
    if active:
        _after(token)


def _before(token: object) -> None:
    if _device_thread():
        return
    state = _state
    with state.lock:
        table = _tokens(token)
        c = table.get(token)
        if c is None:
            table[token] = dict(state.host_clock())
        else:
            join(c, state.host_clock())


def _after(token: object) -> None:
    if _device_thread():
        return
    state = _state
    with state.lock:
        found = _tokens(token).get(token)
        if found is not None:
            join(state.host_clock(), found)


class _Handoffs:
    """What ``_sanitizer_threads`` reports: orderings between host threads."""

    before = staticmethod(_before)
    after = staticmethod(_after)

    @staticmethod
    def started(thread: threading.Thread) -> None:
        if thread.name.startswith(_WORKER_PREFIX) or _device_thread():
            return
        with _state.lock:
            _state.started[thread] = dict(_state.host_clock())

    @staticmethod
    def joined(thread: threading.Thread) -> None:
        if _device_thread():
            return
        state = _state
        with state.lock:
            final = state.ended.get(thread)
            if final is None:
                for actor, ref in state.threads.items():
                    if ref() is thread:
                        final = state.clocks[actor]
                        break
            if final is not None:
                join(state.host_clock(), final)


class _Watcher(Observer):
    """Checks the declared accesses; turns the backend's ordering calls into
    vector-clock joins."""

    def stream_access(
        self,
        backend: Backend,
        stream: int,
        reads: list[tuple[int, int]],
        writes: list[tuple[int, int]],
        what: str,
    ) -> None:
        site = _site()
        items = [("read", lo, hi) for lo, hi in reads] + [("write", lo, hi) for lo, hi in writes]
        state = _state
        with state.lock:
            origin = state.capture_of.get(state.stream(backend, stream))
            if origin is not None:  # recorded, not run: checked when replayed
                state.captured[origin].append((items, what, site))
                state.widen(origin, items)
                return
            actor, clock = state.enqueue(backend, stream)
            state.access(actor, clock, items, what, site)

    def host_access(
        self,
        kind: str,
        ranges: list[tuple[int, int]],
        what: str,
        waited: list[object],
        events: list[tuple[Backend, int]],
        view: object = None,
    ) -> None:
        """A call of the user's that returned (a ``consume``) orders the thread
        after what it waited for from now on; inside the library's work for a
        buffer, what the library knows for it orders this access only."""
        site = _site()
        state = _state
        with state.lock:
            actor = state.host()
            clock = state.clocks[actor]
            scopes = [state.scope_clock(obj) for obj in waited]
            done: Clock = {}  # what the library found done for the buffer
            for key in events:
                captured = state.events.get(key)
                if captured is not None:
                    for c in scopes:  # the library may forget them now: it knows them done
                        join(c, captured)
                    join(done, captured)
            for c in scopes:
                join(done, c)
            if kind == "ready":
                # The data alone is ready: the writes to it that were found done
                # are vouched for by this thread, now (what is ordered after it
                # may read them; another thread is still checked against them).
                # The thread is not ordered after the rest of their streams'
                # work (no call of the user's waited for it): other buffers'
                # writes there are still named, on every run.
                tick = clock[actor] = clock.get(actor, 0) + 1
                vouch = functools.partial(_vouched, done, actor, tick)
                for lo, hi in ranges:
                    state.shadows.keep(lo, hi, vouch)
            else:
                join(clock, done)
            also: Clock | None = None
            stack = state.scope_stack()
            if stack:
                also = {}
                for obj in stack:
                    join(also, state.scope_clock(obj))
            if kind in ("ready", "fill"):  # checked now, not kept: nobody reads yet, or
                checked = "read" if kind == "ready" else "write"  # nothing was written
                items = [(checked, lo, hi) for lo, hi in ranges]
                state.access(actor, clock, items, what, site, also=also, record=False)
                return
            items = [(kind, lo, hi) for lo, hi in ranges]
            until = None if view is None else (weakref.ref(view),)
            state.access(actor, clock, items, what, site, also=also, until=until)

    def scope_entered(self, scope: object) -> None:
        """What the library learns until the scope is left is credited to it,
        and what it knew before orders what it enqueues for it."""
        with _state.lock:
            _state.scope_stack().append(scope)

    def scope_left(self, scope: object) -> None:
        with _state.lock:
            stack = _state.scope_stack()
            if stack and stack[-1] is scope:
                stack.pop()
            elif scope in stack:
                stack.remove(scope)

    def stream_ordered(self, backend: Backend, stream: int) -> None:
        state = _state
        with state.lock:
            c = state.clock(state.stream(backend, stream))
            for obj in state.scope_stack():
                join(c, state.scope_clock(obj))

    def enqueue(self, backend: Backend, stream: int) -> None:
        with _state.lock:
            _state.enqueue(backend, stream)

    def recorded(self, backend: Backend, event: int, stream: int) -> None:
        key = (backend, event)
        with _state.lock:
            actor = _state.stream(backend, stream)
            origin = _state.capture_of.get(actor)
            if origin is not None:  # a node of the graph: a wait on it joins the capture
                _state.capture_events[key] = origin  # (its last real record stays, as
                return  # on the device: the node runs only when the graph does)
            # a real record after one in a capture: a wait means this one, as on the
            # device, and no longer draws its stream into the capture
            _state.capture_events.pop(key, None)
            # enqueue() already joined the host into the stream: capture its clock
            _state.events[key] = dict(_state.clock(actor))

    def waited(self, backend: Backend, stream: int, event: int) -> None:
        with _state.lock:
            origin = _state.capture_events.get((backend, event))
            if origin is not None and origin in _state.captured:
                _state.capture_of[_state.stream(backend, stream)] = origin
                return
            captured = _state.events.get((backend, event))
            if captured is not None:  # a never-recorded event orders nothing
                join(_state.clock(_state.stream(backend, stream)), captured)

    def completed(self, backend: Backend, event: int, user: bool) -> None:
        with _state.lock:
            captured = _state.events.get((backend, event))
            if captured is not None:
                _state.completed(captured, user)

    def before_stream_sync(self, backend: Backend, stream: int) -> object:
        with _state.lock:
            return dict(_state.clock(_state.stream(backend, stream)))

    def stream_synced(self, backend: Backend, stream: int, token: object, user: bool) -> None:
        assert isinstance(token, dict)
        with _state.lock:
            _state.completed(token, user)

    def destroyed(self, backend: Backend, event: int) -> None:
        events = _state.events  # (may run from a collection, inside a change of the state)
        captured = _state.capture_events

        def forget() -> None:
            events.pop((backend, event), None)
            captured.pop((backend, event), None)

        _state.lock.run_or_defer(forget)

    def freed(self, lo: int, hi: int) -> None:
        _state.freed(lo, hi)

    def hold_released(self, backend: Backend, event: int, ranges: list[tuple[int, int]]) -> None:
        _state.hold_released(backend, event, ranges)

    def capture_began(self, backend: Backend, stream: int) -> None:
        with _state.lock:
            origin = _state.stream(backend, stream)
            _state.capture_of[origin] = origin
            _state.captured[origin] = []

    def capture_ended(self, backend: Backend, stream: int, graph: int) -> None:
        state = _state
        with state.lock:
            origin = state.stream(backend, stream)
            operations = state.graphs[(backend, graph, False)] = state.captured.pop(origin, [])
            state.spans.pop(origin, None)  # (the graph's is found again, keyed by it)
            stale = _stale_at_end(operations, state.freed_in.pop(origin, []))
            if stale is not None:
                state.stale[(backend, graph, False)] = stale
            self._end_capture_of(origin)

    def capture_abandoned(self, backend: Backend, stream: int) -> None:
        state = _state
        with state.lock:
            origin = state.stream(backend, stream)
            state.captured.pop(origin, None)  # (never runs: nothing to check it against)
            state.freed_in.pop(origin, None)
            state.spans.pop(origin, None)
            self._end_capture_of(origin)

    @staticmethod
    def _end_capture_of(origin: Any) -> None:
        """Lock held: no stream is in ``origin``'s capture any more (what is
        enqueued on them from now on runs, and is checked as it comes)."""
        for table in (_state.capture_of, _state.capture_events):
            for key in [k for k, v in table.items() if v == origin]:
                del table[key]

    def instantiated(self, backend: Backend, graph: int, graph_exec: int) -> None:
        with _state.lock:
            found = _state.graphs.get((backend, graph, False), [])
            _state.graphs[(backend, graph_exec, True)] = list(found)
            stale = _state.stale.get((backend, graph, False))
            if stale is not None:
                _state.stale[(backend, graph_exec, True)] = stale

    def graph_launch(self, backend: Backend, graph_exec: int, stream: int) -> None:
        """Each replayed access is checked as work of ``stream`` now, after the
        executable's earlier launches (as cudaGraphLaunch orders it); into a
        capturing stream, the launch is a node of that capture (a child graph),
        checked when that graph is replayed."""
        state = _state
        with state.lock:
            operations = state.graphs.get((backend, graph_exec, True), [])
            stale = state.stale.get((backend, graph_exec, True))
            if stale is not None:
                raise _freed_under_graph(*stale)
            origin = state.capture_of.get(state.stream(backend, stream))
            if origin is not None:  # recorded into that capture, not run
                state.captured[origin].extend(operations)
                for items, _, _ in operations:
                    state.widen(origin, items)
                return
            actor, clock = state.enqueue(backend, stream)
            earlier = state.launches.get((backend, graph_exec))
            if earlier is not None:
                join(clock, earlier)
            for items, what, site in operations:
                actor, clock = state.enqueue(backend, stream)
                state.access(actor, clock, items, f"graph replay of {what}", site)
            state.launches[(backend, graph_exec)] = dict(clock)

    def graph_destroyed(self, backend: Backend, graph: int, executable: bool) -> None:
        with _state.lock:
            _state.graphs.pop((backend, graph, executable), None)
            _state.stale.pop((backend, graph, executable), None)
            _state.spans.pop((backend, graph, executable), None)
            if executable:
                _state.launches.pop((backend, graph), None)


def _vouched(done: Clock, actor: Actor, tick: int, a: Access) -> Access:
    """``a``, and if it is a write that ``done`` covers, with ``actor`` at
    ``tick`` as one more witness of its end (an export that found it done;
    one of ``actor``'s at an earlier tick already says more)."""
    if a.kind != "write" or done.get(a.actor, 0) < a.tick:
        return a
    if any(other == actor for other, _ in a.vouched):
        return a
    return dataclasses.replace(a, vouched=(*a.vouched, (actor, tick)))


def _lasts(a: Access) -> bool:
    """Whether ``a`` is a host read through views of which one still lives:
    no ordering, hold or later write ends it, only a free once they are gone."""
    return a.until is not None and _is_host(a) and not _over(a)


def _over(a: Access) -> bool:
    """Whether host access ``a`` is over: a write (done when its call
    returned), or a read through views that are all gone."""
    views = a.until
    return a.kind == "write" or (views is not None and all(v() is None for v in views))


def _views_of_both(
    x: tuple[weakref.ref[Any], ...] | None, y: tuple[weakref.ref[Any], ...] | None
) -> tuple[weakref.ref[Any], ...] | None:
    """The views a read standing for two reads lasts through: None (not known
    to end) if either's is."""
    if x is None or y is None:
        return None
    # once each, by identity (one view read again and again is one weakref; views
    # compare by value, and a dead weakref cannot be hashed)
    return tuple({id(v): v for v in (*x, *y) if v() is not None}.values())


def _stale_at_end(
    operations: list[Captured], frees: list[tuple[int, int, int]]
) -> tuple[str, str, int, int] | None:
    """At a capture's end: the first operation (what, where, range) that uses
    memory freed later in the capture and not scratch memory of it, or None.
    A block is scratch when the capture's accesses on each side of its free
    read only bytes of it they wrote first (in order, from that side's start),
    and those after the free reach it: a temporary took the block, and the
    graph's user keeps its owner. A read of a byte not written there is of data
    from outside the graph (the freed array's, or a new owner's), which the
    capture's other accesses overwrite at each launch."""
    for lo, hi, before in frees:
        if _taken_again(lo, hi, operations[before:]) and _writes_first(lo, hi, operations[:before]):
            continue
        for items, what, site in operations[:before]:
            if any(b > lo and a < hi for _, a, b in items):
                return (what, site, lo, hi)
    return None


def _taken_again(lo: int, hi: int, later: list[Captured]) -> bool:
    """Whether the accesses ``later`` reach ``[lo, hi)`` and, in order, read
    only bytes of it that they wrote first."""
    return _writes_first(lo, hi, later) and any(
        b > lo and a < hi for items, _, _ in later for _, a, b in items
    )


def _writes_first(lo: int, hi: int, operations: list[Captured]) -> bool:
    """Whether ``operations``, in order, read only bytes of ``[lo, hi)`` that
    they wrote first. (Spans kept disjoint and sorted, found by bisection: a
    strided view is many runs.)"""
    starts: list[int] = []
    ends: list[int] = []
    for items, _, _ in operations:
        for kind, a, b in items:
            a, b = max(a, lo), min(b, hi)
            if a >= b:
                continue
            i = bisect.bisect_right(starts, a)  # spans starting at or before a: [0, i)
            if kind == "write":
                j = bisect.bisect_right(starts, b)  # spans starting at or before b: [0, j)
                if i and ends[i - 1] >= a:  # the span before overlaps or touches
                    i -= 1
                    a = starts[i]
                if j > i:
                    b = max(b, ends[j - 1])
                starts[i:j] = [a]
                ends[i:j] = [b]
            elif not (i and ends[i - 1] >= b):
                return False
    return True


def _freed_under_graph(what: str, site: str, lo: int, hi: int) -> HazardError:
    return HazardError(
        f"a launch of a graph whose {what} (captured at {site}) accesses {hi - lo} bytes at "
        f"{lo:#x}, memory freed since the capture: a graph keeps raw pointers, so its "
        "replay would use memory that is gone, or that the caching allocator handed to a "
        "new owner.\n  Fix: keep every array a graph uses alive as long as the graph "
        "(close the graph first, or `cs.hold(owner, until=stream)` after its last launch)."
    )


_watcher = _Watcher()


def _switch_to(on: bool) -> None:
    global active, _state
    if on and not active:
        _state = _State()
        _observe.add(_watcher)
        try:
            _sanitizer_threads.install(_Handoffs())
            _sanitizer_locks.install(_Handoffs())
        except BaseException:  # all or nothing: never half on
            _sanitizer_locks.uninstall()
            _sanitizer_threads.uninstall()
            _observe.remove(_watcher)
            raise
        active = True
    elif not on and active:
        active = False
        _sanitizer_locks.uninstall()
        _sanitizer_threads.uninstall()
        _observe.remove(_watcher)


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
    _from_environment()
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
    _from_environment()
    return active


def checks() -> int:
    """Accesses checked since the sanitizer was last turned on."""
    return _state.checked


_env_read = False


def _from_environment() -> None:
    """``CAI_STREAMS_SANITIZE``, read once: when the first backend is made, or
    by :func:`sanitize` / :func:`sanitizing`, never at import."""
    global _env_read
    if _env_read:
        return
    from ._config import sanitize_requested

    on = sanitize_requested()  # raises, naming the variable, on a malformed value
    _env_read = True
    if on:
        with _switch:
            _switch_to(True)


_backend.first_use.append(_from_environment)
