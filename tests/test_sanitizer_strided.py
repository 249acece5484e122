"""Strided views are declared as the runs of bytes they touch.

Disjoint parts of one array written on two streams (the columns of a matrix,
the even and odd elements) are no hazard; parts that share bytes are. The
runs are checked against the bytes numpy's own offsets say each view
touches, for random slicings and transposes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cai_streams as cs
from cai_streams import sim
from cai_streams._interface import MAX_RUNS, extent, runs


def _fill(x: np.ndarray[Any, Any], value: float) -> None:
    x[...] = value


@pytest.mark.cai_sim
@pytest.mark.parametrize(
    "parts",
    ["columns", "even and odd", "blocks side by side", "control: overlapping columns"],
)
def test_disjoint_strided_parts_on_two_streams_are_no_hazard(parts: str) -> None:
    """Each part written on its own stream with no ordering between them: no
    bytes are shared, so nothing is named (each part was taken as the bytes
    from its first to its last, and the two were named a race). Control:
    parts that share a column are named."""
    a = sim.empty((32, 32), "float32")
    if parts == "columns":
        x, y = a[:, :16], a[:, 16:]
    elif parts == "even and odd":
        x, y = a[:, ::2], a[:, 1::2]
    elif parts == "blocks side by side":
        x, y = a[:16, :16], a[:16, 16:]
    else:
        x, y = a[:, :17], a[:, 16:]
    s1, s2 = cs.Stream(), cs.Stream()
    sim.launch(s1, _fill, x, 1.0, writes=[x], duration=0.01)
    if parts.startswith("control"):
        with pytest.raises(cs.HazardError, match="is not ordered after"):
            sim.launch(s2, _fill, y, 2.0, writes=[y])
        s1.synchronize()
        return
    sim.launch(s2, _fill, y, 2.0, writes=[y])
    s1.synchronize()
    s2.synchronize()
    host = a.to_host()
    assert (host[x_index(parts)] == 1.0).all()


def x_index(parts: str) -> Any:
    return {
        "columns": np.s_[:, :16],
        "even and odd": np.s_[:, ::2],
        "blocks side by side": np.s_[:16, :16],
    }[parts]


def _touched(view: np.ndarray[Any, Any]) -> set[int]:
    """Every byte ``view`` touches, from numpy's element addresses."""
    base = np.zeros(1, dtype=np.intp)
    offsets = base
    for n, stride in zip(view.shape, view.strides, strict=True):
        offsets = (offsets[:, None] + np.arange(n, dtype=np.intp)[None, :] * stride).ravel()
    start = view.__array_interface__["data"][0]
    return {int(start + o + b) for o in offsets for b in range(view.itemsize)}


_slices = st.tuples(st.integers(-12, 12), st.integers(-12, 12), st.sampled_from([1, 2, 3, -1, -2]))


@settings(max_examples=300, deadline=None)
@given(
    shape=st.lists(st.integers(1, 12), min_size=1, max_size=3),
    cuts=st.lists(_slices, min_size=3, max_size=3),
    transpose=st.booleans(),
    itemsize=st.sampled_from([1, 4, 8]),
)
def test_runs_are_the_bytes_a_view_touches(
    shape: list[int], cuts: list[tuple[int, int, int]], transpose: bool, itemsize: int
) -> None:
    base = np.zeros(shape, dtype=f"u{itemsize}")
    view = base[tuple(slice(a, b, c) for a, b, c in cuts[: len(shape)])]
    if transpose:
        view = view.T
    ptr = view.__array_interface__["data"][0]
    got = runs(ptr, view.shape, view.strides, view.itemsize)
    touched = _touched(view) if view.size else set()
    covered = {b for lo, hi in got for b in range(lo, hi)}
    assert all(lo < hi for lo, hi in got)
    assert all(a[1] < b[0] for a, b in zip(got, got[1:], strict=False))  # sorted, apart
    if len(got) == 1 and got[0] == extent(ptr, view.shape, view.strides, view.itemsize):
        assert touched <= covered  # (one run: exact, or the fallback that covers all)
    else:
        assert covered == touched
    assert len(got) <= MAX_RUNS


def test_too_many_runs_fall_back_to_the_whole_extent() -> None:
    a = np.zeros(4 * MAX_RUNS, "float32")[::2]  # 2 * MAX_RUNS runs of 4 bytes
    ptr = a.__array_interface__["data"][0]
    assert runs(ptr, a.shape, a.strides, a.itemsize) == [
        extent(ptr, a.shape, a.strides, a.itemsize)
    ]


@pytest.mark.cai_sim
@pytest.mark.parametrize("how", ["writing() block", "consume to the host", "consume onto a stream"])
def test_the_librarys_own_declarations_of_a_strided_part_are_its_runs(how: str) -> None:
    """The right half of a matrix, handed through the library while a kernel
    on another stream still writes the left half: no byte is shared, so
    nothing is named (the library declared the part's whole extent, which
    takes in the left half's rows)."""
    a = sim.empty((32, 32), "float32")
    left, right = a[:, :16], a[:, 16:]
    s1, s2 = cs.Stream(), cs.Stream()
    sim.launch(s1, _fill, left, 1.0, writes=[left], duration=0.02)
    if how == "writing() block":
        t = cs.track(right)
        with t.writing(s2):
            sim.launch(s2, _fill, right, 2.0, writes=[right])
    elif how == "consume to the host":
        cs.consume_blocking(right, timeout=10)
    else:
        cs.consume_blocking(right, stream=s2, timeout=10)
    s1.synchronize()
    s2.synchronize()


@pytest.mark.cai_sim
@pytest.mark.parametrize("pause", [0.0, 0.3], ids=["pending at export", "done at export"])
def test_an_export_of_a_strided_part_vouches_for_its_runs_only(pause: float) -> None:
    """The even elements are tracked and exported; the odd ones, written
    earlier on the producer's stream, are read on the host with nothing
    ordering the read: named on every run (an export that found the even
    elements' write done vouched for their whole extent, odd ones included)."""
    import time

    producer = cs.Stream()
    base = sim.empty(2048, "float32")
    even, odd = base[::2], base[1:-1:2]
    sim.launch(producer, _fill, odd, 2.0, writes=[odd], duration=0.05)
    t = cs.track(even)
    with t.writing(producer):
        sim.launch(producer, _fill, even, 1.0, writes=[even])
    time.sleep(pause)
    assert (t.__cuda_array_interface__["stream"] is None) == (pause > 0)
    with pytest.raises(cs.HazardError, match="to_host"):
        odd.to_host()
    producer.synchronize()


_ops = st.lists(
    st.lists(
        st.tuples(st.sampled_from(["read", "write"]), st.integers(0, 64), st.integers(0, 64)),
        max_size=4,
    ),
    max_size=12,
)


@settings(max_examples=400, deadline=None)
@given(operations=_ops, lo=st.integers(0, 32), hi=st.integers(16, 64))
def test_reads_of_a_capture_are_covered_by_its_earlier_writes_as_a_byte_set_says(
    operations: list[list[tuple[str, int, int]]], lo: int, hi: int
) -> None:
    """The check that a capture read only what it wrote first (a freed block's
    scratch use), kept as sorted spans for speed, against a set of bytes."""
    from cai_streams._sanitizer import _writes_first

    written: set[int] = set()
    expected = True
    for items in operations:
        for kind, a, b in items:
            span = set(range(max(a, lo), min(b, hi)))
            if kind == "write":
                written |= span
            elif not span <= written:
                expected = False
                break
        if not expected:
            break
    captured = [(items, "kernel", "here") for items in operations]
    assert _writes_first(lo, hi, captured) is expected
