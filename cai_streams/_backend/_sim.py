"""The simulated devices: as strict as the driver.

Ordering rules (CUDA's, for what this library relies on):

* Work on one stream runs in FIFO order, one operation at a time, on that
  stream's own worker thread; host calls only enqueue and return.
* ``record`` puts a marker in the FIFO; the event is complete once every
  operation enqueued before the marker has run. Re-recording moves the event.
* ``stream_wait_event`` captures the event's latest record at call time and
  blocks the waiting stream's worker until that marker is reached. An event
  never recorded makes the wait a no-op.
* Streams made by ``create_stream`` are non-blocking. Handle 1 is the current
  device's legacy default stream, handle 2 the calling thread's per-thread
  default stream on the current device (made on first use, reclaimed when the
  thread ends). Per-thread default streams are blocking: an operation on
  stream 1 waits for all earlier work on every per-thread default stream of its
  device, and an operation on a per-thread default stream waits for all earlier
  work on stream 1.
* Kernels really run (Python callables over numpy views of device memory), after
  their ``duration`` plus a seeded random jitter, so a missing wait gives wrong data.

What else real CUDA does to programs that get it wrong, modelled here:

* Handle reuse: a destroyed stream's, event's or graph's handle is handed out
  again by the next create of its kind, as CUDA recycles addresses.
* Devices: ``CAI_STREAMS_SIM_DEVICES`` of them (default 2), each with its own
  legacy and per-thread default streams, memory and events. Each host thread
  has a current device (0 until it calls ``set_device``). Recording an event on
  a stream of another device is cudaErrorInvalidResourceHandle; waiting on
  another device's event is legal.
* Sticky faults: a kernel that raises poisons its device. From the moment
  it raised, every call on that device (a record, a wait, a launch, an
  allocation, a query or synchronize of any stream or event of the device)
  raises :class:`KernelError`, until ``sim.reset()``: the driver's calls
  return a sticky error once it has noticed the fault, and the simulator
  notices at once.
  Kernels enqueued on a poisoned device never run; marks and waits still
  complete, so nothing hangs. Destroying a stream or event still works.
* Graph capture, as the driver does it (``_sim_capture``).
* A caching allocator per device (``_sim_memory``).
"""

from __future__ import annotations

import itertools
import numbers
import random
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Final

import numpy as np

from .._errors import CudaError
from . import CAPTURE_MODES, Backend, CaptureMode, CaptureStatus
from ._sim_capture import CaptureRules
from ._sim_memory import Memory, free_hooks
from ._sim_stream import Device, Handles, Point, SimEvent, SimStream, kernel_hooks, sim_error

__all__ = ["DecoyBackend", "SimBackend", "free_hooks", "kernel_hooks"]

#: default upper bound of the random delay added to each kernel, in seconds
DEFAULT_JITTER: Final = 0.0005
#: the longest simulated kernel or jitter, in seconds: a stream's worker sleeps
#: it (``time.sleep`` refuses a few hundred years); a day is past any test
MAX_SIM_SECONDS: Final = 86400.0


def check_sim_seconds(name: str, value: object) -> float:
    """``value`` as a simulated kernel's time: a real number of seconds from 0
    to a day (TypeError, or ValueError naming ``name``, else)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    seconds = float(value)
    if not 0 <= seconds <= MAX_SIM_SECONDS:  # (NaN fails too)
        raise ValueError(
            f"{name} must be from 0 to {MAX_SIM_SECONDS:g} seconds (a day), got {value!r}"
        )
    return seconds


_Op = tuple[Any, ...]


#: cudaErrorIllegalState: here, a capture that ended between a check and the
#: call that found it (another thread's), which the driver never reports
_ILLEGAL_STATE: Final = 401


class _ThreadState:
    """One host thread's view of the simulator: its current device, its
    capture interaction mode, and its per-thread default streams."""

    __slots__ = ("__weakref__", "capture_mode", "device", "ptds")

    def __init__(self) -> None:
        self.device = 0
        self.capture_mode: CaptureMode = "global"
        self.ptds: dict[int, SimStream] = {}


def _reclaim(ptds: dict[int, SimStream]) -> None:
    """A host thread ended: its per-thread default streams drain and go (the
    legacy stream keeps synchronizing with each until its work has run)."""
    for stream in ptds.values():
        stream.close_when_idle()


def _check_mode(mode: object) -> None:
    if mode not in CAPTURE_MODES:
        raise ValueError(f"capture mode must be one of {', '.join(CAPTURE_MODES)}, got {mode!r}")


class SimBackend(Backend):
    """Faithful simulated CUDA devices (see the module docstring for the rules)."""

    name = "sim"
    #: the first stream or event handle (a decoy's never collide with the simulator's)
    first_handle: int = 0x7F00_0000_1000

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None

    @property
    def jitter(self) -> float:
        """Upper bound, in seconds, of the random delay added to each kernel
        (from 0 to a day: ``MAX_SIM_SECONDS``)."""
        return self._jitter

    @jitter.setter
    def jitter(self, value: float) -> None:
        self._jitter = check_sim_seconds("jitter", value)

    def __init__(self, *, seed: int | None = None, jitter: float | None = None) -> None:
        from .._config import sim_devices, sim_jitter, sim_seed  # late: _config imports us

        if seed is None:
            seed = sim_seed()
            if seed is None:
                seed = random.SystemRandom().randrange(2**32)
        if jitter is None:
            jitter = sim_jitter(DEFAULT_JITTER)
        #: the seed of every stream's jitter sequence
        self.seed: int = seed
        self._jitter = check_sim_seconds("jitter", jitter)
        self.closing = False
        self.memory = Memory()
        # Re-entrant: Stream/Event destructors call back into the backend and can
        # run from a garbage collection on a thread that already holds the lock.
        self._lock = threading.RLock()
        self._handles = Handles(self.first_handle)
        self._captures = CaptureRules(self._lock, self._handles)
        self._ordinals = itertools.count()
        self._local = threading.local()
        self._streams: dict[int, SimStream] = {}
        #: every stream whose worker may still run (destroyed ones drain first)
        self._every_stream: weakref.WeakSet[SimStream] = weakref.WeakSet()
        self._events: dict[int, SimEvent] = {}
        self._devices = [Device(self, i) for i in range(sim_devices())]

    def new_stream(self, handle: int, device: Device, *, blocking: bool) -> SimStream:
        """A stream object; its worker starts on ``start()`` or its first push."""
        seed = f"{self.seed}:{next(self._ordinals)}"
        stream = SimStream(self, handle, device, blocking=blocking, seed=seed)
        self._every_stream.add(stream)
        return stream

    def drain(self, timeout: float = 30.0) -> bool:
        """Block until every stream's queued work has run, destroyed streams
        included (their workers still drain), or ``timeout`` passes; whether all
        did. For test isolation: freed blocks go back to the pool at once, so a
        test's leftover kernels could write into the next test's arrays."""
        deadline = time.monotonic() + timeout
        for stream in list(self._every_stream):
            while not stream.is_idle():
                if time.monotonic() > deadline or self.closing:
                    return False
                time.sleep(0.001)
        return True

    # -- devices ---------------------------------------------------------------

    def _state(self) -> _ThreadState:
        state: _ThreadState | None = getattr(self._local, "state", None)
        if state is None:
            state = self._local.state = _ThreadState()
        return state

    def _device(self, device: int | None) -> Device:
        if device is None:
            return self._devices[self._state().device]
        if isinstance(device, bool) or not isinstance(device, int):
            raise TypeError(f"a device is an int ordinal, got {type(device).__name__}")
        if not 0 <= device < len(self._devices):
            raise sim_error(
                101, f"device {device} does not exist: the simulator has {len(self._devices)}"
            )
        return self._devices[device]

    def device_count(self) -> int:
        return len(self._devices)

    def current_device(self) -> int:
        return self._state().device

    def set_device(self, device: int) -> None:
        self._state().device = self._device(device).ordinal

    def pointer_device(self, ptr: int) -> int:
        found = self.memory.device_of(ptr)
        if found is None:
            raise ValueError(f"{ptr:#x} is not simulated device memory")
        return found

    def allocate(self, nbytes: int, device: int | None = None) -> tuple[int, np.ndarray[Any, Any]]:
        """Device memory from ``device``'s pool (cudaMalloc when the pool has no
        block of that size: refused during a capture that forbids it). Does not block."""
        dev = self._device(device)
        dev.check()
        return self.memory.allocate(nbytes, dev.ordinal, lambda: self._check_unsafe("cudaMalloc"))

    def reset(self, device: int | None = None) -> list[int]:
        """cudaDeviceReset of ``device`` (None: the current device), as far as
        modelled: the fault is cleared, kernels enqueued before never run,
        captures on the device end (invalidated), cached free blocks are
        released. Streams, events, graphs and live arrays stay valid (CUDA
        destroys them). Returns the streams whose capture it ended. Does not
        block."""
        dev = self._device(device)
        ended = self._captures.end_all(dev.ordinal)
        with self._lock:
            dev.fault = None
            dev.epoch += 1
        self.memory.release_cached(dev.ordinal)
        return ended

    def _check_unsafe(self, call: str) -> None:
        if self._captures.active:
            self._captures.check_unsafe(call, self._state().capture_mode)

    # -- streams ---------------------------------------------------------------

    def _per_thread_stream(self) -> SimStream:
        state = self._state()
        stream = state.ptds.get(state.device)
        if stream is None:
            device = self._devices[state.device]
            stream = self.new_stream(2, device, blocking=True)
            stream.start()
            if not state.ptds:
                reclaim = weakref.finalize(state, _reclaim, state.ptds)
                reclaim.atexit = False  # close() stops every stream at exit
            state.ptds[state.device] = stream
            device.blocking.add(stream)
        return stream

    def _resolve(self, handle: int) -> SimStream:
        if handle == 1:
            return self._devices[self._state().device].legacy
        if handle == 2:
            return self._per_thread_stream()
        found = self._streams.get(handle)
        if found is None:
            raise sim_error(400, f"no simulated stream has handle {handle:#x}")
        return found

    def _enqueue(self, stream: SimStream, *ops: _Op) -> bool:
        """Enqueue on ``stream`` with the default streams' implicit ordering, or
        record into its capture; False for the latter."""
        device = stream.device
        device.check()
        while stream.capture is not None:
            try:
                self._captures.record_ops(stream, ops)
                return False
            except CudaError as exc:  # (the capture ended meanwhile: not the driver's error;
                if exc.code != _ILLEGAL_STATE:  # another may have begun since: again)
                    raise
        legacy = device.legacy
        if stream is legacy:
            self._captures.check_legacy(device)
            for other in list(device.blocking):
                point = other.mark_if_busy()
                if point is not None:
                    stream.push(("wait", point))
        elif stream.blocking:
            point = legacy.mark_if_busy()
            if point is not None:
                stream.push(("wait", point))
        stream.push(*ops)
        return True

    def create_stream(self, device: int | None = None) -> int:
        dev = self._device(device)
        dev.check()
        with self._lock:
            handle = self._handles.take("stream")
        stream = self.new_stream(handle, dev, blocking=False)
        stream.start()  # holding no lock
        with self._lock:
            self._streams[handle] = stream
        return handle

    def destroy_stream(self, stream: int) -> None:
        with self._lock:
            found = self._streams.pop(stream, None)
            if found is None:
                raise sim_error(400, f"no simulated stream has handle {stream:#x}")
            self._handles.release("stream", stream)
        found.close()

    def is_stream(self, stream: int) -> bool:
        return stream in (1, 2) or stream in self._streams

    def stream_device(self, stream: int) -> int:
        return self._resolve(stream).device.ordinal

    def launch(self, stream: int, fn: Callable[[], object], name: str, duration: float) -> None:
        """Enqueue ``fn`` on ``stream``; it runs on the stream's worker thread."""
        target = self._resolve(stream)
        self._enqueue(target, ("kernel", fn, name, duration, target.device.epoch))

    def launch_host_func(self, stream: int, fn: int, user_data: int) -> None:
        """The stream's worker calls the C function ``fn(user_data)`` through
        ctypes at this point in its FIFO (the GIL released, as ctypes does), as
        a driver thread does; never on a poisoned device. Only enqueues."""
        for name, value in (("fn", fn), ("user_data", user_data)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise TypeError(f"{name} must be an address (an int >= 0), got {value!r}")
        if fn == 0:
            raise sim_error(1, "cudaLaunchHostFunc: fn is NULL")
        target = self._resolve(stream)
        self._enqueue(target, ("host", fn, user_data, target.device.epoch))

    def synchronize_stream(self, stream: int) -> None:
        target = self._resolve(stream)
        device = target.device
        self._captures.check_sync(target)
        self._check_unsafe("cudaStreamSynchronize")
        device.check()
        point = Point()
        self._enqueue(target, ("mark", point))
        self._wait(point)
        device.check()

    def query_stream(self, stream: int) -> bool:
        target = self._resolve(stream)
        self._captures.check_sync(target)
        self._check_unsafe("cudaStreamQuery")
        target.device.check()
        return target.is_idle()

    def _wait(self, point: Point) -> None:
        while not point.done.wait(0.1):
            if self.closing:
                return

    # -- events ----------------------------------------------------------------

    def create_event(self, device: int | None = None) -> int:
        dev = self._device(device)
        dev.check()
        with self._lock:
            handle = self._handles.take("event")
            self._events[handle] = SimEvent(dev.ordinal)
        return handle

    def destroy_event(self, event: int) -> None:
        with self._lock:
            if self._events.pop(event, None) is None:
                raise sim_error(400, f"no simulated event has handle {event:#x}")
            self._handles.release("event", event)

    def _event(self, event: int) -> SimEvent:
        found = self._events.get(event)
        if found is None:
            raise sim_error(400, f"no simulated event has handle {event:#x}")
        return found

    def record(self, event: int, stream: int) -> None:
        ev = self._event(event)
        target = self._resolve(stream)
        device = target.device
        if device.ordinal != ev.device:
            raise sim_error(
                400,
                f"event {event:#x} belongs to device {ev.device}; stream {stream:#x} "
                f"is on device {device.ordinal}",
            )
        device.check()
        while True:
            if target.capture is not None:
                try:
                    self._captures.record_event(ev, target)
                    return
                except CudaError as exc:  # the capture ended meanwhile: again
                    if exc.code != _ILLEGAL_STATE:
                        raise
                    continue
            point = Point()
            if self._enqueue(target, ("mark", point)):
                ev.captured, ev.point = None, point
                return
            # A capture that another thread began since the check above took the
            # mark (and dropped it): the driver records into the capture, and so
            # does this, from the top. (No lock across the check and the enqueue:
            # the enqueue takes stream locks, under which a finalizer may call in.)

    def query(self, event: int) -> bool:
        ev = self._event(event)
        self._captures.check_event(ev, "cudaEventQuery")
        self._check_unsafe("cudaEventQuery")
        self._devices[ev.device].check()
        point = ev.point
        return point is None or point.done.is_set()

    def synchronize_event(self, event: int) -> None:
        ev = self._event(event)
        self._captures.check_event(ev, "cudaEventSynchronize")
        self._check_unsafe("cudaEventSynchronize")
        device = self._devices[ev.device]
        device.check()
        point = ev.point
        if point is not None:
            self._wait(point)
        device.check()

    def stream_wait_event(self, stream: int, event: int) -> None:
        ev = self._event(event)
        target = self._resolve(stream)
        target.device.check()
        if ev.captured is not None or target.capture is not None:
            self._captures.wait(target, ev)
            return
        point = ev.point
        if point is not None:
            self._enqueue(target, ("wait", point))
        elif target is target.device.legacy:
            self._captures.check_legacy(target.device)

    # -- graph capture -----------------------------------------------------------

    def begin_capture(self, stream: int, mode: CaptureMode) -> None:
        _check_mode(mode)
        target = self._resolve(stream)
        target.device.check()
        self._captures.begin(target, mode)

    def end_capture(self, stream: int) -> int:
        return self._captures.end(self._resolve(stream))

    def capture_status(self, stream: int) -> CaptureStatus:
        return self._captures.status(self._resolve(stream))

    def exchange_capture_mode(self, mode: CaptureMode) -> CaptureMode:
        _check_mode(mode)
        state = self._state()
        previous, state.capture_mode = state.capture_mode, mode
        return previous

    def instantiate_graph(self, graph: int) -> int:
        return self._captures.instantiate(graph)

    def launch_graph(self, graph_exec: int, stream: int) -> None:
        found = self._captures.executable(graph_exec)
        target = self._resolve(stream)
        device = target.device
        if device.ordinal != found.device:
            raise sim_error(400, f"the graph belongs to device {found.device}")
        if target.capture is not None:  # a graph launched into a capture: a child graph
            self._enqueue(target, ("graph", found, device.epoch))
            return
        done = Point()
        last = found.last  # launches of one graph run one at a time
        if last is not None and not last.done.is_set():
            self._enqueue(target, ("wait", last), ("graph", found, device.epoch), ("mark", done))
        else:
            self._enqueue(target, ("graph", found, device.epoch), ("mark", done))
        found.last = done

    def destroy_graph(self, graph: int) -> None:
        self._captures.destroy(graph)

    def destroy_graph_exec(self, graph_exec: int) -> None:
        self._captures.destroy_executable(graph_exec)

    def close(self) -> None:
        """Stop every worker after it drains its FIFO (bounded wait)."""
        self.closing = True
        locked = self._lock.acquire(timeout=2.0)  # bounded even if a thread is stuck
        try:
            streams = [*self._streams.values()]
            for device in self._devices:
                streams.append(device.legacy)
                streams.extend(list(device.blocking))
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
