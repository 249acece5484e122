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
the old data.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import cai_streams as cs
from cai_streams import _capture_guard
from cai_streams._events import pool_for

from .device_ops import DeviceOps


@pytest.fixture(autouse=True)
def _unsanitized() -> Iterator[None]:
    with cs.sanitize(False):  # it does not model graphs (see test_capture.py)
        yield


@contextlib.contextmanager
def _ends_in_the_record_window(backend: cs.Backend, stream: cs.Stream) -> Iterator[list[int]]:
    """In the block, the first time ``_events.record`` asks whether ``stream``
    captures, the capture on it ends right after the answer. Yields the graphs
    it ended (destroyed after the block)."""
    real = _capture_guard.capturing
    ended: list[int] = []

    def capturing(b: cs.Backend, key: Any) -> bool | None:
        got = real(b, key)
        caller = sys._getframe(1)
        if (
            got is True
            and not ended
            and key.handle == stream.handle
            and caller.f_code.co_name == "record"
            and caller.f_globals["__name__"] == "cai_streams._events"
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
        try:
            cs.consume_blocking(t, timeout=0.2)
            returned = True
        except TimeoutError:
            returned = False
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
        with _ends_in_the_record_window(backend, producer):
            view = cs.consume_blocking(producer_view, stream=consumer)
        with pytest.MonkeyPatch.context() as mp:
            if control:
                _as_before(mp)
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
    assert not early
    assert (ops.to_host(new) == 1.0).all()


@contextlib.contextmanager
def _begins_in_the_record_window(
    backend: cs.Backend, stream: cs.Stream, *, ask_again: bool
) -> Iterator[None]:
    """In the block, the first time ``_events.record`` asks whether ``stream``
    captures and hears no, a (relaxed) capture begins on it right after, as
    another thread's ``begin_capture`` would: the record lands in it.
    ``ask_again=False`` is the control: the ask after the record hears no too,
    as when the library asked only before."""
    real = _capture_guard.capturing
    asks: list[bool | None] = []

    def capturing(b: cs.Backend, key: Any) -> bool | None:
        caller = sys._getframe(1)
        if key.handle != stream.handle or caller.f_globals["__name__"] != "cai_streams._events":
            return real(b, key)
        if caller.f_code.co_name != "record":
            return real(b, key)
        got = real(b, key)
        asks.append(got)
        if len(asks) == 1 and got is False:
            backend.begin_capture(stream.handle, "relaxed")
        elif len(asks) == 2 and not ask_again:
            return False
        return got

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_capture_guard, "capturing", capturing)
        yield
    assert asks[:1] == [False], "the record never asked: the window was not hit"


def _settle(backend: cs.Backend, producer: cs.Stream, latch: Any, *others: cs.Stream) -> None:
    """Whatever the test did: the producer captures no more (its graph, if
    any, destroyed), its latch is released and every stream has drained."""
    if backend.capture_status(producer.handle) != "none":
        with contextlib.suppress(cs.CudaError):
            backend.destroy_graph(backend.end_capture(producer.handle))
    latch.release()
    for s in (producer, *others):
        s.synchronize()


@pytest.mark.parametrize("control", [False, True], ids=["asked", "control"])
def test_a_record_a_capture_begun_meanwhile_took_is_never_queried_during_it(
    ops: DeviceOps, backend: cs.Backend, control: bool
) -> None:
    """A host consume of an untracked producer records on its stream; a capture
    begins on that stream between the record's ask and the record. Asked again
    after the record, the mark says captured: the consume refuses to wait on the
    host for work in a capture under way, and the capture stays valid. The
    control (no second ask) polls the captured event, which invalidates it."""
    producer = cs.Stream()
    arr = ops.array(np.zeros(64, np.float32))
    latch = ops.latch(producer)  # pending work: the consume must record, not skip
    view = cs.read_interface(arr).with_stream(producer.handle)
    try:
        with _begins_in_the_record_window(backend, producer, ask_again=not control):
            with pytest.raises(cs.CudaError) as raised:
                cs.consume_blocking(view, timeout=5)
        if control:
            assert not isinstance(raised.value, cs.CaptureError)
            assert backend.capture_status(producer.handle) == "invalidated"
        else:
            assert isinstance(raised.value, cs.CaptureError)
            assert backend.capture_status(producer.handle) == "active"
            backend.destroy_graph(backend.end_capture(producer.handle))  # it survived
    finally:
        _settle(backend, producer, latch)


@pytest.mark.parametrize("control", [False, True], ids=["asked", "control"])
def test_a_join_never_pulls_its_stream_into_a_capture_begun_meanwhile(
    ops: DeviceOps, backend: cs.Backend, control: bool
) -> None:
    """An enqueued consume of an untracked producer joins the consumer's stream
    onto the producer's with a record there; a capture begins on the producer
    between the record's ask and the record. Asked again, the record is known
    captured: the join cannot be made from outside that capture (CaptureError),
    and the capture stays as it was. The control waits on the captured record,
    which pulls the consumer's stream into the capture: it never joins back,
    so the capture cannot end."""
    producer, consumer = cs.Stream(), cs.Stream()
    arr = ops.array(np.zeros(64, np.float32))
    latch = ops.latch(producer)
    view = cs.read_interface(arr).with_stream(producer.handle)
    try:
        with _begins_in_the_record_window(backend, producer, ask_again=not control):
            if control:
                cs.consume_blocking(view, stream=consumer)
            else:
                with pytest.raises(cs.CaptureError):
                    cs.consume_blocking(view, stream=consumer)
        pulled_in = backend.capture_status(consumer.handle) != "none"
        assert pulled_in == control
        if not control:
            backend.destroy_graph(backend.end_capture(producer.handle))  # it ends as begun
    finally:
        _settle(backend, producer, latch, consumer)
