"""Kernels the behavioural suite needs, on each backend.

The suite proves ordering with data: a kernel that runs too early reads or
writes the wrong values. ``latch`` holds a stream until the host releases it,
so "B did not wait for A" shows deterministically, not by timing luck.
On sim the kernels are Python callables; on cuda they are CuPy kernels (the
latch spins on a host-mapped flag).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Protocol

import anyio
import numpy as np

import cai_streams as cs
from cai_streams import _observe, sim
from cai_streams._interface import byte_range
from cai_streams._stream import stream_handle_of

LATCH_TIMEOUT = 20.0
KERNELS = Path(__file__).resolve().parent / "kernels"


class Latch(Protocol):
    def release(self) -> None: ...


async def consume_after_latch(obj: object, latch: Latch) -> cs.ArrayView:
    """``await cs.consume(obj)`` in a task while ``latch`` holds the producer's
    stream: it must not return until the latch is released."""
    got: list[cs.ArrayView] = []

    async def host() -> None:
        got.append(await cs.consume(obj, timeout=10))

    async with anyio.create_task_group() as tg:
        tg.start_soon(host)
        await anyio.sleep(0.02)
        assert not got, "a host consumer returned before the producer's work"
        latch.release()
    (view,) = got
    return view


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
    def release_all(self) -> None: ...
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

    def __init__(self) -> None:
        self._held: list[_SimLatch] = []

    def latch(self, stream: cs.Stream) -> _SimLatch:
        latch = _SimLatch()
        sim.launch(stream, latch.kernel, name="latch")
        self._held.append(latch)
        return latch

    def release_all(self) -> None:
        held, self._held = self._held, []
        for latch in held:
            latch.release()

    def fail(self, stream: cs.Stream) -> None:
        def broken() -> None:
            raise ZeroDivisionError("boom")

        sim.launch(stream, broken)


def _declare(
    stream: cs.Stream, name: str, reads: tuple[Any, ...] = (), writes: tuple[Any, ...] = ()
) -> None:  # pragma: no cover - runs in the GPU tier only
    """Tell the sanitizer what a CuPy kernel about to be enqueued on ``stream``
    reads and writes, as ``sim.launch(reads=, writes=)`` does for a simulated
    one (the same names): the suite's hazard checks then hold on cuda too."""
    if _observe.active:
        backend = stream.backend if isinstance(stream, cs.Stream) else cs.current_backend()
        _observe.stream_access(
            backend,
            stream_handle_of(stream),
            reads=[byte_range(cs.read_interface(a)) for a in reads],
            writes=[byte_range(cs.read_interface(a)) for a in writes],
            what=f"kernel {name!r}",
        )


class CupyOps:  # pragma: no cover - runs in the GPU tier only
    """The same kernels on a real device, through CuPy.

    Behaves like :class:`SimOps` and never synchronizes more than it must, so a
    held (latched) stream cannot deadlock the test's own thread:

    * ``array`` and ``to_host`` copy on the legacy stream and synchronize only
      it (like ``cudaMemcpy``), which by the CUDA documentation never waits for
      the non-blocking streams the tests make; on an H100 it did wait for eight
      held ones (docs/gpu.md), so a test makes its arrays before it latches;
    * every kernel argument reaches CuPy without a CAI ``stream``: the ordering
      is what the test enqueued, and CuPy would otherwise block the host in
      ``cudaStreamSynchronize`` on the view's stream;
    * every kernel is compiled and loaded once, before any latch is held
      (loading a module may synchronize the context), and the latch flags are
      pinned memory allocated once (a pinned allocation may synchronize too);
    * a latch gives up after ``LATCH_TIMEOUT`` (read from ``%globaltimer``) and
      says so at teardown, so a test that forgets to release it fails instead
      of hanging the rest of the run.
    """

    name = "cuda"
    _SLOTS = 4096
    _shared: CupyOps | None = None

    def __new__(cls) -> CupyOps:
        if cls._shared is None:  # one compile, one pinned block per process
            self = super().__new__(cls)
            self._setup()
            cls._shared = self
        return cls._shared

    def _setup(self) -> None:
        import cupy

        self.cp = cupy
        source = (KERNELS / "device_ops.cu").read_text()
        module = cupy.RawModule(code=source, options=("-std=c++17",))
        self._spin = module.get_function("spin")
        self._wait_flag = module.get_function("wait_flag")
        # flags[0::2]: released, flags[1::2]: expired
        self._pinned = cupy.cuda.alloc_pinned_memory(8 * self._SLOTS)
        self._flags = np.frombuffer(self._pinned, dtype=np.int32, count=2 * self._SLOTS)
        self._flags[...] = 0
        self._next_slot = 0
        self._held: list[int] = []
        self._lock = threading.Lock()
        self._warm_up()

    def _warm_up(self) -> None:
        """Run every kernel the tests use once, with no stream held."""
        cp = self.cp
        null = cp.cuda.Stream.null
        for dtype in ("float32", "float64", "int32", "int64"):  # one module per dtype
            for size in (1, 4, 64, 256, 300):
                x = cp.zeros(size, dtype)
                y = cp.zeros(size, dtype)
                self._fill(null, x, 1.0)
                self._add(null, x, 1.0 if x.dtype.kind == "f" else 1)  # (same_kind)
                self._shift_in(null, x, 3)
                self._copy(null, y, x)
                self._sum_into(null, y[:1], x)
                cp.asnumpy(x[1:], stream=null)
        with null:
            self._spin((1,), (1,), (np.uint64(1000),))
            slot = self._take_slot()
            self._flags[2 * slot] = 1
            self._launch_latch(slot)
        null.synchronize()

    def _stream(self, stream: cs.Stream) -> Any:
        return self.cp.cuda.Stream.from_external(stream)

    def _cupy(self, obj: Any) -> Any:
        """``obj`` as a CuPy array, without letting CuPy synchronize on its stream."""
        if isinstance(obj, self.cp.ndarray):
            return obj
        return self.cp.asarray(cs.read_interface(obj).with_stream(None))

    def _delay(self, s: Any, duration: float) -> None:
        if duration > 0:
            with s:
                self._spin((1,), (1,), (np.uint64(int(duration * 1e9)),))

    def array(self, host: np.ndarray[Any, Any]) -> Any:
        # cudaMemcpy from pageable memory (legacy stream), not cupy.asarray:
        # that stages through CuPy's pinned pool, and a new pinned block
        # (cudaHostAlloc) waits for every running kernel, a held latch included.
        src = np.ascontiguousarray(host)
        out = self.cp.empty(src.shape, src.dtype)
        if src.nbytes:
            out.data.copy_from_host(src.ctypes.data, src.nbytes)
            # From pageable memory cudaMemcpy may return before the DMA ends: the
            # data is in place when this returns, as on the simulator (a track()
            # of the array would otherwise find the legacy stream still busy).
            self.cp.cuda.Stream.null.synchronize()
        return out

    def to_host(self, arr: Any) -> np.ndarray[Any, Any]:
        null = self.cp.cuda.Stream.null
        out: np.ndarray[Any, Any] = self.cp.asnumpy(self._cupy(arr), stream=null)
        null.synchronize()
        return out

    def _fill(self, s: Any, arr: Any, value: float) -> None:
        with s:
            self._cupy(arr).fill(value)

    def _add(self, s: Any, arr: Any, value: float) -> None:
        with s:
            a = self._cupy(arr)
            a += value

    def _copy(self, s: Any, dst: Any, src: Any) -> None:
        with s:
            self.cp.copyto(self._cupy(dst), self._cupy(src))

    def _shift_in(self, s: Any, arr: Any, digit: int) -> None:
        with s:
            a = self._cupy(arr)
            a *= 10
            a += digit

    def _sum_into(self, s: Any, out: Any, src: Any) -> None:
        with s:
            self._cupy(out)[...] = self._cupy(src).sum()

    def fill(self, stream: cs.Stream, arr: Any, value: float, duration: float = 0.0) -> None:
        s = self._stream(stream)
        self._delay(s, duration)
        _declare(stream, "fill", writes=(arr,))
        self._fill(s, arr, value)

    def add(self, stream: cs.Stream, arr: Any, value: float, duration: float = 0.0) -> None:
        s = self._stream(stream)
        self._delay(s, duration)
        _declare(stream, "add", reads=(arr,), writes=(arr,))
        self._add(s, arr, value)

    def copy(self, stream: cs.Stream, dst: Any, src: Any, duration: float = 0.0) -> None:
        s = self._stream(stream)
        self._delay(s, duration)
        _declare(stream, "copy", reads=(src,), writes=(dst,))
        self._copy(s, dst, src)

    def shift_in(self, stream: cs.Stream, arr: Any, digit: int, duration: float = 0.0) -> None:
        s = self._stream(stream)
        self._delay(s, duration)
        _declare(stream, "shift_in", reads=(arr,), writes=(arr,))
        self._shift_in(s, arr, digit)

    def sum_into(self, stream: cs.Stream, out: Any, src: Any) -> None:
        _declare(stream, "total", reads=(src,), writes=(out,))
        self._sum_into(self._stream(stream), out, src)

    def _take_slot(self) -> int:
        with self._lock:
            if self._next_slot >= self._SLOTS:
                raise RuntimeError(f"more than {self._SLOTS} latches in one run")
            slot = self._next_slot
            self._next_slot += 1
            return slot

    def _launch_latch(self, slot: int) -> None:
        base = self._pinned.ptr + 8 * slot
        deadline = np.uint64(int(LATCH_TIMEOUT * 1e9))
        self._wait_flag((1,), (1,), (base, base + 4, deadline))

    def latch(self, stream: cs.Stream) -> _CudaLatch:
        slot = self._take_slot()
        with self._stream(stream):
            self._launch_latch(slot)
        with self._lock:
            self._held.append(slot)
        return _CudaLatch(self._flags, slot)

    def release_all(self) -> None:
        with self._lock:
            held, self._held = self._held, []
        for slot in held:
            self._flags[2 * slot] = 1
        expired = [slot for slot in held if self._flags[2 * slot + 1]]
        if expired:
            raise AssertionError(
                f"{len(expired)} latch kernel(s) gave up after {LATCH_TIMEOUT} s: "
                "the test held a stream and then waited for it on the host"
            )

    def fail(self, stream: cs.Stream) -> None:
        # A device-side fault is sticky: it would poison the context for the
        # rest of the run. Tests call this only after checking ops.name.
        raise NotImplementedError("no kernel failure on a real device in the shared suite")


class _CudaLatch:  # pragma: no cover - runs in the GPU tier only
    __slots__ = ("_flags", "_slot")

    def __init__(self, flags: np.ndarray[Any, Any], slot: int) -> None:
        self._flags = flags
        self._slot = slot

    def release(self) -> None:
        self._flags[2 * self._slot] = 1

    @property
    def expired(self) -> bool:
        """Whether the kernel gave up waiting (its deadline passed first)."""
        return bool(self._flags[2 * self._slot + 1])


def held(stream_or_event: cs.Stream | cs.Event) -> bool:
    """Whether the work so far is still not done 50 ms later: long enough for
    work that did not wait for a held stream to have run (a record made just
    now is not done at once even on an idle stream: asked at once, "not done"
    would prove nothing)."""
    event = stream_or_event.record() if isinstance(stream_or_event, cs.Stream) else stream_or_event
    time.sleep(0.05)
    return not event.is_done


def ops_for(backend_name: str) -> DeviceOps:
    return SimOps() if backend_name == "sim" else CupyOps()


def consume_returns(obj: object, timeout: float) -> bool:
    """Whether ``cs.consume_blocking(obj, timeout=timeout)`` returned (False: it
    timed out, its producer's work still pending)."""
    try:
        cs.consume_blocking(obj, timeout=timeout)
    except TimeoutError:
        return False
    return True


class ForeignStream:
    """Another library's stream: a raw backend stream behind ``__cuda_stream__``.
    A wrapper of it keeps this object alive and the library does not see its
    end, so consumer reads on it count toward ``MAX_OPEN_READS``. Destroyed
    after the test (:func:`close_foreign_streams`), once what recorded on it
    has run."""

    def __init__(self) -> None:
        self.backend = cs.current_backend()
        self.handle = self.backend.create_stream()
        _foreign.append(self)

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


_foreign: list[ForeignStream] = []


def foreign_streams(n: int) -> list[cs.Stream]:
    """Wrappers of ``n`` new :class:`ForeignStream`."""
    return [cs.Stream.wrap(ForeignStream()) for _ in range(n)]


def close_foreign_streams() -> None:
    """Synchronize and destroy every :class:`ForeignStream` made so far (the
    test that made them has ended, and a collection has run: their tracked
    arrays recorded what they had to)."""
    made, _foreign[:] = list(_foreign), []
    for f in made:
        f.backend.synchronize_stream(f.handle)
        f.backend.destroy_stream(f.handle)


@contextlib.asynccontextmanager
async def consuming_past_the_open_reads(t: cs.TrackedArray, s: cs.Stream) -> AsyncIterator[None]:
    """``consuming(t, stream=s)`` whose consumer read is recorded early in the
    body: as many consumers on other libraries' streams as ``MAX_OPEN_READS``
    make it the oldest open read (``s`` must be such a stream too: a read on a
    stream the library made stays open until the stream ends). What the body
    enqueues after that is covered only by the body's own end (its record, at
    its exit or at its stream's close)."""
    from cai_streams._pending import MAX_OPEN_READS

    others = foreign_streams(MAX_OPEN_READS)
    async with cs.consuming(t, stream=s, timeout=5):
        for o in others:
            await cs.consume(t, stream=o, timeout=5)
        yield


@contextlib.contextmanager
def writing_in_another_thread(t: cs.TrackedArray, s: cs.Stream) -> Iterator[threading.Event]:
    """Another thread holds ``t.writing(s)`` open for the body of the block, or
    until the body sets the event it is given."""
    entered, leave = threading.Event(), threading.Event()

    def hold() -> None:
        with t.writing(s):
            entered.set()
            leave.wait(10)

    th = threading.Thread(target=hold)
    th.start()
    try:
        assert entered.wait(10)
        yield leave
    finally:
        leave.set()
        th.join(10)
