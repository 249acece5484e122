"""The event pool: released events are reused once complete, for as few
queries as possible, and a long kernel holds up no one else's reuse."""

from __future__ import annotations

import weakref
from collections.abc import Iterator

import pytest

import cai_streams as cs
from cai_streams._backend import CaptureStatus
from cai_streams._events import ACQUIRE_MISSES, RECLAIM_AT, EventPool, Mark

from .device_ops import DeviceOps, Latch


class _Queries:
    """Counts the backend's event queries, and which found the work pending."""

    def __init__(self, backend: cs.Backend) -> None:
        self.backend = backend
        self.pending = 0
        self.done = 0

    def __enter__(self) -> _Queries:
        query = self.backend.query

        def counted(event: int) -> bool:
            found = query(event)
            if found:
                self.done += 1
            else:
                self.pending += 1
            return found

        self.backend.query = counted  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        del self.backend.query


@pytest.fixture
def held(ops: DeviceOps) -> Iterator[tuple[cs.Stream, Latch]]:
    """A stream whose work waits for a latch (released at teardown)."""
    s = cs.Stream()
    latch = ops.latch(s)
    yield s, latch
    latch.release()
    s.synchronize()
    s.close()


def test_releases_behind_pending_work_spend_one_query_a_batch(
    held: tuple[cs.Stream, Latch],
) -> None:
    s, _ = held
    backend = cs.current_backend()
    pool = EventPool(backend)
    events = [pool.acquire() for _ in range(20)]
    with _Queries(backend) as queries:
        for event in events:
            backend.record(event, s.handle)
            pool.release(event)
    # every RECLAIM_AT-th release asks about the oldest pending event once,
    # then stops: querying the rest would find them pending too (record order)
    assert (queries.pending, queries.done) == (20 // RECLAIM_AT, 0)
    assert pool.free == 0


def test_owners_are_let_go_at_most_a_batch_of_releases_late(
    held: tuple[cs.Stream, Latch],
) -> None:
    """What a released event keeps alive is let go once the event completes,
    at most RECLAIM_AT releases later, however many free events the pool has
    (so no acquire ever needs to reclaim); control: while its work is pending,
    the owner is kept through every release."""
    slow, latch = held
    idle = cs.Stream()
    backend = cs.current_backend()
    pool = EventPool(backend)
    spare = [pool.acquire() for _ in range(4 * RECLAIM_AT)]
    for event in spare:
        pool.reuse(event)  # a pool that never runs out

    class Owner:
        pass

    def released_until_gone(owner_ref: weakref.ref[Owner], stream: cs.Stream) -> int:
        for n in range(1, 3 * RECLAIM_AT):
            event = pool.acquire()
            backend.record(event, stream.handle)
            stream.synchronize()
            pool.release(event)
            if owner_ref() is None:
                return n
        return -1

    owner = Owner()
    ref = weakref.ref(owner)
    event = pool.acquire()
    backend.record(event, slow.handle)
    pool.release(event, owner)
    del owner
    assert released_until_gone(ref, idle) == -1  # control: pending, kept
    latch.release()
    slow.synchronize()
    assert 1 <= released_until_gone(ref, idle) <= RECLAIM_AT
    assert pool.created == 4 * RECLAIM_AT
    idle.close()


def test_a_long_kernel_holds_up_no_one_elses_reuse(
    held: tuple[cs.Stream, Latch],
) -> None:
    slow, _ = held
    idle = cs.Stream()
    backend = cs.current_backend()
    pool = EventPool(backend)
    first, *others = [pool.acquire() for _ in range(1 + 2 * RECLAIM_AT)]
    backend.record(first, slow.handle)  # pending until the latch is released
    pool.release(first)
    for event in others:
        backend.record(event, idle.handle)
        idle.synchronize()  # complete
        pool.release(event)
    # completed ones are handed out again (a batch's worth), the pending one is
    # not, and no event is made meanwhile
    again = {pool.acquire() for _ in range(RECLAIM_AT)}
    assert again <= set(others)
    assert pool.created == 1 + 2 * RECLAIM_AT
    idle.close()


def test_reclaim_moves_every_completed_event_past_pending_ones(
    held: tuple[cs.Stream, Latch],
) -> None:
    """What ``cs.stats()`` reports: ``reclaim()`` takes every completed event,
    not just those before the first pending one."""
    slow, _ = held
    idle = cs.Stream()
    backend = cs.current_backend()
    pool = EventPool(backend)
    events = [pool.acquire() for _ in range(11)]
    backend.record(events[0], slow.handle)  # pending, and first in line
    for event in events[1:]:
        backend.record(event, idle.handle)
    idle.synchronize()
    for event in events:
        pool.release(event)
    pool.reclaim()
    assert (pool.free, pool.in_flight) == (10, 1)
    idle.close()


def test_a_burst_left_waiting_is_let_go_by_the_next_batch(
    held: tuple[cs.Stream, Latch],
) -> None:
    """A burst of releases behind a long kernel, then a loop of releases of
    completed work: once the kernel is done, the next batch lets go of the whole
    backlog (every completed event up to the first pending, not a batch's
    worth), and from then on at most a batch of owners waits. Control: while
    the kernel is pending, the burst's owners are all kept."""
    slow, latch = held
    idle = cs.Stream()
    backend = cs.current_backend()
    pool = EventPool(backend)

    class Owner:
        pass

    alive: set[int] = set()

    def owner() -> Owner:
        made = Owner()
        alive.add(id(made))
        weakref.finalize(made, alive.discard, id(made))
        return made

    burst = 10 * RECLAIM_AT
    for _ in range(burst):
        event = pool.acquire()
        backend.record(event, slow.handle)
        pool.release(event, owner())
    assert len(alive) == burst  # control: pending, every one kept
    latch.release()
    slow.synchronize()
    for i in range(3 * RECLAIM_AT):
        event = pool.acquire()
        backend.record(event, idle.handle)
        idle.synchronize()
        pool.release(event, owner())
        if i >= RECLAIM_AT:  # a batch has come: the backlog is gone
            assert len(alive) <= RECLAIM_AT, len(alive)
    assert pool.created <= burst + RECLAIM_AT
    idle.close()


def test_an_acquire_with_nothing_free_reclaims_past_a_pending_event(
    held: tuple[cs.Stream, Latch],
) -> None:
    """Two pending events and two completed ones wait, the pending ones in
    front, and nothing is free: an acquire hands out a completed one rather
    than make an event (it stops at the second pending one it finds)."""
    slow, _ = held
    idle = cs.Stream()
    backend = cs.current_backend()
    pool = EventPool(backend)
    pending = [pool.acquire(), pool.acquire()]
    done = [pool.acquire(), pool.acquire()]
    for event in pending:
        backend.record(event, slow.handle)
    for event in done:
        backend.record(event, idle.handle)
    idle.synchronize()
    for event in [*pending, *done]:  # the batch's reclaim, at the last, finds one pending
        pool.release(event)
    assert (pool.free, pool.in_flight) == (0, 4)
    assert pool.acquire() in done
    assert pool.created == 4
    idle.close()


def test_an_acquire_with_nothing_free_stops_at_its_second_pending_event(
    held: tuple[cs.Stream, Latch],
) -> None:
    """The host ahead of the GPU: every released event pending, nothing free.
    An acquire asks about ACQUIRE_MISSES of them, then makes an event, rather
    than query a batch's worth each time (what the host running ahead costs)."""
    slow, _ = held
    backend = cs.current_backend()
    pool = EventPool(backend)
    events = [pool.acquire() for _ in range(3 * RECLAIM_AT)]
    for event in events:
        backend.record(event, slow.handle)
        pool.release(event)
    with _Queries(backend) as queries:
        made = pool.created
        pool.acquire()
    assert (queries.pending, queries.done) == (ACQUIRE_MISSES, 0)
    assert pool.created == made + 1
    assert ACQUIRE_MISSES < RECLAIM_AT  # (else the bound above says nothing)


def test_a_batch_asks_each_streams_capture_state_once(
    backend: cs.Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Events recorded in captures still under way, several on each of more
    streams than a batch asks about: a batch asks at most RECLAIM_AT streams'
    capture state, each once; a full reclaim asks every stream once, never once
    per record. Once the captures end, a few batches let go of every record."""
    if backend.name != "sim":
        pytest.skip("counts the simulator's capture-state asks")
    streams = [cs.Stream() for _ in range(2 * RECLAIM_AT)]
    per_stream = 5
    pool = EventPool(backend)
    events = [pool.acquire() for _ in range(len(streams) * per_stream)]
    for spare in [pool.acquire() for _ in range(4 * RECLAIM_AT)]:
        pool.reuse(spare)  # free ones: no acquire below needs to reclaim
    asked: list[int] = []
    real = backend.capture_status

    def counted(handle: int) -> CaptureStatus:
        asked.append(handle)
        return real(handle)

    for s in streams:
        s.begin_capture("relaxed")
    try:
        records = iter(events)
        for s in streams:
            for i in range(per_stream):
                event = next(records)
                backend.record(event, s.handle)
                pool.release(event, None, Mark(s._key(), i, captured=True))
        assert pool.in_flight == len(events)  # all under way: none let go
        with monkeypatch.context() as mp:
            mp.setattr(backend, "capture_status", counted)
            for _ in range(RECLAIM_AT):  # one batch
                pool.release(pool.acquire())
            assert 1 <= len(asked) <= RECLAIM_AT
            assert len(set(asked)) == len(asked)
            asked.clear()
            pool.reclaim()
            assert sorted(asked) == sorted(s.handle for s in streams)
    finally:
        for s in streams:
            s.end_capture().close()
    for _ in range(3 * RECLAIM_AT):  # three batches (a stream's records may straddle two)
        pool.release(pool.acquire())
    assert pool.in_flight < RECLAIM_AT  # (those released since the last batch)
    for s in streams:
        s.close()
