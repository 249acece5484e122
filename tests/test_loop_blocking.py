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

from .device_ops import DeviceOps, writing_in_another_thread

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


def _latched_fill(ops: DeviceOps) -> tuple[cs.Stream, Any, Any]:
    """A stream held by a latch, and an array it then fills with 7s."""
    s = cs.Stream()
    arr = ops.array(np.zeros(4, np.float32))
    latch = ops.latch(s)
    ops.fill(s, arr, 7.0)
    return s, arr, latch


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
    s, arr, latch = _latched_fill(ops)
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
    s, arr, latch = _latched_fill(ops)
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


@pytest.mark.parametrize("access", ["writing", "reading", "consume_blocking"])
async def test_a_wait_for_another_threads_block_warns_at_the_callers_line(
    ops: DeviceOps, anyio_backend: str, access: str
) -> None:
    """The access waits until the other thread's ``writing()`` block ends.
    ``writing()`` and ``reading()`` are generator contexts: the warning skips
    contextlib's frames too, and names this line."""
    s = cs.Stream()
    t = cs.track(ops.array(np.zeros(4, np.float32)), stream=s)
    with writing_in_another_thread(t, s) as leave:
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
    (w,) = caught.list
    assert w.filename == __file__, "the warning names a line inside the library or contextlib"
    message = str(w.message)
    assert f"{access}() is about to wait for another thread's writing()" in message
    assert ("`await cs.consume()`" in message) is (access == "consume_blocking")
    assert "worker thread" in message


@pytest.mark.parametrize("kind", ["GPU work", "another thread's block"])
async def test_a_call_that_would_not_wait_gives_no_warning(
    ops: DeviceOps, anyio_backend: str, kind: str
) -> None:
    """``timeout=0`` takes what is ready now and never waits: a plain
    TimeoutError, not the warning (under ``-W error`` it was raised instead)."""
    s = cs.Stream()
    arr = ops.array(np.zeros(4, np.float32))
    latch = ops.latch(s)
    t = cs.track(ops.array(np.zeros(4, np.float32)), stream=s)
    try:
        with writing_in_another_thread(t, s):
            target: object = _Producer(arr, s.handle) if kind == "GPU work" else t
            with warnings.catch_warnings():
                warnings.simplefilter("error", cs.LoopBlockingWarning)
                with pytest.raises(TimeoutError):
                    cs.consume_blocking(target, timeout=0)
    finally:
        latch.release()


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
