"""Many consumers reading one tracked buffer at once, each on its own stream,
each enqueuing its kernel some time after its consume (an async service
whose requests await between the two): the next writer (a hot reload) must
wait for every one of those kernels.

A read on a stream the library made stays open until something must wait for
it, however many there are: its stream's close records it, so it keeps
nothing alive. Reads on other libraries' streams, which the read keeps alive,
stay bounded by ``MAX_OPEN_READS`` (the oldest is recorded early).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import pytest

import cai_streams as cs
from cai_streams._access import AccessState
from cai_streams._pending import MAX_OPEN_READS, PendingWork

from .device_ops import DeviceOps, ForeignStream, foreign_streams

READERS = MAX_OPEN_READS + 8


def _the_writer_waits_for_the_copy(
    ops: DeviceOps, t: cs.TrackedArray, s: cs.Stream, *held: Any, also: Iterable[cs.Stream] = ()
) -> None:
    """The consumer's copy of ``t`` on ``s`` (``t`` holds 5s), then the next
    writer fills 9s on a stream of its own; the latches ``held`` are let go
    only then. The copy must read 5s: the writer waited for it."""
    out = ops.array(np.zeros(64, np.float32))
    ops.copy(s, out, t.array)  # the consumer's kernel, after its handoff
    w = cs.Stream()
    with t.writing(w):
        ops.fill(w, t.array, 9.0)
    for latch in held:
        latch.release()
    for x in (s, w, *also):
        x.synchronize()
    assert (ops.to_host(out) == 5.0).all()


class _HandleHolder:
    """Another library's stream object made from a bare handle (as CuPy's
    ``ExternalStream``): it keeps nothing alive."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def _capped_as_before(mp: pytest.MonkeyPatch) -> None:
    """The control: every open read counts toward the bound, as before (the
    oldest reads are recorded before their consumers enqueue their kernels)."""
    original = PendingWork._consumer_read

    def consumer_read(self: PendingWork, stream: cs.Stream, key: object) -> None:
        original(self, stream, key)  # type: ignore[arg-type]
        open_reads = [a for a in self.reads if a.state is AccessState.LAZY]
        for a in open_reads[: max(0, len(open_reads) - MAX_OPEN_READS)]:
            a.materialize()

    mp.setattr(PendingWork, "_consumer_read", consumer_read)


@pytest.fixture
def unsanitized_control(request: pytest.FixtureRequest) -> Iterator[bool]:
    control = bool(request.param)
    if control:  # the control races on purpose: the sanitizer would name it
        with cs.sanitize(False), pytest.MonkeyPatch.context() as mp:
            _capped_as_before(mp)
            yield True
    else:
        yield False


@pytest.mark.parametrize(
    "unsanitized_control", [False, True], ids=["open", "control"], indirect=True
)
def test_every_reader_on_a_stream_of_ours_orders_the_next_writer(
    ops: DeviceOps, unsanitized_control: bool
) -> None:
    """``READERS`` consumers (more than ``MAX_OPEN_READS``) each consume the
    buffer onto their own stream, and only then copy it out, held by a latch;
    a writer fills 9 after them. Every copy must read 5. The control (every
    open read bounded, as before) shows the first eight copies reading the 9."""
    t = cs.track(ops.array(np.full(64, 5.0, np.float32)))
    readers = [cs.Stream() for _ in range(READERS)]
    outs = [ops.array(np.zeros(64, np.float32)) for _ in readers]
    for s in readers:
        cs.consume_blocking(t, stream=s)  # no kernel yet: the consumer awaits elsewhere
    latches = []
    for s, out in zip(readers, outs, strict=True):
        latches.append(ops.latch(s))
        ops.copy(s, out, t.array)  # the consumer's read, enqueued after its consume
    w = cs.Stream()
    with t.writing(w):  # a hot reload
        ops.fill(w, t.array, 9.0)
    early = READERS - MAX_OPEN_READS  # (the reads the control records at once)
    for latch in latches[early:]:
        latch.release()
    if unsanitized_control:  # ordered after the others' copies and the early
        w.synchronize()  # records only: the fill is done before the first copies
    for latch in latches[:early]:
        latch.release()
    for s in (*readers, w):
        s.synchronize()
    got = [float(ops.to_host(out)[0]) for out in outs]
    if unsanitized_control:
        assert got == [9.0] * (READERS - MAX_OPEN_READS) + [5.0] * MAX_OPEN_READS
    else:
        assert got == [5.0] * READERS


def test_reads_on_dropped_streams_of_ours_leave_nothing_alive(ops: DeviceOps) -> None:
    """Consumed onto ever-new streams that are then dropped, never written: the
    streams are collected (their close records the reads), and the buffer
    keeps no open read of theirs."""
    t = cs.track(ops.array(np.ones(64, np.float32)))
    gone: list[weakref.ref[cs.Stream]] = []
    outs = []
    for _ in range(3 * MAX_OPEN_READS):
        s = cs.Stream()
        cs.consume_blocking(t, stream=s)
        outs.append(ops.array(np.zeros(64, np.float32)))
        ops.copy(s, outs[-1], t.array)  # the consumer's read
        gone.append(weakref.ref(s))
        del s
    cs.stats(), cs.stats()  # (a released view's lease settles at the second library call)
    gc.collect()  # (a stream collected records its reads at the next library call)
    cs.stats()
    assert sum(r() is not None for r in gone) == 0
    assert not [a for a in t._work.reads if a.state is AccessState.LAZY]
    w = cs.Stream()
    with t.writing(w):  # ordered after every copy, by the records at the closes
        ops.fill(w, t.array, 2.0)
    w.synchronize()
    assert all((ops.to_host(out) == 1.0).all() for out in outs)


def test_reads_on_other_libraries_streams_stay_bounded(ops: DeviceOps) -> None:
    """Other libraries' streams, which an open read keeps alive: past the bound
    the oldest reads are recorded, and they keep the bound."""
    t = cs.track(ops.array(np.ones(64, np.float32)))
    for s in foreign_streams(3 * MAX_OPEN_READS):
        cs.consume_blocking(t, stream=s)
        s.close()  # (the user's wrapper: only forgets the stream)
    lazy = [a for a in t._work.reads if a.state is AccessState.LAZY]
    assert len(lazy) == MAX_OPEN_READS
    assert all(isinstance(a.stream._keepalive, ForeignStream) for a in lazy)


def test_a_stream_dropped_while_capturing_keeps_its_consumers_read(ops: DeviceOps) -> None:
    """The consumer's copy on ``s`` is enqueued (held), then ``s`` begins a
    capture and is dropped. It is kept until the capture ends (``close()``
    refuses a capturing stream meanwhile): its collection would record the
    read inside the capture, covering the captured work only, and the next
    writer overwrote the buffer under the copy. The writer refuses while the
    capture is under way; once it ends, it waits for the copy."""
    from cai_streams import _capture

    t = cs.track(ops.array(np.full(64, 5.0, np.float32)))
    out = ops.array(np.zeros(64, np.float32))
    s = cs.Stream()
    key = s._key()
    gone = weakref.ref(s)
    cs.consume_blocking(t, stream=s)
    latch = ops.latch(s)
    ops.copy(s, out, t.array)  # the consumer's read, before the capture
    s.begin_capture("relaxed")
    del s
    gc.collect()
    cs.stats()
    assert gone() is not None, "a capturing stream was collected"
    w = cs.Stream()
    try:
        with pytest.raises(cs.CaptureError), t.writing(w):
            ops.fill(w, t.array, 9.0)
    finally:
        _capture._capturing_streams[key].end_capture().close()
    gc.collect()
    cs.stats()
    assert gone() is None, "the stream outlived its capture"
    with t.writing(w):  # ordered after the copy, by the record at its close
        ops.fill(w, t.array, 9.0)
    latch.release()
    w.synchronize()
    assert (ops.to_host(out) == 5.0).all()
    assert (ops.to_host(t.array) == 9.0).all()


@pytest.mark.parametrize(
    "how",
    [
        "cs.export",
        "TrackedArray.export",
        "a wrapper of it",
        "after its bare handle's",
        "after a holder's",
        "after a double wrap's",
        "a wrapper of it, after a holder's",
    ],
)
def test_an_exported_streams_handle_stays_its_while_the_read_is_open(
    ops: DeviceOps, how: str
) -> None:
    """``export(t, stream=cs.Stream())`` hands out only the stream's handle:
    the read keeps the stream alive, so the consumer's work on that handle
    is still ordered before the next writer (the stream was collected at
    once, and the next stream made took its handle)."""
    t = cs.track(ops.array(np.full(64, 5.0, np.float32)))
    p = cs.Stream()
    with t.writing(p):  # pending: the export names its stream
        ops.fill(p, t.array, 5.0, duration=0.01)
    if how == "cs.export":
        handle = cs.export(t, stream=cs.Stream())["stream"]
    elif how == "TrackedArray.export":
        handle = t.export(cs.Stream())["stream"]
    elif how == "a wrapper of it":  # (a borrowed wrapper keeps its owner: so does the read)
        handle = cs.export(t, stream=cs.Stream.wrap(cs.Stream()))["stream"]
    else:  # an export onto something naming its handle first (keeps nothing), then onto it
        s = cs.Stream()
        first: object = {
            "after its bare handle's": cs.Stream.wrap(s.handle),
            "after a holder's": _HandleHolder(s.handle),
            "after a double wrap's": cs.Stream.wrap(cs.Stream.wrap(s.handle)),
            "a wrapper of it, after a holder's": _HandleHolder(s.handle),
        }[how]
        cs.export(t, stream=first)
        then = cs.Stream.wrap(s) if how.startswith("a wrapper") else s
        handle = cs.export(t, stream=then)["stream"]
        del s, first, then
    cs.stats(), cs.stats()
    gc.collect()
    other = cs.Stream()
    assert other.handle != handle, "the exported stream was destroyed"
    given = cs.Stream.wrap(handle)
    _the_writer_waits_for_the_copy(ops, t, given, ops.latch(given))


@pytest.mark.parametrize("how", ["reset", "ended elsewhere"])
def test_a_dropped_streams_capture_ended_behind_the_librarys_back_lets_it_go(how: str) -> None:
    """The stream kept for its capture is let go once that capture is over,
    even when it ended without ``end_capture`` (a reset; another library
    ending it on the handle): at the next capture begun."""
    from cai_streams import _capture, sim

    cs.use_backend("sim")
    s = cs.Stream()
    handle, gone = s.handle, weakref.ref(s)
    s.begin_capture("relaxed")
    del s
    gc.collect()
    assert gone() is not None
    if how == "reset":
        sim.reset()
    else:
        sim.device().end_capture(handle)
    other = cs.Stream()
    other.begin_capture("relaxed")
    other.end_capture().close()
    gc.collect()
    cs.stats()
    assert gone() is None, "the stream of a capture that ended was kept"
    assert not _capture.any_under_way()


def test_reads_that_come_to_keep_their_stream_stay_bounded(ops: DeviceOps) -> None:
    """A consume onto each stream (its read keeps nothing), then an export onto
    it (the same read now keeps the stream): past the bound the oldest are
    recorded, as for reads that kept their streams from the start."""
    t = cs.track(ops.array(np.full(64, 5.0, np.float32)))
    p = cs.Stream()
    with t.writing(p):
        ops.fill(p, t.array, 5.0, duration=0.05)
    streams = [cs.Stream() for _ in range(3 * MAX_OPEN_READS)]
    for s in streams:
        cs.consume_blocking(t, stream=s)
    for s in streams:
        cs.export(t, stream=s)
    keeping = [a for a in t._work.reads if a.state is AccessState.LAZY and a.keeps]
    assert len(keeping) == MAX_OPEN_READS
    p.synchronize()


def test_an_export_after_a_consume_onto_its_stream_is_the_newest_read(ops: DeviceOps) -> None:
    """A consume opened the read on ``s``; then 32 exports onto other streams;
    then the export onto ``s`` makes that read keep ``s``. It is the newest
    handoff, so the bound must not record it at once (before the consumer's
    kernel, which the next writer then overtook)."""
    t = cs.track(ops.array(np.full(64, 5.0, np.float32)))
    p = cs.Stream()
    held = ops.latch(p)  # the producer's write stays pending: exports name their streams
    with t.writing(p):
        ops.fill(p, t.array, 5.0)
    s = cs.Stream()
    cs.consume_blocking(t, stream=s)
    others = [cs.Stream() for _ in range(MAX_OPEN_READS)]
    for o in others:
        cs.export(t, stream=o)
    handle = cs.export(t, stream=s)["stream"]
    (read,) = [a for a in t._work.reads if a.key == s._key()]
    assert read.state is AccessState.LAZY and read.keeps
    given = cs.Stream.wrap(handle)
    _the_writer_waits_for_the_copy(ops, t, given, held, ops.latch(given), also=(p, *others))


@pytest.mark.parametrize("first", ["recorded by the bound", "still open"])
def test_a_repeat_handoff_is_the_newest_read(ops: DeviceOps, first: str) -> None:
    """A second consume onto another library's stream ``f``, after 32 others:
    whether the bound had recorded ``f``'s first read (its new read took that
    one's place in the list) or it was still open, ``f``'s read is now the
    newest, and the next handoff records the oldest other one instead. A
    writer then waits for the copy ``f``'s consumer enqueued after its second
    consume (it overtook it: the read had been recorded at once)."""
    t = cs.track(ops.array(np.full(64, 5.0, np.float32)))
    (f,) = foreign_streams(1)
    others = foreign_streams(MAX_OPEN_READS)
    cs.consume_blocking(t, stream=f)
    held = ops.latch(f)  # f's first read, still pending when the bound comes to it
    if first == "recorded by the bound":
        for o in others:
            cs.consume_blocking(t, stream=o)
        cs.consume_blocking(t, stream=f)
    else:
        for o in others[:-1]:
            cs.consume_blocking(t, stream=o)
        cs.consume_blocking(t, stream=f)
        cs.consume_blocking(t, stream=others[-1])  # the next handoff: records the oldest
    (read,) = [a for a in t._work.reads if a.key == f._key()]
    assert read.state is AccessState.LAZY, "the newest handoff's read was recorded at once"
    _the_writer_waits_for_the_copy(ops, t, f, held, also=others)


@pytest.mark.parametrize("older", ["capturing", "the legacy stream, a blocking one capturing"])
def test_the_bound_never_records_the_handoff_it_is_making(ops: DeviceOps, older: str) -> None:
    """Past the bound, the older open reads cannot be recorded now: their
    streams capture (another library's captures), or the oldest is on the
    legacy stream while a blocking stream captures (asking about it raises
    CaptureError). The bound skips them, and must skip this handoff's own read
    too (its consumer has enqueued nothing yet), so a writer waits for the
    kernel enqueued after the consume; and the consume itself must not raise."""
    if ops.name != "sim":
        pytest.skip("another library's captures on raw simulated streams")
    backend = cs.current_backend()
    t = cs.track(ops.array(np.full(64, 5.0, np.float32)))
    if older == "capturing":
        others = foreign_streams(MAX_OPEN_READS)
        for o in others:
            cs.consume_blocking(t, stream=o)
        capturing = [o.handle for o in others]
    else:
        cs.consume_blocking(t, stream=cs.Stream.wrap(1))  # the oldest
        others = foreign_streams(MAX_OPEN_READS - 1)
        for o in others:
            cs.consume_blocking(t, stream=o)
        capturing = [2]  # a blocking stream: the legacy one may not be asked about
    for handle in capturing:
        backend.begin_capture(handle, "relaxed")
    (f,) = foreign_streams(1)
    try:
        cs.consume_blocking(t, stream=f)  # this handoff
    finally:
        for handle in capturing:
            backend.end_capture(handle)
    (read,) = [a for a in t._work.reads if a.key == f._key()]
    assert read.state is AccessState.LAZY
    _the_writer_waits_for_the_copy(ops, t, f, ops.latch(f), also=others)
