"""cuda.core streams through cai_streams, and cuda.core as a consumer.

cuda.core has streams but no array kernels: the arrays are CuPy's and the
kernels CupyOps' (fill, copy), enqueued on cuda.core streams (which are
non-blocking by default: ``StreamOptions(nonblocking=True)``). cs streams go
into cuda.core with ``Device().create_stream(obj)`` (the ``__cuda_stream__``
protocol). As a consumer, ``StridedMemoryView.from_cuda_array_interface(obj,
stream_ptr=consumer)`` records an event on the CAI ``stream`` and makes the
consumer stream wait on it, without blocking the host; ``stream_ptr=-1`` opts
out (cuda_core/cuda/core/_memoryview.pyx, view_as_cai).
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import pytest

import cai_streams as cs

from ..device_ops import CupyOps
from ._interop import (
    NEW,
    OLD,
    TIMEOUT,
    N,
    Releaser,
    asettles,
    expected_thirds,
    ordered_elsewhere,
    racing,
    release_writers,
    settles,
    still_held,
    warm_cupy,
)

ORDERED = pytest.mark.parametrize("sync", [True, False], ids=["ordered", "control"])


class _Core:
    """cuda.core (1.x names; 0.x's ``cuda.core.experimental`` as a fallback)."""

    def __init__(self) -> None:
        core: Any = pytest.importorskip("cuda.core")
        if not hasattr(core, "Device"):  # cuda.core 0.x
            core = pytest.importorskip("cuda.core.experimental")
        self.core = core
        self.smv_type: Any = importlib.import_module(core.__name__ + ".utils").StridedMemoryView
        self.device: Any = core.Device()
        self.device.set_current()

    def stream(self) -> tuple[Any, cs.Stream]:
        """A new cuda.core stream, and its cai_streams wrapper."""
        s = self.device.create_stream()
        wrapped = cs.Stream.wrap(s)
        assert wrapped.handle == int(s.handle)
        return s, wrapped

    def strided_view(self, obj: object, stream_ptr: int) -> Any:
        """cuda.core's CAI consumer: orders ``stream_ptr`` after the CAI stream."""
        make = getattr(self.smv_type, "from_cuda_array_interface", None)
        if make is None:  # cuda.core before the classmethods
            return self.smv_type(obj, stream_ptr=stream_ptr)
        return make(obj, stream_ptr=stream_ptr)


@pytest.fixture
def core(cuda_ops: CupyOps) -> _Core:
    warm_cupy(cuda_ops.cp)
    return _Core()


def _arrays(ops: CupyOps, *values: float) -> list[Any]:
    return [ops.array(np.full(N, v, dtype=np.float32)) for v in values]


def _host(ops: CupyOps, a: Any, after: cs.Stream) -> np.ndarray[Any, Any]:
    """``a`` on the host once ``after`` (the stream that wrote it) is done.
    Only once every latch is released."""
    after.synchronize()
    return ops.to_host(a)


def _cupy_over(ops: CupyOps, view: Any) -> Any:
    """A CuPy array over a StridedMemoryView's memory (no copy, no sync)."""
    cp = ops.cp
    assert tuple(view.shape) == (N,) and np.dtype(view.dtype) == np.float32
    memory = cp.cuda.UnownedMemory(view.ptr, N * 4, view)
    return cp.ndarray((N,), cp.float32, cp.cuda.MemoryPointer(memory, 0))


def test_streams_go_both_ways(core: _Core) -> None:
    """A cuda.core stream wraps as a cs stream, and a cs stream as a cuda.core one."""
    s, wrapped = core.stream()
    assert wrapped == cs.Stream.wrap(int(s.handle))
    owned = cs.Stream()
    assert int(core.device.create_stream(owned).handle) == owned.handle


@pytest.mark.anyio
@ORDERED
async def test_await_consume_with_a_cuda_core_producer_stream(
    core: _Core, cuda_ops: CupyOps, sync: bool
) -> None:
    """A tracked write inside ``writing(p)`` (p a cuda.core stream) is waited for
    by ``await consume``; the control (sync=False) returns while it is held."""
    (p, cs_p), (_, cs_q) = core.stream(), core.stream()
    x, seen = _arrays(cuda_ops, OLD, 0.0)
    t = cs.track(x)
    latch = cuda_ops.latch(cs_p)
    with t.writing(p):
        cuda_ops.fill(cs_p, x, NEW)  # held behind the latch
    releaser = Releaser(latch) if sync else None
    with racing(not sync):
        view = await cs.consume(t, sync=sync, timeout=TIMEOUT)
    cuda_ops.copy(cs_q, seen, view)  # the reader, on a stream that waits for nothing
    await asettles(cs_q)
    if releaser is not None:
        assert releaser.fired.is_set(), "consume returned before the producer's write"
        releaser.join()
    else:
        latch.release()
    assert (_host(cuda_ops, seen, cs_q) == (NEW if sync else OLD)).all()


@pytest.mark.anyio
@ORDERED
async def test_enqueue_consume_orders_a_cuda_core_stream(
    core: _Core, cuda_ops: CupyOps, sync: bool
) -> None:
    """``consume(t, stream=c)`` with c a cuda.core stream: c waits for p on the
    GPU; the control's c copies at once and sees OLD."""
    (p, cs_p), (c, cs_c) = core.stream(), core.stream()
    x, seen = _arrays(cuda_ops, OLD, 0.0)
    t = cs.track(x)
    latch = cuda_ops.latch(cs_p)
    with t.writing(p):
        cuda_ops.fill(cs_p, x, NEW)
    with racing(not sync):
        view = await cs.consume(t, stream=c, sync=sync, timeout=TIMEOUT)
    cuda_ops.copy(cs_c, seen, view)
    if sync:
        assert view.stream == int(c.handle)
        still_held(cs_c)
    else:
        settles(cs_c)
    latch.release()
    assert (_host(cuda_ops, seen, cs_c) == (NEW if sync else OLD)).all()


@pytest.mark.parametrize("ordered", [True, False], ids=["stream_ptr", "control"])
def test_strided_memory_view_orders_its_stream_after_the_export(
    core: _Core, cuda_ops: CupyOps, ordered: bool
) -> None:
    """cuda.core as the consumer of a tracked array: its StridedMemoryView makes
    the consumer stream wait on ``t.__cuda_array_interface__['stream']``; with
    ``stream_ptr=-1`` (its opt-out, the control) it does not, and sees OLD."""
    (p, cs_p), (c, cs_c) = core.stream(), core.stream()
    x, seen = _arrays(cuda_ops, OLD, 0.0)
    t = cs.track(x, stream=cs.Stream())
    latch = cuda_ops.latch(cs_p)
    with t.writing(p):
        cuda_ops.fill(cs_p, x, NEW)
    with ordered_elsewhere():  # (the control races on purpose)
        view = core.strided_view(t, int(c.handle) if ordered else -1)
        cuda_ops.copy(cs_c, seen, _cupy_over(cuda_ops, view))
    if ordered:
        still_held(cs_c)
    else:
        settles(cs_c)
    latch.release()
    assert (_host(cuda_ops, seen, cs_c) == (NEW if ordered else OLD)).all()


@pytest.mark.anyio
@ORDERED
async def test_consuming_holds_the_cuda_core_producer_until_the_reader_is_done(
    core: _Core, cuda_ops: CupyOps, sync: bool
) -> None:
    """Write after read, with the reader's cuda.core stream c latched: after
    ``consuming(t, stream=c)`` the producer's next ``writing(p)`` waits for c
    (the reader sees OLD); with sync=False there is no back-edge (it sees NEW)."""
    (p, cs_p), (c, cs_c) = core.stream(), core.stream()
    x, seen = _arrays(cuda_ops, OLD, 0.0)
    t = cs.track(x)
    latch = cuda_ops.latch(cs_c)
    with racing(not sync):
        async with cs.consuming(t, stream=c, sync=sync, timeout=TIMEOUT) as view:
            cuda_ops.copy(cs_c, seen, view)
        with t.writing(p):
            cuda_ops.fill(cs_p, x, NEW)  # the producer reuses its buffer
    if sync:
        still_held(cs_p)
    else:
        settles(cs_p)
    latch.release()
    assert (_host(cuda_ops, seen, cs_c) == (OLD if sync else NEW)).all()
    assert (_host(cuda_ops, x, cs_p) == NEW).all()


@ORDERED
def test_consume_blocking_with_a_cuda_core_producer_stream(
    core: _Core, cuda_ops: CupyOps, sync: bool
) -> None:
    """``consume_blocking(t)`` returns only after the write on the cuda.core
    stream (a timer thread releases the latch); the control returns at once."""
    (p, cs_p), (_, cs_q) = core.stream(), core.stream()
    x, seen = _arrays(cuda_ops, OLD, 0.0)
    t = cs.track(x)
    latch = cuda_ops.latch(cs_p)
    with t.writing(p):
        cuda_ops.fill(cs_p, x, NEW)
    releaser = Releaser(latch) if sync else None
    with racing(not sync):
        view = cs.consume_blocking(t, sync=sync, timeout=TIMEOUT)
    cuda_ops.copy(cs_q, seen, view)
    settles(cs_q)
    if releaser is not None:
        assert releaser.fired.is_set(), "consume_blocking returned before the write"
        releaser.join()
    else:
        latch.release()
    assert (_host(cuda_ops, seen, cs_q) == (NEW if sync else OLD)).all()


@pytest.mark.parametrize("last", [0, 1, 2, None], ids=["last0", "last1", "last2", "control"])
def test_three_cuda_core_writers_joined_for_a_strided_memory_view(
    core: _Core, cuda_ops: CupyOps, last: int | None
) -> None:
    """The spec's 7/9/15 -> 3 join on three cuda.core streams, consumed by
    cuda.core's StridedMemoryView on its own stream c: c stays pending until
    every writer is released (``last`` last). The control's view is of a CAI
    naming writer 2's stream alone: c completes while writers 0 and 1 are held."""
    (buf, seen) = _arrays(cuda_ops, OLD, 0.0)
    writers = [core.stream() for _ in range(3)]
    c, cs_c = core.stream()
    t = cs.track(buf, stream=cs.Stream())
    n = N // 3
    latches = [cuda_ops.latch(w) for _, w in writers]
    for i, (s, w) in enumerate(writers):
        with t.writing(s, disjoint=True):
            cuda_ops.fill(w, buf[i * n : (i + 1) * n], NEW)
    with ordered_elsewhere():  # (the control races on purpose)
        if last is not None:
            view = core.strided_view(t, int(c.handle))  # one export: three writers joined
        else:
            writer2 = cs.read_interface(buf).with_stream(writers[2][1].handle)
            view = core.strided_view(writer2, int(c.handle))
        cuda_ops.copy(cs_c, seen, _cupy_over(cuda_ops, view))
        release_writers(latches, [w for _, w in writers], cs_c, last)
    assert (_host(cuda_ops, seen, cs_c) == expected_thirds(last)).all()
