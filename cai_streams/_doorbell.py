"""The doorbell: the GPU wakes the event loop itself, and no Python runs on a driver thread.

A bell is armed for a stream's oldest pending event. It is a pipe: the event
loop watches the read end (``add_reader`` under asyncio and uvloop, a system
task in ``wait_readable`` under trio), and on a private notifier stream (a
*lane*) that first waits on the event, a host function closes the write end.
The host function is libc's ``close``, a C function already in the process,
called by the driver's thread with the descriptor as its argument: no Python
and no GIL there. The read end then reports end-of-file, and the loop's own
selector wakes the loop, with no thread of ours in between. A fired bell
means its event is complete, so the poller wakes that event's waiters without
a query, then makes one pass at once for whatever else completed; while every
pending stream has a bell and the ring chains the next, there is nothing else
to find, and the next bell is armed without the pass. A
producer's stream never waits behind a bell: only the lane does.

The poller stays in charge. A stream's oldest pending event gets a bell when
a waiter parks on it, the next one when a bell rings (as long as bells beat
the passes to it), and every stream's once the poller has backed off to its
``cap`` (while passes keep finding completions, polling is as prompt and
cheaper). Nothing is armed for an event nobody waits on any more: it may
have been destroyed and its handle given to another record. While every
pending stream has a bell, the poller sleeps the policy's ``fallback`` between passes,
and those passes still find errors (a device that faulted runs no host
function again). A capturing stream never gets a bell, nor does anything when
the platform has no pipes and no ``close`` to call, or every lane is busy: the
poller's own cadence covers them.

Descriptors: the loop closes a bell's read end when it fires. A bell whose
poller ends first is *retired* (``armed == fired + retired`` once no poller
runs): the doorbell keeps both ends, unwatched, and closes the read end once
it shows end-of-file. It never closes a write end that it handed to a host
function while that function may still run: the number belongs to the driver
until then, so the library can never close a descriptor someone else was
given meanwhile. Only when a query finds the lane idle and the read end still
open (the function was skipped: its device faulted and was reset since; or a
forked child holds a copy) does it close the write end itself, and only if
the number still names that pipe. A forked child closes its copies of the
write ends at once (``os.register_at_fork``), or the parent's bells could not
ring while it lives. Bells of an event loop closed without cancelling its
tasks are retired by the next sweep. On a device that faulted for good, the ends
stay open for the life of the process (a faulted CUDA context is unusable
anyway). The doorbell holds at most ``MAX_FDS`` descriptors
(``stats()["doorbell_fds"]``): beyond that, it settles what it can, then
refuses bells and the poller's cadence serves.

A lane serves one producer stream at a time, so a slow stream never holds
back another stream's bell, and its bells are enqueued in record order: a
bell for an event recorded before one already belled there (its waiter came
later) takes another lane rather than wait behind it. A lane is free again
once its bells fired, or once a query finds it idle (a retired bell's
function may still be queued there); a lane whose device faulted is retired
whole (``stats()`` sweeps; arming there retires it too).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import enum
import functools
import os
import stat
import sys
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Final, Literal, Protocol

import anyio
import anyio.lowlevel
import sniffio

from ._backend import PER_THREAD_DEFAULT_STREAM, Backend
from ._capture_guard import relaxed
from ._errors import CudaError, CudaWarning
from ._identity import StreamId, thread_serial

__all__ = [
    "AUTO_BACKENDS",
    "WAKE_MODES",
    "BellState",
    "PollerBells",
    "WakeMode",
    "counters",
    "gil_shares",
]

#: how a waiter is woken: by a bell where one can be armed ("doorbell"), by
#: polling only ("poll"), or whichever is best on the backend in use ("auto")
WakeMode = Literal["auto", "doorbell", "poll"]
WAKE_MODES: Final[tuple[WakeMode, ...]] = ("auto", "doorbell", "poll")
#: backends where "auto" rings bells: where the benchmarks show them best. On
#: the simulator they are. On an H100 (four runs, 2026-11-23, docs/performance.md)
#: bells won at 1 waiter and in the median at 10,000, but their p99 at 100 and
#: 1,000 waiters was 6-16 ms against the poller's 1.2-1.5 ms: "auto" polls on
#: cuda (and on the decoy that stands in for it). Traced since (docs/gpu.md):
#: the driver runs a host function that follows a wait on another stream's
#: event 9-22 ms after that event in the median, about 97 ms at p99, so the
#: fallback pass finds those completions first. ``wake="doorbell"`` still rings
#: bells there.
AUTO_BACKENDS: Final = frozenset({"sim"})
#: notifier streams per (backend, device); beyond this a bell is refused
MAX_LANES: Final = 64
#: notifier streams serving one producer stream (more than one only when its
#: waiters arrive out of record order), so that one stream cannot take them all
MAX_LANES_PER_STREAM: Final = 4
#: file descriptors the doorbell holds at most (two per armed bell, kept by a
#: retired bell until settled); beyond this a bell is refused
MAX_FDS: Final = 128
#: seconds between the settling of retired bells that arming does (a sweep,
#: ``stats()``, settles them at once)
SETTLE_EVERY: Final = 0.05

#: seconds a poller that never sleeps (spin passes, the low-latency policy)
#: runs at least between two releases of the GIL long enough for a waiting
#: thread to take it (``time.sleep(0)``). The loop's own turns release it too
#: briefly to be won, and restart the switch interval (5 ms) after which
#: CPython makes the holder hand it over: a thread waiting for the GIL beside
#: a spinning poller waited 5 ms or more per take (100 took 0.5-3.7 s under
#: trio). A release blocks the loop until the GIL comes back: about 75 µs
#: beside a thread that takes it briefly (a driver call), about the switch
#: interval beside one running Python (which wins the loop's brief releases
#: by itself), longer beside one in a long C call. The next release then waits
#: ``GIL_SHARE_BACKOFF`` times as long as that one took, at most that many
#: switch intervals, so a release costs its loop about a tenth at most.
GIL_SHARE_EVERY: Final = 0.001
GIL_SHARE_BACKOFF: Final = 10


class _GilShares:
    """How many times pollers let go of the GIL for other threads
    (``cs.stats()["poll_gil_shares"]``)."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0


gil_shares = _GilShares()


class BellState(enum.Enum):
    """Where an entry of the poller stands with the doorbell."""

    UNARMED = "unarmed"
    ARMED = "armed"
    #: could not be armed (capturing stream, no lane, no pipes): the poller's
    #: own cadence covers it
    REFUSED = "refused"


class Woken(enum.Enum):
    """Whether the poller's sleep ends early, and so what its next pass queries."""

    #: it sleeps its time, then passes over every stream
    NO = "no"
    #: only bells rang: a stream whose oldest event has a bell rings for itself
    RUNG = "rung"
    #: something asked for a pass over every stream (a bell refused, say)
    PASS = "pass"


class Nap(enum.Enum):
    """What the poller task is doing, as far as a ring is concerned."""

    #: not sleeping between passes (it arms the chained heads itself next)
    AWAKE = "awake"
    #: sleeping its fast cadence: some pending stream has no bell
    POLLING = "polling"
    #: sleeping ``fallback``: every pending stream's oldest event has a bell
    COVERED = "covered"


class Armable(Protocol):
    """What the doorbell needs of a poller entry."""

    backend: Backend
    event: int
    #: its place in its stream's record order (-1: a lone event)
    seq: int
    bell: BellState

    #: who waits on it: an entry nobody waits on is never armed (its event may
    #: have been destroyed since, and its handle taken by another record)
    @property
    def waiters(self) -> Sequence[object]: ...


class _Phase(enum.Enum):
    """Where one bell stands: the loop watches its read end until it fires
    (then closes the read end) or its poller stops watching first."""

    WATCHED = "watched"
    #: the host function closed the write end; the loop still holds the read end
    FIRED = "fired"
    #: fired, and the loop closed the read end
    CLOSED = "closed"
    #: no longer watched before it fired: both ends are the doorbell's now
    RETIRED = "retired"


class _Lane:
    """A notifier stream, the bells armed there that loops still watch, and the
    retired ones whose write ends are not yet known to be closed."""

    __slots__ = ("backend", "key", "orphans", "stream", "tail", "watched")

    def __init__(self, backend: Backend, stream: int) -> None:
        self.backend = backend
        self.stream = stream
        #: the record-order place of the last bell enqueued here: a bell for
        #: an earlier event must not wait behind it, so it takes another lane
        self.tail = -1
        #: bells armed here that the loops still watch
        self.watched = 0
        #: retired bells: both ends still open (the doorbell's now), settled
        #: once the read end shows end-of-file or a query finds the lane idle
        self.orphans: list[_Bell] = []
        #: the producer stream it serves, else None (free)
        self.key: Hashable | None = None


class _Bell:
    """One armed bell: its pipe, for the entry it was armed for."""

    __slots__ = (
        "entry",
        "event",
        "inode",
        "key",
        "lane",
        "loop_closed",
        "phase",
        "rfd",
        "seq",
        "wfd",
    )

    def __init__(
        self, entry: Armable, key: Hashable, lane: _Lane, rfd: int, wfd: int, inode: int
    ) -> None:
        #: the poller's entry while watched; None once retired (an orphan
        #: outlives its poller, whose entry holds the waiters and their loop)
        self.entry: Armable | None = entry
        #: the record it rings for (an orphan is adopted by a wait on it again)
        self.event = entry.event
        self.seq = entry.seq
        self.key = key
        self.lane = lane
        self.rfd = rfd
        #: the driver's to close, by the host function; the doorbell's only
        #: once an idle lane shows the function will never run (it was skipped)
        self.wfd = wfd
        #: its pipe's: once the host function closed ``wfd``, the number may
        #: name another bell's write end (``_Doorbell.handed``)
        self.inode = inode
        self.phase = _Phase.WATCHED
        #: whether the event loop watching it has been closed (without its
        #: poller ending: then a sweep retires the bell)
        self.loop_closed: Callable[[], bool] = never_closed


#: a bell that fired: the poller's entry and its queue's key (its producer stream)
Fired = tuple[Armable, Hashable]


class _Counters:
    __slots__ = ("armed", "fired", "lanes", "retired")

    def __init__(self) -> None:
        self.armed = 0
        self.fired = 0
        self.retired = 0
        self.lanes = 0


counters = _Counters()


def _close_address() -> int:
    """The address of libc's ``int close(int)``, called as ``void (*)(void *)``
    with the descriptor as the pointer (the int result is ignored, and the int
    argument is the low half of the register, which the x86-64 and aarch64
    ABIs allow); 0 where there is no libc to call."""
    if not hasattr(os, "pipe") or os.name != "posix":
        return 0
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        return ctypes.cast(libc.close, ctypes.c_void_p).value or 0
    except (OSError, AttributeError):
        return 0


def _pipe() -> tuple[int, int]:
    """A non-blocking, close-on-exec pipe: (read end, write end)."""
    if hasattr(os, "pipe2"):
        return os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    rfd, wfd = os.pipe()  # macOS: already close-on-exec (PEP 446)
    os.set_blocking(rfd, False)
    return rfd, wfd


def _has_fired(rfd: int) -> bool:
    """Whether the write end of the pipe was closed (never blocks)."""
    try:
        return os.read(rfd, 1) == b""
    except BlockingIOError:
        return False


class _Doorbell:
    """The process's lanes (shared by every event loop, so under a lock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._close: int | None = None  # libc's close, found on first use (0: none)
        #: descriptors held now: read ends not closed, write ends not known closed
        self.fds = 0
        #: write ends handed to host functions and not known closed, with their
        #: pipe's inode (a forked child closes its copies: close_handed_copies)
        self.handed: dict[int, int] = {}
        #: bells the loops watch (a sweep retires those whose loop was closed)
        self.watched: set[_Bell] = set()
        #: bells that fired and whose read end the loop closes in its next
        #: turn (a sweep closes it if the loop was closed before that turn)
        self.unclosed: set[_Bell] = set()
        self._settled_at = 0.0  # when arming last settled the retired bells
        #: what the loops reported (done), applied under the lock by whoever
        #: holds it next: a report may come from a garbage collection that ran
        #: while this thread held the lock
        self._reports: deque[tuple[_Bell, _Phase]] = deque()
        self.lanes: dict[tuple[Backend, int], list[_Lane]] = {}
        #: the lanes serving each producer stream (more than one only when
        #: waiters arrived out of record order)
        self.serving: dict[tuple[Backend, Hashable], list[_Lane]] = {}
        #: lanes retired (their device faulted, or no host functions there)
        #: and not destroyed yet: their bells are not all settled
        self.retiring: list[_Lane] = []
        #: backends that cannot launch host functions: the poller alone serves them
        self.no_host_functions: set[Backend] = set()

    def close_address(self) -> int:
        if self._close is None:
            self._close = _close_address()
        return self._close

    def arm(self, entry: Armable, key: Hashable) -> _Bell | None:
        """Enqueue a bell for ``entry`` on a lane; None if none can be armed.
        Only enqueues (a pipe, a stream wait and a host function)."""
        backend, event = entry.backend, entry.event
        close = self.close_address()
        if not close or backend in self.no_host_functions or _capturing(backend, key):
            return None
        with self.lock:
            self._apply_reports()
            adopted = self._adopt(entry, key)
            if adopted is not None:
                return adopted
            now = time.monotonic()
            if self.fds + 2 > MAX_FDS or now - self._settled_at > SETTLE_EVERY:
                self._settled_at = now
                self._sweep_locked(in_use=False)  # settles the orphans timed-out waits left
                if self.fds + 2 > MAX_FDS:
                    return None  # the poller's cadence covers it
            if self._orphaned(backend, key):
                # A waiter on this stream gave up, and its bell, for another record,
                # is still queued (its pipe held until it runs): a producer that
                # records anew for each wait (an untracked array) would take a pipe
                # per timed-out wait. The poller's cadence covers this one until
                # that bell settles (``deferred``: asked again as the poller backs off).
                return None
            try:
                rfd, wfd = _pipe()
            except OSError:  # out of descriptors, say
                return None
            try:
                inode = os.fstat(rfd).st_ino
            except OSError:
                os.close(rfd)
                os.close(wfd)
                return None
            self.fds += 2
            self.handed[wfd] = inode  # before the driver has it: a fork may come any time
            lane = self._lane_for(backend, key, entry.seq)
            if lane is not None:
                try:
                    backend.stream_wait_event(lane.stream, event)
                    backend.launch_host_func(lane.stream, close, wfd)
                except CudaError:  # the poller finds the error, if it is the event's
                    if self._query(lane) is None:  # its device faulted
                        self._retire_lane(lane)
                    elif not lane.watched and not lane.orphans:
                        self._release(lane)
                    lane = None
                except OSError:  # the driver library has no cuLaunchHostFunc here
                    self.no_host_functions.add(backend)
                    self._retire_lane(lane)
                    lane = None
                else:  # from here on the write end is the driver's to close
                    lane.tail = entry.seq
                    return self._watch(_Bell(entry, key, lane, rfd, wfd, inode))
            self.fds -= 2
            del self.handed[wfd]
        os.close(rfd)  # never handed over: both ends are still ours
        os.close(wfd)
        return None

    def _orphaned(self, backend: Backend, key: Hashable) -> bool:
        """Lock held: whether a lane serving ``key`` holds an orphan still
        unsettled, once those whose host function ran are settled (one query)."""
        lanes = self.serving.get((backend, key), ())
        for lane in list(lanes):
            if lane.orphans:
                self._settle(lane)
        return any(lane.orphans for lane in self.serving.get((backend, key), ()))

    def deferred(self, backend: Backend, key: Hashable) -> bool:
        """Whether a bell for ``key`` was refused only for an orphan still
        queued there: worth asking again later. Never blocks."""
        with self.lock:
            return any(lane.orphans for lane in self.serving.get((backend, key), ()))

    def _adopt(self, entry: Armable, key: Hashable) -> _Bell | None:
        """Lock held: a retired bell for the same record, still unsettled, armed
        again (its host function is still queued): a waiter that keeps timing
        out on a long kernel holds one pipe, not one per wait."""
        if entry.seq < 0:  # a lone event: its handle may name another record now
            return None
        for lane in self.serving.get((entry.backend, key), ()):
            for i, orphan in enumerate(lane.orphans):
                if orphan.seq == entry.seq and orphan.event == entry.event:
                    del lane.orphans[i]
                    return self._watch(
                        _Bell(entry, key, lane, orphan.rfd, orphan.wfd, orphan.inode)
                    )
        return None

    def _watch(self, bell: _Bell) -> _Bell:
        """Lock held: ``bell`` is armed and handed to a loop to watch."""
        bell.lane.watched += 1
        counters.armed += 1
        self.watched.add(bell)
        return bell

    def _lane_for(self, backend: Backend, key: Hashable, seq: int) -> _Lane | None:
        """Lock held: a lane of ``key`` where nothing later in its record order
        is queued, else a free one (at most MAX_LANES_PER_STREAM per stream)."""
        lanes = self.serving.get((backend, key), ())
        for lane in lanes:
            if lane.tail <= seq:
                return lane
        if len(lanes) >= MAX_LANES_PER_STREAM:
            return None
        return self._free_lane(backend, key)

    def _free_lane(self, backend: Backend, key: Hashable) -> _Lane | None:
        """Lock held."""
        device = key.device if isinstance(key, StreamId) else backend.current_device()
        pool = self.lanes.setdefault((backend, device), [])
        lane = next((lane for lane in pool if lane.key is None), None) or self._reclaim(pool)
        if lane is None:
            if len(pool) >= MAX_LANES:
                return None
            try:
                stream = backend.create_stream(device)
            except CudaError:
                return None
            lane = _Lane(backend, stream)
            pool.append(lane)
            counters.lanes += 1
        lane.key = key
        self.serving.setdefault((backend, key), []).append(lane)
        return lane

    def _reclaim(self, pool: list[_Lane]) -> _Lane | None:
        """Lock held: free the first lane whose bells all stopped being watched
        once its orphans settle, so that a service making a stream per request
        never runs out of lanes."""
        for lane in pool:
            if lane.watched:
                continue
            if lane.orphans:
                self._settle(lane)
            if not lane.orphans:
                self._release(lane)
                return lane
        return None

    def _sweep_locked(self, *, in_use: bool) -> None:
        """Lock held: retire the bells of closed loops, settle the orphans of
        every lane (``in_use``: also free the lanes serving a stream that are
        found idle, and retire those whose device faulted), and destroy the
        retired lanes that have nothing left."""
        self._retire_abandoned()
        for pool in list(self.lanes.values()):
            for lane in list(pool):
                if lane.orphans or (in_use and lane.key is not None):
                    if not self._settle(lane) and in_use:
                        self._retire_lane(lane)
        self._drop_retired()

    @staticmethod
    def _query(lane: _Lane) -> bool | None:
        """Whether every host function enqueued on ``lane`` has run; None if
        its device faulted. Never blocks, never invalidates a capture."""
        try:
            with relaxed(lane.backend):
                return lane.backend.query_stream(lane.stream)
        except CudaError:
            return None

    def _settle(self, lane: _Lane) -> bool:
        """Lock held: close what is known of ``lane``'s orphans: a read end at
        end-of-file (the host function closed the write end), or both ends
        once a query finds the lane idle and the function never ran (its
        device was reset after a fault). Returns whether the lane answered
        the query (False: its device is faulted). Never blocks."""
        idle = self._query(lane)
        self._close_orphans(lane, bool(idle))
        if not lane.watched and not lane.orphans and lane.key is not None:
            self._release(lane)  # nothing of its bells is left on it
        return idle is not None

    def _close_orphans(self, lane: _Lane, idle: bool) -> None:
        """Lock held: close the orphans whose write end the host function
        closed, and, if ``lane`` is idle, those whose function was skipped."""
        kept = []
        for bell in lane.orphans:
            if _has_fired(bell.rfd):
                os.close(bell.rfd)
            elif idle:  # it ran or was skipped: nobody else will close the write end
                os.close(bell.rfd)
                self._close_if_ours(bell.wfd)
            else:
                kept.append(bell)
                continue
            self._not_handed(bell)
            self.fds -= 2
        lane.orphans = kept

    def _not_handed(self, bell: _Bell) -> None:
        """Lock held: ``bell``'s write end is closed: forget it, unless its
        number names another bell's write end by now (the host function closed
        it, and a later pipe took the number: that one is still handed)."""
        if self.handed.get(bell.wfd) == bell.inode:
            del self.handed[bell.wfd]

    def _release(self, lane: _Lane) -> None:
        """Lock held: no bell of ``lane`` can still fire; another stream may use it."""
        lane.tail = -1
        if lane.key is not None:
            lanes = self.serving.get((lane.backend, lane.key), [])
            if lane in lanes:
                lanes.remove(lane)
            if not lanes:
                self.serving.pop((lane.backend, lane.key), None)
            lane.key = None

    def _retire_lane(self, lane: _Lane) -> None:
        """Lock held: its device faulted (or it cannot run host functions). It
        serves nobody again, and is destroyed once its bells are settled: on a
        faulted device, never (no host function runs there again, and the
        write ends stay open); after a reset, at the next sweep."""
        self._release(lane)
        for pool in self.lanes.values():
            if lane in pool:
                pool.remove(lane)
                self.retiring.append(lane)

    def _drop_retired(self) -> None:
        """Lock held: destroy the retired lanes that answer a query again (their
        device was reset, say) and have nothing left."""
        for lane in list(self.retiring):
            if lane.watched or not self._settle(lane) or lane.orphans:
                continue
            self.retiring.remove(lane)
            counters.lanes -= 1
            try:
                lane.backend.destroy_stream(lane.stream)
            except CudaError as exc:
                warnings.warn(
                    f"leaked notifier stream {lane.stream:#x}: {exc}", CudaWarning, stacklevel=3
                )

    def _close_if_ours(self, wfd: int) -> None:
        """Lock held: close ``wfd`` if it still names the pipe it was made for
        (the host function may have closed it, and the number gone to another
        file since; a forked child's copy would have kept the pipe open)."""
        inode = self.handed.get(wfd)
        try:
            info = os.fstat(wfd)
            if inode is not None and stat.S_ISFIFO(info.st_mode) and info.st_ino == inode:
                os.close(wfd)
        except OSError:  # closed meanwhile
            pass

    def done(self, bell: _Bell, phase: _Phase) -> None:
        """The loop reports ``bell`` FIRED (the host function closed the write
        end), CLOSED (then the loop closed the read end), or RETIRED (no longer
        watched before it fired: the doorbell keeps both ends until it knows
        what became of the write end). Never waits for the lock: it may be
        called from a garbage collection while this thread holds it."""
        bell.phase = phase
        self._reports.append((bell, phase))
        if self.lock.acquire(blocking=False):
            try:
                self._apply_reports()
            finally:
                self.lock.release()

    def _apply_reports(self) -> None:
        """Lock held."""
        while self._reports:
            bell, phase = self._reports.popleft()
            lane = bell.lane
            if phase is _Phase.CLOSED:
                self.unclosed.discard(bell)
                self.fds -= 1
                continue
            self.watched.discard(bell)
            lane.watched -= 1
            if phase is _Phase.FIRED:
                if bell.phase is _Phase.FIRED:  # (its CLOSED report not in yet)
                    self.unclosed.add(bell)
                counters.fired += 1
                self._not_handed(bell)
                self.fds -= 1
                if lane.orphans:  # the functions enqueued before it ran
                    self._close_orphans(lane, idle=False)
            else:
                counters.retired += 1
                bell.entry = None  # (its waiters, and their event loop, may go now)
                lane.orphans.append(bell)
            if not lane.watched and not lane.orphans:
                self._release(lane)

    def _retire_abandoned(self) -> None:
        """Lock held: bells whose event loop was closed with its poller still
        running (``loop.close()`` without cancelling its tasks) are retired;
        the read end of one that fired is closed, if the loop was closed (a
        stop in the turn that handled the ring) before the turn that would."""
        for bell in list(self.watched):
            if bell.phase is _Phase.WATCHED and bell.loop_closed():
                bell.phase = _Phase.RETIRED
                self._reports.append((bell, _Phase.RETIRED))
        self._apply_reports()
        for bell in list(self.unclosed):
            if bell.phase is _Phase.FIRED and bell.loop_closed():
                bell.phase = _Phase.CLOSED  # (a closed loop runs no callback again)
                os.close(bell.rfd)
                self.unclosed.discard(bell)
                self.fds -= 1

    def sweep(self) -> None:
        """Settle the orphans of every lane, free the lanes found idle, retire
        those whose device faulted, and destroy the retired ones that have
        nothing left. One stream query per lane in use; never blocks."""
        with self.lock:
            self._sweep_locked(in_use=True)

    def close_handed_copies(self) -> None:
        """In a child made by ``fork()``: close its copies of the write ends
        handed to host functions, or the parent's bells could not ring while
        the child lives (end-of-file needs every copy closed). Only those still
        naming their pipe: never a descriptor the number was given to since.
        (The lock may have been held by another thread at the fork: not taken.)"""
        for wfd in list(self.handed):
            self._close_if_ours(wfd)


def never_closed() -> bool:
    """A ``loop_closed`` for what no closed loop can strand (trio ends its runs)."""
    return False


def _capturing(backend: Backend, key: Hashable) -> bool:
    """Whether the producer stream ``key`` captures (never arm there), or cannot
    be asked from this thread (another thread's per-thread default stream)."""
    if not isinstance(key, StreamId):
        return False  # a lone event: queried just before, which refuses a captured one
    if key.handle == PER_THREAD_DEFAULT_STREAM and key.thread != thread_serial():
        return True
    try:
        return backend.is_capturing(key.handle)
    except CudaError:  # the legacy stream while a blocking stream captures, say
        return True


_doorbell = _Doorbell()


def _after_fork_in_child() -> None:
    """The parent's lanes and bells are not this process's: close the copies
    that would hold the parent's bells back, and start afresh."""
    global _doorbell
    _doorbell.close_handed_copies()
    _doorbell = _Doorbell()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def stats() -> dict[str, int]:
    """The doorbell's counters, after a sweep (see ``cs.stats()``)."""
    _doorbell.sweep()
    return {
        "doorbells_armed": counters.armed,
        "doorbells_fired": counters.fired,
        "doorbells_retired": counters.retired,
        "doorbell_lanes": counters.lanes,
        "doorbell_fds": _doorbell.fds,
    }


def wants_doorbell(mode: WakeMode, backend: Backend) -> bool:
    """Whether the policy's wake mode rings bells on ``backend``, where it can."""
    if mode == "poll":
        return False
    return mode == "doorbell" or backend.name in AUTO_BACKENDS


class PollerBells:
    """One poller's side: arming its queues' heads, watching their read ends in
    its event loop, handing it the bells that fired, and the sleep between
    passes. Lives in the event loop's thread."""

    def __init__(self, rang: Callable[[list[Fired]], None]) -> None:
        #: the poller's handler of fired bells (called in the loop)
        self._poller_rang = rang
        self._watch: Callable[[_Bell], None] | None = None
        self._unwatch: Callable[[_Bell], None] = _no_unwatch
        self._watched: set[_Bell] = set()
        #: ends the sleep in progress (None: none is)
        self._wake: Callable[[], object] | None = None
        #: sleeps at most its argument; True if the time ran out
        self._napper: Callable[[float], Awaitable[bool]] | None = None
        #: the poller lets go of the GIL for another thread not before this
        #: (perf_counter): ``GIL_SHARE_EVERY`` after a sleep or a release, or
        #: ``GIL_SHARE_BACKOFF`` times as long as that release took (at most
        #: that many switch intervals)
        self._gil_share_at = 0.0
        self._woken = Woken.NO
        #: the next heads of streams whose bell rang: armed by the poller task
        #: in its next sleep, so that the waiters the ring woke resume first
        self._chained: list[tuple[Armable, Hashable]] = []
        #: the poller's sleep in progress: whether every pending stream has a
        #: bell (it sleeps ``fallback``: a ring need not wake it)
        self._nap = Nap.AWAKE
        #: a call of ``arm_chained`` is scheduled in the loop (asyncio, uvloop)
        self._arming_soon = False
        #: whether the loop can run a callback soon without a system call
        self._call_soon = False

    def _bind(self) -> Callable[[_Bell], None]:
        watch = self._watch
        if watch is None:
            if sniffio.current_async_library() == "trio":
                import trio

                def watch(bell: _Bell) -> None:
                    trio.lowlevel.spawn_system_task(
                        self._wait_readable, bell, name="cai_streams doorbell"
                    )

                self._unwatch = _trio_unwatch
            else:  # asyncio, uvloop
                self._call_soon = True
                # Only a weak reference: anyio keeps the poller in a RunVar keyed
                # weakly by the loop, which a strong one would keep alive forever.
                loop_ref = weakref.ref(asyncio.get_running_loop())

                def readable(bell: _Bell) -> None:
                    # Nothing is ever written to the pipe, so readable means
                    # end-of-file: the host function ran. Wake the waiters
                    # first; close the read end (a system call, which releases
                    # the GIL to the notifier stream's thread) after they resume.
                    entry = bell.entry
                    if bell.phase is _Phase.WATCHED and entry is not None:
                        try:
                            self._poller_rang([(entry, bell.key)])
                        finally:
                            later = asyncio.get_running_loop().call_soon  # in its loop
                            self._stop_watching(bell, _Phase.FIRED, later=later)

                def watch(bell: _Bell) -> None:
                    bell.loop_closed = functools.partial(loop_gone_or_closed, loop_ref)
                    asyncio.get_running_loop().add_reader(bell.rfd, readable, bell)

                def unwatch(bell: _Bell) -> None:
                    loop = loop_ref()
                    if loop is not None and not loop.is_closed():  # a closed loop watches nothing
                        loop.remove_reader(bell.rfd)

                self._unwatch = unwatch
            self._watch = watch
        return watch

    async def _wait_readable(self, bell: _Bell) -> None:
        """trio: a system task per bell (cancelled when the run ends)."""
        import trio

        try:
            if bell.phase is _Phase.WATCHED:  # never touch a read end closed meanwhile
                await trio.lowlevel.wait_readable(bell.rfd)  # end-of-file: it ran
                entry = bell.entry
                if bell.phase is _Phase.WATCHED and entry is not None:
                    try:
                        self._poller_rang([(entry, bell.key)])
                    finally:
                        self._stop_watching(bell, _Phase.FIRED)
        except trio.ClosedResourceError:
            pass  # retired: its read end was closed
        except Exception as exc:  # noqa: BLE001 - never out of a system task (it ends the run)
            warnings.warn(f"doorbell: {exc!r}", CudaWarning, stacklevel=1)
            self.wake_now()  # the poller's pass takes over
        finally:
            if bell.phase is _Phase.WATCHED:  # the run is ending
                self._retire(bell)

    def _retire(self, bell: _Bell) -> None:
        if bell.phase is not _Phase.WATCHED:  # a sweep retired it (its loop was closed):
            self._watched.discard(bell)  # its read end is the doorbell's, maybe closed
            return
        # it may have fired just now, its callback not yet run: say so
        self._stop_watching(bell, _Phase.FIRED if _has_fired(bell.rfd) else _Phase.RETIRED)

    def _stop_watching(
        self, bell: _Bell, phase: _Phase, later: Callable[..., object] | None = None
    ) -> None:
        """Account for ``bell`` now. Fired: close its read end now, or through
        ``later``. Retired: hand both ends to the doorbell, unwatched."""
        if bell.phase is not _Phase.WATCHED:
            return
        self._watched.discard(bell)
        if phase is _Phase.RETIRED:
            self._unwatch(bell)
        _doorbell.done(bell, phase)
        if phase is _Phase.FIRED:
            if later is None:
                self._close_read_end(bell)
            else:
                later(self._close_read_end, bell)

    def _close_read_end(self, bell: _Bell) -> None:
        if bell.phase is not _Phase.FIRED:  # (a sweep closed it: its loop was closed)
            return
        self._unwatch(bell)
        os.close(bell.rfd)
        _doorbell.done(bell, _Phase.CLOSED)

    def retire_for(self, entry: Armable) -> None:
        """Every waiter of ``entry`` left (cancelled, timed out): stop watching
        its bell. Its host function is still queued, so the doorbell keeps it
        as an orphan, which the next wait on the same record adopts: a waiter
        that keeps timing out on a long kernel holds one pipe, not one per wait
        (each bell left watched took two descriptors, until the doorbell's limit
        refused bells to every loop)."""
        for bell in [b for b in self._watched if b.entry is entry]:
            self._retire(bell)

    def retire_for_entries(self, entries: AbstractSet[Armable]) -> None:
        """A pass found these entries complete (or failed) before their bells
        rang: stop watching the bells. Most ring at once and are closed as
        they do; one whose host function will never run (its device was
        reset, which skipped it) is settled once its lane is found idle, not
        left watched, and counted against the descriptor limit, while the
        poller lives."""
        for bell in [b for b in self._watched if b.entry in entries]:
            self._retire(bell)

    def retire_all(self) -> None:
        """The poller ended: stop watching every bell still armed. Their host
        functions still close their write ends; nothing waits for that."""
        self._chained.clear()
        for bell in list(self._watched):
            self._retire(bell)

    def abandon(self) -> None:
        """The poller's event loop was closed under it: retire its bells and
        drop its sleep under way (whose future holds the loop)."""
        self.retire_all()
        self._wake = None
        self._woken = Woken.NO

    def wake_now(self, why: Woken = Woken.PASS) -> None:
        """End the current sleep between passes (or the next one) at once;
        ``Woken.RUNG``: only bells rang (unless a full pass was asked for too)."""
        if self._woken is not Woken.PASS:
            self._woken = why
        if self._wake is not None:
            self._wake()

    def rang(
        self, queues: Mapping[Hashable, Sequence[Armable]], mode: WakeMode, *, chained: bool
    ) -> None:
        """Bells rang, and the poller woke their waiters. ``chained``: every
        stream that rang has its next head chained, or nothing left. Then, while
        the poller sleeps its ``fallback`` because every stream has a bell, it
        sleeps on (a pass would query nothing: every other head rings for
        itself; the passes every ``fallback`` still come), and the chained heads
        are armed in the loop's next turn, after the waiters the ring woke
        (asyncio, uvloop). Otherwise the poller is woken for a pass."""
        if not (chained and self._nap is Nap.COVERED and self._call_soon):
            self.wake_now(Woken.RUNG)
        elif not self._arming_soon:
            self._arming_soon = True
            asyncio.get_running_loop().call_soon(self._arm_soon, queues, mode)

    def _arm_soon(self, queues: Mapping[Hashable, Sequence[Armable]], mode: WakeMode) -> None:
        self._arming_soon = False
        self.arm_chained(queues, mode)

    def arm_chained(self, queues: Mapping[Hashable, Sequence[Armable]], mode: WakeMode) -> None:
        """Arm the chained heads that are still their stream's oldest pending
        event (a refused one is retried once; one refused again asks for a pass)."""
        chained, self._chained = self._chained, []
        for entry, key in dict.fromkeys(chained):  # once each
            queue = queues.get(key)
            if queue and queue[0] is entry:  # still its stream's oldest pending event
                if entry.bell is BellState.REFUSED:  # no lane then (waiters came out of
                    entry.bell = BellState.UNARMED  # record order, say): try once more
                self.arm(entry, key, mode)

    def chain(self, entry: Armable, key: Hashable) -> None:
        """``entry`` became its stream's head when a bell rang there: arm it in
        the poller's next sleep. Arming makes system calls (a pipe, the
        selector, the notifier stream), and each one hands the GIL to whichever
        thread wants it; the waiters just woken should not wait behind them."""
        self._chained.append((entry, key))

    def arm(self, entry: Armable, key: Hashable, mode: WakeMode) -> None:
        """Arm a bell for ``entry`` (a queue's head) if the policy wants one."""
        if (
            entry.bell is not BellState.UNARMED
            or not entry.waiters
            or not wants_doorbell(mode, entry.backend)
        ):
            return
        watch = self._bind()
        bell = _doorbell.arm(entry, key)
        if bell is None:
            if _doorbell.deferred(entry.backend, key):
                return  # (unarmed: asked again when the poller next backs off)
            entry.bell = BellState.REFUSED
            self.wake_now()  # the poller's own cadence takes over
            return
        entry.bell = BellState.ARMED
        self._watched.add(bell)
        try:
            watch(bell)
        except BaseException:
            entry.bell = BellState.REFUSED  # not covered: the poller's cadence serves
            self._retire(bell)
            raise

    async def sleep(
        self,
        delay: float,
        queues: Mapping[Hashable, Sequence[Armable]],
        mode: WakeMode,
        cap: float,
        fallback: float,
    ) -> Woken:
        """Sleep ``delay``, or until a bell rings or a pass is asked for; say
        which (``Woken.PASS`` when the time ran out). A cancellation point.

        While passes keep finding completions (``delay`` below the policy's
        ``cap``), polling is cheaper than a bell per completion and as prompt;
        once the poller has backed off to ``cap``, every stream's oldest pending
        event gets a bell and the poller sleeps ``fallback`` instead. The next
        head of a stream whose bell rang gets one first, whatever ``delay``."""
        self.arm_chained(queues, mode)
        backed_off = delay >= cap
        covered = bool(queues)
        for key, queue in queues.items():
            if queue:
                head = queue[0]
                if backed_off:
                    self.arm(head, key, mode)
                covered = covered and head.bell is BellState.ARMED
        if covered:  # every stream rings for itself: a pass now finds nothing new
            delay = max(delay, fallback)
        woken: Woken = self._woken
        if delay <= 0 or woken is not Woken.NO:  # no sleep: a turn of the loop
            self.share_gil()
        if woken is Woken.NO:
            self._nap = Nap.COVERED if covered else Nap.POLLING
            try:
                timed_out = await (self._napper or self._bind_nap())(delay)
            finally:
                self._nap = Nap.AWAKE
                woken, self._woken = self._woken, Woken.NO
            if timed_out and delay > 0:  # it let go of the GIL meanwhile
                self._gil_share_at = time.perf_counter() + GIL_SHARE_EVERY
            # a pass that is due is a full one, whatever rang meanwhile
            return Woken.PASS if timed_out or woken is Woken.NO else woken
        self._woken = Woken.NO
        await anyio.lowlevel.checkpoint()
        return woken

    def share_gil(self) -> None:
        """Between passes that do not sleep: at most once every
        ``GIL_SHARE_EVERY``, let a thread waiting for the GIL take it. Blocks
        until the GIL comes back then (see ``GIL_SHARE_EVERY``)."""
        now = time.perf_counter()
        if now >= self._gil_share_at:
            gil_shares.count += 1
            time.sleep(0)
            end = time.perf_counter()
            took = min(end - now, sys.getswitchinterval())  # (a long C call: no longer)
            self._gil_share_at = end + max(GIL_SHARE_EVERY, GIL_SHARE_BACKOFF * took)

    def _bind_nap(self) -> Callable[[float], Awaitable[bool]]:
        """The event loop's own sleep that ``_wake`` ends early: a future and a
        timer under asyncio, a trio Event under a trio cancel scope. anyio's
        Event and ``move_on_after`` cost the loop several times more per
        sleep, and the poller sleeps once per pass."""
        if sniffio.current_async_library() == "trio":
            import trio

            async def nap(delay: float) -> bool:
                if delay <= 0:  # a turn of the loop (an Event under an expired
                    await trio.lowlevel.checkpoint()  # deadline costs three)
                    return self._woken is Woken.NO  # (a bell may ring meanwhile)
                event = trio.Event()
                self._wake = event.set
                try:
                    with trio.move_on_after(delay) as scope:
                        await event.wait()
                finally:
                    self._wake = None
                return scope.cancelled_caught

        else:  # asyncio, uvloop

            async def nap(delay: float) -> bool:
                loop = asyncio.get_running_loop()  # not kept: see _bind
                future: asyncio.Future[bool] = loop.create_future()
                self._wake = functools.partial(_resolve, future, False)
                timer = loop.call_later(delay, _resolve, future, True)
                try:
                    return await future
                finally:
                    timer.cancel()
                    self._wake = None

        self._napper = nap
        return nap


def loop_gone_or_closed(loop_ref: weakref.ref[asyncio.AbstractEventLoop]) -> bool:
    """Whether the asyncio loop ``loop_ref`` names was collected or closed."""
    loop = loop_ref()
    return loop is None or loop.is_closed()


def _resolve(future: asyncio.Future[bool], timed_out: bool) -> None:
    if not future.done():
        future.set_result(timed_out)


def _no_unwatch(bell: _Bell) -> None:
    """Before the poller is bound, nothing is watched."""


def _trio_unwatch(bell: _Bell) -> None:
    import trio

    trio.lowlevel.notify_closing(bell.rfd)  # its task wakes with ClosedResourceError
