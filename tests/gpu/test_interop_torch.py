"""PyTorch tensors and streams through cai_streams, the ordering proven with data.

PyTorch's ``__cuda_array_interface__`` is version 2 with no ``stream`` entry
(torch/_tensor.py), so an untracked tensor is taken as ready whatever is
pending on it: only tracking (``with cs.track(x).writing(stream):``) orders
it. Each test's control is that untracked program, which sees the wrong data.
As a consumer, ``torch.as_tensor`` ignores the ``stream`` entry
(torch/csrc/utils/tensor_numpy.cpp, tensor_from_cuda_array_interface).
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import pytest

import cai_streams as cs

from ..device_ops import CupyOps
from ._interop import (
    NEW,
    OLD,
    RELEASE_AFTER,
    TIMEOUT,
    N,
    Releaser,
    asettles,
    expected_thirds,
    racing,
    settles,
    still_held,
    warm_cupy,
    warm_torch,
)

TRACKED = pytest.mark.parametrize("tracked", [True, False], ids=["tracked", "control"])


@pytest.fixture
def torch(cuda_ops: CupyOps) -> Any:
    torch = pytest.importorskip("torch")
    warm_torch(torch)
    return torch


def _streams(torch: Any, n: int) -> list[tuple[Any, cs.Stream]]:
    """``n`` PyTorch streams (non-blocking: c10/cuda/CUDAStream.cpp), wrapped."""
    out = []
    for _ in range(n):
        s = torch.cuda.Stream()
        wrapped = cs.Stream.wrap(s)
        assert wrapped.handle == s.cuda_stream
        out.append((s, wrapped))
    return out


def _full(torch: Any, value: float) -> Any:
    a = torch.full((N,), value, device="cuda", dtype=torch.float32)
    torch.cuda.default_stream().synchronize()  # before any latch: nothing is held yet
    return a


def _tensor(torch: Any, view: cs.ArrayView) -> Any:
    """The view as a tensor on the same memory. PyTorch ignores the ``stream``
    entry (test_as_tensor_ignores_the_cai_stream); it is dropped anyway, so
    these tests never depend on that: they order the consumer themselves."""
    return torch.as_tensor(view.with_stream(None), device="cuda")


def _host(torch: Any, a: Any, after: Any) -> np.ndarray[Any, Any]:
    """``a`` on the host once ``after`` (the stream that wrote it) is done.
    Only once every latch is released."""
    after.synchronize()
    out: np.ndarray[Any, Any] = a.cpu().numpy()
    return out


def _writing(t: cs.TrackedArray | None, stream: Any) -> contextlib.AbstractContextManager[Any]:
    return t.writing(stream) if t is not None else contextlib.nullcontext()


def test_as_tensor_ignores_the_cai_stream(torch: Any, cuda_ops: CupyOps) -> None:
    """What the docs say of PyTorch as a consumer: ``torch.as_tensor`` returns
    while the CAI's ``stream`` is still held (it neither waits nor synchronizes).
    A timer releases the latch, so a PyTorch that did synchronize would fail
    here instead of hanging."""
    held = cs.Stream()
    x = _full(torch, OLD)
    latch = cuda_ops.latch(held)
    releaser = Releaser(latch, after=10 * RELEASE_AFTER)
    y = torch.as_tensor(cs.read_interface(x).with_stream(held.handle), device="cuda")
    returned_while_held = not releaser.fired.is_set()
    releaser.cancel()
    latch.release()
    assert returned_while_held
    assert y.data_ptr() == x.data_ptr()
    assert "stream" not in x.__cuda_array_interface__
    assert x.__cuda_array_interface__["version"] == 2


@pytest.mark.anyio
@TRACKED
async def test_await_consume_of_a_tracked_tensor(
    torch: Any, cuda_ops: CupyOps, tracked: bool
) -> None:
    """A tensor written inside ``writing(p)`` is waited for by ``await consume``;
    the untracked control is taken as ready at once and the reader sees OLD."""
    (p, cs_p), (q, cs_q) = _streams(torch, 2)
    x, seen = _full(torch, OLD), _full(torch, 0.0)
    t = cs.track(x) if tracked else None
    latch = cuda_ops.latch(cs_p)
    with _writing(t, p), torch.cuda.stream(p):
        x.fill_(NEW)  # held behind the latch
    releaser = Releaser(latch) if tracked else None
    with racing(not tracked):
        view = await cs.consume(x, timeout=TIMEOUT)  # the tensor itself: its tracking is found
    with torch.cuda.stream(q):
        seen.copy_(_tensor(torch, view))
    await asettles(cs_q)
    if releaser is not None:
        assert releaser.fired.is_set(), "consume returned before the producer's write"
        releaser.join()
    else:
        latch.release()
    assert view.stream is None
    assert (_host(torch, seen, q) == (NEW if tracked else OLD)).all()


@pytest.mark.anyio
@TRACKED
async def test_enqueue_consume_orders_a_torch_stream(
    torch: Any, cuda_ops: CupyOps, tracked: bool
) -> None:
    """``consume(x, stream=c)`` with c a ``torch.cuda.Stream``: c waits on the
    GPU for the tracked write; untracked, c copies at once and sees OLD."""
    (p, cs_p), (c, cs_c) = _streams(torch, 2)
    x, seen = _full(torch, OLD), _full(torch, 0.0)
    t = cs.track(x) if tracked else None
    latch = cuda_ops.latch(cs_p)
    with _writing(t, p), torch.cuda.stream(p):
        x.fill_(NEW)
    with racing(not tracked):
        view = await cs.consume(x, stream=c, timeout=TIMEOUT)
    with torch.cuda.stream(c):
        seen.copy_(_tensor(torch, view))
    assert view.stream == c.cuda_stream
    if tracked:
        still_held(cs_c)
    else:
        settles(cs_c)
    latch.release()
    assert (_host(torch, seen, c) == (NEW if tracked else OLD)).all()


@pytest.mark.anyio
@TRACKED
async def test_consuming_holds_the_torch_producer_until_the_reader_is_done(
    torch: Any, cuda_ops: CupyOps, tracked: bool
) -> None:
    """Write after read: the consumer's stream c is latched. After
    ``consuming(x, stream=c)``, the producer's next ``writing(p)`` waits for c,
    so the reader sees OLD; untracked, p overwrites first and it sees NEW."""
    (p, cs_p), (c, cs_c) = _streams(torch, 2)
    x, seen = _full(torch, OLD), _full(torch, 0.0)
    t = cs.track(x) if tracked else None
    latch = cuda_ops.latch(cs_c)
    with racing(not tracked):
        async with cs.consuming(x, stream=c, timeout=TIMEOUT) as view:
            with torch.cuda.stream(c):
                seen.copy_(_tensor(torch, view))
        with _writing(t, p), torch.cuda.stream(p):
            x.fill_(NEW)  # the producer reuses its buffer
    if tracked:
        still_held(cs_p)
    else:
        settles(cs_p)
    latch.release()
    assert (_host(torch, seen, c) == (OLD if tracked else NEW)).all()
    assert (_host(torch, x, p) == NEW).all()


@TRACKED
def test_consume_blocking_of_a_tracked_tensor(torch: Any, cuda_ops: CupyOps, tracked: bool) -> None:
    """``consume_blocking`` returns only after the tracked write (a timer thread
    releases the latch); untracked, it returns at once and the reader sees OLD."""
    (p, cs_p), (q, cs_q) = _streams(torch, 2)
    x, seen = _full(torch, OLD), _full(torch, 0.0)
    t = cs.track(x) if tracked else None
    latch = cuda_ops.latch(cs_p)
    with _writing(t, p), torch.cuda.stream(p):
        x.fill_(NEW)
    releaser = Releaser(latch) if tracked else None
    with racing(not tracked):
        view = cs.consume_blocking(x, timeout=TIMEOUT)
    with torch.cuda.stream(q):
        seen.copy_(_tensor(torch, view))
    settles(cs_q)
    if releaser is not None:
        assert releaser.fired.is_set(), "consume_blocking returned before the write"
        releaser.join()
    else:
        latch.release()
    assert (_host(torch, seen, q) == (NEW if tracked else OLD)).all()


@pytest.mark.parametrize("last", [0, 1, 2, None], ids=["last0", "last1", "last2", "control"])
def test_three_torch_writers_joined_for_cupy(
    torch: Any, cuda_ops: CupyOps, last: int | None
) -> None:
    """The spec's 7/9/15 -> 3 join, consumed by CuPy the way CuPy consumes:
    ``cupy.asarray(t)`` reads ``t.__cuda_array_interface__`` and blocks the
    host in cudaStreamSynchronize on its ``stream`` (the join's stream). Two
    writers are released first; a timer releases ``last``; CuPy must return
    only after it. The control hands CuPy a CAI naming writer 2's stream alone:
    CuPy returns while writers 0 and 1 are held, and they read OLD."""
    cp = pytest.importorskip("cupy")
    warm_cupy(cp)
    writers = _streams(torch, 3)
    buf = _full(torch, OLD)
    seen = cp.zeros(N, dtype=cp.float32)
    cp.cuda.Stream.null.synchronize()
    q = cp.cuda.Stream(non_blocking=True)
    t = cs.track(buf, stream=cs.Stream())
    n = N // 3
    latches = [cuda_ops.latch(w) for _, w in writers]
    for i, (s, _) in enumerate(writers):
        with t.writing(s, disjoint=True), torch.cuda.stream(s):
            buf[i * n : (i + 1) * n].fill_(NEW)
    blocked_on = 2 if last is None else last
    for i, latch in enumerate(latches):
        if i != blocked_on and last is not None:
            latch.release()
            settles(writers[i][1])
    releaser = Releaser(latches[blocked_on])
    with racing(last is None):
        if last is not None:
            joined = cp.asarray(t)  # blocks in cudaStreamSynchronize(export stream)
        else:
            writer2 = cs.read_interface(buf).with_stream(writers[2][1].handle)
            joined = cp.asarray(writer2)  # synchronizes writer 2's stream only
        returned_after_release = releaser.fired.is_set()
        with q:  # the consumer reads at once, on a stream that waits for nothing
            cp.copyto(seen, joined)
        settles(cs.Stream.wrap(q))
    releaser.join()
    for latch in latches:
        latch.release()
    assert returned_after_release
    assert (cp.asnumpy(seen, stream=q) == expected_thirds(last)).all()
