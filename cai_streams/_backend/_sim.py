"""The simulated device: streams are worker threads draining FIFOs.

Ordering rules modelled (CUDA's, for what this library relies on):

* Work on one stream runs in FIFO order, one operation at a time, on that
  stream's own worker thread; host calls only enqueue and return.
* ``record`` puts a marker in the FIFO; the event is complete once every
  operation enqueued before the marker has run. Re-recording moves the event.
* ``stream_wait_event`` captures the event's latest record at call time and
  blocks the waiting stream's worker until that marker is reached. An event
  never recorded makes the wait a no-op.
* Streams made by ``create_stream`` are non-blocking: they never synchronize
  implicitly with anything. Handle 1 is the legacy default stream, handle 2 the
  per-thread default stream (one per host thread, made on first use). Per-thread
  default streams are blocking streams, so the legacy stream's implicit
  synchronization applies between them: an operation on stream 1 waits for all
  earlier work on every per-thread default stream, and an operation on a
  per-thread default stream waits for all earlier work on stream 1.
* Kernels really run (Python callables over numpy views of device memory), after
  their ``duration`` plus a seeded random jitter, so a missing wait gives wrong data.

Error rule: a kernel that raises leaves its stream in error. The next
``synchronize_stream`` of that stream raises :class:`KernelError` (and clears the
error); every event recorded on it after the failure and before that
synchronization raises it from ``query`` and ``synchronize_event``, forever.
Later kernels on the stream still run. Errors do not cross streams through waits.
Memory is host RAM allocated by this module with real, 256-byte aligned pointers.
"""

from __future__ import annotations

import bisect
import itertools
import os
import random
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, Final

import numpy as np

from .._errors import CudaError, KernelError
from . import LEGACY_DEFAULT_STREAM, PER_THREAD_DEFAULT_STREAM, Backend

__all__ = ["DecoyBackend", "SimBackend"]

#: default upper bound of the random delay added to each kernel, in seconds
DEFAULT_JITTER: Final = 0.0005
_ALIGN: Final = 256
_INVALID_HANDLE: Final = (400, "cudaErrorInvalidResourceHandle")


def _invalid(kind: str, handle: int) -> CudaError:
    code, name = _INVALID_HANDLE
    return CudaError(code, name, f"no simulated {kind} has handle {handle:#x}")


class _Point:
    """A position in one stream's FIFO; set once every earlier operation ran."""

    __slots__ = ("done", "error", "stream")

    def __init__(self, stream: int) -> None:
        self.done = threading.Event()
        self.error: KernelError | None = None
        self.stream = stream


def _raise_copy(err: KernelError) -> None:
    # A fresh instance per raise: tracebacks are not shared between threads.
    raise KernelError(err.kernel, err.stream, err.__cause__ or err)


_Op = tuple[Any, ...]


class _SimStream:
    """One stream: a FIFO of operations and the worker thread that drains it."""

    def __init__(self, backend: SimBackend, handle: int, blocking: bool, seed: str) -> None:
        self.handle = handle
        self.blocking = blocking
        self._backend = backend
        self._ops: deque[_Op] = deque()
        self._cv = threading.Condition(threading.Lock())
        self._closed = False
        self._error: KernelError | None = None
        self._rng = random.Random(seed)
        self._thread = threading.Thread(
            target=self._run, name=f"cai-streams-{backend.name}-{handle:#x}", daemon=True
        )
        self._thread.start()

    def push(self, op: _Op) -> None:
        with self._cv:
            if self._closed:
                raise _invalid("stream (destroyed)", self.handle)
            self._ops.append(op)
            self._cv.notify()

    def mark(self) -> _Point:
        point = _Point(self.handle)
        self.push(("mark", point))
        return point

    def take_error(self, point: _Point) -> KernelError | None:
        """The error a synchronization reaching ``point`` reports; clears it."""
        with self._cv:
            if point.error is not None and self._error is point.error:
                self._error = None
        return point.error

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._ops and not self._closed:
                    self._cv.wait()
                if not self._ops:
                    return
                op = self._ops.popleft()
            kind = op[0]
            if kind == "kernel":
                self._run_kernel(op[1], op[2], op[3])
            elif kind == "mark":
                point: _Point = op[1]
                with self._cv:
                    point.error = self._error
                point.done.set()
            elif kind == "wait":
                waited: _Point = op[1]
                while not waited.done.wait(0.05):
                    if self._backend.closing:
                        return
            # An idle worker must not keep the last kernel's arrays alive.
            del op

    def _run_kernel(self, fn: Callable[[], object], name: str, duration: float) -> None:
        hooks = kernel_hooks
        start = time.perf_counter() if hooks else 0.0
        delay = duration
        jitter = self._backend.jitter
        if jitter > 0:
            delay += self._rng.uniform(0.0, jitter)
        if delay > 0:
            time.sleep(delay)
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - a kernel failure is data, not a crash
            with self._cv:
                if self._error is None:
                    self._error = KernelError(name, self.handle, exc)
        if hooks:
            end = time.perf_counter()
            for hook in hooks:
                hook(self.handle, name, start, end)


#: called with (start, end) of every block freed (the sanitizer forgets it)
free_hooks: list[Callable[[int, int], None]] = []
#: called on the stream's worker with (stream, kernel name, start, end) in
#: ``time.perf_counter()`` seconds after every kernel (the tracer records it)
kernel_hooks: list[Callable[[int, str, float, float], None]] = []


class _Allocations:
    """Device memory: host buffers found again by pointer."""

    def __init__(self) -> None:
        # Re-entrant: the weakref callback that frees a block can run from a
        # garbage collection triggered while this very thread holds the lock.
        self._lock = threading.RLock()
        self._starts: list[int] = []
        self._blocks: dict[int, tuple[int, weakref.ref[np.ndarray[Any, Any]]]] = {}

    def allocate(self, nbytes: int) -> tuple[int, np.ndarray[Any, Any]]:
        if nbytes == 0:
            return 0, np.empty(0, dtype=np.uint8)
        raw = np.empty(nbytes + _ALIGN, dtype=np.uint8)
        offset = (-raw.ctypes.data) % _ALIGN
        block = raw[offset : offset + nbytes]
        ptr = int(block.ctypes.data)
        # Every numpy view of ``block`` has ``raw`` as its base (numpy collapses
        # view chains), so ``raw`` is what lives exactly as long as the arrays.
        with self._lock:
            bisect.insort(self._starts, ptr)
            self._blocks[ptr] = (nbytes, weakref.ref(raw, lambda _r: self._free(ptr)))
        return ptr, block

    def _free(self, ptr: int) -> None:
        with self._lock:
            found = self._blocks.pop(ptr, None)
            if found is not None:
                del self._starts[bisect.bisect_left(self._starts, ptr)]
        if found is not None:
            for hook in free_hooks:
                hook(ptr, ptr + found[0])

    def find(self, ptr: int, nbytes: int) -> tuple[np.ndarray[Any, Any], int] | None:
        """The live block holding ``[ptr, ptr + nbytes)`` and the offset into it."""
        with self._lock:
            i = bisect.bisect_right(self._starts, ptr) - 1
            if i < 0:
                return None
            start = self._starts[i]
            size, ref = self._blocks[start]
            raw = ref()
        if raw is None or ptr + nbytes > start + size:
            return None
        offset = start - int(raw.ctypes.data)
        return raw[offset : offset + size], ptr - start


class SimBackend(Backend):
    """A faithful simulated CUDA device (see the module docstring for the rules)."""

    name = "sim"
    #: the first stream or event handle (a decoy's never collide with the simulator's)
    first_handle: int = 0x7F00_0000_1000

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None

    def __init__(self, *, seed: int | None = None, jitter: float | None = None) -> None:
        env_seed = os.environ.get("CAI_STREAMS_SIM_SEED", "").strip()
        if seed is None:
            seed = int(env_seed) if env_seed else random.SystemRandom().randrange(2**32)
        if jitter is None:
            env_jitter = os.environ.get("CAI_STREAMS_SIM_JITTER", "").strip()
            jitter = float(env_jitter) if env_jitter else DEFAULT_JITTER
        #: the seed of every stream's jitter sequence
        self.seed: int = seed
        #: upper bound, in seconds, of the random delay added to each kernel
        self.jitter: float = float(jitter)
        self.closing = False
        self.memory = _Allocations()
        # Re-entrant: Stream/Event destructors call back into the backend and can
        # run from a garbage collection on a thread that already holds the lock.
        self._lock = threading.RLock()
        self._handles = itertools.count(self.first_handle, 0x200)
        self._ordinals = itertools.count()
        self._streams: dict[int, _SimStream] = {}
        self._events: dict[int, list[_Point | None]] = {}
        self._per_thread = threading.local()
        self._blocking: weakref.WeakSet[_SimStream] = weakref.WeakSet()
        self._all_per_thread: list[_SimStream] = []
        self._legacy = self._new_stream(LEGACY_DEFAULT_STREAM, blocking=True)

    # -- streams ---------------------------------------------------------------

    def _new_stream(self, handle: int, *, blocking: bool) -> _SimStream:
        return _SimStream(self, handle, blocking, f"{self.seed}:{next(self._ordinals)}")

    def _resolve(self, handle: int) -> _SimStream:
        if handle == LEGACY_DEFAULT_STREAM:
            return self._legacy
        if handle == PER_THREAD_DEFAULT_STREAM:
            stream: _SimStream | None = getattr(self._per_thread, "stream", None)
            if stream is None:
                stream = self._new_stream(PER_THREAD_DEFAULT_STREAM, blocking=True)
                self._per_thread.stream = stream
                with self._lock:
                    self._blocking.add(stream)
                    self._all_per_thread.append(stream)
            return stream
        found = self._streams.get(handle)
        if found is None:
            raise _invalid("stream", handle)
        return found

    def _enqueue(self, handle: int, op: _Op) -> None:
        stream = self._resolve(handle)
        if stream is self._legacy:
            with self._lock:
                others = list(self._blocking)
            for other in others:
                stream.push(("wait", other.mark()))
        elif stream.blocking:
            stream.push(("wait", self._legacy.mark()))
        stream.push(op)

    def create_stream(self) -> int:
        handle = next(self._handles)
        stream = self._new_stream(handle, blocking=False)  # starts a thread: not under the lock
        with self._lock:
            self._streams[handle] = stream
        return handle

    def destroy_stream(self, stream: int) -> None:
        with self._lock:
            found = self._streams.pop(stream, None)
        if found is None:
            raise _invalid("stream", stream)
        found.close()

    def is_stream(self, stream: int) -> bool:
        return stream in (LEGACY_DEFAULT_STREAM, PER_THREAD_DEFAULT_STREAM) or (
            stream in self._streams
        )

    def launch(self, stream: int, fn: Callable[[], object], name: str, duration: float) -> None:
        """Enqueue ``fn`` on ``stream``; it runs on the stream's worker thread."""
        self._enqueue(stream, ("kernel", fn, name, duration))

    def synchronize_stream(self, stream: int) -> None:
        target = self._resolve(stream)
        point = _Point(target.handle)
        self._enqueue(stream, ("mark", point))
        point.done.wait()
        err = target.take_error(point)
        if err is not None:
            _raise_copy(err)

    # -- events ----------------------------------------------------------------

    def create_event(self) -> int:
        handle = next(self._handles)
        with self._lock:
            self._events[handle] = [None]
        return handle

    def destroy_event(self, event: int) -> None:
        with self._lock:
            if self._events.pop(event, None) is None:
                raise _invalid("event", event)

    def _slot(self, event: int) -> list[_Point | None]:
        slot = self._events.get(event)
        if slot is None:
            raise _invalid("event", event)
        return slot

    def record(self, event: int, stream: int) -> None:
        slot = self._slot(event)
        point = _Point(stream)
        self._enqueue(stream, ("mark", point))
        slot[0] = point

    def query(self, event: int) -> bool:
        point = self._slot(event)[0]
        if point is None:
            return True
        if not point.done.is_set():
            return False
        if point.error is not None:
            _raise_copy(point.error)
        return True

    def synchronize_event(self, event: int) -> None:
        point = self._slot(event)[0]
        if point is None:
            return
        point.done.wait()
        if point.error is not None:
            _raise_copy(point.error)

    def stream_wait_event(self, stream: int, event: int) -> None:
        point = self._slot(event)[0]
        self._resolve(stream)
        if point is not None:
            self._enqueue(stream, ("wait", point))

    def current_device(self) -> int:
        return 0

    def close(self) -> None:
        """Stop every worker after it drains its FIFO (bounded wait)."""
        self.closing = True
        locked = self._lock.acquire(timeout=2.0)  # bounded even if a thread is stuck
        try:
            streams = [self._legacy, *self._streams.values(), *self._all_per_thread]
        finally:
            if locked:
                self._lock.release()
        for stream in streams:
            stream.close()
        deadline = time.monotonic() + 2.0
        for stream in streams:
            stream.join(max(0.0, deadline - time.monotonic()))


class DecoyBackend(SimBackend):
    """The simulator under another name, for testing that code never assumes the
    default backend is the simulator.

    ``CAI_STREAMS_SIM_DECOY=1`` makes it the default backend, chosen where a GPU
    machine chooses ``cuda``. Its streams and events follow every rule above, but
    it is not the simulated device: :func:`cai_streams.sim.launch` and
    ``SimArray.to_host`` refuse its streams, as they refuse cuda streams, and its
    handles never name a simulator stream. Code that makes streams on the default
    backend and then runs simulated kernels therefore fails under it on a CPU,
    as it would on every GPU machine; code that selects ``sim`` (``use_backend``,
    ``sim.simulated``, the ``cai_sim`` fixture) runs unchanged.
    """

    name = "decoy"
    first_handle = 0x7E00_0000_1000
