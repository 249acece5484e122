"""CuPy arrays and streams through cai_streams, the ordering proven with data.

CuPy (14.x, cupy/_core/core.pyx) exports its *current* stream in
``__cuda_array_interface__`` (1 for the null stream), not the stream that
wrote the array: each test consumes inside ``with producer:``, the pattern the
docs give. Each test holds a stream with a latch, and beside it runs a control
(``sync=False``, or no back-edge, or no join) that sees the wrong data.
"""

from __future__ import annotations

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
    racing,
    release_writers,
    settles,
    still_held,
    warm_cupy,
    warm_torch,
)

ORDERED = pytest.mark.parametrize("sync", [True, False], ids=["ordered", "control"])


@pytest.fixture
def cp(cuda_ops: CupyOps) -> Any:
    cupy = pytest.importorskip("cupy")
    warm_cupy(cupy)
    return cupy


def _streams(cp: Any, n: int) -> list[tuple[Any, cs.Stream]]:
    """``n`` non-blocking CuPy streams, each with its cai_streams wrapper."""
    out = []
    for _ in range(n):
        s = cp.cuda.Stream(non_blocking=True)
        wrapped = cs.Stream.wrap(s)
        assert wrapped.handle == s.ptr
        out.append((s, wrapped))
    return out


def _full(cp: Any, value: float) -> Any:
    null = cp.cuda.Stream.null
    with null:
        a = cp.full(N, value, dtype=cp.float32)
    null.synchronize()  # before any latch: nothing is held yet
    return a


def _cupy(cp: Any, view: cs.ArrayView) -> Any:
    """The view as a CuPy array. Without ``with_stream(None)`` CuPy would block
    the host in cudaStreamSynchronize on the view's stream (core.pyx,
    _convert_object_with_cuda_array_interface); the tests order it themselves."""
    return cp.asarray(view.with_stream(None))


def _host(cp: Any, a: Any, after: Any) -> np.ndarray[Any, Any]:
    """``a`` on the host, read on ``after`` (the stream that wrote it). Only
    once every latch is released."""
    out: np.ndarray[Any, Any] = cp.asnumpy(a, stream=after)
    return out


@pytest.mark.anyio
@ORDERED
async def test_await_consume_waits_for_the_stream_cupy_exports(
    cp: Any, cuda_ops: CupyOps, sync: bool
) -> None:
    """Host readiness: ``await consume(x)`` inside ``with p:`` returns only after
    p's write; the control (sync=False) returns while it is held and sees OLD."""
    (p, cs_p), (q, cs_q) = _streams(cp, 2)
    x, seen = _full(cp, OLD), _full(cp, 0.0)
    latch = cuda_ops.latch(cs_p)
    with p:
        x.fill(NEW)  # held behind the latch
    releaser = Releaser(latch) if sync else None
    with racing(not sync), p:  # inside `with p`, CuPy's CAI names p
        view = await cs.consume(x, sync=sync, timeout=TIMEOUT)
    # The consumer reads at once, on a stream that waits for nothing.
    with q:
        cp.copyto(seen, _cupy(cp, view))
    await asettles(cs_q)
    if releaser is not None:
        assert releaser.fired.is_set(), "consume returned before the producer's write"
        assert view.stream is None
        releaser.join()
    else:
        assert view.stream == p.ptr  # CuPy exported the producer's stream
        latch.release()
    assert (_host(cp, seen, q) == (NEW if sync else OLD)).all()


@pytest.mark.anyio
@ORDERED
async def test_enqueue_consume_orders_a_cupy_stream(cp: Any, cuda_ops: CupyOps, sync: bool) -> None:
    """``consume(x, stream=c)`` makes c wait for p on the GPU: c's copy stays
    pending while p is held. The control's c copies at once and sees OLD."""
    (p, cs_p), (c, cs_c) = _streams(cp, 2)
    x, seen = _full(cp, OLD), _full(cp, 0.0)
    latch = cuda_ops.latch(cs_p)
    with racing(not sync), p:
        x.fill(NEW)
        view = await cs.consume(x, stream=c, sync=sync, timeout=TIMEOUT)  # a CuPy stream
    with c:
        cp.copyto(seen, _cupy(cp, view))
    if sync:
        assert view.stream == c.ptr
        still_held(cs_c)
    else:
        settles(cs_c)
    latch.release()
    assert (_host(cp, seen, c) == (NEW if sync else OLD)).all()


@pytest.mark.anyio
@pytest.mark.parametrize("back_edge", [True, False], ids=["consuming", "control"])
async def test_consuming_holds_the_cupy_producer_until_the_reader_is_done(
    cp: Any, cuda_ops: CupyOps, back_edge: bool
) -> None:
    """Write after read: the consumer's stream c is slow (latched). Leaving
    ``consuming(x, stream=c)`` makes p wait for c, so p's next write cannot
    overwrite x while c still reads it. The control (``consume``, no
    back-edge) lets p overwrite first: the reader sees NEW."""
    (p, cs_p), (c, cs_c) = _streams(cp, 2)
    x, seen = _full(cp, OLD), _full(cp, 0.0)
    latch = cuda_ops.latch(cs_c)
    with racing(not back_edge), p:
        if back_edge:
            async with cs.consuming(x, stream=cs_c, timeout=TIMEOUT) as view:
                with c:
                    cp.copyto(seen, _cupy(cp, view))
        else:
            view = await cs.consume(x, stream=cs_c, timeout=TIMEOUT)
            with c:
                cp.copyto(seen, _cupy(cp, view))
        x.fill(NEW)  # the producer reuses its buffer, on p
    if back_edge:
        still_held(cs_p)
    else:
        settles(cs_p)
    latch.release()
    assert (_host(cp, seen, c) == (OLD if back_edge else NEW)).all()
    assert (_host(cp, x, p) == NEW).all()


@ORDERED
def test_consume_blocking_waits_for_the_cupy_stream(cp: Any, cuda_ops: CupyOps, sync: bool) -> None:
    """``consume_blocking`` returns only after p's write (a timer thread
    releases the latch); the control returns at once and sees OLD."""
    (p, cs_p), (q, cs_q) = _streams(cp, 2)
    x, seen = _full(cp, OLD), _full(cp, 0.0)
    latch = cuda_ops.latch(cs_p)
    with p:
        x.fill(NEW)
    releaser = Releaser(latch) if sync else None
    with racing(not sync), p:
        view = cs.consume_blocking(x, sync=sync, timeout=TIMEOUT)
    with q:
        cp.copyto(seen, _cupy(cp, view))
    settles(cs_q)
    if releaser is not None:
        assert releaser.fired.is_set(), "consume_blocking returned before the write"
        releaser.join()
    else:
        latch.release()
    assert (_host(cp, seen, q) == (NEW if sync else OLD)).all()


@pytest.mark.parametrize("last", [0, 1, 2, None], ids=["last0", "last1", "last2", "control"])
def test_three_cupy_writers_joined_for_a_torch_consumer(
    cp: Any, cuda_ops: CupyOps, last: int | None
) -> None:
    """The spec's example: a buffer written on three CuPy streams (7, 9, 15),
    tracked; ``t.__cuda_array_interface__`` joins them onto one stream (3).
    PyTorch ignores the CAI ``stream`` entry, so the torch consumer enqueues on
    that stream itself; it stays pending until every writer is released
    (``last`` is released last). The control's consumer is on writer 2's
    stream alone (what CuPy's CAI says inside ``with`` that stream): it sees
    the other thirds OLD."""
    torch = pytest.importorskip("torch")
    warm_torch(torch)
    writers = _streams(cp, 3)
    buf = _full(cp, OLD)
    seen = torch.zeros(N, device="cuda", dtype=torch.float32)
    torch.cuda.default_stream().synchronize()
    export = cs.Stream()
    t = cs.track(buf, stream=export)
    n = N // 3
    latches = [cuda_ops.latch(w) for _, w in writers]
    for i, (s, _) in enumerate(writers):
        with t.writing(s, disjoint=True), s:
            buf[i * n : (i + 1) * n].fill(NEW)
    with racing(last is None):
        if last is not None:
            view = cs.read_interface(t)  # one export: the three writers joined
            assert view.stream == export.handle
        else:
            with writers[2][0]:
                view = cs.read_interface(buf)  # CuPy's own CAI: writer 2's stream only
            assert view.stream == writers[2][0].ptr
        # The consumer enqueues on the CAI stream itself (torch would not
        # look at the entry: test_interop_torch.py shows it).
        consumer = torch.cuda.ExternalStream(view.stream)
        with torch.cuda.stream(consumer):
            seen.copy_(torch.as_tensor(view.with_stream(None), device="cuda"))
        release_writers(latches, [w for _, w in writers], cs.Stream.wrap(consumer), last)
    consumer.synchronize()  # every latch is released
    assert (seen.cpu().numpy() == expected_thirds(last)).all()
