"""Streams of real libraries wrapped on a real device (GPU tier)."""

from __future__ import annotations

import numpy as np
import pytest

import cai_streams as cs


def test_cupy_streams() -> None:
    cupy = pytest.importorskip("cupy")
    owned = cupy.cuda.Stream(non_blocking=True)
    assert cs.Stream.wrap(owned).handle == owned.ptr
    assert cs.Stream.wrap(cupy.cuda.Stream.null).handle == 1
    cs.Stream.wrap(owned).synchronize()


def test_torch_streams() -> None:
    torch = pytest.importorskip("torch")
    s = torch.cuda.Stream()
    assert cs.Stream.wrap(s).handle == s.cuda_stream
    assert cs.Stream.wrap(torch.cuda.default_stream()).handle == 1


def test_numba_streams() -> None:
    cuda = pytest.importorskip("numba.cuda")
    s = cuda.stream()
    wrapped = cs.Stream.wrap(s)
    assert wrapped.handle > 2
    wrapped.synchronize()


def test_cuda_core_streams() -> None:
    core = pytest.importorskip("cuda.core")
    device = core.Device()
    device.set_current()
    s = device.create_stream()
    assert cs.Stream.wrap(s).handle == int(s.handle)


@pytest.mark.parametrize("handle", [1, 2])
def test_default_streams(handle: int) -> None:
    s = cs.Stream.wrap(handle)
    s.record().synchronize()
    s.synchronize()


def test_destroyed_stream_is_a_cuda_error() -> None:
    s = cs.Stream()
    e = s.record()
    e.synchronize()
    e.close()
    raw = cs.current_backend()
    with pytest.raises(cs.CudaError) as info:
        raw.query(e._handle)  # a destroyed event handle
    assert info.value.name.startswith("cuda")
    assert np.isfinite(info.value.code)
