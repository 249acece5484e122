"""Streams of real libraries wrapped on a real device (GPU tier)."""

from __future__ import annotations

import numpy as np
import pytest

import cai_streams as cs

from ..device_ops import CupyOps


def test_cupy_streams() -> None:
    cupy = pytest.importorskip("cupy")
    owned = cupy.cuda.Stream(non_blocking=True)
    assert cs.Stream.wrap(owned).handle == owned.ptr
    assert cs.Stream.wrap(cupy.cuda.Stream.null).handle == 1
    mine = cs.Stream()
    assert cupy.cuda.Stream.from_external(mine).ptr == mine.handle
    cs.Stream.wrap(owned).synchronize()


def test_torch_streams() -> None:
    torch = pytest.importorskip("torch")
    s = torch.cuda.Stream()
    assert cs.Stream.wrap(s).handle == s.cuda_stream
    assert cs.Stream.wrap(torch.cuda.default_stream()).handle == 1
    mine = cs.Stream()
    assert torch.cuda.ExternalStream(mine.handle).cuda_stream == mine.handle


def test_numba_streams() -> None:
    cuda = pytest.importorskip("numba.cuda")
    s = cuda.stream()
    wrapped = cs.Stream.wrap(s)
    assert wrapped.handle == int(s.handle)  # numba's own handle (a CUstream)
    assert wrapped.handle > 2
    wrapped.synchronize()
    mine = cs.Stream()
    external = cuda.external_stream(mine.handle)
    assert int(external.handle) == mine.handle
    assert cs.Stream.wrap(external) == mine
    assert cs.Stream.wrap(cuda.default_stream()).handle == 1  # numba's 0: legacy
    assert cs.Stream.wrap(cuda.legacy_default_stream()).handle == 1
    assert cs.Stream.wrap(cuda.per_thread_default_stream()).handle == 2


def test_cuda_core_streams() -> None:
    core = pytest.importorskip("cuda.core")
    if not hasattr(core, "Device"):  # cuda.core 0.x
        core = pytest.importorskip("cuda.core.experimental")
    device = core.Device()
    device.set_current()
    s = device.create_stream()
    assert cs.Stream.wrap(s).handle == int(s.handle)
    mine = cs.Stream()
    assert int(device.create_stream(mine).handle) == mine.handle


@pytest.mark.parametrize("handle", [1, 2], ids=["legacy", "per_thread"])
def test_default_streams_synchronize(handle: int, cuda_ops: CupyOps) -> None:
    """Work enqueued on a default stream is complete once ``synchronize``
    returns: a 50 ms spin is still pending before, done after, and a read on a
    non-blocking stream (ordered after nothing) then sees the data."""
    cupy = cuda_ops.cp
    ops = cuda_ops
    s = cs.Stream.wrap(handle)
    x = ops.array(np.zeros(256, dtype=np.float32))
    ops.fill(s, x, 7.0, duration=0.05)
    pending = s.record()
    assert not pending.is_done
    s.synchronize()
    assert pending.is_done
    reader = cupy.cuda.Stream(non_blocking=True)
    assert (cupy.asnumpy(x, stream=reader) == 7.0).all()


def test_an_invalid_event_handle_is_a_cuda_error() -> None:
    """A driver error reaches the caller as CudaError with the driver's name and
    code: cudaEventQuery(NULL) is cudaErrorInvalidResourceHandle (400)."""
    from cuda.bindings import runtime

    expected = runtime.cudaError_t.cudaErrorInvalidResourceHandle
    with pytest.raises(cs.CudaError) as info:
        cs.current_backend().query(0)
    assert info.value.name == "cudaErrorInvalidResourceHandle"
    assert info.value.code == int(expected) == 400
