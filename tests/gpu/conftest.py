"""The GPU tier: real devices and real libraries. Skipped without a usable device."""

from __future__ import annotations

import pytest

from cai_streams._backend import _backend_class

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
