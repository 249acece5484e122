"""Kernels the behavioural suite needs, on each backend.

The suite proves ordering with data: a kernel that runs too early reads or
writes the wrong values. ``latch`` holds a stream until the host releases it,
so "B did not wait for A" shows deterministically, not by timing luck.
On sim the kernels are Python callables; on cuda they are CuPy kernels (the
latch spins on a host-mapped flag).
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import numpy as np

import cai_streams as cs
from cai_streams import sim

LATCH_TIMEOUT = 20.0


class Latch(Protocol):
    def release(self) -> None: ...


class DeviceOps(Protocol):
    name: str

    def array(self, host: np.ndarray[Any, Any]) -> Any: ...
    def to_host(self, arr: Any) -> np.ndarray[Any, Any]: ...
    def fill(self, stream: cs.Stream, arr: Any, value: float, duration: float = 0.0) -> None: ...
    def add(self, stream: cs.Stream, arr: Any, value: float, duration: float = 0.0) -> None: ...
    def copy(self, stream: cs.Stream, dst: Any, src: Any, duration: float = 0.0) -> None: ...
    def shift_in(self, stream: cs.Stream, arr: Any, digit: int, duration: float = 0.0) -> None: ...
    def sum_into(self, stream: cs.Stream, out: Any, src: Any) -> None: ...
    def latch(self, stream: cs.Stream) -> Latch: ...
    def fail(self, stream: cs.Stream) -> None: ...


class _SimLatch:
    def __init__(self) -> None:
        self._released = threading.Event()

    def kernel(self) -> None:
        if not self._released.wait(LATCH_TIMEOUT):
            raise TimeoutError("latch kernel was never released")

    def release(self) -> None:
        self._released.set()


class SimOps:
    name = "sim"

    def array(self, host: np.ndarray[Any, Any]) -> sim.SimArray:
        return sim.asarray(host)

    def to_host(self, arr: Any) -> np.ndarray[Any, Any]:
        view = sim._numpy_view(arr)
        assert view is not None
        out: np.ndarray[Any, Any] = view.copy()
        return out

    def fill(self, stream: cs.Stream, arr: Any, value: float, duration: float = 0.0) -> None:
        def fill(x: np.ndarray[Any, Any]) -> None:
            x[...] = value

        sim.launch(stream, fill, arr, writes=[arr], duration=duration)

    def add(self, stream: cs.Stream, arr: Any, value: float, duration: float = 0.0) -> None:
        def add(x: np.ndarray[Any, Any]) -> None:
            x += value

        sim.launch(stream, add, arr, reads=[arr], writes=[arr], duration=duration)

    def copy(self, stream: cs.Stream, dst: Any, src: Any, duration: float = 0.0) -> None:
        def copy(d: np.ndarray[Any, Any], s: np.ndarray[Any, Any]) -> None:
            np.copyto(d, s)

        sim.launch(stream, copy, dst, src, reads=[src], writes=[dst], duration=duration)

    def shift_in(self, stream: cs.Stream, arr: Any, digit: int, duration: float = 0.0) -> None:
        def shift_in(x: np.ndarray[Any, Any]) -> None:
            x *= 10
            x += digit

        sim.launch(stream, shift_in, arr, reads=[arr], writes=[arr], duration=duration)

    def sum_into(self, stream: cs.Stream, out: Any, src: Any) -> None:
        def total(o: np.ndarray[Any, Any], s: np.ndarray[Any, Any]) -> None:
            o[...] = s.sum()

        sim.launch(stream, total, out, src, reads=[src], writes=[out])

    def latch(self, stream: cs.Stream) -> _SimLatch:
        latch = _SimLatch()
        sim.launch(stream, latch.kernel, name="latch")
        return latch

    def fail(self, stream: cs.Stream) -> None:
        def broken() -> None:
            raise ZeroDivisionError("boom")

        sim.launch(stream, broken)


class CupyOps:  # pragma: no cover - runs in the GPU tier only
    name = "cuda"

    def __init__(self) -> None:
        import cupy

        self.cp = cupy
        self._spin = cupy.RawKernel(
            r"""
            extern "C" __global__ void spin(long long cycles) {
                long long start = clock64();
                while (clock64() - start < cycles) { }
            }""",
            "spin",
        )
        self._wait_flag = cupy.RawKernel(
            r"""
            extern "C" __global__ void wait_flag(volatile int* flag) {
                while (*flag == 0) { __nanosleep(1000); }
            }""",
            "wait_flag",
        )
        rate_khz = cupy.cuda.runtime.deviceGetAttribute(13, 0)  # cudaDevAttrClockRate, kHz
        self._cycles_per_s = rate_khz * 1000

    def _on(self, stream: cs.Stream) -> Any:
        return self.cp.cuda.Stream.from_external(stream)

    def _delay(self, s: Any, duration: float) -> None:
        if duration > 0:
            with s:
                self._spin((1,), (1,), (np.int64(duration * self._cycles_per_s),))

    def array(self, host: np.ndarray[Any, Any]) -> Any:
        out = self.cp.asarray(host)
        self.cp.cuda.runtime.deviceSynchronize()
        return out

    def to_host(self, arr: Any) -> np.ndarray[Any, Any]:
        self.cp.cuda.runtime.deviceSynchronize()
        out: np.ndarray[Any, Any] = self.cp.asnumpy(self.cp.asarray(arr))
        return out

    def fill(self, stream: cs.Stream, arr: Any, value: float, duration: float = 0.0) -> None:
        s = self._on(stream)
        self._delay(s, duration)
        with s:
            self.cp.asarray(arr).fill(value)

    def add(self, stream: cs.Stream, arr: Any, value: float, duration: float = 0.0) -> None:
        s = self._on(stream)
        self._delay(s, duration)
        with s:
            a = self.cp.asarray(arr)
            a += value

    def copy(self, stream: cs.Stream, dst: Any, src: Any, duration: float = 0.0) -> None:
        s = self._on(stream)
        self._delay(s, duration)
        with s:
            self.cp.copyto(self.cp.asarray(dst), self.cp.asarray(src))

    def shift_in(self, stream: cs.Stream, arr: Any, digit: int, duration: float = 0.0) -> None:
        s = self._on(stream)
        self._delay(s, duration)
        with s:
            a = self.cp.asarray(arr)
            a *= 10
            a += digit

    def sum_into(self, stream: cs.Stream, out: Any, src: Any) -> None:
        with self._on(stream):
            self.cp.asarray(out)[...] = self.cp.asarray(src).sum()

    def latch(self, stream: cs.Stream) -> Any:
        cp = self.cp
        flag = cp.cuda.alloc_pinned_memory(4)
        host = np.frombuffer(flag, dtype=np.int32, count=1)
        host[0] = 0
        with self._on(stream):
            self._wait_flag((1,), (1,), (flag.ptr,))

        class _Latch:
            def release(self) -> None:
                host[0] = 1

        latch = _Latch()
        latch.keep = (flag, host)  # type: ignore[attr-defined]
        return latch

    def fail(self, stream: cs.Stream) -> None:
        import pytest

        pytest.skip("no portable way to make a kernel fail without poisoning the context")


def ops_for(backend_name: str) -> DeviceOps:
    return SimOps() if backend_name == "sim" else CupyOps()
