"""consume() under pytest-asyncio (the plugin many asyncio users run)."""

from __future__ import annotations

import pytest

import cai_streams as cs
from cai_streams import sim


@pytest.mark.asyncio
async def test_under_pytest_asyncio() -> None:
    cs.use_backend("sim")
    s = cs.Stream()
    arr = sim.empty(8, "float32")
    sim.launch(s, lambda x: x.fill(5), arr, writes=[arr], duration=0.005)
    view = await cs.consume(cs.read_interface(arr).with_stream(s.handle), timeout=20)
    data = sim._numpy_view(view)
    assert data is not None and (data == 5).all()
