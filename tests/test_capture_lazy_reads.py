"""A consumer's read of a tracked array on its stream stays open (lazy) until
something must wait for it; it is then recorded on that stream. If the stream
is capturing a graph by then, a record would stand for the captured work only,
and the consumer's ordinary work from before the capture would be taken for
done once it ended. A lazy read is therefore recorded only while its stream
does not capture: the bound on open reads and the settling of an orphaned
buffer leave it open until then (``PendingWork._materialize_outside_capture``).

Each test beside a control that records it anyway (the library before), which
shows a writer overwriting the buffer under the consumer's held copy.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

import cai_streams as cs
from cai_streams._access import Access, AccessState
from cai_streams._pending import MAX_OPEN_READS, PendingWork

from .device_ops import DeviceOps, foreign_streams


@pytest.fixture(autouse=True)
def _unsanitized() -> Iterator[None]:
    with cs.sanitize(False):  # the controls race on purpose, as the programs' undeclared fills do
        yield


def _as_before(mp: pytest.MonkeyPatch) -> None:
    def always(self: PendingWork, a: Access) -> bool:
        a.materialize()
        return True

    mp.setattr(PendingWork, "_materialize_outside_capture", always)


@pytest.mark.parametrize("control", [False, True], ids=["left open", "control"])
def test_the_open_reads_bound_does_not_record_a_capturing_consumers_read(
    ops: DeviceOps, control: bool
) -> None:
    """``s`` copies the array out (held by a latch), then begins a capture;
    more consumers than MAX_OPEN_READS make the oldest open read (``s``'s) due
    for a record while ``s`` captures. A writer on ``s2`` after the capture
    must still wait for the copy: it reads 5, not the writer's 9."""
    (s,), s2 = foreign_streams(1), cs.Stream()  # (a read on a stream of ours is never due)
    others = foreign_streams(MAX_OPEN_READS)
    t = cs.track(ops.array(np.full(64, 5.0, np.float32)))
    out = ops.array(np.zeros(64, np.float32))
    with pytest.MonkeyPatch.context() as mp:
        if control:
            _as_before(mp)
        cs.consume_blocking(t, stream=s)  # the oldest open read
        latch = ops.latch(s)
        ops.copy(s, out, t.array)  # the consumer's read, held
        s.begin_capture("relaxed")
        ops.add(s, out, 1.0)
        for o in others:
            cs.consume_blocking(t, stream=o)
        graph = s.end_capture()
        with t.writing(s2):  # ordered after the consumers' reads
            ops.fill(s2, t.array, 9.0)
    if control:  # not ordered after the held copy: the fill runs first
        s2.synchronize()
    latch.release()
    for stream in (s, s2, *others):
        stream.synchronize()
    graph.close()
    assert (ops.to_host(out) == (9.0 if control else 5.0)).all()


@pytest.mark.parametrize("control", [False, True], ids=["left open", "control"])
def test_settling_does_not_record_a_capturing_consumers_read(ops: DeviceOps, control: bool) -> None:
    """``settle()`` (an orphaned buffer's, here called directly) while the
    consumer's stream captures leaves its read open and the buffer unsettled;
    the writer after the capture waits for the held copy."""
    s, s2 = cs.Stream(), cs.Stream()
    t = cs.track(ops.array(np.full(64, 5.0, np.float32)))
    out = ops.array(np.zeros(64, np.float32))
    with pytest.MonkeyPatch.context() as mp:
        if control:
            _as_before(mp)
        cs.consume_blocking(t, stream=s)
        latch = ops.latch(s)
        ops.copy(s, out, t.array)
        s.begin_capture("relaxed")
        ops.add(s, out, 1.0)
        settled = t._work.settle()
        graph = s.end_capture()
        with t.writing(s2):
            ops.fill(s2, t.array, 9.0)
    if control:
        s2.synchronize()
    latch.release()
    for stream in (s, s2):
        stream.synchronize()
    graph.close()
    assert not settled
    assert (ops.to_host(out) == (9.0 if control else 5.0)).all()


def test_the_open_reads_bound_holds_while_the_oldest_reads_stream_captures(
    ops: DeviceOps,
) -> None:
    """The oldest open read's stream captures: newer consumers' reads are
    recorded in its place, so the open reads stay within the bound (they grew
    by one per consumer when only the oldest was tried)."""
    (s,) = foreign_streams(1)
    others = foreign_streams(3 * MAX_OPEN_READS)
    t = cs.track(ops.array(np.full(64, 5.0, np.float32)))
    cs.consume_blocking(t, stream=s)  # the oldest open read
    s.begin_capture("relaxed")
    try:
        for o in others:
            cs.consume_blocking(t, stream=o)
        open_reads = [a for a in t._work.reads if a.state is AccessState.LAZY]
        assert len(open_reads) <= MAX_OPEN_READS
        assert open_reads[0].key == s._key()  # (its stream captures: still open)
    finally:
        s.end_capture().close()
