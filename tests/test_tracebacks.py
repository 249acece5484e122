"""``_tracebacks.release_frames``: a kept exception keeps none of the library's locals."""

from __future__ import annotations

import gc
import sys
import threading
import weakref
from collections.abc import Awaitable, Callable
from types import FrameType, TracebackType
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

import cai_streams as cs
from cai_streams import sim
from cai_streams._consume import _finish_all
from cai_streams._tracebacks import release_frames

from .device_ops import SimOps


def _frames(tb: TracebackType | None) -> list[FrameType]:
    found = []
    while tb is not None:
        found.append(tb.tb_frame)
        tb = tb.tb_next
    return found


def _users_helper(marker: object) -> None:
    cs.configure(sync=marker)  # type: ignore[arg-type]  # TypeError inside the library


def _caught() -> BaseException:
    try:
        _users_helper(object())
    except TypeError as exc:
        return exc
    raise AssertionError("configure accepted a non-bool")


def test_the_librarys_finished_frames_lose_their_locals_and_no_other_frame_does() -> None:
    exc = _caught()
    head, helper, library = _frames(exc.__traceback__)
    assert library.f_globals["__name__"] == "cai_streams._config"
    assert "sync" in library.f_locals  # the control: a kept traceback keeps them
    release_frames(exc)
    assert library.f_locals == {}
    assert "marker" in helper.f_locals  # the user's own frames are left alone
    assert head.f_code is _caught.__code__


def test_chained_and_grouped_exceptions_are_visited_and_a_running_frame_is_left() -> None:
    inner = _caught()
    library = _frames(inner.__traceback__)[-1]
    try:
        try:
            raise inner
        except TypeError as exc:
            raise RuntimeError("outer") from exc
    except RuntimeError as outer:
        group = [outer]
        release_frames(outer)  # this frame is the head: it runs on, untouched
        assert group  # (a cleared running frame would have lost this local)
    assert library.f_locals == {}
    if sys.version_info >= (3, 11):
        again = _caught()
        library = _frames(again.__traceback__)[-1]
        release_frames(BaseExceptionGroup("group", [again]))  # noqa: F821
        assert library.f_locals == {}


def test_an_exception_without_a_traceback_is_fine() -> None:
    exc = ValueError("never raised")
    release_frames(exc)
    assert exc.__traceback__ is None


# -- the consume calls: nothing of a failed one outlives its work through the exception --


async def _consume(items: list[Any]) -> None:
    await cs.consume(items.pop(), timeout=0.02)


async def _consume_all(items: list[Any]) -> None:
    await cs.consume_all(items.pop(), timeout=0.02)


async def _consuming(items: list[Any]) -> None:
    async with cs.consuming(items.pop(), timeout=0.02):
        raise AssertionError("the work is held: the block is never entered")


async def _blocking(items: list[Any]) -> None:
    cs.consume_blocking(items.pop(), timeout=0.02)


@pytest.mark.anyio
@pytest.mark.parametrize("call", [_consume, _consume_all, _consuming, _blocking])
async def test_a_kept_timeout_does_not_keep_the_array_the_caller_dropped(
    call: Callable[[list[Any]], Awaitable[None]],
) -> None:
    """The array is the view's owner and the consume call's own argument: the
    call's frame, the head of the traceback, must let go of it too (the caller
    takes it out of a list, so no frame of the test holds it)."""
    cs.use_backend("sim")
    ops = SimOps()
    p = cs.Stream()
    arr = ops.array(np.zeros(64, "float32"))
    latch = ops.latch(p)
    ops.fill(p, arr, 1.0)
    arr.stream = p.handle  # a version 3 interface naming the producer's stream
    ref = weakref.ref(arr)
    items = [arr]
    del arr
    with pytest.raises(TimeoutError) as kept:
        await call(items)
    latch.release()
    await anyio.lowlevel.checkpoint()
    assert sim.device().drain(timeout=30)
    cs.stats()
    gc.collect()
    assert ref() is None, "the kept exception keeps the array alive"
    assert "GPU work not complete" in str(kept.value)


@pytest.mark.anyio
async def test_every_handoff_of_consume_all_is_finished_when_one_finish_raises() -> None:
    """The sanitizer names a hazard at ``a``'s host read, in its handoff's
    finish: ``b``'s handoff, begun too, must still give back its event and its
    pin (it did not when ``a`` came first; the control, ``b`` first, did)."""
    cs.use_backend("sim")
    ops = SimOps()
    p, p2, q = cs.Stream(), cs.Stream(), cs.Stream()
    a = ops.array(np.zeros(8, "float32"))
    ops.fill(p, a, 1.0)
    a.stream = p.handle
    b = cs.track(ops.array(np.zeros(8, "float32")))
    latch = ops.latch(p2)
    with b.writing(p2):
        ops.fill(p2, b.array, 2.0)

    async def writer() -> None:
        await anyio.sleep(0.02)
        q.wait(p)  # after a's producer, but unordered with the host read to come
        ops.fill(q, a, 3.0)
        latch.release()

    before = cs.stats()
    named: list[cs.HazardError] = []
    with cs.sanitize():
        async with anyio.create_task_group() as tg:
            tg.start_soon(writer)
            try:
                await cs.consume_all(a, b, timeout=10)
            except cs.HazardError as exc:
                named.append(exc)
    assert named, "the sanitizer names the write after a's read"
    assert sim.device().drain(timeout=30)
    gc.collect()
    after = cs.stats()
    assert after["events_pinned"] == before["events_pinned"]
    assert after["events_in_flight"] <= before["events_in_flight"]


def test_a_blocking_consume_that_times_out_behind_a_write_block_keeps_nothing() -> None:
    """``consume_blocking`` waits for another thread's ``writing()`` block of
    the array and times out there: the kept exception must not keep the array
    the caller dropped (that wait was outside the part that lets go)."""
    cs.use_backend("sim")
    s = cs.Stream()
    items = [cs.track(SimOps().array(np.zeros(64, "float32")))]
    ref = weakref.ref(items[0])
    inside, finish = threading.Event(), threading.Event()

    def writer(t: cs.TrackedArray) -> None:
        with t.writing(s):
            inside.set()
            finish.wait(10)

    thread = threading.Thread(target=writer, args=(items[0],))
    thread.start()
    try:
        assert inside.wait(10)
        with pytest.raises(TimeoutError) as kept:
            cs.consume_blocking(items.pop(), timeout=0.05)
    finally:
        finish.set()
        thread.join(10)
    s.synchronize()
    cs.stats()
    gc.collect()
    assert ref() is None, "the kept exception keeps the array alive"
    assert kept.value.__traceback__ is not None


class _Finishing:
    def __init__(self, error: BaseException | None) -> None:
        self.error = error
        self.finished = False

    def finish(self, *, complete: bool) -> None:
        self.finished = True
        if self.error is not None:
            raise self.error


def test_finishing_all_handoffs_raises_an_interrupt_over_an_error() -> None:
    """Every handoff is finished; an interrupt (or a cancellation) that comes
    after an error is raised, with the error as its context, not lost."""
    handoffs = [_Finishing(ValueError("hazard")), _Finishing(KeyboardInterrupt()), _Finishing(None)]
    with pytest.raises(KeyboardInterrupt) as raised:
        _finish_all(handoffs, complete=False)  # type: ignore[arg-type]
    assert isinstance(raised.value.__context__, ValueError)
    assert all(h.finished for h in handoffs)
    errors = [_Finishing(ValueError("first")), _Finishing(RuntimeError("second"))]
    with pytest.raises(ValueError, match="first"):
        _finish_all(errors, complete=True)  # type: ignore[arg-type]
    assert all(h.finished for h in errors)
