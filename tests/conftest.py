from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from typing import Any

import pytest

import cai_streams as cs
from cai_streams import _backend
from cai_streams._backend import _backend_class

from . import device_ops
from .device_ops import DeviceOps, ops_for

_CUDA_REASON = _backend_class("cuda").unavailable_reason()
_FORCED = os.environ.get("CAI_STREAMS_BACKEND")


def _backend_params() -> list[Any]:
    names = [_FORCED] if _FORCED in ("sim", "cuda") else ["sim", "cuda"]
    marks = {"cuda": [pytest.mark.skipif(_CUDA_REASON is not None, reason=f"cuda: {_CUDA_REASON}")]}
    return [pytest.param(n, marks=marks.get(n, [])) for n in names]


@pytest.fixture(params=_backend_params())
def backend(request: pytest.FixtureRequest) -> Iterator[cs.Backend]:
    """Each test using it runs on sim, and on cuda when a device is usable."""
    previous = cs.current_backend()
    chosen = cs.use_backend(request.param)
    try:
        yield chosen
    finally:
        cs.use_backend(previous.name)


@pytest.fixture
def ops(backend: cs.Backend) -> Iterator[DeviceOps]:
    """Kernels for ``backend``; every latch it handed out is released at teardown,
    so a failed assertion while a stream is held never leaves a kernel spinning."""
    device_ops = ops_for(backend.name)
    try:
        yield device_ops
    finally:
        device_ops.release_all()


@pytest.fixture(autouse=True)
def _default_backend() -> Iterator[None]:
    """Each test starts on the process's default backend, whatever the test
    before it selected: under ``CAI_STREAMS_SIM_DECOY=1`` every test that does
    not choose a backend runs on the decoy, which simulated kernels refuse."""
    default = cs.current_backend()
    yield
    with _backend._lock:
        _backend._current = default


@pytest.fixture(autouse=True)
def _foreign_streams_closed() -> Iterator[None]:
    """The other libraries' streams a test made (``device_ops.foreign_streams``)
    are destroyed after it, once its arrays are collected."""
    yield
    if device_ops._foreign:
        gc.collect()
        device_ops.close_foreign_streams()


@pytest.fixture(autouse=True)
def _no_sticky_fault_leaks() -> Iterator[None]:
    """Test isolation on the simulator: each test's work has run before the next
    starts, and a device faulted on purpose (a kernel that raised poisons its
    device until ``sim.reset()``, as a device-side fault does) is reset."""
    yield
    from cai_streams._backend._sim import SimBackend
    from cai_streams._hold_table import table as holds

    holds.sweep()  # views the test released record their holds now, not in the next test
    for backend in list(_backend._instances.values()):
        if isinstance(backend, SimBackend):
            # the caching allocator hands a freed block out at once: a test's
            # leftover kernels must not write into the next test's arrays
            assert backend.drain(timeout=30), "simulated work still running after 30 s"
            for device in backend._devices:
                if device.fault is not None:
                    backend.reset(device.ordinal)
    holds.sweep()  # and, complete, are let go


@pytest.fixture(autouse=True)
def _sanitized() -> Iterator[None]:
    """The project's own tests run with the sanitizer on, each from a clean slate.
    A test that races on purpose says so with ``with cs.sanitize(False):``."""
    with cs.sanitize():
        yield


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)
