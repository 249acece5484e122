"""A capture that ends while a block (or a consumer's read) on its stream is open.

The block's work from inside the capture is in the graph, but the block's
record comes at its end, after the capture: an ordinary record, which orders
nothing about a launch. ``end_capture`` hands such buffers to the graph, so
each launch is ordered like a block on the launch stream. Each test proves it
with data: a slow captured kernel, a launch, then a consumer (or a writer)
that must wait for the launch. Its control is the same program with that
step undone (``_capture._note_open_on`` and ``ended_in`` no-ops, as before): the
consumer reads the old data, or the writer overwrites what the graph was
about to read. The fixed runs are sanitized: the sanitizer checks each
replay on the stream it is launched on, and stays silent.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import anyio
import numpy as np
import pytest

import cai_streams as cs
from cai_streams import _capture, sim

SLOW = 0.2  # seconds a captured kernel runs at each launch


@pytest.fixture(autouse=True)
def _sim() -> None:
    cs.use_backend("sim")


@contextlib.contextmanager
def _as_fixed(fixed: bool, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Sanitized when ``fixed``; else the control: the open blocks and reads
    on a capture's stream are not handed to its graph, neither at its end nor
    at theirs."""
    if not fixed:
        monkeypatch.setattr(_capture, "_note_open_on", lambda capture, key: None)
        monkeypatch.setattr(_capture, "ended_in", lambda *args: None)
    with cs.sanitize(fixed):
        yield


def _fill(value: float) -> Any:
    def fill(a: Any) -> None:
        a[...] = value

    return fill


def _copy(dst: Any, src: Any) -> None:
    dst[...] = src


def _consumed(x: Any) -> Any:
    """What a host consumer of ``x`` sees (a copy, taken when the consume returns)."""
    got = sim._numpy_view(cs.consume_blocking(x, timeout=10))
    assert got is not None
    return got.copy()


@pytest.mark.parametrize(
    ("opened", "mode"),
    [("before", "global"), ("before", "thread_local"), ("before", "relaxed"), ("inside", "global")],
)
@pytest.mark.parametrize("fixed", [True, False], ids=["noted", "control"])
def test_a_capture_ending_inside_a_writing_block_orders_the_next_consumer_after_each_launch(
    opened: str, mode: str, fixed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The block opened before the capture began, or inside it; the capture
    ends inside the block either way."""
    s, launch_on = cs.Stream(), cs.Stream()
    x = sim.asarray(np.zeros(4, np.float32))
    tx = cs.track(x)
    with _as_fixed(fixed, monkeypatch):
        if opened == "inside":
            s.begin_capture(mode)
        with tx.writing(s):
            if opened == "before":
                s.begin_capture(mode)
            sim.launch(s, _fill(9.0), x, writes=[x], duration=SLOW)
            graph = s.end_capture()
        graph.launch(launch_on)
        got = _consumed(x)
        launch_on.synchronize()
    graph.close()
    assert (got == (9.0 if fixed else 0.0)).all(), got


@pytest.mark.parametrize("reader", ["reading() block", "consume(stream=s)"])
@pytest.mark.parametrize("fixed", [True, False], ids=["noted", "control"])
def test_a_read_open_when_its_capture_ends_orders_the_next_writer_after_each_launch(
    reader: str, fixed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Write after read: the graph's read of ``x`` comes before the writer's
    fill. The read is a ``reading()`` block the capture ends in, or the
    consumer's read from ``consume(x, stream=s)``, open when it ends."""
    s, launch_on, w = cs.Stream(), cs.Stream(), cs.Stream()
    x = sim.asarray(np.full(4, 5.0, np.float32))
    out = sim.asarray(np.zeros(4, np.float32))
    tx = cs.track(x)
    with _as_fixed(fixed, monkeypatch):
        if reader == "reading() block":
            with tx.reading(s):
                s.begin_capture("global")
                sim.launch(s, _copy, out, x, reads=[x], writes=[out], duration=SLOW)
                graph = s.end_capture()
        else:
            view = cs.consume_blocking(tx, stream=s, timeout=10)
            s.begin_capture("global")
            sim.launch(s, _copy, out, view, reads=[view], writes=[out], duration=SLOW)
            graph = s.end_capture()
        graph.launch(launch_on)
        with tx.writing(w):
            sim.launch(w, _fill(7.0), x, writes=[x])
        launch_on.synchronize()
        w.synchronize()
    graph.close()
    assert (out.to_host() == (5.0 if fixed else 7.0)).all()


@pytest.mark.anyio
@pytest.mark.parametrize("fixed", [True, False], ids=["noted", "control"])
async def test_a_capture_inside_a_consuming_body_orders_the_next_writer_after_each_launch(
    fixed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    s, launch_on, w = cs.Stream(), cs.Stream(), cs.Stream()
    x = sim.asarray(np.full(4, 5.0, np.float32))
    out = sim.asarray(np.zeros(4, np.float32))
    tx = cs.track(x)
    with _as_fixed(fixed, monkeypatch):
        async with cs.consuming(tx, stream=s, timeout=10) as view:
            s.begin_capture("global")
            sim.launch(s, _copy, out, view, reads=[view], writes=[out], duration=SLOW)
            graph = s.end_capture()
        graph.launch(launch_on)
        with tx.writing(w):
            sim.launch(w, _fill(7.0), x, writes=[x])
        await anyio.to_thread.run_sync(launch_on.synchronize)
        w.synchronize()
    graph.close()
    assert (out.to_host() == (5.0 if fixed else 7.0)).all()


@pytest.mark.parametrize("waited", [True, False], ids=["consumed", "control"])
def test_a_stream_of_another_device_forked_into_a_capture_hands_its_array_to_the_graph(
    waited: bool,
) -> None:
    """The capture begins on device 0; a stream of device 1 joins it through
    an event and writes an array of device 1 there. A host consumer after the
    launch waits for it (the array was noted only for captures of its own
    device). Control: a read right after the launch, with no consume, sees
    the old data (the launch is still running then)."""
    backend = cs.current_backend()
    if backend.device_count() < 2:
        pytest.skip("needs two simulated devices")
    s, side, launch_on = cs.Stream(device=0), cs.Stream(device=1), cs.Stream(device=0)
    x = sim.asarray(np.zeros(4, np.float32), device=1)
    tx = cs.track(x)
    with cs.sanitize(waited):
        s.begin_capture("global")
        side.wait(s.record())  # (side joins the capture)
        with tx.writing(side):
            sim.launch(side, _fill(9.0), x, writes=[x], duration=SLOW)
        s.wait(side.record())  # (and is joined back)
        graph = s.end_capture()
        graph.launch(launch_on)
        if waited:
            got = _consumed(x)
        else:
            got = np.array(sim._numpy_view(x))
        launch_on.synchronize()
    graph.close()
    assert (got == (9.0 if waited else 0.0)).all(), got


@pytest.mark.parametrize("fixed", [True, False], ids=["noted", "control"])
def test_a_block_ending_between_the_drivers_end_and_the_look_for_open_blocks_is_noted(
    fixed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another thread's block on the capturing stream ends while
    ``end_capture`` runs: after the driver ended the capture (its record is
    ordinary) and before the look for open blocks (it is gone from them). Its
    end hands the array to the graph (``ended_in``). The window is made
    deterministic: the driver's end lets the block end and waits for it."""
    if not fixed:
        monkeypatch.setattr(_capture, "ended_in", lambda *args: None)
    backend = cs.current_backend()
    entered, may_leave, left = threading.Event(), threading.Event(), threading.Event()
    real_end = type(backend).end_capture

    def end_capture(self: Any, stream: int) -> int:
        graph: int = real_end(self, stream)
        may_leave.set()
        left.wait(10)
        return graph

    monkeypatch.setattr(type(backend), "end_capture", end_capture)
    s, launch_on = cs.Stream(), cs.Stream()
    x = sim.asarray(np.zeros(4, np.float32))
    tx = cs.track(x)

    def writer() -> None:
        with tx.writing(s):
            sim.launch(s, _fill(9.0), x, writes=[x], duration=SLOW)  # captured
            entered.set()
            may_leave.wait(10)
        left.set()

    with cs.sanitize(False):
        s.begin_capture("relaxed")
        thread = threading.Thread(target=writer)
        thread.start()
        assert entered.wait(10)
        graph = s.end_capture()
        thread.join(10)
        graph.launch(launch_on)
        got = _consumed(x)
        launch_on.synchronize()
    graph.close()
    assert (got == (9.0 if fixed else 0.0)).all(), got


@pytest.mark.parametrize("fork_device", [0, 1])
def test_a_forked_stream_is_its_captures_with_two_devices_capturing(fork_device: int) -> None:
    """One capture under way on each device; a stream of device ``fork_device``
    forked into device 0's capture (``Stream.wait`` of an event recorded in it)
    writes an array of that device: device 0's graph has it, device 1's does
    not. Device 0: looking on the whole backend found two captures and gave
    up. Device 1: it was given to device 1's, the only one on the fork's
    device, and launching that one into a capture waited for the array's work
    (CaptureError)."""
    backend = cs.current_backend()
    if backend.device_count() < 2:
        pytest.skip("needs two simulated devices")
    s0, launch_on = cs.Stream(device=0), cs.Stream(device=0)
    s1, side = cs.Stream(device=1), cs.Stream(device=fork_device)
    x = sim.asarray(np.zeros(4, np.float32), device=fork_device)
    tx = cs.track(x)
    with cs.sanitize():
        s1.begin_capture("relaxed")
        s0.begin_capture("relaxed")
        side.wait(s0.record())  # (side joins device 0's capture)
        with tx.writing(side):
            sim.launch(side, _fill(9.0), x, writes=[x], duration=SLOW)
        s0.wait(side.record())
        graph0 = s0.end_capture()
        graph1 = s1.end_capture()
        assert graph1._capture is not None and not graph1._capture.touched
        graph0.launch(launch_on)
        got = _consumed(x)
        launch_on.synchronize()
    graph0.close()
    graph1.close()
    assert (got == 9.0).all(), got


@pytest.mark.parametrize("fixed", [True, False], ids=["noted", "control"])
def test_a_consumer_read_recorded_between_the_drivers_end_and_the_look_is_noted(
    fixed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A consumer's read open on the capturing stream, which a captured kernel
    reads; another thread's writer records it while ``end_capture`` runs (after
    the driver's end, before the look for open reads). Its record hands the
    array to the graph, so a writer after the launch waits for its read."""
    if not fixed:
        monkeypatch.setattr(_capture, "ended_in", lambda *args: None)
    backend = cs.current_backend()
    s, launch_on, w0, w = cs.Stream(), cs.Stream(), cs.Stream(), cs.Stream()
    x = sim.asarray(np.full(4, 5.0, np.float32))
    out = sim.asarray(np.zeros(4, np.float32))
    tx = cs.track(x)

    def writer() -> None:
        with tx.writing(w0):  # (records the consumer's read on s, and waits for it)
            sim.launch(w0, _fill(6.0), x, writes=[x])
        w0.synchronize()

    real_end = type(backend).end_capture

    def end_capture(self: Any, stream: int) -> int:
        graph: int = real_end(self, stream)
        thread = threading.Thread(target=writer)
        thread.start()
        thread.join(10)
        return graph

    with cs.sanitize(False):
        view = cs.consume_blocking(tx, stream=s, timeout=10)
        s.begin_capture("global")
        sim.launch(s, _copy, out, view, reads=[view], writes=[out], duration=SLOW)
        monkeypatch.setattr(type(backend), "end_capture", end_capture)
        graph = s.end_capture()
        monkeypatch.setattr(type(backend), "end_capture", real_end)
        graph.launch(launch_on)
        with tx.writing(w):  # after the launch's read of x
            sim.launch(w, _fill(7.0), x, writes=[x])
        launch_on.synchronize()
        w.synchronize()
    graph.close()
    assert (out.to_host() == (6.0 if fixed else 7.0)).all()


def test_a_stream_joined_to_a_capture_a_reset_ended_is_taken_for_the_next_capture() -> None:
    """A stream joined capture A through ``Stream.wait``; a reset ended A
    unseen by the library; capture B begins, and the stream is forked into it
    by a raw wait: its write is B's (it was taken for A's, and B's graph
    ordered nothing: a consumer after B's launch read the old data)."""
    backend = cs.current_backend()
    s0, s1, joined, launch_on = cs.Stream(), cs.Stream(), cs.Stream(), cs.Stream()
    with cs.sanitize(False):  # (a reset: the sanitizer's view of A's work ends there)
        s0.begin_capture("relaxed")
        joined.wait(s0)
        sim.reset()  # (A ended, invalidated)
        a = sim.asarray(np.zeros(4, np.float32))
        ta = cs.track(a)
        s1.begin_capture("relaxed")
        event = backend.create_event()
        backend.record(event, s1.handle)
        backend.stream_wait_event(joined.handle, event)  # (a fork the library does not see)
        with ta.writing(joined):
            sim.launch(joined, _fill(3.0), a, writes=[a], duration=SLOW)
        s1.wait(joined.record())
        graph = s1.end_capture()
        graph.launch(launch_on)
        got = _consumed(a)
        launch_on.synchronize()
    graph.close()
    backend.destroy_event(event)
    assert (got == 3.0).all(), got
