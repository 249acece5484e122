"""consume / consuming / consume_blocking / consume_all, on every backend, asyncio and trio.

Ordering is shown with data: a latch holds the producer's stream, so a
consumer that did not wait sees the old values, deterministically.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import math
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import numpy as np
import pytest

import cai_streams as cs
from cai_streams import _doorbell, sim
from cai_streams._consume import Mode, _handoff

from .device_ops import DeviceOps, consume_after_latch, writing_in_another_thread

pytestmark = pytest.mark.anyio

#: loop-gap allowance on the simulated device: its stream workers share the GIL
#: with the loop (handed over every 5 ms under contention); a blocked loop
#: shows gaps the length of the pending work instead (see the control test)
SLACK = 0.1


@pytest.fixture(autouse=True)
def _defaults() -> Iterator[None]:
    yield
    cs.configure(sync=True, export_stream=True, poll=cs.PollPolicy())


def _on(ops: DeviceOps, host: np.ndarray[Any, Any], stream: cs.Stream) -> tuple[Any, cs.ArrayView]:
    """A device copy of ``host`` and a producer object exporting it on ``stream``."""
    arr = ops.array(host)
    return arr, cs.read_interface(arr).with_stream(stream.handle)


def _baseline() -> int:
    gc.collect()  # (an earlier test's tracked array, kept by a cycle, lets go of its events)
    cs.current_backend().synchronize_stream(1)
    return cs.stats()["events_in_flight"]


# -- host readiness -----------------------------------------------------------


async def test_host_wait_sees_the_producers_data(ops: DeviceOps) -> None:
    s = cs.Stream()
    arr, producer = _on(ops, np.zeros(256, "float32"), s)
    latch = ops.latch(s)
    ops.fill(s, arr, 7.0)
    got: list[cs.ArrayView] = []

    async def consumer() -> None:
        got.append(await cs.consume(producer, timeout=20))

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(consumer)
            for _ in range(20):
                await anyio.sleep(0.001)
            assert not got, "consume returned while the producer's stream was held"
            assert (ops.to_host(arr) == 0).all()
            latch.release()
    finally:
        latch.release()
    (view,) = got
    assert view.stream is None
    assert view.ptr == producer.ptr and view.owner is arr  # kept alive by the view
    assert (ops.to_host(arr) == 7).all()


async def test_without_sync_the_consumer_sees_old_data(ops: DeviceOps) -> None:
    """The control: the same handoff with sync=False returns at once, with
    the producer's stream still in the view, and the data is not there yet."""
    s = cs.Stream()
    arr, producer = _on(ops, np.zeros(256, "float32"), s)
    latch = ops.latch(s)
    ops.fill(s, arr, 7.0)
    try:
        view = await cs.consume(producer, sync=False)
        assert view.stream == s.handle
        assert (ops.to_host(arr) == 0).all()
        cs.configure(sync=False)  # the process-wide switch does the same
        assert (await cs.consume(producer)).stream == s.handle
    finally:
        latch.release()
    s.synchronize()


async def test_complete_work_costs_one_checkpoint_and_no_poll(ops: DeviceOps) -> None:
    """A tracked array whose writes are done: its own events say so at once."""
    s = cs.Stream()
    arr = ops.array(np.zeros(8, "float32"))
    t = cs.track(arr)
    with t.writing(s):
        ops.fill(s, cs.read_interface(arr).with_stream(None), 1.0)
    s.synchronize()
    passes = cs.stats()["poll_passes"]
    with anyio.CancelScope() as scope:  # trio's rule: still a cancellation point
        scope.cancel()
        await cs.consume(t)
    assert scope.cancelled_caught
    view = await cs.consume(t)
    assert view.stream is None and (ops.to_host(arr) == 1).all()
    assert cs.stats()["poll_passes"] == passes


async def test_no_stream_means_nothing_to_wait_for(ops: DeviceOps) -> None:
    arr = ops.array(np.arange(4, dtype="int32"))
    view = await cs.consume(cs.read_interface(arr).with_stream(None))
    assert view.stream is None and view.shape == (4,)


# -- enqueue mode and the back-edge -------------------------------------------


async def test_enqueue_orders_the_consumer_stream(ops: DeviceOps) -> None:
    s, c = cs.Stream(), cs.Stream()
    arr, producer = _on(ops, np.zeros(256, "float32"), s)
    out = ops.array(np.zeros(1, "float32"))
    latch = ops.latch(s)
    ops.fill(s, arr, 3.0)
    try:
        view = await cs.consume(producer, stream=c)  # returns while s is held
        assert view.stream == c.handle
        ops.sum_into(c, out, view)
    finally:
        latch.release()
    c.synchronize()
    assert ops.to_host(out)[0] == 3 * 256


async def test_enqueue_on_the_producers_own_stream_adds_nothing(ops: DeviceOps) -> None:
    s = cs.Stream()
    _, producer = _on(ops, np.zeros(4, "float32"), s)
    before = cs.stats()["events_created"] + cs.stats()["events_pooled"]
    view = await cs.consume(producer, stream=s)
    assert view.stream == s.handle
    assert cs.stats()["events_created"] + cs.stats()["events_pooled"] == before


@pytest.mark.parametrize("back_edge", [True, False])
async def test_consuming_holds_the_producer_until_the_reader_is_done(
    ops: DeviceOps, back_edge: bool
) -> None:
    """The reader on c is held by a latch; the producer then overwrites the
    buffer on s. With the back-edge the reader sees the old value; without
    it (plain consume: the control) the overwrite runs first."""
    s, c = cs.Stream(), cs.Stream()
    arr, producer = _on(ops, np.full(64, 1.0, "float32"), s)
    out = ops.array(np.zeros(1, "float32"))
    latch = ops.latch(c)
    try:
        if back_edge:
            async with cs.consuming(producer, stream=c) as view:
                ops.sum_into(c, out, view)
            ops.fill(s, arr, 100.0)  # the producer reuses its buffer
        else:
            view = await cs.consume(producer, stream=c)
            ops.sum_into(c, out, view)
            with cs.sanitize(False):  # racy on purpose: no back-edge
                ops.fill(s, arr, 100.0)
        if not back_edge:
            s.synchronize()  # the overwrite completes while the reader is held
    finally:
        latch.release()
    c.synchronize()
    s.synchronize()
    assert ops.to_host(out)[0] == (64.0 if back_edge else 6400.0)


async def test_consuming_runs_the_back_edge_when_the_block_raises(ops: DeviceOps) -> None:
    s, c = cs.Stream(), cs.Stream()
    arr, producer = _on(ops, np.full(64, 1.0, "float32"), s)
    out = ops.array(np.zeros(1, "float32"))
    latch = ops.latch(c)
    try:
        with pytest.raises(KeyError):
            async with cs.consuming(producer, stream=c) as view:
                ops.sum_into(c, out, view)
                raise KeyError("consumer failed after enqueueing")
        ops.fill(s, arr, 100.0)
    finally:
        latch.release()
    s.synchronize()
    c.synchronize()
    assert ops.to_host(out)[0] == 64.0


# -- tracked arrays -----------------------------------------------------------


async def test_tracked_host_wait_covers_every_writer(ops: DeviceOps) -> None:
    writers = [cs.Stream() for _ in range(3)]
    arr = ops.array(np.zeros(300, "float32"))
    t = cs.track(arr)
    latches = [ops.latch(w) for w in writers]
    try:
        for i, w in enumerate(writers):
            with t.writing(w, disjoint=True):
                ops.fill(w, cs.read_interface(arr[i * 100 : (i + 1) * 100]), float(i + 1))
        got: list[cs.ArrayView] = []
        async with anyio.create_task_group() as tg:

            async def consumer() -> None:
                got.append(await cs.consume(t, timeout=20))

            tg.start_soon(consumer)
            for latch in latches[:2]:
                latch.release()
                await anyio.sleep(0.01)
                assert not got, "consume returned before the last writer finished"
            latches[2].release()
    finally:
        for latch in latches:
            latch.release()
    assert got[0].stream is None
    assert (ops.to_host(arr) == np.repeat([1.0, 2.0, 3.0], 100)).all()
    assert t.pending_streams() == {"writes": [], "reads": []}  # waited writes are forgotten


async def test_tracked_enqueue_read_protects_buffer_reuse(ops: DeviceOps) -> None:
    """consume(t, stream=c) is a pending read: a later writer waits for c."""
    c, w = cs.Stream(), cs.Stream()
    arr = ops.array(np.full(64, 1.0, "float32"))
    out = ops.array(np.zeros(1, "float32"))
    t = cs.track(arr)
    latch = ops.latch(c)
    try:
        view = await cs.consume(t, stream=c)
        ops.sum_into(c, out, view)
        with t.writing(w):
            ops.fill(w, view.with_stream(None), 100.0)
    finally:
        latch.release()
    c.synchronize()
    w.synchronize()
    assert ops.to_host(out)[0] == 64.0


# -- timeouts, cancellation, errors --------------------------------------------


async def test_timeout_raises_and_leaks_nothing(ops: DeviceOps) -> None:
    base = _baseline()
    s = cs.Stream()
    _, producer = _on(ops, np.zeros(8, "float32"), s)
    latch = ops.latch(s)
    try:
        with pytest.raises(TimeoutError):
            await cs.consume(producer, timeout=0.02)
        assert cs.stats()["events_in_flight"] == base + 1  # held until its work completes
    finally:
        latch.release()
    s.synchronize()
    assert cs.stats()["events_in_flight"] == base


@pytest.mark.parametrize("blocking", [False, True], ids=["await consume", "consume_blocking"])
async def test_a_timeout_names_the_callers_timeout_not_what_was_left(
    ops: DeviceOps, blocking: bool
) -> None:
    """Part of the timeout goes to waiting for another thread's ``writing()``
    block; the TimeoutError still names the timeout the caller gave (it named
    what was left for the GPU wait: "after 0.19 s" for ``timeout=0.3``), and
    the stream whose work was late."""
    s = cs.Stream()
    t = cs.track(ops.array(np.zeros(8, "float32")))
    latch = ops.latch(s)
    opened, end = threading.Event(), threading.Event()

    def writer() -> None:
        with t.writing(s):
            ops.fill(s, t.array, 1.0)
            opened.set()
            end.wait(0.1)

    th = threading.Thread(target=writer)
    th.start()
    try:
        assert opened.wait(10)
        if blocking:  # (in a thread of its own, joined: nothing else keeps its frames)
            raised: list[BaseException] = []

            def consumer() -> None:
                try:
                    cs.consume_blocking(t, timeout=0.3)
                except TimeoutError as exc:
                    raised.append(exc)

            other = threading.Thread(target=consumer)
            other.start()
            other.join(10)
            (error,) = raised
        else:
            with pytest.raises(TimeoutError) as info:
                await cs.consume(t, timeout=0.3)
            error = info.value
        expected = f"GPU work not complete after 0.3 s: still pending on stream {s.handle:#x}"
        assert str(error) == expected, str(error)
    finally:
        th.join(10)
        latch.release()
    s.synchronize()


async def test_cancelled_waiters_leak_nothing_and_keep_owners_alive(ops: DeviceOps) -> None:
    base = _baseline()
    s = cs.Stream()
    latch = ops.latch(s)
    n = 1000
    producers = [_on(ops, np.zeros(4, "float32"), s)[1] for _ in range(n)]
    owner = weakref.ref(producers[0].owner)  # the device array behind the view
    done = 0
    try:
        async with anyio.create_task_group() as tg:
            scopes = []

            async def consumer(p: cs.ArrayView, scope: anyio.CancelScope) -> None:
                nonlocal done
                with scope:
                    await cs.consume(p, timeout=20)
                    done += 1

            for p in producers:
                scope = anyio.CancelScope()
                scopes.append(scope)
                tg.start_soon(consumer, p, scope)
            del p
            with anyio.fail_after(10):  # every consume made its handoff (an event each)
                while cs.stats()["events_in_flight"] < base + n:  # noqa: ASYNC110 - a counter
                    await anyio.sleep(0.001)
            for scope in scopes[::2]:
                scope.cancel()
            await anyio.sleep(0.02)
            del producers
            gc.collect()
            assert owner() is not None, "a cancelled wait let go of the owner too early"
            latch.release()
    finally:
        latch.release()
    assert done == n // 2
    s.synchronize()
    assert cs.stats()["events_in_flight"] == base
    gc.collect()
    assert owner() is None


async def test_a_failed_kernel_raises_in_every_waiter(ops: DeviceOps) -> None:
    if ops.name == "cuda":  # before any latch: a device-side fault is sticky on a GPU
        pytest.skip("a failing kernel would poison the CUDA context for the rest of the run")
    s = cs.Stream()
    arr = ops.array(np.zeros(8, "float32"))
    t = cs.track(arr)
    latch = ops.latch(s)
    with t.writing(s):
        ops.fail(s)
    errors: list[BaseException] = []

    async def consumer() -> None:
        try:
            await cs.consume(t, timeout=20)
        except cs.CudaError as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(consumer)
        await anyio.sleep(0.01)
        latch.release()
    assert len(errors) == 3
    assert all(isinstance(e, cs.CudaError) for e in errors)
    assert len({id(e) for e in errors}) == 3  # each task gets its own exception


# -- many waiters ----------------------------------------------------------------


async def test_a_thousand_consumers_all_see_complete_data() -> None:
    cs.use_backend("sim")
    rng = np.random.default_rng(5)
    streams = [cs.Stream() for _ in range(8)]
    n = 1000
    arrays = [sim.empty(16, "int32") for _ in range(n)]
    producers = []
    for i, arr in enumerate(arrays):
        s = streams[i % len(streams)]
        duration = float(rng.uniform(0, 0.002))
        sim.launch(s, lambda x, v=i: x.fill(v), arr, writes=[arr], duration=duration)
        producers.append(cs.read_interface(arr).with_stream(s.handle))
    wrong = 0
    started = finished = 0
    all_started = anyio.Event()
    gaps: list[float] = []

    async def heartbeat() -> None:
        await all_started.wait()  # starting 1,000 tasks is one long loop turn: not measured
        await anyio.lowlevel.checkpoint()
        last = anyio.current_time()
        while finished < n:
            await anyio.sleep(0.001)
            now = anyio.current_time()
            gaps.append(now - last)
            last = now

    async def consumer(i: int) -> None:
        nonlocal wrong, started, finished
        started += 1
        if started == n:
            all_started.set()
        view = await cs.consume(producers[i], timeout=30)
        data = sim._numpy_view(view)
        assert data is not None
        wrong += int((data != i).any())
        finished += 1

    queries = cs.stats()["poll_queries"]
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(heartbeat)
            for i in range(n):
                tg.start_soon(consumer, i)
    assert wrong == 0
    # The stream-order shortcut: far fewer queries than one per waiter per pass.
    assert cs.stats()["poll_queries"] - queries < 20 * n
    # The loop never stalled for a pending duration: gaps stay near the cap.
    # (Slack covers the GIL hand-off to the simulator's threads, up to 5 ms.)
    assert max(gaps) < cs.PollPolicy().cap + SLACK, max(gaps)


async def test_the_heartbeat_sees_a_blocking_wait() -> None:
    """The control for the heartbeat bound above: what CuPy and Numba
    consumers do (a blocking synchronize in the loop) breaks it."""
    cs.use_backend("sim")
    s = cs.Stream()
    arr = sim.empty(16, "int32")
    sim.launch(s, lambda x: x.fill(1), arr, writes=[arr], duration=0.3)
    gaps: list[float] = []
    stop = anyio.Event()

    async def heartbeat() -> None:
        last = anyio.current_time()
        while not stop.is_set():
            await anyio.sleep(0.001)
            now = anyio.current_time()
            gaps.append(now - last)
            last = now

    async with anyio.create_task_group() as tg:
        tg.start_soon(heartbeat)
        await anyio.sleep(0.005)
        cs.consume_blocking(cs.read_interface(arr).with_stream(s.handle), timeout=20)
        await anyio.sleep(0.005)
        stop.set()
    assert max(gaps) > cs.PollPolicy().cap + SLACK


async def test_consume_all_of_a_hundred_arrays() -> None:
    cs.use_backend("sim")
    streams = [cs.Stream() for _ in range(4)]
    arrays = [sim.empty(8, "float64") for _ in range(100)]
    producers = []
    for i, arr in enumerate(arrays):
        s = streams[i % 4]
        sim.launch(s, lambda x, v=i: x.fill(v), arr, writes=[arr], duration=0.0005)
        producers.append(cs.read_interface(arr).with_stream(s.handle))
    views = await cs.consume_all(*producers, timeout=30)
    assert [v.ptr for v in views] == [a.ptr for a in arrays]
    for i, v in enumerate(views):
        data = sim._numpy_view(v)
        assert data is not None and (data == i).all()
    assert await cs.consume_all() == []


async def test_the_poller_ends_when_nothing_is_pending(ops: DeviceOps) -> None:
    from cai_streams import _poller

    s = cs.Stream()
    _, producer = _on(ops, np.zeros(8, "float32"), s)
    latch = ops.latch(s)
    async with anyio.create_task_group() as tg:
        tg.start_soon(cs.consume, producer)
        await anyio.sleep(0.005)
        assert _poller._current_poller().running
        latch.release()
    for _ in range(100):
        if not _poller._current_poller().running:
            break
        await anyio.sleep(0.001)
    assert not _poller._current_poller().running


async def test_low_latency_policy_waits_correctly(ops: DeviceOps) -> None:
    cs.configure(poll=cs.PollPolicy.low_latency())
    s = cs.Stream()
    arr, producer = _on(ops, np.zeros(16, "float32"), s)
    ops.fill(s, arr, 2.0, duration=0.01)
    await cs.consume(producer, timeout=20)
    assert (ops.to_host(arr) == 2).all()


async def test_a_policy_set_while_a_waiter_is_parked_is_followed_from_the_next_pass(
    ops: DeviceOps,
) -> None:
    """A poller parked with one policy takes another from its next pass: from
    low latency's busy passes to the default, the pass rate falls; from a slow
    policy to low latency, once the slow sleep ends, it rises. (Its delays were
    made when a pass last woke someone: a new policy waited for a completion.)"""
    s = cs.Stream()
    _, producer = _on(ops, np.zeros(8, "float32"), s)
    latch = ops.latch(s)

    async def passes_in(seconds: float) -> int:
        before = cs.stats()["poll_passes"]
        await anyio.sleep(seconds)
        return cs.stats()["poll_passes"] - before

    slow = cs.PollPolicy(first=0.3, cap=0.3, wake="poll")
    try:
        cs.configure(poll=cs.PollPolicy.low_latency())
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: cs.consume(producer, timeout=20))
            await anyio.sleep(0.02)
            busy = await passes_in(0.2)
            cs.configure(poll=slow)
            await anyio.sleep(0.05)  # (low latency's sleep is none: the next pass is now)
            calm = await passes_in(0.6)
            assert calm * 10 < busy, (calm, busy)
            cs.configure(poll=cs.PollPolicy.low_latency())
            await anyio.sleep(0.05)  # the slow sleep under way ends at once
            again = await passes_in(0.2)
            assert again > 10 * max(calm, 1), (again, calm)
            latch.release()
    finally:
        latch.release()
        cs.configure(poll=cs.PollPolicy())


def _pending_write(
    ops: DeviceOps, waiting_for: str
) -> tuple[cs.TrackedArray, Any, threading.Event, threading.Thread]:
    """A tracked array whose write of 1.0 on a new stream is pending behind a
    latch: ``"kernel"``, written in a block of this thread (the caller releases
    the latch); ``"writing() block"``, in another thread's block still open
    (the latch released; the caller ends the block by setting the event, and
    joins the thread)."""
    s = cs.Stream()
    t = cs.track(ops.array(np.zeros(8, "float32")))
    latch = ops.latch(s)
    opened, end = threading.Event(), threading.Event()

    def writer() -> None:
        with t.writing(s):
            ops.fill(s, t.array, 1.0)
            opened.set()
            end.wait(30)

    th = threading.Thread(target=writer)
    if waiting_for == "writing() block":
        th.start()
        assert opened.wait(10)
        latch.release()
    else:
        with t.writing(s):
            ops.fill(s, t.array, 1.0)
    return t, latch, end, th


@pytest.mark.parametrize("waiting_for", ["kernel", "writing() block"])
async def test_a_new_policy_ends_a_sleep_of_the_old_one_at_once(
    ops: DeviceOps, waiting_for: str
) -> None:
    """A waiter parked under a slow policy (passes 4 s apart) while the
    policy is switched to low latency: the sleep under way was the old
    policy's, and ends at once, so the waiter wakes when its work is done,
    0.2 s after the switch (it slept out the 4 s). Both the poller's sleep
    and a wait for another thread's ``writing()`` block follow the switch."""
    slow = cs.PollPolicy(spin=0, first=4.0, cap=4.0, wake="poll")
    t, latch, end, th = _pending_write(ops, waiting_for)  # the block ends 0.2 s after the switch
    try:
        cs.configure(poll=slow)
        async with anyio.create_task_group() as tg:
            woke = []

            async def consumer() -> None:
                await cs.consume(t, timeout=20)
                woke.append(time.monotonic())

            tg.start_soon(consumer)
            await anyio.sleep(0.1)  # parked, in the slow sleep
            cs.configure(poll=cs.PollPolicy.low_latency())
            switched = time.monotonic()
            await anyio.sleep(0.2)
            end.set()
            latch.release()
        assert woke[0] - switched < slow.cap / 2, woke[0] - switched
        np.testing.assert_array_equal(ops.to_host(t.array), 1.0)
    finally:
        end.set()
        latch.release()
        if th.is_alive() or waiting_for == "writing() block":
            th.join(10)
        cs.configure(poll=cs.PollPolicy())


#: GIL takes another thread makes in one measurement, and the switch interval
#: they run under: a thread starved of the GIL waits it out for each take
_TAKES, _SWITCH = 30, 0.02


_sleep = time.sleep
#: the thread of the event loop the tests run in (pytest's, for each runner)
_loop_thread = threading.get_ident()


def _counting_sleep(released: list[float], seconds: float) -> None:
    """``time.sleep``, counting the releases of the GIL (sleeps of 0) that
    the event loop's thread makes."""
    if seconds == 0 and threading.get_ident() == _loop_thread:
        released.append(seconds)
    _sleep(seconds)


async def _gil_takes() -> float:
    """Seconds another thread takes to give up the GIL and take it back
    ``_TAKES`` times (as a lock wait or a driver call does) while this loop
    waits for it."""
    took: list[float] = []

    def worker() -> None:
        start = time.perf_counter()
        for _ in range(_TAKES):
            time.sleep(0)
        took.append(time.perf_counter() - start)

    th = threading.Thread(target=worker)
    th.start()
    await anyio.to_thread.run_sync(th.join, 30)
    return took[0] if took else math.inf  # (not done in 30 s: starved)


@pytest.mark.parametrize("waiting_for", ["kernel", "writing() block"])
async def test_a_busy_poller_lets_other_threads_take_the_gil(
    ops: DeviceOps, waiting_for: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The low-latency policy never sleeps, but a consumer spinning under it
    (the poller's passes, or a wait for another thread's block) lets a thread
    waiting for the GIL take it, once a millisecond. Without that (under
    trio) each of that thread's takes could wait out CPython's switch
    interval or longer: the loop's own turns let go of the GIL too briefly to
    be won, and restart the interval (at 5 ms, 100 took 0.5 to 3.7 s), so a
    loader thread, or the simulator's own stream workers, crawled while a
    consumer waited. The control is the same spin with that sharing turned
    off, measured here beside the real one, under a 20 ms switch interval,
    the worst of three each: 30 takes beside the real spin take 10-40 ms.
    Whether the brief turns are lost is up to the machine: where the control
    shows no starvation (asyncio's turns are mostly won, as are trio's on a
    loaded machine), there is nothing to compare, and the test skips after
    checking only that the spin lets go of the GIL: ``poll_gil_shares``
    grows, and the loop's thread makes as many ``time.sleep(0)``."""
    switch = sys.getswitchinterval()
    sys.setswitchinterval(_SWITCH)
    try:
        await _gil_takes_beside_a_spinning_consumer(ops, waiting_for, monkeypatch)
    finally:
        sys.setswitchinterval(switch)


async def _gil_takes_beside_a_spinning_consumer(
    ops: DeviceOps, waiting_for: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    idle = await _gil_takes()
    t, latch, end, th = _pending_write(ops, waiting_for)  # the block ends once measured
    cs.configure(poll=cs.PollPolicy.low_latency())
    share = _doorbell.PollerBells.share_gil
    shared: list[float] = []
    unshared: list[float] = []
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(cs.consume, t, timeout=60))
            await anyio.sleep(0.05)  # parked, spinning
            before = cs.stats()["poll_gil_shares"]
            released: list[float] = []
            monkeypatch.setattr(time, "sleep", functools.partial(_counting_sleep, released))
            await anyio.sleep(0.3)
            monkeypatch.setattr(time, "sleep", _sleep)
            shares = cs.stats()["poll_gil_shares"] - before
            assert shares > 0  # it lets go (idle: once a ms), each time for real:
            assert len(released) == shares, (released, shares)
            for _ in range(3):
                monkeypatch.setattr(_doorbell.PollerBells, "share_gil", lambda self: None)
                unshared.append(await _gil_takes())  # the control
                monkeypatch.setattr(_doorbell.PollerBells, "share_gil", share)
                shared.append(await _gil_takes())
            end.set()
            latch.release()
        np.testing.assert_array_equal(ops.to_host(t.array), 1.0)
    finally:
        monkeypatch.setattr(_doorbell.PollerBells, "share_gil", share)
        end.set()
        latch.release()
        if waiting_for == "writing() block":
            th.join(10)
        cs.configure(poll=cs.PollPolicy())
    if max(unshared) < _TAKES * _SWITCH / 2:  # (most takes did not wait it out)
        pytest.skip(f"the control shows no starvation here ({unshared}, idle {idle:.4f} s)")
    assert max(shared) < max(unshared) / 3, (shared, unshared, idle)


# -- blocking and validation ----------------------------------------------------


def test_consume_blocking(ops: DeviceOps) -> None:
    s = cs.Stream()
    arr, producer = _on(ops, np.zeros(16, "float32"), s)
    latch = ops.latch(s)
    ops.fill(s, arr, 4.0)
    with pytest.raises(TimeoutError):
        cs.consume_blocking(producer, timeout=0.01)
    latch.release()
    view = cs.consume_blocking(producer, timeout=20)
    assert view.stream is None and (ops.to_host(arr) == 4).all()
    c = cs.Stream()
    assert cs.consume_blocking(producer, stream=c).stream == c.handle
    assert cs.consume_blocking(producer).stream is None  # no timeout: synchronizes


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"timeout": -1}, ValueError),
        ({"timeout": float("nan")}, ValueError),
        ({"timeout": "1"}, ValueError),
        ({"timeout": 10**400}, ValueError),  # (an OverflowError, from deep inside)
        ({"sync": 1}, TypeError),
        ({"stream": 0}, ValueError),
        ({"stream": "s"}, TypeError),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], error: type[Exception]) -> None:
    cs.use_backend("sim")
    arr = sim.empty(4)
    with pytest.raises(error):
        cs.consume_blocking(arr, **kwargs)
    with pytest.raises(error):
        anyio.run(lambda: cs.consume(arr, **kwargs))


@pytest.mark.parametrize("kind", [np.float16, np.float32, np.int64, np.float64])
def test_numpy_numbers_are_timeouts_of_that_many_seconds(kind: Any) -> None:
    """A NumPy number is a number of seconds: pending work that ends well
    inside it is waited for, host and async alike (a float16 deadline,
    computed in float16 at this machine's uptime, had passed at once)."""
    cs.use_backend("sim")
    for wait in ("blocking", "async"):
        s = cs.Stream()
        arr = sim.empty(4)
        arr.stream = s.handle
        sim.launch(s, lambda x: x.fill(3.0), arr, writes=[arr], duration=0.05)
        if wait == "blocking":
            view = cs.consume_blocking(arr, timeout=kind(3))
        else:
            view = anyio.run(functools.partial(cs.consume, arr, timeout=kind(3)))
        got = sim._numpy_view(view)
        assert got is not None and (got == 3.0).all()


def test_not_an_array() -> None:
    with pytest.raises(TypeError, match="__cuda_array_interface__"):
        cs.consume_blocking(object())


# -- event loops ----------------------------------------------------------------


def test_uvloop() -> None:
    pytest.importorskip("uvloop")
    cs.use_backend("sim")
    s = cs.Stream()
    arr = sim.empty(8, "float32")
    sim.launch(s, lambda x: x.fill(9), arr, writes=[arr], duration=0.005)

    async def main() -> cs.ArrayView:
        return await cs.consume(cs.read_interface(arr).with_stream(s.handle), timeout=20)

    view = anyio.run(main, backend_options={"use_uvloop": True})
    data = sim._numpy_view(view)
    assert data is not None and (data == 9).all()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"spin": -1},
        {"spin": True},
        {"first": -0.1},
        {"cap": float("inf")},
        {"growth": 0.5},
        {"first": 0.01, "cap": 0.001},
        {"slice": float("nan")},
        {"first": 0.0, "cap": 0.001},  # a sleep of 0 never grows: a busy loop
    ],  # fmt: skip
)
def test_poll_policy_rejects_nonsense(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        cs.PollPolicy(**kwargs)
    assert list(itertools.islice(cs.PollPolicy(first=0.0, cap=0.0).delays(), 3)) == [0.0] * 3
    with pytest.raises(TypeError):
        cs.configure(poll="fast")  # type: ignore[arg-type]


def test_poll_policy_delays() -> None:
    delays = iter(cs.PollPolicy(spin=1, first=0.0001, growth=2.0, cap=0.0005).delays())
    assert [next(delays) for _ in range(6)] == [0.0, 0.0001, 0.0002, 0.0004, 0.0005, 0.0005]
    low = iter(cs.PollPolicy.low_latency().delays())
    assert {next(low) for _ in range(5)} == {0.0}


def test_a_stream_of_another_backend_is_refused_everywhere() -> None:
    """consume(stream=), writing()/reading() and export(stream=) share one check:
    a stream must belong to the backend of the array it is ordered with."""
    from cai_streams import _backend
    from cai_streams._backend._sim import SimBackend

    cs.use_backend("sim")
    other = SimBackend(jitter=0.0)
    saved, _backend._current = _backend._current, other
    try:
        foreign = cs.Stream()
    finally:
        _backend._current = saved
    try:
        arr = sim.empty(8)
        t = cs.track(sim.empty(8))
        calls: list[Callable[[], object]] = [
            lambda: cs.consume_blocking(arr, stream=foreign),
            lambda: t.writing(foreign).__enter__(),
            lambda: t.reading(foreign).__enter__(),
            lambda: t.export(foreign),
        ]
        for call in calls:
            with pytest.raises(ValueError, match=r"another 'sim' backend instance"):
                call()
    finally:
        foreign.close()
        other.close()


# -- the mode table: one test per row ---------------------------------------------------


class _Producer:
    """An untracked producer naming ``stream`` (None: nothing pending)."""

    def __init__(self, arr: Any, stream: int | None) -> None:
        self.arr, self.stream = arr, stream

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return cs.read_interface(self.arr).with_stream(self.stream).__cuda_array_interface__


def _still_running(s: cs.Stream) -> bool:
    event = s.record()
    time.sleep(0.05)  # long enough for work that did not wait to have run
    return not event.is_done


@pytest.mark.parametrize(
    "row",
    # the DLPack rows have their own test (test_dlpack.py): their producer has no interface
    [m for m in Mode if not m.name.startswith("DLPACK")],
    ids=lambda m: m.name,
)
async def test_each_row_of_the_mode_table(ops: DeviceOps, row: Mode) -> None:
    """Each row: the row chosen, what is waited for (a held producer), what
    the view names, and what leaving ``consuming()`` enqueues."""
    p, c, w = cs.Stream(), cs.Stream(), cs.Stream()
    arr = ops.array(np.zeros(64, "float32"))
    out = ops.array(np.full(64, -1.0, "float32"))
    tracked = row.name.startswith("TRACKED")
    stream = c if row.name.endswith("ENQUEUE") else None
    sync = not row.name.endswith("OPT_OUT")
    latch = ops.latch(p)
    try:
        if tracked:
            obj: Any = cs.track(arr)
            with obj.writing(p):
                ops.fill(p, arr, 1.0)
        elif row is Mode.READY:  # the producer's work is done: it names no stream
            latch.release()
            ops.fill(p, arr, 1.0)
            p.synchronize()
            obj = _Producer(arr, None)
        else:
            ops.fill(p, arr, 1.0)
            obj = _Producer(arr, p.handle)
        assert _handoff(obj, stream, sync, cs.current_backend()).mode is row
        if row in (Mode.TRACKED_HOST, Mode.UNTRACKED_HOST):
            view = await consume_after_latch(obj, latch)
            assert view.stream is None and (ops.to_host(arr) == 1).all()
            return
        async with cs.consuming(obj, stream=stream, sync=sync) as view:  # returns at once
            expected = {
                Mode.TRACKED_ENQUEUE: c.handle,
                Mode.UNTRACKED_ENQUEUE: c.handle,
                Mode.TRACKED_OPT_OUT: obj.export_stream.handle if tracked else None,
                Mode.UNTRACKED_OPT_OUT: p.handle,
                Mode.READY: None,
            }[row]
            assert view.stream == expected
            if view.stream is not None:  # a consumer that follows the view
                reader = cs.Stream.wrap(view.stream)
                held = ops.latch(reader) if row.name.endswith("ENQUEUE") else None
                with cs.sanitize(row is not Mode.UNTRACKED_OPT_OUT):  # reads p's own stream
                    ops.copy(reader, out, view.with_stream(None))
        latch.release()
        if row.name.endswith("ENQUEUE"):  # leaving made the producer's side wait for c
            assert held is not None
            try:
                if tracked:
                    with obj.writing(w):
                        ops.fill(w, arr, 2.0)
                    assert _still_running(w)
                else:
                    ops.fill(p, arr, 2.0)
                    assert _still_running(p)
            finally:
                held.release()
            c.synchronize()
            assert (ops.to_host(out) == 1).all()
        elif view.stream is not None:
            cs.Stream.wrap(view.stream).synchronize()
            assert (ops.to_host(out) == 1).all()
    finally:
        latch.release()
    for s in (p, c, w):
        s.synchronize()


@pytest.mark.parametrize("behind", ["a latched kernel", "another thread's block"])
async def test_a_scope_around_a_consume_that_expires_with_its_timeout_catches_it(
    ops: DeviceOps, behind: str
) -> None:
    """The caller's ``move_on_after`` and the consume's ``timeout`` expire in
    the same loop turn, a hundred times: the caller's scope catches it every
    time, as under trio (under asyncio, the consume's ``TimeoutError``
    escaped the scope about one time in twenty)."""
    if ops.name != "sim":
        pytest.skip("the sim's latch: a hundred 10 ms waits")
    s = cs.Stream()
    t = cs.track(ops.array(np.zeros(8, "float32")))
    escaped = 0
    with contextlib.ExitStack() as behind_it:
        behind_it.callback(ops.latch(s).release)
        if behind == "a latched kernel":
            with t.writing(s):
                ops.fill(s, t.array, 1.0)
        else:
            behind_it.enter_context(writing_in_another_thread(t, s))
        for _ in range(100):
            try:
                with anyio.move_on_after(0.01):
                    await cs.consume(t, timeout=0.01)
            except TimeoutError:
                escaped += 1
    s.synchronize()
    assert escaped == 0


async def test_a_timeout_names_only_the_streams_still_pending(ops: DeviceOps) -> None:
    """``consume_all`` of two arrays, one on a stream done long before the
    timeout: the message names the other stream only (it named both: the
    pass that would have seen the first done was cancelled by the timeout)."""
    if ops.name != "sim":
        pytest.skip("the sim's kernel durations")
    fast, slow = cs.Stream(), cs.Stream()
    a, b = cs.track(sim.empty(16)), cs.track(sim.empty(16))
    with a.writing(fast):
        sim.launch(fast, lambda: None, duration=0.02)
    latch = ops.latch(slow)
    with b.writing(slow):
        pass
    try:
        with pytest.raises(TimeoutError) as info:
            await cs.consume_all(a, b, timeout=0.3)
    finally:
        latch.release()
    assert str(info.value) == (
        f"GPU work not complete after 0.3 s: still pending on stream {slow.handle:#x}"
    )
    slow.synchronize()


async def test_work_found_done_when_the_timeout_expires_is_returned(
    ops: DeviceOps, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wait's own timeout expires just as the work completes (here: a
    wait that gives up at once, over work done by then): the consume returns
    the view, as ``consume_blocking`` does, instead of raising "GPU work not
    complete" with no stream to name."""
    if ops.name != "sim":
        pytest.skip("the sim's latch")
    from cai_streams import _poller

    s = cs.Stream()
    t = cs.track(ops.array(np.zeros(8, "float32")))
    latch = ops.latch(s)
    with t.writing(s):
        ops.fill(s, t.array, 1.0)

    async def gives_up(seconds: float, fn: Any) -> bool:
        latch.release()
        s.synchronize()  # (done by the time the wait looks again)
        return False

    monkeypatch.setattr(_poller, "finished_within", gives_up)
    view = await cs.consume(t, timeout=5)
    assert view is not None
