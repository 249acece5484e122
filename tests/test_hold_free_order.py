"""A held owner's block is freed after every hold of it was released, in
whatever thread each release and the last drop happen.

The library keeps an owner until the stream of each of its holds has passed
the hold; the thread that drops the owner's last reference (the free) comes
after every earlier release, so the block is never reused while that work
runs. These tests let one thread release one hold while another frees the
block, with the sanitizer on, and read the data each reader saw; beside each,
the control where nothing holds the owner for one reader: the block is reused
while it reads (wrong data), and the sanitizer names it.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import cai_streams as cs
from cai_streams import _sanitizer, sim

WAIT = 10.0  # seconds: every wait here is bounded by this
N = 256


def reused_under(kernel: str) -> str:
    """What the sanitizer says of a block reused under ``kernel``'s access."""
    return rf"(?s)'{kernel}'.*freed and reused while stream"


@pytest.fixture(autouse=True)
def _sim() -> Iterator[None]:
    cs.use_backend("sim")
    gc.collect()  # nothing else of this size class is freed in between
    _until(lambda: _holds() == 0)  # the holds counted below are this test's
    yield


def _copy(dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any]) -> None:
    dst[...] = src


def _fill(dst: np.ndarray[Any, Any]) -> None:
    dst[...] = 3.0


def _until(done: Callable[[], bool]) -> None:
    """Library calls (each releases completed holds) until ``done``, bounded."""
    deadline = time.monotonic() + WAIT
    while not done():
        assert time.monotonic() < deadline, "no hold was released"
        cs.stats()
        time.sleep(0.0005)


def _holds() -> int:
    """Holds in flight (``stats()`` first records released views' holds and
    lets go of those complete)."""
    return int(cs.stats()["holds"])


def _elsewhere(step: Callable[[], None]) -> None:
    """Run ``step`` in a thread of its own, and join it."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            step()
        except BaseException as exc:  # reported here
            errors.append(exc)

    t = threading.Thread(target=run, name="releaser")
    t.start()
    t.join(WAIT)
    assert not t.is_alive() and not errors, errors


def _two_streams(second: str) -> tuple[float, float, bool, bool]:
    """An owner read on ``s1`` through a view from ``consume(stream=s1)``, and on
    ``s2`` (gated) through a second view (``second="view"``) or directly with
    nothing holding it there (``"unheld"``, the control); views and owner are
    dropped. Another thread releases the hold on ``s1`` (it sees only ``s1``
    complete), and an array of 3s is made while ``s2`` is still gated; then
    the gate opens, this thread releases the last hold (and frees the block)
    and an array of 2s is made. Returns what each reader saw, and whether the
    array of 3s, or that of 2s, got the owner's block."""
    s1, s2 = cs.Stream(), cs.Stream()
    gate = threading.Event()
    out1, out2 = sim.empty(N, "float32"), sim.empty(N, "float32")
    owner = sim.asarray(np.full(N, 1.0, np.float32))
    ptr, ref = owner.ptr, weakref.ref(owner)
    v1 = cs.consume_blocking(owner, stream=s1)
    sim.launch(s1, _copy, out1, v1, reads=[v1], writes=[out1], name="read on s1")
    v2: object = owner
    if second == "view":
        v2 = cs.consume_blocking(owner, stream=s2)
    sim.launch(s2, lambda: gate.wait(WAIT), name="gate")
    sim.launch(s2, _copy, out2, v2, reads=[v2], writes=[out2], name="read on s2")
    del v1, v2, owner
    try:
        if second == "view":  # s1's hold is released there; s2's is gated
            _elsewhere(lambda: _until(lambda: _holds() == 1))
        else:  # s1's hold is released there, and the owner freed
            _elsewhere(lambda: _until(lambda: ref() is None))
        while_gated = sim.asarray(np.full(N, 3.0, np.float32))  # kept: not freed again
        if second == "view":  # s2's hold keeps the owner: it is released (and freed) here
            gate.set()
            _until(lambda: ref() is None)
        after = sim.asarray(np.full(N, 2.0, np.float32))
    finally:
        gate.set()
        s1.synchronize()
        s2.synchronize()
    read1, read2 = float(out1.to_host()[0]), float(out2.to_host()[0])
    return read1, read2, while_gated.ptr == ptr, after.ptr == ptr


def test_views_of_one_owner_on_two_streams_freed_where_one_hold_was_seen_are_not_a_hazard() -> None:
    """Each view's hold is released once its stream passed it; the thread that
    frees the block saw only ``s2`` complete, and the other thread's release
    of ``s1``'s hold came before the free: no hazard, both readers see the
    owner's data, and the block is handed on only after both."""
    assert _two_streams("view") == (1.0, 1.0, False, True)
    with cs.sanitize(False):  # the data alone says the same
        assert _two_streams("view") == (1.0, 1.0, False, True)


def test_the_control_an_unheld_reader_on_the_second_stream_reads_the_next_owner() -> None:
    """Nothing holds the owner for ``s2``: freed once ``s1``'s hold goes, the
    block is handed on while ``s2`` still has to read it (wrong data), and the
    sanitizer names it on every run."""
    with cs.sanitize(False):
        assert _two_streams("unheld") == (1.0, 3.0, True, False)
    with pytest.raises(cs.HazardError, match=reused_under("read on s2")):
        _two_streams("unheld")


@pytest.mark.parametrize("held", ["owner", "slice", "nothing"])
def test_an_owner_dropped_after_another_thread_released_its_hold_is_freed_after_the_work(
    held: str,
) -> None:
    """The hold (on the owner, or on a slice of it that the reader reads) is
    released by another thread, which saw the stream pass it; this thread,
    which never waited for the stream, drops the owner later: the free comes
    after the work (the hold kept the memory until then), so it is no hazard.
    The control (``nothing``): dropped while the gated reader still has to
    run, the block is reused under it, and the sanitizer names it."""
    s = cs.Stream()
    gate = threading.Event()
    out = sim.empty(N // 2, "float32")
    owner = sim.asarray(np.full(N, 1.0, np.float32))
    ptr = owner.ptr
    part = owner[: N // 2]
    sim.launch(s, lambda: gate.wait(WAIT), name="gate")
    sim.launch(s, _copy, out, part, reads=[part], writes=[out], name="reader")
    if held != "nothing":
        cs.hold(owner if held == "owner" else part, until=s)
        gate.set()
        _elsewhere(lambda: _until(lambda: _holds() == 0))
    del part
    gc.collect()
    try:
        del owner  # here: a thread that never waited for s
        gc.collect()
        if held == "nothing":
            with pytest.raises(cs.HazardError, match=reused_under("reader")):
                sim.asarray(np.full(N, 2.0, np.float32))
            with cs.sanitize(False):
                assert sim.asarray(np.full(N, 2.0, np.float32)).ptr == ptr
        else:
            assert sim.asarray(np.full(N, 2.0, np.float32)).ptr == ptr
    finally:
        gate.set()
        s.synchronize()
    assert float(out.to_host()[0]) == (2.0 if held == "nothing" else 1.0)


def test_a_released_hold_orders_only_frees_not_the_host() -> None:
    """What a released hold vouches for is the free of its owner's memory,
    not the program: a host write of the (still living) owner by a thread that
    never waited for the stream is still a race, after the hold went."""
    s = cs.Stream()
    owner = sim.asarray(np.full(N, 1.0, np.float32))
    out = sim.empty(N, "float32")
    keep = owner  # the program's own reference: the hold's release frees nothing
    sim.launch(s, _copy, out, owner, reads=[owner], writes=[out], name="reader")
    cs.hold(owner, until=s)
    _elsewhere(lambda: _until(lambda: _holds() == 0))
    assert any(a.held for seg in _sanitizer._state.shadows for a in seg.accesses())
    with pytest.raises(cs.HazardError, match="reader"):
        sim.launch(cs.Stream(), _fill, keep, writes=[keep], name="overwrite")
    s.synchronize()
