"""Every handoff pattern race-free, leak-free and loop-friendly: one test (or a
few) per class of program that used to break, each beside a control that shows
what goes wrong without the mechanism under test.

Ordering is shown with data: a latch holds a stream, so a missing wait reads
or writes the wrong values deterministically. Tests that use ``ops`` hold on
both backends; the others need the simulated device (jitter, handle reuse,
per-thread default streams held on the host) and select it.
"""

from __future__ import annotations

import asyncio
import gc
import math
import threading
import time
import warnings
import weakref
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import numpy as np
import pytest

import cai_streams as cs
from cai_streams import sim
from cai_streams._hold_table import table
from cai_streams._pending import PendingWork

from .device_ops import (
    DeviceOps,
    Latch,
    SimOps,
    consuming_past_the_open_reads,
    writing_in_another_thread,
)
from .device_ops import held as _held
from .model import recycled_stream_handles, until

pytestmark = pytest.mark.anyio


@pytest.fixture
def sim_backend() -> Iterator[cs.Backend]:
    previous = cs.current_backend()
    chosen = cs.use_backend("sim")
    try:
        yield chosen
    finally:
        cs.use_backend(previous.name)


def _values(obj: Any) -> np.ndarray[Any, Any]:
    """The simulated device memory behind ``obj``, as numpy (no stream work)."""
    data = sim._numpy_view(obj)
    assert data is not None
    return data


def _settled_in_flight(*streams: cs.Stream) -> int:
    for s in streams:
        s.synchronize()
    gc.collect()
    return cs.stats()["events_in_flight"]


class Reporting:
    """A producer whose interface names whatever stream it says (a Numba array
    with a default stream, a CuPy array exported under a stream)."""

    def __init__(self, arr: Any) -> None:
        self.arr = arr
        self.stream: int | None = None

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return cs.read_interface(self.arr).with_stream(self.stream).__cuda_array_interface__


async def _returns_only_after_release(call: Callable[[], Awaitable[Any]], latch: Any) -> Any:
    """``call()`` must still be waiting while ``latch`` holds; then it returns."""
    got: list[Any] = []

    async def run() -> None:
        got.append(await call())

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            for _ in range(20):
                await anyio.sleep(0.001)
            assert not got, "returned while the producer's stream was held"
            latch.release()
    finally:
        latch.release()
    return got[0]


# -- 1. fan-out: every consumer is protected, not only the last --------------------------

FAN_OUTS = [
    "export, export",
    "export, consume(stream=)",
    "export, host consume",
    "consume(stream=), consume(stream=)",
    "consume(stream=), host consume",
]


@pytest.mark.parametrize("shape", FAN_OUTS)
async def test_a_fan_out_protects_every_consumer(ops: DeviceOps, shape: str) -> None:
    """Two consumers of one tracked buffer; the first is slow (held) and
    enqueues its read after the second handoff. The producer's next
    writing() must wait for it too, so it reads 1, not 2."""
    p, a, b, w = cs.Stream(), cs.Stream(), cs.Stream(), cs.Stream()
    arr = ops.array(np.zeros(64, "float32"))
    out_a = ops.array(np.zeros(64, "float32"))
    out_b = ops.array(np.zeros(64, "float32"))
    t = cs.track(arr)
    with t.writing(p):
        ops.fill(p, arr, 1.0)
    first, second = shape.split(", ")
    latch = ops.latch(a)
    try:
        if first == "export":
            # None once the fill already completed: the read on ``a`` counts either way
            assert t.export(a)["stream"] in (a.handle, None)
        else:
            await cs.consume(t, stream=a)
        if second == "export":
            assert cs.export(t, stream=b)["stream"] in (b.handle, None)
            ops.copy(b, out_b, cs.read_interface(arr))
        elif second == "consume(stream=)":
            view = await cs.consume(t, stream=b)
            ops.copy(b, out_b, view.with_stream(None))
        else:
            view = await cs.consume(t, timeout=5)
            assert (ops.to_host(arr) == 1).all()
        ops.copy(a, out_a, cs.read_interface(arr))  # the first consumer's read comes now
        with t.writing(w):  # the producer reuses the buffer
            ops.fill(w, arr, 2.0)
        assert _held(w), "the writer did not wait for the held consumer"
    finally:
        latch.release()
    for s in (a, b, w):
        s.synchronize()
    assert (ops.to_host(out_a) == 1).all()
    if second != "host consume":
        assert (ops.to_host(out_b) == 1).all()
    assert (ops.to_host(arr) == 2).all()


async def test_a_fan_out_control_an_undeclared_reader_is_overwritten(ops: DeviceOps) -> None:
    """The control: the first reader orders itself after the producer by hand,
    so the buffer does not know it, and the refill overtakes it."""
    p, a, w = cs.Stream(), cs.Stream(), cs.Stream()
    arr = ops.array(np.zeros(64, "float32"))
    out = ops.array(np.zeros(64, "float32"))
    t = cs.track(arr)
    with t.writing(p):
        ops.fill(p, arr, 1.0)
    latch = ops.latch(a)
    try:
        a.wait(p)
        with cs.sanitize(False):  # racy on purpose
            ops.copy(a, out, cs.read_interface(arr))
            with t.writing(w):
                ops.fill(w, arr, 2.0)
        w.synchronize()  # the refill completes while the reader is held
    finally:
        latch.release()
    a.synchronize()
    assert (ops.to_host(out) == 2).all()


# -- 2. a consumer closing its stream ------------------------------------------------------


def _the_next_write_waits_for_the_read(
    ops: DeviceOps,
    t: cs.TrackedArray,
    w: cs.Stream,
    latch: Latch,
    done: cs.Event,
    out: Any,
) -> None:
    """A consumer's copy of ``t`` (1.0) into ``out``, held by ``latch`` and
    ending at ``done``, on a stream closed since: a write of 2.0 on ``w`` waits
    for it (write after read). Releases the latch."""
    try:
        with t.writing(w):
            ops.fill(w, t.array, 2.0)
        assert _held(w), "the writer did not wait for the closed stream's read"
    finally:
        latch.release()
    done.synchronize()
    w.synchronize()
    assert (ops.to_host(out) == 1).all() and (ops.to_host(t.array) == 2).all()


@pytest.mark.parametrize("hand_on", ["consume", "export", "__dlpack__"])
def test_a_view_of_a_tracked_array_handed_on_protects_its_next_consumer_too(
    sim_backend: cs.Backend, hand_on: str
) -> None:
    """The view ``consume(t, stream=s)`` returns, handed on by the library to
    a second consumer ``c`` (``consume``, ``export`` or ``__dlpack__`` of the
    view): ``c`` counts as a reader of ``t``, so ``t``'s next ``writing()``
    waits for it. The view was taken for an untracked array, and the write
    overwrote what ``c`` was about to read. Control: a consumer that reads the
    memory without a handoff (latched the same way) sees the new data."""
    ops = SimOps()
    t = cs.track(ops.array(np.ones(64, np.float32)))
    s, c, w, bypass = cs.Stream(), cs.Stream(), cs.Stream(), cs.Stream()
    view = cs.consume_blocking(t, stream=s)
    out, stale = ops.array(np.zeros(64, np.float32)), ops.array(np.zeros(64, np.float32))
    latch, latch2 = ops.latch(c), ops.latch(bypass)  # both consumers are slow
    if hand_on == "consume":
        src = cs.consume_blocking(view, stream=c)
    elif hand_on == "export":
        cs.export(view, stream=c)
        src = view
    else:
        view.__dlpack__(stream=c.handle)
        src = view
    with cs.sanitize(False):  # the control races on purpose
        ops.copy(c, out, src)
        ops.copy(bypass, stale, view.with_stream(None))
        with t.writing(w):
            ops.fill(w, t.array, 9.0)
        assert _held(w)  # the write waits for c's read
        latch.release()
        w.synchronize()
        latch2.release()  # the write did not wait for the undeclared reader
        bypass.synchronize()
    c.synchronize()
    np.testing.assert_array_equal(_values(out), 1.0)
    np.testing.assert_array_equal(_values(stale), 9.0)  # the control read the new data


def test_a_view_handed_to_another_threads_per_thread_stream_is_waited_for_here(
    sim_backend: cs.Backend,
) -> None:
    """Thread A hands an untracked producer's array to its per-thread stream
    (``stream=2``); the view, handed on in this thread, names A's stream, not
    this thread's handle 2 (which never waited for the producer: the next
    consumer read before the write). From here A's stream is waited for
    through the legacy stream, which waits for it."""
    ops = SimOps()
    p, c = cs.Stream(), cs.Stream()
    arr = ops.array(np.zeros(64, np.float32))
    latch = ops.latch(p)
    ops.fill(p, arr, 7.0)
    producer = Reporting(arr)
    producer.stream = p.handle
    got: list[cs.ArrayView] = []
    th = threading.Thread(target=lambda: got.append(cs.consume_blocking(producer, stream=2)))
    th.start()
    th.join(10)
    (view,) = got
    out = ops.array(np.zeros(64, np.float32))
    try:
        ops.copy(c, out, cs.consume_blocking(view, stream=c))
        held = _held(c)
    finally:
        latch.release()
    c.synchronize()
    assert held
    np.testing.assert_array_equal(_values(out), 7.0)


@pytest.mark.parametrize("reused", [False, True], ids=["handle gone", "handle reused"])
def test_a_view_whose_stream_closed_since_is_refused_when_handed_on(
    sim_backend: cs.Backend, reused: bool
) -> None:
    """A view handed to ``s`` names ``s``; ``s`` closed, its work cannot be
    waited for by handle, and a new stream may have the handle: handing the
    view on raises ValueError saying so (it waited on the new stream, or
    raised a CudaError for the gone handle), on the host and onto a stream."""
    ops = SimOps()
    p, s = cs.Stream(), cs.Stream()
    arr = ops.array(np.zeros(64, np.float32))
    latch = ops.latch(p)
    try:
        ops.fill(p, arr, 7.0)
        producer = Reporting(arr)
        producer.stream = p.handle
        view = cs.consume_blocking(producer, stream=s)
        s.close()
        taker = cs.Stream() if reused else None
        for stream in (None, cs.Stream()):
            with pytest.raises(ValueError, match="was closed after the view was handed to it"):
                cs.consume_blocking(view, stream=stream, timeout=1)
        with pytest.raises(ValueError, match="was closed after"):
            cs.export(view, stream=cs.Stream())
        assert cs.consume_blocking(view.owner, stream=cs.Stream()).stream is not None
    finally:
        latch.release()
    p.synchronize()  # (s waited only for p: its work is known complete now)
    assert cs.consume_blocking(view.with_stream(None), timeout=1).stream is None  # as advised
    if taker is not None:
        taker.close()


@pytest.mark.parametrize("hand_on", ["to a stream", "to the host"])
def test_a_view_of_a_tracked_array_written_on_its_stream_is_handed_on_after_that_write(
    sim_backend: cs.Backend, hand_on: str
) -> None:
    """The first consumer updates the view in place on its stream ``s`` (held),
    then hands the view on: the next consumer waits for ``s`` too, not only
    for the array's tracked writes (the view names ``s``: where its data is
    ready). The view was routed to the array's tracked state alone, and the
    next consumer read the old data."""
    ops = SimOps()
    t = cs.track(ops.array(np.ones(64, np.float32)))
    s, c = cs.Stream(), cs.Stream()
    view = cs.consume_blocking(t, stream=s)
    latch = ops.latch(s)
    with cs.sanitize(False):  # (an undeclared in-place update, as another library makes)
        ops.fill(s, view, 10.0)
    out = ops.array(np.zeros(64, np.float32))
    try:
        if hand_on == "to a stream":
            ops.copy(c, out, cs.consume_blocking(view, stream=c))
            waited = _held(c)
        else:
            with pytest.raises(TimeoutError):  # not ready while s is held
                cs.consume_blocking(view, timeout=0.05)
            waited = True
    finally:
        latch.release()
    if hand_on == "to the host":
        cs.consume_blocking(view, timeout=10)
        np.testing.assert_array_equal(_values(t.array), 10.0)
    else:
        c.synchronize()
        np.testing.assert_array_equal(_values(out), 10.0)
    assert waited


@pytest.mark.parametrize("fixed", [True, False], ids=["under the lock", "control"])
def test_two_threads_handing_on_one_view_keep_the_newer_record_of_its_stream(
    sim_backend: cs.Backend, fixed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Thread T1 hands on a view of a tracked array that names a held stream
    ``s``: its record of ``s``'s work is made, and T1 is preempted there
    (forced: it waits up to 0.5 s for thread C). C fills the view on ``s`` and
    hands it on too. T1's older record must not replace C's newer one: the
    host consume after both waits for the fill (the control records outside
    the array's lock, so T1 adds its record last, and the host reads the old
    data)."""
    from cai_streams import _pending
    from cai_streams._access import Access, Kind

    if not fixed:

        def note_stream(self: Any, key: Any) -> None:
            stream = cs.Stream._borrow_key(key, self.backend)
            access = Access.recorded(self, Kind.WRITE, stream, key)
            with self._locked():
                self._add(access)

        monkeypatch.setattr(_pending.PendingWork, "note_stream", note_stream)
    ops = SimOps()
    a = sim.asarray(np.zeros(64, np.float32))
    t = cs.track(a)
    s, s2, s3 = cs.Stream(), cs.Stream(), cs.Stream()
    view = cs.consume_blocking(t, stream=s)
    latch = ops.latch(s)

    def fill(x: Any) -> None:
        time.sleep(0.1)
        x.fill(5.0)

    def fill_and_hand_on() -> None:
        with cs.sanitize(False):  # (an undeclared in-place update, as another library makes)
            sim.launch(s, fill, view)
        cs.consume_blocking(view, stream=s3)

    other = threading.Thread(target=fill_and_hand_on, name="C")
    recorded = Access.recorded.__func__  # type: ignore[attr-defined]

    def preempted(cls: Any, *args: Any, **kwargs: Any) -> Any:
        access = recorded(cls, *args, **kwargs)
        if threading.current_thread().name == "T1" and not other.is_alive():
            other.start()
            other.join(0.5)  # (under the lock, C waits: T1 goes on first)
        return access

    monkeypatch.setattr(Access, "recorded", classmethod(preempted))
    t1 = threading.Thread(
        target=cs.consume_blocking, args=(view,), kwargs={"stream": s2}, name="T1"
    )
    t1.start()
    t1.join(10)
    other.join(10)
    monkeypatch.undo()
    latch.release()
    cs.consume_blocking(t, timeout=10)
    got = a.to_host()[0]
    s.synchronize()
    assert got == (5.0 if fixed else 0.0)


def test_a_host_consume_of_a_view_on_another_threads_per_thread_stream_waits_for_it(
    sim_backend: cs.Backend,
) -> None:
    """A view handed to thread A's stream 2, consumed on the host here while
    A's stream is held: the host waits (through an event on the legacy
    stream, which waits for A's stream). It asked the legacy stream itself
    whether it was idle (it was: nothing is enqueued there) and returned at
    once, before A's work."""
    ops = SimOps()
    arr = ops.array(np.ones(64, np.float32))
    got: list[cs.ArrayView] = []
    ready, done = threading.Event(), threading.Event()
    latches: list[Latch] = []  # A's own stream 2, held

    def thread_a() -> None:
        mine = cs.Stream.wrap(2)
        view = cs.consume_blocking(arr, stream=mine)
        latches.append(ops.latch(mine))
        with cs.sanitize(False):
            ops.fill(mine, view, 10.0)
        got.append(view)
        ready.set()
        done.wait(10)  # A stays alive meanwhile

    th = threading.Thread(target=thread_a)
    th.start()
    try:
        assert ready.wait(10)
        with pytest.raises(TimeoutError):
            cs.consume_blocking(got[0], timeout=0.05)
        latches[0].release()
        cs.consume_blocking(got[0], timeout=10)
        np.testing.assert_array_equal(_values(arr), 10.0)
    finally:
        for latch in latches:
            latch.release()
        done.set()
        th.join(10)


async def test_a_consuming_exit_and_a_close_in_another_thread_make_one_back_edge(
    sim_backend: cs.Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The body's exit is making its back-edge when another thread closes the
    consumer's stream: the close waits for that record before it destroys the
    stream (it found the edge taken and went on, and the exit's record met a
    destroyed handle: a CudaError out of ``async with``, and no back-edge)."""
    from cai_streams import _consume

    ops = SimOps()
    p, c = cs.Stream(), cs.Stream()
    arr = ops.array(np.ones(64, np.float32))
    arr.stream = p.handle
    out = ops.array(np.zeros(64, np.float32))
    in_join, closer_started = threading.Event(), threading.Event()
    real = _consume._UntrackedEnqueue._join_back

    def slow_join(self: Any) -> None:
        in_join.set()
        assert closer_started.wait(10)
        time.sleep(0.05)  # the close runs meanwhile, in the other thread
        real(self)

    monkeypatch.setattr(_consume._UntrackedEnqueue, "_join_back", slow_join)

    def close_during_the_exit() -> None:
        assert in_join.wait(10)
        closer_started.set()
        c.close()

    closer = threading.Thread(target=close_during_the_exit)
    closer.start()
    latch = ops.latch(c)
    try:
        async with cs.consuming(arr, stream=c, timeout=5) as view:
            ops.copy(c, out, view)
            done = c.record()
        closer.join(10)
        ops.fill(p, arr, 5.0)  # the producer's next write waits for the body's copy
        waited = _held(p)
    finally:
        latch.release()
        closer.join(10)
    done.synchronize()
    p.synchronize()
    assert waited
    np.testing.assert_array_equal(_values(out), 1.0)


async def test_a_consuming_exit_after_its_producers_stream_closed_makes_no_back_edge(
    sim_backend: cs.Backend,
) -> None:
    """The untracked producer's stream closes during the body, and a new
    stream takes its handle and begins a capture: the exit makes no back-edge
    (nothing more can write on a closed stream). It made the new stream wait,
    which broke its capture (and raised a CudaError from the exit when the
    handle was gone)."""
    p = cs.Stream()
    x = sim.empty(16)
    x.stream = p.handle
    sim.launch(p, lambda a: a.fill(1.0), x, writes=[x], duration=0.02)
    s = cs.Stream()
    async with cs.consuming(x, stream=s, timeout=5) as view:
        sim.launch(s, lambda a: None, view, reads=[view])
        handle = p.handle
        p.close()
        q = cs.Stream()
        assert q.handle == handle  # (the sim gives the closed handle out again)
        q.begin_capture()
    q.end_capture()  # the capture survived
    s.synchronize()


def test_tracking_a_view_of_a_tracked_array_gives_that_array(sim_backend: cs.Backend) -> None:
    """``cs.track(view)`` of a view of a tracked array is the array's
    TrackedArray (it made a second, independent tracked state: a write
    through it did not wait for the array's reader, which read zeros)."""
    ops = SimOps()
    a = ops.array(np.ones(64, np.float32))
    t = cs.track(a)
    view = cs.consume_blocking(t, stream=cs.Stream())
    r, q = cs.Stream(), cs.Stream()
    out = ops.array(np.zeros(64, np.float32))
    latch = ops.latch(r)
    with t.reading(r):
        ops.copy(r, out, a)
    try:
        t2 = cs.track(view)
        assert t2 is t
        with t2.writing(q):
            ops.fill(q, view.with_stream(None), 0.0)
        waited = _held(q)
    finally:
        latch.release()
    q.synchronize()
    assert waited
    np.testing.assert_array_equal(_values(out), 1.0)


@pytest.mark.parametrize("tracked", [True, False], ids=["tracked", "untracked"])
def test_a_view_on_another_threads_capturing_stream_2_is_refused_and_the_capture_lives(
    sim_backend: cs.Backend, tracked: bool
) -> None:
    """Thread A hands an array to its stream 2 and begins a capture there;
    handing the view on here needs a record on the legacy stream, which any
    use would invalidate A's capture: CaptureError first (the record was made,
    the driver refused it, and A's capture was invalidated)."""
    x = sim.empty(16)
    source: Any = cs.track(x) if tracked else x
    got: list[cs.ArrayView] = []
    began, handed = threading.Event(), threading.Event()
    ended: list[str] = []

    def thread_a() -> None:
        mine = cs.Stream.wrap(2)
        got.append(cs.consume_blocking(source, stream=mine, timeout=5))
        mine.begin_capture(mode="thread_local")
        began.set()
        handed.wait(10)
        mine.end_capture()
        ended.append("ok")

    th = threading.Thread(target=thread_a)
    th.start()
    try:
        assert began.wait(10)
        with pytest.raises(
            cs.CaptureError, match=r"per-thread default stream \(2\) of another thread.*legacy"
        ):
            cs.consume_blocking(got[0], stream=cs.Stream(), timeout=1)
    finally:
        handed.set()
        th.join(10)
    assert ended == ["ok"]


def test_a_view_on_a_capturing_stream_handed_on_leaves_its_array_as_it_was(
    sim_backend: cs.Backend,
) -> None:
    """A view of a tracked array whose stream now captures, handed on to the
    host: nothing is recorded into the capture for it, and the array keeps no
    pending write from it (a captured write was left behind: every later
    consume of the array raised CaptureError until the capture ended)."""
    t = cs.track(sim.empty(16))
    s = cs.Stream()
    view = cs.consume_blocking(t, stream=s, timeout=5)
    s.synchronize()
    s.begin_capture(mode="relaxed")
    try:
        cs.consume_blocking(view, timeout=1)
        assert t.pending_streams()["writes"] == []
        cs.consume_blocking(t, timeout=1)
        cs.consume_blocking(t, stream=cs.Stream(), timeout=1)
    finally:
        s.end_capture()


@pytest.mark.parametrize("how", ["a TrackedArray over it", "sync=False"])
def test_a_view_whose_stream_closed_stays_usable_where_its_stream_is_not_waited_for(
    sim_backend: cs.Backend, how: str
) -> None:
    """A TrackedArray made over a view, whose stream was synchronized and
    closed, keeps working (every access raised ValueError for good: its own
    interface names the closed stream, where nothing more can be enqueued);
    ``sync=False`` hands a tracked array's view on without asking its stream
    (it raised the same ValueError)."""
    x = sim.empty(16)
    s = cs.Stream()
    if how == "sync=False":
        view = cs.consume_blocking(cs.track(x), stream=s, timeout=5)
        s.synchronize()
        s.close()
        cs.consume_blocking(view, sync=False)  # (its stream is not asked)
        return
    view = cs.consume_blocking(x, stream=s, timeout=5)
    t = cs.track(view)
    s.synchronize()
    s.close()
    q = cs.Stream()
    with t.writing(q):
        pass
    t.export()
    cs.consume_blocking(t, timeout=1)
    cs.consume_blocking(t, stream=q, timeout=1)


@pytest.mark.parametrize("fixed", [True, False], ids=["recorded at the close", "control"])
def test_a_tracked_view_whose_stream_closes_with_work_pending_still_waits_for_it(
    sim_backend: cs.Backend, fixed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TrackedArray over a view handed to ``s``: a slow write of the view
    is enqueued on ``s``, and ``s`` is closed (its work still runs). A host
    consume of the tracked array waits for that write: the close recorded it
    (the control takes the closed stream as idle, as before: the host read
    the old data)."""
    from cai_streams import _pending

    if not fixed:
        monkeypatch.setattr(
            _pending.PendingWork,
            "follow_view_stream",
            lambda self, view: setattr(self, "view_stream", _pending.ViewStream.RECORDED),
        )
    a = sim.asarray(np.zeros(64, np.float32))
    s = cs.Stream()
    t = cs.track(cs.consume_blocking(a, stream=s))
    got = _written_on_closed_and_read(t, s, a)
    time.sleep(0.3)
    assert got == (5.0 if fixed else 0.0)


def _written_on_closed_and_read(t: cs.TrackedArray, s: cs.Stream, a: Any) -> float:
    """A slow write of the tracked view ``t`` on its stream ``s``, ``s``
    closed, then a host consume of ``t``: what the host reads of ``a``."""

    def fill(x: Any) -> None:
        time.sleep(0.2)
        x.fill(5.0)

    with cs.sanitize(False):  # (an undeclared in-place update, as another library makes)
        sim.launch(s, fill, t.array)
    s.close()
    cs.consume_blocking(t, timeout=10)
    return float(a.to_host()[0])


@pytest.mark.parametrize("block", ["reading", "writing"])
def test_a_block_on_a_tracked_views_stream_leaves_it_followed(
    sim_backend: cs.Backend, block: str
) -> None:
    """A block of the tracked view on its own stream ends before the stream
    closes with a slow write pending: the close still records that write for
    the view (the block's end stopped listening to the stream, and every
    access of the array raised ValueError from then on)."""
    a = sim.asarray(np.zeros(64, np.float32))
    s = cs.Stream()
    t = cs.track(cs.consume_blocking(a, stream=s))
    with getattr(t, block)(s):
        pass
    assert _written_on_closed_and_read(t, s, a) == 5.0
    with t.writing(cs.Stream()):
        pass


def test_a_tracked_views_own_view_keeps_working_after_its_stream_closed(
    sim_backend: cs.Backend,
) -> None:
    """``t.view`` of a view tracked while its stream was open, after that
    stream closed: exported, consumed and tracked as ``t`` (it was taken for
    another view of the array, whose stream was noted, and raised ValueError)."""
    a = sim.asarray(np.zeros(64, np.float32))
    s = cs.Stream()
    t = cs.track(cs.consume_blocking(a, stream=s))
    assert _written_on_closed_and_read(t, s, a) == 5.0
    assert cs.track(t.view) is t
    cs.export(t.view)
    t.view.__cuda_array_interface__  # noqa: B018
    cs.consume_blocking(t.view, timeout=5)


def test_tracking_a_view_whose_stream_closed_is_refused(sim_backend: cs.Backend) -> None:
    """Tracked only after its stream closed, a view names a stream whose work
    cannot be waited for any more (its handle may name another stream): the
    same ValueError as a consume of the view (it was tracked, and every
    consume of it took the stream as idle)."""
    a = sim.empty(16)
    s = cs.Stream()
    view = cs.consume_blocking(a, stream=s)
    s.close()
    with pytest.raises(ValueError, match="which was closed"):
        cs.track(view)
    with pytest.raises(ValueError, match="which was closed"):
        cs.consume_blocking(view)
    cs.track(view.with_stream(None))  # (known complete: named by the user)


def test_a_view_whose_stream_closed_while_it_was_tracked_is_refused_again(
    sim_backend: cs.Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stream closes while ``track(view)`` runs, before the tracked state
    listens for it (forced: inside ``work_for``): that track raises, and so
    does the next one of the view (it found the state the first left and
    took it, and every consume of it raised)."""
    from cai_streams import _scheduler

    a = sim.empty(16)
    s = cs.Stream()
    view = cs.consume_blocking(a, stream=s)
    work_for = _scheduler.Scheduler.work_for

    def closed_meanwhile(self: Any, *args: Any) -> Any:
        got = work_for(self, *args)
        s.close()
        return got

    monkeypatch.setattr(_scheduler.Scheduler, "work_for", closed_meanwhile)
    with pytest.raises(ValueError, match="which was closed"):
        cs.track(view)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="which was closed"):
        cs.track(view)


def test_a_tracked_sim_arrays_own_dlpack_joins_its_tracked_writes(sim_backend: cs.Backend) -> None:
    """``arr.__dlpack__(stream=c)`` of a SimArray tracked with ``cs.track``
    (what ``cupy.from_dlpack(arr)`` calls) orders ``c`` after the writes
    tracked through ``writing()``, as the TrackedArray's own does: it joined
    only ``arr.stream`` (None), and the consumer read before the write ran.
    Control: ``stream=-1`` (no synchronization, by request) reads too early."""
    ops = SimOps()
    arr = ops.array(np.zeros(64, np.float32))
    t = cs.track(arr)
    p, c, early = cs.Stream(), cs.Stream(), cs.Stream()
    latch = ops.latch(p)
    with t.writing(p):
        ops.fill(p, arr, 5.0)
    out, control = ops.array(np.zeros(64, np.float32)), ops.array(np.zeros(64, np.float32))
    arr.__dlpack__(stream=c.handle)
    arr.__dlpack__(stream=-1)
    with cs.sanitize(False):  # the control races on purpose
        ops.copy(c, out, arr)
        ops.copy(early, control, arr)
        assert _held(c)
        early.synchronize()
        latch.release()
    c.synchronize()
    np.testing.assert_array_equal(_values(out), 5.0)
    np.testing.assert_array_equal(_values(control), 0.0)


@pytest.mark.parametrize("how", ["consume(stream=)", "export(stream=)"])
async def test_closing_the_consumers_stream_keeps_the_producer_working(
    ops: DeviceOps, how: str
) -> None:
    """The consumer's stream is closed with its read still held; the producer
    goes on (no 'this Stream is closed', ever), its next write waits for the
    read, and no event is left behind."""
    p, w = cs.Stream(), cs.Stream()
    arr = ops.array(np.zeros(64, "float32"))
    out = ops.array(np.zeros(64, "float32"))
    t = cs.track(arr)
    with t.writing(p):
        ops.fill(p, arr, 1.0)
    base = _settled_in_flight(p)
    with cs.Stream() as s:
        latch = ops.latch(s)
        if how == "consume(stream=)":
            await cs.consume(t, stream=s)
        else:
            cs.export(t, stream=s)
        ops.copy(s, out, cs.read_interface(arr))
        done = s.record()
    _the_next_write_waits_for_the_read(ops, t, w, latch, done, out)
    for _ in range(20):  # and it stays usable: every later use, every re-track
        with cs.track(arr).writing(p):
            ops.fill(p, arr, 3.0)
        cs.export(arr)
        await cs.consume(arr, timeout=5)
    del done
    assert _settled_in_flight(p, w) <= base


def _close_now(s: cs.Stream, how: str) -> None:
    """Close ``s`` from this thread, another thread, or a finalizer in a garbage
    collection (its listeners then run at the next library call)."""
    if how == "this thread":
        s.close()
    elif how == "another thread":
        th = threading.Thread(target=s.close)
        th.start()
        th.join(10)
    else:

        class Closer:
            def __init__(self) -> None:
                self.cycle = self

            def __del__(self) -> None:
                s.close()

        Closer()
        gc.collect()


CLOSERS = ["this thread", "another thread", "a finalizer"]


@pytest.mark.parametrize("how", CLOSERS)
def test_a_stream_closed_inside_a_writing_block_on_it_keeps_the_blocks_write(
    ops: DeviceOps, how: str
) -> None:
    """Its work still runs (CUDA's rule), so the block's exit records it as the
    stream closes: a host consume waits for the held fill and sees it."""
    arr = ops.array(np.zeros(64, "float32"))
    t = cs.track(arr)
    s = cs.Stream()
    latch = ops.latch(s)
    try:
        with t.writing(s):
            ops.fill(s, arr, 7.0)
            _close_now(s, how)
        assert s.closed
        assert t.pending_streams()["writes"], "the block's write was forgotten"
        with pytest.raises(TimeoutError):
            cs.consume_blocking(t, timeout=0.05)  # the fill is held: nothing to read yet
    finally:
        latch.release()
    view = cs.consume_blocking(t, timeout=10)
    assert (ops.to_host(view) == 7).all()


@pytest.mark.parametrize("how", CLOSERS)
@pytest.mark.parametrize("via", ["reading() block", "consume(stream=)"])
def test_a_stream_closed_with_a_read_open_on_it_is_waited_for_by_the_next_writer(
    ops: DeviceOps, how: str, via: str
) -> None:
    """Write after read: a read open on ``r`` when it closes, as a ``reading()``
    block (closed inside it) or a consumer's read that ``consume(t,
    stream=r)`` leaves to record later, is recorded as ``r`` closes (also from
    a finalizer, whose wrapper says closed before its listeners record): the
    next writer waits for it, and the array stays writable."""
    arr = ops.array(np.ones(64, "float32"))
    out = ops.array(np.zeros(64, "float32"))
    t = cs.track(arr)
    r, w = cs.Stream(), cs.Stream()
    latch = ops.latch(r)
    try:
        if via == "reading() block":
            with t.reading(r):
                ops.copy(r, out, arr)
                done = r.record()
                _close_now(r, how)
        else:
            view = cs.consume_blocking(t, stream=r)
            ops.copy(r, out, view)
            done = r.record()
            del view
            _close_now(r, how)
    except BaseException:
        latch.release()
        raise
    _the_next_write_waits_for_the_read(ops, t, w, latch, done, out)
    with t.writing(w):
        ops.fill(w, arr, 3.0)
    w.synchronize()


@pytest.mark.parametrize(
    "closed", ["stream", "stream, via a wrapper", "the wrapper", "a wrapper of stream 1"]
)
def test_inside_a_block_whose_stream_closed_the_owner_sees_the_blocks_work(
    ops: DeviceOps, closed: str
) -> None:
    """The block's own owner consumes the array inside the block, after the
    stream closed (and its handle went to a new stream), or after the borrowed
    wrapper the block was opened on was closed (which only forgets it): the
    consume orders after the block's work, never a record on the new stream,
    an error, or nothing at all."""
    arr = ops.array(np.zeros(64, "float32"))
    t = cs.track(arr)
    s = cs.Stream.wrap(1) if closed == "a wrapper of stream 1" else cs.Stream()
    on = s if closed == "stream" else cs.Stream.wrap(s)
    latch = ops.latch(s)
    again = None
    try:
        with t.writing(on):
            ops.fill(on, arr, 7.0)
            if closed in ("the wrapper", "a wrapper of stream 1"):
                on.close()
            else:
                s.close()
                again = cs.Stream()  # the simulator hands the handle out again, as CUDA does
            with pytest.raises(TimeoutError):
                cs.consume_blocking(t, timeout=0.05)  # the fill is held
    finally:
        latch.release()
    view = cs.consume_blocking(t, timeout=10)
    assert (ops.to_host(view) == 7).all()
    if again is not None:
        again.close()


class _Foreign:
    """Another library's stream object, alive whatever becomes of a wrapper."""

    def __init__(self, s: cs.Stream) -> None:
        self.s = s

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.s.handle)


def _wrapped(kind: str, s: cs.Stream) -> tuple[cs.Stream, cs.Stream]:
    """A borrowed wrapper of the kind named, and the stream it names."""
    if kind == "cs.Stream()":
        return cs.Stream.wrap(s), s
    if kind == "another library's stream":
        return cs.Stream.wrap(_Foreign(s)), s
    handle = 1 if kind == "the legacy stream" else 2
    return cs.Stream.wrap(handle), cs.Stream.wrap(handle)


WRAPPED = ["cs.Stream()", "another library's stream", "the legacy stream", "stream 2"]


@pytest.mark.parametrize("reused", [False, True], ids=["gone", "handle-reused"])
async def test_a_bare_handle_closed_and_destroyed_in_a_body_is_never_recorded_on_again(
    sim_backend: cs.Backend, reused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bare handle of another library's stream: the library cannot see its
    end, so it records there at the handoff only. Its wrapper closed and the
    stream destroyed (its handle perhaps another stream's by then) inside a
    ``consuming()`` body or a ``writing()`` block: the body's exit records
    nothing there; the block's says the stream is closed. Neither records on
    the handle (a new stream's, maybe)."""
    t = cs.track(sim.asarray(np.zeros(4)))
    records: list[int] = []
    record = sim_backend.record

    def spy(event: int, stream: int) -> None:
        records.append(stream)
        record(event, stream)

    monkeypatch.setattr(sim_backend, "record", spy)

    def gone(w: cs.Stream, h: int) -> None:
        w.close()
        sim_backend.destroy_stream(h)
        if reused:
            assert sim_backend.create_stream(0) == h
        records.clear()

    with cs.sanitize(False):  # (destroying a stream with the body's reads on it races)
        h = sim_backend.create_stream(0)
        w = cs.Stream.wrap(h)
        async with cs.consuming(t, stream=w, timeout=5):
            gone(w, h)
        assert h not in records
        h = sim_backend.create_stream(0)
        w = cs.Stream.wrap(h)
        with pytest.raises(ValueError, match="closed"), t.writing(w):
            gone(w, h)
        assert h not in records


async def test_closing_a_wrapper_of_a_library_stream_lets_the_stream_go(
    sim_backend: cs.Backend,
) -> None:
    """The library's copy of the wrapper keeps nothing alive for a stream it
    made (closing that stream records what listens first): once the wrapper
    is closed and the stream dropped, the stream is collected."""
    t = cs.track(sim.asarray(np.zeros(4)))
    owned = cs.Stream()
    ref = weakref.ref(owned)
    w = cs.Stream.wrap(owned)
    await cs.consume(t, stream=w)  # a read left open on it
    w.close()
    del w, owned
    gc.collect()
    cs.stats()
    assert ref() is None
    with t.writing(cs.Stream()):  # its read was recorded as it closed
        pass


@pytest.mark.parametrize("kind", WRAPPED)
def test_a_consumer_that_closes_its_borrowed_wrapper_leaves_the_array_writable(
    ops: DeviceOps, kind: str
) -> None:
    """``consume(t, stream=w)``, ``w`` a borrowed wrapper the consumer then
    closes (which only forgets the stream): the next writer waits for the read
    on the stream, and every later write goes through."""
    arr = ops.array(np.ones(64, "float32"))
    out = ops.array(np.zeros(64, "float32"))
    t = cs.track(arr)
    w = cs.Stream()
    on, s = _wrapped(kind, cs.Stream())
    latch = ops.latch(s)
    try:
        ops.copy(on, out, cs.consume_blocking(t, stream=on))
        done = s.record()
        on.close()
    except BaseException:
        latch.release()
        raise
    _the_next_write_waits_for_the_read(ops, t, w, latch, done, out)
    for _ in range(3):
        with t.writing(w):
            ops.fill(w, arr, 3.0)
    w.synchronize()


async def test_a_consuming_body_whose_stream_closes_in_it_is_waited_for_by_the_next_writer(
    ops: DeviceOps,
) -> None:
    """The body's read was recorded mid-body (other consumers made it the
    oldest open read past ``MAX_OPEN_READS``); then the body copies the array
    on ``s`` (held) and closes ``s``: the body's record at the close covers the
    copy, so the next writer waits for it."""
    arr = ops.array(np.ones(64, "float32"))
    out = ops.array(np.zeros(64, "float32"))
    t = cs.track(arr)
    s, w = cs.Stream(), cs.Stream()
    latch = None
    try:
        async with consuming_past_the_open_reads(t, s):
            latch = ops.latch(s)
            ops.copy(s, out, arr)
            done = s.record()
            s.close()
    except BaseException:
        if latch is not None:
            latch.release()
        raise
    assert latch is not None
    _the_next_write_waits_for_the_read(ops, t, w, latch, done, out)


@pytest.mark.parametrize("reused", [False, True], ids=["handle gone", "handle reused"])
@pytest.mark.parametrize("body", ["consuming()", "consume (the control)"])
async def test_an_untracked_consuming_body_whose_stream_closes_in_it_keeps_its_back_edge(
    sim_backend: cs.Backend, reused: bool, body: str
) -> None:
    """``consuming()`` of an untracked producer (its interface names its own
    stream ``p``): the body copies the array on ``c`` (held) and closes ``c``.
    The back-edge is made at the close, while ``c`` exists, so ``p``'s next
    write waits for the copy. It was made at the exit, on the closed handle:
    a CudaError out of ``async with``, or, when a new stream had taken the
    handle, a wait on that one, and the write overwrote what the copy was
    about to read. Control: a plain ``consume`` (no back-edge promised)."""
    ops = SimOps()
    p, c = cs.Stream(), cs.Stream()
    arr = ops.array(np.ones(64, np.float32))
    arr.stream = p.handle
    out = ops.array(np.zeros(64, np.float32))
    latch = ops.latch(c)
    taker = None
    try:
        with cs.sanitize(body == "consuming()"):  # (the control races on purpose)
            if body == "consuming()":
                async with cs.consuming(arr, stream=c, timeout=5) as view:
                    ops.copy(c, out, view)
                    done = c.record()
                    c.close()
                    taker = cs.Stream() if reused else None
            else:
                view = await cs.consume(arr, stream=c, timeout=5)
                ops.copy(c, out, view)
                done = c.record()
                c.close()
                taker = cs.Stream() if reused else None
            ops.fill(p, arr, 5.0)  # the producer's next write
            held = _held(p)
    finally:
        latch.release()
    p.synchronize()
    done.synchronize()
    if taker is not None:
        assert taker.handle == c._handle  # (the sim gives a closed handle out again)
    if body == "consuming()":
        assert held
        np.testing.assert_array_equal(_values(out), 1.0)
    else:
        assert not held
        np.testing.assert_array_equal(_values(out), 5.0)


async def test_a_consuming_body_and_a_block_inside_it_on_a_stream_that_closes_leak_nothing(
    sim_backend: cs.Backend,
) -> None:
    """The body's read is the consumer's read (its close records it); the
    block records at the close. Nothing keeps an event, and nothing still
    listens to a stream for an array that is gone."""
    s0 = cs.Stream()
    base = _settled_in_flight(s0)
    for _ in range(20):
        t = cs.track(sim.asarray(np.zeros(8, "float32")))
        s = cs.Stream()
        async with cs.consuming(t, stream=s, timeout=5):
            with t.reading(s):
                s.close()
        async with cs.consuming(t, stream=s0, timeout=5):
            with t.reading(s0):
                pass
    del t
    gc.collect()
    assert _settled_in_flight(s0) <= base
    listeners = s0._lifetime._listeners  # type: ignore[union-attr]
    assert not any(isinstance(x, PendingWork) for x in listeners), listeners


def _close_during_the_first_record_on(
    monkeypatch: pytest.MonkeyPatch, backend: cs.Backend, c: cs.Stream
) -> tuple[threading.Event, list[threading.Thread]]:
    """When the calling thread first records an event on ``c``, another thread
    closes ``c``, and the record waits (at most 0.2 s) for the close to end:
    a close that does not wait for the record destroys ``c`` under it. Returns
    the "closed" flag and the closing thread (to join)."""
    real, handle = backend.record, c.handle
    closed = threading.Event()
    closers: list[threading.Thread] = []

    def close() -> None:
        c.close()
        closed.set()

    def record(event: int, stream: int) -> None:
        if stream == handle and not closers:
            th = threading.Thread(target=close)
            closers.append(th)
            th.start()
            closed.wait(0.2)  # the close must wait for this record (its lock is held)
        real(event, stream)

    monkeypatch.setattr(backend, "record", record)
    return closed, closers


def test_a_write_records_a_consumers_read_while_another_thread_closes_its_stream(
    sim_backend: cs.Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer records the consumer's read on ``c`` while the consumer's thread
    closes ``c``: the close waits, and the write goes on. The read used to stop
    listening for the close before its record, so the close destroyed ``c``
    under it: the write raised, and every later write raised "this Stream is
    closed" (found by an unsynchronized four-thread stress)."""
    t = cs.track(sim.asarray(np.zeros(8)))
    c, w = cs.Stream(), cs.Stream()
    t.export(c)  # the consumer's read on c, recorded when something must wait for it
    closed, closers = _close_during_the_first_record_on(monkeypatch, sim_backend, c)
    with t.writing(w):
        SimOps().fill(w, t.array, 2.0)
    monkeypatch.undo()
    closers[0].join(10)
    assert closed.is_set() and c.closed
    with t.writing(w):  # and it stays usable
        SimOps().fill(w, t.array, 3.0)
    w.synchronize()
    assert (t.array.to_host() == 3.0).all()


def test_a_hold_is_recorded_while_another_thread_closes_the_consumers_stream(
    sim_backend: cs.Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A released view's hold is recorded (by a sweep in another thread) while the
    consumer closes its stream: the close waits, the hold is recorded, and the
    owner is let go once it completes. The lease used to stop listening before
    its record: the close destroyed the stream under it, and the owner was
    kept alive for good, with a warning."""
    p, c = cs.Stream(), cs.Stream()
    owner = sim.empty(64)
    owner.stream = p.handle
    gone = weakref.ref(owner)
    view = cs.consume_blocking(owner, stream=c)
    del owner, view
    gc.collect()
    closed, closers = _close_during_the_first_record_on(monkeypatch, sim_backend, c)
    with warnings.catch_warnings():
        warnings.simplefilter("error", cs.CudaWarning)
        sweeper = threading.Thread(target=table.sweep)
        sweeper.start()
        sweeper.join(10)
    monkeypatch.undo()
    assert closers, "the sweep recorded no hold on the consumer's stream"
    closers[0].join(10)
    assert closed.is_set() and c.closed
    p.synchronize()
    deadline = time.monotonic() + 5
    while gone() is not None and time.monotonic() < deadline:
        cs.stats()  # lets go of what completed: the holds, and the join's keepalive
        gc.collect()
        time.sleep(0.001)
    assert gone() is None, "the owner was kept alive"


# -- 3. concurrent consumers pin and unpin every event --------------------------------------

PATTERNS = ["gather", "consume_all(t, t)", "host consume racing an export", "threads"]


@pytest.mark.parametrize("pattern", PATTERNS)
async def test_concurrent_consumers_of_one_array_leave_no_event_pinned(
    ops: DeviceOps, pattern: str
) -> None:
    p, x = cs.Stream(), cs.Stream()
    arr = ops.array(np.zeros(16, "float32"))
    t = cs.track(arr, stream=x)
    base = _settled_in_flight(p, x)
    for i in range(100):
        with t.writing(p):
            ops.fill(p, arr, float(i), duration=0.0002)
        if pattern == "gather":
            async with anyio.create_task_group() as tg:
                tg.start_soon(cs.consume, t)
                tg.start_soon(cs.consume, t)
        elif pattern == "consume_all(t, t)":
            await cs.consume_all(t, t, timeout=5)
        elif pattern == "host consume racing an export":
            async with anyio.create_task_group() as tg:
                tg.start_soon(cs.consume, t)
                await anyio.lowlevel.checkpoint()
                t.export()
        else:

            def consumer(i: int = i) -> None:
                cs.consume_blocking(t, timeout=5)
                cs.happens_before(("consumer", i))  # the host reads end before the join

            threads = [threading.Thread(target=consumer) for _ in range(3)]
            for th in threads:
                th.start()
            for th in threads:
                th.join(10)
            cs.happens_after(("consumer", i))
        assert (ops.to_host(arr) == i).all()
    assert cs.stats()["events_pinned"] == 0
    assert _settled_in_flight(p, x) <= base + 1  # the last cycle's pending read may hold one


# -- 4. dropping the TrackedArray -------------------------------------------------------------


@pytest.mark.parametrize("declared", [True, False])
async def test_dropping_the_tracked_array_forgets_no_pending_work(
    ops: DeviceOps, declared: bool
) -> None:
    """The wrapper goes at once; the buffer's pending write does not. The
    control writes without declaring it: consume sees nothing to wait for."""
    s = cs.Stream()
    buf = ops.array(np.zeros(64, "float32"))
    latch = ops.latch(s)
    try:
        if declared:
            with cs.track(buf).writing(s):
                ops.fill(s, buf, 5.0)
            gc.collect()
            view = await _returns_only_after_release(lambda: cs.consume(buf, timeout=10), latch)
            assert (ops.to_host(view) == 5).all()
        else:
            ops.fill(s, buf, 5.0)
            with cs.sanitize(False):  # racy on purpose
                view = await cs.consume(buf, timeout=10)  # at once: nothing declared
            assert (ops.to_host(view) == 0).all()
    finally:
        latch.release()
    s.synchronize()


# -- 5. handle 2 is one stream per host thread -----------------------------------------------


def _in_thread(fn: Callable[[], Any]) -> Any:
    out: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            errors.append(exc)

    th = threading.Thread(target=run)
    th.start()
    th.join(20)
    if errors:
        raise errors[0]
    return out[0]


@pytest.mark.parametrize("declared", [True, False])
def test_a_read_on_another_threads_stream_2_waits_for_its_write(
    sim_backend: cs.Backend, declared: bool
) -> None:
    """Thread A writes on its stream 2 (held); thread B reads on its own
    stream 2 inside reading(): B waits. The control reads undeclared."""
    ops = SimOps()
    t = cs.track(sim.asarray(np.zeros(64)))
    out = sim.asarray(np.full(64, -1.0))

    def write() -> Any:
        with t.writing(2):
            latch = ops.latch(cs.Stream.wrap(2))
            ops.fill(cs.Stream.wrap(2), t.array, 7.0)
        return latch

    def read() -> cs.Event:
        mine = cs.Stream.wrap(2)
        if declared:
            with t.reading(2):
                ops.copy(mine, out, t.array)
        else:
            with cs.sanitize(False):
                ops.copy(mine, out, t.array)
        return mine.record()

    latch = _in_thread(write)
    try:
        done = _in_thread(read)
        if declared:
            assert _held(done), "B's stream 2 did not wait for A's write"
        else:
            done.synchronize()
    finally:
        latch.release()
    done.synchronize()
    assert (_values(out) == (7.0 if declared else 0.0)).all()


@pytest.mark.parametrize("declared", [True, False])
def test_a_writer_waits_for_a_consumer_on_another_threads_stream_2(
    sim_backend: cs.Backend, declared: bool
) -> None:
    """Thread A consumes onto its stream 2 and reads there (held); thread B
    then writes on its own stream 2 and must wait for A's read."""
    ops = SimOps()
    t = cs.track(sim.asarray(np.ones(64)))
    out = sim.asarray(np.full(64, -1.0))

    def consume() -> Any:
        mine = cs.Stream.wrap(2)
        latch = ops.latch(mine)
        if declared:
            view = cs.consume_blocking(t, stream=2)
            ops.copy(mine, out, view)
        else:
            with cs.sanitize(False):
                ops.copy(mine, out, t.array)
        return latch

    def write() -> cs.Event:
        with cs.sanitize(declared):
            with t.writing(2):
                ops.fill(cs.Stream.wrap(2), t.array, 9.0)
            return cs.Stream.wrap(2).record()

    latch = _in_thread(consume)
    try:
        done = _in_thread(write)
        if declared:
            assert _held(done), "B's write did not wait for A's read on A's stream 2"
        else:
            done.synchronize()
    finally:
        latch.release()
    done.synchronize()
    cs.current_backend().synchronize_stream(1)  # and A's stream 2, which it waits for
    assert (_values(out) == (1.0 if declared else 9.0)).all()


# -- 6. track() from several threads at once -------------------------------------------------


class SlowInterface:
    """Reading its interface takes a while (and lets other threads run)."""

    def __init__(self, arr: Any) -> None:
        self.arr = arr

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        time.sleep(0.002)
        return cs.read_interface(self.arr).__cuda_array_interface__


def _track_at_once(obj: object, threads: int) -> list[cs.TrackedArray]:
    start = threading.Barrier(threads)
    got: list[cs.TrackedArray] = []

    def track() -> None:
        start.wait()
        got.append(cs.track(obj))

    running = [threading.Thread(target=track) for _ in range(threads)]
    for th in running:
        th.start()
    for th in running:
        th.join(10)
    return got


def test_track_from_several_threads_at_once_gives_one_tracked_array(
    sim_backend: cs.Backend,
) -> None:
    ops = SimOps()
    for _ in range(10):
        obj = SlowInterface(sim.asarray(np.zeros(8)))
        got = _track_at_once(obj, 6)
        assert len({id(t) for t in got}) == 1, "several TrackedArrays for one object"
        # and a write through any of them is what consume waits for
        s = cs.Stream()
        latch = ops.latch(s)
        with got[-1].writing(s):
            ops.fill(s, obj.arr, 3.0)

        async def consume(obj: object = obj, latch: Any = latch) -> Any:
            return await _returns_only_after_release(lambda: cs.consume(obj), latch)

        assert (_values(anyio.run(consume)) == 3).all()


# -- 7. never block the event loop on another thread's writing() block ----------------------

BLOCK = 1.0  # how long the other thread holds its writing() block, in seconds


async def _heartbeat_during(
    awaitable: Callable[[], Awaitable[None]], stop_after: float = 0.0
) -> list[float]:
    gaps: list[float] = []
    done = anyio.Event()

    async def beat() -> None:
        last = anyio.current_time()
        while not done.is_set():
            await anyio.sleep(0.001)
            now = anyio.current_time()
            gaps.append(now - last)
            last = now

    async with anyio.create_task_group() as tg:
        tg.start_soon(beat)
        await anyio.sleep(0.01)
        try:
            await awaitable()
        finally:
            await anyio.sleep(stop_after)
            done.set()
    return gaps


def _hold_writing_block(t: cs.TrackedArray, s: cs.Stream, ops: DeviceOps) -> threading.Event:
    entered = threading.Event()

    def hold() -> None:
        with t.writing(s):
            entered.set()
            time.sleep(BLOCK)
            ops.fill(s, t.array, 8.0)

    threading.Thread(target=hold, daemon=True).start()
    assert entered.wait(10)
    return entered


async def test_consume_times_out_while_another_thread_holds_a_writing_block(
    sim_backend: cs.Backend,
) -> None:
    """``await consume(t, timeout=0.1)`` raises in about 0.1 s and the loop
    never stalls for the block's length; once the block ends, the write is seen."""
    ops = SimOps()
    t = cs.track(sim.asarray(np.zeros(64)))
    s = cs.Stream()
    _hold_writing_block(t, s, ops)
    elapsed: list[float] = []

    async def consume_with_timeout() -> None:
        start = time.perf_counter()
        with pytest.raises(TimeoutError):
            await cs.consume(t, timeout=0.1)
        elapsed.append(time.perf_counter() - start)

    gaps = await _heartbeat_during(consume_with_timeout)
    assert 0.1 <= elapsed[0] < BLOCK / 4, elapsed
    assert max(gaps) < BLOCK / 4, max(gaps)
    view = await cs.consume(t, timeout=10)  # waits (yielding) for the block, then its write
    assert (_values(view) == 8).all()


async def test_consume_control_a_blocking_wait_stalls_the_loop_for_the_block(
    sim_backend: cs.Backend,
) -> None:
    """The control: a blocking wait inside the loop (what taking a thread lock
    amounts to) stalls the heartbeat for the rest of the block."""
    ops = SimOps()
    t = cs.track(sim.asarray(np.zeros(64)))
    _hold_writing_block(t, cs.Stream(), ops)

    async def block_the_loop() -> None:
        cs.consume_blocking(t, timeout=10)

    gaps = await _heartbeat_during(block_the_loop)
    assert max(gaps) > BLOCK / 2, max(gaps)


@pytest.mark.parametrize("timeout", [math.inf, 1e300, 1e12])
def test_consume_blocking_with_an_unbounded_timeout_waits_for_another_threads_block(
    sim_backend: cs.Backend, timeout: float
) -> None:
    """A timeout past what a thread wait takes (``threading.TIMEOUT_MAX``) is
    the longest wait, not an OverflowError; the block's write is seen."""
    ops = SimOps()
    t = cs.track(sim.asarray(np.zeros(16)))
    s = cs.Stream()
    entered = threading.Event()

    def hold() -> None:
        with t.writing(s):
            entered.set()
            time.sleep(0.05)
            ops.fill(s, t.array, 3.0)

    th = threading.Thread(target=hold)
    th.start()
    try:
        assert entered.wait(10)
        view = cs.consume_blocking(t, timeout=timeout)
        assert (_values(view) == 3).all()
    finally:
        th.join(10)


async def test_a_task_waits_for_another_tasks_block_held_across_an_await(
    sim_backend: cs.Backend,
) -> None:
    """Two tasks of one loop: one holds a writing() block across an await; the
    other's consume waits for it by yielding (a synchronous call that would
    have to block the loop for it refuses instead of deadlocking)."""
    ops = SimOps()
    t = cs.track(sim.asarray(np.zeros(16)))
    s, c = cs.Stream(), cs.Stream()
    order: list[str] = []

    async def writer() -> None:
        with t.writing(s):
            order.append("entered")
            await anyio.sleep(0.05)
            ops.fill(s, t.array, 5.0)
        order.append("left")

    async def reader() -> None:
        await anyio.sleep(0.01)
        with pytest.raises(RuntimeError, match="another task of this thread"):
            with t.reading(c):
                pass
        view = await cs.consume(t, timeout=5)
        order.append("consumed")
        assert (_values(view) == 5).all()

    async with anyio.create_task_group() as tg:
        tg.start_soon(writer)
        tg.start_soon(reader)
    assert order == ["entered", "left", "consumed"]


async def test_a_consume_timing_out_on_another_tasks_block_names_a_task(
    sim_backend: cs.Backend,
) -> None:
    t = cs.track(sim.asarray(np.zeros(16)))
    s = cs.Stream()
    entered, leave = anyio.Event(), anyio.Event()

    async def writer() -> None:
        with t.writing(s):
            entered.set()
            await leave.wait()

    async with anyio.create_task_group() as tg:
        tg.start_soon(writer)
        await entered.wait()
        with pytest.raises(TimeoutError, match="another task's writing"):
            await cs.consume(t, timeout=0.02)
        leave.set()
    with writing_in_another_thread(t, s):
        with pytest.raises(TimeoutError, match="another thread's writing"):
            await cs.consume(t, timeout=0.02)


def _ones_written_on_p(ops: DeviceOps) -> tuple[cs.Stream, cs.Stream, Any, Any, cs.TrackedArray]:
    """Streams ``s`` and ``w``, a tracked buffer whose write of 1.0 is pending
    on a third stream, and an output buffer: (s, w, arr, out, t)."""
    p, s, w = cs.Stream(), cs.Stream(), cs.Stream()
    arr = ops.array(np.zeros(64, "float32"))
    out = ops.array(np.zeros(64, "float32"))
    t = cs.track(arr)
    with t.writing(p):
        ops.fill(p, arr, 1.0)
    return s, w, arr, out, t


async def _a_write_races_the_consumers_handoff(
    ops: DeviceOps, *, await_before_reading: bool
) -> tuple[bool, np.ndarray[Any, Any]]:
    """Task A hands a tracked buffer (1.0) to its stream ``s`` and copies it
    out there; task B, already waiting, refills it with 3.0 on ``w``, whose
    kernels a latch holds. B is woken as A calls ``consume``, or (with
    ``await_before_reading``) once it returned, A then awaiting before its
    copy. Returns whether B's write was made when A enqueued its copy, and
    what the copy read."""
    s, w, arr, out, t = _ones_written_on_p(ops)
    b_waits, go = anyio.Event(), anyio.Event()
    b_wrote: list[bool] = []
    wrote: list[bool] = []
    named: list[cs.HazardError] = []
    latch = ops.latch(w)

    async def consumer() -> None:
        await b_waits.wait()
        if not await_before_reading:
            go.set()
        view = await cs.consume(t, stream=s)
        if await_before_reading:
            go.set()
            await anyio.sleep(0.01)
        wrote.append(bool(b_wrote))
        try:
            ops.copy(s, out, view.with_stream(None))
        except cs.HazardError as exc:  # raised below, not in a task group's group
            named.append(exc)
            return
        if await_before_reading:  # unordered with the held write: it reads now
            s.synchronize()

    async def writer() -> None:
        b_waits.set()
        await go.wait()
        with t.writing(w):
            ops.fill(w, arr, 3.0)
        b_wrote.append(True)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(consumer)
            tg.start_soon(writer)
    finally:
        latch.release()
        for stream in (s, w):
            stream.synchronize()
    if named:
        raise named[0]
    return wrote[0], ops.to_host(out)


async def test_a_write_in_another_task_never_lands_between_a_handoff_and_its_reads(
    ops: DeviceOps,
) -> None:
    """``await consume(t, stream=s)`` returns as soon as its handoff is made: its
    cancellation point comes before. A task's write that got in during the
    call came before the handoff, and ``s`` waits for it (A reads 3.0); one
    that comes later waits for the reads A enqueued at once (A reads 1.0).
    The consume used to make its handoff and then yield: the write got in
    between, was ordered after no read of A's, and A read the stale 1.0."""
    wrote, seen = await _a_write_races_the_consumers_handoff(ops, await_before_reading=False)
    assert (seen == (3.0 if wrote else 1.0)).all(), (wrote, seen[:4])


async def test_a_consumer_that_awaits_before_reading_is_not_protected(ops: DeviceOps) -> None:
    """The control: a consumer that yields between the handoff and its reads lets
    the write in before them, unordered (docs: enqueue your reads right after
    the handoff, or inside ``consuming()``): the read misses it, and the
    sanitizer names the pair."""
    with cs.sanitize(False):
        wrote, seen = await _a_write_races_the_consumers_handoff(ops, await_before_reading=True)
    assert wrote and (seen == 1.0).all(), (wrote, seen[:4])
    with pytest.raises(cs.HazardError, match="kernel 'copy'"):
        await _a_write_races_the_consumers_handoff(ops, await_before_reading=True)


async def test_consume_all_onto_a_stream_returns_with_no_await_after_any_handoff(
    ops: DeviceOps,
) -> None:
    """``consume_all(t1, t2, stream=s)`` with ``t2`` held by another thread's
    ``writing()`` block: the call waits for it after ``t1``'s handoff, and a task
    writes ``t1`` meanwhile. The handoffs are made again after the wait, so
    ``s`` waits for that write and the copy enqueued next reads it (3.0). They
    used to be kept from before the wait: the copy was ordered after nothing
    and read the stale 1.0 while the write was held."""
    p, s, w, w2 = cs.Stream(), cs.Stream(), cs.Stream(), cs.Stream()
    t1 = cs.track(ops.array(np.zeros(64, "float32")))
    t2 = cs.track(ops.array(np.zeros(64, "float32")))
    out = ops.array(np.zeros(64, "float32"))
    with t1.writing(p):
        ops.fill(p, t1.array, 1.0)
    with writing_in_another_thread(t2, w2) as let_go:
        latch = ops.latch(w)

        async def consumer() -> None:
            views = await cs.consume_all(t1, t2, stream=s, timeout=10)
            ops.copy(s, out, views[0].with_stream(None))

        async def writer() -> None:
            await anyio.sleep(0.05)  # the consumer waits for t2's block now
            with t1.writing(w):
                ops.fill(w, t1.array, 3.0)
            let_go.set()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(consumer)
                tg.start_soon(writer)
            assert _held(s), "s did not wait for the write made during the call"
        finally:
            latch.release()
    for stream in (s, w, w2):
        stream.synchronize()
    assert (ops.to_host(out) == 3.0).all(), ops.to_host(out)[:4]


async def _a_thread_writes_while_the_consumer_awaits(
    ops: DeviceOps, *, how: str
) -> tuple[bool, np.ndarray[Any, Any]]:
    """Task A takes a tracked buffer (1.0) onto ``s`` (``consuming()`` or a plain
    ``consume``), awaits while a thread refills it with 3.0 on ``w``, then
    copies it out on ``s`` behind a latch. Returns whether the refill waited
    for the held copy, and what the copy read."""
    s, w, arr, out, t = _ones_written_on_p(ops)
    handed, refilled = threading.Event(), threading.Event()

    def writer() -> None:
        if handed.wait(10):
            with t.writing(w):
                ops.fill(w, arr, 3.0)
            refilled.set()

    th = threading.Thread(target=writer)
    th.start()
    try:
        if how == "consuming":
            async with cs.consuming(t, stream=s) as view:
                handed.set()
                await anyio.sleep(0.05)  # the thread tries to write now
                assert not refilled.is_set(), "the write did not wait for the block"
                ops.latch(s)
                ops.copy(s, out, view.with_stream(None))
        else:
            view = await cs.consume(t, stream=s)
            handed.set()
            await anyio.to_thread.run_sync(refilled.wait, 10)
            ops.latch(s)
            ops.copy(s, out, view.with_stream(None))
        th.join(10)
        held = _held(w)
    finally:
        handed.set()
        ops.release_all()
        th.join(10)
        for stream in (s, w):
            stream.synchronize()
    return held, ops.to_host(out)


async def test_a_consuming_body_holds_off_another_threads_write(ops: DeviceOps) -> None:
    """``consuming()`` is a read block: another thread's ``writing()`` waits for
    the body to end, then for the reads it enqueued, wherever they came in the
    body (after an await here)."""
    held, seen = await _a_thread_writes_while_the_consumer_awaits(ops, how="consuming")
    assert held, "the refill did not wait for the consumer's held copy"
    assert (seen == 1.0).all(), seen[:4]


async def test_a_plain_consume_then_an_await_lets_the_write_in(ops: DeviceOps) -> None:
    """The control: after a plain ``consume`` the reads count only as they are
    enqueued; the write that comes first is ordered after none of them and
    overtakes the held copy, and the sanitizer names the pair."""
    with cs.sanitize(False):
        held, seen = await _a_thread_writes_while_the_consumer_awaits(ops, how="consume")
    assert not held and (seen == 3.0).all(), (held, seen[:4])
    with pytest.raises(cs.HazardError, match="kernel 'copy'"):
        await _a_thread_writes_while_the_consumer_awaits(ops, how="consume")


async def test_a_write_the_event_loop_runs_outside_any_task_works(
    sim_backend: cs.Backend,
) -> None:
    """A ``writing()`` run by the loop itself (``anyio.from_thread.run_sync`` from a
    worker: under asyncio a callback outside every task) used to fail inside
    the library with anyio's "There is no task currently running"."""
    ops = SimOps()
    t = cs.track(sim.asarray(np.zeros(16)))
    w = cs.Stream()

    def write() -> None:
        with t.writing(w):
            ops.fill(w, t.array, 5.0)

    await anyio.to_thread.run_sync(lambda: anyio.from_thread.run_sync(write))
    view = await cs.consume(t, timeout=5)
    assert (_values(view) == 5.0).all()


async def test_a_task_that_would_block_the_loop_on_a_consuming_body_refuses(
    sim_backend: cs.Backend,
) -> None:
    """Two tasks of one loop: a ``writing()`` (synchronous) cannot wait for the
    other task's ``consuming()`` body without blocking the loop it runs in, so it
    raises; a host ``consume`` (a read) goes ahead, and the write once the body
    ended waits for the body's reads."""
    ops = SimOps()
    t = cs.track(sim.asarray(np.ones(16)))
    s, w = cs.Stream(), cs.Stream()
    out = sim.empty(16, "float64")
    latch = ops.latch(s)
    order: list[str] = []

    async def reader() -> None:
        async with cs.consuming(t, stream=s) as view:
            order.append("entered")
            await anyio.sleep(0.05)
            ops.copy(s, out, view.with_stream(None))
        order.append("left")

    async def writer() -> None:
        await anyio.sleep(0.01)
        with pytest.raises(RuntimeError, match="another task of this thread"):
            with t.writing(w):
                pass
        await cs.consume(t, timeout=5)
        order.append("consumed")

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            tg.start_soon(writer)
        with t.writing(w):
            ops.fill(w, t.array, 2.0)
        assert _held(w)
    finally:
        latch.release()
    w.synchronize()
    s.synchronize()
    assert order == ["entered", "consumed", "left"]
    assert (out.to_host() == 1.0).all()


# -- 8. timeout=0 takes data that is ready ---------------------------------------------------


@pytest.fixture
def stream_query(sim_backend: Any) -> None:
    """The simulated device answers ``query_stream`` (cudaStreamQuery), which the
    library uses to take an idle untracked producer's data without an event."""
    assert callable(getattr(sim_backend, "query_stream", None))


@pytest.mark.parametrize("ready", [True, False])
async def test_timeout_zero_takes_data_that_is_ready(stream_query: None, ready: bool) -> None:
    """An untracked producer whose work finished long ago: ``timeout=0``
    takes it every time, and spends no event. The control: work still
    pending raises TimeoutError every time."""
    ops = SimOps()
    s = cs.Stream()
    arr = sim.asarray(np.zeros(16))
    ops.fill(s, arr, 4.0)
    latch = None if ready else ops.latch(s)
    if ready:
        s.synchronize()
    arr.stream = s.handle
    try:
        before = cs.stats()["events_acquired"]
        outcomes = []
        for _ in range(50):
            try:
                await cs.consume(arr, timeout=0)
                outcomes.append("taken")
            except TimeoutError:
                outcomes.append("timeout")
        if ready:
            assert outcomes == ["taken"] * 50
            assert cs.stats()["events_acquired"] == before  # a stream query, no record
        else:
            assert outcomes == ["timeout"] * 50
    finally:
        if latch is not None:
            latch.release()
    s.synchronize()


async def test_timeout_zero_takes_a_tracked_array_whose_writes_are_done(ops: DeviceOps) -> None:
    s = cs.Stream()
    arr = ops.array(np.zeros(16, "float32"))
    t = cs.track(arr)
    with t.writing(s):
        ops.fill(s, arr, 2.0)
    s.synchronize()
    for _ in range(50):
        view = await cs.consume(t, timeout=0)
    assert (ops.to_host(view) == 2).all()


# -- 9. an export inside the writer's own writing() block -------------------------------------


@pytest.mark.parametrize("after_the_work", [True, False])
async def test_an_export_inside_ones_own_writing_block_covers_its_work(
    ops: DeviceOps, after_the_work: bool
) -> None:
    """What the block enqueued before the export is what the export covers;
    the control exports before enqueueing its write, and the consumer sees
    the old data."""
    s, x = cs.Stream(), cs.Stream()
    arr = ops.array(np.zeros(64, "float32"))
    out = ops.array(np.full(64, -1.0, "float32"))
    t = cs.track(arr)
    latch = ops.latch(s)
    later = None
    try:
        with t.writing(s):
            if after_the_work:
                ops.fill(s, arr, 3.0)
            cai = t.export(x)
            assert cai["stream"] == x.handle  # s's work so far (the held latch) is pending
            with cs.sanitize(after_the_work):  # the control races on purpose
                if not after_the_work:
                    later = ops.latch(s)  # the write comes after the export, and later still
                    ops.fill(s, arr, 3.0)
                ops.copy(x, out, cs.read_interface(arr))
        latch.release()
        x.synchronize()
    finally:
        latch.release()
        if later is not None:
            later.release()
    s.synchronize()
    assert (ops.to_host(out) == (3.0 if after_the_work else 0.0)).all()


# -- 10. consume(sync=False) names where the data will be ready ------------------------------


@pytest.mark.parametrize("follows_the_view", [True, False])
async def test_opt_out_consume_of_a_tracked_array_names_its_stream(
    ops: DeviceOps, follows_the_view: bool
) -> None:
    """sync=False waits for nothing, and the view names the stream the pending
    writes are joined onto; a consumer that follows it reads the new data,
    one that ignores it (the control) does not."""
    p, c = cs.Stream(), cs.Stream()
    arr = ops.array(np.zeros(64, "float32"))
    out = ops.array(np.full(64, -1.0, "float32"))
    t = cs.track(arr)
    latch = ops.latch(p)
    try:
        with t.writing(p):
            ops.fill(p, arr, 4.0)
        view = await cs.consume(t, sync=False)
        assert view.stream == t.export_stream.handle
        if follows_the_view:
            ops.copy(cs.Stream.wrap(view.stream), out, view.with_stream(None))
        else:
            with cs.sanitize(False):
                ops.copy(c, out, view.with_stream(None))
            c.synchronize()
    finally:
        latch.release()
    p.synchronize()
    t.export_stream.synchronize()
    assert (ops.to_host(out) == (4.0 if follows_the_view else 0.0)).all()


# -- 11. a tracked object's own interface stream --------------------------------------------


@pytest.mark.parametrize("sync", [True, False])
async def test_a_tracked_object_that_later_reports_a_stream_is_waited_for(
    ops: DeviceOps, sync: bool
) -> None:
    """Tracked while idle; later its producer enqueues work and names the
    stream in its interface: consume waits for it. The control opts out."""
    p = cs.Stream()
    arr = ops.array(np.zeros(64, "float32"))
    obj = Reporting(arr)
    t = cs.track(obj)
    latch = ops.latch(p)
    try:
        ops.fill(p, arr, 6.0)
        obj.stream = p.handle  # the producer says where its work is pending
        if sync:
            view = await _returns_only_after_release(lambda: cs.consume(t, timeout=10), latch)
            assert (ops.to_host(view) == 6).all()
        else:
            view = await cs.consume(t, sync=False)
            assert (ops.to_host(view) == 0).all()
    finally:
        latch.release()
    p.synchronize()


# -- 12. a cancelled poller task strands no waiter ---------------------------------------------


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_cancelling_the_shared_poller_task_strands_no_waiter(
    sim_backend: cs.Backend, loop: str
) -> None:
    """Shutdown code cancels every task but its own, the shared poller
    included; the consumer it awaits still wakes when the work completes."""
    if loop == "uvloop":
        pytest.importorskip("uvloop")
    ops = SimOps()
    s = cs.Stream()
    arr = sim.asarray(np.zeros(16))
    latch = ops.latch(s)
    ops.fill(s, arr, 1.0)
    arr.stream = s.handle
    cancelled: list[str] = []

    async def main() -> cs.ArrayView:
        me = asyncio.current_task()

        async def shutdown() -> None:
            await until(
                lambda: any(t.get_name() == "cai_streams poller" for t in asyncio.all_tasks())
            )
            for task in asyncio.all_tasks():
                if task is not me and task is not asyncio.current_task():
                    cancelled.append(task.get_name())
                    task.cancel()
            await asyncio.sleep(0.01)
            latch.release()

        helper = asyncio.create_task(shutdown())
        try:
            return await cs.consume(arr, timeout=3)
        finally:
            await helper

    try:
        view = anyio.run(main, backend="asyncio", backend_options={"use_uvloop": loop == "uvloop"})
    finally:
        latch.release()
    assert "cai_streams poller" in cancelled
    assert (_values(view) == 1).all()


# -- 13. disjoint writers after a whole-array write -------------------------------------------


@pytest.mark.parametrize("declared", [True, False])
def test_disjoint_writers_wait_for_an_earlier_whole_array_write(
    ops: DeviceOps, declared: bool
) -> None:
    """A memset of the whole array (held), then three writers of disjoint
    thirds that add to it: each waits for the memset. The control does the
    memset outside writing(), and the adds land first."""
    m = cs.Stream()
    writers = [cs.Stream() for _ in range(3)]
    arr = ops.array(np.full(300, 5.0, "float32"))
    t = cs.track(arr)
    latch = ops.latch(m)
    try:
        if declared:
            with t.writing(m):
                ops.fill(m, arr, 0.0)
        else:
            ops.fill(m, arr, 0.0)
        with cs.sanitize(declared):
            for i, w in enumerate(writers):
                with t.writing(w, disjoint=True):
                    ops.add(w, arr[i * 100 : (i + 1) * 100], float(i + 1))
        if not declared:
            for w in writers:
                w.synchronize()
    finally:
        latch.release()
    m.synchronize()
    for w in writers:
        w.synchronize()
    expected = np.repeat([1.0, 2.0, 3.0], 100) if declared else np.zeros(300)
    np.testing.assert_array_equal(ops.to_host(arr), expected)


def test_a_second_round_of_disjoint_writers_is_ordered_after_the_first(
    sim_backend: cs.Backend,
) -> None:
    """Disjoint writers of one round run concurrently; after a read (an
    export) the next round is a new group: its writer of a third waits for
    the previous round's writer of that third, even on another stream."""
    ops = SimOps()
    a, b, x = cs.Stream(), cs.Stream(), cs.Stream()
    arr = sim.asarray(np.zeros(30))
    t = cs.track(arr, stream=x)
    first = arr[0:10]
    latch = ops.latch(a)
    try:
        with t.writing(a, disjoint=True):
            ops.fill(a, first, 1.0)
        t.export()
        with t.writing(b, disjoint=True):  # round 2, same third, other stream
            ops.fill(b, first, 2.0)
        assert _held(b), "round 2 did not wait for round 1"
    finally:
        latch.release()
    b.synchronize()
    assert (_values(first) == 2).all()


# -- 14. one stream identity: a reused handle is another stream -------------------------------


def test_a_closed_streams_reused_handle_is_another_stream(sim_backend: cs.Backend) -> None:
    with recycled_stream_handles(sim_backend):
        s1 = cs.Stream()
        h = s1.handle
        s1.close()
        s2 = cs.Stream()
        assert s2.handle == h  # CUDA reuses it
        assert s1 != s2 and hash(s1) != hash(s2)
        assert cs.Stream.wrap(h) == s2 and cs.Stream.wrap(s2) == s2
        s2.close()
    t2 = [cs.Stream.wrap(2)]
    t2.append(_in_thread(lambda: cs.Stream.wrap(2)))
    assert t2[0] != t2[1]  # handle 2 is one stream per host thread
    assert cs.Stream.wrap(2) == t2[0]


def test_a_pending_read_on_a_closed_stream_is_waited_for_by_its_handles_successor(
    sim_backend: cs.Backend,
) -> None:
    """A consumer's stream is closed with its read held; the next stream gets
    its handle and writes: that is another stream, so it waits."""
    ops = SimOps()
    t = cs.track(sim.asarray(np.ones(64)))
    out = sim.asarray(np.full(64, -1.0))
    with recycled_stream_handles(sim_backend):
        c1 = cs.Stream()
        latch = ops.latch(c1)
        try:
            view = cs.consume_blocking(t, stream=c1)
            ops.copy(c1, out, view)
            done = c1.record()
            c1.close()
            c2 = cs.Stream()
            assert c2.handle == view.stream  # the simulator reuses it, as CUDA does
            with t.writing(c2):
                ops.fill(c2, t.array, 2.0)
            assert _held(c2), "the successor did not wait for the closed read"
        finally:
            latch.release()
        done.synchronize()
        c2.synchronize()
        c2.close()
    assert (_values(out) == 1).all()


def test_work_a_producer_names_by_bare_handle_is_recorded_at_the_handoff(
    sim_backend: cs.Backend,
) -> None:
    """track() of an object whose interface names a stream: the event is
    recorded then, not later, when the handle names another stream."""
    ops = SimOps()
    with recycled_stream_handles(sim_backend):
        p = cs.Stream()
        arr = sim.asarray(np.zeros(64))
        latch = ops.latch(p)
        ops.fill(p, arr, 5.0)
        arr.stream = p.handle
        t = cs.track(arr)
        arr.stream = None  # the producer has handed over
        p.close()
        q = cs.Stream()  # gets p's handle: idle
        assert q.handle == p._handle
        view = anyio.run(lambda: _returns_only_after_release(lambda: cs.consume(t), latch))
        assert (_values(view) == 5).all()
        q.close()


# -- 15. errors say what happened --------------------------------------------------------------


async def test_a_failed_poller_query_is_never_reported_as_success(
    sim_backend: cs.Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The poller's query raises once; the waiter asks again in its own task
    and, the work being merely pending, keeps waiting: no CudaError with code
    0. A query that keeps failing raises the driver's own error."""
    ops = SimOps()
    s = cs.Stream()
    arr = sim.asarray(np.zeros(16))
    latch = ops.latch(s)
    ops.fill(s, arr, 1.0)
    arr.stream = s.handle
    real = sim_backend.query
    failures = {"once": 0, "always": 0}
    mode = {"now": "off"}

    def query(event: int) -> bool:
        if mode["now"] == "once":
            mode["now"] = "off"
            failures["once"] += 1
            raise cs.CudaError(999, "cudaErrorTransient", "flaky query")
        if mode["now"] == "always":
            failures["always"] += 1
            raise cs.CudaError(700, "cudaErrorIllegalAddress", "the device faulted")
        return bool(real(event))

    monkeypatch.setattr(sim_backend, "query", query)

    async def flaky_then_release() -> None:
        await anyio.sleep(0.01)
        mode["now"] = "once"
        await until(lambda: mode["now"] != "once")
        await anyio.sleep(0.01)
        latch.release()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(flaky_then_release)
            view = await cs.consume(arr, timeout=5)
    finally:
        latch.release()
    assert failures["once"] == 1 and (_values(view) == 1).all()

    latch = ops.latch(s)
    try:

        async def fail_soon() -> None:
            await anyio.sleep(0.01)
            mode["now"] = "always"

        async with anyio.create_task_group() as tg:
            tg.start_soon(fail_soon)
            with pytest.raises(cs.CudaError) as info:
                await cs.consume(arr, timeout=5)
        assert (info.value.code, info.value.name) == (700, "cudaErrorIllegalAddress")
    finally:
        mode["now"] = "off"
        latch.release()
    s.synchronize()


def test_a_stream_of_another_backend_instance_is_named_so(sim_backend: cs.Backend) -> None:
    from cai_streams import _backend
    from cai_streams._backend._sim import SimBackend

    other = SimBackend(jitter=0.0)
    with _backend._lock:
        saved, _backend._current = _backend._current, other
    try:
        foreign = cs.Stream()
    finally:
        with _backend._lock:
            _backend._current = saved
    try:
        with pytest.raises(ValueError) as info:
            cs.consume_blocking(sim.empty(4), stream=foreign)
        message = str(info.value)
        assert "another 'sim' backend instance" in message
        assert "not 'sim'" not in message
    finally:
        foreign.close()
        other.close()


BIG = 1 << 64


@pytest.mark.parametrize(
    ("entry", "field"),
    [
        ({"data": (BIG, False)}, "data"),
        ({"data": (BIG + 4096, False)}, "data"),
        ({"stream": BIG}, "stream"),
        ({"stream": BIG + 7}, "stream"),
        ({"data": (BIG - 8, False), "strides": (8,)}, "strides"),
        ({"data": (8, False), "strides": (-4096,)}, "strides"),
    ],
)
def test_values_beyond_64_bits_are_refused(entry: dict[str, Any], field: str) -> None:
    cai = {"shape": (2,), "typestr": "<f8", "data": (4096, False), "version": 3} | entry

    class Exports:
        __cuda_array_interface__ = cai

    with pytest.raises(cs.InterfaceError, match=repr(field)):
        cs.read_interface(Exports())


def test_stream_handles_beyond_64_bits_are_refused() -> None:
    with pytest.raises(ValueError, match="64 bits"):
        cs.Stream.wrap(BIG)


def test_a_cyclic_mask_is_an_interface_error() -> None:
    class Masked:
        def __init__(self) -> None:
            self.mask: object = self

        @property
        def __cuda_array_interface__(self) -> dict[str, Any]:
            return {
                "shape": (2,),
                "typestr": "<f4",
                "data": (4096, False),
                "version": 3,
                "mask": self.mask,
            }

    a, b = Masked(), Masked()
    with pytest.raises(cs.InterfaceError, match="mask"):
        cs.read_interface(a)
    a.mask, b.mask = b, a
    with pytest.raises(cs.InterfaceError, match="mask"):
        cs.read_interface(a)


def test_views_can_be_weakly_referenced() -> None:
    view = cs.read_interface(sim.empty(4))
    assert weakref.ref(view)() is view


def _read_as_another_library(view: Any, of: Any) -> float:
    """What CuPy or Numba given ``view`` would see of ``of``: they take its
    interface's ``stream`` entry, synchronize that stream, and read."""
    stream = view.__cuda_array_interface__["stream"]
    cs.Stream.wrap(1 if stream is None else stream).synchronize()
    return float(_values(of)[0])


@pytest.mark.parametrize("fixed", [True, False], ids=["exported", "control"])
@pytest.mark.parametrize("where", ["another thread", "another device current"])
def test_a_views_interface_handed_on_elsewhere_names_a_stream_that_waits(
    sim_backend: cs.Backend, fixed: bool, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A view handed to a default stream (thread A's 2, device 1's 1) with a
    slow write of it there, read through its interface in another thread, or
    with device 0 current: the stream the interface names waits for that
    write (the control re-exports the bare handle, which names another
    stream there, and the other library read the old data)."""
    if not fixed:
        monkeypatch.setattr(cs.ArrayView, "_handed_on_elsewhere", lambda self, key: False)
    if where == "another device current":
        cs.set_device(1)
    x = sim.asarray(np.ones(4, np.float32), device=1 if where != "another thread" else None)
    handle = 2 if where == "another thread" else 1
    view = cs.consume_blocking(x, stream=handle)
    with cs.sanitize(False):  # (an undeclared write, as another library makes)
        sim.launch(cs.Stream.wrap(handle), lambda a: a.fill(8.0), view, duration=0.2)
    got: list[float] = []
    if where == "another thread":
        th = threading.Thread(target=lambda: got.append(_read_as_another_library(view, x)))
        th.start()
        th.join(10)
    else:
        cs.set_device(0)
        got.append(_read_as_another_library(view, x))
    time.sleep(0.25)  # (the write is done)
    assert got == ([8.0] if fixed else [1.0])


def test_a_views_interface_is_refused_once_its_stream_closed(sim_backend: cs.Backend) -> None:
    """Handed to ``s``, which was closed since (its handle given to a new
    stream): the view's interface raises ValueError, as handing it on does
    (it named the handle, now the new stream's, and another library waited
    for the wrong stream)."""
    x = sim.asarray(np.ones(4, np.float32))
    s = cs.Stream()
    view = cs.consume_blocking(x, stream=s)
    s.close()
    new = cs.Stream()
    assert new.handle == view.stream  # (the simulator recycles handles, as CUDA does)
    with pytest.raises(ValueError, match="which was closed"):
        view.__cuda_array_interface__  # noqa: B018
    assert view.with_stream(None).__cuda_array_interface__["stream"] is None
