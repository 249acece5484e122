"""Stream-ordered lifetime: ``cs.hold(owner, until=stream)`` and views handed to a stream.

Each guarantee is shown on an owner that is weakly referenced: it must be
alive while the stream has not passed the point, and gone once it has (the
control: the same owner without a hold is gone at once). Data-level proof
(the caching allocator handing a dropped owner's block out) is in
``test_conformance_lifetime.py`` and the model test.
"""

from __future__ import annotations

import functools
import gc
import random
import re
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import cai_streams as cs
from cai_streams import _capture_guard, _config, _hold, _hold_table, sim

from .device_ops import DeviceOps, Latch, SimOps
from .test_dlpack import DLPackOnly

WAIT = 10.0  # seconds: every wait here is bounded by this


class Owner:
    """An object to keep alive, weakly referenceable; says its size."""

    def __init__(self, nbytes: int | None = None) -> None:
        if nbytes is not None:
            self.nbytes = nbytes


class Announced:
    """An owner whose finalizer sets ``freed``: it says when it goes even from
    inside a garbage collection (which clears a weakref to what it frees)."""

    def __init__(self, freed: threading.Event) -> None:
        self.freed = freed

    def __del__(self) -> None:
        self.freed.set()


class Box:
    """A CAI object over a device array that can be weakly referenced; its
    interface names ``stream`` (None: nothing pending)."""

    def __init__(self, arr: Any, stream: int | None = None) -> None:
        self.arr = arr
        self.stream = stream

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        cai: dict[str, Any] = dict(self.arr.__cuda_array_interface__)
        cai["stream"] = self.stream
        return cai


def set_soon(flag: threading.Event) -> bool:
    """Whether ``flag`` is set (an owner's finalizer ran) within WAIT, calling
    ``cs.stats()`` meanwhile (it releases completed holds)."""
    deadline = time.monotonic() + WAIT
    while not flag.is_set() and time.monotonic() < deadline:
        cs.stats()
        time.sleep(0.01)
    return flag.is_set()


def released_soon(ref: weakref.ref[Any], step: Callable[[], object] = cs.stats) -> bool:
    """Whether ``ref`` dies within WAIT while ``step`` (a library call) runs."""
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        gc.collect(0)
        if ref() is None:
            return True
        step()
        time.sleep(0.0005)
    return ref() is None


def held_owner(nbytes: int | None = None) -> tuple[Owner, weakref.ref[Owner]]:
    o = Owner(nbytes)
    return o, weakref.ref(o)


def latched_view(ops: DeviceOps) -> tuple[cs.Stream, Latch, cs.ArrayView, weakref.ref[Box]]:
    """A view handed to a new stream that a latch holds; a weak reference to its owner."""
    s = cs.Stream()
    latch = ops.latch(s)
    box = Box(ops.array(np.zeros(64, np.float32)))
    return s, latch, cs.consume_blocking(box, stream=s), weakref.ref(box)


@pytest.fixture
def limits() -> Iterator[None]:
    saved = (_config.settings.hold_limit_count, _config.settings.hold_limit_bytes)
    try:
        yield
    finally:
        cs.configure(hold_limit_count=saved[0], hold_limit_bytes=saved[1])


# -- hold() -----------------------------------------------------------------------------


def test_hold_keeps_the_owner_until_the_work_enqueued_before_it_completes(
    ops: DeviceOps,
) -> None:
    s = cs.Stream()
    first = ops.latch(s)
    o, ref = held_owner()
    cs.hold(o, until=s)
    later = ops.latch(s)  # enqueued after the hold: not waited for
    control, control_ref = held_owner()
    del o, control
    cs.stats()
    assert control_ref() is None  # nothing held it
    assert ref() is not None  # s has not passed the hold
    first.release()
    assert released_soon(ref)  # while `later` still holds s
    later.release()
    s.synchronize()


def test_hold_only_enqueues_and_needs_no_event_loop(ops: DeviceOps) -> None:
    s = cs.Stream()
    latch = ops.latch(s)
    o, ref = held_owner()
    errors: list[BaseException] = []

    def hold_from_a_thread(owner: Owner) -> None:
        try:
            cs.hold(owner, until=s)
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=hold_from_a_thread, args=(o,))
    del o
    worker.start()
    worker.join(WAIT)
    assert not worker.is_alive() and not errors  # returned while s is held
    assert ref() is not None
    latch.release()
    assert released_soon(ref)


def test_hold_on_handle_2_is_the_calling_threads_per_thread_stream(ops: DeviceOps) -> None:
    entered, leave, done = threading.Event(), threading.Event(), threading.Event()
    refs: list[weakref.ref[Owner]] = []

    def thread_a() -> None:
        latch = ops.latch(cs.Stream.wrap(2))  # A's stream 2 is held
        o = Owner()
        refs.append(weakref.ref(o))
        cs.hold(o, until=2)
        del o
        entered.set()
        leave.wait(WAIT)
        latch.release()
        cs.current_backend().synchronize_stream(2)
        done.set()

    a = threading.Thread(target=thread_a)
    a.start()
    try:
        assert entered.wait(WAIT)
        mine, my_ref = held_owner()
        cs.hold(mine, until=2)  # this thread's stream 2: idle
        del mine
        assert released_soon(my_ref)
        assert refs[0]() is not None  # A's hold waits for A's stream 2
    finally:
        leave.set()
        a.join(WAIT)
    assert done.is_set()
    assert released_soon(refs[0])


class _ForeignStream:
    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def test_hold_accepts_what_stream_wrap_accepts(backend: cs.Backend) -> None:
    s = cs.Stream()
    before = cs.stats()["holds_made"]
    for until in (s, s.handle, 1, 2, _ForeignStream(s.handle), cs.Stream.wrap(s)):
        cs.hold(Owner(), until=until)
    assert cs.stats()["holds_made"] - before == 6
    s.synchronize()


def test_hold_refuses_bad_input_with_what_it_expected(backend: cs.Backend) -> None:
    s = cs.Stream()
    with pytest.raises(ValueError, match="ambiguous"):
        cs.hold(Owner(), until=0)
    with pytest.raises(TypeError, match="as a stream"):
        cs.hold(Owner(), until="stream")
    with pytest.raises(TypeError, match="object to keep alive"):
        cs.hold(None, until=s)
    with pytest.raises(TypeError):
        cs.hold(Owner(), s)  # type: ignore[call-arg]
    s.close()
    with pytest.raises(ValueError, match="closed"):
        cs.hold(Owner(), until=s)


@pytest.mark.parametrize("mode", ["blocking", "await"])
@pytest.mark.parametrize("kind", ["untracked", "tracked", "dlpack"])
@pytest.mark.parametrize("fixed", [True, False], ids=["kept", "control"])
def test_sync_false_onto_a_stream_still_keeps_the_owner(
    kind: str, fixed: bool, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``consume(x, stream=s, sync=False)``: synchronization with the producer
    is the caller's, but the view handed to ``s`` keeps its owner until ``s``
    passes a slow read of it, as with sync on (the owner was let go, and the
    next allocation took its memory under the read). Control: the opt-out
    rows as before, taking no lease."""
    from cai_streams import _consume

    cs.use_backend("sim")
    if not fixed:
        for row in (_consume._UntrackedOptOut, _consume._TrackedOptOut, _consume._DLPackOptOut):
            monkeypatch.setattr(row, "to_stream", False)
    producer, consumer = cs.Stream(), cs.Stream()
    out = sim.empty(256, "float32")
    a = sim.asarray(np.full(256, 1.0, np.float32))
    obj: Any = a
    if kind == "untracked":
        a.stream = producer.handle
    elif kind == "tracked":
        obj = cs.track(a)
        with obj.writing(producer):
            pass
    else:
        obj = DLPackOnly(a)
    with cs.sanitize(False):  # (the control frees under the read on purpose)
        if mode == "blocking":
            view = cs.consume_blocking(obj, stream=consumer, sync=False)
        else:
            view = anyio.run(functools.partial(cs.consume, obj, stream=consumer, sync=False))
        sim.launch(consumer, lambda d, v: d.__setitem__(..., v), out, view, duration=0.2)
        del view, obj, a
        gc.collect()
        for _ in range(3):
            cs.stats()
        b = sim.asarray(np.full(256, 2.0, np.float32))
        consumer.synchronize()
    assert (out.to_host() == (1.0 if fixed else 2.0)).all()
    del b


def test_hold_on_a_capturing_stream_raises_capture_error_and_the_capture_stays_valid(
    backend: cs.Backend,
) -> None:
    s = cs.Stream()
    backend.begin_capture(s.handle, "global")
    try:
        with pytest.raises(cs.CaptureError, match="capturing a graph"):
            cs.hold(Owner(), until=s)
    finally:
        graph = backend.end_capture(s.handle)  # raises if the capture was invalidated
    backend.destroy_graph(graph)


def test_hold_on_the_legacy_stream_while_a_blocking_stream_captures_raises_capture_error(
    backend: cs.Backend,
) -> None:
    """Stream 2 captures in this thread; another thread holds an owner until
    the legacy stream: CaptureError with the advice every handoff gives (it
    was the driver's bare CudaError, cudaErrorStreamCaptureImplicit), and the
    capture is still valid."""
    blocking = cs.Stream.wrap(2)
    backend.begin_capture(blocking.handle, "global")
    raised: list[BaseException] = []

    def other() -> None:
        try:
            cs.hold(Owner(), until=cs.Stream.wrap(1))
        except BaseException as exc:  # (checked below, in the test's thread)
            raised.append(exc)

    try:
        thread = threading.Thread(target=other)
        thread.start()
        thread.join(10)
    finally:
        graph = backend.end_capture(blocking.handle)  # raises if the capture was invalidated
    backend.destroy_graph(graph)
    assert len(raised) == 1 and type(raised[0]) is cs.CaptureError, raised
    assert "legacy default stream (1) cannot be used" in str(raised[0])


def test_holds_made_and_released_during_another_streams_capture_leave_it_valid(
    ops: DeviceOps, backend: cs.Backend
) -> None:
    s, c, p, x = cs.Stream(), cs.Stream(), cs.Stream(), cs.Stream()
    latch = ops.latch(p)
    # a join leaves an event in the pool that is not complete: acquiring the
    # next event queries it
    cs.export(Box(ops.array(np.zeros(4, np.float32)), stream=p.handle), stream=x)
    o, ref = held_owner()
    cs.hold(o, until=s)
    del o
    s.synchronize()  # complete, not released yet: the next call queries it
    backend.begin_capture(c.handle, "global")
    try:
        cs.hold(Owner(), until=s)  # every query in relaxed mode
        assert ref() is None
    finally:
        graph = backend.end_capture(c.handle)  # raises if the capture was invalidated
        latch.release()
    backend.destroy_graph(graph)


def test_a_hold_on_another_devices_stream_records_on_that_device(backend: cs.Backend) -> None:
    if cs.device_count() < 2:
        pytest.skip("needs two devices")
    cs.set_device(1)
    try:
        s = cs.Stream()
    finally:
        cs.set_device(0)
    o, ref = held_owner()
    cs.hold(o, until=s)  # its event is made on device 1, not this thread's device 0
    del o
    s.synchronize()
    assert released_soon(ref)


# -- when holds are released --------------------------------------------------------


def test_without_a_poller_a_completed_hold_is_released_at_the_next_library_call(
    ops: DeviceOps,
) -> None:
    s = cs.Stream()
    o, ref = held_owner()
    cs.hold(o, until=s)
    del o
    s.synchronize()
    gc.collect()
    assert ref() is not None  # complete, but nothing was called since
    cs.track(ops.array(np.zeros(4, np.float32)))
    assert ref() is None


@pytest.mark.anyio
async def test_the_shared_poller_releases_completed_holds(ops: DeviceOps) -> None:
    s, p = cs.Stream(), cs.Stream()
    s_latch, p_latch = ops.latch(s), ops.latch(p)
    producer = Box(ops.array(np.zeros(4, np.float32)), stream=p.handle)
    o, ref = held_owner()
    cs.hold(o, until=s)
    del o
    passes = cs.stats()["poll_passes"]
    async with anyio.create_task_group() as tg:
        # a consumer waiting for p keeps the poller running; nothing else calls us
        tg.start_soon(lambda: cs.consume(producer, timeout=WAIT))
        await anyio.sleep(0.002)
        assert ref() is not None
        s_latch.release()
        with anyio.fail_after(WAIT):
            while ref() is not None:  # noqa: ASYNC110 - a weakref has no event to await
                await anyio.sleep(0.0005)
        p_latch.release()
    assert cs.stats()["poll_passes"] > passes


def test_releasing_a_hold_is_no_synchronization_to_the_sanitizer(backend: cs.Backend) -> None:
    """The library seeing a hold's event complete orders nothing in the program:
    a host read that never waited for the writer is still a race, found on
    every run whatever the timing."""
    if backend.name != "sim":
        pytest.skip("simulated kernels")
    s = cs.Stream()
    a = sim.asarray(np.zeros(16, np.float32))
    sim.launch(s, np.copyto, a, np.ones(16, np.float32), writes=[a])
    o, ref = held_owner()
    cs.hold(o, until=s)
    del o
    assert released_soon(ref)  # the library saw s pass the hold
    with pytest.raises(cs.HazardError):
        a.to_host()  # the program never waited for s
    s.synchronize()
    a.to_host()  # the control: once it has, the read is ordered


# -- limits and stats --------------------------------------------------------------------


def test_past_the_count_limit_completed_holds_go_first_then_one_warning(
    ops: DeviceOps, limits: None
) -> None:
    cs.configure(hold_limit_count=10)
    held = [cs.Stream() for _ in range(8)]
    latches = [ops.latch(h) for h in held]
    for h in held:
        cs.hold(Owner(), until=h)
    idle = cs.Stream()
    cs.hold(Owner(), until=idle)
    cs.hold(Owner(), until=idle)
    idle.synchronize()
    # 10 in flight, 2 of them complete; a call's few queries go to held streams
    # first, so only the full release past the limit finds those two
    s = held[0]
    cs.hold(Owner(), until=s)  # no warning: 9 left
    try:
        cs.hold(Owner(), until=s)  # 10
        with pytest.warns(cs.HoldWarning, match=rf"11 stream-ordered holds.*{s.handle:#x}"):
            cs.hold(Owner(), until=s)
        with warnings.catch_warnings(record=True) as more:
            warnings.simplefilter("always")
            for _ in range(10):
                cs.hold(Owner(), until=s)  # never blocks, warns once
        assert not [w for w in more if issubclass(w.category, cs.HoldWarning)]
        cs.configure(hold_limit_count=8)  # a new limit warns again when passed
        with pytest.warns(cs.HoldWarning, match="limits: 8 holds"):
            cs.hold(Owner(), until=s)
        # so does setting the same limit again (the same test on another backend,
        # in one process, found no warning: the first run's setting had been used)
        cs.configure(hold_limit_count=8)
        with pytest.warns(cs.HoldWarning, match="limits: 8 holds"):
            cs.hold(Owner(), until=s)
    finally:
        for latch in latches:
            latch.release()


def test_past_the_bytes_limit_a_warning_says_how_many_bytes_are_held(
    ops: DeviceOps, limits: None
) -> None:
    cs.configure(hold_limit_count=0, hold_limit_bytes=2500)
    s = cs.Stream()
    latch = ops.latch(s)
    try:
        cs.hold(Owner(1000), until=s)
        cs.hold(Owner(1000), until=s)
        with pytest.warns(cs.HoldWarning, match="keep 3000 bytes alive"):
            cs.hold(Owner(1000), until=s)
    finally:
        latch.release()


def test_limits_come_from_the_environment_and_are_checked(
    monkeypatch: pytest.MonkeyPatch, limits: None
) -> None:
    monkeypatch.setenv("CAI_STREAMS_HOLD_LIMIT_COUNT", "7")
    monkeypatch.setenv("CAI_STREAMS_HOLD_LIMIT_BYTES", "0")
    settings = _config._Settings()
    assert (settings.hold_limit_count, settings.hold_limit_bytes) == (7, 0)
    monkeypatch.setenv("CAI_STREAMS_HOLD_LIMIT_BYTES", "lots")
    with pytest.raises(ValueError, match="CAI_STREAMS_HOLD_LIMIT_BYTES='lots'"):
        _config._Settings().hold_limit_bytes  # noqa: B018 - read when first used
    with pytest.raises(ValueError, match=">= 0"):
        cs.configure(hold_limit_count=-1)
    with pytest.raises(TypeError, match="must be an int"):
        cs.configure(hold_limit_bytes=1.5)  # type: ignore[arg-type]
    assert _config.settings.hold_limit_count != -1  # nothing was changed


def test_stats_report_holds_in_flight_and_the_bytes_they_keep(ops: DeviceOps) -> None:
    s = cs.Stream()
    latch = ops.latch(s)
    start = cs.stats()
    cs.hold(Owner(100), until=s)
    cs.hold(Owner(), until=s)  # says no size
    box = Box(ops.array(np.zeros(64, np.float32)))
    del box  # not a view: only cs.hold and handed views count
    view = cs.consume_blocking(Box(ops.array(np.zeros(64, np.float32))), stream=s)
    del view  # its hold is recorded at the next call
    mid = cs.stats()
    assert mid["holds"] - start["holds"] == 3
    assert mid["hold_bytes"] - start["hold_bytes"] == 100 + 64 * 4
    latch.release()
    s.synchronize()
    end = cs.stats()
    assert (end["holds"], end["hold_bytes"]) == (start["holds"], start["hold_bytes"])
    assert end["holds_released"] - start["holds_released"] == 3


# -- views handed to a stream ------------------------------------------------------------


def test_a_released_view_keeps_its_owner_until_the_stream_passes_what_was_enqueued(
    ops: DeviceOps,
) -> None:
    s, latch, view, ref = latched_view(ops)
    host_view = cs.consume_blocking(Box(ops.array(np.zeros(64, np.float32))))
    host_ref = weakref.ref(host_view.owner)
    del view, host_view
    cs.stats()  # the released view's hold is recorded here
    later = ops.latch(s)  # after the view's release: not waited for
    assert host_ref() is None  # a host consumer's view holds nothing once gone
    assert ref() is not None
    latch.release()
    assert released_soon(ref)
    later.release()


def test_a_loop_of_views_of_one_owner_on_one_stream_records_one_hold_and_keeps_the_owner(
    ops: DeviceOps,
) -> None:
    """Consume, drop, consume again: each released view is merged into the
    newer one (one record for all), and the owner still lives until the stream
    passes the first view's work."""
    s = cs.Stream()
    latch = ops.latch(s)  # nothing enqueued on s after it runs until it is released
    box = Box(ops.array(np.zeros(64, np.float32)))
    ref = weakref.ref(box)
    start = cs.stats()
    for _ in range(20):
        view = cs.consume_blocking(box, stream=s)
        del view
    view = cs.consume_blocking(box, stream=s)
    mid = cs.stats()  # settles every released view: each merges into the live one
    assert mid["holds_merged"] - start["holds_merged"] == 20
    assert mid["holds_made"] == start["holds_made"]
    del view, box
    end = cs.stats()  # the last view records the one hold
    assert end["holds_made"] - start["holds_made"] == 1
    assert ref() is not None
    latch.release()
    assert released_soon(ref)


def test_a_view_handed_again_and_again_to_its_stream_is_counted_once(
    ops: DeviceOps,
) -> None:
    """A view is its own parse, and ``with_stream`` of its own stream is
    itself: handed to its stream in a loop (a long-lived view, handed on
    every request), it is counted once, by one reference, until it is
    collected: neither its entry nor the lease grows with the handoffs (each
    kept one more reference for the view's life before). The owner is still
    held until the stream passes the work enqueued meanwhile; an export of it
    makes no view that joins its lease."""
    s = cs.Stream()
    box = Box(ops.array(np.zeros(64, np.float32)))
    ref = weakref.ref(box)
    view = cs.consume_blocking(box, stream=s)
    assert len(view._leases) == 1
    lease = view._leases[0].lease
    for _ in range(200):
        assert cs.consume_blocking(view, stream=s) is view
    assert len(view._leases) == 1 and view._leases[0].uses == 1
    assert len(lease.refs) == 1 and lease.views == 1
    views = lease.views
    cs.export(view)
    assert lease.views == views  # no throwaway view joined
    derived = view.with_stream(None)
    assert len(derived._leases) == 1 and lease.views == views + 1
    del derived
    cs.stats()
    cs.stats()
    assert lease.views == views
    latch = ops.latch(s)  # work enqueued while the view is in use: still pending
    assert cs.consume_blocking(view, stream=s) is view
    del view, box
    cs.stats()
    assert ref() is not None and not lease.refs
    latch.release()
    assert released_soon(ref)


@pytest.mark.anyio
async def test_a_consuming_block_on_a_view_kept_by_a_handoff_leaves_the_record_to_its_release(
    ops: DeviceOps,
) -> None:
    """A ``consuming()`` block on a view already counted until collected is
    counted on its own: its exit records nothing (the view is still in use),
    and the one record comes when the view goes, after the block's work."""
    s = cs.Stream()
    box = Box(ops.array(np.zeros(64, np.float32)))
    ref = weakref.ref(box)
    view = cs.consume_blocking(box, stream=s)
    assert len(view._leases) == 1
    lease = view._leases[0].lease
    start = cs.stats()
    async with cs.consuming(view, stream=s, timeout=5) as same:
        assert same is view and lease.views == 2
        latch = ops.latch(s)
    assert lease.views == 1 and cs.stats()["holds_made"] == start["holds_made"]
    del view, same, box
    cs.stats()
    assert cs.stats()["holds_made"] == start["holds_made"] + 1
    assert ref() is not None  # the block's work is still pending
    latch.release()
    assert released_soon(ref)


@pytest.mark.anyio
async def test_a_view_in_a_consuming_loop_keeps_only_the_entries_still_counted(
    ops: DeviceOps,
) -> None:
    """Each ``consuming(view, stream=s)`` exit records its lease, and the next
    round makes a new one: the view keeps the entries still counting it, not
    one per round (each kept its lease, and ``with_stream`` walked them all)."""
    s = cs.Stream()
    box = Box(ops.array(np.zeros(64, np.float32)))
    view = cs.consume_blocking(box, stream=s)
    for _ in range(100):
        async with cs.consuming(view, stream=s, timeout=5) as same:
            assert same is view
    assert len(view._leases) <= 2
    assert len(view.with_stream(None)._leases) <= 1


def test_views_of_one_owner_on_two_streams_or_two_owners_on_one_stream_are_not_merged(
    ops: DeviceOps,
) -> None:
    """The controls: a newer view on another stream, or of another owner, does
    not cover a released view's work; merged into it, the owner would go at
    once, while its stream is still latched."""
    s, other = cs.Stream(), cs.Stream()
    latch = ops.latch(s)
    box, mate = Box(ops.array(np.zeros(64, np.float32))), Box(ops.array(np.zeros(64, np.float32)))
    ref = weakref.ref(box)
    start = cs.stats()
    view = cs.consume_blocking(box, stream=s)
    newer = [cs.consume_blocking(box, stream=other), cs.consume_blocking(mate, stream=s)]
    del view, box
    assert cs.stats()["holds_merged"] == start["holds_merged"]  # settled with both alive
    del newer
    end = cs.stats()
    assert end["holds_made"] - start["holds_made"] == 3
    assert ref() is not None  # held by its own record on s
    latch.release()
    assert released_soon(ref)


def test_views_of_one_owner_released_from_several_threads_at_once_keep_it_until_the_stream_passes(
    ops: DeviceOps,
) -> None:
    """Four threads hand one owner to one stream and drop the views while
    each other's settle: every view is either recorded or merged, at least one
    records, and the owner outlives the latch (were two leases each to merge
    into the other, none would record and the owner would go at once)."""
    s = cs.Stream()
    latch = ops.latch(s)
    box = Box(ops.array(np.zeros(64, np.float32)))
    ref = weakref.ref(box)
    start = cs.stats()
    rounds, threads = 50, 4
    go = threading.Barrier(threads, timeout=WAIT)

    def handoffs(owner: Box) -> None:
        go.wait()
        for _ in range(rounds):
            view = cs.consume_blocking(owner, stream=s)
            del view

    workers = [threading.Thread(target=handoffs, args=(box,)) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(WAIT)
    del box
    end = cs.stats()
    made = end["holds_made"] - start["holds_made"]
    merged = end["holds_merged"] - start["holds_merged"]
    assert made + merged == rounds * threads and made >= 1, (made, merged)
    assert ref() is not None
    latch.release()
    assert released_soon(ref)


def test_a_view_joining_while_the_last_one_settles_counts_that_one_as_merged(
    ops: DeviceOps, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The settle of the last view in use asks the capture state (a driver
    call, which lets other threads run on a GPU) before it records: a view
    of the same owner and stream made in between covers it. That release was
    counted neither made nor merged (on an H100, 199 of 200 in the test above)."""
    s = cs.Stream()
    latch = ops.latch(s)
    box = Box(ops.array(np.zeros(64, np.float32)))
    later: list[cs.ArrayView] = []
    real = _hold._waits_for_capture

    def joins_meanwhile(on: Any) -> bool:
        if not later:  # another thread's handoff, here where the GIL would be let go
            later.append(cs.consume_blocking(box, stream=s))
        return real(on)

    first = cs.consume_blocking(box, stream=s)
    start = cs.stats()
    monkeypatch.setattr(_hold, "_waits_for_capture", joins_meanwhile)
    del first
    cs.stats()  # settles the released view: the new one is in use by then
    monkeypatch.undo()
    middle = cs.stats()
    assert len(later) == 1
    assert (middle["holds_made"], middle["holds_merged"]) == (
        start["holds_made"],
        start["holds_merged"] + 1,
    )
    later.clear()
    end = cs.stats()
    assert (end["holds_made"], end["holds_merged"]) == (
        start["holds_made"] + 1,
        start["holds_merged"] + 1,
    )
    latch.release()


@pytest.mark.anyio
async def test_a_consuming_exit_while_another_view_of_its_owner_is_in_use_leaves_it_to_that_view(
    ops: DeviceOps,
) -> None:
    """The block's exit records nothing while a view of the same owner on the
    same stream is still in use: that view's later record covers both, and the
    owner lives until the stream passes the work enqueued with it after the exit."""
    s = cs.Stream()
    box = Box(ops.array(np.zeros(64, np.float32)))
    ref = weakref.ref(box)
    start = cs.stats()
    other = cs.consume_blocking(box, stream=s)
    async with cs.consuming(box, stream=s) as view:
        pass
    assert cs.stats()["holds_made"] == start["holds_made"]
    latch = ops.latch(s)  # enqueued while `other` is still in use
    del view, other, box
    end = cs.stats()
    assert end["holds_made"] - start["holds_made"] == 1
    assert ref() is not None
    latch.release()
    assert released_soon(ref)


class _OwningStream:
    """Another library's stream object: its stream is destroyed with it."""

    def __init__(self, backend: cs.Backend) -> None:
        self.backend = backend
        self.handle = backend.create_stream()

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)

    def __del__(self) -> None:
        self.backend.destroy_stream(self.handle)


class _ExternalStream:
    """Another library's non-owning view of a stream handle (as
    ``torch.cuda.ExternalStream`` or cuda.core's ``Stream.from_handle``)."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


@pytest.mark.parametrize(
    "through",
    ["its handle, then the Stream", "its handle twice", "a non-owning object, then its owner"],
)
def test_a_stream_dropped_while_views_handed_through_another_object_are_in_use_records_first(
    ops: DeviceOps, through: str
) -> None:
    """Views of one owner handed to a stream through a non-owning object (the
    bare handle, another library's external stream), then through the object
    that owns the stream or the handle again; the user drops the owning
    object while a latched reader of the second view is pending. The stream
    must not be destroyed before the hold is recorded (the lease keeps every
    object views came through; a collected Stream records what listens
    first), or the record lands on the next stream given the handle, the
    owner goes, the allocator hands its block to the next array, and the
    reader copies that array's data."""
    backend = cs.current_backend()
    owning: object = _OwningStream(backend) if through.startswith("a non") else cs.Stream()
    handle = owning.handle  # type: ignore[attr-defined]
    first: object = _ExternalStream(handle) if through.startswith("a non") else handle
    second = handle if through == "its handle twice" else owning
    box = Box(ops.array(np.full(256, 1.0, np.float32)))
    ref = weakref.ref(box)
    out = ops.array(np.zeros(256, np.float32))
    views = [cs.consume_blocking(box, stream=first), cs.consume_blocking(box, stream=second)]
    s = cs.Stream.wrap(handle)  # bare: keeps nothing alive
    latch = ops.latch(s)
    ops.copy(s, out, views[1])  # enqueued while the view is in use
    copied = backend.create_event()  # (a cs.Event would keep the stream object alive)
    backend.record(copied, handle)
    del owning, first, second, s
    gc.collect()
    successor = _OwningStream(backend)  # the simulator hands a destroyed handle out again
    del views, box
    for _ in range(20):  # a hold misplaced on the idle successor completes at once
        cs.stats()
        time.sleep(0.001)
    assert ref() is not None
    other = ops.array(np.full(256, 9.0, np.float32))  # would take a freed owner's block
    latch.release()
    backend.synchronize_event(copied)
    backend.destroy_event(copied)
    assert ops.to_host(out)[0] == 1.0
    assert released_soon(ref)
    del other, successor


def test_a_new_stream_object_on_every_handoff_keeps_each_lease_bounded(ops: DeviceOps) -> None:
    """Views of one owner handed to one stream through a new object each time
    (``torch.cuda.ExternalStream(handle)`` per call, say) while earlier views
    are still in use: each lease keeps at most MAX_KEPT of the objects, a full
    one records on its own once its views go, and the owner still lives until
    the stream passes the work enqueued while any view was in use."""
    s = cs.Stream()
    latch = ops.latch(s)
    box = Box(ops.array(np.zeros(64, np.float32)))
    ref = weakref.ref(box)
    start = cs.stats()
    views = [cs.consume_blocking(box, stream=_ExternalStream(s.handle)) for _ in range(40)]
    leases = [lease for (key, owner), lease in _hold._in_use.items() if owner == id(box)]
    assert len(leases) == 1 and len(leases[0].others) <= _hold.MAX_KEPT
    del views, box
    end = cs.stats()
    made = end["holds_made"] - start["holds_made"]
    assert _hold.MAX_KEPT < 40
    assert 40 // (_hold.MAX_KEPT + 1) <= made <= 40 // _hold.MAX_KEPT + 1  # (one: unbounded)
    assert ref() is not None
    latch.release()
    assert released_soon(ref)


@pytest.mark.parametrize("seed", range(12))
def test_random_view_lifetimes_keep_each_owner_while_work_enqueued_in_its_views_use_is_pending(
    ops: DeviceOps, seed: int
) -> None:
    """A random program of handoffs of owners to one stream (at most two at a
    time, new ones made as old ones are let go), views dropped in any order,
    latches enqueued on the stream (a few at a time) and released in any
    order, views derived from views in use (``with_stream``), sweeps: the
    oracle says which owners work still pending on the stream was enqueued for
    (while a view of theirs was in use). Such an owner must be alive after
    every step; once everything is released, all are gone. (A lease that
    recorded at its first view's release, not its last, fails; so does a
    derived view that joins no lease.)"""
    rng = random.Random(seed)
    s = cs.Stream()
    owners: dict[int, Box] = {}
    refs: dict[int, weakref.ref[Box]] = {}
    views: list[tuple[int, cs.ArrayView]] = []
    #: in stream order: the latch, the owners in use when it was enqueued, and
    #: an event recorded after it (to wait until the stream has passed it)
    latches: list[tuple[Latch, set[int], cs.Event]] = []
    passed = 0  # latches the stream has passed: every one before them released
    released: set[int] = set()
    for _ in range(300):
        if len(owners) < 2:
            n = len(refs)
            owners[n] = Box(ops.array(np.zeros(16, np.float32)))
            refs[n] = weakref.ref(owners[n])
        op = rng.choice(
            ["consume"] * 3 + ["drop"] * 3 + ["latch", "release"] * 2 + ["derive", "stats"]
        )
        if op == "consume":
            i = rng.choice(sorted(owners))
            views.append((i, cs.consume_blocking(owners[i], stream=s)))
        elif op == "derive" and views:  # what one hands to CuPy (docs/interop.md)
            i, view = rng.choice(views)
            views.append((i, view.with_stream(rng.choice([None, 0x5000]))))
            del view
        elif op == "drop" and views:
            del views[rng.randrange(len(views))]
        elif op == "latch" and len(latches) - passed < 3:
            latch = ops.latch(s)
            latches.append((latch, {i for i, _ in views}, s.record()))
        elif op == "release" and len(released) < len(latches):
            held = [k for k in range(passed, len(latches)) if k not in released]
            k = held[0] if rng.random() < 0.7 else rng.choice(held)  # mostly in order
            released.add(k)
            latches[k][0].release()
            while passed in released:
                passed += 1
            if passed:
                latches[passed - 1][2].synchronize()  # the device where the oracle is
        else:
            cs.stats()
        if rng.random() < 0.1:  # let go of an owner: its views may still hold it
            del owners[rng.choice(sorted(owners))]
        needed = set().union(*(used for _, used, _ in latches[passed:]))
        gone = {i for i, r in refs.items() if r() is None}
        assert not gone & needed, (gone & needed, "freed with its work pending")
    for latch, _, _ in latches:
        latch.release()
    del views, owners
    for i, r in refs.items():
        assert released_soon(r), f"owner {i} was never let go"


@pytest.mark.anyio
async def test_consuming_exit_records_the_hold_on_a_bare_handle_too(
    ops: DeviceOps, backend: cs.Backend
) -> None:
    raw = backend.create_stream()  # another library's stream: a bare handle
    try:
        latch = ops.latch(cs.Stream.wrap(raw))
        box = Box(ops.array(np.zeros(64, np.float32)))
        ref = weakref.ref(box)
        out = ops.array(np.zeros(64, np.float32))
        async with cs.consuming(box, stream=raw) as view:
            ops.copy(cs.Stream.wrap(raw), out, view)
        del view, box
        cs.stats()
        assert ref() is not None
        # The documented rule: a bare handle's view, released later, records
        # nothing (the stream may be gone by then): its owner lives as the view.
        unheld = Box(ops.array(np.zeros(64, np.float32)))
        unheld_ref = weakref.ref(unheld)
        view = await cs.consume(unheld, stream=raw)
        del view, unheld
        cs.stats()
        assert unheld_ref() is None
        latch.release()
        assert released_soon(ref)
    finally:
        backend.synchronize_stream(raw)
        backend.destroy_stream(raw)


def test_closing_the_consumer_stream_with_the_view_alive_records_its_hold(
    ops: DeviceOps,
) -> None:
    s, latch, view, ref = latched_view(ops)
    made = cs.stats()["holds_made"]
    s.close()  # recorded now, while the stream exists
    assert cs.stats()["holds_made"] == made + 1
    del view
    cs.stats()
    assert ref() is not None
    latch.release()
    assert released_soon(ref)


def test_a_released_view_whose_stream_closes_past_a_limit_is_recorded_once(
    ops: DeviceOps, limits: None
) -> None:
    """Closing records the queued lease's hold; passing the limit then settles
    the queued leases, this one among them: it must not record twice (or wait
    for itself)."""
    cs.configure(hold_limit_count=1)
    other = cs.Stream()
    latch = ops.latch(other)
    cs.hold(Owner(), until=other)
    s = cs.Stream()
    busy = ops.latch(s)  # its hold is not complete when recorded (on a GPU the
    # consumer's wait would be done at once, and the sweep would release it)
    view = cs.consume_blocking(Box(ops.array(np.zeros(64, np.float32))), stream=s)
    made = cs.stats()["holds_made"]
    del view  # queued: nothing was called since
    with pytest.warns(cs.HoldWarning, match="2 stream-ordered holds"):
        s.close()
    assert cs.stats()["holds_made"] == made + 1
    busy.release()
    latch.release()


def test_a_hold_that_cannot_be_recorded_keeps_its_owner_for_good_and_warns(
    ops: DeviceOps, backend: cs.Backend
) -> None:
    """Another library destroys the stream its own stream object names while a
    view handed to it lives (breaking its promise): a leak, not a block reused
    under work that may still run. The simulator says the handle is gone; a
    driver need not (any call on it is undefined)."""
    if backend.name == "cuda":
        pytest.skip(
            "a destroyed stream's handle is undefined behaviour on a driver: the "
            "capture query on it crashed the process on an H100 (docs/gpu.md)"
        )
    raw = backend.create_stream()
    box = Box(ops.array(np.zeros(64, np.float32)))
    ref = weakref.ref(box)
    view = cs.consume_blocking(box, stream=_ForeignStream(raw))  # kept: recorded later
    backend.destroy_stream(raw)
    del view, box
    with pytest.warns(cs.CudaWarning, match="kept Box alive for good"):
        cs.stats()
    assert ref() is not None


def test_a_view_on_another_threads_stream_2_released_here_waits_through_the_legacy_stream(
    ops: DeviceOps,
) -> None:
    handed: list[cs.ArrayView] = []
    ready, leave = threading.Event(), threading.Event()
    boxes = [Box(ops.array(np.zeros(64, np.float32)))]
    ref = weakref.ref(boxes[0])

    def consumer() -> None:
        latch = ops.latch(cs.Stream.wrap(2))
        handed.append(cs.consume_blocking(boxes.pop(), stream=2))
        ready.set()
        leave.wait(WAIT)
        latch.release()

    a = threading.Thread(target=consumer)
    a.start()
    try:
        assert ready.wait(WAIT)
        handed.clear()  # released in this thread, which cannot name A's stream 2
        cs.stats()  # recorded now
        control, control_ref = held_owner()
        cs.hold(control, until=cs.Stream())  # an idle stream: released soon
        del control
        assert released_soon(control_ref)
        assert ref() is not None
    finally:
        leave.set()
        a.join(WAIT)
    assert released_soon(ref)


def test_a_view_released_while_its_stream_captures_is_held_until_the_capture_ends(
    ops: DeviceOps, backend: cs.Backend
) -> None:
    s = cs.Stream()
    box = Box(ops.array(np.zeros(64, np.float32)))
    ref = weakref.ref(box)
    backend.begin_capture(s.handle, "global")
    try:
        view = cs.consume_blocking(box, stream=s)
        del view, box
        cs.stats()  # cannot record on a capturing stream: the lease waits
        assert ref() is not None
    finally:
        graph = backend.end_capture(s.handle)  # raises if the capture was invalidated
    backend.destroy_graph(graph)
    assert released_soon(ref)


def test_a_view_on_another_threads_stream_2_settled_while_this_threads_stream_2_captures_waits(
    ops: DeviceOps, backend: cs.Backend
) -> None:
    """Settled here, a view handed to another thread's handle 2 records on the
    legacy stream, which any capture on a blocking stream of the device (this
    thread's handle 2) forbids: the lease waits for the capture to end, which
    stays valid, rather than fail and keep the owner for good."""
    box = Box(ops.array(np.zeros(64, np.float32)))
    ref = weakref.ref(box)
    got: list[cs.ArrayView] = []
    worker = threading.Thread(
        target=lambda b: got.append(cs.consume_blocking(b, stream=2)), args=(box,)
    )
    worker.start()
    worker.join(WAIT)
    del box
    backend.begin_capture(2, "relaxed")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "kept ... alive for good" would raise here
            got.clear()
            cs.stats()  # settles the released view: it must wait
        assert ref() is not None
    finally:
        graph = backend.end_capture(2)  # raises if the capture was invalidated
    backend.destroy_graph(graph)
    assert released_soon(ref)


def test_the_example_in_the_lifetime_docs_runs_and_shows_the_hazard() -> None:
    text = (Path(__file__).resolve().parents[1] / "docs" / "lifetime.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    example = max(blocks, key=len)
    assert "read_then_drop(keep=False) == 2.0" in example  # the control is in it
    namespace: dict[str, Any] = {}
    try:
        exec(compile(example, "docs/lifetime.md", "exec"), namespace)
    finally:
        namespace.clear()  # its functions and arrays form a cycle with it: free them now
        gc.collect()


# -- a release that meets a capture: retried, counted once, recorded ------------------------


def test_a_release_retried_after_a_capture_is_counted_once() -> None:
    """``v1``'s settle meets a capture on its stream and is retried later; ``v2``
    of the same owner joins meanwhile. The retry is covered by ``v2``'s record:
    merged. It was counted neither made nor merged (the retry lost the fact
    that it was a release)."""
    backend = cs.use_backend("sim")
    ops = SimOps()
    s = cs.Stream()
    latch = ops.latch(s)
    box = Box(ops.array(np.zeros(64, np.float32)))
    v1 = cs.consume_blocking(box, stream=s)
    start = cs.stats()
    backend.begin_capture(s.handle, "global")
    del v1
    cs.stats()  # v1's settle: the stream captures, asked again later
    v2 = cs.consume_blocking(box, stream=s)  # the same lease, during the capture
    backend.destroy_graph(backend.end_capture(s.handle))
    cs.stats()  # v1 retried: v2 is in use
    del v2
    end = cs.stats()
    made = end["holds_made"] - start["holds_made"]
    merged = end["holds_merged"] - start["holds_merged"]
    assert (made, merged) == (1, 1)
    latch.release()


@pytest.mark.anyio
async def test_a_consuming_exit_that_meets_a_capture_records_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``consuming()`` on the legacy stream: its exit asks the capture state,
    lets the view go, and asks again to record; another thread begins a capture
    on its blocking stream (handle 2) in between, which the legacy stream cannot
    record past. The record is retried once that capture ends: the owner goes
    when the stream passes it. It was kept for good, counted nowhere."""
    backend = cs.use_backend("sim")
    box = Box(SimOps().array(np.zeros(64, np.float32)))
    ref = weakref.ref(box)
    real = _hold._waits_for_capture
    asks: list[object] = []
    capturing, finish = threading.Event(), threading.Event()

    def other_thread_captures() -> None:
        backend.begin_capture(2, "relaxed")  # that thread's blocking handle 2
        capturing.set()
        finish.wait(WAIT)
        backend.destroy_graph(backend.end_capture(2))

    def begins_between(on: Any) -> bool:
        asks.append(on)
        if len(asks) == 2:  # the second ask, where a driver call lets the GIL go
            threading.Thread(target=other_thread_captures, daemon=True).start()
            assert capturing.wait(WAIT)
        return real(on)

    start = cs.stats()
    monkeypatch.setattr(_hold, "_waits_for_capture", begins_between)
    async with cs.consuming(box, stream=1) as view:
        pass
    monkeypatch.undo()
    del view, box
    finish.set()
    assert released_soon(ref)
    end, begun = cs.stats(), start["holds_made"] + start["holds_merged"]
    assert end["holds_made"] + end["holds_merged"] == begun + 1


def _a_released_views_record_taken_by_a_capture(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[cs.Backend, cs.Stream, Latch, weakref.ref[Box]]:
    """A view of a box on a latched stream, released; its settle asks whether
    the stream captures, and another thread begins a capture of it right
    after: the hold's record lands in that capture. The capture is left
    under way."""
    backend = cs.use_backend("sim")
    ops = SimOps()
    s = cs.Stream()
    latch = ops.latch(s)
    box = Box(ops.array(np.zeros(64, np.float32)))
    ref = weakref.ref(box)
    view = cs.consume_blocking(box, stream=s)
    del view, box
    real = _hold._waits_for_capture

    def then_a_capture_begins(on: Any) -> bool:
        found = real(on)
        monkeypatch.setattr(_hold, "_waits_for_capture", real)
        other = threading.Thread(target=backend.begin_capture, args=(s.handle, "relaxed"))
        other.start()
        other.join(WAIT)
        return found

    monkeypatch.setattr(_hold, "_waits_for_capture", then_a_capture_begins)
    cs.stats()
    return backend, s, latch, ref


def test_a_capture_begun_between_the_check_and_the_record_keeps_the_owner(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another thread begins a capture of the consumer's stream after the
    settle's capture check, before the hold's record: the record lands in the
    capture. The hold waits, unqueried, for the capture to end (a query would
    invalidate it), then records again: the owner lives until the stream
    passes its work. It used to be queried at once (the capture invalidated),
    taken for failed work, and let go under the held stream."""
    backend, s, latch, ref = _a_released_views_record_taken_by_a_capture(monkeypatch)
    cs.stats()
    gc.collect()
    assert ref() is not None, "let go while the latch holds the stream"
    backend.destroy_graph(backend.end_capture(s.handle))  # not invalidated
    cs.stats()
    assert ref() is not None
    latch.release()
    assert released_soon(ref)


def test_a_capture_begun_inside_the_record_keeps_the_owner(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The capture begins between the record's own capture ask and the record
    (its mark says "not captured"): the hold asks again after recording, and
    waits unqueried. It used to join the table, be queried (invalidating the
    capture) and let the owner go under the held stream."""
    backend = cs.use_backend("sim")
    ops = SimOps()
    s = cs.Stream()
    latch = ops.latch(s)
    box = Box(ops.array(np.zeros(64, np.float32)))
    ref = weakref.ref(box)
    real = _capture_guard.capturing
    asks: list[object] = []

    def then_a_capture_begins(b: cs.Backend, key: Any) -> bool | None:
        found = real(b, key)
        asks.append(key)
        if len(asks) == 1:  # the record's own ask (hold() asked the backend directly)
            other = threading.Thread(target=backend.begin_capture, args=(s.handle, "relaxed"))
            other.start()
            other.join(WAIT)
        return found

    monkeypatch.setattr(_capture_guard, "capturing", then_a_capture_begins)
    cs.hold(box, until=s)
    monkeypatch.undo()
    del box
    for _ in range(3):
        cs.stats()
    assert ref() is not None, "let go while the latch holds the stream"
    backend.destroy_graph(backend.end_capture(s.handle))  # not invalidated
    latch.release()
    assert released_soon(ref)


def test_a_hold_waiting_for_a_capture_records_before_its_stream_closes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The capture ends and the stream is closed (its work still drains) before
    the waiting hold is retried, and a new stream takes the handle: the hold
    recorded on the closing stream, not on the new one (which is idle, and
    would have let the owner go under the old stream's work)."""
    backend, s, latch, ref = _a_released_views_record_taken_by_a_capture(monkeypatch)
    cs.stats()  # asked again while the capture is under way: it waits
    backend.destroy_graph(backend.end_capture(s.handle))
    handle = s.handle
    s.close()
    successor = cs.Stream()
    assert successor.handle == handle  # the simulator reuses it at once, as CUDA may
    for _ in range(20):
        cs.stats()
        gc.collect()
    assert ref() is not None, "recorded on the successor: let go under the old work"
    latch.release()
    assert released_soon(ref)


def test_a_hold_on_another_librarys_stream_whose_record_a_capture_took_is_kept_for_good(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stream whose end the library cannot see (a bare handle): by the time the
    capture ends its handle may name another stream, so the owner is kept for
    good, with a warning, rather than let go early."""
    backend = cs.use_backend("sim")
    ops = SimOps()
    raw = backend.create_stream()
    latch = ops.latch(cs.Stream.wrap(raw))
    box = Box(ops.array(np.zeros(64, np.float32)))
    ref = weakref.ref(box)
    real = backend.capture_status

    def then_a_capture_begins(handle: int) -> Any:
        found = real(handle)
        monkeypatch.setattr(backend, "capture_status", real)
        other = threading.Thread(target=backend.begin_capture, args=(raw, "relaxed"))
        other.start()
        other.join(WAIT)
        return found

    monkeypatch.setattr(backend, "capture_status", then_a_capture_begins)
    try:
        with pytest.warns(cs.CudaWarning, match="kept Box alive for good"):
            cs.hold(box, until=raw)
        del box
        backend.destroy_graph(backend.end_capture(raw))  # not invalidated
        latch.release()
        backend.synchronize_stream(raw)
        cs.stats()
        assert ref() is not None
    finally:
        backend.destroy_stream(raw)


def test_a_finalizers_hold_whose_record_a_capture_took_waits_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``hold()`` in a garbage collection records through the backend alone; a
    capture another thread begins before that record takes it. The hold asks
    again after recording and waits, unqueried, for the capture to end: the
    capture stays valid and the owner lives until the stream passes its work.
    (The owner says when it goes: a weakref or a finalizer of an object the
    collection frees would be cleared or run even though the hold keeps it.)"""
    backend = cs.use_backend("sim")
    ops = SimOps()
    s = cs.Stream()
    latch = ops.latch(s)
    freed = threading.Event()

    class Finalized:
        def __init__(self, owner: Announced) -> None:
            self.me = self  # a cycle: only a collection frees it
            self.owner = owner

        def __del__(self) -> None:
            cs.hold(self.owner, until=s)

    owner = Announced(freed)
    Finalized(owner)
    real = backend.create_event

    def then_a_capture_begins(device: int | None = None) -> int:
        monkeypatch.setattr(backend, "create_event", real)
        other = threading.Thread(target=backend.begin_capture, args=(s.handle, "relaxed"))
        other.start()
        other.join(WAIT)
        return real(device)

    monkeypatch.setattr(backend, "create_event", then_a_capture_begins)
    gc.collect()
    del owner  # the hold keeps it now
    for _ in range(3):
        cs.stats()
    assert not freed.is_set(), "let go while the latch holds the stream"
    backend.destroy_graph(backend.end_capture(s.handle))  # not invalidated
    cs.stats()
    assert not freed.is_set()
    latch.release()
    assert set_soon(freed)


def test_passing_a_limit_releases_completed_holds_without_a_sweep(
    monkeypatch: pytest.MonkeyPatch, limits: None
) -> None:
    """A hold added past a limit releases completed holds, but runs neither
    finalizers' queued work nor the queued views' settles: its caller may
    hold a lease's lock, and a stream end that work runs takes its listeners'
    locks (two threads deadlocked so in a review)."""
    cs.use_backend("sim")
    ops = SimOps()
    cs.configure(hold_limit_count=1)
    s = cs.Stream()
    latch = ops.latch(s)

    def no_sweep() -> None:
        raise AssertionError("a sweep from inside add()")

    monkeypatch.setattr(_hold_table.table, "sweep", no_sweep)
    cs.hold(Owner(), until=s)
    with pytest.warns(cs.HoldWarning, match="2 stream-ordered holds"):
        cs.hold(Owner(), until=s)
    monkeypatch.undo()
    latch.release()


def test_a_hold_whose_record_a_brief_capture_took_is_recorded_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another thread's capture begins and ends around the hold's record: the
    record went into that capture's graph, never onto the stream, and both asks
    around it said "not capturing". The table's query says so; the hold waits
    again and records again, instead of taking the answer for failed work and
    letting the owner go under the held stream."""
    backend = cs.use_backend("sim")
    ops = SimOps()
    s = cs.Stream()
    latch = ops.latch(s)
    freed = threading.Event()
    real = backend.record

    def inside_a_brief_capture(event: int, stream: int) -> None:
        monkeypatch.setattr(backend, "record", real)
        for step in (
            lambda: backend.begin_capture(s.handle, "relaxed"),
            lambda: real(event, stream),
            lambda: backend.destroy_graph(backend.end_capture(s.handle)),
        ):
            other = threading.Thread(target=step)
            other.start()
            other.join(WAIT)

    monkeypatch.setattr(backend, "record", inside_a_brief_capture)
    cs.hold(Announced(freed), until=s)
    for _ in range(5):
        cs.stats()
    assert not freed.is_set(), "let go while the latch holds the stream"
    latch.release()
    assert set_soon(freed)


def test_owners_released_past_a_limit_go_after_the_call_not_inside_it(
    monkeypatch: pytest.MonkeyPatch, limits: None
) -> None:
    """A hold added past a limit releases the completed ones, but their owners
    go at the next library call: inside add() the caller may hold a lease's
    lock, and an owner's finalizer may call in (a review deadlocked two
    threads so)."""
    cs.use_backend("sim")
    ops = SimOps()
    idle, held = cs.Stream(), cs.Stream()
    inside: list[bool] = [False]
    seen: list[bool] = []

    class Dropped:
        def __del__(self) -> None:
            seen.append(inside[0])

    cs.hold(Dropped(), until=idle)
    idle.synchronize()
    cs.configure(hold_limit_count=1)
    latch = ops.latch(held)
    real = _hold_table.HoldTable.add

    def marked(self: Any, hold: Any, *, stacklevel: int) -> None:
        inside[0] = True
        try:
            real(self, hold, stacklevel=stacklevel + 1)
        finally:
            inside[0] = False

    monkeypatch.setattr(_hold_table.HoldTable, "add", marked)
    monkeypatch.setattr(_hold, "tick", lambda: None)  # (hold()'s own would release it first)
    cs.hold(Owner(), until=held)  # past the limit: the idle stream's hold is released
    monkeypatch.undo()
    cs.stats()
    assert seen == [False]
    latch.release()


@pytest.mark.parametrize("fixed", [True, False], ids=["record order", "control"])
def test_a_hold_recorded_earlier_and_added_later_keeps_the_table_in_record_order(
    fixed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Thread T2 records a hold on a shared stream and is preempted before the
    hold joins the table (forced here, between its record and its add);
    meanwhile the main thread records a later hold there, over an owner a late
    kernel reads, and adds it first. Once T2's record is found complete, the
    hold after it in record order is not released with it: the owner's block
    is not handed to the next allocation under the late kernel (the control
    appends, and the late kernel reads another owner's data)."""
    cs.use_backend("sim")
    if not fixed:
        monkeypatch.setattr(_hold_table, "_in_record_order", lambda queue, hold: queue.append(hold))
    backend = cs.current_backend()
    s = cs.Stream()
    n = 256
    paused, resume = threading.Event(), threading.Event()
    recorded = threading.Event()
    real_record, real_status = backend.record, backend.capture_status

    def record(event: int, stream: int) -> None:
        real_record(event, stream)
        if threading.current_thread().name == "T2":
            recorded.set()

    def capture_status(stream: int) -> str:  # (asked between T2's record and its add)
        if threading.current_thread().name == "T2" and recorded.is_set() and not paused.is_set():
            paused.set()
            resume.wait(WAIT)
        return real_status(stream)

    monkeypatch.setattr(backend, "record", record)
    monkeypatch.setattr(backend, "capture_status", capture_status)
    sim.launch(s, time.sleep, 0.2)  # the first hold stays pending a little while
    cs.hold(sim.empty(n), until=s)
    t2 = threading.Thread(target=cs.hold, args=(sim.empty(n),), kwargs={"until": s}, name="T2")
    t2.start()
    assert paused.wait(WAIT)  # T2's hold: recorded, not in the table yet
    gate, seen = threading.Event(), []
    sim.launch(s, gate.wait, WAIT)  # s is busy from here
    c = sim.asarray(np.full(n, 7.0, np.float32))
    sim.launch(s, lambda x: seen.append(float(x[0])), c)  # a late kernel reads c
    cs.hold(c, until=s)  # recorded after T2's, added before it
    resume.set()
    t2.join(WAIT)
    monkeypatch.undo()
    del c
    gc.collect()
    time.sleep(0.4)  # the first two records are complete
    cs.stats()  # releases the completed holds
    junk = [sim.asarray(np.full(n, 99.0, np.float32)) for _ in range(3)]
    gate.set()
    s.synchronize()
    assert seen == ([7.0] if fixed else [99.0])
    del junk
