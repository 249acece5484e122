"""Finalizers that call the library while this thread is inside it.

A ``__del__`` that calls ``cs.hold`` ("I am about to drop an owner whose
memory a stream still reads") runs wherever its object goes: in a garbage
collection started by an allocation the library makes while it holds one of
its locks, or when the library drops the last reference to it. Each scenario
makes that happen at a known point, in a fresh interpreter with a bounded
wait: a finalizer that waits for a lock its own thread holds hangs for good
(and would hold that lock for every test after it).
"""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cai_streams as cs
from cai_streams import _hold, sim

from .device_ops import SimOps

WAIT = 10.0


class _Memory:
    """What a buffer's finalizer hands to ``cs.hold``."""


class _SelfFreeing:
    """A buffer in a reference cycle that frees itself stream-ordered."""

    def __init__(self, until: cs.Stream, freed: list[weakref.ref[_Memory]]) -> None:
        self.me = self
        self.until = until
        self.freed = freed

    def __del__(self) -> None:
        # (made here: a collection clears weak references to what it collects,
        # the cycle's own attributes included, before it runs finalizers)
        memory = _Memory()
        self.freed.append(weakref.ref(memory))
        cs.hold(memory, until=self.until)


class _Box:
    def __init__(self, arr: Any) -> None:
        self.arr = arr

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return dict(self.arr.__cuda_array_interface__)


def _released_soon(ref: weakref.ref[Any]) -> bool:
    for _ in range(int(WAIT * 1000)):
        cs.stats()
        if ref() is None:
            return True
        threading.Event().wait(0.001)
    return False


def hold_in_a_collection_inside_a_record() -> None:
    """A collection starts inside the library's record (as an allocation of the
    backend's may start one) while it holds the record lock; the finalizer's
    ``hold`` is recorded at the next library call instead, and keeps the
    memory until the stream passes the work enqueued before it."""
    ops = SimOps()
    s, other = cs.Stream(), cs.Stream()
    latch = ops.latch(s)
    freed: list[weakref.ref[_Memory]] = []
    backend = cs.current_backend()
    record = backend.record
    collect = [True]

    def record_collecting(event: int, stream: int) -> None:
        if collect and collect.pop():
            _SelfFreeing(s, freed)  # garbage in a cycle: this collection runs its __del__
            gc.collect()
        record(event, stream)

    backend.record = record_collecting  # type: ignore[method-assign]
    try:
        cs.hold(object(), until=other)  # records: the collection runs in there
    finally:
        del backend.record
    cs.stats()  # the next library call records the finalizer's hold
    assert len(freed) == 1 and not collect
    assert freed[0]() is not None  # held: s is latched
    latch.release()
    assert _released_soon(freed[0])


def hold_from_an_owner_the_event_pool_lets_go() -> None:
    """A view handed to a bare handle of another library's stream keeps its
    owner only through the join's event; the pool lets it go once the event
    completed, outside its lock, so the owner's finalizer may call ``hold``
    (which takes an event from that pool)."""
    backend = cs.current_backend()
    raw = backend.create_stream()  # another library's: no lease is made
    producer = cs.Stream()
    after: list[weakref.ref[_Memory]] = []

    class Owner:
        def __init__(self) -> None:
            self.arr = sim.asarray(np.zeros(8, np.float32))
            self.memory = _Memory()
            after.append(weakref.ref(self.memory))

        @property
        def __cuda_array_interface__(self) -> dict[str, Any]:
            cai = dict(self.arr.__cuda_array_interface__)
            cai["stream"] = producer.handle
            return cai

        def __del__(self) -> None:
            cs.hold(self.memory, until=producer)

    view = cs.consume_blocking(Owner(), stream=raw)
    del view  # the owner now lives only in the pool, with the join's event
    producer.synchronize()
    for _ in range(8):  # acquires and releases reclaim the completed event
        cs.hold(object(), until=producer)
    assert len(after) == 1
    assert _released_soon(after[0])
    backend.synchronize_stream(raw)
    backend.destroy_stream(raw)


def a_collected_stream_ends_at_the_next_library_call() -> None:
    """A view handed through a stream's bare handle listens to the stream the
    library made; collecting that stream queues its end (its finalizer may run
    inside the library), and the next library call records the view's hold
    before destroying the stream."""
    ops = SimOps()
    s = cs.Stream()
    box = _Box(ops.array(np.zeros(64, np.float32)))
    ref = weakref.ref(box)
    view = cs.consume_blocking(box, stream=s.handle)
    latch = ops.latch(s)
    del s
    gc.collect()
    # not ended yet: the stream's end waits for a library call
    assert any(owner == id(box) for _, owner in _hold._in_use)
    del view, box
    cs.stats()
    assert ref() is not None  # recorded behind the latch
    latch.release()
    assert _released_soon(ref)


def _bounded(scenario: Callable[[], None]) -> None:
    """Run ``scenario`` (a function of this module) in a fresh interpreter on
    the simulator; fail, not hang, if it does not end."""
    code = (
        "import cai_streams as cs; cs.use_backend('sim'); "
        f"from {__name__} import {scenario.__name__}; {scenario.__name__}()"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code],
            cwd=Path(__file__).resolve().parents[1],
            capture_output=True,
            text=True,
            timeout=WAIT * 3,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{scenario.__name__} deadlocked: a finalizer waited on its own thread's lock")
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(
    "scenario",
    [
        hold_in_a_collection_inside_a_record,
        hold_from_an_owner_the_event_pool_lets_go,
        a_collected_stream_ends_at_the_next_library_call,
    ],
    ids=lambda f: f.__name__,
)
def test_a_finalizer_calling_the_library_from_inside_it_never_deadlocks(
    scenario: Callable[[], None],
) -> None:
    _bounded(scenario)
