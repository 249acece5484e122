"""The scheduler on the simulated device: joins, write-after-read, threads, lifetime."""

from __future__ import annotations

import _thread
import gc
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import cai_streams as cs
from cai_streams import sim

from .device_ops import SimOps, held

N = 3 * 512


@pytest.fixture(autouse=True)
def _sim() -> Iterator[None]:
    cs.use_backend("sim")
    yield
    cs.configure(export_stream=True, sync=True)


def _fill(x: np.ndarray[Any, Any], value: float) -> None:
    x[...] = value


def _sum(out: np.ndarray[Any, Any], x: np.ndarray[Any, Any]) -> None:
    out[0] = x.sum()


def _consumer_sum(producer: Any, data: sim.SimArray, own: cs.Stream) -> sim.SimArray:
    """A consumer that knows only the interface: it enqueues on the exported
    stream when there is one, else on its own stream."""
    cai = producer.__cuda_array_interface__
    out = sim.empty(1, "float64")
    stream = cai["stream"] if cai["stream"] is not None else own.handle
    sim.launch(stream, _sum, out, data, reads=[data], writes=[out])
    return out


def _spec_scenario(reps: int) -> int:
    """Streams '7', '9', '15' write disjoint thirds; export onto '3'; sum there."""
    writers = [cs.Stream() for _ in range(3)]
    three = cs.Stream()
    wrong = 0
    for rep in range(reps):
        data = sim.empty(N, "float64")
        t = cs.track(data, stream=three)
        for i, s in enumerate(writers):
            with t.writing(s, disjoint=True):
                part = data[i * N // 3 : (i + 1) * N // 3]
                sim.launch(s, _fill, part, float(rep + 1), writes=[part], duration=0.001)
        out = _consumer_sum(t, data, own=three)
        wrong += int(out.to_host(stream=three)[0] != N * (rep + 1))
    return wrong


def test_spec_example_7_9_15_joined_onto_3_always_sums_right() -> None:
    before = cs.stats()
    assert _spec_scenario(reps=60) == 0
    after = cs.stats()
    assert after["joins"] - before["joins"] == 3 * 60


def test_spec_example_without_the_join_goes_wrong() -> None:
    """The control: the same program with the join disabled reads unfinished thirds."""
    cs.configure(export_stream=False)
    with cs.sanitize(False):  # racy on purpose (the sanitizer's catalogue flags it)
        assert _spec_scenario(reps=30) > 0


def test_overlapping_writers_are_serialized_by_default() -> None:
    """Without disjoint=True, a second writer waits for the first (write after write)."""
    ops = SimOps()
    a, b = cs.Stream(), cs.Stream()
    t = cs.track(sim.empty(8, "float64"))
    latch = ops.latch(a)
    with t.writing(a):
        ops.fill(a, t.array, 1.0)
    with t.writing(b):
        ops.fill(b, t.array, 2.0)
    assert held(b)
    latch.release()
    b.synchronize()
    np.testing.assert_array_equal(t.array.to_host(stream=b), 2.0)


def test_no_pending_work_exports_no_stream() -> None:
    t = cs.track(sim.empty(4))
    assert t.__cuda_array_interface__["stream"] is None
    assert t.__cuda_array_interface__ == sim.empty(4).__cuda_array_interface__ | {
        "data": (t.array.ptr, False)
    }


def test_pending_work_only_on_the_export_stream_needs_no_event() -> None:
    s, ops = cs.Stream(), SimOps()
    t = cs.track(sim.empty(4), stream=s)
    latch = ops.latch(s)  # the write stays pending until the export is checked
    with t.writing(s):
        ops.fill(s, t.array, 1.0)
    try:
        before = cs.stats()
        assert t.__cuda_array_interface__["stream"] == s.handle
        after = cs.stats()
    finally:
        latch.release()
    assert after["joins"] == before["joins"]
    assert after["events_created"] == before["events_created"]


def test_export_twice_adds_no_event_and_no_wait() -> None:
    a, x = cs.Stream(), cs.Stream()
    t = cs.track(sim.empty(8), stream=x)
    ops = SimOps()
    latch = ops.latch(a)  # keep the work pending so nothing is elided
    with t.writing(a):
        ops.fill(a, t.array, 2.0)
    first = cs.export(t, stream=x)
    middle = cs.stats()
    second = cs.export(t.array, stream=x)  # via the tracked object itself
    after = cs.stats()
    latch.release()
    assert first["stream"] == second["stream"] == x.handle
    assert after["joins"] == middle["joins"]
    assert after["events_created"] == middle["events_created"]


def test_an_export_after_the_joined_work_completed_names_no_stream() -> None:
    """The second export's join passes by the write the first joined onto ``x``:
    once that write is done, the export says None (nothing pending), not ``x``;
    while it is held, ``x``."""
    a, x = cs.Stream(), cs.Stream()
    t = cs.track(sim.empty(8), stream=x)
    latch = SimOps().latch(a)
    with t.writing(a):
        SimOps().fill(a, t.array, 2.0)
    try:
        assert t.__cuda_array_interface__["stream"] == x.handle
        assert t.__cuda_array_interface__["stream"] == x.handle  # still held
    finally:
        latch.release()
    a.synchronize()
    x.synchronize()
    assert t.__cuda_array_interface__["stream"] is None
    assert t.pending_streams()["writes"] == []


def test_completed_work_is_elided_not_waited_on() -> None:
    a, x = cs.Stream(), cs.Stream()
    t = cs.track(sim.empty(8), stream=x)
    with t.writing(a):
        SimOps().fill(a, t.array, 2.0)
    a.synchronize()
    before = cs.stats()
    assert t.__cuda_array_interface__["stream"] is None
    assert cs.stats()["waits_elided"] == before["waits_elided"] + 1


def test_export_of_an_untracked_object_joins_its_stream() -> None:
    ops = SimOps()
    producer, x = cs.Stream(), cs.Stream()
    data = sim.empty(64, "float64")
    data.stream = producer.handle  # like a Numba array with a default stream
    latch = ops.latch(producer)
    ops.fill(producer, data, 5.0)
    cai = cs.export(data, stream=x)
    assert cai["stream"] == x.handle
    out = sim.empty(1, "float64")
    sim.launch(x, _sum, out, data)
    done = x.record()
    assert not done.is_done  # x waits behind the producer's latch
    latch.release()
    assert out.to_host(stream=x)[0] == 64 * 5.0
    data.stream = None
    assert cs.export(data, stream=x)["stream"] is None


@pytest.mark.parametrize("named", [False, True], ids=["no-stream", "tracked-naming-a-stream"])
def test_export_stream_opt_out_exports_none_and_joins_nothing(named: bool) -> None:
    """Every export of a tracked array says None, also of one tracked while its
    own interface named a stream (a Numba array bound to one, CuPy's)."""
    s = cs.Stream()
    arr = sim.empty(4)
    if named:
        arr.stream = s.handle
    t = cs.track(arr)
    with t.writing(s):
        SimOps().fill(s, t.array, 1.0, duration=0.01)
    cs.configure(export_stream=False)
    before = cs.stats()
    assert t.__cuda_array_interface__["stream"] is None
    assert cs.export(t)["stream"] is None
    assert t.export(cs.Stream())["stream"] is None
    assert cs.stats()["joins"] == before["joins"]


def test_write_after_read_on_a_ring_of_two_buffers() -> None:
    """A producer refills ring buffers while a slow reader copies them out: the
    reader always sees the value written for its round."""
    producer, reader = cs.Stream(), cs.Stream()
    ring = [cs.track(sim.empty(256, "float64")) for _ in range(2)]
    rounds = 40
    outs = [sim.empty(256, "float64") for _ in range(rounds)]
    ops = SimOps()
    for k in range(rounds):
        t = ring[k % 2]
        with t.writing(producer):
            ops.fill(producer, t.array, float(k))
        with t.reading(reader):
            ops.copy(reader, outs[k], t.array, duration=0.002)
    reader.synchronize()
    for k, out in enumerate(outs):
        np.testing.assert_array_equal(out.to_host(), float(k))


def test_without_read_tracking_the_buffer_is_overwritten_under_the_reader() -> None:
    """The control: the reader's access left undeclared, the refill overtakes it."""
    producer, reader = cs.Stream(), cs.Stream()
    ops = SimOps()
    t = cs.track(sim.empty(16, "float64"))
    out = sim.empty(16, "float64")
    with t.writing(producer):
        ops.fill(producer, t.array, 1.0)
    reader.wait(producer.record())  # read ordered after the write, but not tracked
    latch = ops.latch(reader)
    ops.copy(reader, out, t.array)
    with cs.sanitize(False), t.writing(producer):  # racy on purpose (write after read)
        ops.fill(producer, t.array, 2.0)
    producer.synchronize()
    latch.release()
    reader.synchronize()
    np.testing.assert_array_equal(out.to_host(), 2.0)  # the reader saw the refill


def _export_ready_then_write_elsewhere(
    *, guarded: bool, consumer_reads: bool
) -> tuple[object, np.ndarray[Any, Any]]:
    """A consumer thread exports ready data onto its stream ``c`` (stream
    None: nothing pending), enqueues its read there behind a latch (or not
    yet: ``consumer_reads`` False), and tells the main thread through a raw
    lock, which the sanitizer does not see. The main thread then writes the
    buffer on ``w``: inside ``writing()`` (``guarded``) or with a bare launch.
    Returns the exported stream entry and what the consumer read."""
    ops = SimOps()
    t = cs.track(sim.asarray(np.zeros(64)))
    out = sim.asarray(np.full(64, -1.0))
    exported: list[object] = []
    handed = _thread.allocate_lock()
    handed.acquire()
    c, w = cs.Stream(), cs.Stream()

    def consumer() -> None:
        exported.append(t.export(c)["stream"])
        if consumer_reads:
            ops.latch(c)
            ops.copy(c, out, t.array)  # the consumer's read, right after the handoff
        handed.release()

    th = threading.Thread(target=consumer)
    th.start()
    try:
        assert handed.acquire(timeout=10)
        if guarded:
            with t.writing(w):
                ops.fill(w, t.array, 2.0)
        else:
            ops.fill(w, t.array, 2.0)
            w.synchronize()  # nothing orders it after the latched read: done before it
    finally:
        th.join(10)
        ops.release_all()
        c.synchronize()  # before ``out`` can be freed, even when the write was named
        w.synchronize()
    return exported[0], out.to_host()


@pytest.mark.parametrize("consumer_reads", [True, False], ids=["read enqueued", "no read yet"])
def test_a_write_in_another_thread_waits_for_the_consumer_of_a_ready_export(
    consumer_reads: bool,
) -> None:
    """An export of ready data names no stream; the consumer's read on the
    stream it passed is protected all the same, whether or not it was enqueued
    yet. The sanitizer checks the export as a read of ready data, and keeps
    nothing: it once kept a host read there, which only a read the consumer
    went on to enqueue covered, so it named the guarded writer of the thread
    stress below."""
    stream, seen = _export_ready_then_write_elsewhere(guarded=True, consumer_reads=consumer_reads)
    assert stream is None
    np.testing.assert_array_equal(seen, 0.0 if consumer_reads else -1.0)  # read before the write


def test_an_unguarded_write_after_a_ready_export_races_and_is_named() -> None:
    """The control: the bare write overwrites what the consumer had yet to read,
    and the sanitizer names it against the kernel that read."""
    with cs.sanitize(False):
        stream, seen = _export_ready_then_write_elsewhere(guarded=False, consumer_reads=True)
    assert stream is None
    np.testing.assert_array_equal(seen, 2.0)
    with pytest.raises(cs.HazardError, match="kernel 'copy'"):
        _export_ready_then_write_elsewhere(guarded=False, consumer_reads=True)


@pytest.mark.parametrize("how", ["interface", "export()", "export(y)"])
def test_ready_data_read_on_the_consumers_own_stream_is_freed_without_a_false_alarm(
    how: str,
) -> None:
    """Exported ready ("stream: None, read anywhere"), read by the consumer on its
    own stream ``y``, which the host synchronizes; then the array is dropped and
    its block reused at once. Nothing ran on the export stream: a read declared
    there for the consumer (as once, briefly) names the reuse falsely."""
    y = cs.Stream()
    arr = sim.asarray(np.ones(64))
    out = sim.empty(64, "float64")
    ptr = arr.ptr
    t = cs.track(arr)
    if how == "interface":
        cai = t.__cuda_array_interface__
    else:
        cai = t.export() if how == "export()" else t.export(y)
    assert cai["stream"] is None
    SimOps().copy(y, out, arr)
    y.synchronize()
    del t, arr
    gc.collect()
    # The caching allocator hands the block out again; blocks an earlier test
    # freed in the collection above may come first.
    taken: list[sim.SimArray] = []
    while len(taken) < 64 and (not taken or taken[-1].ptr != ptr):
        taken.append(sim.asarray(np.zeros(64)))
    assert taken[-1].ptr == ptr  # (the check really ran on the freed block)
    np.testing.assert_array_equal(out.to_host(), 1.0)


def _increment(x: np.ndarray[Any, Any]) -> None:
    value = x.copy()
    time.sleep(0)  # let an unordered writer interleave
    x[...] = value + 1


def test_four_threads_a_thousand_write_export_cycles() -> None:
    shared = [cs.track(sim.asarray(np.zeros(8))) for _ in range(2)]
    errors: list[BaseException] = []
    cycles = 1000

    def worker(seed: int) -> None:
        try:
            s = cs.Stream()
            rng = np.random.default_rng(seed)
            for _ in range(cycles):
                t = shared[int(rng.integers(2))]
                with t.writing(s):
                    sim.launch(s, _increment, t.array, reads=[t], writes=[t])
                cai = t.export(s)
                assert cai["stream"] in (None, s.handle)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    sim.device().jitter, saved = 0.0, sim.device().jitter
    try:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
    finally:
        sim.device().jitter = saved
    assert not errors, errors
    total = 0.0
    for t in shared:
        with t.reading(1):
            pass
        total += float(t.array.to_host()[0])
    assert total == 4 * cycles


def test_track_is_idempotent_and_checks_the_export_stream() -> None:
    data = sim.empty(4)
    s = cs.Stream()
    t = cs.track(data, stream=s)
    assert cs.track(data) is t and cs.track(t) is t and t.array is data
    with pytest.raises(ValueError, match="already tracked"):
        cs.track(data, stream=cs.Stream())
    with pytest.raises(TypeError):
        cs.track(np.zeros(3))
    with pytest.raises(TypeError, match="use cai_streams.track"):
        cs.TrackedArray()


def test_tracking_starts_with_the_objects_own_stream_pending() -> None:
    ops = SimOps()
    producer, x = cs.Stream(), cs.Stream()
    data = sim.empty(4)
    data.stream = producer.handle
    latch = ops.latch(producer)
    t = cs.track(data, stream=x)
    assert t.pending_streams()["writes"] == [producer.handle]
    assert t.__cuda_array_interface__["stream"] == x.handle
    assert held(x)
    latch.release()


def test_nothing_is_left_behind_when_references_go() -> None:
    s = cs.Stream()
    gc.collect()
    baseline = cs.stats()
    ops = SimOps()
    # The sanitizer names what this does: each array is dropped after an export
    # whose consumer stream nobody waits for, and its block is reused at once
    # (the caching-allocator hazard `cs.hold`, issue 18, closes). Leaks are the point here.
    with cs.sanitize(False):
        for _ in range(50):
            t = cs.track(sim.empty(32), stream=cs.Stream())
            with t.writing(s):
                ops.fill(s, t.array, 1.0)
            t.export()
            with t.reading(s):
                pass
            del t
    s.synchronize()
    gc.collect()
    after = cs.stats()
    assert after["tracked"] == baseline["tracked"]
    assert after["events_in_flight"] == baseline["events_in_flight"]
    assert after["events_created"] - baseline["events_created"] <= 8  # the pool reuses


def test_tracked_array_keeps_its_stream_and_array_alive() -> None:
    """The TrackedArray holds its array, the array's state holds the export
    stream; once the array is gone, the next library call lets go of both."""
    import weakref

    data = sim.empty(4)
    s = cs.Stream()
    t = cs.track(data, stream=s)
    refs: list[weakref.ref[Any]] = [weakref.ref(data), weakref.ref(s)]
    del data, s
    gc.collect()
    assert all(r() is not None for r in refs)
    del t
    gc.collect()
    cs.stats()  # any scheduler call releases the state of collected arrays
    gc.collect()
    assert all(r() is None for r in refs)


def test_writing_rejects_what_is_not_a_stream() -> None:
    t = cs.track(sim.empty(4))
    with pytest.raises(TypeError, match="cannot use str as a stream"):
        with t.writing("nope"):
            pass


class _ReadOnly:
    """A read-only producer, as a JAX array is: ``data`` is ``(ptr, True)``."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        cai = dict(self.inner.__cuda_array_interface__)
        cai["data"] = (cai["data"][0], True)
        return cai


def test_writing_a_read_only_array_is_refused_and_reading_it_is_not() -> None:
    """It was accepted, and the data written."""
    t = cs.track(_ReadOnly(sim.empty(4)))
    s = cs.Stream()
    with pytest.raises(ValueError, match=r"writing\(\) of a read-only array \(_ReadOnly"):
        with t.writing(s):
            pytest.fail("the block ran")
    with t.reading(s):
        pass
    assert t.pending_streams()["writes"] == []


@pytest.mark.parametrize("tracked", [True, False])
@pytest.mark.parametrize("export_stream", [True, False], ids=["exporting", "opted out"])
def test_export_checks_its_stream_whether_or_not_anything_is_pending(
    tracked: bool, export_stream: bool
) -> None:
    """An untracked array with nothing pending, or the export-stream opt-out,
    returned before the stream was looked at: any value was accepted."""
    cs.configure(export_stream=export_stream)
    a = sim.empty(4)
    obj: Any = cs.track(a) if tracked else a
    closed = cs.Stream()
    closed.close()
    for bad, error in [
        ("nope", TypeError),
        (1.5, TypeError),
        (0, ValueError),
        (closed, ValueError),
    ]:
        with pytest.raises(error):
            cs.export(obj, stream=bad)
    assert cs.export(obj, stream=cs.Stream())["stream"] is None  # (nothing pending)


@pytest.mark.parametrize("nested", [True, False])
def test_a_block_nested_in_its_own_thread_sees_the_outer_blocks_work(nested: bool) -> None:
    """Inside its own writing() block, a thread's reading() (or export) counts
    what the outer block enqueued so far; the control reads without the
    nested block and sees the old value."""
    ops = SimOps()
    a, b = cs.Stream(), cs.Stream()
    t = cs.track(sim.asarray(np.zeros(8)))
    out = sim.asarray(np.full(8, -1.0))
    latch = ops.latch(a)
    try:
        with t.writing(a):
            ops.fill(a, t.array, 5.0)
            if nested:
                with t.reading(b):
                    ops.copy(b, out, t.array)
            else:
                with cs.sanitize(False):  # racy on purpose
                    ops.copy(b, out, t.array)
                b.synchronize()
    finally:
        latch.release()
    b.synchronize()
    np.testing.assert_array_equal(out.to_host(stream=b), 5.0 if nested else 0.0)


class _NoWeakref:
    """A CAI object that cannot be weakly referenced (``__slots__`` without
    ``__weakref__``): its state holds it until its work is done."""

    __slots__ = ("arr",)

    def __init__(self, arr: Any) -> None:
        self.arr = arr

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return cs.read_interface(self.arr).__cuda_array_interface__


@pytest.mark.parametrize("weakrefable", [True, False])
def test_the_state_of_a_buffer_outlives_its_wrapper_until_its_work_is_done(
    weakrefable: bool,
) -> None:
    import weakref

    ops = SimOps()
    s = cs.Stream()
    arr = sim.asarray(np.zeros(8))
    obj: Any = arr if weakrefable else _NoWeakref(arr)
    base = cs.stats()["tracked"]
    latch = ops.latch(s)
    try:
        with cs.track(obj).writing(s):
            ops.fill(s, arr, 4.0)
        gc.collect()
        assert cs.stats()["tracked"] == base + 1  # the wrapper is gone, the state is not
        assert cs.track(obj).pending_streams()["writes"] == [s.handle]
    finally:
        latch.release()
    s.synchronize()
    view = cs.consume_blocking(obj, timeout=10)
    assert (SimOps().to_host(view) == 4).all()
    ref = weakref.ref(arr)
    del obj, view, arr
    gc.collect()
    assert cs.stats()["tracked"] == base  # done and unreferenced: let go
    gc.collect()
    assert ref() is None


def test_an_array_tracked_again_may_name_another_export_stream_once_unwrapped() -> None:
    a, b = cs.Stream(), cs.Stream()
    data = sim.empty(4)
    t = cs.track(data, stream=a)
    with pytest.raises(ValueError, match="already tracked"):
        cs.track(data, stream=b)
    del t
    gc.collect()
    assert cs.track(data, stream=b).export_stream == b


def test_an_array_whose_export_stream_closed_exports_onto_the_shared_one_after_its_writes() -> None:
    """Closing the stream given to ``track`` does not make the array
    unexportable (every CAI read raised "this Stream is closed", and tracking
    it again with another stream was refused while the TrackedArray lived):
    exports join onto the device's shared export stream, after the writes
    pending on the closed stream (a latch holds them: a consumer that reads
    there without the join sees zeros, the control)."""
    ops = SimOps()
    s, other = cs.Stream(), cs.Stream()
    data = ops.array(np.zeros(N))
    t = cs.track(data, stream=s)
    latch = ops.latch(s)
    with t.writing(s):
        ops.fill(s, data, 1.0)
    s.close()
    shared = t.export_stream
    assert shared != s and not shared.closed
    assert shared == cs.track(sim.empty(4)).export_stream  # the device's shared one
    with cs.sanitize(False):  # the control is racy on purpose
        early = _consumer_sum(t.view.with_stream(None), data, own=other)  # no join: the control
    out = _consumer_sum(t, data, own=other)
    assert t.__cuda_array_interface__["stream"] == shared.handle
    assert held(shared)  # the join waits for the latched write
    latch.release()
    assert early.to_host(stream=other)[0] == 0.0
    assert out.to_host(stream=shared)[0] == N
    assert cs.track(data, stream=other).export_stream == other  # may be named again now


def test_closing_what_export_stream_returns_for_the_shared_stream_only_forgets_it() -> None:
    """The shared export stream serves every tracked array of the device:
    closing what ``export_stream`` returns must not destroy it (it broke
    every later export on the device)."""
    t, u = cs.track(sim.empty(4)), cs.track(sim.empty(4))
    t.export_stream.close()
    assert not u.export_stream.closed
    with u.writing(cs.Stream()):
        pass
    assert cs.export(u)["stream"] == u.export_stream.handle
    assert cs.consume_blocking(u, stream=cs.Stream()).stream is not None


def test_streams_carry_their_device_and_identity() -> None:
    s = cs.Stream()
    assert s.device == cs.current_backend().current_device()
    assert cs.Stream(device=s.device).device == s.device
    for d in range(cs.device_count()):  # any device, whatever the current one
        other = cs.Stream(device=d)
        assert other.device == d and cs.Stream.wrap(other.handle).device == d
        assert cs.current_device() == s.device
    with pytest.raises(ValueError, match="does not exist"):
        cs.Stream(device=cs.device_count())
    with pytest.raises(TypeError):
        cs.Stream(device="0")  # type: ignore[arg-type]
    assert cs.Stream.wrap(s) == s and cs.Stream.wrap(s.handle) == s
    assert cs.Stream.wrap(1) == cs.Stream.wrap(1) and cs.Stream.wrap(1) != s
    s.close()
    with pytest.raises(ValueError, match="closed"):
        cs.Stream.wrap(s)


def test_a_buffer_read_on_ever_new_streams_holds_neither_them_nor_events() -> None:
    """Never written again, consumed on a new stream each time and the stream
    dropped: the buffer keeps at most a bounded number of reads open."""
    import weakref

    from cai_streams._events import RECLAIM_AT
    from cai_streams._pending import MAX_OPEN_READS

    t = cs.track(sim.asarray(np.ones(8)))
    gone: list[weakref.ref[cs.Stream]] = []
    for _ in range(3 * MAX_OPEN_READS):
        s = cs.Stream()
        cs.consume_blocking(t, stream=s)
        gone.append(weakref.ref(s))
        s.synchronize()
        del s
    # The oldest read beyond the bound is recorded at the next handoff, and its
    # event, complete once the simulated device has run the records, goes back
    # to the pool with its stream: the pool lets go of what its completed
    # events keep at every RECLAIM_AT-th release, so a batch of them may wait.
    assert cs.current_backend().drain(timeout=10)  # type: ignore[attr-defined]
    cs.consume_blocking(t, stream=cs.Stream())
    gc.collect()
    alive = sum(r() is not None for r in gone)
    assert alive <= MAX_OPEN_READS + RECLAIM_AT, alive
    assert len(t.pending_streams()["reads"]) <= MAX_OPEN_READS + 1


def test_the_registry_of_tracked_ids_follows_the_buffers() -> None:
    """A lookup asks other backends only about ids tracked somewhere: that set
    grows with the tracked buffers and shrinks with them."""
    from cai_streams import _scheduler

    base = len(_scheduler._tracked_ids)
    tracked = [cs.track(sim.empty(4)) for _ in range(100)]
    assert {id(t.array) for t in tracked} <= set(_scheduler._tracked_ids)
    del tracked
    gc.collect()
    cs.stats()  # releases the state of collected buffers
    assert len(_scheduler._tracked_ids) <= base


def test_an_orphan_a_capture_keeps_from_settling_is_not_asked_on_every_lookup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A buffer held by the library (not weakly referenceable) whose wrapper is
    gone has a read open on the legacy stream, which a capture on a blocking
    stream forbids recording: it is asked again after a pause, not four times
    on every lookup of every thread."""
    from cai_streams import _pending

    class NoWeak:
        __slots__ = ("a",)

        def __init__(self, a: sim.SimArray) -> None:
            self.a = a

        @property
        def __cuda_array_interface__(self) -> dict[str, Any]:
            return self.a.__cuda_array_interface__

    t = cs.track(NoWeak(sim.asarray(np.zeros(16, np.float32))))
    cs.consume_blocking(t, stream=cs.Stream.wrap(1))  # a read open on the legacy stream
    del t
    gc.collect()
    calls = [0]
    settle = _pending.PendingWork.settle

    def counted(self: _pending.PendingWork) -> bool:
        calls[0] += 1
        return settle(self)

    monkeypatch.setattr(_pending.PendingWork, "settle", counted)
    other, s = sim.asarray(np.zeros(16, np.float32)), cs.Stream()
    capturing = cs.Stream.wrap(2)
    capturing.begin_capture("relaxed")
    try:
        with cs.sanitize(False):
            for _ in range(100):
                cs.consume_blocking(other, stream=s)
    finally:
        capturing.end_capture().close()
    assert 1 <= calls[0] <= 20, calls  # (one, then one per pause elapsed)
    cs.stats()  # settles it now


def test_the_shared_export_stream_is_made_on_its_schedulers_backend() -> None:
    """First asked for while another backend is current (an export of an array
    whose own export stream was closed, say): it is the scheduler's backend's
    stream (it was the current one's, kept: every later export on that device
    raised, also once its backend was current again)."""
    from cai_streams._scheduler import Scheduler

    backend = cs.current_backend()
    sched = Scheduler(backend, 0)
    cs.use_backend("decoy")
    try:
        s = sched.export_stream
    finally:
        cs.use_backend("sim")
    assert s.backend is backend
    s.close()
