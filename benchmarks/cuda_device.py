"""The device under the cuda benchmarks: a GPU through CuPy, or the simulator standing in.

The cuda benchmarks (``cuda_waiting``, ``cuda_pipeline``, ``cuda_handoff``) ask a
device for a few operations: a kernel that is busy for a given time and stamps
its completion time, a gate that holds streams until the host opens it, and the
pipeline's copy, preprocess and checksum steps. :class:`CudaDevice` does them on
a GPU with the kernels of ``benchmarks/kernels.cu`` (loaded with
``cupy.RawModule``); :class:`SimStandIn` does them on the simulated device, so
that the orchestration of the cuda run (sections, guards, rows, JSON, table) is
exercised on CPU by the test suite. Figures measured on the stand-in are the
simulator's, never GPU figures: the report says which device ran.

Completion times on a GPU. Each waiter's kernel ends by writing ``%globaltimer``
(the GPU's nanosecond clock, 32 ns steps on an H100) to device memory, read
back after the run. :meth:`CudaDevice.mark` relates that clock to the host's
``time.perf_counter_ns``: a one-thread kernel writes ``%globaltimer`` to
host-mapped pinned memory, and the host spins until the value lands. The stamp
was taken between the host's launch time ``t0`` and the time it saw the value
``t1``, so the offset (device minus host) lies in ``[g - t1, g - t0]``; the
lower bound, maximised over 8 tries, is used. It is late only by the time the
write takes to reach host memory (about a microsecond), so wake latencies read
at most that much short. The two clocks drift apart by tens of ppm (17 ppm was
seen on an H100), so a run is bracketed by a mark before its work is enqueued
and one after it completed (not while gate kernels hold streams: with more
streams than the device's hardware queues, a held stream can hold up the
calibration kernel behind it), and each stamp is converted with the offset
interpolated between them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

import cai_streams as cs
from cai_streams import sim

KERNELS = Path(__file__).resolve().parent / "kernels.cu"

#: Host wait bounds: nothing here waits longer for the device than this.
DRAIN_TIMEOUT = 30.0


class Gate(Protocol):
    """Holds some streams until :meth:`release` (or its own timeout)."""

    def release(self) -> None: ...

    @property
    def expired(self) -> bool:
        """True when the gate opened by its timeout, not by :meth:`release`."""
        ...


class Device(Protocol):
    """What the cuda benchmarks need of a device (see the module docstring)."""

    #: "cuda" on a GPU, "sim stand-in" on the simulated device
    name: str

    def prepare_stamps(self, n: int) -> None:
        """Make room for ``n`` completion stamps (slots 0..n-1), zeroed."""
        ...

    def spin_then_stamp(self, stream: cs.Stream, seconds: float, slot: int) -> None:
        """Enqueue work busy for ``seconds`` that then stamps its completion time."""
        ...

    def mark(self) -> None:
        """Relate the device clock to the host's now: before a run's work is
        enqueued and after it completed (a busy device delays the calibration)."""
        ...

    def completion_ns(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """Every slot's completion time in ``time.perf_counter_ns`` units.

        Call once every stamped kernel has completed and after a :meth:`mark`.
        """
        ...

    def gate(self, streams: Sequence[cs.Stream], timeout: float) -> Gate:
        """Hold ``streams`` until released, or ``timeout`` seconds at most."""
        ...

    def clock_uncertainty_us(self) -> float:
        """Width of the last calibration bracket, in microseconds (0 on the sim)."""
        ...

    def forget(self, streams: Sequence[cs.Stream]) -> None:
        """Drop what the device caches about ``streams`` (before they are closed)."""
        ...

    def pending_record_cap(self, limit: int = 1024) -> int:
        """How many cai_streams events can be recorded on one held stream before a
        record blocks the host (at most ``limit``)."""
        ...


def pending_record_cap(device: Device, limit: int = 1024) -> int:
    """Record cai_streams events (``Stream.record()``, with the library's own event
    flags) on a stream held by a gate until one record takes over 50 ms: that
    record waited for the gate, so the queue held the ones before it. A driver
    bounds how much pending work a hardware queue holds, and the bound depends
    on the kind of work: about 1,000 kernels, but only about 56 records of
    events made with ``cudaEventBlockingSync`` (seen on an H100, driver 580).
    The waiting benchmark holds its waiters' events pending behind a gate, so
    it lays them out within this cap."""
    s = cs.Stream()
    gate = device.gate([s], 1.0)
    events: list[cs.Event] = []
    fitted = limit
    try:
        for i in range(limit):
            start = time.perf_counter()
            events.append(s.record())
            if time.perf_counter() - start > 0.05:
                fitted = i
                break
    finally:
        gate.release()
        drain([s])
        for e in events:
            e.close()
        device.forget([s])
        s.close()
    return fitted


def drain(streams: Sequence[cs.Stream], timeout: float = DRAIN_TIMEOUT) -> None:
    """Wait, polling, until the work enqueued so far on ``streams`` is complete.

    A bounded wait: raises TimeoutError after ``timeout`` seconds instead of
    blocking in a stream synchronize that might never return.
    """
    events = [s.record() for s in streams if not s.closed]
    deadline = time.monotonic() + timeout
    try:
        for e in events:
            while not e.is_done:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"device work still pending after {timeout:.0f} s")
                time.sleep(0.0002)
    finally:
        for e in events:
            e.close()


# --------------------------------------------------------------------- GPU


class _CudaGate:
    def __init__(self, cp: Any, kernel: Any, streams: Sequence[cs.Stream], timeout: float) -> None:
        self._memory = cp.cuda.alloc_pinned_memory(8)
        self._flags = np.frombuffer(self._memory, np.int32, 2)
        self._flags[:] = 0
        ptr = int(self._memory.ptr)
        for s in streams:
            with cp.cuda.Stream.from_external(s):
                kernel((1,), (1,), (ptr, ptr + 4, np.uint64(int(timeout * 1e9))))

    def release(self) -> None:
        self._flags[0] = 1

    @property
    def expired(self) -> bool:
        return bool(self._flags[1])


class CudaDevice:
    """The GPU, through CuPy (imported here only) and the kernels of kernels.cu."""

    name = "cuda"

    def __init__(self) -> None:
        import cupy

        self.cp = cupy
        self.module = cupy.RawModule(code=KERNELS.read_text())
        fn = self.module.get_function
        self._stamp_now = fn("stamp_now")
        self._timer_step = fn("timer_step")
        self._spin_then_stamp = fn("spin_then_stamp")
        self._spin = fn("spin")
        self._gate = fn("gate")
        self._preprocess = fn("preprocess")
        self._checksum = fn("checksum")
        self._calib_memory = cupy.cuda.alloc_pinned_memory(8)
        self._calib_host = np.frombuffer(self._calib_memory, np.uint64, 1)
        self._calib_stream = cs.Stream()
        self._external: dict[int, Any] = {}
        self._stamps: Any = None
        self._marks: list[tuple[int, int, int]] = []  # (host ns, offset lower bound, width)
        self.gpu, self.sms = "unknown", 0
        try:
            props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
            raw_name = props.get("name", b"?")
            self.gpu = raw_name.decode() if isinstance(raw_name, bytes) else str(raw_name)
            self.sms = int(props.get("multiProcessorCount", 0))
        except Exception:  # only for the report and the grid size
            pass
        self.h2d_bytes_per_s = float("nan")

    # streams
    def on(self, stream: cs.Stream) -> Any:
        """A CuPy stream over ``stream``'s handle (cached), to launch kernels on."""
        ext = self._external.get(stream.handle)
        if ext is None or ext.ptr != stream.handle:
            ext = self.cp.cuda.Stream.from_external(stream)
            self._external[stream.handle] = ext
        return ext

    def forget(self, streams: Sequence[cs.Stream]) -> None:
        """Drop the cached CuPy streams of ``streams`` (before they are closed)."""
        for s in streams:
            if not s.closed:
                self._external.pop(s.handle, None)

    # clock
    def timer_step_ns(self) -> int:
        out = self.cp.zeros(1, self.cp.uint64)
        self._timer_step((1,), (1,), (out, np.int32(100_000)))
        return int(out.get()[0])

    def mark(self) -> None:
        best_low, best_high = -(1 << 62), 1 << 62
        host = self._calib_host
        ptr = int(self._calib_memory.ptr)
        ext = self.on(self._calib_stream)
        for _ in range(8):
            host[0] = 0
            t0 = time.perf_counter_ns()
            with ext:
                self._stamp_now((1,), (1,), (ptr,))
            deadline = t0 + 1_000_000_000
            t1 = time.perf_counter_ns()
            while host[0] == 0 and t1 < deadline:
                t1 = time.perf_counter_ns()
            g = int(host[0])
            if g == 0:  # the device is held by other work: calibrate when it is not
                break
            best_low = max(best_low, g - t1)
            best_high = min(best_high, g - t0)
        if best_high == 1 << 62:
            raise TimeoutError(
                "the clock calibration kernel did not run within 1 s (the device is busy)"
            )
        self._marks.append((time.perf_counter_ns(), best_low, best_high - best_low))

    def clock_uncertainty_us(self) -> float:
        return self._marks[-1][2] / 1e3 if self._marks else float("nan")

    def to_host_ns(self, device_ns: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.int64]]:
        """Convert %globaltimer stamps to perf_counter_ns, between the last two marks."""
        g = device_ns.astype(np.int64)
        if len(self._marks) >= 2:
            (h0, o0, _), (h1, o1, _) = self._marks[-2], self._marks[-1]
        else:
            (h0, o0, _) = (h1, o1, _) = self._marks[-1]
        approx = g - o0  # host time with the first offset: close enough to interpolate at
        frac = np.clip((approx - h0) / max(h1 - h0, 1), 0.0, 1.0)
        offset = o0 + np.round((o1 - o0) * frac).astype(np.int64)
        result: np.ndarray[Any, np.dtype[np.int64]] = g - offset
        return result

    # waiting
    def pending_record_cap(self, limit: int = 1024) -> int:
        return pending_record_cap(self, limit)

    def prepare_stamps(self, n: int) -> None:
        self._stamps = self.cp.zeros(n, self.cp.uint64)
        # zeros() fills on the legacy stream, which the benchmark's non-blocking
        # streams do not wait for: finish the fill before any kernel stamps.
        self.cp.cuda.Stream.null.synchronize()

    def spin_then_stamp(self, stream: cs.Stream, seconds: float, slot: int) -> None:
        with self.on(stream):
            self._spin_then_stamp(
                (1,), (1,), (np.uint64(int(seconds * 1e9)), self._stamps, np.int32(slot))
            )

    def completion_ns(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        raw = self._stamps.get()
        if (raw == 0).any():
            raise RuntimeError(f"{int((raw == 0).sum())} stamped kernels never ran")
        return self.to_host_ns(raw)

    def gate(self, streams: Sequence[cs.Stream], timeout: float) -> Gate:
        return _CudaGate(self.cp, self._gate, streams, timeout)

    # pipeline
    def spin(self, stream: cs.Stream, seconds: float) -> None:
        with self.on(stream):
            self._spin((1,), (1,), (np.uint64(int(seconds * 1e9)),))

    def pipeline_ops(self, elements: int, sources: int, buffers: int) -> CudaPipelineOps:
        return CudaPipelineOps(self, elements, sources, buffers)

    def pipeline_elements(self, target_seconds: float) -> int:
        """float32 elements per batch whose pinned host-to-device copy takes about
        ``target_seconds``, from a 64 MiB copy timed with CUDA events (best of 3);
        a multiple of 2**20, between 4 Mi and 64 Mi elements (16-256 MiB)."""
        cp = self.cp
        nbytes = 64 << 20
        src = cp.cuda.alloc_pinned_memory(nbytes)
        dst = cp.cuda.alloc(nbytes)
        s = cs.Stream()
        best = float("inf")
        try:
            ext = self.on(s)
            for _ in range(3):
                begin, end = cp.cuda.Event(), cp.cuda.Event()
                begin.record(ext)
                cp.cuda.runtime.memcpyAsync(int(dst.ptr), int(src.ptr), nbytes, 1, s.handle)
                end.record(ext)
                drain([s])
                best = min(best, cp.cuda.get_elapsed_time(begin, end) / 1e3)
        finally:
            self.forget([s])
            s.close()
        self.h2d_bytes_per_s = nbytes / best
        elements = int(self.h2d_bytes_per_s * target_seconds / 4) >> 20 << 20
        return max(1 << 22, min(elements, 1 << 26))


class _DeviceBuffer:
    """A plain device allocation exporting CAI v3 with no stream of its own:
    cai_streams tracks its pending work (the pipeline's buffers)."""

    def __init__(self, cp: Any, elements: int) -> None:
        self.memory = cp.cuda.alloc(elements * 4)
        self.ptr = int(self.memory.ptr)
        self.elements = elements

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {
            "shape": (self.elements,),
            "typestr": "<f4",
            "data": (self.ptr, False),
            "strides": None,
            "version": 3,
            "stream": None,
        }


class CudaPipelineOps:
    """The pipeline's steps on the GPU: pinned host sources, H2D copies, the
    preprocess kernel, a fixed-time spin, and a checksum copied to pinned memory."""

    BLOCKS_PER_SM = 2

    def __init__(self, device: CudaDevice, elements: int, sources: int, buffers: int) -> None:
        cp = device.cp
        self.device = device
        self.cp = cp
        self.elements = elements
        self.nbytes = elements * 4
        base = (np.arange(elements, dtype=np.int64) % 1000).astype(np.float32)
        base_sum = int((np.arange(elements, dtype=np.int64) % 1000).sum())
        self._pinned = []
        self.source_sums: list[int] = []
        for k in range(sources):
            mem = cp.cuda.alloc_pinned_memory(self.nbytes)
            host = np.frombuffer(mem, np.float32, elements)
            np.add(base, np.float32(37 * k), out=host)
            self._pinned.append(mem)
            self.source_sums.append(base_sum + 37 * k * elements)
        self._sum_dev = cp.zeros(buffers, cp.uint64)
        cp.cuda.Stream.null.synchronize()  # the fill, on the legacy stream, done
        self._sum_memory = cp.cuda.alloc_pinned_memory(8 * buffers)
        self._sum_host = np.frombuffer(self._sum_memory, np.uint64, buffers)
        self._sum_host[:] = 0
        self._grid = (max(1, device.sms) * self.BLOCKS_PER_SM,)

    def buffer(self) -> _DeviceBuffer:
        return _DeviceBuffer(self.cp, self.elements)

    def copy_in(self, stream: cs.Stream, dst: _DeviceBuffer, source: int) -> None:
        self.cp.cuda.runtime.memcpyAsync(
            dst.ptr, int(self._pinned[source].ptr), self.nbytes, 1, stream.handle
        )  # 1: host to device

    def compute(
        self,
        stream: cs.Stream,
        out: _DeviceBuffer,
        inp: _DeviceBuffer,
        bias: int,
        seconds: float,
        slot: int,
    ) -> None:
        """out = 2 * inp + 1 + bias; busy ``seconds``; checksum of out to host slot."""
        rt = self.cp.cuda.runtime
        sum_ptr = int(self._sum_dev.data.ptr) + 8 * slot
        n = np.int64(self.elements)
        with self.device.on(stream):
            self.device._preprocess(self._grid, (256,), (out.ptr, inp.ptr, n, np.float32(bias)))
            self.device._spin((1,), (1,), (np.uint64(int(seconds * 1e9)),))
            rt.memsetAsync(sum_ptr, 0, 8, stream.handle)
            self.device._checksum(self._grid, (256,), (out.ptr, n, sum_ptr))
            rt.memcpyAsync(
                int(self._sum_memory.ptr) + 8 * slot, sum_ptr, 8, 2, stream.handle
            )  # 2: device to host

    def checksum(self, slot: int) -> int:
        return int(self._sum_host[slot])

    def expected(self, source: int, bias: int) -> int:
        return 2 * self.source_sums[source] + (1 + bias) * self.elements

    def close(self) -> None:
        self._pinned.clear()


# -------------------------------------------------------------- stand-in


class _SimGate:
    def __init__(self, streams: Sequence[cs.Stream], timeout: float) -> None:
        import threading

        self._open = threading.Event()
        self._expired = False
        for s in streams:
            sim.launch(s, self._hold, timeout, name="gate")

    def _hold(self, timeout: float) -> None:
        if not self._open.wait(timeout):
            self._expired = True

    def release(self) -> None:
        self._open.set()

    @property
    def expired(self) -> bool:
        return self._expired


class SimStandIn:
    """The simulated device standing in for the GPU, so the cuda benchmarks'
    code runs on CPU (in tests). Host clock stamps; no calibration needed."""

    name = "sim stand-in"
    gpu = "none (the simulated device)"

    def __init__(self) -> None:
        cs.use_backend("sim")
        sim.device().jitter = 0.0
        self._stamps = np.zeros(0, np.int64)

    def forget(self, streams: Sequence[cs.Stream]) -> None:
        pass

    def mark(self) -> None:
        pass

    def clock_uncertainty_us(self) -> float:
        return 0.0

    def pending_record_cap(self, limit: int = 1024) -> int:
        return pending_record_cap(self, limit)

    def prepare_stamps(self, n: int) -> None:
        self._stamps = np.zeros(n, np.int64)

    def spin_then_stamp(self, stream: cs.Stream, seconds: float, slot: int) -> None:
        stamps = self._stamps

        def stamp() -> None:
            stamps[slot] = time.perf_counter_ns()

        sim.launch(stream, stamp, duration=seconds, name="spin_then_stamp")

    def completion_ns(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        if (self._stamps == 0).any():
            raise RuntimeError(f"{int((self._stamps == 0).sum())} stamped kernels never ran")
        stamps: np.ndarray[Any, np.dtype[np.int64]] = self._stamps.copy()
        return stamps

    def gate(self, streams: Sequence[cs.Stream], timeout: float) -> Gate:
        return _SimGate(streams, timeout)

    def spin(self, stream: cs.Stream, seconds: float) -> None:
        sim.launch(stream, lambda: None, duration=seconds, name="spin")

    def pipeline_ops(self, elements: int, sources: int, buffers: int) -> SimPipelineOps:
        return SimPipelineOps(elements, sources, buffers)

    def pipeline_elements(self, target_seconds: float) -> int:
        return 1 << 16


class SimPipelineOps:
    """The pipeline's steps on the simulated device (copies and kernels are
    numpy calls with the pipeline's durations)."""

    def __init__(self, elements: int, sources: int, buffers: int) -> None:
        self.elements = elements
        self.nbytes = elements * 4
        base = (np.arange(elements, dtype=np.int64) % 1000).astype(np.float32)
        self._sources = [base + np.float32(37 * k) for k in range(sources)]
        self.source_sums = [int(s.astype(np.int64).sum()) for s in self._sources]
        self._sums = np.zeros(buffers, np.int64)
        #: seconds a copy takes on the simulated device
        self.copy_seconds = 0.002

    def buffer(self) -> sim.SimArray:
        return sim.empty(self.elements)

    def copy_in(self, stream: cs.Stream, dst: sim.SimArray, source: int) -> None:
        sim.launch(
            stream,
            np.copyto,
            dst,
            self._sources[source],
            writes=[dst],
            duration=self.copy_seconds,
            name="h2d copy",
        )

    def compute(
        self,
        stream: cs.Stream,
        out: sim.SimArray,
        inp: sim.SimArray,
        bias: int,
        seconds: float,
        slot: int,
    ) -> None:
        sums = self._sums

        def preprocess(o: np.ndarray[Any, Any], x: np.ndarray[Any, Any]) -> None:
            np.multiply(x, 2, out=o)
            o += np.float32(1 + bias)
            sums[slot] = int(o.astype(np.int64).sum())

        sim.launch(
            stream,
            preprocess,
            out,
            inp,
            reads=[inp],
            writes=[out],
            duration=seconds,
            name="preprocess",
        )

    def checksum(self, slot: int) -> int:
        return int(self._sums[slot])

    def expected(self, source: int, bias: int) -> int:
        return 2 * self.source_sums[source] + (1 + bias) * self.elements

    def close(self) -> None:
        pass
