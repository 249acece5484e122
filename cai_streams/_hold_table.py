"""Holds in flight: owners kept alive until an event recorded on a stream completes.

Every hold (``cs.hold``, a view handed to a stream) is one pooled event and
the object it keeps. The table keeps them per stream identity in record
order: events recorded on one stream complete in that order, so releasing
looks at each stream's oldest hold and stops at the first one not done.

Nothing here waits. Completed holds are let go by :func:`tick`, which the
shared poller calls on every pass and the library calls on entry (bounded
work: a few queries), by :meth:`HoldTable.release_completed` when a limit is
passed, and by :meth:`HoldTable.sweep` when ``cs.stats()`` asks. Queries run
in the ``relaxed`` capture mode, so releasing never invalidates a graph capture
in another thread. Owners are dropped outside the table's lock: their
finalizers may call the library.

Views whose release must record a hold (see ``_hold``) are queued here by a
weakref callback, which may run in any thread inside any lock, so it only
appends; :func:`tick` settles them, each at the second tick after its release:
by then a newer view of the same owner on the same stream has usually been
made (the next handoff of a loop), and the released one is merged into it
instead of recording an event of its own. :meth:`HoldTable.sweep` settles
every one at once.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections import deque
from collections.abc import Callable
from typing import Protocol

from . import _observe
from ._backend import Backend, CaptureMode
from ._capture_guard import TAKEN_BY_A_CAPTURE
from ._config import settings
from ._deferred import in_collection, later, pending
from ._deferred import run as run_deferred
from ._errors import CudaError, DeviceFaultError, HoldWarning
from ._events import EventPool, Mark
from ._identity import StreamId, order_known
from ._poller import pass_hooks

__all__ = ["Hold", "HoldTable", "Ranges", "Settles", "table", "tick"]

#: queries that find a hold not done, per call of :func:`tick` (the per-call
#: bound; the queries that find holds done release them, about log2 of their number)
TICK_QUERIES = 2
#: released views one call of :func:`tick` settles
TICK_SETTLES = 4


#: byte ranges of device memory: ``((lo, hi), ...)``
Ranges = tuple[tuple[int, int], ...]


class Hold:
    """One owner kept until ``event`` (recorded at ``mark``) completes;
    ``ranges``: the memory it keeps, when the sanitizer observes (else empty)."""

    __slots__ = ("event", "failed", "mark", "nbytes", "owner", "pool", "ranges", "since", "taken")

    def __init__(
        self, pool: EventPool, event: int, mark: Mark, owner: object, nbytes: int, ranges: Ranges
    ) -> None:
        self.pool = pool
        self.event = event
        self.mark = mark
        self.owner = owner
        self.nbytes = nbytes
        self.ranges = ranges
        self.since = time.monotonic()
        self.failed = False  # its query raised: the event is never reused
        #: its query says a capture took the record (begun and ended between the
        #: checks around it): it says nothing of the stream, and is made again
        self.taken = False


class Settles(Protocol):
    """A released view whose hold is still to be recorded (``_hold.ViewLease``)."""

    def settle(self) -> bool:
        """Record its hold if it can now; False to be asked again later."""


def _in_record_order(queue: deque[Hold], hold: Hold) -> None:
    """Put ``hold`` in its stream's ``queue`` in record order: after the last
    one, unless another thread recorded after it and added its hold first (a
    hold found complete releases every one before it unasked)."""
    seq = hold.mark.seq
    if not queue or queue[-1].mark.seq <= seq:
        queue.append(hold)
        return
    i = len(queue)
    while i and queue[i - 1].mark.seq > seq:
        i -= 1
    queue.insert(i, hold)


class HoldTable:
    """Every hold in flight, per stream in record order (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # bookkeeping and a bounded number of queries
        self._streams: dict[StreamId, deque[Hold]] = {}
        self._turn: deque[StreamId] = deque()  # which stream's oldest hold to query next
        self.count = 0
        self.nbytes = 0
        self.made = 0
        self.released = 0
        self.released_views: deque[Settles] = deque()
        #: how many of the oldest released views were queued before the last tick
        self.aged = 0
        #: released views whose hold a newer one of the same owner and stream covers
        self.merged = 0
        #: the limit setting last warned about: (count, bytes, settings.limits_set)
        self._warned_at: tuple[int, int, int] | None = None
        #: what makes a hold whose record a capture took wait again (``_hold``)
        self.taken_again: Callable[[Hold], None] | None = None

    @property
    def busy(self) -> bool:
        return bool(self.count or self.released_views)

    def add(self, hold: Hold, *, stacklevel: int) -> None:
        """Keep ``hold`` until its event completes; past a limit, release the
        completed holds first, then warn once. Never blocks."""
        key = hold.mark.key
        with self._lock:
            queue = self._streams.get(key)
            if queue is None:
                queue = self._streams[key] = deque()
                self._turn.append(key)
            _in_record_order(queue, hold)
            self.count += 1
            self.nbytes += hold.nbytes
            self.made += 1
        if self._over_limit():
            # Completed holds only: no settles and no finalizers' work here,
            # where the caller may hold a lease's lock (a stream end that work
            # runs would take its listeners' locks: a deadlock across threads);
            # and their owners go at the next library call, not under that lock
            # (an owner's finalizer may call in and run such work).
            released: list[Hold] = []
            self.release_completed(None, keep=released)
            if released:
                later(released.clear)
            if self._over_limit():
                self._warn(stacklevel + 1)

    def _over_limit(self) -> bool:
        count, nbytes = settings.hold_limit_count, settings.hold_limit_bytes
        return bool((count and self.count > count) or (nbytes and self.nbytes > nbytes))

    def _warn(self, stacklevel: int) -> None:
        setting = settings.hold_limits()
        limits = setting[:2]
        with self._lock:
            if self._warned_at == setting:
                return
            self._warned_at = setting
            oldest = sorted(
                ((q[0].since, key, len(q)) for key, q in self._streams.items() if q),
                key=lambda item: item[0],
            )[:3]
            count, nbytes = self.count, self.nbytes
        now = time.monotonic()
        where = "; ".join(
            f"{key.describe()} on device {key.device}: {n} holds, the oldest {now - since:.3g} s"
            for since, key, n in oldest
        )
        warnings.warn(
            f"{count} stream-ordered holds in flight keep {nbytes} bytes alive "
            f"(limits: {limits[0] or 'none'} holds, {limits[1] or 'none'} bytes); "
            f"the oldest wait on {where}. Each is released once its stream passes the "
            "point where it was recorded: check that those streams make progress, or "
            "raise the limit (cs.configure(hold_limit_count=..., hold_limit_bytes=...)). "
            "This warning is given once per limit setting.",
            HoldWarning,
            stacklevel=stacklevel,
        )

    def release_completed(self, queries: int | None, *, keep: list[Hold] | None = None) -> int:
        """Let go of completed holds, visiting each stream at most once and
        stopping after ``queries`` queries found a hold not done (None: every
        stream). Returns how many were released. Never blocks; a failed event
        does not raise (its work will never run: its owner is let go). ``keep``:
        the released holds go there, their owners with them, for the caller to
        drop later. A hold whose record a capture took goes back to waiting."""
        done: list[Hold] = []
        taken: list[Hold] = []
        modes: dict[Backend, CaptureMode] = {}
        try:
            with self._lock:
                budget = len(self._turn) if queries is None else queries
                streams = len(self._turn)
                while budget > 0 and streams > 0 and self._turn:
                    key = self._turn.popleft()
                    streams -= 1
                    queue = self._streams[key]
                    budget = self._take_completed(queue, budget, modes, done, taken)
                    if queue:
                        self._turn.append(key)
                    else:
                        del self._streams[key]
                self.count -= len(done) + len(taken)
                self.nbytes -= sum(h.nbytes for h in done) + sum(h.nbytes for h in taken)
                self.released += len(done)
            for hold in done:  # outside the lock; the pool queries too: still relaxed
                if hold.ranges and _observe.active and not hold.failed:
                    # before the event is reused and the owner let go (see _complete)
                    _observe.hold_released(hold.mark.key.backend, hold.event, hold.ranges)
                if hold.failed:
                    hold.pool.release(hold.event)  # never reused
                else:
                    hold.pool.reuse(hold.event)  # no query: seen complete already
        finally:
            for backend, mode in modes.items():
                backend.exchange_capture_mode(mode)
        if taken:
            wait_again = self.taken_again
            assert wait_again is not None  # (set by _hold, which makes every hold)
            for hold in taken:
                wait_again(hold)
        released = len(done)
        if keep is not None:
            keep.extend(done)
        del done  # the owners go now, outside the lock: their finalizers may call us
        return released

    def _take_completed(
        self,
        queue: deque[Hold],
        budget: int,
        modes: dict[Backend, CaptureMode],
        done: list[Hold],
        taken: list[Hold],
    ) -> int:
        """Move the completed holds at the front of one stream's ``queue`` to
        ``done``; returns the budget left, which only a query that finds a hold
        not done spends. Holds complete in record order, so the oldest are
        probed at doubling distances and each probe found done releases all up
        to it: a backlog of n completed holds takes about log2(n) queries.
        Where that order is not known (another library's stream, whose handle
        may have been destroyed and given to a new one: ``order_known``), one
        at a time, the oldest first: each released by its own query."""
        step = 1
        doubling = bool(queue) and order_known(queue[0].mark.key)
        while queue:
            i = min(step, len(queue)) - 1
            if not self._complete(queue[i], modes):
                return budget - 1
            if queue[i].taken:  # it says nothing of the holds before it
                taken.append(queue[i])
                del queue[i]
                return budget - 1
            for _ in range(i + 1):
                done.append(queue.popleft())
            if doubling:
                step *= 2
        return budget

    @staticmethod
    def _complete(hold: Hold, modes: dict[Backend, CaptureMode]) -> bool:
        backend = hold.mark.key.backend
        if backend not in modes:
            modes[backend] = backend.exchange_capture_mode("relaxed")
        try:
            # Through the one observation channel: a library query orders
            # nothing in the program for the sanitizer, except that the owner
            # let go now is freed after the work it saw complete, in whatever
            # thread its last reference goes (``_observe.hold_released``).
            return backend.query(hold.event)
        except CudaError as exc:
            if exc.code in TAKEN_BY_A_CAPTURE and not isinstance(exc, DeviceFaultError):
                hold.taken = True
            else:  # the work before it failed and will never run
                hold.failed = True
            return True

    def sweep(self) -> None:
        """Run what finalizers left, settle every released view, then release
        every completed hold (nothing inside a garbage collection: see tick)."""
        if in_collection():
            return
        run_deferred()
        for _ in range(len(self.released_views)):
            self._settle_one()
        self.aged = len(self.released_views)  # what is left waits for a capture to end
        self.release_completed(None)

    def _settle_one(self) -> None:
        try:
            lease = self.released_views.popleft()
        except IndexError:
            return
        if not lease.settle():
            self.released_views.append(lease)  # its stream cannot take a record yet


table = HoldTable()


def tick() -> None:
    """Bounded release work, done by the shared poller on every pass and by
    the library on entry: run what finalizers left (``_deferred``), settle a
    few views released before the previous tick, query a few holds. Never
    blocks; nothing inside a garbage collection (a finalizer calling in may
    run while this thread holds a library lock)."""
    if in_collection():
        return
    if pending():
        run_deferred()
    if not table.busy:
        table.aged = 0  # nothing is queued
        return
    queued = table.released_views
    for _ in range(min(TICK_SETTLES, table.aged, len(queued))):
        table._settle_one()
    table.aged = len(queued)  # (another thread's tick may race: only a delay of one)
    if table.count:
        table.release_completed(TICK_QUERIES)


def _tick_in_poller() -> None:
    try:
        tick()
    except Exception:  # never end the poller: the next library call runs the same
        pass  # step and raises into its caller (a warning turned into an error)


pass_hooks.append(_tick_in_poller)
