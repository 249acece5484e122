"""A host consume of a tracked array whose work is complete returns at once,
with no handoff built (``_consume._tracked_host``, #20's lean path); anything
pending, open or left to fence takes the full row.

Model-based: random programs of latched writes in ``writing()`` blocks, latched
work on the buffer's own stream (what its own interface names), another
thread's open ``writing()`` block, releases and consumes, with the sanitizer
off (it takes the full row) and on. The oracle: a consume returns iff no latch
holds work it must wait for, and no other thread's block is open. Beside it,
controls with the lean path's check disabled, which return too early.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cai_streams as cs
from cai_streams import _consume, sim
from cai_streams._pending import PendingWork

from .device_ops import SimOps, consume_returns

#: a consume expected to time out waits this long (its work is held by a latch)
SHORT = 0.03
#: a consume expected to return may take this long (a loaded CI machine)
LONG = 10.0


@pytest.fixture(autouse=True)
def _on_sim() -> None:
    """Every test here runs on the simulator (under CAI_STREAMS_SIM_DECOY=1 too;
    conftest restores the default backend after each)."""
    cs.use_backend("sim")


class _Block:
    """Another thread's ``writing(s)`` block of ``t``, open until ``end``."""

    def __init__(self, t: cs.TrackedArray, s: cs.Stream) -> None:
        self._opened, self._end = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, args=(t, s))
        self._thread.start()
        assert self._opened.wait(LONG)

    def _run(self, t: cs.TrackedArray, s: cs.Stream) -> None:
        with t.writing(s):
            self._opened.set()
            self._end.wait(LONG)

    def end(self) -> None:
        self._end.set()
        self._thread.join(LONG)
        assert not self._thread.is_alive()


def _async_returns(t: cs.TrackedArray, timeout: float) -> bool:
    async def go() -> None:
        await cs.consume(t, timeout=timeout)

    try:
        asyncio.run(go())
    except TimeoutError:
        return False
    return True


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("write"), st.integers(0, 1), st.booleans()),
        st.tuples(st.just("own"), st.booleans()),
        st.tuples(st.just("block"), st.integers(0, 1)),
        st.tuples(st.just("release"), st.integers(0, 3)),
        st.tuples(st.just("consume"), st.booleans()),
    ),
    max_size=12,
)


@pytest.mark.parametrize("sanitized", [False, True], ids=["lean", "sanitized"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=OPS)
def test_a_host_consume_returns_iff_nothing_holds_it(
    program: list[tuple[Any, ...]], sanitized: bool
) -> None:
    ops = SimOps()
    streams = [cs.Stream(), cs.Stream()]
    own = cs.Stream()
    buf = sim.asarray(np.zeros(64, np.float32))
    t = cs.track(buf)
    holds: list[Callable[[], None]] = []  # releases of what a consume must wait for
    blocks: list[Callable[[], None]] = []  # (another writer waits for an open block: none then)
    try:
        with cs.sanitize(sanitized):
            for op in program:
                blocks[:] = [end for end in blocks if end in holds]
                if op[0] in ("write", "block") and blocks:
                    continue  # (it would wait for the open block: the consume tests that)
                if op[0] == "write":
                    s = streams[op[1]]
                    with t.writing(s):
                        if op[2]:
                            holds.append(ops.latch(s).release)
                        ops.fill(s, t.array, 1.0)
                elif op[0] == "own":  # work the buffer's own interface names
                    buf.stream = own.handle
                    if op[1]:
                        holds.append(ops.latch(own).release)
                    sim.launch(own, lambda: None, name="own work")
                elif op[0] == "block":
                    blocks.append(_Block(t, streams[op[1]]).end)
                    holds.append(blocks[-1])
                elif op[0] == "release" and holds:
                    holds.pop(op[1] % len(holds))()
                elif op[0] == "consume":
                    returns = _async_returns if op[1] else consume_returns
                    if holds:
                        assert not returns(t, SHORT), "returned while work was held"
                    else:
                        assert returns(t, LONG)
    finally:
        for release in holds:
            release()
        ops.release_all()
        for s in (*streams, own):  # the buffer goes back to the pool: its work first
            s.synchronize()


@pytest.fixture
def _lean() -> Iterator[None]:
    with cs.sanitize(False):  # (a sanitized consume takes the full row)
        yield


def _as_if_idle(mp: pytest.MonkeyPatch) -> None:
    """The control: the lean path's check of the array's state says idle."""
    mp.setattr(PendingWork, "idle_for_host", lambda self: True)


def _consumed_then_read(
    latch: Any,
    t: cs.TrackedArray,
    arr: Any,
    patch: Callable[[pytest.MonkeyPatch], None] | None,
) -> float:
    """``consume_blocking(t)`` while ``latch`` holds a fill, released 0.05 s on,
    with ``patch`` applied (a control); then ``arr[0]`` as the host sees it."""
    timer = threading.Timer(0.05, latch.release)
    timer.start()
    try:
        with pytest.MonkeyPatch.context() as mp:
            if patch is not None:
                patch(mp)
            cs.consume_blocking(t, timeout=LONG)
            return float(SimOps().to_host(arr)[0])
    finally:
        timer.cancel()
        latch.release()


@pytest.mark.usefixtures("_lean")
@pytest.mark.parametrize("control", [False, True], ids=["lean", "control"])
def test_a_pending_write_is_waited_for(control: bool) -> None:
    """Data: a fill of 7 held by a latch. The consume returns once it ran; the
    control returns at once and reads the 0 from before it."""
    ops = SimOps()
    s = cs.Stream()
    t = cs.track(sim.asarray(np.zeros(64, np.float32)))
    latch = ops.latch(s)
    with t.writing(s):
        ops.fill(s, t.array, 7.0)
    seen = _consumed_then_read(latch, t, t.array, _as_if_idle if control else None)
    assert seen == (0.0 if control else 7.0)


@pytest.mark.usefixtures("_lean")
@pytest.mark.parametrize("control", [False, True], ids=["lean", "control"])
def test_the_buffers_own_stream_is_waited_for(control: bool) -> None:
    """Data: the buffer's own interface names a stream whose fill of 5 a latch
    holds (no ``writing()`` block). The control skips the own stream's check."""
    ops = SimOps()
    own = cs.Stream()
    buf = sim.asarray(np.zeros(64, np.float32))
    t = cs.track(buf)
    latch = ops.latch(own)
    ops.fill(own, buf, 5.0)
    buf.stream = own.handle

    def unchecked(mp: pytest.MonkeyPatch) -> None:
        mp.setattr(PendingWork, "own_stream", lambda self, **kw: None)

    seen = _consumed_then_read(latch, t, buf, unchecked if control else None)
    assert seen == (0.0 if control else 5.0)


@pytest.mark.usefixtures("_lean")
@pytest.mark.parametrize("control", [False, True], ids=["lean", "control"])
def test_another_threads_open_block_is_waited_for(control: bool) -> None:
    s = cs.Stream()
    t = cs.track(sim.asarray(np.zeros(64, np.float32)))
    block = _Block(t, s)
    try:
        with pytest.MonkeyPatch.context() as mp:
            if control:
                _as_if_idle(mp)
            assert consume_returns(t, SHORT) is control
    finally:
        block.end()


class _Counting(sim.SimArray):
    """A simulated buffer that counts reads of its interface."""

    reads = 0

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        self.reads += 1
        cai: dict[str, Any] = super().__cuda_array_interface__
        return cai


@pytest.mark.usefixtures("_lean")
def test_the_buffers_interface_is_read_once_per_consume() -> None:
    """Also when its own stream is busy and the full row takes over from the
    lean check: the row is given what the check read."""
    ops = SimOps()
    own = cs.Stream()
    memory = sim.asarray(np.zeros(64, np.float32))  # (kept: it owns the memory)
    buf = _Counting(memory._view, device=memory.device)
    t = cs.track(buf)
    buf.stream = own.handle
    before = buf.reads
    cs.consume_blocking(t)  # idle: complete at once
    assert buf.reads == before + 1
    latch = ops.latch(own)
    timer = threading.Timer(0.05, latch.release)
    timer.start()
    try:
        cs.consume_blocking(t, timeout=LONG)  # busy: the row waits
    finally:
        timer.cancel()
        latch.release()
    assert buf.reads == before + 2


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The TRACKED_HOST rows built from here on (none: the lean path)."""
    rows: list[object] = []
    real = _consume._TrackedHost.__init__

    def counted(self: Any, *args: Any) -> None:
        rows.append(self)
        real(self, *args)

    monkeypatch.setattr(_consume._TrackedHost, "__init__", counted)
    return rows


@pytest.mark.usefixtures("_lean")
def test_a_complete_consume_builds_no_handoff(built: list[object]) -> None:
    """The lean path is taken (else this test proves nothing about it), and it
    gives what the full row gives: the tracked array's view, naming no stream."""
    t = cs.track(sim.asarray(np.zeros(64, np.float32)))
    view = cs.consume_blocking(t)
    assert asyncio.run(cs.consume(t)) is view
    assert built == []
    assert view is t.view and view.stream is None and view.owner is t.array
    with cs.sanitize():  # the sanitizer declares the host's read in the row
        assert cs.consume_blocking(t) == view
    assert len(built) == 1
    assert cs.consume_blocking(t, sync=False).stream is None  # the opt-out row: no writes
    with pytest.raises(TypeError, match="sync must be"):
        cs.consume_blocking(t, sync=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout"):
        cs.consume_blocking(t, timeout=-1)


def _consume_via(how: str, items: list[cs.TrackedArray], timeout: float) -> None:
    """Consume the one TrackedArray in ``items``, held by no frame but the library's."""
    if how == "blocking":
        cs.consume_blocking(items.pop(), timeout=timeout)
    elif how == "awaited":
        anyio.run(lambda: cs.consume(items.pop(), timeout=timeout))
    else:  # awaited in a scope cancelled before it (the lean path's checkpoint raises)

        async def cancelled() -> None:
            with anyio.CancelScope() as scope:
                scope.cancel()
                try:
                    await cs.consume(items.pop(), timeout=timeout)
                except anyio.get_cancelled_exc_class() as exc:
                    raise _Kept(exc) from None

        anyio.run(cancelled)


class _Kept(Exception):
    """Carries a cancellation out of its scope, as a caller keeping it would."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__("kept")
        self.exc = exc


@pytest.mark.usefixtures("_lean")
@pytest.mark.parametrize(
    ("cause", "how"),
    [
        ("timeout", "blocking"),
        ("timeout", "awaited"),
        ("fault", "blocking"),
        ("fault", "awaited"),
        ("bad stream", "blocking"),
        ("bad stream", "awaited"),
        ("none", "cancelled"),
    ],
)
def test_a_kept_error_does_not_keep_the_array(cause: str, how: str) -> None:
    """The caller dropped the array and keeps the exception of a failed host
    consume (a timeout behind a held write, a faulted kernel on the buffer's own
    stream, a bad ``stream`` entry, or a cancellation of a complete consume):
    the array is collected, as the full row lets it be."""
    ops = SimOps()
    s = cs.Stream()
    buf = sim.asarray(np.zeros(64, np.float32))
    t = cs.track(buf)
    if cause == "timeout":
        latch = ops.latch(s)
        with t.writing(s):
            ops.fill(s, t.array, 1.0)
    elif cause == "fault":
        ops.fail(s)
        buf.stream = s.handle
    elif cause == "bad stream":
        buf.stream = 0  # the spec forbids 0: InterfaceError
    ref = weakref.ref(buf)
    items = [t]
    del t, buf
    kept: BaseException | None = None
    try:
        _consume_via(how, items, 0.05)
    except (TimeoutError, cs.CudaError, cs.InterfaceError, _Kept) as exc:
        kept = exc
    if cause == "timeout":
        latch.release()
    s.synchronize() if cause != "fault" else sim.device().drain(timeout=10)
    cs.stats()  # (completed holds let go)
    gc.collect()
    try:
        assert kept is not None
        assert ref() is None, f"{type(kept).__name__} kept the array"
    finally:
        del kept
        if cause == "fault":
            sim.reset(0)


@pytest.mark.usefixtures("_lean")
def test_an_array_tracked_while_its_interface_named_a_stream_takes_the_lean_path(
    built: list[object],
) -> None:
    """``t.view`` keeps the stream the interface named at ``track()``; a complete
    consume still returns at once, with a view naming no stream (the row's)."""
    s = cs.Stream()
    buf = sim.asarray(np.zeros(64, np.float32))
    buf.stream = s.handle
    t = cs.track(buf)
    assert t.view.stream == s.handle
    view = cs.consume_blocking(t)
    assert built == []
    assert view.stream is None and view == t.view.with_stream(None)


@pytest.mark.usefixtures("_lean")
def test_sync_true_waits_for_the_buffers_own_stream_whatever_the_setting() -> None:
    """An explicit ``sync=True`` synchronizes under ``configure(sync=False)``:
    the stream the buffer's own interface names is waited for too, on the
    host and onto a consumer's stream (each on an array of its own: a wait
    notes the own stream's work as the array's, which the next one would see)."""
    ops = SimOps()
    own = cs.Stream()
    latch = ops.latch(own)
    cs.configure(sync=False)
    try:
        for how in ("host", "stream"):
            for sync in (None, True):
                buf = sim.asarray(np.zeros(64, np.float32))
                t = cs.track(buf)
                buf.stream = own.handle
                if how == "host":
                    assert consume_returns_sync(t, sync) is (sync is None), (how, sync)
                    continue
                consumer = cs.Stream()
                cs.consume_blocking(t, stream=consumer, sync=sync)
                done = consumer.record()
                time.sleep(SHORT)
                assert done.is_done is (sync is None), (how, sync)
    finally:
        cs.configure(sync=True)
        latch.release()
        own.synchronize()


def consume_returns_sync(t: cs.TrackedArray, sync: bool | None) -> bool:
    try:
        cs.consume_blocking(t, sync=sync, timeout=SHORT)
    except TimeoutError:
        return False
    return True
