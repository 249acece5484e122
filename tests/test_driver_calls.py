"""Driver calls per handoff: the hot path makes no call it does not need.

On a GPU each backend call is a driver call of 1-3 µs with its Python wrapper:
they dominate a handoff's host cost (issue 20). Each test counts the calls of
one operation, in the steady state of a loop (its streams synchronized and the
library's own bookkeeping settled before each counted call, so the count is
the same every time; where the event pool's reclaim batches make single calls
differ, over whole batches), against an upper bound equal to what the library
makes now, each call named. A change that adds a call to a hot path fails
here; one that removes one lowers the bound.

Beside them, the ordering the cut paths still give, shown with data: a loop
of handoffs longer than the event pool's reclaim batch, whose slow, jittered
producer kernels a consumer that did not wait reads too early (the control).
"""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import cai_streams as cs
from cai_streams import sim
from cai_streams._events import RECLAIM_AT, Mark, pool_for
from cai_streams._hold_table import TICK_QUERIES

from .backend_calls import counting

#: counted calls per operation (after the warm-up)
REPEATS = 4


@pytest.fixture
def sim_backend() -> Iterator[cs.Backend]:
    previous = cs.current_backend()
    chosen = cs.use_backend("sim")
    try:
        with cs.sanitize(False):  # what is counted is the library's, not the sanitizer's
            yield chosen
    finally:
        cs.use_backend(previous.name)


def _calls(
    op: Callable[[], object], *streams: cs.Stream, settle: bool = True, repeats: int = REPEATS
) -> list[Counter[str]]:
    """The backend calls of each of REPEATS calls of ``op``, after a warm-up;
    before each, outside the count, ``streams`` are synchronized (the work is
    complete) and, with ``settle``, ``cs.stats()`` records the holds of views let
    go and, once they are done, releases them and reclaims the event pools."""
    backend = cs.current_backend()
    gc.collect()  # what earlier tests left in cycles (an Event, say) is not counted here
    counts = []
    for i in range(repeats + 2):
        for _ in range(2 if settle else 1):  # (the holds stats() records, then done)
            for s in streams:
                s.synchronize()
            if settle:
                cs.stats()
        with counting(backend) as calls:
            op()
        if i >= 2:  # the first two: caches, pools, a lease's first record
            counts.append(calls)
    return counts


def _at_most(counts: list[Counter[str]], bound: dict[str, int]) -> None:
    for calls in counts:
        over = Counter(calls)
        over.subtract(bound)
        assert max(over.values(), default=0) <= 0, f"{dict(calls)} made, at most {bound} expected"


#: consume(arr, stream=s) of a v3 producer on another stream
ENQUEUE = {
    "capture_status": 2,  # the producer's and the consumer's, once each (CaptureError rules)
    "record": 1,  # an event on the producer's stream
    "stream_wait_event": 1,  # the consumer's stream waits for it
}
#: consume(arr) of a v3 producer whose stream is idle
HOST = {
    "capture_status": 1,  # a capturing producer cannot be waited for on the host
    "exchange_capture_mode": 2,  # relaxed around the query, and back (another
    "query_stream": 1,  # thread's global capture forbids a query): once each
}
#: consume(t) of a tracked array whose writes are complete: its own state says so
TRACKED: dict[str, int] = {}
#: an empty ``writing(s)`` block of a tracked array with nothing pending
BLOCK = {
    "capture_status": 2,  # at its start (a capture begun in it: _pending._fence), and the record's
    "record": 1,  # its write, on s
}


def test_enqueue_mode_makes_the_floors_two_calls_and_two_capture_asks(
    sim_backend: cs.Backend,
) -> None:
    producer, mine = cs.Stream(), cs.Stream()
    arr = sim.empty(1024)
    arr.stream = producer.handle
    _at_most(_calls(lambda: cs.consume_blocking(arr, stream=mine), producer, mine), ENQUEUE)
    _at_most(_calls(lambda: asyncio.run(cs.consume(arr, stream=mine)), producer, mine), ENQUEUE)


def test_enqueue_mode_of_a_new_owner_each_call(sim_backend: cs.Backend) -> None:
    """The previous owner's view is let go: its lease records one hold on the
    consumer's stream, and the table finds an older one done; the pool reclaims
    the joins' events in batches. Not settled by ``cs.stats()`` between calls:
    this is a loop's steady state, counted over whole batches."""
    n = 3 * RECLAIM_AT
    producer, mine = cs.Stream(), cs.Stream()
    arrays = [sim.empty(16) for _ in range(n + 2)]
    for a in arrays:
        a.stream = producer.handle
    batches = n // RECLAIM_AT + 1  # (the count may begin anywhere in a batch)
    per_call = {
        **ENQUEUE,
        "capture_status": 2 + 3,  # the hold's stream: before, at and after its record
        "record": 1 + 1,  # the hold's event, on the consumer's stream
        "exchange_capture_mode": 2,  # the hold table's queries, relaxed
        # the join's event, once (the pool reclaims before adding the new one); the
        # previous hold, found done; a hold recorded just now, on a stream idle but
        # for it, may be found pending, by up to TICK_QUERIES queries (timing)
        "query": 1 + 1 + TICK_QUERIES,
    }
    bound = {name: count * n for name, count in per_call.items()}
    bound["exchange_capture_mode"] += 2 * batches  # the pool's batch, relaxed
    cs.stats()  # the pool's released events reclaimed: fewer than a batch from here
    pool = pool_for(sim_backend, 0)  # and free events, as a loop's pool has (see below)
    spare = [pool.acquire() for _ in range(4 * n)]
    for event in spare:
        pool.reuse(event)  # never recorded: complete
    ops = iter(arrays)
    total: Counter[str] = Counter()
    for calls in _calls(lambda: cs.consume_blocking(next(ops), stream=mine), producer, mine,
                        settle=False, repeats=n):  # fmt: skip
        total.update(calls)
    _at_most([total], bound)


def test_host_mode_of_an_idle_producer_is_one_query(sim_backend: cs.Backend) -> None:
    producer = cs.Stream()
    arr = sim.empty(1024)
    arr.stream = producer.handle
    _at_most(_calls(lambda: cs.consume_blocking(arr), producer), HOST)
    _at_most(_calls(lambda: asyncio.run(cs.consume(arr)), producer), HOST)


@pytest.mark.parametrize("mode", ["blocking", "await"])
def test_a_host_wait_gives_its_event_back_at_once(sim_backend: cs.Backend, mode: str) -> None:
    """A host-mode consume of pending work records an event and waits until it
    is done: it is free again at once (no query later), and it keeps nothing
    alive, so the owner goes with its last view. A failed or cancelled wait
    instead leaves it to the pool (``test_consume``)."""
    producer = cs.Stream()
    arr = sim.asarray(np.zeros(1024, np.float32))
    arr.stream = producer.handle
    pool = pool_for(sim_backend, 0)
    cs.stats()
    before = (pool.acquired, pool.in_flight)
    sim.launch(producer, _fill, arr, 1.0, writes=[arr], duration=SLOW)
    view = cs.consume_blocking(arr) if mode == "blocking" else asyncio.run(cs.consume(arr))
    assert pool.acquired == before[0] + 1  # the stream was busy: an event was recorded
    assert pool.in_flight == before[1]  # and is free already
    gone = weakref.finalize(arr, lambda: None)
    del view, arr
    assert not gone.alive
    producer.close()


def test_a_capturing_consumer_of_an_idle_producer_takes_no_event(sim_backend: cs.Backend) -> None:
    """A consumer's stream captures and the producer's is idle: the join needs
    no wait, and the event it took first goes back unrecorded, not counted as
    handed out and free at once. Control: a join that records (the producer
    in the same capture) hands one out."""
    producer, mine = cs.Stream(), cs.Stream()
    arr = sim.empty(1024)
    arr.stream = producer.handle
    cs.stats()
    before = cs.stats()
    mine.begin_capture("relaxed")
    try:
        for _ in range(3):
            cs.consume_blocking(arr, stream=mine)
        after = cs.stats()
        assert after["events_acquired"] == before["events_acquired"]
        assert after["events_in_flight"] == before["events_in_flight"]
    finally:
        mine.end_capture().close()
    producer.begin_capture("relaxed")
    try:
        side = cs.Stream()
        side.wait(producer.record())  # side joins the producer's capture
        before = cs.stats()
        cs.consume_blocking(arr, stream=side)  # a graph edge: recorded
        assert cs.stats()["events_acquired"] == before["events_acquired"] + 1
        producer.wait(side.record())
    finally:
        producer.end_capture().close()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_only_tracked_handoffs_ask_who_is_calling(
    sim_backend: cs.Backend, monkeypatch: pytest.MonkeyPatch, anyio_backend: str
) -> None:
    """Only a tracked row looks at who calls (another owner's open block is
    waited for): an untracked handoff never asks (a few calls into the async
    library each time); a tracked one asks once, unless it is a host consume
    with nothing open or pending (complete at once, no row built)."""
    from cai_streams import _blocks, _consume

    asked = 0
    real = _blocks.current_owner

    def counted() -> Any:
        nonlocal asked
        asked += 1
        return real()

    monkeypatch.setattr(_consume, "current_owner", counted)
    producer, mine = cs.Stream(), cs.Stream()
    arr = sim.empty(1024)
    arr.stream = producer.handle
    cs.consume_blocking(arr)
    cs.consume_blocking(arr, stream=mine)
    await cs.consume(arr)
    await cs.consume(arr, stream=mine)
    await cs.consume_all(arr, arr)
    assert asked == 0
    t = cs.track(sim.empty(1024))
    cs.consume_blocking(t)
    await cs.consume(t)
    assert asked == 0
    with t.writing(producer):  # a pending write: the row, which asks
        sim.launch(producer, lambda a: a.fill(1.0), t.array, writes=[t.array])
    cs.consume_blocking(t)
    await cs.consume(t, stream=mine)
    await cs.consume_all(arr, t)
    assert asked == 3


def test_a_block_asks_the_capture_state_twice_and_records_once(sim_backend: cs.Backend) -> None:
    s = cs.Stream()
    t = cs.track(sim.empty(1024))

    def block() -> None:
        with t.writing(s):
            pass

    _at_most(_calls(block, s), BLOCK)


def test_host_mode_of_complete_tracked_work_makes_no_call(sim_backend: cs.Backend) -> None:
    s = cs.Stream()
    t = cs.track(sim.empty(1024))
    with t.writing(s):
        sim.launch(s, lambda a: a.fill(1.0), t.array, writes=[t.array])
    _at_most(_calls(lambda: cs.consume_blocking(t), s), TRACKED)
    _at_most(_calls(lambda: asyncio.run(cs.consume(t)), s), TRACKED)


def test_a_loops_pool_reclaims_in_batches(sim_backend: cs.Backend) -> None:
    """A loop from an empty pool: it grows to about RECLAIM_AT events; from
    then on every few releases reclaim a batch in one relaxed capture scope:
    one mode exchange pair per batch, one query per event (each found done)."""
    producer, mine = cs.Stream(), cs.Stream()
    arr = sim.empty(1024)
    arr.stream = producer.handle
    cs.stats()  # every completed event free: then none free for this loop
    pool = pool_for(sim_backend, 0)
    taken = [pool.acquire() for _ in range(pool.free)]
    try:
        n = 4 * RECLAIM_AT
        op = lambda: cs.consume_blocking(arr, stream=mine)  # noqa: E731
        total: Counter[str] = Counter()
        for calls in _calls(op, producer, mine, settle=False, repeats=n):
            total.update(calls)
    finally:
        for event in taken:
            pool.reuse(event)
    bound = {name: count * n for name, count in ENQUEUE.items()}
    bound["query"] = n  # each join's event once, found done
    # a batch every RECLAIM_AT releases, relaxed around it and back (the count
    # may begin anywhere in one)
    bound["exchange_capture_mode"] = 2 * (n // RECLAIM_AT + 1)
    bound["create_event"] = RECLAIM_AT  # the pool's growth, once
    _at_most([total], bound)
    assert total["exchange_capture_mode"] < n, "no batching: a pair per handoff"


# -- the ordering the cut paths give, with data ----------------------------------

#: each producer kernel's duration, before the simulator's seeded jitter
SLOW = 0.002


def _fill(buf: np.ndarray[Any, Any], value: float) -> None:
    buf.fill(value)


def _take(out: np.ndarray[Any, Any], src: np.ndarray[Any, Any], i: int) -> None:
    out[i] = src[0]


@pytest.mark.parametrize("sync", [True, False], ids=["ordered", "control"])
@pytest.mark.parametrize("enqueue", [True, False], ids=["enqueue", "host"])
def test_a_loop_of_handoffs_reads_each_producers_data(
    sim_backend: cs.Backend, enqueue: bool, sync: bool
) -> None:
    """Three reclaim batches of v3 handoffs from two producer streams, each
    buffer written by a slow kernel: the consumer's stream (or the host) reads
    what the producer wrote. The control, ``sync=False``, reads too early."""
    n = 3 * RECLAIM_AT
    producers, mine = (cs.Stream(), cs.Stream()), cs.Stream()
    out = sim.asarray(np.zeros(n, np.float32))
    got = np.zeros(n, np.float32)
    for i in range(n):
        buf = sim.asarray(np.zeros(4, np.float32))
        ps = producers[i % 2]
        sim.launch(ps, _fill, buf, float(i + 1), writes=[buf], duration=SLOW)
        buf.stream = ps.handle
        if enqueue:
            view = cs.consume_blocking(buf, stream=mine, sync=sync)
            sim.launch(mine, _take, out, view, i, reads=[view], writes=[out])
        else:
            cs.consume_blocking(buf, sync=sync)
            got[i] = buf.to_host()[0]  # on the legacy stream: ordered after no producer
    if enqueue:
        got = out.to_host(mine)
    for ps in producers:
        ps.synchronize()
    expected = np.arange(1, n + 1, dtype=np.float32)
    if sync:
        assert (got == expected).all(), got
    else:
        assert (got != expected).any(), "the control read every value after its write"


@pytest.mark.parametrize(
    ("sync", "held"),
    [(True, True), (False, True), (True, False)],
    ids=["held", "sync off", "control"],
)
def test_a_loop_of_new_owners_keeps_each_until_its_reader_ran(
    sim_backend: cs.Backend, sync: bool, held: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each owner is dropped right after its handoff while a slow kernel on
    the consumer's stream still has to read it: the hold each let-go view
    records keeps its block from the next allocation of its size, with sync
    off too (the producer's ordering is the caller's then, not the owner's
    life). The control takes no hold (``_keep_owner`` undone) and has the
    block written over first."""
    from cai_streams import _consume

    if not held:
        monkeypatch.setattr(_consume, "_keep_owner", lambda h, **kwargs: None)
    n = 3 * RECLAIM_AT
    producer, mine = cs.Stream(), cs.Stream()
    out = sim.asarray(np.zeros(n, np.float32))
    for i in range(n):
        buf = sim.asarray(np.full(4, i + 1, np.float32))
        buf.stream = producer.handle
        view = cs.consume_blocking(buf, stream=mine, sync=sync)
        memory = sim._numpy_view(view)  # what a kernel gets: it keeps no owner alive
        sim.launch(mine, _take, out, memory, i, writes=[out], duration=SLOW)
        del buf, view, memory  # the next asarray may get the block at once
        producer.synchronize()  # its join's event done: were the view's lease gone, the
        # pool would let go of the view at once, and nothing else would keep the owner
    got = out.to_host(mine)
    expected = np.arange(1, n + 1, dtype=np.float32)
    if held:
        assert (got == expected).all(), got
    else:
        assert (got != expected).any(), "the control's blocks were never reused early"


def _copy(out: np.ndarray[Any, Any], src: np.ndarray[Any, Any]) -> None:
    out[...] = src


@pytest.mark.parametrize("told", [True, False], ids=["captured", "control"])
def test_a_join_in_one_capture_is_a_graph_edge_whose_events_are_never_queried(
    sim_backend: cs.Backend, told: bool
) -> None:
    """An untracked producer's stream and the consumer's are in one capture:
    the join is a graph edge, and its record, told "in a capture" by the join's
    ask just before it, is never queried while the capture is
    under way: two batches of releases and a full reclaim leave it intact, and
    the replay reads what the captured producer wrote. The control releases
    the same records marked "not captured": the reclaim queries them, and the
    capture is invalidated."""
    s, side = cs.Stream(), cs.Stream()
    arr, out = sim.asarray(np.zeros(64, np.float32)), sim.asarray(np.zeros(64, np.float32))
    pool = pool_for(sim_backend, 0)
    s.begin_capture()
    sim.launch(s, _fill, arr, 3.0, writes=[arr], duration=SLOW)
    side.wait(s.record())  # side joins the capture
    arr.stream = s.handle
    if told:
        for _ in range(2 * RECLAIM_AT):
            cs.consume_blocking(arr, stream=side)  # a wait among capturing streams
    else:
        events = [pool.acquire() for _ in range(2 * RECLAIM_AT)]
        for event in events:
            sim_backend.record(event, s.handle)
            sim_backend.stream_wait_event(side.handle, event)
        for event in events:
            pool.release(event, None, Mark(s._key(), 0, captured=False))
    cs.stats()  # every pool reclaimed, captured events included
    if not told:
        assert sim_backend.capture_status(s.handle) == "invalidated"
        with pytest.raises(cs.CudaError):
            s.end_capture()
        return
    sim.launch(side, _copy, out, arr, reads=[arr], writes=[out], duration=SLOW)
    s.wait(side.record())
    with s.end_capture() as graph:  # not invalidated
        graph.launch(s)
        s.synchronize()
    np.testing.assert_array_equal(out.to_host(), 3.0)
