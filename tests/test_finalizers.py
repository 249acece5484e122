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
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cai_streams as cs
from cai_streams import _hold, sim
from cai_streams._events import RECLAIM_AT, pool_for

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


@contextmanager
def _collection_in_the_next_record(
    before: Callable[[], object] = lambda: None,
) -> Iterator[list[bool]]:
    """The backend's next record first calls ``before``, then collects garbage,
    as an allocation of the backend's may: while the library holds its record
    lock. Yields a list that is empty once that happened."""
    backend = cs.current_backend()
    record = backend.record
    pending = [True]

    def record_collecting(event: int, stream: int) -> None:
        if pending and pending.pop():
            before()
            gc.collect()
        record(event, stream)

    backend.record = record_collecting  # type: ignore[method-assign]
    try:
        yield pending
    finally:
        del backend.record


def hold_in_a_collection_inside_a_record() -> None:
    """A collection starts inside the library's record (as an allocation of the
    backend's may start one) while it holds the record lock; the finalizer's
    ``hold`` is recorded at the next library call instead, and keeps the
    memory until the stream passes the work enqueued before it."""
    ops = SimOps()
    s, other = cs.Stream(), cs.Stream()
    latch = ops.latch(s)
    freed: list[weakref.ref[_Memory]] = []
    # garbage in a cycle, made in there: that collection runs its __del__
    with _collection_in_the_next_record(lambda: _SelfFreeing(s, freed)) as pending:
        cs.hold(object(), until=other)  # records: the collection runs in there
    cs.stats()  # the next library call records the finalizer's hold
    assert len(freed) == 1 and not pending
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

    owner = Owner()
    owner_gone = weakref.finalize(owner, lambda: None)
    view = cs.consume_blocking(owner, stream=raw)
    del view, owner  # the owner now lives only in the pool, with the join's event
    producer.synchronize()
    pool = pool_for(backend, producer._key().device)
    for _ in range(RECLAIM_AT):  # a batch of releases reclaims the completed event
        pool.release(pool.acquire())
    assert not owner_gone.alive  # (its finalizer's hold took an event from that pool)
    assert len(after) == 1
    assert _released_soon(after[0])
    backend.synchronize_stream(raw)
    backend.destroy_stream(raw)


def _viewed_through_its_handle(
    ops: SimOps,
) -> tuple[cs.Stream, weakref.ref[_Box], cs.ArrayView, Any]:
    """A new stream, a view of a new owner handed through the stream's bare
    handle (so the view's lease listens to the stream), and a latch holding
    the stream; the owner lives in the view."""
    s = cs.Stream()
    box = _Box(ops.array(np.zeros(64, np.float32)))
    view = cs.consume_blocking(box, stream=s.handle)
    return s, weakref.ref(box), view, ops.latch(s)


def a_collected_stream_ends_at_the_next_library_call() -> None:
    """A view handed through a stream's bare handle listens to the stream the
    library made; collecting that stream queues its end (its finalizer may run
    inside the library), and the next library call records the view's hold
    before destroying the stream."""
    s, ref, view, latch = _viewed_through_its_handle(SimOps())
    del s
    gc.collect()
    # not ended yet: the stream's end waits for a library call
    assert any(owner == id(view.owner) for _, owner in _hold._in_use)
    del view
    cs.stats()
    assert ref() is not None  # recorded behind the latch
    latch.release()
    assert _released_soon(ref)


def hold_in_a_collection_lands_where_asked_whatever_becomes_of_the_handle() -> None:
    """``hold(owner, until=<another library's stream handle>)`` from a
    finalizer run by a collection is recorded at once, by the backend: the
    other library then destroys its stream (its work still runs) and the next
    stream gets the handle; a record made later would land on that idle one,
    the owner would go under the latched reader, and the allocator would hand
    its block to the next array, whose data the reader would copy."""
    ops, backend = SimOps(), cs.current_backend()
    raw = backend.create_stream()
    s = cs.Stream.wrap(raw)
    buf = ops.array(np.full(256, 1.0, np.float32))
    out = ops.array(np.zeros(256, np.float32))
    latch = ops.latch(s)
    ops.copy(s, out, buf)  # reads buf, behind the latch
    done = backend.create_event()
    backend.record(done, raw)
    del s
    held: list[weakref.ref[Any]] = []

    class Freer:  # frees its buffer stream-ordered
        def __init__(self, buf: Any) -> None:
            self.me, self.buf = self, buf

        def __del__(self) -> None:
            held.append(weakref.ref(self.buf))
            cs.hold(self.buf, until=raw)

    Freer(buf)
    del buf
    gc.collect()  # runs Freer.__del__ inside the collection
    backend.destroy_stream(raw)  # the other library is done with it...
    successor = backend.create_stream()  # ...and makes another (the same handle, here)
    for _ in range(20):
        cs.stats()
        threading.Event().wait(0.001)
    assert held[0]() is not None
    other = ops.array(np.full(256, 9.0, np.float32))  # would take a freed block
    latch.release()
    backend.synchronize_event(done)
    assert ops.to_host(out)[0] == 1.0
    del other
    backend.destroy_stream(successor)


def a_buffer_owning_its_stream_freed_in_a_cycle() -> None:
    """A buffer that owns its stream and frees itself stream-ordered in
    ``__del__``, garbage in a cycle: the collection finalizes the buffer (its
    hold) and the stream in one pass; the memory is released once the work
    before the hold completed, not kept for good."""
    released: list[weakref.ref[_Memory]] = []

    class Buffer:
        def __init__(self) -> None:
            self.me = self
            self.stream = cs.Stream()

        def __del__(self) -> None:
            memory = _Memory()
            released.append(weakref.ref(memory))
            cs.hold(memory, until=self.stream)

    Buffer()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "kept ... alive for good" would raise
        gc.collect()
        assert len(released) == 1
        assert _released_soon(released[0])


def close_from_a_finalizer_in_a_collection_inside_a_record() -> None:
    """A finalizer that closes its stream (listened to by a view handed
    through its bare handle), run by a collection that started inside a
    record: the close is finished at the next library call, which records the
    view's hold first."""
    s, ref, view, latch = _viewed_through_its_handle(SimOps())

    class Worker:
        def __init__(self, stream: cs.Stream) -> None:
            self.me, self.stream = self, stream

        def __del__(self) -> None:
            self.stream.close()

    gc.disable()  # (no collection before the one started inside the record)
    Worker(s)  # garbage; the stream is not (this function holds it): it is closed, not collected
    try:
        with _collection_in_the_next_record() as pending:
            cs.hold(object(), until=cs.Stream())
    finally:
        gc.enable()
    assert not pending and s.closed
    del view
    cs.stats()
    assert ref() is not None  # recorded behind the latch, before the stream went
    latch.release()
    assert _released_soon(ref)


def hold_in_a_collection_releases_no_other_hold() -> None:
    """A finalizer's hold recorded at once (the collection started inside
    another hold's record, before that record was enqueued) lands before a
    latch, and the other hold after it; the table releases a stream's holds
    in record order, all those before one found done, so the finalizer's
    must not sit behind the other there: found done first, it would release
    the other's owner while the latch still holds the stream."""
    ops = SimOps()
    s = cs.Stream()
    cs.hold(_Memory(), until=s)  # done at once: first in the stream's holds
    cs.stats()  # (and released)
    first = _Memory()
    cs.hold(first, until=s)  # done at once, still in the table
    held: list[Any] = []

    class Freer:
        def __init__(self) -> None:
            self.me = self

        def __del__(self) -> None:
            cs.hold(_Memory(), until=s)  # recorded at once: done at once
            held.append(ops.latch(s))  # the other hold's record comes after it

    gc.disable()
    Freer()
    other = _Memory()
    ref = weakref.ref(other)
    try:
        with _collection_in_the_next_record() as pending:
            cs.hold(other, until=s)
    finally:
        gc.enable()
    assert not pending and len(held) == 1
    del first, other
    for _ in range(20):
        cs.stats()
        threading.Event().wait(0.001)
    assert ref() is not None  # behind the latch
    held[0].release()
    assert _released_soon(ref)


def a_buffer_freed_in_a_cycle_after_the_stream_it_owns() -> None:
    """The same, with the Stream made before the buffer: the collection
    finalizes the Stream first (its end waits for the next library call),
    then the buffer's ``hold`` on it, which must still record there (it
    exists until then), not refuse and let the memory go under the latched
    reader for the allocator to hand out."""
    ops, backend = SimOps(), cs.current_backend()

    class Buffer:
        def __init__(self, stream: cs.Stream, arr: Any) -> None:
            self.me, self.stream, self.arr = self, stream, arr

        def __del__(self) -> None:
            cs.hold(self.arr, until=self.stream)  # free stream-ordered

    out = ops.array(np.zeros(256, np.float32))
    s = cs.Stream()  # made first: finalized first
    arr = ops.array(np.full(256, 1.0, np.float32))
    latch = ops.latch(s)
    ops.copy(s, out, arr)  # reads arr behind the latch
    done = backend.create_event()
    backend.record(done, s.handle)
    Buffer(s, arr)
    del s, arr
    gc.collect()
    other = ops.array(np.full(256, 9.0, np.float32))  # would take a freed block
    latch.release()
    backend.synchronize_event(done)
    assert ops.to_host(out)[0] == 1.0
    del other
    stats = cs.stats()
    assert stats["events_in_flight"] >= 0  # the finalizer's event counted where it returned


def hold_in_a_collection_inside_the_simulators_enqueue() -> None:
    """A collection that starts while the simulator holds a stream's lock
    (enqueueing onto it) runs a finalizer that holds memory until that very
    stream: a driver takes such a call from any context, and so must the
    simulator."""
    backend = cs.current_backend()
    s = cs.Stream()
    simulated = backend._resolve(s.handle)  # type: ignore[attr-defined]
    freed: list[weakref.ref[_Memory]] = []
    pending = [True]

    class CollectingOps(deque[Any]):
        def extend(self, ops: Iterable[Any]) -> None:
            super().extend(ops)
            if pending and pending.pop():
                _SelfFreeing(s, freed)  # garbage: this collection runs its __del__
                gc.collect()

    simulated._ops = CollectingOps(simulated._ops)
    gc.disable()
    try:
        cs.hold(object(), until=s)  # its record enqueues onto s: the collection runs in there
    finally:
        gc.enable()
    assert not pending and len(freed) == 1
    assert _released_soon(freed[0])


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
        hold_in_a_collection_lands_where_asked_whatever_becomes_of_the_handle,
        a_buffer_owning_its_stream_freed_in_a_cycle,
        close_from_a_finalizer_in_a_collection_inside_a_record,
        hold_in_a_collection_releases_no_other_hold,
        a_buffer_freed_in_a_cycle_after_the_stream_it_owns,
        hold_in_a_collection_inside_the_simulators_enqueue,
    ],
    ids=lambda f: f.__name__,
)
def test_a_finalizer_calling_the_library_from_inside_it_is_safe(
    scenario: Callable[[], None],
) -> None:
    _bounded(scenario)


def test_closing_a_stream_starts_no_collection_while_its_listeners_are_locked() -> None:
    """A collection started while a stream's lifetime lock is held runs
    finalizers that may close that very stream (waiting on the lock for
    good): with a collection at every allocation, none starts under it."""
    streams = [cs.Stream() for _ in range(4)]
    held: list[bool] = []
    locks = [s._lifetime._lock for s in streams if s._lifetime is not None]

    def probe(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            held.append(any(lock.locked() for lock in locks))

    thresholds = gc.get_threshold()
    gc.callbacks.append(probe)
    try:
        for pad, s in enumerate(streams):  # (a collection every second allocation:
            gc.collect()  # each close starts at another phase of it)
            gc.set_threshold(1)
            _ = [[] for _ in range(pad)]
            s.close()
            gc.set_threshold(*thresholds)
    finally:
        gc.set_threshold(*thresholds)
        gc.callbacks.remove(probe)
    assert held  # collections did start
    assert not any(held)
