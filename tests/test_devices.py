"""The library across devices: events from the pool of the stream's device,
a tracked array's export stream on its own device, and consumers on one device
ordered after producers on another (a stream may wait on any device's event).

Ordering is shown with data: a latch holds the producer's stream, so a missing
wait reads the wrong values; each test has a control that reads them. Every
test needs two devices and is skipped, with the reason, where the backend has
one (``CAI_STREAMS_SIM_DEVICES=1``, a one-GPU machine).
"""

from __future__ import annotations

import enum
import gc
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import anyio
import numpy as np
import pytest

import cai_streams as cs
from cai_streams import sim

from .device_ops import DeviceOps, held
from .test_conformance_devices import _on_device

pytestmark = pytest.mark.anyio

N = 64


@pytest.fixture(autouse=True)
def _two_devices(backend: cs.Backend) -> None:
    if backend.device_count() < 2:
        pytest.skip(f"{backend.name}: one device; these handoffs need two")


def on_device(device: int) -> AbstractContextManager[None]:
    """This thread's current device is ``device`` inside the block."""
    return _on_device(cs.current_backend(), device)


class Reporting:
    """An untracked producer whose interface names the stream it wrote on."""

    def __init__(self, arr: Any, stream: cs.Stream) -> None:
        self.arr = arr
        self.stream = stream

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        view = cs.read_interface(self.arr)
        return view.with_stream(self.stream.handle).__cuda_array_interface__


class Naming:
    """An untracked producer whose interface names a bare handle (1 or 2: the
    default streams of the device that was current where it wrote)."""

    def __init__(self, arr: Any, handle: int) -> None:
        self.arr = arr
        self.handle = handle

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return cs.read_interface(self.arr).with_stream(self.handle).__cuda_array_interface__


def _settled(*streams: cs.Stream) -> int:
    for s in streams:
        s.synchronize()
    gc.collect()
    return cs.stats()["events_in_flight"]


def test_set_device_is_this_threads_only() -> None:
    seen: list[int] = []
    with on_device(1):
        assert cs.current_device() == 1
        thread = threading.Thread(target=lambda: seen.append(cs.current_device()))
        thread.start()
        thread.join(10)
    assert seen == [0] and cs.current_device() == 0
    with pytest.raises(cs.CudaError):
        cs.set_device(cs.device_count())
    with pytest.raises(TypeError):
        cs.set_device("1")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        cs.set_device(True)


def test_streams_events_and_views_know_their_device(ops: DeviceOps) -> None:
    with on_device(1):
        arr = ops.array(np.zeros(N, np.float32))
        here = cs.Stream()
    s1 = cs.Stream(device=1)
    assert here.device == 1 and s1.device == 1 and cs.Stream().device == 0
    assert cs.Stream.wrap(s1.handle).device == 1  # borrowed: the stream's own device
    assert cs.read_interface(arr).device == 1
    event = s1.record()  # an event of the stream's device, or the record would fail
    event.synchronize()
    assert event.is_done


@pytest.mark.parametrize("handle", [1, 2], ids=["legacy", "per-thread"])
def test_a_default_stream_wrapped_on_device_1_is_refused_while_device_0_is_current(
    ops: DeviceOps, handle: int
) -> None:
    """Handles 1 and 2 name the current device's default streams: a wrapper made
    on device 1 would reach device 0's stream once device 0 is current (work
    out of order with device 1's, or an event of one device recorded on the
    other). Every use says so instead, before anything is enqueued; with its
    device current again it works."""
    arr = ops.array(np.zeros(N, np.float32))
    t = cs.track(arr)
    with on_device(1):
        s1 = cs.Stream.wrap(handle)
    assert s1.device == 1
    uses: dict[str, Callable[[], object]] = {
        "record": s1.record,
        "synchronize": s1.synchronize,
        "writing": lambda: t.writing(s1).__enter__(),
        "consume": lambda: cs.consume_blocking(t, stream=s1),
        "hold": lambda: cs.hold(arr, until=s1),
    }
    for name, use in uses.items():
        with pytest.raises(ValueError, match=r"cs\.set_device\(1\)"):
            use()
        assert not t.pending_streams()["reads"], name  # nothing was added
    with on_device(1):
        s1.record().synchronize()
        s1.synchronize()


def test_a_tracked_array_exports_a_stream_of_its_own_device(
    backend: cs.Backend, ops: DeviceOps
) -> None:
    with on_device(1):
        arr = ops.array(np.zeros(N, np.float32))
    t = cs.track(arr)  # tracked from device 0
    assert t.export_stream.device == 1
    producer = cs.Stream(device=1)
    latch = ops.latch(producer)
    with t.writing(producer):
        ops.fill(producer, arr, 5.0)
    handle = t.__cuda_array_interface__["stream"]
    assert handle == t.export_stream.handle and backend.stream_device(handle) == 1
    latch.release()
    t.export_stream.synchronize()
    np.testing.assert_array_equal(ops.to_host(arr), 5.0)


@pytest.mark.parametrize("capture", [False, True], ids=["", "device-0-capturing"])
def test_a_read_open_on_device_1s_legacy_stream_is_waited_for_from_device_0(
    ops: DeviceOps, backend: cs.Backend, capture: bool
) -> None:
    """``consume(t, stream=1)`` with device 1 current leaves a read open on
    device 1's legacy stream; a writer while device 0 is current records it
    on that stream and asks that stream whether it captures (handle 1 names
    the current device's: device 1 is made current for both), so the write
    waits for the held copy. With device 0's per-thread stream (a blocking
    stream) capturing, asked of device 0's legacy stream, the write was
    refused; now it goes through and the capture survives."""
    if capture and backend.name != "sim":
        pytest.skip("a capture on the per-thread stream of a GPU would block the legacy stream")
    with on_device(1):
        arr = ops.array(np.ones(N, np.float32))
        out = ops.array(np.zeros(N, np.float32))
        legacy1 = cs.Stream.wrap(1)
        t = cs.track(arr)
        latch = ops.latch(legacy1)
        ops.copy(legacy1, out, cs.consume_blocking(t, stream=legacy1))
    w = cs.Stream(device=1)
    capturing = cs.Stream.wrap(2)  # device 0's, this thread's
    if capture:
        capturing.begin_capture("relaxed")
    try:
        with t.writing(w):  # device 0 is current here
            ops.fill(w, arr, 2.0)
        assert held(w), "the write did not wait for the read on device 1"
    finally:
        if capture:
            capturing.end_capture().close()  # (it was not invalidated)
        latch.release()
    w.synchronize()
    with on_device(1):
        legacy1.synchronize()
    np.testing.assert_array_equal(ops.to_host(out), 1.0)


def test_a_zero_size_array_is_tracked_on_the_device_it_says(ops: DeviceOps) -> None:
    """No pointer to ask the driver about: the array's ``__dlpack_device__``
    says where it is (CuPy, PyTorch and the simulator give one)."""
    with on_device(1):
        arr = ops.array(np.zeros(0, np.float32))
    if not hasattr(arr, "__dlpack_device__"):
        pytest.skip("this backend's arrays do not say their device")
    assert arr.__dlpack_device__() == (2, 1)
    t = cs.track(arr)  # tracked from device 0
    assert t.__dlpack_device__() == (2, 1) and t.export_stream.device == 1
    t.__dlpack__(dl_device=(2, 1))


@pytest.mark.parametrize("sync", [True, False], ids=["joined", "control-sync-off"])
def test_a_consumer_on_device_0_waits_for_a_producer_on_device_1(
    ops: DeviceOps, sync: bool
) -> None:
    with on_device(1):
        arr = ops.array(np.zeros(N, np.float32))
    out = ops.array(np.full(N, -1.0, np.float32))  # device 0
    producer, consumer = cs.Stream(device=1), cs.Stream(device=0)
    base = _settled(producer, consumer)
    latch = ops.latch(producer)
    ops.fill(producer, arr, 7.0)
    with cs.sanitize(sync):  # the control races on purpose
        view = cs.consume_blocking(Reporting(arr, producer), stream=consumer, sync=sync)
        ops.copy(consumer, out, view)
    if sync:
        assert held(consumer)  # held behind the producer's latch
    else:
        consumer.synchronize()  # the control ran without waiting for it
    latch.release()
    consumer.synchronize()
    expected = 7.0 if sync else 0.0  # the control copies before the producer wrote
    np.testing.assert_array_equal(ops.to_host(out), expected)
    assert _settled(producer, consumer) == base


@pytest.mark.parametrize("sync", [True, False], ids=["synced", "control-unsynced"])
@pytest.mark.parametrize("handle", [1, 2])
def test_an_interface_naming_device_1s_default_stream_is_waited_for_there_from_device_0(
    ops: DeviceOps, handle: int, sync: bool
) -> None:
    """An untracked array on device 1 whose interface names stream 1 or 2
    (device 1's default streams, where its producer wrote) is consumed while
    device 0 is current: the consumer waits for device 1's stream. The handle
    was taken for device 0's, which has nothing pending, so the consumer read
    before the write. Control: ``sync=False`` reads early."""
    with on_device(1):
        arr = ops.array(np.zeros(N, np.float32))
        default = cs.Stream.wrap(handle)
        latch = ops.latch(default)
        ops.fill(default, arr, 7.0)
    out = ops.array(np.full(N, -1.0, np.float32))  # device 0
    consumer = cs.Stream(device=0)
    try:
        with cs.sanitize(sync):  # the control races on purpose
            got = cs.consume_blocking(Naming(arr, handle), stream=consumer, sync=sync)
            ops.copy(consumer, out, got)
            waited = held(consumer)
    finally:
        latch.release()
    with on_device(1):
        cs.Stream.wrap(handle).synchronize()
    consumer.synchronize()
    assert waited is sync
    np.testing.assert_array_equal(ops.to_host(out), 7.0 if sync else 0.0)


def test_a_view_handed_to_device_1s_legacy_stream_is_waited_for_from_device_0(
    ops: DeviceOps,
) -> None:
    """``consume(obj, stream=Stream.wrap(1))`` with device 1 current hands the
    view to device 1's legacy stream; handed on with device 0 current, the
    view still names device 1's (it named device 0's, which had nothing
    pending, and the next consumer read before the producer's write)."""
    producer = cs.Stream(device=1)
    with on_device(1):
        arr = ops.array(np.zeros(N, np.float32))
        latch = ops.latch(producer)
        ops.fill(producer, arr, 7.0)
        view = cs.consume_blocking(Reporting(arr, producer), stream=cs.Stream.wrap(1))
    assert view.stream == 1
    out = ops.array(np.full(N, -1.0, np.float32))
    consumer = cs.Stream(device=0)
    try:
        got = cs.consume_blocking(view, stream=consumer)
        ops.copy(consumer, out, got)
        waited = held(consumer)
    finally:
        latch.release()
    consumer.synchronize()
    assert waited
    np.testing.assert_array_equal(ops.to_host(out), 7.0)


async def test_a_consuming_body_whose_thread_switches_device_keeps_its_back_edge(
    ops: DeviceOps,
) -> None:
    """``consuming()`` of an untracked array on device 1 whose interface
    names stream 1 (device 1's legacy stream); another task of this thread
    makes device 0 current while the body awaits. The back-edge still makes
    device 1's legacy stream wait for the body's work (it made device 0's
    wait, and the producer's next write overwrote what the body read)."""
    with on_device(1):
        arr = ops.array(np.ones(N, np.float32))
        legacy = cs.Stream.wrap(1)
    out = ops.array(np.zeros(N, np.float32))
    c = cs.Stream(device=1)
    latch = ops.latch(c)  # the consumer is slow
    try:
        with on_device(1):
            async with cs.consuming(Naming(arr, 1), stream=c, timeout=5) as got:
                with on_device(1):
                    ops.copy(c, out, got)
                cs.set_device(0)  # as another task of this thread may do across an await
                await anyio.sleep(0.01)
            with on_device(1):
                ops.fill(legacy, arr, 9.0)  # the producer writes again on its stream
                waited = held(legacy)
    finally:
        latch.release()
    c.synchronize()
    with on_device(1):
        legacy.synchronize()
    assert waited
    np.testing.assert_array_equal(ops.to_host(out), 1.0)


def test_a_tracked_buffers_own_interface_naming_device_1s_stream_1_is_waited_for_there(
    ops: DeviceOps,
) -> None:
    """A tracked buffer on device 1 whose own interface names stream 1 (work
    enqueued there after it was tracked) is consumed with device 0 current:
    the consumer waits for device 1's legacy stream (the handle was asked of
    device 0's, found idle, and the consumer read before the write)."""
    with on_device(1):
        arr = ops.array(np.zeros(N, np.float32))
        t = cs.track(Naming(arr, 1))  # its interface names device 1's legacy stream
        legacy = cs.Stream.wrap(1)
        latch = ops.latch(legacy)
        ops.fill(legacy, arr, 5.0)
    out = ops.array(np.zeros(N, np.float32))
    c = cs.Stream(device=0)
    try:
        ops.copy(c, out, cs.consume_blocking(t, stream=c))
        waited = held(c)
    finally:
        latch.release()
    c.synchronize()
    assert waited
    np.testing.assert_array_equal(ops.to_host(out), 5.0)


@pytest.mark.parametrize("how", ["consume_all", "consume_all, no timeout", "consume_blocking"])
async def test_a_fault_on_one_device_is_heard_while_another_devices_work_is_pending(
    ops: DeviceOps, how: str
) -> None:
    """A host wait over work of two devices: device 1's kernel fails while
    device 0's stream is held. The fault is raised at once (it was heard only
    after device 0's work completed, so a timeout came first, or, with no
    timeout, nothing until then: each event was waited for in turn, and a
    fault fails only its own device's)."""
    if ops.name == "cuda":
        pytest.skip("a failing kernel would poison the CUDA context for the rest of the run")
    p0, p1 = cs.Stream(device=0), cs.Stream(device=1)
    a = ops.array(np.zeros(N, np.float32))
    with on_device(1):
        b = ops.array(np.zeros(N, np.float32))
    t, u = cs.track(a), cs.track(b)
    busy = ops.latch(p0)  # device 0's writer: held for the whole test
    try:
        if how == "consume_blocking":  # one array, a disjoint half written on each device
            with t.writing(p0, disjoint=True):
                ops.fill(p0, a[: N // 2], 1.0)
            with t.writing(p1, disjoint=True):
                ops.fill(p1, a[N // 2 :], 2.0)
                ops.fail(p1)
        else:
            with t.writing(p0):
                ops.fill(p0, a, 1.0)
            with u.writing(p1):
                ops.fill(p1, b, 2.0)
                ops.fail(p1)
        with pytest.raises(cs.KernelError):
            if how == "consume_blocking":
                await anyio.to_thread.run_sync(lambda: cs.consume_blocking(t, timeout=30))
            elif how == "consume_all":
                await cs.consume_all(t, u, timeout=30)
            else:
                with anyio.fail_after(30):  # (the test's own bound: the call has none)
                    await cs.consume_all(t, u)
    finally:
        busy.release()
        p0.synchronize()
        sim.reset(1)


@pytest.mark.parametrize("tracked", [True, False], ids=["tracked", "control-untracked"])
def test_two_devices_each_fill_half_and_one_consumer_reads_the_whole(
    ops: DeviceOps, tracked: bool
) -> None:
    """The multi-device example as a test: disjoint writes on streams of two
    devices, joined onto a consumer stream on device 0."""
    halves = []
    for d in range(2):
        with on_device(d):
            halves.append(ops.array(np.zeros(N // 2, np.float32)))
    writers = [cs.Stream(device=0), cs.Stream(device=1)]
    consumer = cs.Stream(device=0)
    latches = [ops.latch(w) for w in writers]
    views = []
    racy = cs.sanitize(tracked)  # the control races on purpose
    racy.__enter__()
    for i, (w, half) in enumerate(zip(writers, halves, strict=True)):
        if tracked:
            t = cs.track(half)
            with t.writing(w):
                ops.fill(w, half, float(i + 1))
            views.append(cs.consume_blocking(t, stream=consumer))
        else:  # nothing names the writer's stream: nothing is waited for
            ops.fill(w, half, float(i + 1))
            views.append(cs.consume_blocking(half, stream=consumer))
    sums = [ops.array(np.full(1, -1.0, np.float32)) for _ in range(2)]
    for total, view in zip(sums, views, strict=True):
        ops.sum_into(consumer, total, view)
    racy.__exit__(None, None, None)
    if tracked:
        assert held(consumer)  # held behind the producers' latches
    else:
        consumer.synchronize()  # the control ran without waiting for them
    for latch in latches:
        latch.release()
    consumer.synchronize()
    got = [float(ops.to_host(total)[0]) for total in sums]
    assert got == ([N // 2 * 1.0, N // 2 * 2.0] if tracked else [0.0, 0.0])


async def test_host_consume_of_another_devices_array_waits_without_blocking(
    ops: DeviceOps,
) -> None:
    with on_device(1):
        arr = ops.array(np.zeros(N, np.float32))
    producer = cs.Stream(device=1)
    base = _settled(producer)
    latch = ops.latch(producer)
    t = cs.track(arr)
    with t.writing(producer):
        ops.fill(producer, arr, 3.0)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.sleep(0.001)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        with anyio.move_on_after(0.05) as early:
            await cs.consume(t)
        assert early.cancelled_caught  # held: not ready
        latch.release()
        view = await cs.consume(t, timeout=20)
        tg.cancel_scope.cancel()
    assert ticks > 5  # the loop ran while the consumer waited
    assert view.stream is None
    np.testing.assert_array_equal(ops.to_host(arr), 3.0)
    assert _settled(producer) == base


def test_stats_count_every_devices_events(ops: DeviceOps) -> None:
    """Work only on device 1, asked from device 0: its events are counted,
    and all of them come back."""
    s1, other = cs.Stream(device=1), cs.Stream(device=1)
    base = _settled(s1, other)
    with on_device(1):
        arr = ops.array(np.zeros(N, np.float32))
    latch = ops.latch(s1)
    t = cs.track(arr)
    with t.writing(s1):
        ops.fill(s1, arr, 1.0)
    cs.export(t, stream=other)
    assert cs.current_device() == 0
    assert cs.stats()["events_in_flight"] > base  # device 1's pool, counted from device 0
    latch.release()
    del t, arr  # their pending accesses hold their events while they live
    assert _settled(s1, other) == base


class _Handle(enum.IntEnum):
    LEGACY = 1


@pytest.mark.parametrize(
    "stream",
    [1, None, 2, _Handle.LEGACY, -1],
    ids=["1", "None", "2", "IntEnum 1", "control-minus-1"],
)
@pytest.mark.parametrize("tracked", [True, False], ids=["tracked", "untracked"])
def test_dlpack_default_streams_are_the_arrays_devices_whichever_is_current(
    ops: DeviceOps, tracked: bool, stream: int | None
) -> None:
    """A DLPack consumer computes ``stream`` for the device ``__dlpack_device__``
    gave (``torch.from_dlpack`` passes 1 for that device's default stream
    without making it current): None, 1 and 2 name device 0's default streams
    here, although device 1 is current at the call. They were taken for device
    1's, which waited, and the consumer on device 0 read before the write.
    Control: -1 asks for no synchronization and reads early."""
    arr = ops.array(np.zeros(N, np.float32))  # device 0
    out = ops.array(np.full(N, -1.0, np.float32))
    producer = cs.Stream(device=0)
    latch = ops.latch(producer)
    ops.fill(producer, arr, 7.0)
    if tracked:
        obj: Any = cs.track(arr)
        with obj.writing(producer):
            pass  # the fill above, enqueued before the block, is the write
    else:
        obj = cs.read_interface(arr).with_stream(producer.handle)
    assert obj.__dlpack_device__() == (2, 0)
    try:
        with cs.sanitize(stream != -1), on_device(1):  # the control races on purpose
            capsule = obj.__dlpack__(stream=stream)
        consumer = cs.Stream.wrap(1 if stream is None else abs(int(stream)))
        ops.copy(consumer, out, arr)
        waited = held(consumer)
    finally:
        latch.release()
    producer.synchronize()
    consumer.synchronize()
    del capsule
    assert waited is (stream != -1)
    np.testing.assert_array_equal(ops.to_host(out), 0.0 if stream == -1 else 7.0)
