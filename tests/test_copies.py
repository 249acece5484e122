"""Copies and pickles of the objects that stand for one thing of this process.

A ``copy.copy`` of a Stream, Event or Graph copied its slots, owner flag
included: both objects destroyed the handle, the second time whichever stream
or event CUDA had given the recycled handle to (one of the library's pooled
events, breaking an unrelated array's consume). ``copy.copy`` of an ArrayView
raised AttributeError from its frozen ``__setattr__``; of a TrackedArray it
made a second wrapper. Now a copy is the object itself, and a pickle raises
TypeError.
"""

from __future__ import annotations

import copy
import gc
import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import cai_streams as cs
from cai_streams import sim

from .test_dlpack import DLPackOnly


@pytest.fixture(autouse=True)
def _sim() -> None:
    cs.use_backend("sim")


def _graph() -> cs.Graph:
    s = cs.Stream()
    s.begin_capture("relaxed")
    sim.launch(s, lambda: None)
    return s.end_capture()


def _dlpack_owner() -> Any:
    return cs.consume_blocking(DLPackOnly(sim.empty(4)), timeout=10).owner


MAKERS: dict[str, Callable[[], Any]] = {
    "Stream": cs.Stream,
    "borrowed Stream": lambda: cs.Stream.wrap(1),
    "Event": lambda: cs.Stream().record(),
    "Graph": _graph,
    "TrackedArray": lambda: cs.track(sim.empty(4)),
    "ArrayView": lambda: cs.read_interface(sim.empty(4)),
    "DLPackOwner": _dlpack_owner,
}


@pytest.mark.parametrize("name", list(MAKERS))
def test_a_copy_is_the_object_itself_and_a_pickle_is_refused(name: str) -> None:
    obj = MAKERS[name]()
    assert copy.copy(obj) is obj
    assert copy.deepcopy([obj])[0] is obj
    with pytest.raises(TypeError, match=f"cannot pickle a {type(obj).__name__}"):
        pickle.dumps(obj)


def test_a_dropped_copy_of_a_stream_destroys_nothing() -> None:
    """The copy and the original are one stream: dropping a copy leaves it
    open, and its handle is not handed to a new stream."""
    s = cs.Stream()
    handle = s.handle
    c = copy.copy(s)
    del c
    gc.collect()
    assert not s.closed
    other = cs.Stream()
    assert other.handle != handle
    sim.launch(s, lambda: None)
    s.synchronize()


def test_a_dropped_copy_of_an_event_leaves_the_librarys_pooled_events_alone() -> None:
    """The attack's program: a copy of a user's Event dropped, a tracked
    array's export (a pooled event, which got the freed handle), then the
    user's Event dropped too. The array's consume still works."""
    p = cs.Stream()
    e = p.record()
    c = copy.copy(e)
    del c
    gc.collect()
    buf = sim.asarray(np.zeros(256, np.float32))
    t = cs.track(buf)
    w, consumer = cs.Stream(), cs.Stream()
    with t.writing(w):
        sim.launch(w, lambda x: x.fill(1.0), buf, writes=[buf], duration=0.05)
    cs.export(t, stream=consumer)
    del e
    gc.collect()
    view = cs.consume_blocking(t, timeout=10)
    got = sim._numpy_view(view)
    assert got is not None and (got == 1.0).all()


def test_a_dropped_copy_of_a_dlpack_views_owner_deletes_no_tensor() -> None:
    """``view.owner`` of a DLPack consume runs the tensor's deleter once, when
    collected: a copy of it ran the deleter while the view was in use (the
    next allocation took the memory), and the owner ran it again (a double
    free with a real producer)."""
    from cai_streams._dlpack_export import live_exports

    before = live_exports()
    a = sim.asarray(np.full(1 << 12, 1.0, np.float32))
    view = cs.consume_blocking(DLPackOnly(a), timeout=10)
    del a  # (the tensor keeps the memory)
    twin = copy.copy(view.owner)
    del twin
    gc.collect()
    b = sim.asarray(np.full(1 << 12, 2.0, np.float32))
    got = sim._numpy_view(view)
    assert got is not None and (got == 1.0).all()
    assert b.ptr != view.ptr
    del view, got
    gc.collect()
    assert live_exports() == before  # deleted once, not twice
