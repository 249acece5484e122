"""One scheduler per (backend, device): the event pool, the export stream, the
pending work of every tracked buffer, and the counters ``cs.stats()`` reports.

The registry holds each buffer's :class:`~cai_streams._pending.PendingWork`
while the buffer lives, whether or not a TrackedArray wraps it. It never keeps
the buffer alive: when the buffer is collected its state is released (nothing
can conflict with its work any more; each event returns to the pool once
complete). A buffer that cannot be weakly referenced is held instead, until its
wrapper is gone and its work has completed.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Final

from . import _capture_guard, _observe
from ._access import Counters
from ._backend import LEGACY_DEFAULT_STREAM, PER_THREAD_DEFAULT_STREAM, Backend, current_backend
from ._device import OnDevice
from ._doorbell import gil_shares
from ._doorbell import stats as doorbell_stats
from ._errors import CaptureError, CudaError
from ._events import pool_for, pools_of, record_asked, registered
from ._hold_table import table as holds
from ._hold_table import tick as release_holds
from ._identity import StreamId, name_stream, stream_id_now, thread_serial
from ._interface import ArrayView, byte_runs
from ._pending import PendingWork
from ._poller import counters as poll_counters
from ._poller import sweep_pollers
from ._stream import Stream

__all__ = ["Scheduler", "any_scheduler", "find_work", "scheduler_for", "schedulers_of", "stats"]


class _Spares:
    """Streams of one device that the library made for one use at a time,
    kept for the next (at most ``MAX_SPARES``, as PyTorch keeps 32 side
    streams per device; beyond, closed once given back). :meth:`take` hands
    out a kept one that a query finds idle, asking at most ``SPARE_QUERIES``
    of them, else a new one: whoever takes it waits for its own work alone."""

    def __init__(self, sched: Scheduler, role: str) -> None:
        self._sched = sched
        self._role = role  # how messages name them
        self._kept: deque[Stream] = deque()

    def __len__(self) -> int:
        return len(self._kept)

    def handles(self) -> list[int]:
        """The handles of the streams kept now."""
        with self._sched.lock:
            return [s.handle for s in self._kept]

    def take(self) -> Stream:
        """An idle stream. Does not block (``SPARE_QUERIES`` queries at most:
        the longest idle first, the busy ones go to the back)."""
        sched = self._sched
        for _ in range(min(len(self._kept), SPARE_QUERIES)):
            with sched.lock:
                if not self._kept:
                    break
                s = self._kept.popleft()
            try:
                idle = _capture_guard.stream_idle(sched.backend, s._key())
            except CudaError:  # (a fault its wait saw: let it go, with its error)
                continue
            if idle:
                return s
            with sched.lock:  # (still busy: a timed-out or cancelled consume's, say)
                self._kept.append(s)
        s = Stream._on(sched.backend, sched.device)
        name_stream(s._key(), self._role)
        return s

    def give(self, s: Stream) -> None:
        """``s``, from :meth:`take`, is free again (its work may still run)."""
        with self._sched.lock:
            if len(self._kept) < MAX_SPARES:
                self._kept.append(s)
                return
        try:
            s.close()  # (what it has enqueued still runs)
        except CudaError:  # (a fault or a reset: the stream is gone with it, and the
            pass  # caller's own calls say so; what it used the stream for is done)


class Scheduler:
    """Per (backend, device) state (see the module docstring)."""

    def __init__(self, backend: Backend, device: int) -> None:
        self.backend = backend
        self.device = device
        self.pool = pool_for(backend, device)
        self.counters = Counters()
        self.lock = threading.Lock()  # the registry and the export stream: bookkeeping only
        self.buffers: dict[int, PendingWork] = {}
        self._collected: deque[PendingWork] = deque()  # buffers gone: release their work
        self._orphans: deque[PendingWork] = deque()  # held buffers whose wrapper is gone
        #: until then the orphans are not asked again (one's record met a capture)
        self._orphans_paused_until = 0.0
        self._export_stream: Stream | None = None
        #: streams of this device the library made for DLPack host consumes,
        #: kept for the next (see :meth:`landing`)
        self._landings = _Spares(self, "cai_streams' landing stream")
        #: streams of the library's on which accesses on another library's
        #: streams are merged (:meth:`merging`), kept for the next
        self._merges = _Spares(self, "cai_streams' merge stream")

    @property
    def export_stream(self) -> Stream:
        stream = self._export_stream
        if stream is None:
            with self.lock:
                if self._export_stream is None:
                    self._export_stream = Stream._on(self.backend, self.device)
                    name_stream(self._export_stream._key(), "cai_streams' export stream")
                stream = self._export_stream
        return stream

    def landing(self) -> Stream:
        """A stream of this device with nothing pending, for one DLPack host
        consume: the producer's ``__dlpack__`` orders it after its work, and
        the host waits for that alone (the shared export stream also carries
        every tracked export's joins, and is never idle right after one). Give
        it back with :meth:`landed`. Does not block (see :class:`_Spares`)."""
        return self._landings.take()

    def landed(self, s: Stream) -> None:
        """``s``, from :meth:`landing`, is free again (its work may still run)."""
        self._landings.give(s)

    def merging(self) -> Stream:
        """A stream of this device with nothing pending, on which an access on
        another library's stream is merged with an older one (``PendingWork``):
        its own, so that the merged access waits for those two alone (a stream
        shared by merges would queue each behind the others' waits, and one
        busy stream would hold up every array merged after it). Give it back
        with :meth:`merged`. Does not block (see :class:`_Spares`)."""
        return self._merges.take()

    def merged(self, s: Stream) -> None:
        """``s``, from :meth:`merging`, is free again (its work may still run)."""
        self._merges.give(s)

    def join(
        self,
        waiter: int,
        producer: StreamId,
        *,
        keepalive: object,
        what: str,
        waiter_id: StreamId | None = None,
    ) -> None:
        """Stream ``waiter`` waits for all work enqueued so far on ``producer``
        (one pooled event of the producer's device, recorded now; ``keepalive``
        lives until it completes). A join a graph capture forbids raises
        CaptureError first (``what`` is the call, for its message); a capturing
        waiter of an idle producer needs none. ``waiter_id``: the waiter's
        identity, when the caller has it already."""
        backend = self.backend
        if waiter_id is None:
            waiter_id = stream_id_now(backend, waiter)
        pool = pool_for(backend, producer.device)  # recorded on the producer's device
        event = pool.acquire()  # first: it may query and create, and the record's ask
        mark = None  # (below) must be the last backend call before the record
        try:
            waiter_capturing = _capture_guard.capturing(backend, waiter_id) is True
            state = _capture_guard.capturing(backend, producer)
            if not _capture_guard.check_wait(
                waiter_id,
                waiter_capturing,
                producer,
                producer_capturing=state is True,
                done=lambda: _capture_guard.stream_idle(backend, producer),
                what=what,
            ):
                return
            mark = record_asked(backend, event, producer, state)
            if waiter_id.handle <= PER_THREAD_DEFAULT_STREAM:  # a default stream: its
                on = waiter_id  # device's; another thread's handle 2 waits through
                if on.handle == PER_THREAD_DEFAULT_STREAM and on.thread != thread_serial():
                    on = StreamId(backend, on.device, LEGACY_DEFAULT_STREAM, 0, 0)  # the legacy
                with OnDevice(backend, on.device, on.handle):  # stream, whose work it waits for
                    backend.stream_wait_event(on.handle, event)
            else:
                backend.stream_wait_event(waiter, event)  # legal across devices
        finally:
            if mark is None:  # never recorded: it is as complete as it was handed out
                pool.unacquire(event)
            else:
                pool.release(event, keepalive, mark)

    def declare_stream_read(self, s: Stream, view: ArrayView, what: str) -> None:
        """Tell the sanitizer that work enqueued on ``s`` from now reads ``view``."""
        if _observe.active:
            _observe.stream_access(
                self.backend, s.handle, reads=byte_runs(view), writes=(), what=what
            )

    def work_of(self, obj: object) -> PendingWork | None:
        """The pending work of ``obj`` if it is tracked. Does not block."""
        if self._collected or self._orphans:
            self.collect(limit=4)
        work = self.buffers.get(id(obj))
        if work is not None and work.obj() is obj:
            return work
        return None

    def work_for(
        self, obj: object, layout: ArrayView, export_stream: Stream | None
    ) -> tuple[PendingWork, bool]:
        """The pending work of ``obj``, made on first use; one per object even
        when threads race (True when it was made now)."""
        if self._collected or self._orphans:
            self.collect(limit=4)
        x = self.export_stream if export_stream is None else export_stream
        with self.lock:
            work = self.buffers.get(id(obj))
            if work is not None and work.obj() is obj:
                return work, False
            work = PendingWork(
                obj,
                layout,
                x,
                self.backend,
                self.device,
                self.counters,
                self._on_collected,
            )
            if self.buffers.get(work.key) is None:  # (else it replaces a collected one's)
                with _schedulers_lock:
                    _tracked_ids[work.key] = _tracked_ids.get(work.key, 0) + 1
            self.buffers[work.key] = work
            return work, True

    def _on_collected(self, work: PendingWork) -> None:
        # From a weakref callback: may run in any thread, inside any lock: only queue.
        global _queued
        self._collected.append(work)
        _queued = True

    def wrapper_gone(self, work: PendingWork) -> None:
        """A weakref callback when a TrackedArray goes: only queue."""
        global _queued
        if work.held_strongly:
            self._orphans.append(work)
            _queued = True

    def collect(self, limit: int | None = None) -> None:
        """Release the work of collected buffers; let go of settled held ones."""
        n = len(self._collected) if limit is None else limit
        while n > 0 and self._collected:
            n -= 1
            work = self._collected.popleft()
            work.abandon()
            self._forget(work)
        n = len(self._orphans) if limit is None else limit
        if n and self._orphans and time.monotonic() < self._orphans_paused_until:
            n = 0  # (a capture forbade a record: not asked again on every lookup)
        while n > 0 and self._orphans:
            n -= 1
            work = self._orphans.popleft()
            wrapper = work.wrapper
            if wrapper is not None and wrapper() is not None:
                continue  # tracked again: its new wrapper will report when it goes
            try:
                settled = work.settle()
            except CaptureError:  # a capture forbids the record now: asked again later
                self._orphans.append(work)
                self._orphans_paused_until = time.monotonic() + ORPHAN_PAUSE
                break
            except CudaError:  # its work failed: nothing can wait for it any more
                work.abandon()
                settled = True
            if settled:
                self._forget(work)
            else:
                self._orphans.append(work)

    def _forget(self, work: PendingWork) -> None:
        with self.lock:
            if self.buffers.get(work.key) is work:
                del self.buffers[work.key]
                with _schedulers_lock:
                    left = _tracked_ids.pop(work.key, 1) - 1
                    if left:
                        _tracked_ids[work.key] = left


#: seconds the orphans of a registry are left alone after one's record met a
#: graph capture (they are asked on every lookup otherwise: settle, raise)
ORPHAN_PAUSE: Final = 0.005
#: streams :meth:`Scheduler.landing` and :meth:`Scheduler.merging` each keep
#: per device; beyond, they are closed once given back (merges on streams kept
#: busy, by slow work of another library's, need one each)
MAX_SPARES: Final = 32
#: kept streams one take asks whether they are idle, at most (a query each)
SPARE_QUERIES: Final = 8

_schedulers: dict[tuple[Backend, int], Scheduler] = {}
_schedulers_lock = threading.Lock()
#: a buffer of some registry was collected, or lost its wrapper, since the
#: lookups last released those of backends that are not current (a lookup
#: releases its own backend's as it goes)
_queued = False
#: the ids of the buffers tracked on any backend, with how many registries hold
#: each: a lookup asks the other backends only about these
_tracked_ids: dict[int, int] = {}
#: the same schedulers per backend, in the order made: every lookup walks them
_of_backend: dict[Backend, tuple[Scheduler, ...]] = {}


def export_stream_of(work: PendingWork) -> Stream:
    """The stream an export of ``work`` joins onto when given none: the one
    it was tracked with while that is open, else its scheduler's own (a
    closed stream can take no join, and the array stays exportable)."""
    stream = work.export_stream
    if stream.closed:
        return scheduler_for(work.backend, work.device).export_stream
    return stream


def scheduler_for(backend: Backend, device: int | None = None) -> Scheduler:
    """The scheduler of ``backend``'s ``device`` (None: the current device)."""
    if device is None:
        device = backend.current_device()
    found = _schedulers.get((backend, device))  # every handoff asks: no closure made then
    if found is not None:
        return found
    on = device

    def make() -> Scheduler:  # under the lock
        made = Scheduler(backend, on)
        _of_backend[backend] = (*_of_backend.get(backend, ()), made)
        return made

    return registered(_schedulers, _schedulers_lock, (backend, on), make)


def any_scheduler(backend: Backend) -> Scheduler:
    """A scheduler of ``backend``, for work that no device's state is kept for
    (the join of an untracked handoff: its event comes from the producer's
    stream's device): the first one made, without asking the current device
    (a cudaGetDevice on a GPU). Does not block."""
    made = _of_backend.get(backend)
    return made[0] if made else scheduler_for(backend)


def schedulers_of(backend: Backend) -> list[Scheduler]:
    """Every scheduler made so far for ``backend`` (one per device used)."""
    return list(_of_backend.get(backend, ()))


def find_work(backend: Backend, obj: object) -> PendingWork | None:
    """The pending work of ``obj`` on whichever device it is tracked, on
    ``backend`` first, then on any other backend in use (an array tracked
    before another backend was made current). Does not block."""
    release_holds()  # every handoff, export and track() passes here: a bounded step
    others = len(_of_backend) > (backend in _of_backend)  # (another backend in use)
    if _queued and others:
        _collect_elsewhere(backend)
    for sched in _of_backend.get(backend, ()):
        work = sched.work_of(obj)
        if work is not None:
            return work
    if others and id(obj) in _tracked_ids:
        for other, scheds in list(_of_backend.items()):  # (tracked before another was current)
            if other is not backend:
                for sched in scheds:
                    work = sched.work_of(obj)
                    if work is not None:
                        return work
    return None


def _collect_elsewhere(backend: Backend) -> None:
    """A bounded step of releasing the state of buffers collected on the
    backends other than ``backend`` (the current one), which their own
    lookups no longer reach while another backend is current."""
    global _queued
    _queued = False  # (first: what is queued meanwhile sets it again)
    for other, scheds in list(_of_backend.items()):
        if other is not backend:
            for sched in scheds:
                if sched._collected or sched._orphans:
                    sched.collect(limit=4)
                    if sched._collected or sched._orphans:
                        _queued = True


def stats() -> dict[str, int]:
    """Counters of the current backend, summed over its devices (for tests and
    benchmarks).

    ``events_created``, ``events_acquired`` (handed out: the difference was
    reused), ``events_pooled`` (free for reuse), ``events_in_flight``
    (handed out or not yet complete), ``events_pinned`` (held by host waiters
    now), ``joins`` (export waits), ``waits`` (waits made by blocks and
    consumers), ``waits_elided`` (pending work found complete), ``exports``,
    ``tracked`` (buffers with tracked state); and, for the shared poller of
    every event loop, ``poll_passes``, ``poll_queries`` (event queries made),
    ``poll_wakes`` (waiters woken) and ``poll_gil_shares`` (times a poller,
    or a block waiter, that does not sleep let go of the GIL so that other
    threads get it); for the stream-ordered holds of
    every device (``cs.hold``, views handed to a stream), ``holds`` (in
    flight), ``hold_bytes`` (bytes their owners say they have), ``holds_made``,
    ``holds_released`` and ``holds_merged`` (released views whose hold was
    merged into a newer view's of the same owner on the same stream, so
    recorded no event of its own); for the doorbell (process-wide),
    ``doorbells_armed``, ``doorbells_fired``, ``doorbells_retired`` (no
    longer watched before they fired: their poller ended first, or their
    device faulted), ``doorbell_lanes`` (notifier streams) and
    ``doorbell_fds`` (pipe ends held, at most 128): once no poller runs,
    armed == fired + retired. Does not block: completed holds
    are released first (it makes one stream query per notifier stream in
    use).
    """
    sweep_pollers()  # (what the pollers of closed event loops hold goes first)
    holds.sweep()
    backend = current_backend()
    scheds = schedulers_of(backend) or [scheduler_for(backend)]
    pools = pools_of(backend)
    for sched in scheds:
        sched.collect()
    for pool in pools:
        pool.reclaim()
    return {
        **doorbell_stats(),
        "poll_passes": poll_counters.passes,
        "poll_queries": poll_counters.queries,
        "poll_wakes": poll_counters.wakes,
        "poll_gil_shares": gil_shares.count,
        "events_created": sum(p.created for p in pools),
        "events_acquired": sum(p.acquired for p in pools),
        "events_pooled": sum(p.free for p in pools),
        "events_in_flight": sum(p.in_flight for p in pools),
        "events_pinned": sum(s.counters.pinned for s in scheds),
        "joins": sum(s.counters.joins for s in scheds),
        "waits": sum(s.counters.waits for s in scheds),
        "waits_elided": sum(s.counters.elided for s in scheds),
        "exports": sum(s.counters.exports for s in scheds),
        "tracked": sum(len(s.buffers) for s in scheds),
        "holds": holds.count,
        "hold_bytes": holds.nbytes,
        "holds_made": holds.made,
        "holds_released": holds.released,
        "holds_merged": holds.merged,
    }
