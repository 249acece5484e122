"""A blocking wait in an event loop's thread gives LoopBlockingWarning, naming
the caller's line and the awaitable to use; a wait that would not block, or
one in a worker thread, gives nothing."""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
import pytest

import cai_streams as cs
from cai_streams._loop_thread import loop_running

from .device_ops import DeviceOps

pytestmark = pytest.mark.anyio

#: how long the stream stays held after the blocking call begins
HELD = 0.05


class _Producer:
    """An untracked producer naming ``stream``: consume_blocking waits for it."""

    def __init__(self, arr: Any, stream: int) -> None:
        self._arr, self._stream = arr, stream

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        cai = dict(self._arr.__cuda_array_interface__)
        cai["stream"] = self._stream
        return cai


def _calls(ops: DeviceOps, s: cs.Stream, arr: Any) -> dict[str, Callable[[], object]]:
    """Each blocking call, waiting for work on ``s`` (filled in with 7s)."""
    return {
        "consume_blocking": lambda: cs.consume_blocking(_Producer(arr, s.handle), timeout=10),
        "Stream.synchronize": s.synchronize,
        "Event.synchronize": s.record().synchronize,
    }


CALLS = ["consume_blocking", "Stream.synchronize", "Event.synchronize"]
INSTEAD = {
    "consume_blocking": "await cs.consume()",
    "Stream.synchronize": "await stream.record().wait()",
    "Event.synchronize": "await event.wait()",
}


@pytest.mark.parametrize("call", CALLS)
async def test_a_blocking_wait_in_the_loop_thread_warns_at_the_callers_line(
    ops: DeviceOps, anyio_backend: str, call: str
) -> None:
    s = cs.Stream()
    arr = ops.array(np.zeros(4, np.float32))
    latch = ops.latch(s)
    ops.fill(s, arr, 7.0)
    blocking = _calls(ops, s, arr)[call]
    timer = threading.Timer(HELD, latch.release)  # (the loop is blocked: another thread)
    timer.start()
    try:
        with pytest.warns(cs.LoopBlockingWarning) as caught:
            began = time.monotonic()
            blocking()
            waited = time.monotonic() - began
    finally:
        timer.join()
    assert waited >= HELD * 0.5, "it did not wait: the warning would be wrong"
    (w,) = caught.list
    assert w.filename == __file__, "the warning names a line inside the library"
    message = str(w.message)
    assert f"running {anyio_backend} event loop" in message
    assert INSTEAD[call] in message
    assert ops.to_host(arr).tolist() == [7.0] * 4


@pytest.mark.parametrize("call", CALLS)
async def test_a_wait_that_would_not_block_gives_no_warning(
    ops: DeviceOps, anyio_backend: str, call: str
) -> None:
    s = cs.Stream()
    arr = ops.array(np.zeros(4, np.float32))
    ops.fill(s, arr, 7.0)
    blocking = _calls(ops, s, arr)[call]
    await s.record().wait()  # complete: nothing to block on
    with warnings.catch_warnings():
        warnings.simplefilter("error", cs.LoopBlockingWarning)
        blocking()


@pytest.mark.parametrize("call", CALLS)
async def test_a_worker_threads_blocking_wait_gives_no_warning(
    ops: DeviceOps, anyio_backend: str, call: str
) -> None:
    s = cs.Stream()
    arr = ops.array(np.zeros(4, np.float32))
    latch = ops.latch(s)
    ops.fill(s, arr, 7.0)
    blocking = _calls(ops, s, arr)[call]

    def in_worker() -> list[warnings.WarningMessage]:
        assert loop_running() is None
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            blocking()
        return seen

    got: list[list[warnings.WarningMessage]] = []

    async def worker() -> None:
        got.append(await anyio.to_thread.run_sync(in_worker))

    async with anyio.create_task_group() as tg:
        tg.start_soon(worker)
        await anyio.sleep(HELD)  # the loop runs meanwhile, the worker waits
        assert not got, "the worker did not wait: nothing to warn of"
        latch.release()
    (seen,) = got
    assert not [w for w in seen if w.category is cs.LoopBlockingWarning]
    assert ops.to_host(arr).tolist() == [7.0] * 4


async def test_waiting_for_another_threads_block_warns(ops: DeviceOps, anyio_backend: str) -> None:
    """consume_blocking of a tracked array whose writing() block another thread
    holds blocks the loop until that block ends."""
    s = cs.Stream()
    t = cs.track(ops.array(np.zeros(4, np.float32)), stream=s)
    entered, leave = threading.Event(), threading.Event()

    def writer() -> None:
        with t.writing(s):
            ops.fill(s, t, 7.0)
            entered.set()
            leave.wait(10)

    th = threading.Thread(target=writer)
    th.start()
    try:
        assert await anyio.to_thread.run_sync(entered.wait, 10)
        timer = threading.Timer(HELD, leave.set)
        timer.start()
        with pytest.warns(cs.LoopBlockingWarning) as caught:
            cs.consume_blocking(t, stream=cs.Stream())
        timer.join()
    finally:
        leave.set()
        th.join(10)
    (w,) = caught.list
    assert w.filename == __file__
    message = str(w.message)
    assert "consume_blocking() is about to wait for another thread's writing()" in message
    assert "`await cs.consume()`" in message


@pytest.mark.parametrize("access", ["writing", "reading", "consume_blocking"])
async def test_a_wait_for_another_threads_block_names_the_callers_line(
    ops: DeviceOps, anyio_backend: str, access: str
) -> None:
    """``writing()`` and ``reading()`` are generator contexts: the warning skips
    contextlib's frames too, so each caller's line is named (and the default
    filter's once-per-line does not fold two callers into one)."""
    s = cs.Stream()
    t = cs.track(ops.array(np.zeros(4, np.float32)), stream=s)
    lines = []

    def writer(entered: threading.Event, leave: threading.Event) -> None:
        with t.writing(s):
            entered.set()
            leave.wait(10)

    for _ in range(2):
        entered, leave = threading.Event(), threading.Event()
        th = threading.Thread(target=writer, args=(entered, leave))
        th.start()
        assert await anyio.to_thread.run_sync(entered.wait, 10)
        timer = threading.Timer(HELD, leave.set)
        timer.start()
        try:
            with pytest.warns(cs.LoopBlockingWarning) as caught:
                if access == "consume_blocking":
                    cs.consume_blocking(t, stream=cs.Stream())
                else:
                    with getattr(t, access)(cs.Stream()):
                        pass
        finally:
            timer.join()
            leave.set()
            th.join(10)
        (w,) = caught.list
        assert w.filename == __file__
        lines.append(w.lineno)
        instead = "`await cs.consume()`" in str(w.message)
        assert instead is (access == "consume_blocking")
    assert lines[0] == lines[1] and lines[0] > 0


@pytest.mark.parametrize("kind", ["GPU work", "another thread's block"])
async def test_a_call_that_would_not_wait_gives_no_warning(
    ops: DeviceOps, anyio_backend: str, kind: str
) -> None:
    """``timeout=0`` takes what is ready now and never waits: a plain
    TimeoutError, not the warning (under ``-W error`` it was raised instead)."""
    s = cs.Stream()
    arr = ops.array(np.zeros(4, np.float32))
    latch = ops.latch(s)
    entered, leave = threading.Event(), threading.Event()
    t = cs.track(ops.array(np.zeros(4, np.float32)), stream=s)

    def writer() -> None:
        with t.writing(s):
            entered.set()
            leave.wait(10)

    th = threading.Thread(target=writer)
    th.start()
    try:
        assert await anyio.to_thread.run_sync(entered.wait, 10)
        target: object = _Producer(arr, s.handle) if kind == "GPU work" else t
        with warnings.catch_warnings():
            warnings.simplefilter("error", cs.LoopBlockingWarning)
            with pytest.raises(TimeoutError):
                cs.consume_blocking(target, timeout=0)
    finally:
        leave.set()
        latch.release()
        th.join(10)


async def test_a_default_streams_synchronize_always_warns(anyio_backend: str) -> None:
    """Its synchronize also waits for other streams' work, which a query of it
    does not see: said even when it is idle."""
    cs.use_backend("sim")
    for handle in (1, 2):
        with pytest.warns(cs.LoopBlockingWarning, match="of a default stream may wait") as caught:
            cs.Stream.wrap(handle).synchronize()
        assert caught.list[0].filename == __file__


def test_a_frame_named_through_dotdot_is_still_the_librarys() -> None:
    """``sys.path.insert(0, "<dir>/..")`` names the package's files through
    "..": they are still skipped, and the warning names the user's line."""
    from cai_streams import _loop_thread

    inside = os.path.join(os.path.dirname(_loop_thread.__file__), "..", "cai_streams", "_stream.py")
    assert _loop_thread._skips(inside)
    assert not _loop_thread._skips(__file__)
