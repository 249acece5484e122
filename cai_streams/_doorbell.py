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
a query, then makes one pass at once for whatever else completed. A
producer's stream never waits behind a bell: only the lane does.

The poller stays in charge. Bells are armed when a waiter parks on an idle
stream and once the poller has backed off to its ``cap`` (while passes keep
finding completions, polling is as prompt and cheaper); while every pending
stream has one, the poller sleeps the policy's ``fallback`` between passes,
and those passes still find errors (a device that faulted runs no host
function again). A capturing stream never gets a bell, nor does anything when
the platform has no pipes and no ``close`` to call, or every lane is busy: the
poller's own cadence covers them.

Descriptors: the library closes a bell's read end when it fires or when its
poller ends first (the bell is *retired*; ``armed == fired + retired`` once no
poller runs). It never closes a write end that it handed to a host function:
that number belongs to the driver until the function runs, so it can never
close a descriptor someone else was given meanwhile. A bell armed on a device
that then faults therefore keeps its write end open for the life of the
process (a faulted CUDA context is unusable anyway). The doorbell holds at
most ``MAX_FDS`` descriptors (``stats()["doorbell_fds"]``): beyond that,
bells are refused and the poller's cadence serves.

A lane serves one producer stream at a time, so a slow stream never holds
back another stream's bell, and its bells are enqueued in record order: a
bell for an event recorded before one already belled there (its waiter came
later) takes another lane rather than wait behind it. A lane is free again
once its bells fired, or once a query finds it idle (a retired bell's
function may still be queued there); a lane whose device faulted is retired
whole (``stats()`` sweeps; arming there retires it too).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import os
import threading
import warnings
from collections.abc import Callable, Hashable, Mapping, Sequence
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
]

#: how a waiter is woken: by a bell where one can be armed ("doorbell"), by
#: polling only ("poll"), or whichever is best on the backend in use ("auto")
WakeMode = Literal["auto", "doorbell", "poll"]
WAKE_MODES: Final[tuple[WakeMode, ...]] = ("auto", "doorbell", "poll")
#: backends where "auto" rings bells: on the simulator the benchmarks show it
#: best (docs/performance.md); on cuda it follows from the design (a driver
#: thread's close(), then the loop's own selector) and is unverified on a GPU so far
AUTO_BACKENDS: Final = frozenset({"sim", "decoy", "cuda"})
#: notifier streams per (backend, device); beyond this a bell is refused
MAX_LANES: Final = 64
#: file descriptors the doorbell holds at most (two per armed bell; a retired
#: bell's write end until its lane is found idle); beyond this a bell is refused
MAX_FDS: Final = 256


class BellState(enum.Enum):
    """Where an entry of the poller stands with the doorbell."""

    UNARMED = "unarmed"
    ARMED = "armed"
    #: could not be armed (capturing stream, no lane, no pipes): the poller's
    #: own cadence covers it
    REFUSED = "refused"


class Armable(Protocol):
    """What the doorbell needs of a poller entry."""

    backend: Backend
    event: int
    #: its place in its stream's record order (-1: a lone event)
    seq: int
    bell: BellState


class _Phase(enum.Enum):
    """Where one bell stands: the loop watches its read end until it fires or
    its poller stops watching first."""

    WATCHED = "watched"
    FIRED = "fired"
    RETIRED = "retired"


class _Lane:
    """A notifier stream, and how many of its bells may still fire."""

    __slots__ = ("backend", "key", "stream", "tail", "unsure", "watched")

    def __init__(self, backend: Backend, stream: int) -> None:
        self.backend = backend
        self.stream = stream
        #: the record-order place of the last bell enqueued here: a bell for
        #: an earlier event must not wait behind it, so it takes another lane
        self.tail = -1
        #: bells armed here that the loops still watch
        self.watched = 0
        #: retired bells whose host functions may still be queued here (their
        #: write ends still open): free only once a query finds the lane idle
        self.unsure = 0
        #: the producer stream it serves, else None (free)
        self.key: Hashable | None = None


class _Bell:
    """One armed bell: the read end of its pipe, for the entry it was armed for."""

    __slots__ = ("entry", "key", "lane", "phase", "rfd")

    def __init__(self, entry: Armable, key: Hashable, lane: _Lane, rfd: int) -> None:
        self.entry = entry
        self.key = key
        self.lane = lane
        self.rfd = rfd
        self.phase = _Phase.WATCHED


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
        self.lanes: dict[tuple[Backend, int], list[_Lane]] = {}
        #: the lanes serving each producer stream (more than one only when
        #: waiters arrived out of record order)
        self.serving: dict[tuple[Backend, Hashable], list[_Lane]] = {}
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
            if self.fds + 2 > MAX_FDS:
                self._reclaim_fds()
                if self.fds + 2 > MAX_FDS:
                    return None  # the poller's cadence covers it
            try:
                rfd, wfd = _pipe()
            except OSError:  # out of descriptors, say
                return None
            self.fds += 2
            lane = self._lane_for(backend, key, entry.seq)
            if lane is not None:
                try:
                    backend.stream_wait_event(lane.stream, event)
                    backend.launch_host_func(lane.stream, close, wfd)
                except CudaError:  # a faulted device, say: the poller finds the error
                    self._retire_lane(lane)
                    lane = None
                except OSError:  # the driver library has no cuLaunchHostFunc here
                    self.no_host_functions.add(backend)
                    self._retire_lane(lane)
                    lane = None
                else:  # from here on the write end is the driver's to close
                    lane.watched += 1
                    lane.tail = entry.seq
                    counters.armed += 1
                    return _Bell(entry, key, lane, rfd)
            self.fds -= 2
        os.close(rfd)  # never handed over: both ends are still ours
        os.close(wfd)
        return None

    def _lane_for(self, backend: Backend, key: Hashable, seq: int) -> _Lane | None:
        """Lock held: a lane of ``key`` where nothing later in its record order
        is queued, else a free one."""
        for lane in self.serving.get((backend, key), ()):
            if lane.tail <= seq:
                return lane
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
        and that a query finds idle (their host functions ran), so that a
        service making a stream per request never runs out of lanes."""
        for lane in pool:
            if lane.unsure and not lane.watched and self._idle(lane):
                self._drained(lane)
                return lane
        return None

    def _reclaim_fds(self) -> None:
        """Lock held: count the write ends of retired bells closed where a
        query finds their lane idle (waiters that keep timing out on a long
        kernel leave one per wait)."""
        for pool in self.lanes.values():
            for lane in pool:
                if lane.unsure and self._idle(lane):
                    self._drained(lane)

    @staticmethod
    def _idle(lane: _Lane) -> bool:
        """Whether every host function enqueued on ``lane`` has run. Never blocks."""
        try:
            with relaxed(lane.backend):  # never invalidates another thread's capture
                return lane.backend.query_stream(lane.stream)
        except CudaError:  # its device faulted: they never will
            return False

    def _drained(self, lane: _Lane) -> None:
        """Lock held: a query found ``lane`` idle, so its retired bells' write
        ends are closed; free it if no bell is watched there."""
        self.fds -= lane.unsure
        lane.unsure = 0
        if not lane.watched:
            self._release(lane)

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
        """Lock held: its device faulted; its bells will never fire, and the
        write ends of its retired bells stay open (and counted) for good."""
        self._release(lane)
        for pool in self.lanes.values():
            if lane in pool:
                pool.remove(lane)
                counters.lanes -= 1
        try:
            lane.backend.destroy_stream(lane.stream)
        except CudaError as exc:
            warnings.warn(
                f"leaked notifier stream {lane.stream:#x}: {exc}", CudaWarning, stacklevel=2
            )

    def done(self, bell: _Bell, phase: _Phase) -> None:
        """The loop stopped watching ``bell``: it fired (both ends closed), or
        was retired (its read end closed; its write end not known to be)."""
        bell.phase = phase
        with self.lock:
            lane = bell.lane
            lane.watched -= 1
            if phase is _Phase.FIRED:
                counters.fired += 1
                self.fds -= 2
            else:
                counters.retired += 1
                self.fds -= 1
                lane.unsure += 1
            if not lane.watched and not lane.unsure:
                self._release(lane)

    def sweep(self) -> None:
        """Free the lanes found idle whose bells all stopped being watched, and
        retire those whose device faulted. One stream query per busy lane;
        never blocks."""
        with self.lock:
            busy = [
                lane
                for pool in self.lanes.values()
                for lane in pool
                if lane.key is not None or lane.unsure
            ]
        for lane in busy:
            try:
                with relaxed(lane.backend):  # never invalidates another thread's capture
                    idle = lane.backend.query_stream(lane.stream)
            except CudaError:  # its device faulted: no host function runs there again
                with self.lock:
                    self._retire_lane(lane)
                continue
            if idle:
                with self.lock:
                    self._drained(lane)


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
        self._wake: anyio.Event | None = None
        self._rung = False

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
                import asyncio

                loop = asyncio.get_running_loop()

                def readable(bell: _Bell) -> None:
                    # Nothing is ever written to the pipe, so readable means
                    # end-of-file: the host function ran. Wake the waiters
                    # first, then make the system calls (each releases the
                    # GIL, which the notifier stream's thread would take)
                    # after they have resumed.
                    if bell.phase is _Phase.WATCHED:
                        self._poller_rang([(bell.entry, bell.key)])
                        self._stop_watching(bell, _Phase.FIRED, later=loop.call_soon)

                def watch(bell: _Bell) -> None:
                    loop.add_reader(bell.rfd, readable, bell)

                def unwatch(bell: _Bell) -> None:
                    if not loop.is_closed():  # a closed loop watches nothing
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
                if bell.phase is _Phase.WATCHED:
                    self._poller_rang([(bell.entry, bell.key)])
                    self._stop_watching(bell, _Phase.FIRED)
        except trio.ClosedResourceError:
            pass  # retired: its read end was closed
        finally:
            if bell.phase is _Phase.WATCHED:  # the run is ending
                self._retire(bell)

    def _retire(self, bell: _Bell) -> None:
        # it may have fired just now, its callback not yet run: say so
        self._stop_watching(bell, _Phase.FIRED if _has_fired(bell.rfd) else _Phase.RETIRED)

    def _stop_watching(
        self, bell: _Bell, phase: _Phase, later: Callable[..., object] | None = None
    ) -> None:
        """Account for ``bell`` now; close its read end now, or through ``later``."""
        if bell.phase is not _Phase.WATCHED:
            return
        _doorbell.done(bell, phase)
        self._watched.discard(bell)
        if later is None:
            self._close_read_end(bell)
        else:
            later(self._close_read_end, bell)

    def _close_read_end(self, bell: _Bell) -> None:
        self._unwatch(bell)
        os.close(bell.rfd)

    def retire_all(self) -> None:
        """The poller ended: stop watching every bell still armed. Their host
        functions still close their write ends; nothing waits for that."""
        for bell in list(self._watched):
            self._retire(bell)

    def wake_now(self) -> None:
        """End the current sleep between passes (or the next one) at once."""
        self._rung = True
        if self._wake is not None:
            self._wake.set()

    def arm(self, entry: Armable, key: Hashable, mode: WakeMode) -> None:
        """Arm a bell for ``entry`` (a queue's head) if the policy wants one."""
        if entry.bell is not BellState.UNARMED or not wants_doorbell(mode, entry.backend):
            return
        watch = self._bind()
        bell = _doorbell.arm(entry, key)
        if bell is None:
            entry.bell = BellState.REFUSED
            self.wake_now()  # the poller's own cadence takes over
            return
        entry.bell = BellState.ARMED
        self._watched.add(bell)
        try:
            watch(bell)
        except BaseException:
            self._retire(bell)
            raise

    async def sleep(
        self,
        delay: float,
        queues: Mapping[Hashable, Sequence[Armable]],
        mode: WakeMode,
        cap: float,
        fallback: float,
    ) -> None:
        """Sleep ``delay``, or until a bell rings. A cancellation point.

        While passes keep finding completions (``delay`` below the policy's
        ``cap``), polling is cheaper than a bell per completion and as prompt;
        once the poller has backed off to ``cap``, every stream's oldest pending
        event gets a bell and the poller sleeps ``fallback`` instead."""
        if delay >= cap:
            covered = bool(queues)
            for key, queue in queues.items():
                if queue:
                    head = queue[0]
                    self.arm(head, key, mode)
                    covered = covered and head.bell is BellState.ARMED
            if covered:
                delay = max(delay, fallback)
        if self._rung:
            self._rung = False
            await anyio.lowlevel.checkpoint()
            return
        self._wake = wake = anyio.Event()
        try:
            with anyio.move_on_after(delay):
                await wake.wait()
        finally:
            self._wake = None
            self._rung = False


def _no_unwatch(bell: _Bell) -> None:
    """Before the poller is bound, nothing is watched."""


def _trio_unwatch(bell: _Bell) -> None:
    import trio

    trio.lowlevel.notify_closing(bell.rfd)  # its task wakes with ClosedResourceError
