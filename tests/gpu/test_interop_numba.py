"""Numba device arrays and streams through cai_streams, the ordering proven with data.

A numba-cuda device array exports in ``__cuda_array_interface__`` the stream
it is *bound* to (``device_array(..., stream=s)``, ``to_device(..., stream=s)``,
``arr.bind(s)``; numba_cuda/numba/cuda/cudadrv/devicearray.py), not the stream
of the last kernel that wrote it: these tests bind the array to the producer's
stream before handing it over. As a consumer, ``numba.cuda.as_cuda_array``
synchronizes the host on the CAI stream unless ``sync=False`` (api.py,
from_cuda_array_interface); the tests pass ``sync=False`` and order it
themselves. Numba's ``cuda.stream()`` is a blocking stream (cuStreamCreate
flags 0), so the streams here are cai_streams' non-blocking ones, seen by
Numba through ``numba.cuda.external_stream``.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType
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
)

ORDERED = pytest.mark.parametrize("sync", [True, False], ids=["ordered", "control"])


class _Numba:
    """numba.cuda, its two kernels, and three device arrays made once: no Numba
    allocation or free (cuMemFree synchronizes the device) during a test."""

    def __init__(self, cuda: ModuleType) -> None:
        from . import _numba_kernels

        self.cuda: Any = cuda
        self.kernels: Any = _numba_kernels
        self.arrays = [cuda.to_device(np.zeros(N, dtype=np.float32)) for _ in range(3)]
        self._warm_up()

    def _warm_up(self) -> None:
        """Compile and load both kernels for the argument types the tests use."""
        ns, owned = self.stream()
        x, seen, _ = self.arrays
        self.fill(x, NEW, ns)
        for i in range(3):
            self.fill(x[i * (N // 3) : (i + 1) * (N // 3)], NEW, ns)
        self.copy(seen, self.view(cs.read_interface(x.bind(ns))), ns)
        owned.synchronize()

    def stream(self) -> tuple[Any, cs.Stream]:
        """A non-blocking stream as Numba sees it, and the cai_streams stream
        that owns it (keep both alive)."""
        owned = cs.Stream()
        ns = self.cuda.external_stream(owned.handle)
        assert cs.Stream.wrap(ns) == owned
        return ns, owned

    def reset(self, *values: float) -> list[Any]:
        """The preallocated arrays, filled with ``values`` (before any latch)."""
        for a, v in zip(self.arrays, values, strict=False):
            a.copy_to_device(np.full(N, v, dtype=np.float32))
        return self.arrays[: len(values)]

    def fill(self, x: Any, value: float, on: Any) -> None:
        k = self.kernels
        k.fill[k.GRID, k.BLOCK, on](x, value)

    def copy(self, dst: Any, src: Any, on: Any) -> None:
        k = self.kernels
        k.copy[k.GRID, k.BLOCK, on](dst, src)

    def view(self, obj: object) -> Any:
        """``obj`` as a Numba array without the host wait on its CAI stream."""
        return self.cuda.as_cuda_array(obj, sync=False)

    def host(self, a: Any, after: cs.Stream) -> np.ndarray[Any, Any]:
        """``a`` on the host once ``after`` (the stream that wrote it) is done.
        Only once every latch is released."""
        after.synchronize()
        out: np.ndarray[Any, Any] = a.copy_to_host()
        return out


_made: list[_Numba] = []  # one per process: made in the first test, on the cuda backend


@pytest.fixture
def nb(cuda_ops: CupyOps) -> Iterator[_Numba]:
    if not _made:
        cuda = pytest.importorskip("numba.cuda")  # silences the import-time warning
        _made.append(_Numba(cuda))
    numba = _made[0]
    with numba.cuda.defer_cleanup():  # no deferred cuMemFree flushed mid-test
        yield numba


@pytest.mark.anyio
@ORDERED
async def test_await_consume_waits_for_the_bound_numba_stream(
    nb: _Numba, cuda_ops: CupyOps, sync: bool
) -> None:
    """``await consume(x.bind(p))`` waits for the kernel on p; the control
    (sync=False) returns while it is held and the reader sees OLD."""
    (ns_p, cs_p), (ns_q, cs_q) = nb.stream(), nb.stream()
    x, seen = nb.reset(OLD, 0.0)
    latch = cuda_ops.latch(cs_p)
    nb.fill(x, NEW, ns_p)  # held behind the latch
    xp = x.bind(ns_p)
    assert xp.__cuda_array_interface__["stream"] == cs_p.handle
    releaser = Releaser(latch) if sync else None
    with racing(not sync):
        view = await cs.consume(xp, sync=sync, timeout=TIMEOUT)
    nb.copy(seen, nb.view(view), ns_q)
    await asettles(cs_q)
    if releaser is not None:
        assert releaser.fired.is_set(), "consume returned before the producer's kernel"
        releaser.join()
    else:
        latch.release()
    assert (nb.host(seen, cs_q) == (NEW if sync else OLD)).all()


@pytest.mark.anyio
@ORDERED
async def test_enqueue_consume_orders_a_numba_stream(
    nb: _Numba, cuda_ops: CupyOps, sync: bool
) -> None:
    """``consume(x, stream=c)`` with c a Numba stream: c's kernel waits for p
    on the GPU; the control's runs at once and sees OLD."""
    (ns_p, cs_p), (ns_c, cs_c) = nb.stream(), nb.stream()
    x, seen = nb.reset(OLD, 0.0)
    latch = cuda_ops.latch(cs_p)
    nb.fill(x, NEW, ns_p)
    with racing(not sync):
        view = await cs.consume(x.bind(ns_p), stream=ns_c, sync=sync, timeout=TIMEOUT)
    nb.copy(seen, nb.view(view), ns_c)
    if sync:
        assert view.stream == cs_c.handle
        still_held(cs_c)
    else:
        settles(cs_c)
    latch.release()
    assert (nb.host(seen, cs_c) == (NEW if sync else OLD)).all()


@pytest.mark.anyio
@pytest.mark.parametrize("back_edge", [True, False], ids=["consuming", "control"])
async def test_consuming_holds_the_numba_producer_until_the_reader_is_done(
    nb: _Numba, cuda_ops: CupyOps, back_edge: bool
) -> None:
    """Write after read: with the reader's stream c latched, leaving
    ``consuming(x.bind(p), stream=c)`` makes p wait for c, so p's next kernel
    cannot overwrite x under the reader. The control (``consume``) lets it."""
    (ns_p, cs_p), (ns_c, cs_c) = nb.stream(), nb.stream()
    x, seen = nb.reset(OLD, 0.0)
    latch = cuda_ops.latch(cs_c)
    xp = x.bind(ns_p)
    with racing(not back_edge):
        if back_edge:
            async with cs.consuming(xp, stream=ns_c, timeout=TIMEOUT) as view:
                nb.copy(seen, nb.view(view), ns_c)
        else:
            view = await cs.consume(xp, stream=ns_c, timeout=TIMEOUT)
            nb.copy(seen, nb.view(view), ns_c)
        nb.fill(x, NEW, ns_p)  # the producer reuses its buffer
    if back_edge:
        still_held(cs_p)
    else:
        settles(cs_p)
    latch.release()
    assert (nb.host(seen, cs_c) == (OLD if back_edge else NEW)).all()
    assert (nb.host(x, cs_p) == NEW).all()


@ORDERED
def test_consume_blocking_waits_for_the_bound_numba_stream(
    nb: _Numba, cuda_ops: CupyOps, sync: bool
) -> None:
    """``consume_blocking`` returns only after p's kernel (a timer thread
    releases the latch); the control returns at once and sees OLD."""
    (ns_p, cs_p), (ns_q, cs_q) = nb.stream(), nb.stream()
    x, seen = nb.reset(OLD, 0.0)
    latch = cuda_ops.latch(cs_p)
    nb.fill(x, NEW, ns_p)
    releaser = Releaser(latch) if sync else None
    with racing(not sync):
        view = cs.consume_blocking(x.bind(ns_p), sync=sync, timeout=TIMEOUT)
    nb.copy(seen, nb.view(view), ns_q)
    settles(cs_q)
    if releaser is not None:
        assert releaser.fired.is_set(), "consume_blocking returned before the kernel"
        releaser.join()
    else:
        latch.release()
    assert (nb.host(seen, cs_q) == (NEW if sync else OLD)).all()


@pytest.mark.parametrize("last", [0, 1, 2, None], ids=["last0", "last1", "last2", "control"])
def test_three_numba_writers_joined_for_cupy(
    nb: _Numba, cuda_ops: CupyOps, last: int | None
) -> None:
    """The spec's 7/9/15 -> 3 join: three Numba kernels on three streams fill
    a tracked buffer's thirds; CuPy enqueues its read on the stream that
    ``t.__cuda_array_interface__`` names, and stays pending until every writer
    is released (``last`` is released last). The control reads on the stream a
    Numba array bound to writer 2 exports: it sees the other thirds OLD."""
    cp = pytest.importorskip("cupy")
    warm_cupy(cp)
    buf = nb.cuda.to_device(np.full(N, OLD, dtype=np.float32))  # tracked: a fresh array
    seen = cp.zeros(N, dtype=cp.float32)
    cp.cuda.Stream.null.synchronize()
    writers = [nb.stream() for _ in range(3)]
    t = cs.track(buf, stream=cs.Stream())
    n = N // 3
    latches = [cuda_ops.latch(w) for _, w in writers]
    for i, (ns, _) in enumerate(writers):
        with t.writing(ns, disjoint=True):
            nb.fill(buf[i * n : (i + 1) * n], NEW, ns)
    with racing(last is None):
        if last is not None:
            view = cs.read_interface(t)  # one export: the three writers joined
        else:
            view = cs.read_interface(buf.bind(writers[2][0]))  # writer 2's stream only
        consumer = cp.cuda.Stream.from_external(cs.Stream.wrap(view.stream))
        with consumer:  # the consumer enqueues on the CAI stream
            cp.copyto(seen, cp.asarray(view.with_stream(None)))
        release_writers(latches, [w for _, w in writers], cs.Stream.wrap(consumer), last)
    assert (cp.asnumpy(seen, stream=consumer) == expected_thirds(last)).all()
