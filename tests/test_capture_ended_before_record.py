"""A graph capture that ends between a record's capture check and the record.

``_events.record`` asks the stream whether it captures, then records: another
thread may end the capture in between, which leaves an ordinary record, behind
whatever the stream still has pending, whose mark says captured. Once the
capture is over, such a record is asked of the driver like any other
(``_capture_guard.taken_or_complete``), never taken for done. Each test ends the
capture inside that window, deterministically (the ask is wrapped: the capture
ends right after it answers, as another thread's ``end_capture`` would), and
proves with data that the work before the record is still waited for, beside a
control that takes such a record for done, as the library did before, and reads
the old data. The last test keeps the pool from asking a stream that is gone
(its capture may still run in the stream it was forked from).
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import numpy as np
import pytest

import cai_streams as cs
from cai_streams import _capture_guard
from cai_streams._events import pool_for

from .device_ops import DeviceOps, consume_returns


@pytest.fixture(autouse=True)
def _unsanitized() -> Iterator[None]:
    with cs.sanitize(False):  # the controls race on purpose, as the programs' undeclared fills do
        yield


#: (function, module) of each ask made right before a record, with no backend call between
_RECORD_ASKS = {("record", "cai_streams._events"), ("join", "cai_streams._scheduler")}


@contextlib.contextmanager
def _ends_in_the_record_window(backend: cs.Backend, stream: cs.Stream) -> Iterator[list[int]]:
    """In the block, the first time a record's own ask (in ``_events.record``,
    or in ``Scheduler.join``, which asks just before its record) finds that
    ``stream`` captures, the capture on it ends right after the answer. Yields
    the graphs it ended (destroyed after the block)."""
    real = _capture_guard.capturing
    ended: list[int] = []

    def capturing(b: cs.Backend, key: Any) -> bool | None:
        got = real(b, key)
        caller = sys._getframe(1)
        if (
            got is True
            and not ended
            and key.handle == stream.handle
            and (caller.f_code.co_name, caller.f_globals["__name__"]) in _RECORD_ASKS
        ):
            ended.append(backend.end_capture(stream.handle))
        return got

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_capture_guard, "capturing", capturing)
        yield ended
    for graph in ended:
        backend.destroy_graph(graph)
    assert ended, "the record never asked: the window was not hit"


def _as_before(mp: pytest.MonkeyPatch) -> None:
    """The control: a record marked captured is done once its capture ended."""
    taken: Callable[[cs.Backend, int], bool] = lambda backend, event: True  # noqa: E731
    mp.setattr(_capture_guard, "taken_or_complete", taken)


def _held_then_filled(ops: DeviceOps, s: cs.Stream, arr: Any, value: float) -> Any:
    """``s`` held by a latch, then a fill of ``arr`` behind it (pending work the
    library was not told of): the record that follows on ``s`` comes after it."""
    latch = ops.latch(s)
    ops.fill(s, arr, value)
    return latch


@pytest.mark.parametrize("control", [False, True], ids=["asked", "control"])
def test_a_host_consume_waits_for_work_before_a_record_the_capture_missed(
    ops: DeviceOps, backend: cs.Backend, control: bool
) -> None:
    producer = cs.Stream()
    arr = ops.array(np.zeros(64, np.float32))
    t = cs.track(arr)
    latch = _held_then_filled(ops, producer, arr, 7.0)
    backend.begin_capture(producer.handle, "relaxed")
    with _ends_in_the_record_window(backend, producer), t.writing(producer):
        pass  # the write's record: after the pending fill, marked captured
    with pytest.MonkeyPatch.context() as mp:
        if control:
            _as_before(mp)
        returned = consume_returns(t, 0.2)
        seen = ops.to_host(arr)
    latch.release()
    producer.synchronize()
    if control:  # taken for done: returned while the fill was pending
        assert returned and (seen == 0.0).all()
    else:
        assert not returned
        cs.consume_blocking(t, timeout=5)
        assert (ops.to_host(arr) == 7.0).all()


@pytest.mark.parametrize("control", [False, True], ids=["asked", "control"])
def test_an_enqueued_consume_joins_work_before_a_record_the_capture_missed(
    ops: DeviceOps, backend: cs.Backend, control: bool
) -> None:
    producer, consumer = cs.Stream(), cs.Stream()
    arr = ops.array(np.zeros(64, np.float32))
    out = ops.array(np.zeros(64, np.float32))
    t = cs.track(arr)
    latch = _held_then_filled(ops, producer, arr, 7.0)
    backend.begin_capture(producer.handle, "relaxed")
    with _ends_in_the_record_window(backend, producer), t.writing(producer):
        pass
    with pytest.MonkeyPatch.context() as mp:
        if control:
            _as_before(mp)
        cs.consume_blocking(t, stream=consumer)
        ops.copy(consumer, out, arr)  # ordered after the fill only by the join
    if control:  # no join: the copy runs (and reads) while the fill still waits
        consumer.synchronize()
    latch.release()
    consumer.synchronize()
    producer.synchronize()
    assert (ops.to_host(out) == (0.0 if control else 7.0)).all()


@pytest.mark.parametrize("control", [False, True], ids=["asked", "control"])
def test_the_pool_keeps_an_owner_until_work_before_a_record_the_capture_missed(
    ops: DeviceOps, backend: cs.Backend, control: bool
) -> None:
    """An enqueued consume onto a bare stream handle (no lease: the pool keeps
    the owner with the join's event) inside a capture the consumer's stream was
    forked into; the capture ends in the join's record window. The owner must
    outlive the producer's pending fill, or the block is handed out again and
    the fill lands in the next array."""
    if ops.name != "sim":
        pytest.skip("the freed block's reuse by the next array: the simulator's allocator")
    producer = cs.Stream()
    consumer = backend.create_stream()  # a bare handle: no lease keeps the owner
    arr = ops.array(np.zeros(256, np.float32))
    gone = weakref.finalize(arr, lambda: None)
    latch = _held_then_filled(ops, producer, arr, 7.0)
    producer_view = cs.read_interface(arr).with_stream(producer.handle)
    backend.begin_capture(producer.handle, "relaxed")
    fork = backend.create_event()
    try:
        backend.record(fork, producer.handle)
        backend.stream_wait_event(consumer, fork)  # the consumer captures too
        with pytest.MonkeyPatch.context() as mp:
            if control:  # (from the start: the join's own release may reclaim it)
                _as_before(mp)
            with _ends_in_the_record_window(backend, producer):
                view = cs.consume_blocking(producer_view, stream=consumer)
            del view, producer_view, arr
            pool_for(backend, 0).reclaim()  # (any later library call may reclaim)
            early = not gone.alive
            new = ops.array(np.ones(256, np.float32))  # the next block of that size
    finally:
        latch.release()
        producer.synchronize()
        backend.synchronize_stream(consumer)
        backend.destroy_stream(consumer)
        backend.destroy_event(fork)
    assert early == control  # the control let the owner go under the pending fill,
    assert (ops.to_host(new) == (7.0 if control else 1.0)).all()  # which lands in new


@pytest.mark.parametrize("control", [False, True], ids=["taken back", "control"])
def test_a_gone_streams_captured_record_is_never_queried(
    ops: DeviceOps, backend: cs.Backend, control: bool
) -> None:
    """A bare producer stream forked into a capture, consumed from inside it (a
    graph edge), joined back and destroyed while the capture runs on: nothing
    says whether that capture is over, so the pool takes the record's event back
    without a query. The control asks it as a stream that merely stopped
    capturing, which invalidates the capture."""
    if ops.name != "sim":
        pytest.skip("a destroyed stream's handle is undefined on a driver (docs/gpu.md)")
    origin, consumer = cs.Stream(), cs.Stream()
    producer = backend.create_stream()  # another library's, destroyed below
    arr = ops.array(np.zeros(64, np.float32))
    origin.begin_capture("relaxed")
    try:
        fork = backend.create_event()
        backend.record(fork, origin.handle)
        for s in (producer, consumer.handle):  # both forked into the capture
            backend.stream_wait_event(s, fork)
        view = cs.consume_blocking(cs.read_interface(arr).with_stream(producer), stream=consumer)
        del view
        for s in (producer, consumer.handle):  # joined back: the capture can end
            back = backend.create_event()
            backend.record(back, s)
            backend.stream_wait_event(origin.handle, back)
            backend.destroy_event(back)
        backend.destroy_stream(producer)
        with pytest.MonkeyPatch.context() as mp:
            if control:
                real = _capture_guard.stream_phase

                def as_before(b: cs.Backend, key: Any) -> _capture_guard.StreamPhase:
                    phase = real(b, key)
                    gone = phase is _capture_guard.StreamPhase.GONE
                    return _capture_guard.StreamPhase.NOT_CAPTURING if gone else phase

                mp.setattr(_capture_guard, "stream_phase", as_before)
            pool_for(backend, 0).reclaim()
        status = backend.capture_status(origin.handle)
        assert status == ("invalidated" if control else "active")
    finally:
        with contextlib.suppress(cs.CudaError):
            origin.end_capture().close()
        backend.destroy_event(fork)


@pytest.mark.parametrize("control", [False, True], ids=["asked", "control"])
def test_event_wait_waits_for_work_before_a_record_the_capture_missed(
    ops: DeviceOps, backend: cs.Backend, control: bool
) -> None:
    """``await Event.wait()`` of ``Stream.record()``'s event, marked captured by
    a capture that ended before the record: it waits for the pending fill; the
    control returns at once."""
    producer = cs.Stream()
    arr = ops.array(np.zeros(64, np.float32))
    latch = _held_then_filled(ops, producer, arr, 7.0)
    backend.begin_capture(producer.handle, "relaxed")
    with _ends_in_the_record_window(backend, producer):
        event = producer.record()

    async def wait() -> bool:
        with anyio.move_on_after(0.2):
            await event.wait(timeout=5)
            return True
        return False

    with pytest.MonkeyPatch.context() as mp:
        if control:
            _as_before(mp)
        returned = anyio.run(wait)
        seen = ops.to_host(arr)
    latch.release()
    producer.synchronize()
    assert returned == control
    if control:  # returned while the fill was pending
        assert (seen == 0.0).all()
    event.close()
