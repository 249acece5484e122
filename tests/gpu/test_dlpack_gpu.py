"""DLPack with PyTorch, CuPy and Numba: the same join, proven with data on a GPU.

Consumer side: PyTorch's ``__cuda_array_interface__`` is version 2 and names
no stream, so only DLPack orders a tensor's pending work: ``torch.Tensor.
__dlpack__(stream=c)`` makes ``c`` wait for torch's *current* stream (the
tests enqueue the producer's write and consume inside ``torch.cuda.stream(p)``).
The control forces the interface (``protocol="cai"``): taken as ready, it
reads OLD. CuPy's ``__dlpack__`` does the same with CuPy's current stream;
its control is ``sync=False`` (the consumer passes -1).

Producer side: ``torch.from_dlpack`` and ``cupy.from_dlpack`` pass their
current stream to ``TrackedArray.__dlpack__``, which joins the pending writes
onto it; the control hands them the array through a wrapper that passes -1.
"""

from __future__ import annotations

from typing import Any

import pytest

import cai_streams as cs
from cai_streams._dlpack_import import DLPackOwner

from ..device_ops import CupyOps
from ._interop import (
    NEW,
    OLD,
    TIMEOUT,
    Releaser,
    asettles,
    racing,
    settles,
    still_held,
    warm_cupy,
    warm_torch,
)
from .test_interop_cupy import _cupy
from .test_interop_cupy import _full as _cupy_full
from .test_interop_cupy import _host as _cupy_host
from .test_interop_cupy import _streams as _cupy_streams
from .test_interop_torch import _full, _host, _streams, _tensor

ORDERED = pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "control"])


@pytest.fixture
def torch(cuda_ops: CupyOps) -> Any:
    torch = pytest.importorskip("torch")
    warm_torch(torch)
    return torch


@pytest.fixture
def cp(cuda_ops: CupyOps) -> Any:
    cupy = pytest.importorskip("cupy")
    warm_cupy(cupy)
    return cupy


class NoSync:
    """Hands over a DLPack producer, asking it for no synchronization (-1)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __dlpack__(self, **kwargs: Any) -> Any:
        kwargs["stream"] = -1
        return self.inner.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.inner.__dlpack_device__()  # type: ignore[no-any-return]


# -- PyTorch ------------------------------------------------------------------------------


@pytest.mark.anyio
@ORDERED
async def test_consume_orders_a_stream_after_torchs_current_stream(
    torch: Any, cuda_ops: CupyOps, ordered: bool
) -> None:
    """``consume(x, stream=c)`` of an untracked tensor written on torch's
    current stream p (held): through DLPack, c waits for p on the GPU; the
    interface (the control) names no stream and c copies OLD at once."""
    (p, cs_p), (c, cs_c) = _streams(torch, 2)
    x, seen = _full(torch, OLD), _full(torch, 0.0)
    latch = cuda_ops.latch(cs_p)
    with torch.cuda.stream(p):
        x.fill_(NEW)  # pending on torch's current stream, behind the latch
        with racing(not ordered):
            view = await cs.consume(
                x, stream=cs_c, timeout=TIMEOUT, protocol=None if ordered else "cai"
            )
    assert isinstance(view.owner, DLPackOwner) is ordered
    assert view.stream == c.cuda_stream
    with torch.cuda.stream(c):
        seen.copy_(_tensor(torch, view))
    if ordered:
        still_held(cs_c)
    else:
        settles(cs_c)
    latch.release()
    assert (_host(torch, seen, c) == (NEW if ordered else OLD)).all()


@pytest.mark.anyio
@ORDERED
async def test_await_consume_waits_for_a_torch_tensors_pending_write(
    torch: Any, cuda_ops: CupyOps, ordered: bool
) -> None:
    """Host readiness: torch joins its current stream onto the export stream,
    which the event loop polls (a timer releases the latch); the control
    returns at once and the reader sees OLD."""
    (p, cs_p), (q, cs_q) = _streams(torch, 2)
    x, seen = _full(torch, OLD), _full(torch, 0.0)
    latch = cuda_ops.latch(cs_p)
    with torch.cuda.stream(p):
        x.fill_(NEW)
        releaser = Releaser(latch) if ordered else None
        with racing(not ordered):
            view = await cs.consume(x, timeout=TIMEOUT, protocol=None if ordered else "cai")
    with torch.cuda.stream(q):
        seen.copy_(_tensor(torch, view))
    await asettles(cs_q)
    if releaser is not None:
        assert releaser.fired.is_set(), "consume returned before torch's pending write"
        releaser.join()
    else:
        latch.release()
    assert view.stream is None
    assert (_host(torch, seen, q) == (NEW if ordered else OLD)).all()


@ORDERED
def test_torch_from_dlpack_of_a_tracked_array(torch: Any, cuda_ops: CupyOps, ordered: bool) -> None:
    """``torch.from_dlpack(t)`` inside ``torch.cuda.stream(c)``: the tracked
    write on p (held) is joined onto c; the control (-1) copies OLD at once."""
    (p, cs_p), (c, cs_c) = _streams(torch, 2)
    x, seen = _full(torch, OLD), _full(torch, 0.0)
    t = cs.track(x)
    latch = cuda_ops.latch(cs_p)
    with t.writing(cs_p), torch.cuda.stream(p):
        x.fill_(NEW)
    with torch.cuda.stream(c), racing(not ordered):
        y = torch.from_dlpack(t if ordered else NoSync(t))
        assert y.data_ptr() == x.data_ptr()
        seen.copy_(y)
    if ordered:
        still_held(cs_c)
    else:
        settles(cs_c)
    latch.release()
    assert (_host(torch, seen, c) == (NEW if ordered else OLD)).all()


# -- CuPy ----------------------------------------------------------------------------------


@pytest.mark.anyio
@ORDERED
async def test_consume_through_cupys_dlpack(cp: Any, cuda_ops: CupyOps, ordered: bool) -> None:
    """``consume(x, stream=c, protocol="dlpack")`` inside ``with p:``: CuPy
    makes c wait for p (held); ``sync=False`` passes -1 and c copies OLD."""
    (p, cs_p), (c, cs_c) = _cupy_streams(cp, 2)
    x, seen = _cupy_full(cp, OLD), _cupy_full(cp, 0.0)
    latch = cuda_ops.latch(cs_p)
    with p:
        x.fill(NEW)
        with racing(not ordered):
            view = await cs.consume(
                x, stream=cs_c, sync=ordered, protocol="dlpack", timeout=TIMEOUT
            )
    assert isinstance(view.owner, DLPackOwner)
    with c:
        cp.copyto(seen, _cupy(cp, view))
    if ordered:
        still_held(cs_c)
    else:
        settles(cs_c)
    latch.release()
    assert (_cupy_host(cp, seen, c) == (NEW if ordered else OLD)).all()


@ORDERED
def test_cupy_from_dlpack_of_a_tracked_array(cp: Any, cuda_ops: CupyOps, ordered: bool) -> None:
    """``cupy.from_dlpack(t)`` inside ``with c:``: the tracked write on p
    (held) is joined onto c; the control (-1) copies OLD at once."""
    (p, cs_p), (c, cs_c) = _cupy_streams(cp, 2)
    x, seen = _cupy_full(cp, OLD), _cupy_full(cp, 0.0)
    t = cs.track(x)
    latch = cuda_ops.latch(cs_p)
    with t.writing(cs_p), p:
        x.fill(NEW)
    with c, racing(not ordered):
        y = cp.from_dlpack(t if ordered else NoSync(t))
        assert y.data.ptr == x.data.ptr
        cp.copyto(seen, y)
    if ordered:
        still_held(cs_c)
    else:
        settles(cs_c)
    latch.release()
    assert (_cupy_host(cp, seen, c) == (NEW if ordered else OLD)).all()


# -- Numba ---------------------------------------------------------------------------------


def test_numba_through_dlpack(cuda_ops: CupyOps) -> None:
    """numba-cuda device arrays, where they speak DLPack: taken through it,
    and our tracked arrays given to it. Skipped with the reason otherwise."""
    numba_cuda = pytest.importorskip("numba.cuda")
    import numpy as np

    arr = numba_cuda.to_device(np.full(8, NEW, dtype=np.float32))
    if not hasattr(type(arr), "__dlpack__"):
        pytest.skip("this numba-cuda's device arrays have no __dlpack__ (they speak the CAI)")
    view = cs.consume_blocking(arr, protocol="dlpack", timeout=TIMEOUT)
    assert isinstance(view.owner, DLPackOwner)
    assert view.ptr == arr.__cuda_array_interface__["data"][0]
    from_dlpack = getattr(numba_cuda, "from_dlpack", None)
    if from_dlpack is not None:
        back = from_dlpack(cs.track(arr))
        assert (back.copy_to_host() == NEW).all()
