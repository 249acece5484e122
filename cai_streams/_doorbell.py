"""The doorbell: the GPU wakes the poller, and no Python runs on a driver thread.

A bell is armed for a stream's oldest pending event: on a private notifier
stream (a *lane*) that first waits on the event, two host functions run libc's
``sem_post``, a C function already in the process: once on the lane's own
semaphore (which counts, exactly, the bells fired on that lane) and once on the
doorbell's semaphore. One daemon thread blocks in ``sem_timedwait`` on the
latter with the GIL released (ctypes releases it), collects what fired, and
hands each event loop its fired bells in one callback
(``call_soon_threadsafe`` under asyncio and uvloop, the trio token's
``run_sync_soon`` under trio). A fired bell means its event is complete, so
the poller wakes that event's waiters without a query, then makes one pass at
once for whatever else completed. A producer's stream never waits behind a
bell: only the lane does.

The poller stays in charge. Bells are armed when a waiter parks on an idle
stream and once the poller has backed off to its ``cap`` (while passes keep
finding completions, polling is as prompt and cheaper); while every pending
stream has one, the poller sleeps the policy's ``fallback`` between passes,
and those passes still find errors (a device that faulted runs no host
function again). A capturing stream never gets a bell, nor does anything when
there are no POSIX semaphores here or every lane is busy: the poller's own
cadence covers them.

A lane serves one producer stream at a time, so the bells of one stream fire
in record order and a slow stream never holds back another stream's bell.
Bells that can never fire (their device faulted) are retired by a sweep
(``stats()`` runs one; arming on a faulted device retires its lane too): a
lane found idle retires its bells that did not fire; a lane whose device
faulted is retired whole. ``armed == fired + retired`` once nothing is pending
and a sweep has run. A bell that fires late is harmless: the poller takes its
waiters only if they still wait, and a pass follows every ring.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import enum
import threading
import time
import warnings
from collections import deque
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
    "AUTO_LOOPS",
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
#: thread's sem_post, then one GIL hand-over) and is unverified on a GPU so far
AUTO_BACKENDS: Final = frozenset({"sim", "decoy", "cuda"})
#: notifier streams per (backend, device); beyond this a bell is refused
MAX_LANES: Final = 64
_SEM_BYTES: Final = 64  # sizeof(sem_t) is 32 on glibc x86-64 and aarch64, 16 words on musl


class BellState(enum.Enum):
    """Where an entry of the poller stands with the doorbell."""

    UNARMED = "unarmed"
    ARMED = "armed"
    #: could not be armed (capturing stream, no lane, no semaphores): the
    #: poller's own cadence covers it
    REFUSED = "refused"


class Armable(Protocol):
    """What the doorbell needs of a poller entry."""

    backend: Backend
    event: int
    bell: BellState


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Libc:
    """The POSIX semaphore calls, through ctypes (each releases the GIL)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        self.sem_init = libc.sem_init
        self.sem_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
        self.sem_trywait = libc.sem_trywait
        self.sem_trywait.argtypes = [ctypes.c_void_p]
        self.sem_timedwait = libc.sem_timedwait
        self.sem_timedwait.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Timespec)]
        self.sem_post = libc.sem_post
        self.sem_post.argtypes = [ctypes.c_void_p]
        #: the host function: ``int sem_post(sem_t *)`` called as ``void (*)(void *)``
        #: (the int result is ignored, which the x86-64 and aarch64 ABIs allow)
        self.post_address: int = ctypes.cast(libc.sem_post, ctypes.c_void_p).value or 0


class _Semaphore:
    """A ``sem_t`` in memory that lives as long as this object (kept while a
    post may still come: see ``_Doorbell.kept``)."""

    __slots__ = ("address", "buffer")

    def __init__(self, libc: _Libc) -> None:
        self.buffer = ctypes.create_string_buffer(_SEM_BYTES)
        self.address: int = ctypes.addressof(self.buffer)
        if libc.sem_init(self.address, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "sem_init failed")

    def take_all(self, libc: _Libc) -> int:
        """How many posts came since the last call (never blocks)."""
        n = 0
        while libc.sem_trywait(self.address) == 0:
            n += 1
        return n


#: a bell that fired: the poller's entry and its queue's key (its producer stream)
Fired = tuple[Armable, Hashable]


class Ring:
    """How an event loop hears of fired bells from the doorbell's thread:
    one callback scheduled in the loop for any number of bells."""

    __slots__ = ("_call", "_callback", "fired", "pending")

    def __init__(
        self, call: Callable[[Callable[[], None]], object], callback: Callable[[], None]
    ) -> None:
        self._call = call
        self._callback = callback
        self.fired: deque[Fired] = deque()  # appended by the thread, drained by the loop
        self.pending = False

    def ring(self, fired: list[Fired]) -> None:
        """Called on the doorbell's thread."""
        self.fired.extend(fired)
        if self.pending:
            return
        self.pending = True
        try:
            self._call(self._callback)
        except Exception:  # the loop has ended: nobody left to wake
            self.pending = False
            self.fired.clear()


class _Lane:
    """A notifier stream and the bells armed on it, in enqueue (firing) order."""

    __slots__ = ("appended", "backend", "bells", "gone", "key", "sem", "stream")

    def __init__(self, backend: Backend, stream: int, sem: _Semaphore) -> None:
        self.backend = backend
        self.stream = stream
        self.sem = sem
        self.bells: deque[tuple[Ring, Armable]] = deque()
        #: bells ever armed here, and ever popped (fired or retired)
        self.appended = 0
        self.gone = 0
        #: the producer stream it serves while bells are armed, else None (free)
        self.key: Hashable | None = None


class _Counters:
    __slots__ = ("armed", "fired", "lanes", "retired")

    def __init__(self) -> None:
        self.armed = 0
        self.fired = 0
        self.retired = 0
        self.lanes = 0


counters = _Counters()


class _Doorbell:
    """The process's doorbell: its semaphore, its thread, every lane."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.libc: _Libc | None = None
        self.sem: _Semaphore | None = None
        self.unavailable: str | None = None
        self.thread: threading.Thread | None = None
        self.stopping = False
        self.lanes: dict[tuple[Backend, int], list[_Lane]] = {}
        self.serving: dict[tuple[Backend, Hashable], _Lane] = {}
        #: semaphores of retired lanes: a late post must find live memory
        self.kept: list[_Semaphore] = []
        #: backends that cannot launch host functions: the poller alone serves them
        self.no_host_functions: set[Backend] = set()

    def available(self) -> bool:
        if self.sem is None and self.unavailable is None:
            try:
                self.libc = _Libc()
                self.sem = _Semaphore(self.libc)
            except (OSError, AttributeError) as exc:  # no POSIX semaphores (macOS, Windows)
                self.unavailable = f"{type(exc).__name__}: {exc}"
        return self.sem is not None

    def arm(self, entry: Armable, key: Hashable, ring: Ring) -> BellState:
        backend, event = entry.backend, entry.event
        if backend in self.no_host_functions or not self.available():
            return BellState.REFUSED
        if _capturing(backend, key):
            return BellState.REFUSED
        libc, sem = self.libc, self.sem
        assert libc is not None and sem is not None
        with self.lock:
            lane = self.serving.get((backend, key))
            if lane is None:
                lane = self._free_lane(backend, key)
                if lane is None:
                    return BellState.REFUSED
            try:
                backend.stream_wait_event(lane.stream, event)
                backend.launch_host_func(lane.stream, libc.post_address, lane.sem.address)
                lane.bells.append((ring, entry))
                lane.appended += 1
                counters.armed += 1
                backend.launch_host_func(lane.stream, libc.post_address, sem.address)
            except CudaError:  # a faulted device, say: the poller finds the error
                self._retire_lane(lane)
                return BellState.REFUSED
            except OSError:  # the driver library has no cuLaunchHostFunc here
                self.no_host_functions.add(backend)
                self._retire_lane(lane)
                return BellState.REFUSED
            self._start()
        return BellState.ARMED

    def _free_lane(self, backend: Backend, key: Hashable) -> _Lane | None:
        device = key.device if isinstance(key, StreamId) else backend.current_device()
        pool = self.lanes.setdefault((backend, device), [])
        lane = next((lane for lane in pool if lane.key is None), None)
        if lane is None:
            if len(pool) >= MAX_LANES:
                return None
            assert self.libc is not None
            try:
                stream = backend.create_stream(device)
            except CudaError:
                return None
            lane = _Lane(backend, stream, _Semaphore(self.libc))
            pool.append(lane)
            counters.lanes += 1
        lane.key = key
        self.serving[(backend, key)] = lane
        return lane

    def _release(self, lane: _Lane) -> None:
        """Lock held: ``lane`` has no bell left; another stream may use it."""
        if lane.key is not None:
            self.serving.pop((lane.backend, lane.key), None)
            lane.key = None

    def _retire_lane(self, lane: _Lane) -> None:
        """Lock held: its bells will never fire (its device faulted)."""
        counters.retired += len(lane.bells)
        lane.bells.clear()
        self._release(lane)
        for pool in self.lanes.values():
            if lane in pool:
                pool.remove(lane)
                counters.lanes -= 1
        self.kept.append(lane.sem)
        try:
            lane.backend.destroy_stream(lane.stream)
        except CudaError as exc:
            warnings.warn(
                f"leaked notifier stream {lane.stream:#x}: {exc}", CudaWarning, stacklevel=2
            )

    def _fired(self, lane: _Lane, rings: dict[Ring, list[Fired]]) -> None:
        """Lock held: pop the bells of ``lane`` that fired since the last look."""
        assert self.libc is not None
        n = min(lane.sem.take_all(self.libc), len(lane.bells))
        for _ in range(n):
            ring, entry = lane.bells.popleft()
            rings.setdefault(ring, []).append((entry, lane.key))
        lane.gone += n
        counters.fired += n
        if not lane.bells:
            self._release(lane)

    # -- the thread ------------------------------------------------------------------

    def _start(self) -> None:
        """Lock held."""
        if self.thread is None:
            self.thread = threading.Thread(
                target=self._run, name="cai_streams doorbell", daemon=True
            )
            self.thread.start()

    def _run(self) -> None:
        libc, sem = self.libc, self.sem
        assert libc is not None and sem is not None
        deadline = _Timespec()
        while not self.stopping:
            now = time.time() + 1.0  # bounded, so that exit never waits on it
            deadline.tv_sec, deadline.tv_nsec = int(now), int(now % 1 * 1e9)
            if libc.sem_timedwait(sem.address, ctypes.byref(deadline)) != 0:
                continue  # timed out, or interrupted
            sem.take_all(libc)  # coalesce: one look covers every post so far
            rings: dict[Ring, list[Fired]] = {}
            with self.lock:
                for pool in self.lanes.values():
                    for lane in pool:
                        if lane.bells:
                            self._fired(lane, rings)
            for ring, fired in rings.items():
                ring.ring(fired)

    def stop(self) -> None:
        self.stopping = True
        thread, sem, libc = self.thread, self.sem, self.libc
        if thread is not None and sem is not None and libc is not None:
            libc.sem_post(sem.address)
            thread.join(2.0)

    # -- the sweep -------------------------------------------------------------------

    def sweep(self) -> None:
        """Account for bells that can no longer fire. Makes one stream query per
        lane with bells armed; never blocks."""
        with self.lock:
            busy = [
                (lane, lane.appended) for pool in self.lanes.values() for lane in pool if lane.bells
            ]
        rings: dict[Ring, list[Fired]] = {}
        for lane, cutoff in busy:
            try:
                with relaxed(lane.backend):  # never invalidates another thread's capture
                    idle = lane.backend.query_stream(lane.stream)
            except CudaError:  # its device faulted: no host function runs there again
                with self.lock:
                    self._retire_lane(lane)
                continue
            if not idle:
                continue
            with self.lock:
                self._fired(lane, rings)
                # every bell armed before the query has run, or never will
                lost = min(len(lane.bells), max(0, cutoff - lane.gone))
                for _ in range(lost):
                    lane.bells.popleft()
                lane.gone += lost
                counters.retired += lost
                if not lane.bells:
                    self._release(lane)
        for ring, fired in rings.items():
            ring.ring(fired)


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
atexit.register(_doorbell.stop)


def stats() -> dict[str, int]:
    """The doorbell's counters, after a sweep (see ``cs.stats()``)."""
    _doorbell.sweep()
    return {
        "doorbells_armed": counters.armed,
        "doorbells_fired": counters.fired,
        "doorbells_retired": counters.retired,
        "doorbell_lanes": counters.lanes,
    }


#: event loops where "auto" rings bells. Under trio the benchmarks on the
#: simulator showed a worse p99 wake with bells than polling alone at 100 and
#: 1,000 waiters (docs/performance.md), so "auto" polls there
AUTO_LOOPS: Final = frozenset({"asyncio"})


def wants_doorbell(mode: WakeMode, backend: Backend, library: str) -> bool:
    """Whether the policy's wake mode rings bells on ``backend`` under the
    async ``library`` (sniffio's name), where it can."""
    if mode == "poll":
        return False
    return mode == "doorbell" or (backend.name in AUTO_BACKENDS and library in AUTO_LOOPS)


class PollerBells:
    """One poller's side: arming its queues' heads, handing it the bells that
    fired, and the sleep between passes. Lives in the event loop's thread."""

    def __init__(self, rang: Callable[[list[Fired]], None]) -> None:
        #: the poller's handler of fired bells (called in the loop)
        self._poller_rang = rang
        self._ring: Ring | None = None
        self._library = ""  # the event loop's async library, known once bound
        self._wake: anyio.Event | None = None
        self._rung = False

    def _bound(self) -> Ring:
        ring = self._ring
        if ring is None:
            call: Callable[[Callable[[], None]], object]
            self._library = sniffio.current_async_library()
            if self._library == "trio":
                import trio

                call = trio.lowlevel.current_trio_token().run_sync_soon
            else:  # asyncio, uvloop
                import asyncio

                call = asyncio.get_running_loop().call_soon_threadsafe
            ring = self._ring = Ring(call, self._rang)
        return ring

    def _rang(self) -> None:
        """In the loop's thread: bells fired."""
        ring = self._ring
        if ring is None:
            return
        ring.pending = False
        fired = []
        while ring.fired:
            fired.append(ring.fired.popleft())
        if fired:
            self._poller_rang(fired)

    def wake_now(self) -> None:
        """End the current sleep between passes (or the next one) at once."""
        self._rung = True
        if self._wake is not None:
            self._wake.set()

    def arm(self, entry: Armable, key: Hashable, mode: WakeMode) -> None:
        """Arm a bell for ``entry`` (a queue's head) if the policy wants one."""
        if entry.bell is not BellState.UNARMED:
            return
        ring = self._bound()
        if not wants_doorbell(mode, entry.backend, self._library):
            return
        entry.bell = _doorbell.arm(entry, key, ring)
        if entry.bell is BellState.REFUSED:
            self.wake_now()  # the poller's own cadence takes over

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
