"""The lean hot path of a handoff gives what the full path gives.

Model-based: random producer dicts (CuPy's shape, with and without its
trivial descr) consumed in host and enqueue mode; the oracle is full
validation with the layout cache empty, and the row the handoff table names.
A handoff reads the producer's interface once.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cai_streams as cs
from cai_streams import _interface
from cai_streams._dlpack_import import uses_dlpack
from cai_streams._interface import parse

from .test_interface_fast import PTR, Exports, cupy_style


class Counting:
    """A v3 producer that also offers DLPack (as CuPy does): consume must read
    its interface to choose the protocol."""

    def __init__(self, cai: dict[str, Any]) -> None:
        self.cai = cai
        self.reads = 0

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        self.reads += 1
        return dict(self.cai)

    def __dlpack__(self, **kwargs: Any) -> Any:
        raise AssertionError("a v3 interface is taken through the interface")

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, 0)


def test_a_handoff_reads_the_interface_once() -> None:
    cs.use_backend("sim")
    cai = {"shape": (8,), "typestr": "<f4", "data": (PTR, False), "version": 3, "stream": 1}
    control = Counting(cai)  # choosing the protocol, then parsing: what a handoff did
    assert not uses_dlpack(control, None)
    parse(control)
    assert control.reads == 2
    producer = Counting(cai)
    view = cs.consume_blocking(producer)
    assert producer.reads == 1
    assert view.owner is producer and view.stream is None


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cupy_style(), st.sampled_from([None, 1, 2]), st.booleans(), st.booleans())
def test_consume_gives_the_full_paths_view(
    cai: dict[str, Any], producer_stream: int | None, enqueue: bool, cached: bool
) -> None:
    cs.use_backend("sim")
    if cai["version"] == 3:
        cai["stream"] = producer_stream
    obj = Exports(cai)
    _interface._layouts.clear()
    oracle = parse(obj)  # full validation
    if not cached:
        _interface._layouts.clear()  # else the fast path takes it
    with cs.Stream() as s:
        view = cs.consume_blocking(obj, stream=s if enqueue else None)
        expected = oracle.with_stream(s.handle if enqueue else None)
        assert view == expected  # every field of the key, and the owner
        assert (view.size, view.nbytes) == (oracle.size, oracle.nbytes)
        assert view.nbytes == int(np.prod(cai["shape"])) * view.dtype.itemsize
        del view
