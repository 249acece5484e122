"""The simulated device's objects: devices, streams, events, handles.

A stream is a FIFO of operations and a worker thread (started when the
stream is made; a device's legacy stream's on first use) that runs them one at
a time: kernels (Python callables, after their duration and a seeded jitter),
marks (a point later work or the host can wait for), waits (block this worker
until another stream's mark is reached), host functions (a C function called
through ctypes, as a driver thread calls it) and graph replays. A device holds its
legacy stream, the blocking per-thread default streams of live host threads,
and its sticky fault.
"""

from __future__ import annotations

import ctypes
import itertools
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from .._errors import CudaError, KernelError

if TYPE_CHECKING:
    from ._sim import SimBackend
    from ._sim_graph import Capture, GraphExec

__all__ = ["Device", "Handles", "Point", "SimEvent", "SimStream", "kernel_hooks", "sim_error"]

#: called on the stream's worker with (stream, kernel name, start, end) in
#: ``time.perf_counter()`` seconds after every kernel (the tracer records it)
kernel_hooks: list[Callable[[int, str, float, float], None]] = []

_NAMES: Final = {
    1: "cudaErrorInvalidValue",
    101: "cudaErrorInvalidDevice",
    400: "cudaErrorInvalidResourceHandle",
    401: "cudaErrorIllegalState",
    900: "cudaErrorStreamCaptureUnsupported",
    901: "cudaErrorStreamCaptureInvalidated",
    902: "cudaErrorStreamCaptureMerge",
    903: "cudaErrorStreamCaptureUnmatched",
    904: "cudaErrorStreamCaptureUnjoined",
    905: "cudaErrorStreamCaptureIsolation",
    906: "cudaErrorStreamCaptureImplicit",
    907: "cudaErrorCapturedEvent",
    908: "cudaErrorStreamCaptureWrongThread",
}


def sim_error(code: int, detail: str) -> CudaError:
    """The CudaError the driver returns as ``code``, with what happened."""
    return CudaError(code, _NAMES[code], detail)


_HostFn = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_host_functions: dict[int, Any] = {}


def _host_function(address: int) -> Any:
    """A ctypes callable for the ``void (*)(void *)`` at ``address`` (cached)."""
    fn = _host_functions.get(address)
    if fn is None:
        fn = _host_functions.setdefault(address, _HostFn(address))
    return fn


def raise_fault(fault: KernelError) -> None:
    # A fresh instance per raise: tracebacks are not shared between threads.
    raise KernelError(fault.kernel, fault.stream, fault.__cause__ or fault)


class Point:
    """A position in one stream's FIFO; set once every earlier operation ran.

    A stream whose next operation waits for it is woken when it is set, and
    not before: a driver wakes no host thread for a stream wait."""

    __slots__ = ("done", "watchers")

    def __init__(self) -> None:
        self.done = threading.Event()
        #: streams whose next operation waits for this point
        self.watchers: list[SimStream] = []

    def set(self) -> None:
        """Reached: wake the streams that wait for it."""
        self.done.set()  # first: a stream that registers from now on sees it set
        watchers, self.watchers = self.watchers, []
        for stream in watchers:
            stream.wake()


class SimEvent:
    """An event: its device and its latest record, in a capture or not."""

    __slots__ = ("captured", "deps", "device", "point")

    def __init__(self, device: int) -> None:
        self.device = device
        self.point: Point | None = None  # the latest record outside a capture
        self.captured: Capture | None = None  # the latest record was in this capture
        self.deps: frozenset[int] = frozenset()  # ... after these graph nodes


class Handles:
    """Handle values: fresh ones from one counter; a released one is handed
    out again by the next take of its kind (last released, first reused), as
    CUDA recycles the addresses of destroyed objects."""

    def __init__(self, first: int) -> None:
        self._fresh = itertools.count(first, 0x200)
        self._released: dict[str, list[int]] = {}

    def take(self, kind: str) -> int:
        released = self._released.get(kind)
        return released.pop() if released else next(self._fresh)

    def release(self, kind: str, handle: int) -> None:
        self._released.setdefault(kind, []).append(handle)


class Device:
    """One simulated device: its legacy stream, blocking streams and fault state."""

    def __init__(self, backend: SimBackend, ordinal: int) -> None:
        self.ordinal = ordinal
        #: the first kernel failure since the last reset: poisons the device
        self.fault: KernelError | None = None
        #: bumped by reset(): kernels enqueued before it never run
        self.epoch = 0
        #: per-thread default streams of live host threads (legacy syncs with them)
        self.blocking: set[SimStream] = set()
        self.legacy = backend.new_stream(1, self, blocking=True)

    def check(self) -> None:
        """Raise the sticky fault, if a kernel faulted since the last reset:
        every call on the device but a destroy returns it from then on, as
        the driver's calls do once it has noticed the fault (the simulator
        notices at once: the worst case for code that makes more calls)."""
        fault = self.fault
        if fault is not None:
            raise_fault(fault)


_Op = tuple[Any, ...]


class SimStream:
    """One stream: a FIFO of operations and the worker thread that drains it."""

    __slots__ = ("__weakref__", "_backend", "_closed", "_cv", "_drained", "_ops",
                 "_reclaimed", "_rng", "_running", "_thread", "blocking", "capture",
                 "device", "handle", "tail")  # fmt: skip

    def __init__(
        self, backend: SimBackend, handle: int, device: Device, *, blocking: bool, seed: str
    ) -> None:
        self.handle = handle
        self.device = device
        self.blocking = blocking
        #: the capture sequence this stream records into, or None
        self.capture: Capture | None = None
        #: while capturing: the graph nodes the next captured node depends on
        self.tail: frozenset[int] = frozenset()
        self._backend = backend
        self._ops: deque[_Op] = deque()
        # Re-entrant, as a driver is: a garbage collection may start at an
        # allocation made while this is held, and a finalizer it runs may
        # enqueue onto this very stream (a buffer's __del__ calling cs.hold)
        self._cv = threading.Condition(threading.RLock())
        self._closed = False
        #: set when the worker ends, closed and drained
        self._drained = Point()
        #: its host thread ended: it closes itself once idle (close_when_idle)
        self._reclaimed = False
        self._running = False
        self._rng = random.Random(seed)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the worker now (call it holding no lock), not at the first push:
        starting a thread takes the host a while, and the first kernel's
        caller should not pay for it."""
        with self._cv:
            thread = self._new_worker()
        if thread is not None:
            thread.start()

    def _new_worker(self) -> threading.Thread | None:
        if self._thread is not None:
            return None
        self._thread = threading.Thread(
            target=self._run,
            name=f"cai-streams-{self._backend.name}-{self.device.ordinal}-{self.handle:#x}",
            daemon=True,
        )
        return self._thread

    def push(self, *ops: _Op) -> None:
        """Append ``ops``; starts the worker if it was not (outside the lock).
        The worker is woken only if it can run the first of them now (not for
        a wait on a point not reached: that point wakes it)."""
        with self._cv:
            if self._closed:
                raise sim_error(400, f"stream {self.handle:#x} was destroyed")
            was_empty = not self._ops
            self._ops.extend(ops)
            thread = self._new_worker()
            if thread is None:
                if was_empty and self._ready():
                    self._cv.notify()
                return
        thread.start()

    def wake(self) -> None:
        """A point this stream's next operation waits for was reached."""
        with self._cv:
            self._cv.notify()

    def _ready(self) -> bool:
        """Lock held: whether the worker can run its next operation now; a wait
        for a point not reached yet registers this stream to be woken by it."""
        ops = self._ops
        if not ops:
            return False
        op = ops[0]
        if op[0] != "wait":
            return True
        point: Point = op[1]
        if point.done.is_set():
            return True
        if self not in point.watchers:
            point.watchers.append(self)
        return point.done.is_set()  # set meanwhile: its wake may have come before

    def is_idle(self) -> bool:
        """Whether every operation enqueued so far has run (cudaStreamQuery)."""
        with self._cv:
            return not self._ops and not self._running

    def mark_if_busy(self) -> Point | None:
        """A mark after the work enqueued so far, or None if there is none pending
        (a closed stream still draining: the point where its worker ends)."""
        with self._cv:
            idle = not self._ops and not self._running
            if self._closed:
                return None if idle or self._thread is None else self._drained
            if idle:
                return None
        point = Point()
        try:
            self.push(("mark", point))
        except CudaError:  # destroyed meanwhile: its work still drains, nothing to wait for
            return None
        return point

    def close_when_idle(self) -> None:
        """Close once every operation enqueued so far (and any the legacy stream
        adds meanwhile, to wait for it) has run: a per-thread default stream whose
        thread ended stays a blocking stream until its work is done."""
        with self._cv:
            self._reclaimed = True
            self._cv.notify()

    def close(self) -> None:
        """Stop taking work; the worker drains what is queued, then ends."""
        with self._cv:
            self._closed = True
            self._cv.notify()

    def join(self, timeout: float) -> None:
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._running = False
                while not self._ready():
                    if self._ops:  # a wait for a point not reached: it wakes us
                        if self._backend.closing:
                            return
                        self._cv.wait(0.05)
                        continue
                    if self._closed:
                        break
                    if self._reclaimed:
                        self._closed = True
                        break
                    self._cv.wait()
                if not self._ops:
                    # closed and drained: a reclaimed per-thread stream stops
                    # being one the legacy stream synchronizes with only now
                    self.device.blocking.discard(self)
                    drained = True
                else:
                    drained = False
                    op = self._ops.popleft()
                    self._running = True
            if drained:
                self._drained.set()  # outside the lock: it wakes the streams waiting for it
                return
            kind = op[0]
            if kind == "kernel":
                self._run_kernel(op[1], op[2], op[3], op[4])
            elif kind == "mark":
                op[1].set()
            elif kind == "wait":
                waited: Point = op[1]
                while not waited.done.wait(0.05):  # reached: returns at once
                    if self._backend.closing:
                        return
            elif kind == "host":
                self._run_host(op[1], op[2], op[3])
            elif kind == "graph":
                self._run_graph(op[1], op[2])
            # An idle worker must not keep the last kernel's arrays alive.
            del op

    def _run_graph(self, graph: GraphExec, epoch: int) -> None:
        for node in graph.order(self._rng):
            if node.op[0] == "kernel":
                _, fn, name, duration = node.op
                self._run_kernel(fn, name, duration, epoch)
            elif node.op[0] == "host":
                self._run_host(node.op[1], node.op[2], epoch)
            else:
                self._run_graph(node.op[1], epoch)

    def _run_host(self, fn: int, user_data: int, epoch: int) -> None:
        """A host function: the C function at ``fn``, called as a driver thread
        calls it (no Python of ours runs; ctypes releases the GIL for the call)."""
        device = self.device
        if device.fault is not None or epoch != device.epoch:
            return  # as on a GPU: nothing more runs on a faulted device
        _host_function(fn)(user_data)

    def _run_kernel(self, fn: Callable[[], object], name: str, duration: float, epoch: int) -> None:
        device = self.device
        if device.fault is not None or epoch != device.epoch:
            return  # a poisoned (or since reset) device runs nothing more
        hooks = kernel_hooks
        start = time.perf_counter() if hooks else 0.0
        delay = duration
        jitter = self._backend.jitter
        if jitter > 0:
            delay += self._rng.uniform(0.0, jitter)
        if delay > 0:
            time.sleep(delay)
            if device.fault is not None or epoch != device.epoch:
                return  # it was running when another kernel faulted: aborted with it
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - a kernel failure is data, not a crash
            if device.fault is None and epoch == device.epoch:
                device.fault = KernelError(name, self.handle, exc)
        if hooks:
            end = time.perf_counter()
            for hook in hooks:
                hook(self.handle, name, start, end)
