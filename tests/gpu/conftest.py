"""The GPU tier: real devices and real libraries. Skipped without a usable device."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from cai_streams._backend import _backend_class

if TYPE_CHECKING:
    from ..device_ops import CupyOps

_REASON = _backend_class("cuda").unavailable_reason()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason=f"GPU tier: {_REASON}")
    for item in items:
        if "tests/gpu/" in item.nodeid.replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if _REASON is not None:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _cuda_backend() -> None:
    import cai_streams as cs

    cs.use_backend("cuda")


@pytest.fixture
def anyio_backend() -> str:
    """One event loop is enough here: the loops are proven on sim and in the
    shared suite; these tests prove the libraries' ordering on a device."""
    return "asyncio"


@pytest.fixture
def cuda_ops() -> Iterator[CupyOps]:
    """The process-wide CuPy kernels (latch, fill, copy), warmed up.

    At teardown every latch handed out is released (a failed assertion while
    a stream is held never leaves a kernel spinning), the test fails if one
    of them expired (it was waited for on the host before its release), and
    the device is synchronized, so the next test starts with nothing in flight.
    """
    cupy = pytest.importorskip("cupy")
    from ..device_ops import CupyOps

    ops = CupyOps()
    try:
        yield ops
    finally:
        try:
            ops.release_all()
        finally:
            cupy.cuda.runtime.deviceSynchronize()
