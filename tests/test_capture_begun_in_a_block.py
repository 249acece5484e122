"""A graph capture that begins on a stream while a ``writing()`` block on it is
open, and is still under way when the block ends: the block's record goes into
the capture and stands for the captured work only. Its work from before the
capture began is ordinary and pending on the stream; once the capture is over,
an ordinary record covers it (``PendingWork._fence``), so consumers wait for it.

Each test runs beside a control with that record disabled (the library before
it), which shows the wrong answer: a host consume that returns while the block's
fill is still held by a latch, a consumer stream that copies before the fill.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import cai_streams as cs
from cai_streams import _capture_guard
from cai_streams._capture_guard import StreamPhase
from cai_streams._identity import Lifetime
from cai_streams._pending import PendingWork

from .device_ops import (
    DeviceOps,
    consume_returns,
    consuming_past_the_open_reads,
    foreign_streams,
    held,
)


@pytest.fixture(autouse=True)
def _unsanitized() -> Iterator[None]:
    with cs.sanitize(False):  # the controls race on purpose, as the programs' undeclared fills do
        yield


def _as_before(mp: pytest.MonkeyPatch) -> None:
    """The control: no ordinary record once the capture is over (the captured
    record is taken as it is)."""

    def no_fence(self: PendingWork) -> None:
        self.unfenced = []

    mp.setattr(PendingWork, "_fence", no_fence)


def _check_the_fill_was_waited_for(
    ops: DeviceOps, t: cs.TrackedArray, control: bool, returned: bool, seen: Any
) -> None:
    """A host consume of ``t`` that gave up after a short timeout (``returned``)
    while a latch held its fill of 7; ``seen``, what ``t`` held then. The
    control returned under the held fill and saw 0; else it timed out, and a
    consume after the latch's release sees 7 (no graph ever ran: no +1)."""
    if control:  # the captured record taken for done
        assert returned and (seen == 0.0).all()
    else:
        assert not returned
        _sees_the_fill(ops, t)


def _let_go(latch: Any, s: cs.Stream, graph: cs.Graph) -> None:
    latch.release()
    s.synchronize()
    graph.close()


def _sees_the_fill(ops: DeviceOps, t: cs.TrackedArray) -> None:
    cs.consume_blocking(t, timeout=5)
    assert (ops.to_host(t.array) == 7.0).all()  # (no graph ever ran: no +1)


def _fence_asks_stale(mp: pytest.MonkeyPatch, phase: StreamPhase) -> None:
    """The fence's next ask answers ``phase``: what it saw just before another
    thread ended (or began) the capture, which the asks after it see."""
    real = _capture_guard.stream_phase
    answers = [phase]

    def stale(backend: cs.Backend, key: Any) -> StreamPhase:
        return answers.pop() if answers else real(backend, key)

    mp.setattr(_capture_guard, "stream_phase", stale)


def _host_skips_before(backend: cs.Backend, access: Any, what: str) -> bool:
    """``host_skips`` as it was: it asked again, and took a captured record for
    done once that ask found the capture over."""
    mark = access.mark
    _capture_guard.check_host_wait(backend, access.key, mark, what)
    return (
        mark is not None
        and mark.captured
        and _capture_guard.taken_or_complete(backend, access.event)
    )


def _filled_then_capturing(ops: DeviceOps, s: cs.Stream, t: cs.TrackedArray) -> Any:
    """In a ``writing(s)`` block: a fill of 7 held by a latch (ordinary), then a
    capture begins on ``s`` and adds 1 (captured). The block ends while the
    capture is under way. Returns the latch."""
    latch = ops.latch(s)
    with t.writing(s):
        ops.fill(s, t.array, 7.0)
        s.begin_capture("relaxed")
        ops.add(s, t.array, 1.0)
    return latch


def _filled_then_captured(ops: DeviceOps, s: cs.Stream, t: cs.TrackedArray) -> tuple[Any, Any]:
    """:func:`_filled_then_capturing`, and the capture ends after the block.
    Returns the latch and the graph (to close)."""
    latch = _filled_then_capturing(ops, s, t)
    return latch, s.end_capture()


@pytest.mark.parametrize("control", [False, True], ids=["fenced", "control"])
def test_a_host_consume_waits_for_the_blocks_work_from_before_the_capture(
    ops: DeviceOps, control: bool
) -> None:
    s = cs.Stream()
    t = cs.track(ops.array(np.zeros(64, np.float32)))
    latch, graph = _filled_then_captured(ops, s, t)
    with pytest.MonkeyPatch.context() as mp:
        if control:
            _as_before(mp)
        returned = consume_returns(t, 0.2)
        seen = ops.to_host(t.array)
    _let_go(latch, s, graph)
    _check_the_fill_was_waited_for(ops, t, control, returned, seen)


@pytest.mark.parametrize("control", [False, True], ids=["fenced", "control"])
def test_a_consumer_stream_is_ordered_after_the_blocks_work_from_before_the_capture(
    ops: DeviceOps, control: bool
) -> None:
    s, consumer = cs.Stream(), cs.Stream()
    t = cs.track(ops.array(np.zeros(64, np.float32)))
    out = ops.array(np.zeros(64, np.float32))
    latch, graph = _filled_then_captured(ops, s, t)
    with pytest.MonkeyPatch.context() as mp:
        if control:
            _as_before(mp)
        cs.consume_blocking(t, stream=consumer)
        ops.copy(consumer, out, t.array)  # ordered after the fill only by the join
    if control:  # no join: the copy runs (and reads) while the fill still waits
        consumer.synchronize()
    latch.release()
    consumer.synchronize()
    s.synchronize()
    graph.close()
    assert (ops.to_host(out) == (0.0 if control else 7.0)).all()


def test_while_the_capture_is_under_way_a_host_consume_raises_and_keeps_it(
    ops: DeviceOps,
) -> None:
    """Nothing ordinary can be recorded on the stream yet: the host cannot wait
    (CaptureError, as for any captured write), and the capture survives."""
    s = cs.Stream()
    t = cs.track(ops.array(np.zeros(64, np.float32)))
    latch = _filled_then_capturing(ops, s, t)
    try:
        with pytest.raises(cs.CaptureError):
            cs.consume_blocking(t, timeout=0.2)
        assert s.backend.capture_status(s.handle) == "active"
    finally:
        s.end_capture().close()
        latch.release()
    cs.consume_blocking(t, timeout=5)  # over: the fill is waited for, then taken
    assert (ops.to_host(t.array) == 7.0).all()
    s.synchronize()


def test_a_block_opened_in_the_capture_needs_no_ordinary_record(ops: DeviceOps) -> None:
    """A block whose stream was capturing when it opened holds captured work
    only: nothing is recorded on the stream once the capture is over (its
    write is the capture's), and a host consume after it returns at once."""
    s = cs.Stream()
    t = cs.track(ops.array(np.zeros(64, np.float32)))
    latch = ops.latch(s)
    ops.fill(s, t.array, 7.0)  # ordinary, held: not part of any block
    s.begin_capture("relaxed")
    with t.writing(s):
        ops.add(s, t.array, 1.0)
    s.end_capture().close()
    try:
        cs.consume_blocking(t, timeout=1)  # (the held fill was never the library's to know)
        assert t.pending_streams()["writes"] == []
    finally:
        latch.release()
        s.synchronize()


@pytest.mark.parametrize("control", [False, True], ids=["one ask", "control"])
def test_a_capture_ending_after_the_fences_ask_still_refuses_the_host_wait(
    ops: DeviceOps, control: bool
) -> None:
    """The fence found the stream capturing and kept the block; the capture
    ended before the host's own ask. One ask decides: CaptureError, and the
    next consume records and waits. The control (the host asking again) took
    the captured record for done and returned under the held fill."""
    s = cs.Stream()
    t = cs.track(ops.array(np.zeros(64, np.float32)))
    latch, graph = _filled_then_captured(ops, s, t)
    refused = returned = False
    with pytest.MonkeyPatch.context() as mp:
        _fence_asks_stale(mp, StreamPhase.CAPTURING)
        if control:
            mp.setattr(_capture_guard, "host_skips", _host_skips_before)
        try:
            returned = consume_returns(t, 0.2)
        except cs.CaptureError:
            refused = True
        seen = ops.to_host(t.array)
    try:
        if control:
            assert returned and (seen == 0.0).all()
        else:
            assert refused
            assert not consume_returns(t, 0.2)  # asked again: recorded, and waited for
    finally:
        _let_go(latch, s, graph)
    _sees_the_fill(ops, t)


def test_a_capture_ending_after_the_fences_ask_refuses_a_consumer_stream(
    ops: DeviceOps,
) -> None:
    """The same for a consumer's stream outside the capture: CaptureError, not
    a stream that waits for nothing of the block's fill."""
    s, consumer = cs.Stream(), cs.Stream()
    t = cs.track(ops.array(np.zeros(64, np.float32)))
    out = ops.array(np.zeros(64, np.float32))
    latch, graph = _filled_then_captured(ops, s, t)
    try:
        with pytest.MonkeyPatch.context() as mp:
            _fence_asks_stale(mp, StreamPhase.CAPTURING)
            with pytest.raises(cs.CaptureError):
                cs.consume_blocking(t, stream=consumer)
        cs.consume_blocking(t, stream=consumer)  # asked again: ordered after the fill
        ops.copy(consumer, out, t.array)
    finally:
        latch.release()
    consumer.synchronize()
    s.synchronize()
    graph.close()
    assert (ops.to_host(out) == 7.0).all()


def test_a_capture_begun_between_the_fences_ask_and_its_record_keeps_the_block(
    ops: DeviceOps,
) -> None:
    """Another thread began a second capture on the stream after the fence's
    ask: the fence's record went into that capture, so the block's fill is
    still unrecorded and the block stays to fence; once the second capture is
    over, a host consume waits for the fill (it returned under the held fill
    when the block was let go with a captured record)."""
    s = cs.Stream()
    t = cs.track(ops.array(np.zeros(64, np.float32)))
    latch, graph = _filled_then_captured(ops, s, t)
    try:
        with pytest.MonkeyPatch.context() as mp:
            s.begin_capture("relaxed")
            _fence_asks_stale(mp, StreamPhase.NOT_CAPTURING)
            with pytest.raises(cs.CaptureError):
                cs.consume_blocking(t, timeout=0.2)
            assert len(t._work.unfenced) == 1
            s.end_capture().close()
        assert not consume_returns(t, 0.2)
    finally:
        _let_go(latch, s, graph)
    _sees_the_fill(ops, t)
    assert t._work.unfenced == []


def test_a_borrowed_stream_destroyed_after_the_capture_is_let_go(
    ops: DeviceOps, backend: cs.Backend
) -> None:
    """A bare handle another library made and destroyed once its work was done:
    nothing more can be recorded or waited for there, and the array stays
    usable (each use tried to record on the destroyed handle)."""
    other = cs.Stream()  # (made first: the destroyed handle is not reused below)
    handle = backend.create_stream()
    s = cs.Stream.wrap(handle)
    t = cs.track(ops.array(np.zeros(64, np.float32)))
    with t.writing(s):
        ops.fill(s, t.array, 7.0)
        s.begin_capture("relaxed")
        ops.add(s, t.array, 1.0)
    s.end_capture().close()
    backend.synchronize_stream(handle)
    backend.destroy_stream(handle)
    for _ in range(2):
        cs.consume_blocking(t, timeout=5)
        cs.consume_blocking(t, stream=other)
    with t.writing(other):
        ops.add(other, t.array, 1.0)
    cs.consume_blocking(t, timeout=5)
    assert (ops.to_host(t.array) == 8.0).all()
    assert t._work.unfenced == []


@pytest.mark.parametrize("how", ["close", "finalizer"])
@pytest.mark.parametrize("control", [False, True], ids=["recorded", "control"])
def test_closing_the_stream_after_the_capture_records_the_blocks_work_first(
    ops: DeviceOps, control: bool, how: str
) -> None:
    """The block's stream, one of the library's, is closed once the capture is
    over, before the array's next use: closing records first, so a host consume
    still waits for the held fill. With the close in a finalizer, the fence
    records while the close runs, though the wrapper already says closed. The
    controls (nothing listening; the close taken as already over) returned
    under the held fill."""
    s = cs.Stream()
    t = cs.track(ops.array(np.zeros(64, np.float32)))
    latch, graph = _filled_then_captured(ops, s, t)
    graph.close()
    with pytest.MonkeyPatch.context() as mp:
        if control and how == "close":
            mp.setattr(PendingWork, "stream_closing", lambda self: None)
        elif control:
            mp.setattr(Lifetime, "ending", property(lambda self: False))
        if how == "close":
            s.close()
        else:
            _ClosesInGC(s)
            gc.collect()
        assert s.closed
        returned = consume_returns(t, 0.2)
        seen = ops.to_host(t.array)
    latch.release()
    _check_the_fill_was_waited_for(ops, t, control, returned, seen)
    assert t._work.unfenced == []


def test_a_fenced_block_stops_listening_to_its_stream(ops: DeviceOps) -> None:
    """Once recorded, the array is no longer one of the stream's listeners (it
    would be kept alive, and told, until the stream closes)."""
    s = cs.Stream()
    t = cs.track(ops.array(np.zeros(64, np.float32)))
    latch, graph = _filled_then_captured(ops, s, t)
    lifetime = s._lifetime
    assert lifetime is not None and t._work in lifetime._listeners
    latch.release()
    cs.consume_blocking(t, timeout=5)
    assert t._work not in lifetime._listeners
    graph.close()
    s.synchronize()


@pytest.mark.parametrize("control", [False, True], ids=["told apart", "control"])
def test_a_block_opened_in_one_capture_that_ends_and_another_that_begins_in_it(
    ops: DeviceOps, control: bool
) -> None:
    """The block opens in capture A; A ends inside it; an ordinary fill of 7
    (held by a latch) follows; capture B begins inside it and is under way at
    its end. B began in the block: once B is over, a host consume waits for the
    fill. The control (only "was it capturing when it opened") returned under
    the held fill."""
    s = cs.Stream()
    t = cs.track(ops.array(np.zeros(64, np.float32)))
    with pytest.MonkeyPatch.context() as mp:
        if control:
            mp.setattr(PendingWork, "_began_in", staticmethod(lambda b: not b.began_capturing))
        s.begin_capture("relaxed")
        with t.writing(s):
            ops.add(s, t.array, 1.0)  # captured in A
            s.end_capture().close()
            latch = ops.latch(s)
            ops.fill(s, t.array, 7.0)
            s.begin_capture("relaxed")
            ops.add(s, t.array, 1.0)  # captured in B
    graph = s.end_capture()
    returned = consume_returns(t, 0.2)
    seen = ops.to_host(t.array)
    _let_go(latch, s, graph)
    _check_the_fill_was_waited_for(ops, t, control, returned, seen)


def test_a_captured_record_that_replaced_the_blocks_own_still_refuses_the_host_wait(
    ops: DeviceOps,
) -> None:
    """Still in the capture begun in a block, a second block on the stream (opened
    in the capture) ends: its captured record replaces the first's in the
    array's writes. It stands for the first block's unrecorded fill as well:
    with the fence's ask stale (the capture ended after it), the host wait
    raises rather than take it for done; asked again, it waits for the fill."""
    s = cs.Stream()
    t = cs.track(ops.array(np.zeros(64, np.float32)))
    latch = _filled_then_capturing(ops, s, t)
    with t.writing(s):  # opened in the capture
        ops.add(s, t.array, 1.0)
    (write,) = t._work.writes
    assert write.unfenced  # (the second block's record: it replaced the first's)
    graph = s.end_capture()
    try:
        with pytest.MonkeyPatch.context() as mp:
            _fence_asks_stale(mp, StreamPhase.CAPTURING)
            with pytest.raises(cs.CaptureError):
                cs.consume_blocking(t, timeout=0.2)
        assert not consume_returns(t, 0.2)
    finally:
        _let_go(latch, s, graph)
    _sees_the_fill(ops, t)


class _ClosesInGC:
    """A user object in a reference cycle whose finalizer closes its stream:
    the close runs inside a garbage collection, so its wrapper says closed at
    once and what listens records at the next library call."""

    def __init__(self, s: cs.Stream) -> None:
        self.s = s
        self.me = self

    def __del__(self) -> None:
        self.s.close()


def test_a_block_on_a_borrowed_wrapper_closed_after_the_capture_is_still_fenced(
    ops: DeviceOps,
) -> None:
    """The block was opened on a borrowed wrapper of a live stream; the capture
    begun in it ends, then the wrapper is closed (which only forgets it): the
    block's work from before the capture is still waited for, not taken for
    gone with the wrapper."""
    arr = ops.array(np.zeros(64, "float32"))
    t = cs.track(arr)
    s = cs.Stream()
    on = cs.Stream.wrap(s)
    latch = ops.latch(s)
    try:
        with t.writing(on):
            ops.fill(on, arr, 7.0)  # ordinary, held by the latch
            on.begin_capture("relaxed")
        graph = on.end_capture()
        on.close()
        assert not consume_returns(t, timeout=0.1), "the block's fill was taken for done"
    finally:
        latch.release()
    s.synchronize()
    graph.close()
    _sees_the_fill(ops, t)


@pytest.mark.anyio
async def test_a_consuming_body_in_which_a_capture_begins_is_fenced_as_a_block(
    ops: DeviceOps,
) -> None:
    """The body's read was recorded early (other consumers past
    ``MAX_OPEN_READS``); the body copies the array on ``s`` (held) and begins a
    capture that is under way when it ends: the body's record is captured, so
    its ordinary copy is recorded once the capture ends, as a ``reading()``
    block's is, and the next writer waits for it."""
    arr = ops.array(np.ones(64, "float32"))
    out = ops.array(np.zeros(64, "float32"))
    t = cs.track(arr)
    (s,), w = foreign_streams(1), cs.Stream()
    latch = None
    try:
        async with consuming_past_the_open_reads(t, s):
            latch = ops.latch(s)
            ops.copy(s, out, arr)
            s.begin_capture("relaxed")
        s.end_capture().close()
        with t.writing(w):
            ops.fill(w, arr, 2.0)
        assert held(w), "the writer did not wait for the body's copy"
    finally:
        if latch is not None:
            latch.release()
    w.synchronize()
    s.synchronize()
    assert (ops.to_host(out) == 1).all()


@pytest.mark.anyio
async def test_a_consuming_body_on_a_stream_already_capturing_leaves_nothing_to_fence(
    ops: DeviceOps,
) -> None:
    """The capture was under way when the body began: its record stands for
    the body's work, which is all captured, so nothing is left to fence."""
    arr = ops.array(np.ones(16, "float32"))
    t = cs.track(arr)
    s = cs.Stream()
    s.begin_capture("relaxed")
    try:
        async with cs.consuming(t, stream=s, timeout=5):
            pass
        assert not t._work.unfenced
    finally:
        s.end_capture().close()
