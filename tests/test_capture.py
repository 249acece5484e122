"""Graph capture through the library: the API, and a library correct under it.

Each CaptureError case checks that the capture is still valid afterwards (its
``end_capture`` succeeds) beside a control: the raw backend calls the library
would otherwise have made, which invalidate it (or, for a fork into the
capture, make ``end_capture`` fail). The sanitizer is off here, as in the
capture conformance suite: these controls make the raw calls on purpose. (It
models graphs by their launches: tests/test_sanitizer.py, and
tests/test_capture_spanning_blocks.py, which runs graphs sanitized.)
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import numpy as np
import pytest

import cai_streams as cs
from cai_streams import _capture_guard, _poller, _tracked, sim
from cai_streams._capture import GraphState
from cai_streams._scheduler import scheduler_for

from .device_ops import DeviceOps, SimOps, held
from .test_conformance_capture import _code

pytestmark = pytest.mark.anyio


@pytest.fixture(autouse=True)
def _unsanitized() -> Iterator[None]:
    with cs.sanitize(False):
        yield


@contextlib.contextmanager
def _capturing(s: cs.Stream, mode: str = "global") -> Iterator[None]:
    """Capture on ``s`` in the block; whatever happens, it is not capturing after."""
    s.begin_capture(mode)
    try:
        yield
    finally:
        if s.is_capturing:
            with contextlib.suppress(cs.CudaError):
                s.end_capture().close()


def _still_valid(s: cs.Stream) -> None:
    """The capture on ``s`` survived: it ends into a graph."""
    assert s.backend.capture_status(s.handle) == "active"
    s.end_capture().close()


def _write(ops: DeviceOps, s: cs.Stream, arr: Any, value: float) -> cs.TrackedArray:
    """``arr`` tracked, and filled with ``value`` on ``s``. Arrays are made before
    a capture begins: an allocation the pool cannot serve is a cudaMalloc, which a
    capture forbids."""
    t = cs.track(arr)
    with t.writing(s):
        ops.fill(s, arr, value)
    return t


# -- the API --------------------------------------------------------------------


def test_begin_capture_checks_its_mode_and_is_capturing_follows_it(backend: cs.Backend) -> None:
    s = cs.Stream()
    with pytest.raises(ValueError, match="'global', 'thread_local', 'relaxed'"):
        s.begin_capture("local")
    with pytest.raises(TypeError, match="must be a str"):
        s.begin_capture(1)  # type: ignore[arg-type]
    assert not s.is_capturing
    for mode in ("global", "thread_local", "relaxed"):
        s.begin_capture(mode)
        assert s.is_capturing
        with s.end_capture() as graph:
            assert graph._state is GraphState.CAPTURED
        assert not s.is_capturing
    with pytest.raises(TypeError, match="end_capture"):
        cs.Graph()


def test_closing_a_capturing_stream_raises_and_keeps_the_capture(backend: cs.Backend) -> None:
    """Destroyed while capturing, a stream would leave its capture under way with
    no way to end it, refusing the host syncs of every thread in global mode."""
    s, other = cs.Stream(), cs.Stream()
    s.begin_capture()
    with pytest.raises(cs.CaptureError, match="end_capture"):
        s.close()
    assert not s.closed and s.is_capturing
    s.end_capture().close()
    other.synchronize()  # a host sync that a global capture under way would refuse
    s.close()
    assert s.closed


def test_end_capture_raises_when_the_capture_was_invalidated(backend: cs.Backend) -> None:
    s = cs.Stream()
    s.begin_capture()
    assert _code(s.synchronize) == "cudaErrorStreamCaptureUnsupported"  # the user's own call
    with pytest.raises(cs.CudaError, match="cudaErrorStreamCaptureInvalidated") as caught:
        s.end_capture()
    assert caught.value.name == "cudaErrorStreamCaptureInvalidated"
    assert not s.is_capturing
    s.synchronize()  # an ordinary stream again


async def test_a_captured_pipeline_replays_and_a_consumer_after_the_launch_waits_for_it(
    ops: DeviceOps,
) -> None:
    """Tracked arrays written in the capture: each launch is ordered like a
    writing() block on the launch stream, so a consumer after it sees its data."""
    s, side, launch_on = cs.Stream(), cs.Stream(), cs.Stream()
    x_arr = ops.array(np.zeros(64, np.float32))
    y_arr = ops.array(np.zeros(64, np.float32))
    x, y = cs.track(x_arr), cs.track(y_arr)
    with _capturing(s):
        with x.writing(s):
            ops.add(s, x_arr, 1.0)
        side.wait(s.record())  # side forks into the capture (the user's own join)
        with y.writing(side):  # waits for x's write on s: a graph edge
            ops.copy(side, y_arr, x_arr)
            ops.add(side, y_arr, 10.0)
        s.wait(side.record())  # and joins back
        graph = s.end_capture()
    np.testing.assert_array_equal(ops.to_host(y_arr), 0.0)  # recorded, not run
    with graph:
        for launch in (1, 2):
            latch = ops.latch(launch_on)
            graph.launch(launch_on)
            # control: the data is not there yet, and a host wait knows it
            before = 0.0 if launch == 1 else 10.0 + launch - 1
            np.testing.assert_array_equal(ops.to_host(y_arr), before)
            with pytest.raises(TimeoutError):
                cs.consume_blocking(y, timeout=0.05)
            latch.release()
            view = await cs.consume(y, timeout=10)
            assert view.stream is None
            np.testing.assert_array_equal(ops.to_host(y_arr), 10.0 + launch)
        assert graph._state is GraphState.INSTANTIATED
    assert graph._state is GraphState.CLOSED  # type: ignore[comparison-overlap] # close() changed it
    with pytest.raises(ValueError, match="closed"):
        graph.launch(launch_on)
    graph.close()  # safe twice


async def test_a_capture_ended_behind_the_librarys_back_is_forgotten(
    ops: DeviceOps, backend: cs.Backend
) -> None:
    """A write on a stream forked into a capture belongs to the one capture under
    way on its device: one ended by a raw backend call does not count."""
    stale, s, side, launch_on = cs.Stream(), cs.Stream(), cs.Stream(), cs.Stream()
    arr = ops.array(np.zeros(16, np.float32))
    y = cs.track(arr)
    stale.begin_capture()
    backend.destroy_graph(backend.end_capture(stale.handle))
    with _capturing(s):
        side.wait(s.record())
        with y.writing(side):
            ops.fill(side, arr, 4.0)
        s.wait(side.record())
        graph = s.end_capture()
    with graph:
        latch = ops.latch(launch_on)
        graph.launch(launch_on)
        with pytest.raises(TimeoutError):  # the launch is y's pending write
            cs.consume_blocking(y, timeout=0.05)
        latch.release()
        await cs.consume(y, timeout=10)
    np.testing.assert_array_equal(ops.to_host(arr), 4.0)


def test_a_graph_that_cannot_be_destroyed_warns(backend: cs.Backend, monkeypatch: Any) -> None:
    s = cs.Stream()
    s.begin_capture()
    graph = s.end_capture()

    def broken(handle: int) -> None:
        raise cs.CudaError(400, "cudaErrorInvalidResourceHandle", "gone")

    real = backend.destroy_graph
    monkeypatch.setattr(backend, "destroy_graph", broken)
    with pytest.warns(cs.CudaWarning, match="leaked graph"):
        graph.__del__()
    monkeypatch.undo()
    real(graph._graph)


# -- what a capture forbids ---------------------------------------------------------


async def test_consuming_onto_a_stream_outside_the_capture_raises_and_keeps_it(
    ops: DeviceOps, backend: cs.Backend
) -> None:
    s, outside = cs.Stream(), cs.Stream()
    arr, other = ops.array(np.zeros(64, np.float32)), ops.array(np.zeros(4, np.float32))
    with _capturing(s):
        t = _write(ops, s, arr, 1.0)
        with pytest.raises(cs.CaptureError, match="Graph.launch, or pass a stream in the same"):
            await cs.consume(t, stream=outside)
        with pytest.raises(cs.CaptureError, match="capturing a graph"):
            cs.export(t)  # onto the scheduler's export stream, outside the capture
        with pytest.raises(cs.CaptureError, match="the host cannot wait"):
            await cs.consume(t)
        with pytest.raises(cs.CaptureError, match="the host cannot wait"):
            cs.consume_blocking(t)
        _still_valid(s)
    # control: the join the library refused pulls the outside stream into the
    # capture, which then cannot end
    s.begin_capture()
    event = backend.create_event()
    backend.record(event, s.handle)
    backend.stream_wait_event(outside.handle, event)
    ops.add(outside, other, 1.0)
    assert _code(s.end_capture) == "cudaErrorStreamCaptureUnjoined"
    backend.destroy_event(event)


async def test_a_host_wait_on_an_untracked_capturing_producer_raises_and_keeps_it(
    ops: DeviceOps, backend: cs.Backend
) -> None:
    s = cs.Stream()
    arr = ops.array(np.zeros(16, np.float32))
    producer = cs.read_interface(arr).with_stream(s.handle)
    with _capturing(s):
        ops.add(s, arr, 1.0)
        with pytest.raises(cs.CaptureError, match="the host cannot wait"):
            await cs.consume(producer)
        with pytest.raises(cs.CaptureError, match="the host cannot wait"):
            cs.consume_blocking(producer)
        _still_valid(s)
    with _capturing(s):  # control: the query the library did not make
        assert _code(lambda: backend.query_stream(s.handle)) == "cudaErrorStreamCaptureUnsupported"
        assert backend.capture_status(s.handle) == "invalidated"


async def test_waiting_for_an_event_recorded_in_a_capture_raises_and_keeps_it(
    backend: cs.Backend,
) -> None:
    s = cs.Stream()
    with _capturing(s):
        event = s.record()
        with pytest.raises(cs.CaptureError, match="the host cannot wait"):
            await event.wait(timeout=1)
        _still_valid(s)
        event.close()
    with _capturing(s):  # control: the poller's query of it
        event = s.record()
        assert _code(lambda: backend.query(event.handle)) == "cudaErrorCapturedEvent"
        assert backend.capture_status(s.handle) == "invalidated"
        event.close()


async def test_a_capturing_consumer_of_busy_outside_work_raises_and_keeps_it(
    ops: DeviceOps, backend: cs.Backend
) -> None:
    producer, s = cs.Stream(), cs.Stream()
    arr = ops.array(np.zeros(16, np.float32))
    t = cs.track(arr)
    latch = ops.latch(producer)
    with t.writing(producer):
        ops.fill(producer, arr, 5.0)
    untracked = cs.read_interface(ops.array(np.zeros(4, np.float32))).with_stream(producer.handle)
    try:
        with _capturing(s):
            with pytest.raises(cs.CaptureError, match="await cs.consume"):
                await cs.consume(t, stream=s)
            with pytest.raises(cs.CaptureError, match="before begin_capture"):
                await cs.consume(untracked, stream=s)
            with pytest.raises(cs.CaptureError, match="before begin_capture"):
                with t.writing(s):
                    pass
            _still_valid(s)
    finally:
        latch.release()
    # once the producer is done nothing is needed: no edge, the capture stays valid
    producer.synchronize()
    with _capturing(s):
        view = await cs.consume(t, stream=s)
        assert view.stream == s.handle
        await cs.consume(untracked, stream=s)
        _still_valid(s)
    # control: the wait the library refused, made raw while the producer is busy
    latch = ops.latch(producer)
    try:
        event = backend.create_event()
        backend.record(event, producer.handle)
        with _capturing(s):
            assert _code(lambda: backend.stream_wait_event(s.handle, event)) == (
                "cudaErrorStreamCaptureIsolation"
            )
            assert backend.capture_status(s.handle) == "invalidated"
    finally:
        latch.release()
    backend.synchronize_event(event)
    backend.destroy_event(event)


def test_the_legacy_stream_during_a_blocking_capture_raises_and_keeps_it(
    ops: DeviceOps, backend: cs.Backend
) -> None:
    """The per-thread default stream is blocking: while it captures, any use of
    the legacy stream would invalidate the capture."""
    arr = ops.array(np.zeros(16, np.float32))
    legacy = cs.Stream.wrap(1)
    per_thread = cs.Stream.wrap(2)
    with _capturing(per_thread):
        with pytest.raises(cs.CaptureError, match="legacy default stream"):
            cs.consume_blocking(cs.read_interface(arr).with_stream(legacy.handle))
        _still_valid(per_thread)


# -- ordinary work pending on the stream a capture begins on -------------------------


@pytest.mark.parametrize("consumer", ["host", "stream"])
def test_a_block_captured_after_a_pending_write_on_its_stream_does_not_replace_it(
    ops: DeviceOps, consumer: str
) -> None:
    """A held fill on ``s``, then a capture on ``s`` with a block writing the
    array: the captured record stands for work that runs only at a launch, not
    after the fill in ``s``'s order. After the capture a consumer still waits
    for the fill, and sees the data as it was before the graph."""
    arr = ops.array(np.zeros(16, np.float32))
    t = cs.track(arr)
    s = cs.Stream()
    latch = ops.latch(s)
    with t.writing(s):
        ops.fill(s, arr, 7.0)  # ordinary, held by the latch
    with _capturing(s, "relaxed"), t.writing(s):
        ops.fill(s, arr, 1.0)  # captured: runs at a launch (none here)
    try:
        if consumer == "host":
            with pytest.raises(TimeoutError):
                cs.consume_blocking(t, timeout=0.05)  # the fill is held
        else:
            c = cs.Stream()
            cs.consume_blocking(t, stream=c)
            assert held(c), "the consumer's stream did not wait for the fill"
    finally:
        latch.release()
    view = cs.consume_blocking(t, timeout=10)
    assert (ops.to_host(view) == 7).all()


def test_a_read_captured_after_a_pending_read_on_its_stream_does_not_replace_it(
    ops: DeviceOps,
) -> None:
    """Write after read: a held copy-out on ``s``, then a captured read block on
    ``s``: a writer on another stream still waits for the copy-out."""
    arr = ops.array(np.ones(16, np.float32))
    out = ops.array(np.zeros(16, np.float32))
    t = cs.track(arr)
    s, w = cs.Stream(), cs.Stream()
    latch = ops.latch(s)
    try:
        with t.reading(s):
            ops.copy(s, out, arr)  # ordinary, held by the latch
        with _capturing(s, "relaxed"), t.reading(s):
            ops.copy(s, out, arr)  # captured
        with t.writing(w):
            ops.fill(w, arr, 2.0)
        assert held(w), "the writer did not wait for the copy-out"
    finally:
        latch.release()
    w.synchronize()
    s.synchronize()
    assert (ops.to_host(out) == 1).all() and (ops.to_host(arr) == 2).all()


@pytest.mark.parametrize("how", ["consume", "export"])
def test_a_consumer_read_onto_a_capturing_stream_is_the_graphs_and_each_launch_is_ordered(
    ops: DeviceOps, how: str
) -> None:
    """``consume(t, stream=s)`` or ``export(t, stream=s)`` while ``s`` captures:
    the graph reads ``t``, so a writer after a launch waits for the launch's
    read (as for a ``reading()`` block in the capture)."""
    arr = ops.array(np.ones(16, np.float32))
    out = ops.array(np.zeros(16, np.float32))
    t = cs.track(arr)
    s, launch_on, w = cs.Stream(), cs.Stream(), cs.Stream()
    s.begin_capture("relaxed")
    try:
        view = cs.consume_blocking(t, stream=s) if how == "consume" else cs.read_interface(arr)
        if how == "export":
            cs.export(t, stream=s)
        ops.copy(s, out, view)
    finally:
        graph = s.end_capture()
    with graph:
        assert graph._capture is not None and len(graph._capture.touched) == 1
        latch = ops.latch(launch_on)
        try:
            graph.launch(launch_on)  # the copy, held behind the latch
            with t.writing(w):
                ops.fill(w, arr, 2.0)
            assert held(w), "the writer did not wait for the launch's read"
        finally:
            latch.release()
        launch_on.synchronize()
        w.synchronize()
    assert (ops.to_host(out) == 1).all() and (ops.to_host(arr) == 2).all()


def test_a_read_open_on_a_stream_that_begins_capturing_stays_open_for_its_ordinary_work(
    ops: DeviceOps,
) -> None:
    """``consume(t, stream=s)`` leaves its read open on ``s`` (a held copy);
    then ``s`` captures and a stream forked into the capture writes ``t``: the
    graph edge from ``s`` is a captured record, and the read still stands for
    the held copy, so a writer after the capture waits for it."""
    arr = ops.array(np.ones(16, np.float32))
    out = ops.array(np.zeros(16, np.float32))
    t = cs.track(arr)
    s, side, w = cs.Stream(), cs.Stream(), cs.Stream()
    latch = ops.latch(s)
    try:
        ops.copy(s, out, cs.consume_blocking(t, stream=s))  # ordinary, held
        with _capturing(s, "relaxed"):
            side.wait(s.record())
            with t.writing(side):
                ops.fill(side, arr, 5.0)  # captured: runs at a launch (none here)
            s.wait(side.record())
        with t.writing(w):
            ops.fill(w, arr, 2.0)
        assert held(w), "the writer did not wait for the held copy"
    finally:
        latch.release()
    s.synchronize()
    w.synchronize()
    assert (ops.to_host(out) == 1).all() and (ops.to_host(arr) == 2).all()


def test_two_graphs_touching_two_arrays_in_opposite_orders_launch_at_once_from_two_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A launch opens a block per array its graph touched, holding each while
    it opens the next: in one order for every graph, else two launches each
    hold the block the other waits for (a stall until the bound, then
    TimeoutError). Each block's opening is slowed so that they interleave."""
    cs.use_backend("sim")  # (simulated kernels, also under the decoy default)
    a, b = (cs.track(sim.asarray(np.zeros(4, np.float32))) for _ in range(2))

    def capture(first: cs.TrackedArray, second: cs.TrackedArray) -> cs.Graph:
        s = cs.Stream()
        s.begin_capture("relaxed")
        for t in (first, second):
            with t.writing(s):
                sim.launch(s, lambda x: x.__iadd__(1), t.array, writes=[t.array])
        return s.end_capture()

    graphs = [capture(a, b), capture(b, a)]
    enter = _tracked._enter

    def slow_enter(*args: Any, **kwargs: Any) -> Any:
        block = enter(*args, **kwargs)
        time.sleep(0.05)
        return block

    monkeypatch.setattr(_tracked, "_enter", slow_enter)
    monkeypatch.setattr(_tracked, "BLOCK_TIMEOUT", 2.0)
    errors: list[BaseException] = []

    def launch(graph: cs.Graph) -> None:
        try:
            graph.launch(cs.Stream())
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=launch, args=(g,)) for g in graphs]
    start = time.monotonic()
    for th in threads:
        th.start()
    for th in threads:
        th.join(10)
    assert not errors, errors
    assert time.monotonic() - start < 1.5  # no launch waited for the bound
    for g in graphs:
        g.close()
    got = sim._numpy_view(cs.consume_blocking(a, timeout=10))
    assert got is not None and (got == 2).all()


def test_a_read_open_on_another_threads_stream_2_names_itself_when_a_capture_forbids_it() -> None:
    """Thread A leaves a read open on its per-thread stream; thread C captures
    on its own (a blocking stream). A writer elsewhere must wait for A's read
    through the legacy stream, which C's capture forbids: CaptureError says
    whose read it is, C's capture survives, and after it the write goes on."""
    cs.use_backend("sim")  # (simulated kernels, also under the decoy default)
    arr = sim.asarray(np.ones(16, np.float32))
    t = cs.track(arr)
    reader = threading.Thread(target=lambda: cs.consume_blocking(t, stream=2))
    reader.start()
    reader.join(10)
    began, end = threading.Event(), threading.Event()
    ended: list[object] = []

    def capture() -> None:
        s2 = cs.Stream.wrap(2)
        s2.begin_capture("thread_local")
        began.set()
        end.wait(10)
        with s2.end_capture() as graph:
            ended.append(graph)

    capturer = threading.Thread(target=capture)
    capturer.start()
    w = cs.Stream()
    try:
        assert began.wait(10)
        with pytest.raises(cs.CaptureError, match=r"per-thread default stream \(2\) of another"):
            with t.writing(w):
                sim.launch(w, lambda x: x.fill(2.0), arr, writes=[arr])
    finally:
        end.set()
        capturer.join(10)
    assert len(ended) == 1  # the capture was not invalidated
    with t.writing(w):
        sim.launch(w, lambda x: x.fill(2.0), arr, writes=[arr])
    w.synchronize()
    assert (arr.to_host() == 2.0).all()


# -- joins among the streams of one capture ----------------------------------------


async def test_a_consumer_in_the_same_capture_gets_a_graph_edge(ops: DeviceOps) -> None:
    s, side = cs.Stream(), cs.Stream()
    arr, out = ops.array(np.zeros(64, np.float32)), ops.array(np.zeros(64, np.float32))
    with _capturing(s):
        t = _write(ops, s, arr, 3.0)
        side.wait(s.record())  # side is in the capture
        view = await cs.consume(t, stream=side)  # a wait among capturing streams: an edge
        assert view.stream == side.handle
        ops.copy(side, out, arr, duration=0.002)
        s.wait(side.record())
        graph = s.end_capture()
    with graph:
        graph.launch(s)
        s.synchronize()
    np.testing.assert_array_equal(ops.to_host(out), 3.0)


# -- the event pool -----------------------------------------------------------------


def test_events_recorded_in_a_capture_are_not_queried_during_it_and_reused_after(
    ops: DeviceOps, backend: cs.Backend
) -> None:
    """Never queried while the capture is under way; once it has ended, asked
    (a capture may end between a record's ask and the record:
    test_capture_ended_before_record.py), answered as taken, and reused."""
    s = cs.Stream()
    pool = scheduler_for(backend).pool
    pool.reclaim()
    arr = ops.array(np.zeros(16, np.float32))
    t = cs.track(arr)
    queried: list[int] = []
    real_query = backend.query

    def query(event: int) -> bool:
        queried.append(event)
        return real_query(event)

    with _capturing(s):
        recorded = []
        for _ in range(5):  # each write replaces the last: its event is released
            with t.writing(s):
                ops.add(s, arr, 1.0)
            (write,) = t._work.writes
            recorded.append(write.event)
        held = set(recorded[:-1])
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(backend, "query", query)
            pool.reclaim()
        assert not held & set(queried)  # never queried: that would invalidate
        assert not held & set(pool._free)
        graph = s.end_capture()  # the capture survived
    graph.close()
    pool.reclaim()
    assert held <= set(pool._free)
    created = pool.created
    for _ in range(3):  # reused: recorded again, they work
        with t.writing(s):
            ops.add(s, arr, 1.0)
    cs.consume_blocking(t, timeout=10)
    assert pool.created == created
    # control: querying one while its capture is under way invalidates it
    event = backend.create_event()
    with _capturing(s):
        backend.record(event, s.handle)
        assert _code(lambda: backend.query(event)) == "cudaErrorCapturedEvent"
        assert backend.capture_status(s.handle) == "invalidated"
    backend.destroy_event(event)


def test_events_of_a_closed_capturing_stream_are_taken_back_without_asking_the_driver(
    ops: DeviceOps, backend: cs.Backend
) -> None:
    """A destroyed stream handle must never reach the driver (undefined behaviour
    on a GPU; maybe another stream already): the pool goes by the stream's identity."""
    pool = scheduler_for(backend).pool
    arr = ops.array(np.zeros(16, np.float32))
    t = cs.track(arr)
    s = cs.Stream()
    with _capturing(s):
        for _ in range(3):
            with t.writing(s):
                ops.add(s, arr, 1.0)
        held = {a.event for a in t._work.writes}
        s.end_capture().close()
    handle = s.handle
    s.close()
    asked: list[int] = []
    real_status = backend.capture_status

    def capture_status(stream: int) -> Any:
        asked.append(stream)
        return real_status(stream)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(backend, "capture_status", capture_status)
        t._work.abandon()  # every access released: their events go back to the pool
        pool.reclaim()
    assert handle not in asked
    assert held <= set(pool._free)


async def test_waiting_on_an_event_recorded_in_a_capture_that_ended_returns_at_once(
    ops: DeviceOps, backend: cs.Backend
) -> None:
    """Refused (CaptureError) while its capture is under way; once it ended, the
    event stands for work that runs only when a graph is launched: the wait
    returns, where the driver answers cudaErrorInvalidValue to a query."""
    s = cs.Stream()
    arr = ops.array(np.zeros(8, np.float32))
    with _capturing(s):
        ops.add(s, arr, 1.0)
        event = s.record()
        with pytest.raises(cs.CaptureError):
            await event.wait(timeout=5)
        graph = s.end_capture()
    graph.close()
    assert _code(lambda: backend.query(event.handle)) == "cudaErrorInvalidValue"
    with anyio.fail_after(5):
        await event.wait(timeout=5)
    assert (ops.to_host(arr) == 0.0).all()  # the captured add never ran
    event.close()


# -- the headline: a capture in another thread survives the shared poller -----------

WAITERS = 2000
STREAMS = 8


def _poll_during_a_capture(ops: DeviceOps) -> tuple[str, int, int]:
    """A thread captures in global mode while an event loop in this thread
    polls WAITERS consumers, registered before the capture began and still
    pending while it runs. Returns how the capture ended, the errors the
    waiters saw, and the poll passes made while it was under way."""
    streams = [cs.Stream() for _ in range(STREAMS)]
    arrays = [ops.array(np.zeros(8, np.int64)) for _ in streams]
    # The capture's own stream and array are made before any stream is held: on
    # an H100 the legacy stream's copy in ops.array waited behind the held
    # (non-blocking) streams until their latches gave up (docs/gpu.md).
    captured_on = cs.Stream()
    x = ops.array(np.zeros(8, np.float32))
    latches = [ops.latch(s) for s in streams]
    for i, (s, arr) in enumerate(zip(streams, arrays, strict=True)):
        ops.fill(s, arr, float(i + 1))
    producers = [
        cs.read_interface(a).with_stream(s.handle) for a, s in zip(arrays, streams, strict=True)
    ]
    begin, began, end = threading.Event(), threading.Event(), threading.Event()
    outcome: list[str] = []

    def capture() -> None:  # this thread's mode stays "global"
        begin.wait(30)
        captured_on.begin_capture("global")
        ops.add(captured_on, x, 1.0)
        began.set()
        end.wait(30)
        try:
            captured_on.end_capture().close()
            outcome.append("valid")
        except cs.CudaError as exc:
            outcome.append(exc.name)

    errors = 0
    passes = 0
    done: list[int] = []

    async def consume_one(i: int) -> None:
        nonlocal errors
        try:
            view = await cs.consume(producers[i % STREAMS], timeout=30)
        except cs.CudaError:
            errors += 1
            return
        assert view.stream is None
        done.append(i % STREAMS)  # read once the capture has ended: a copy to the
        # host synchronizes, which a global capture in another thread forbids

    async def main() -> None:
        nonlocal passes
        async with anyio.create_task_group() as tg:
            for i in range(WAITERS):
                tg.start_soon(consume_one, i)
            await anyio.sleep(0.01)  # all registered: the poller is polling
            begin.set()
            await anyio.to_thread.run_sync(began.wait, 30)
            first = _poller.counters.passes
            for _ in range(10_000):  # bounded: the control's waiters fail at once
                if _poller.counters.passes >= first + 20 or errors:
                    break
                await anyio.sleep(0.001)
            for latch in latches:
                latch.release()
            passes = _poller.counters.passes - first
        end.set()

    thread = threading.Thread(target=capture)
    thread.start()
    try:
        anyio.run(main)
    finally:
        begin.set()
        end.set()
        for latch in latches:
            latch.release()
        thread.join(30)
    for i in sorted(set(done)):  # every consumer's stream had completed its fill
        assert (ops.to_host(arrays[i]) == i + 1).all()
    return outcome[0], errors, passes


def test_a_global_capture_in_another_thread_survives_thousands_of_polled_waiters(
    ops: DeviceOps,
) -> None:
    outcome, errors, passes = _poll_during_a_capture(ops)
    assert outcome == "valid"
    assert errors == 0
    assert passes >= 20


def test_control_a_poller_without_the_mode_exchange_invalidates_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from .device_ops import SimOps

    with sim.simulated(sanitizer=False):
        # no exchange: the calling thread's mode stays "global" (the library
        # exchanges through the backend, in relaxed() and inline around a query)
        monkeypatch.setattr(cs.current_backend(), "exchange_capture_mode", lambda mode: "global")
        outcome, errors, _ = _poll_during_a_capture(SimOps())
    assert outcome == "cudaErrorStreamCaptureInvalidated"
    assert errors > 0


def test_relaxed_restores_the_threads_mode(backend: cs.Backend) -> None:
    previous = backend.exchange_capture_mode("thread_local")
    try:
        with _capture_guard.relaxed(backend):
            assert backend.exchange_capture_mode("relaxed") == "relaxed"
        assert backend.exchange_capture_mode("thread_local") == "thread_local"
        scope = _capture_guard.RelaxedScope()
        scope.enter(backend)
        scope.enter(backend)  # once per backend
        scope.restore()
        assert backend.exchange_capture_mode("thread_local") == "thread_local"
    finally:
        backend.exchange_capture_mode(previous)


# -- random programs with a captured graph, against a sequential oracle -------------

CAPTURE_PROGRAMS = 40


class _Program:
    """Random kernels on tracked arrays: some on streams outside any capture, some
    captured (on the capture stream and a stream forked into it) and replayed by
    launches among the others. The oracle applies each kernel in program order,
    and the captured ones again at every launch: any ordering the library
    missed (a launch not after earlier writes, a later kernel not after the
    launch, a captured join that is no graph edge) gives other data."""

    def __init__(self, seed: int) -> None:
        import random

        self.rng = random.Random(seed)
        self.arrays = [sim.asarray(np.zeros(16, np.float32)) for _ in range(3)]
        self.tracked = [cs.track(a) for a in self.arrays]
        self.expect = [np.zeros(16, np.float32) for _ in self.arrays]
        self.captured: list[Callable[[list[Any]], None]] = []

    def kernel(self, stream: cs.Stream, *, captured: bool, via_consume: bool = False) -> None:
        """``via_consume``: the source is read through ``consume(stream=)``, a
        read left open on the stream, not a ``reading()`` block. A kernel a
        capture forbids (CaptureError before anything is enqueued) is skipped."""
        rng = self.rng
        dst, src, c = rng.randrange(3), rng.randrange(3), float(rng.randrange(1, 9))
        arrays, tracked = self.arrays, self.tracked
        duration = rng.choice((0.0, 0.0005, 0.002))

        def apply(xs: list[Any]) -> None:
            xs[dst][...] = xs[dst] * 0.5 + xs[src] + c

        try:
            with contextlib.ExitStack() as blocks:
                source: Any = arrays[src]
                if src != dst and via_consume:
                    source = cs.consume_blocking(tracked[src], stream=stream, timeout=10)
                blocks.enter_context(tracked[dst].writing(stream))
                if src != dst and not via_consume:
                    blocks.enter_context(tracked[src].reading(stream))
                sim.launch(
                    stream,
                    lambda d, s_: apply([d if i == dst else s_ for i in range(3)]),
                    arrays[dst],
                    source,
                    reads=[source],
                    writes=[arrays[dst]],
                    duration=duration,
                )
        except cs.CaptureError:
            return
        if captured:
            self.captured.append(apply)
        else:
            apply(self.expect)

    def check(self, where: str) -> None:
        """A host consume of a random array sees the oracle's data (or is
        refused with CaptureError, while its pending work is captured)."""
        i = self.rng.randrange(3)
        try:
            view = cs.consume_blocking(self.tracked[i], timeout=10)
        except cs.CaptureError:
            return
        got = sim._numpy_view(view)
        assert got is not None
        np.testing.assert_array_equal(got, self.expect[i], err_msg=f"{where}, array {i}")

    def launched(self) -> None:
        for apply in self.captured:
            apply(self.expect)


def _run_program(seed: int) -> None:
    program = _Program(seed)
    rng = program.rng
    outside = [cs.Stream(), cs.Stream()]
    s, side, launch_on = cs.Stream(), cs.Stream(), cs.Stream()
    for _ in range(rng.randrange(1, 4)):
        program.kernel(rng.choice(outside), captured=False)
    for stream in outside:  # the producers are done before the capture begins
        stream.synchronize()
    s.begin_capture(rng.choice(("global", "thread_local", "relaxed")))
    side.wait(s.record())
    for _ in range(rng.randrange(2, 6)):
        program.kernel(rng.choice((s, side)), captured=True)
    s.wait(side.record())
    with s.end_capture() as graph:
        for _ in range(rng.randrange(1, 4)):
            for _ in range(rng.randrange(0, 3)):
                program.kernel(rng.choice(outside), captured=False)
            graph.launch(rng.choice((launch_on, *outside)))
            program.launched()
        for _ in range(rng.randrange(0, 3)):
            program.kernel(rng.choice(outside), captured=False)
        for i, t in enumerate(program.tracked):
            view = cs.consume_blocking(t, timeout=30)
            got = sim._numpy_view(view)
            assert got is not None
            np.testing.assert_array_equal(got, program.expect[i], err_msg=f"seed {seed}, array {i}")


def test_random_programs_with_a_captured_graph_match_a_sequential_oracle() -> None:
    with sim.simulated(sanitizer=False, jitter=0.001):
        for seed in range(CAPTURE_PROGRAMS):
            _run_program(seed)


def _run_mixed_program(seed: int) -> None:
    """As :func:`_run_program`, with work left pending around the capture: on
    every stream before it (the capture's own too), reads left open by
    ``consume(stream=)`` before, in and after it, ordinary kernels and host
    consumes while it is under way, and host consumes between launches."""
    program = _Program(seed)
    rng = program.rng
    o0, o1, s, side, launch_on = (cs.Stream() for _ in range(5))
    streams = [o0, o1, s, side, launch_on]
    for _ in range(rng.randrange(1, 5)):
        program.kernel(rng.choice(streams), captured=False, via_consume=rng.random() < 0.3)
        if rng.random() < 0.3:
            program.check(f"seed {seed}, before the capture")
    if rng.random() < 0.5:
        o0.synchronize()
        o1.synchronize()
    graph = None
    s.begin_capture(rng.choice(("global", "thread_local", "relaxed")))
    try:
        side.wait(s.record())
        for _ in range(rng.randrange(1, 6)):
            r = rng.random()
            if r < 0.6:
                program.kernel(rng.choice((s, side)), captured=True, via_consume=rng.random() < 0.3)
            elif r < 0.8:
                program.kernel(rng.choice((o0, o1)), captured=False)
            else:
                program.check(f"seed {seed}, during the capture")
        s.wait(side.record())
    finally:
        graph = s.end_capture()
    with graph:
        for _ in range(rng.randrange(0, 3)):
            program.check(f"seed {seed}, after the capture")
            program.kernel(rng.choice((o0, o1)), captured=False)
        for _ in range(rng.randrange(1, 4)):
            for _ in range(rng.randrange(0, 3)):
                program.kernel(rng.choice(streams), captured=False, via_consume=rng.random() < 0.3)
            graph.launch(rng.choice(streams))
            program.launched()
            if rng.random() < 0.5:
                program.check(f"seed {seed}, after a launch")
        for i, t in enumerate(program.tracked):
            view = cs.consume_blocking(t, timeout=30)
            got = sim._numpy_view(view)
            assert got is not None
            np.testing.assert_array_equal(got, program.expect[i], err_msg=f"seed {seed}, array {i}")
    for x in streams:
        x.synchronize()
        x.close()


def test_random_programs_with_work_pending_around_a_capture_match_a_sequential_oracle() -> None:
    """Found a captured record taking the place of ordinary work on its stream,
    a consumer's open read recorded in a capture (its ordinary work then taken
    for done), and reads onto a capturing stream not handed to the graph."""
    with sim.simulated(sanitizer=False, jitter=0.002):
        for seed in range(3 * CAPTURE_PROGRAMS):
            _run_mixed_program(seed)


def _a_captured_fill() -> tuple[SimOps, cs.Backend, cs.TrackedArray, cs.Stream]:
    """On the simulator: a tracked array of 1s, and a stream capturing a
    writing() block that fills it with 9s (run at each launch)."""
    cs.use_backend("sim")
    ops = SimOps()
    t = cs.track(ops.array(np.full(64, 1.0, np.float32)))
    s = cs.Stream()
    s.begin_capture("relaxed")
    with t.writing(s):
        ops.fill(s, t.array, 9.0, duration=0.05)
    return ops, cs.current_backend(), t, s


def _a_consumer_after_its_launch_sees_the_write(
    ops: SimOps, t: cs.TrackedArray, graph: cs.Graph
) -> None:
    """Launch ``graph``; a consumer after the launch must read its 9s."""
    launch_on, r = cs.Stream(), cs.Stream()
    graph.launch(launch_on)
    out = ops.array(np.zeros(64, np.float32))
    cs.consume_blocking(t, stream=r)  # ordered after the launch's write
    ops.copy(r, out, t.array)
    r.synchronize()
    launch_on.synchronize()
    graph.close()
    assert (ops.to_host(out) == 9.0).all()


@pytest.mark.parametrize("where", ["another stream", "the same stream", "the same, left open"])
def test_a_capture_ending_in_one_thread_is_not_forgotten_by_another(
    monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Another thread begins (and ends) a capture just after the driver ended
    this one, before ``end_capture`` took its bookkeeping, on another stream
    or on this one: neither that thread's sweep of captures ended behind the
    library's back nor its new capture on the stream may take this one's
    place, or this Graph orders nothing and a consumer after the launch
    reads the buffer before the captured write."""
    ops, backend, t, s = _a_captured_fill()
    real_end = type(backend).end_capture
    once: list[None] = []

    def end_then_another_thread(self: cs.Backend, handle: int) -> int:
        graph: int = real_end(self, handle)
        if handle == s.handle and not once:
            once.append(None)  # (the other thread's own end on s passes through)

            def other() -> None:
                o = cs.Stream() if where == "another stream" else s
                o.begin_capture("relaxed")
                if where != "the same, left open":
                    o.end_capture().close()

            th = threading.Thread(target=other)
            th.start()
            th.join(10)
        return graph

    monkeypatch.setattr(type(backend), "end_capture", end_then_another_thread)
    graph = s.end_capture()
    monkeypatch.undo()
    if where == "the same, left open":
        s.end_capture().close()
    _a_consumer_after_its_launch_sees_the_write(ops, t, graph)


def test_a_capture_begun_on_the_stream_as_its_last_one_ends_does_not_take_its_graph(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another thread's driver begin on the stream lands after the driver
    ended this capture and before either's bookkeeping: the stream is
    capturing again when ``end_capture`` looks, but its own capture is over
    (the driver's end returned), so its Graph still orders the buffer."""
    ops, backend, t, s = _a_captured_fill()
    real_end, real_begin = type(backend).end_capture, type(backend).begin_capture
    began, proceed = threading.Event(), threading.Event()
    once: list[None] = []

    def begin_then_wait(self: cs.Backend, handle: int, mode: Any) -> None:
        real_begin(self, handle, mode)
        if threading.current_thread().name == "other":
            began.set()
            proceed.wait(10)  # its bookkeeping waits until this end_capture is done

    def end_then_other_begins(self: cs.Backend, handle: int) -> int:
        graph: int = real_end(self, handle)
        if handle == s.handle and not once:
            once.append(None)
            threading.Thread(target=lambda: s.begin_capture("relaxed"), name="other").start()
            assert began.wait(10)
        return graph

    monkeypatch.setattr(type(backend), "end_capture", end_then_other_begins)
    monkeypatch.setattr(type(backend), "begin_capture", begin_then_wait)
    try:
        graph = s.end_capture()
    finally:
        monkeypatch.undo()
        proceed.set()
    for th in threading.enumerate():
        if th.name == "other":
            th.join(10)
    s.end_capture().close()  # the other thread's
    _a_consumer_after_its_launch_sees_the_write(ops, t, graph)
