"""Another library's stream, destroyed while its work runs, and its handle
handed to a new stream (CUDA recycles handles at once, as the simulator does).

The library cannot tell the two streams apart: a bare handle (or a wrapper
the user lets go) has one identity for both. So nothing is inferred from the
order of their records (``_identity.order_known``): a hold or a waiter on the
new stream found complete says nothing of one on the old stream, and a
consumer on the new stream waits for a write on the old one. Each test proves
it with data (a slow kernel on the old stream, still running), beside a
control that infers as before (``order_known`` always True) and reads wrong
data.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio
import numpy as np
import pytest

import cai_streams as cs
from cai_streams import _hold_table, _pending, _poller, sim

from .device_ops import SimOps

N = 256
SLOW = 0.3  # seconds the old stream's kernel runs after its handle was reused


@pytest.fixture(autouse=True)
def _sim() -> Iterator[None]:
    cs.use_backend("sim")
    with cs.sanitize(False):  # (the controls race on purpose)
        yield


def _reused(backend: cs.Backend, old: int) -> int:
    """A new stream given ``old``'s handle, which was just destroyed."""
    new = backend.create_stream()
    assert new == old, "the simulator recycles a destroyed stream's handle"
    return new


def _copy(dst: Any, src: Any) -> None:
    dst[...] = src


def _as_before(monkeypatch: pytest.MonkeyPatch, *modules: Any) -> None:
    for module in modules:
        monkeypatch.setattr(module, "order_known", lambda key: True)


@pytest.mark.parametrize("fixed", [True, False], ids=["own query", "control"])
def test_a_hold_on_a_reused_handle_is_released_by_its_own_query(
    fixed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An owner held until the old stream passes a slow read; a hold on the
    new stream completes at once. The first is not released with it: its
    memory is not handed to the next allocation under the read."""
    if not fixed:
        _as_before(monkeypatch, _hold_table)
    backend = cs.current_backend()
    out = sim.empty(N, "float32")
    x = backend.create_stream()
    sim.launch(x, lambda: None, duration=0.05)
    cs.hold(object(), until=x)  # (done soon: the probe that doubles its step)
    a = sim.asarray(np.full(N, 1.0, np.float32))
    sim.launch(x, _copy, out, a, duration=SLOW)
    cs.hold(a, until=x)
    del a
    backend.destroy_stream(x)  # (its work still runs)
    y = _reused(backend, x)
    cs.hold(object(), until=y)  # complete at once
    time.sleep(0.1)
    cs.stats()  # releases every completed hold
    gc.collect()
    b = sim.asarray(np.full(N, 2.0, np.float32))  # (the block a's release would free)
    time.sleep(SLOW)
    backend.synchronize_stream(y)
    time.sleep(0.05)
    assert (out.to_host() == (1.0 if fixed else 2.0)).all()
    del b
    backend.destroy_stream(y)


@pytest.mark.parametrize("fixed", [True, False], ids=["waited", "control"])
def test_a_write_on_a_destroyed_handle_is_waited_for_by_its_new_stream(
    fixed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tracked array written on the old stream (slow); a consumer on the new
    stream, which has its handle, waits for that write."""
    if not fixed:
        _as_before(monkeypatch, _pending)
    backend = cs.current_backend()
    a = sim.asarray(np.zeros(N, np.float32))
    out = sim.empty(N, "float32")
    t = cs.track(a)
    x = backend.create_stream()
    with t.writing(x):
        sim.launch(x, lambda d: d.fill(7.0), a, writes=[a], duration=SLOW)
    backend.destroy_stream(x)
    y = _reused(backend, x)
    view = cs.consume_blocking(t, stream=y)
    sim.launch(y, _copy, out, view)
    backend.synchronize_stream(y)
    assert (out.to_host() == (7.0 if fixed else 0.0)).all()
    time.sleep(SLOW)  # (the old stream's write ends before the next test)
    del view
    backend.destroy_stream(y)


@pytest.mark.parametrize("fixed", [True, False], ids=["own bell", "control"])
def test_a_bell_on_a_reused_handle_wakes_only_its_own_waiter(
    fixed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two waiters on events of one handle: the old stream's (held by a latch)
    and the new stream's (a short kernel), which is waited on first, so its
    bell is armed, and rings first. It wakes its own waiter only: the old
    event's waiter was woken with it, its event not done."""
    if not fixed:
        _as_before(monkeypatch, _poller)
    backend = cs.current_backend()
    ops = SimOps()
    x = backend.create_stream()
    latch = ops.latch(cs.Stream.wrap(x))
    old = cs.Stream.wrap(x).record()
    backend.destroy_stream(x)
    y = _reused(backend, x)
    sim.launch(y, lambda: None, duration=0.1)
    new = cs.Stream.wrap(y).record()
    woke: list[tuple[str, bool]] = []

    async def wait(name: str, event: cs.Event) -> None:
        await event.wait(timeout=10)
        woke.append((name, old.is_done))

    async def main() -> None:
        previous = _poller.poll_policy()
        cs.configure(poll=cs.PollPolicy(wake="doorbell"))
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(wait, "new", new)
                await anyio.sleep(0.02)  # (its bell is armed: the stream's oldest waiter)
                tg.start_soon(wait, "old", old)
                await anyio.sleep(0.3)  # the new event's bell rang
                seen = list(woke)
                latch.release()
        finally:
            cs.configure(poll=previous)
        if fixed:
            assert seen == [("new", False)]
        else:
            assert ("old", False) in seen  # woken before its event was done

    try:
        anyio.run(main)
    finally:
        latch.release()
        backend.synchronize_stream(y)
        backend.destroy_stream(y)


class _CupyLike:
    """Another library's stream object: it owns its handle while it lives."""

    def __init__(self, backend: cs.Backend) -> None:
        self.ptr = backend.create_stream()

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


@pytest.mark.parametrize("call", ["writing", "export"])
@pytest.mark.parametrize("kind", ["bare handle", "object"])
def test_a_capture_on_another_librarys_stream_waits_for_nothing_of_its_own(
    kind: str, call: str
) -> None:
    """A tracked array's write still running on another library's stream,
    then a capture on that stream writes or exports the array: no wait for the
    stream's own write (a wait on work outside the capture is refused: it
    raised CaptureError), and the capture stays valid."""
    backend = cs.current_backend()
    s = cs.Stream.wrap(backend.create_stream() if kind == "bare handle" else _CupyLike(backend))
    x = sim.asarray(np.zeros(16, np.float32))
    t = cs.track(x)
    with t.writing(s):
        sim.launch(s, lambda: None, duration=0.2)
    s.begin_capture("relaxed")
    try:
        if call == "writing":
            with t.writing(s):
                sim.launch(s, lambda: None)
        else:
            cs.export(t, stream=s)
    finally:
        s.end_capture().close()  # (raises if the capture was invalidated)
    s.synchronize()


@pytest.mark.parametrize("second", ["reading", "consuming"])
@pytest.mark.parametrize("fixed", [True, False], ids=["both kept", "control"])
def test_a_read_on_the_new_stream_does_not_replace_the_old_streams_read(
    fixed: bool, second: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slow read on the old stream, then a read on the new stream (its
    handle): the next writer waits for both (the new one replaced the old in
    the array's list, and the write overwrote the data under the old read)."""
    if not fixed:
        _as_before(monkeypatch, _pending)
    backend = cs.current_backend()
    a = sim.asarray(np.zeros(N, np.float32))
    t = cs.track(a)
    out = sim.asarray(np.full(N, -1.0, np.float32))
    x = backend.create_stream()
    with t.reading(x):
        sim.launch(x, _copy, out, a, reads=[a], writes=[out], duration=SLOW)
    backend.destroy_stream(x)
    y = _reused(backend, x)
    if second == "reading":
        with t.reading(y):
            pass
    else:

        async def body() -> None:
            async with cs.consuming(t, stream=y, timeout=5):
                pass

        anyio.run(body)
    w = cs.Stream()
    with t.writing(w):
        sim.launch(w, lambda d: d.fill(100.0), a, writes=[a])
    w.synchronize()
    time.sleep(SLOW)
    assert (out.to_host() == (0.0 if fixed else 100.0)).all()
    backend.destroy_stream(y)


@pytest.mark.parametrize("fixed", [True, False], ids=["both kept", "control"])
def test_a_disjoint_write_on_the_new_stream_does_not_replace_the_old_streams(
    fixed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Disjoint writes of two halves, the first slow on the old stream, the
    second on the new one: a consumer waits for both halves."""
    if not fixed:
        _as_before(monkeypatch, _pending)
    backend = cs.current_backend()
    a = sim.asarray(np.zeros(N, np.float32))
    t = cs.track(a)
    low, high = a[: N // 2], a[N // 2 :]
    x = backend.create_stream()
    with t.writing(x, disjoint=True):
        sim.launch(x, lambda d: d.fill(1.0), low, writes=[low], duration=SLOW)
    backend.destroy_stream(x)
    y = _reused(backend, x)
    with t.writing(y, disjoint=True):
        sim.launch(y, lambda d: d.fill(2.0), high, writes=[high])
    out = sim.asarray(np.full(N, -1.0, np.float32))
    c = cs.Stream()
    view = cs.consume_blocking(t, stream=c, timeout=5)
    sim.launch(c, _copy, out, view, reads=[view], writes=[out])
    c.synchronize()
    got = out.to_host()
    time.sleep(SLOW)
    assert (got[N // 2 :] == 2.0).all()
    assert (got[: N // 2] == (1.0 if fixed else 0.0)).all(), got
    del view
    backend.destroy_stream(y)


def test_reads_on_one_busy_bare_handle_stay_one() -> None:
    """Reads and disjoint writes handed again and again to another library's
    stream that is held busy: each new one makes the stream wait for the one
    before and takes its place, so the lists stay at one each (every one was
    kept, and each handoff queried them all: quadratic)."""
    backend = cs.current_backend()
    t = cs.track(sim.asarray(np.zeros(16, np.float32)))
    x = backend.create_stream()
    latch = SimOps().latch(cs.Stream.wrap(x))
    try:
        for _ in range(100):  # (each leaves an event pending: the pool keeps 1,024 free)
            cs.consume_blocking(t, stream=x)
        assert len(t._work.reads) == 1
        for _ in range(100):
            with t.writing(x, disjoint=True):
                pass
        assert len(t._work.writes) == 1
    finally:
        latch.release()
    backend.synchronize_stream(x)
    backend.destroy_stream(x)


def test_reads_on_one_bare_handle_do_not_pile_up() -> None:
    """Reads on another library's stream are each kept until seen complete
    (a newer one on the same handle may be another stream's), not for good:
    each new one drops a few seen complete, so three thousand blocks keep
    about as many as the stream has not run yet (all were kept, each with
    its event), not three thousand."""
    backend = cs.current_backend()
    t = cs.track(sim.empty(16))
    x = backend.create_stream()
    for _ in range(3):
        for _ in range(1000):
            with t.reading(x):
                pass
        assert len(t._work.reads) < 250, len(t._work.reads)
    backend.synchronize_stream(x)
    backend.destroy_stream(x)


@pytest.mark.parametrize("step", ["destroyed", "reused", "capturing"])
def test_a_merge_enqueues_nothing_on_the_other_librarys_stream(
    step: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other library, in its own thread, destroys its stream (and maybe
    makes a new one with the handle) or begins a capture on it between a
    handoff's record there and the merge of that record with an older one
    (made deterministic: right after the record). The merge enqueues nothing
    there: the handoff succeeds, the capture stays valid, and the next
    consumer still waits for the write on the old stream (the merge recorded
    again on the handle: a CudaError, a capture invalidated, or a record on
    the new stream in place of the write's)."""
    from cai_streams._access import Access

    backend = cs.current_backend()
    arr = sim.asarray(np.zeros(N, np.float32))
    t = cs.track(arr)
    h = backend.create_stream()
    view = cs.consume_blocking(t, stream=h)  # (a view whose stream is h)
    other = cs.Stream()
    sim.launch(h, lambda: None, duration=0.1)
    cs.consume_blocking(view, stream=other)  # (a write noted on h, pending)
    sim.launch(h, lambda a: a.fill(7.0), arr, writes=[arr], duration=SLOW)
    real = Access.recorded
    new = 0

    def recorded(*args: Any, **kwargs: Any) -> Any:
        nonlocal new
        access = real(*args, **kwargs)
        if step == "capturing":
            backend.begin_capture(h, "relaxed")
        else:
            backend.destroy_stream(h)
            if step == "reused":
                new = backend.create_stream()
                assert new == h
        return access

    monkeypatch.setattr(Access, "recorded", recorded)
    cs.consume_blocking(view, stream=other)  # (notes h again: merged with the first)
    monkeypatch.setattr(Access, "recorded", real)
    out = sim.asarray(np.zeros(N, np.float32))
    got = cs.consume_blocking(t, stream=other)
    sim.launch(other, _copy, out, got, reads=[got], writes=[out])
    other.synchronize()
    assert (out.to_host() == 7.0).all()
    if step == "capturing":
        assert backend.capture_status(h) == "active"
        backend.destroy_graph(backend.end_capture(h))
        backend.synchronize_stream(h)
        backend.destroy_stream(h)
    elif step == "reused":
        backend.destroy_stream(new)
    time.sleep(SLOW)


def test_merges_use_streams_of_the_arrays_backend_whichever_is_current() -> None:
    """Reads merged on 33 busy streams of another library, five rounds, while
    another backend is current for some: the merges' streams are made on the
    array's backend (made on the current one, the merge raised and the
    block's read was lost), at most ``MAX_SPARES`` are kept for the next, and
    a writer after them still waits for the last reads."""
    from cai_streams import _scheduler

    backend = cs.current_backend()
    a = sim.asarray(np.full(N, 5.0, np.float32))
    t = cs.track(a)
    out = sim.asarray(np.zeros(N, np.float32))
    handles = [backend.create_stream() for _ in range(33)]
    for h in handles:
        sim.launch(h, lambda: None, duration=0.2)
    made: list[int] = []
    real = type(backend).create_stream

    def create_stream(self: Any, *args: Any) -> int:
        made.append(real(self, *args))
        return made[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(backend), "create_stream", create_stream)
        for round_ in range(5):
            for h in handles:
                if round_ == 4:
                    cs.use_backend("decoy")
                try:
                    with t.reading(h):
                        if h == handles[-1] and round_ == 4:
                            sim.launch(h, _copy, out, a, reads=[a], writes=[out], duration=0.1)
                finally:
                    cs.use_backend("sim")
    assert made  # (on the simulator: a merge on the decoy backend raises)
    assert len(_scheduler.scheduler_for(backend)._merges) <= _scheduler.MAX_SPARES
    w = cs.Stream()
    with t.writing(w):
        sim.launch(w, lambda d: d.fill(-1.0), a, writes=[a])
    w.synchronize()
    for h in handles:
        backend.synchronize_stream(h)
        backend.destroy_stream(h)
    assert (out.to_host() == 5.0).all()


def _one_merge_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every merge on one shared stream, as a slot per handle did (the driver's
    and the simulator's handles are aligned: all had one slot)."""
    from cai_streams import _scheduler

    shared: list[cs.Stream] = []

    def merging(self: Any) -> cs.Stream:
        if not shared:
            shared.append(cs.Stream._on(self.backend, self.device))
        return shared[0]

    monkeypatch.setattr(_scheduler.Scheduler, "merging", merging)
    monkeypatch.setattr(_scheduler.Scheduler, "merged", lambda self, s: None)


@pytest.mark.parametrize("fixed", [True, False], ids=["own stream", "control"])
def test_a_busy_stream_holds_up_no_merge_of_another_handle(
    fixed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reads of one array merged on another library's stream that is held
    busy, then writes of a second array merged on another such stream: a host
    consume of the second waits for its own writes alone (the control merges
    every handle on one shared stream, as a slot per handle did, since the
    simulator's and the driver's handles are aligned: the second array's
    merge queued behind the first's waits, and the consume timed out)."""
    if not fixed:
        _one_merge_stream(monkeypatch)
    backend = cs.current_backend()
    a, b = backend.create_stream(), backend.create_stream()
    latch = SimOps().latch(cs.Stream.wrap(a))
    try:
        x = cs.track(sim.asarray(np.zeros(16, np.float32)))
        for _ in range(2):  # two reads of x pending on a: merged
            with x.reading(a):
                pass
        y = cs.track(sim.asarray(np.zeros(16, np.float32)))
        for v in (1.0, 2.0):  # two writes of y on b, the first still running: merged
            with y.writing(b, disjoint=True):
                sim.launch(b, lambda d, v=v: d.fill(v), y.array, writes=[y.array], duration=0.1)
        backend.synchronize_stream(b)
        if fixed:
            cs.consume_blocking(y, timeout=5)
            assert (y.array.to_host() == 2.0).all()
        else:
            with pytest.raises(TimeoutError):
                cs.consume_blocking(y, timeout=0.3)
    finally:
        latch.release()
    for h in (a, b):
        backend.synchronize_stream(h)
        backend.destroy_stream(h)


@pytest.mark.parametrize("fixed", [True, False], ids=["asked again", "control"])
def test_a_capture_begun_before_the_newer_record_keeps_the_merge_out_of_it(
    fixed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another thread begins a capture on another library's stream between
    the library's ask and its record there (forced here): the record lands in
    the capture. The merge asks again and is not made, so no stream of the
    library's joins that capture: a merge of another array on another stream
    meanwhile leaves it valid (the control merges: the merge stream joins the
    capture, and the next merge's wait on an ordinary event invalidates it)."""
    from cai_streams import _capture_guard, _events

    if not fixed:
        real = _capture_guard

        class _Unasked:
            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

            @staticmethod
            def capturing(backend: Any, key: Any) -> bool | None:
                return False if key.handle == h else real.capturing(backend, key)

        monkeypatch.setattr(_pending, "_capture_guard", _Unasked())
        _one_merge_stream(monkeypatch)
    backend = cs.current_backend()
    h, k = backend.create_stream(), backend.create_stream()
    t = cs.track(sim.asarray(np.full(N, 5.0, np.float32)))
    with t.reading(h):  # a read still running on h
        sim.launch(h, lambda: None, duration=SLOW)
    record_asked = _events.record_asked
    armed = [True]

    def begin_in_the_window(backend: Any, event: int, key: Any, state: Any) -> Any:
        if armed[0] and key.handle == h:
            armed[0] = False
            backend.begin_capture(h, "relaxed")  # (another thread's, in the window)
        return record_asked(backend, event, key, state)

    monkeypatch.setattr(_events, "record_asked", begin_in_the_window)
    cs.consume_blocking(t, stream=h)  # its read is recorded at once: in the capture
    monkeypatch.setattr(_events, "record_asked", record_asked)
    u = cs.track(sim.asarray(np.zeros(16, np.float32)))
    sim.launch(k, lambda: None, duration=SLOW)
    for _ in range(2):  # another array's merge on another stream, meanwhile
        with u.reading(k):
            pass
    status = backend.capture_status(h)
    try:
        backend.destroy_graph(backend.end_capture(h))
    except cs.CudaError:  # (the control's: the capture is invalidated)
        assert not fixed
    if fixed:
        assert status == "active"
        assert len(t._work.reads) == 2  # (both kept: nothing merged)
    else:
        assert status == "invalidated"
    for x in (h, k):
        backend.synchronize_stream(x)
    del t  # (its read in the ended capture: never queried)
    gc.collect()
    for x in (h, k):
        backend.destroy_stream(x)


@pytest.mark.parametrize("fixed", [True, False], ids=["covered", "control"])
def test_reads_on_a_capturing_bare_handle_stay_one(
    fixed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reads handed again and again to another library's stream while it
    captures: each capture record covers the one before (one capture is under
    way on a handle at a time), so the list stays at one (the control keeps
    every one, each with its event, and each handoff walks them all)."""
    if not fixed:
        covers = _pending.PendingWork._covers_foreign

        def kept(self: Any, new: Any, old: Any) -> bool:
            return False if new.captured else covers(self, new, old)

        monkeypatch.setattr(_pending.PendingWork, "_covers_foreign", kept)
    backend = cs.current_backend()
    h = backend.create_stream()
    t = cs.track(sim.asarray(np.zeros(16, np.float32)))
    backend.begin_capture(h, "relaxed")
    try:
        for _ in range(50):
            with t.reading(h):
                pass
        assert len(t._work.reads) == (1 if fixed else 50)
    finally:
        backend.destroy_graph(backend.end_capture(h))
    backend.destroy_stream(h)


def test_a_merge_whose_stream_cannot_be_made_keeps_both(monkeypatch: pytest.MonkeyPatch) -> None:
    """No merge stream is idle and making one fails (out of memory): both
    writes on another library's stream are kept, and a host consume waits for
    the newer (the block's exit raised, its write was lost, and the host read
    the older one's data)."""
    from cai_streams import _scheduler

    monkeypatch.setattr(_scheduler.Scheduler, "merging", _no_stream)
    backend = cs.current_backend()
    h = backend.create_stream()
    x = cs.track(sim.asarray(np.zeros(16, np.float32)))
    for v in (1.0, 2.0):  # two writes on h, the first still running: merged
        with x.writing(h, disjoint=True):
            sim.launch(h, lambda d, v=v: d.fill(v), x.array, writes=[x.array], duration=0.2)
    assert len(x._work.writes) == 2
    cs.consume_blocking(x, timeout=5)
    assert x.array.to_host()[0] == 2.0
    backend.synchronize_stream(h)
    backend.destroy_stream(h)


def _no_stream(self: Any) -> cs.Stream:
    raise cs.CudaError(2, "cudaErrorMemoryAllocation", "out of memory (injected)")


def test_merges_on_busy_streams_keep_their_spares_instead_of_making_one_each() -> None:
    """Reads merged on 16 streams of another library, kept busy by slow work,
    three rounds: the second and third merge each read with the one before
    on a stream of the library's that must be idle (it then waits for both),
    32 in all, as many as ``MAX_SPARES`` keeps: none is closed (with eight
    kept, 24 of them were, each made for one merge)."""
    from cai_streams import _scheduler

    backend = cs.current_backend()
    t = cs.track(sim.asarray(np.full(N, 5.0, np.float32)))
    handles = [backend.create_stream() for _ in range(16)]
    gate = threading.Event()
    for h in handles:
        sim.launch(h, lambda: gate.wait(20))
    made: list[int] = []
    destroyed: list[int] = []
    create, destroy = type(backend).create_stream, type(backend).destroy_stream

    def counted_create(self: Any, *args: Any) -> int:
        made.append(create(self, *args))
        return made[-1]

    def counted_destroy(self: Any, handle: int) -> None:
        destroyed.append(handle)
        destroy(self, handle)

    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(type(backend), "create_stream", counted_create)
            mp.setattr(type(backend), "destroy_stream", counted_destroy)
            for _ in range(3):
                for h in handles:
                    with t.reading(h):
                        pass
        assert len(made) <= _scheduler.MAX_SPARES and not destroyed, (len(made), len(destroyed))
    finally:
        gate.set()
        for h in handles:
            backend.synchronize_stream(h)
            backend.destroy_stream(h)
