"""The conformance suite every backend passes: CUDA's ordering rules, with data."""

from __future__ import annotations

import numpy as np
import pytest

import cai_streams as cs

from .device_ops import DeviceOps

REPS = 300


def test_fifo_order_within_a_stream(ops: DeviceOps) -> None:
    """x = 10 x + digit for digits 1..9, each kernel with a random duration:
    only first-in-first-out execution spells 123456789."""
    s = cs.Stream()
    rng = np.random.default_rng()
    for _ in range(20):
        x = ops.array(np.zeros(8, np.float64))
        for digit in range(1, 10):
            ops.shift_in(s, x, digit, duration=float(rng.uniform(0, 0.001)))
        s.synchronize()
        np.testing.assert_array_equal(ops.to_host(x), 123456789)


def test_fifo_order_is_data_order(ops: DeviceOps) -> None:
    """Fill then add on one stream: only FIFO order gives value + 1 everywhere."""
    s = cs.Stream()
    x = ops.array(np.zeros(64, np.float32))
    for rep in range(REPS // 3):
        ops.fill(s, x, float(rep), duration=0.0005)
        ops.add(s, x, 1.0)
    s.synchronize()
    np.testing.assert_array_equal(ops.to_host(x), REPS // 3)


def test_record_query_synchronize(ops: DeviceOps) -> None:
    s = cs.Stream()
    latch = ops.latch(s)
    e = s.record()
    assert e.is_done is False
    latch.release()
    e.synchronize()
    assert e.is_done is True
    assert e.stream is s


def test_cross_stream_wait_orders_work(ops: DeviceOps) -> None:
    a, b = cs.Stream(), cs.Stream()
    x = ops.array(np.zeros(256, np.float32))
    y = ops.array(np.zeros(256, np.float32))
    for rep in range(1, REPS + 1):
        ops.fill(a, x, float(rep), duration=0.0002)
        b.wait(a.record())
        ops.copy(b, y, x)
        ops.add(b, y, 1.0)
        a.wait(b.record())  # next fill of x waits for this rep's copy
    b.synchronize()
    np.testing.assert_array_equal(ops.to_host(y), REPS + 1)


def test_cross_stream_wait_data_each_repetition(ops: DeviceOps) -> None:
    a, b = cs.Stream(), cs.Stream()
    wrong = 0
    for rep in range(REPS):
        x = ops.array(np.zeros(32, np.float32))
        y = ops.array(np.zeros(32, np.float32))
        ops.fill(a, x, float(rep + 1), duration=0.0002)
        b.wait(a.record())
        ops.copy(b, y, x)
        b.synchronize()
        wrong += int((ops.to_host(y) != rep + 1).any())
    assert wrong == 0


def test_without_the_wait_the_consumer_reads_old_data(ops: DeviceOps) -> None:
    """The control for the tests above: the same program minus the wait fails."""
    a, b = cs.Stream(), cs.Stream()
    x = ops.array(np.zeros(16, np.float32))
    y = ops.array(np.full(16, -1, np.float32))
    latch = ops.latch(a)
    ops.fill(a, x, 7.0)
    with cs.sanitize(False):  # racy on purpose (the sanitizer's catalogue flags it)
        ops.copy(b, y, x)  # no b.wait(a): runs while a is held
    b.synchronize()
    latch.release()
    a.synchronize()
    np.testing.assert_array_equal(ops.to_host(y), 0.0)
    np.testing.assert_array_equal(ops.to_host(x), 7.0)


def test_wait_on_a_stream_waits_for_its_work_so_far(ops: DeviceOps) -> None:
    a, b = cs.Stream(), cs.Stream()
    x = ops.array(np.zeros(16, np.float32))
    y = ops.array(np.zeros(16, np.float32))
    latch = ops.latch(a)
    ops.fill(a, x, 3.0)
    b.wait(a)
    ops.copy(b, y, x)
    done = b.record()
    assert not done.is_done
    latch.release()
    done.synchronize()
    np.testing.assert_array_equal(ops.to_host(y), 3.0)


def test_wait_captures_the_record_at_call_time(ops: DeviceOps, backend: cs.Backend) -> None:
    """Re-recording an event after a wait was enqueued does not move that wait."""
    a, b, c = cs.Stream(), cs.Stream(), cs.Stream()
    event = backend.create_event()
    try:
        backend.record(event, c.handle)  # c is idle: complete at once
        backend.stream_wait_event(b.handle, event)
        latch = ops.latch(a)
        backend.record(event, a.handle)  # now pending, but b's wait saw the old record
        done = b.record()
        done.synchronize()  # would hang (latch) if the wait had moved
        assert not backend.query(event)
        latch.release()
        backend.synchronize_event(event)
    finally:
        backend.destroy_event(event)


def test_never_recorded_event_is_complete_and_waiting_on_it_is_a_noop(
    ops: DeviceOps, backend: cs.Backend
) -> None:
    s = cs.Stream()
    event = backend.create_event()
    try:
        assert backend.query(event) is True
        backend.synchronize_event(event)
        backend.stream_wait_event(s.handle, event)
        x = ops.array(np.zeros(4, np.float32))
        ops.fill(s, x, 2.0)
        s.synchronize()
        np.testing.assert_array_equal(ops.to_host(x), 2.0)
    finally:
        backend.destroy_event(event)


def test_handles_are_distinct_ints_above_2(backend: cs.Backend) -> None:
    streams = [cs.Stream() for _ in range(16)]
    handles = [s.handle for s in streams]
    assert all(type(h) is int and h > 2 for h in handles)
    assert len(set(handles)) == len(handles)
    events = [s.record() for s in streams]
    assert len({e.handle for e in events}) == len(events)
    for s in streams:
        s.close()


def test_close_twice_is_safe(backend: cs.Backend) -> None:
    s = cs.Stream()
    e = s.record()
    s.close()
    s.close()
    e.close()
    e.close()
    with pytest.raises(ValueError, match="closed"):
        _ = s.handle
    with pytest.raises(ValueError, match="closed"):
        e.synchronize()


def test_streams_compare_by_handle(backend: cs.Backend) -> None:
    s = cs.Stream()
    borrowed = cs.Stream.wrap(s.handle)
    assert borrowed == s and hash(borrowed) == hash(s)
    assert cs.Stream.wrap(s) == s
    assert s != cs.Stream()
    assert s.__cuda_stream__() == (0, s.handle)
    borrowed.close()  # borrowed: does not destroy
    s.synchronize()


def test_stream_wait_self_is_a_noop(backend: cs.Backend) -> None:
    s = cs.Stream()
    s.wait(s)
    s.synchronize()


def test_legacy_and_per_thread_default_streams_exist(ops: DeviceOps) -> None:
    for handle in (1, 2):
        s = cs.Stream.wrap(handle)
        x = ops.array(np.zeros(4, np.float32))
        ops.fill(s, x, float(handle))
        s.synchronize()
        np.testing.assert_array_equal(ops.to_host(x), float(handle))
