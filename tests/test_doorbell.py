"""The doorbell beside the poller: it wakes waiters, and leaks nothing.

Each guarantee is shown against a control: a poller that sleeps long between
passes wakes late unless a bell rings; counters of armed, fired and retired
bells balance once nothing is pending, whatever became of the waiters.
"""

from __future__ import annotations

import functools
import gc
import os
import random
import select
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, cast

import anyio
import numpy as np
import pytest

import cai_streams as cs
from cai_streams import _doorbell, _poller, sim

from .device_ops import DeviceOps

pytestmark = pytest.mark.anyio

_PROC_FDS = os.path.isdir("/proc/self/fd")
#: a poller that would wake its waiters this long after their work ends
SLOW = 0.25


@pytest.fixture(autouse=True)
def _defaults() -> Iterator[None]:
    yield
    cs.configure(poll=cs.PollPolicy())


def _sleepy(wake: str) -> cs.PollPolicy:
    """A policy whose passes are SLOW apart: only a bell wakes a waiter sooner."""
    return cs.PollPolicy(spin=0, first=SLOW, cap=SLOW, fallback=SLOW, wake=wake)  # type: ignore[arg-type]


def _never_backs_off(cap: float = SLOW * 2) -> cs.PollPolicy:
    """Passes ``cap / 2`` apart, never backed off to ``cap``: a bell is armed
    for a new head, or chained by a completion, and never by backing off."""
    return cs.PollPolicy(
        spin=0, first=cap / 2, growth=1.0, cap=cap, fallback=cap / 2, wake="doorbell"
    )


def _settled() -> dict[str, int]:
    cs.current_backend().synchronize_stream(1)
    return cs.stats()


def _np(arr: object) -> np.ndarray[Any, Any]:
    """The host memory behind a simulated array."""
    view = sim._numpy_view(arr)
    assert view is not None
    return view


async def _poller_ended() -> None:
    with anyio.fail_after(10):
        while _poller._current_poller().running:  # noqa: ASYNC110 - its own state, no event
            await anyio.sleep(0.005)


async def _fds_after_timed_out_waits(events: list[cs.Event], baseline: int) -> list[int]:
    """Wait on each event in turn, giving up after 1 ms; the descriptors the
    doorbell holds (above ``baseline``) once each wait's poller has ended."""
    held = []
    for event in events:
        with anyio.move_on_after(0.001):
            await event.wait()
        await _poller_ended()
        held.append(_doorbell._doorbell.fds - baseline)
    return held


def _sync_lanes() -> None:
    """Every host function enqueued on the notifier streams (retired ones too)
    has run, or been skipped."""
    doorbell = _doorbell._doorbell
    for lane in [*(lane for pool in doorbell.lanes.values() for lane in pool), *doorbell.retiring]:
        lane.backend.synchronize_stream(lane.stream)


async def _open_fds() -> int | None:
    """This process's open descriptors once every poller of this loop has ended
    and every notifier stream is idle (None where /proc is missing)."""
    if not _PROC_FDS:
        return None
    await _poller_ended()
    _sync_lanes()
    cs.stats()  # its sweep settles the bells retired without firing
    return len(os.listdir("/proc/self/fd"))


async def _wake_times(*waits: tuple[str, cs.Event]) -> dict[str, float]:
    """Seconds until each wait returned, the waits started 5 ms apart in this
    order (so the first one's bell is armed first)."""
    woke: dict[str, float] = {}
    start = time.perf_counter()

    async def wait(name: str, event: cs.Event) -> None:
        await event.wait()
        woke[name] = time.perf_counter() - start

    async with anyio.create_task_group() as tg:
        for i, (name, event) in enumerate(waits):
            if i:
                await anyio.sleep(0.005)
            tg.start_soon(wait, name, event)
    return woke


def _slow_and_fast() -> tuple[cs.Event, cs.Event]:
    """Under a policy whose passes are SLOW apart: an event after 2 SLOW on one
    stream, and one after 20 ms on another."""
    cs.use_backend("sim")
    cs.configure(poll=_sleepy("doorbell"))
    slow, fast = cs.Stream(), cs.Stream()
    sim.launch(slow, lambda: None, duration=SLOW * 2)
    slow_event = slow.record()
    sim.launch(fast, lambda: None, duration=0.02)
    return slow_event, fast.record()


async def _time_one_wait(duration: float) -> float:
    s = cs.Stream()
    sim.launch(s, lambda: None, duration=duration)
    event = s.record()
    start = time.perf_counter()
    await event.wait()
    elapsed = time.perf_counter() - start
    event.close()
    s.close()
    return elapsed


async def test_a_bell_wakes_the_waiter_long_before_the_next_pass() -> None:
    cs.use_backend("sim")
    cs.configure(poll=_sleepy("poll"))
    polled = await _time_one_wait(0.02)  # control: woken at the pass after SLOW
    before = _settled()
    cs.configure(poll=_sleepy("doorbell"))
    rung = await _time_one_wait(0.02)
    after = _settled()
    assert polled > SLOW * 0.9  # the control is late, as its policy says
    assert rung < polled / 2, (rung, polled)
    assert after["doorbells_armed"] > before["doorbells_armed"]
    assert after["doorbells_fired"] - before["doorbells_fired"] == 1


async def test_a_stream_that_completes_first_is_not_held_behind_a_slow_one() -> None:
    """Bells of different streams use different notifier streams."""
    slow_event, fast_event = _slow_and_fast()
    woke = await _wake_times(("slow", slow_event), ("fast", fast_event))
    assert woke["fast"] < woke["slow"] / 2, woke


async def test_an_earlier_event_waited_on_later_is_not_held_behind_a_later_one() -> None:
    """Waiters arrive out of record order (trio starts tasks in any order): the
    later event's bell is armed first, then the earlier one becomes its
    stream's head. Its bell must not queue behind the later event's wait: it
    rings when its own kernel ends, not when the slow kernel after it does
    (there, the only earlier wake would be a pass, SLOW apart)."""
    cs.use_backend("sim")
    cs.configure(poll=_sleepy("doorbell"))
    s = cs.Stream()
    sim.launch(s, lambda: None, duration=0.02)
    early = s.record()
    sim.launch(s, lambda: None, duration=SLOW * 2)
    late = s.record()
    woke = await _wake_times(("late", late), ("early", early))
    assert woke["early"] < woke["late"] / 4, woke


async def test_a_ring_wakes_its_waiter_before_the_next_bell_is_armed(anyio_backend: str) -> None:
    """A stream whose bell rang gets a bell for its next head at once, not
    only when the poller backs off (here it never does: its sleeps stay below
    ``cap``), and after the waiters the ring woke resume (arming makes system
    calls, each of which hands the GIL away). Under trio the woken waiter and
    the poller run in either order, so only the first part holds there."""
    cs.use_backend("sim")
    cs.configure(poll=_never_backs_off())
    s = cs.Stream()
    sim.launch(s, lambda: None, duration=0.02)
    first = s.record()
    sim.launch(s, lambda: None, duration=0.05)
    second = s.record()
    before = _settled()
    armed_at_resume: list[int] = []

    async def wait_first() -> None:
        await first.wait()
        armed_at_resume.append(cs.stats()["doorbells_armed"] - before["doorbells_armed"])

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait_first)
        await anyio.sleep(0.005)
        await second.wait()
    after = _settled()
    assert after["doorbells_armed"] - before["doorbells_armed"] == 2  # the head, then the next
    assert after["doorbells_fired"] - before["doorbells_fired"] == 2
    if anyio_backend == "asyncio":
        assert armed_at_resume == [1], armed_at_resume  # the next bell came after


async def test_while_every_stream_has_a_bell_the_poller_sleeps_its_fallback() -> None:
    """A bell armed for every pending stream makes fast passes pointless: the
    poller sleeps ``fallback`` between them, not its fast cadence (control:
    the same policy without bells passes at that cadence)."""
    cs.use_backend("sim")
    passes = {}
    for wake in ("poll", "doorbell"):
        cs.configure(
            poll=cs.PollPolicy(spin=0, first=0.002, growth=1.0, cap=SLOW, fallback=0.05, wake=wake)
        )
        before = cs.stats()["poll_passes"]
        await _time_one_wait(0.2)
        passes[wake] = cs.stats()["poll_passes"] - before
    assert passes["poll"] > 40, passes  # every 2 ms for 0.2 s
    assert passes["doorbell"] < passes["poll"] / 4, passes


async def test_the_pass_after_a_ring_skips_streams_whose_bell_is_armed() -> None:
    """A ring asks for a pass (it takes what else completed), but a stream
    whose oldest event has a bell rings for itself: that pass does not query
    it. The pass that is due by the policy's cadence does (the control: the
    counter sees those queries)."""
    slow_event, fast_event = _slow_and_fast()
    queries: dict[str, int] = {}
    rang = anyio.Event()

    async def wait_fast() -> None:
        await fast_event.wait()
        rang.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(slow_event.wait)
        tg.start_soon(wait_fast)
        await anyio.sleep(0.005)  # both waiting, both bells armed
        start = cs.stats()["poll_queries"]
        await rang.wait()
        await anyio.sleep(0.01)  # the pass after the ring has run
        queries["after the ring"] = cs.stats()["poll_queries"] - start
        await anyio.sleep(SLOW * 1.4)  # a pass due by the cadence (SLOW after the last)
        queries["after a timed pass"] = cs.stats()["poll_queries"] - start
    assert queries["after the ring"] == 0, queries
    assert queries["after a timed pass"] > 0, queries


async def _bells_for_kernels_5_ms_apart(n: int, policy: cs.PollPolicy) -> int:
    """Under ``policy``: the bells armed while ``n`` waiters, all in place
    first, wait for ``n`` kernels of one stream that end 5 ms apart."""
    return (await _counts_for_kernels_5_ms_apart(n, policy))["doorbells_armed"]


async def _counts_for_kernels_5_ms_apart(n: int, policy: cs.PollPolicy) -> dict[str, int]:
    """The same: how every counter of ``cs.stats()`` changed."""
    cs.use_backend("sim")
    cs.configure(poll=policy)
    s = cs.Stream()
    sim.launch(s, lambda: None, duration=0.02)  # every waiter in place first
    events = []
    for _ in range(n):
        sim.launch(s, lambda: None, duration=0.005)
        events.append(s.record())
    before = _settled()
    async with anyio.create_task_group() as tg:
        for event in events:
            tg.start_soon(event.wait)
    after = _settled()
    return {key: after[key] - before[key] for key in before}


@pytest.mark.parametrize("cap", [SLOW * 2, 0.001])
async def test_only_sparse_completions_chain_bells(cap: float) -> None:
    """Completions that come less than ``cap`` apart on average are seen by
    the passes about as soon as a bell would see them, for a query each: a
    bell that rings among them does not arm the next one. The same kernels,
    5 ms apart, are sparse for a 1 ms ``cap``: there each completion chains
    the next bell (the control: this poller never backs off to ``cap``, so
    only chaining arms them)."""
    n = 40
    armed = await _bells_for_kernels_5_ms_apart(n, _never_backs_off(cap))
    if cap > SLOW:
        assert armed < n / 4, armed
    else:
        assert armed > n * 3 / 4, armed


async def test_a_ring_keeps_the_poller_from_backing_off_into_a_bell_per_completion() -> None:
    """Completions 5 ms apart are dense for a 16 ms ``cap``: after the first
    few, no bell chains the next. A ring wakes waiters as a pass does, so it
    restarts the pass cadence (1, 2, 4, 8 ms: a pass finds the next one)
    instead of letting the poller back off to ``cap`` and arm every head,
    which gave each completion a bell (951 of 1,000 under uvloop, whose timers
    are that coarse)."""
    n = 40
    policy = cs.PollPolicy(
        spin=0, first=0.001, growth=2.0, cap=0.016, fallback=SLOW, wake="doorbell"
    )
    armed = await _bells_for_kernels_5_ms_apart(n, policy)
    assert armed < n / 2, armed


async def test_a_ring_that_chains_the_next_bell_makes_no_pass(
    anyio_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While every pending stream has a bell the poller sleeps its fallback,
    and a ring that chains its stream's next bell leaves it asleep: the
    waiters are woken and the bell armed in the loop's next turn, without
    the poller's pass (which would query nothing: every other stream rings
    for itself) and its new sleep. The control: a ring that always wakes the
    poller, as before, makes a pass per ring. (Under trio a ring always does.)"""
    if anyio_backend != "asyncio":
        pytest.skip("under trio a ring always wakes the poller")
    n = 8
    # kernels 5 ms apart are sparse for a 1 ms cap: each ring chains the next
    # bell, and the stream always has one; the fallback outlasts the test
    policy = cs.PollPolicy(
        spin=0, first=0.001, growth=1.0, cap=0.001, fallback=SLOW * 2, wake="doorbell"
    )
    quiet = await _counts_for_kernels_5_ms_apart(n, policy)

    def always_wake(self: _doorbell.PollerBells, *args: object, chained: bool) -> None:
        self.wake_now(_doorbell.Woken.RUNG)

    monkeypatch.setattr(_doorbell.PollerBells, "rang", always_wake)
    woken = await _counts_for_kernels_5_ms_apart(n, policy)
    for counts in (quiet, woken):  # every wait was a bell's, and each one rang
        assert counts["doorbells_armed"] == counts["doorbells_fired"] == n, counts
        assert counts["poll_wakes"] == n, counts
    assert woken["poll_passes"] >= n, woken
    assert quiet["poll_passes"] <= 3, quiet


async def test_a_fault_under_an_armed_bell_is_found_while_other_bells_ring() -> None:
    """A faulted device runs no host function again, so its armed bell never
    rings; the passes that rings ask for skip armed streams, but one every
    ``fallback`` queries them all: the error surfaces about then, not when
    the other device's stream, ringing every few ms, finally drains (the
    control: when that happens)."""
    cs.use_backend("sim")
    cs.configure(poll=cs.PollPolicy(wake="doorbell"))  # fallback 10 ms
    busy, bad = cs.Stream(device=0), cs.Stream(device=1)
    sim.launch(busy, lambda: None, duration=0.02)
    events = []
    for _ in range(50):
        sim.launch(busy, lambda: None, duration=0.006)
        events.append(busy.record())
    sim.launch(bad, lambda: 1 / 0, duration=0.03, name="broken")
    bad_event = bad.record()
    start = time.perf_counter()
    seen: list[float] = []

    async def wait_bad() -> None:
        with pytest.raises(cs.KernelError):
            await bad_event.wait(timeout=20)
        seen.append(time.perf_counter() - start)

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait_bad)
        for event in events:
            tg.start_soon(event.wait)
    drained = time.perf_counter() - start
    assert seen[0] < drained / 3, (seen, drained)
    sim.reset(1)


def test_event_loops_are_not_kept_alive() -> None:
    """anyio keeps each loop's poller in a RunVar keyed weakly by the loop:
    nothing the poller or its bells keep may refer to the loop."""
    import asyncio

    cs.use_backend("sim")
    loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []

    async def one_wait() -> None:
        loops.append(weakref.ref(asyncio.get_running_loop()))
        await _time_one_wait(0.005)

    try:
        for wake in ("poll", "doorbell"):
            cs.configure(poll=cs.PollPolicy(wake=wake))
            for _ in range(3):
                asyncio.run(one_wait())
    finally:
        cs.configure(poll=cs.PollPolicy())
    gc.collect()
    assert [ref() for ref in loops] == [None] * 6


def test_trio_runs_are_not_kept_alive() -> None:
    """anyio keeps each trio run's poller in a RunVar keyed weakly by the
    run's token: the poller must not keep the token (it did, through its way
    into the run from other threads: every run that consumed left its poller
    and its token for good)."""
    import trio

    cs.use_backend("sim")
    gc.collect()
    before = len(_poller._pollers)
    tokens: list[weakref.ref[Any]] = []

    async def one_wait() -> None:
        tokens.append(weakref.ref(trio.lowlevel.current_trio_token()))
        await _time_one_wait(0.005)

    try:
        for wake in ("poll", "doorbell"):
            cs.configure(poll=cs.PollPolicy(wake=wake))
            for _ in range(3):
                trio.run(one_wait)
    finally:
        cs.configure(poll=cs.PollPolicy())
    gc.collect()
    cs.stats()  # (what a run's end left to the next library call)
    gc.collect()
    assert [ref() for ref in tokens] == [None] * 6
    assert len(_poller._pollers) == before


@pytest.mark.parametrize("timeout", [None, 10.0], ids=["", "timeout"])
@pytest.mark.parametrize("wake", ["poll", "doorbell"])
def test_a_loop_closed_with_waiters_parked_is_let_go_with_what_they_keep(
    wake: str, timeout: float | None
) -> None:
    """``loop.close()`` without cancelling a task parked in ``await consume``:
    its poller, stored under the loop weakly, held the loop through the
    waiter's event, its task and its sleep, so the loop, the task, the array
    it consumed and its pinned event were never freed (a plain
    ``asyncio.sleep`` task is: the control). The next ``cs.stats()`` (or a
    poller starting in another loop) lets go, and the next collection frees
    them; the handoff gives its event back at the next library call. With a
    ``timeout``, anyio's cancel scope (kept per task in a module-level table
    whose value refers back to the task) kept all of it under asyncio."""
    import asyncio

    cs.use_backend("sim")
    cs.configure(poll=cs.PollPolicy(wake=wake))  # type: ignore[arg-type]
    before = _settled()
    s, gate = cs.Stream(), threading.Event()
    arr = sim.asarray(np.zeros(4, np.float32))
    t = cs.track(arr)
    with t.writing(s):
        sim.launch(s, lambda x: gate.wait(20), arr, writes=[arr])
    owner = weakref.ref(arr)
    box = [t]
    del arr, t

    def abandon(body: Any) -> weakref.ref[asyncio.AbstractEventLoop]:
        loop = asyncio.new_event_loop()
        loop.create_task(body())  # noqa: RUF006 - abandoned on purpose
        loop.run_until_complete(asyncio.sleep(0.05))  # (parked)
        loop.close()
        return weakref.ref(loop)

    async def waiter() -> None:
        await cs.consume(box.pop(), timeout=timeout)

    async def sleeper() -> None:
        await asyncio.sleep(100)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (asyncio: "Task was destroyed but it is pending")
        control, parked = abandon(sleeper), abandon(waiter)
        assert cs.stats()["events_pinned"] == before["events_pinned"] + 1
        gate.set()
        s.synchronize()
        cs.stats()
        gc.collect()
        after = cs.stats()
    assert control() is None and parked() is None
    assert owner() is None
    assert after["events_pinned"] == before["events_pinned"]
    assert after["events_in_flight"] == before["events_in_flight"]
    s.close()


@pytest.mark.parametrize("timeout", [None, 10.0], ids=["", "timeout"])
def test_a_loop_closed_while_a_consume_waits_for_another_threads_block_lets_go(
    timeout: float | None,
) -> None:
    """A consume parked behind another thread's open ``writing()`` block
    sleeps by the poll policy; its loop closed meanwhile kept the task and
    the array for good (the sleep was an anyio cancel scope, kept per task in
    a module-level table whose value refers back to the task)."""
    import asyncio

    cs.use_backend("sim")
    s = cs.Stream()
    arr = sim.asarray(np.zeros(4, np.float32))
    t = cs.track(arr)
    owner = weakref.ref(arr)
    entered, done = threading.Event(), threading.Event()

    def holder(tracked: cs.TrackedArray) -> None:
        with tracked.writing(s):
            entered.set()
            done.wait(20)

    thread = threading.Thread(target=holder, args=(t,))
    thread.start()
    assert entered.wait(10)
    box = [t]
    del arr, t

    async def waiter() -> None:
        await cs.consume(box.pop(), timeout=timeout)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (asyncio: "Task was destroyed but it is pending")
        loop = asyncio.new_event_loop()
        loop.create_task(waiter())  # noqa: RUF006 - abandoned on purpose
        loop.run_until_complete(asyncio.sleep(0.05))  # (parked)
        loop.close()
        del loop
        done.set()
        thread.join(10)
        s.synchronize()
        cs.stats()
        gc.collect()
        cs.stats()
        gc.collect()
    assert owner() is None
    s.close()


async def test_cancelled_and_timed_out_waiters_leak_no_bell(ops: DeviceOps) -> None:
    if ops.name != "sim":
        pytest.skip("the sim's counters; the GPU tier runs the same code")
    cs.configure(poll=cs.PollPolicy(wake="doorbell"))
    before = _settled()
    fds = await _open_fds()
    s = cs.Stream()
    latch = ops.latch(s)
    producers = [
        cs.read_interface(ops.array(np.zeros(4, "float32"))).with_stream(s.handle)
        for _ in range(20)
    ]
    timed_out: list[int] = []
    try:
        async with anyio.create_task_group() as tg:
            scopes = [anyio.CancelScope() for _ in producers]

            async def consumer(i: int) -> None:
                with scopes[i]:
                    try:
                        await cs.consume(producers[i], timeout=0.05 if i % 3 == 0 else 20)
                    except TimeoutError:
                        timed_out.append(i)

            for i in range(len(producers)):
                tg.start_soon(consumer, i)
            await anyio.sleep(0.02)
            armed = cs.stats()["doorbells_armed"] - before["doorbells_armed"]
            assert armed >= 1  # the stream's oldest pending event has a bell
            for scope in scopes[1::3]:
                scope.cancel()
            await anyio.sleep(0.1)  # the timeouts expire
            latch.release()
    finally:
        latch.release()
    s.synchronize()
    assert sorted(timed_out) == list(range(0, len(producers), 3))
    assert await _open_fds() == fds  # every pipe closed: read ends by us, write ends by the GPU
    after = _settled()
    armed = after["doorbells_armed"] - before["doorbells_armed"]
    fired = after["doorbells_fired"] - before["doorbells_fired"]
    retired = after["doorbells_retired"] - before["doorbells_retired"]
    # retired: still watched when the poller ended (a pass saw the event first)
    assert armed >= 1 and armed == fired + retired
    assert after["events_in_flight"] == before["events_in_flight"]


async def test_a_faulted_kernel_is_found_by_the_poller_and_its_bell_retired() -> None:
    """A device that faulted runs no host function again: the bell never fires,
    the slow fallback pass finds the error, and the sweep retires the bell."""
    cs.use_backend("sim")
    cs.configure(poll=cs.PollPolicy(wake="doorbell"))
    before = _settled()
    fds = await _open_fds()
    s = cs.Stream()
    t = cs.track(sim.empty(4))
    with t.writing(s):
        sim.launch(s, lambda: 1 / 0, duration=0.02, name="broken")
    with pytest.raises(cs.KernelError):
        await cs.consume(t, timeout=20)
    await _poller_ended()
    after = cs.stats()
    # faulted: the skipped host functions' write ends stay open, and counted
    assert after["doorbell_fds"] > before["doorbell_fds"]
    sim.reset()
    _sync_lanes()  # their skipped host functions are behind them
    armed = after["doorbells_armed"] - before["doorbells_armed"]
    retired = after["doorbells_retired"] - before["doorbells_retired"]
    fired = after["doorbells_fired"] - before["doorbells_fired"]
    assert armed >= 1 and fired == 0 and retired == armed
    # reset: their lanes answer idle, so the doorbell closes both ends itself
    assert _settled()["doorbell_fds"] == before["doorbell_fds"]
    assert await _open_fds() == fds


async def test_bells_skipped_by_a_reset_are_settled_while_the_poller_runs() -> None:
    """A reset skips the host functions of the bells armed on its device: the
    next pass finds their events complete and wakes the waiters, and their
    bells are settled then, not left watched until the poller ends (a busy
    poller, kept by a wait on the other device, piled their pipes up to the
    doorbell's limit, and no event loop got a bell after)."""
    if cs.device_count() < 2:
        pytest.skip("needs a second simulated device whose wait keeps the poller running")
    cs.use_backend("sim")
    cs.configure(poll=cs.PollPolicy(wake="doorbell"))
    before = _settled()
    keep = cs.Stream(device=1)
    gate = threading.Event()
    sim.launch(keep, lambda: gate.wait(30), duration=0)
    keeper = keep.record()
    streams = [cs.Stream(device=0) for _ in range(8)]
    held = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(keeper.wait, timeout=30))
        for _ in range(4):
            events = []
            for s in streams:
                sim.launch(s, lambda: None, duration=0.05)
                events.append(s.record())
            async with anyio.create_task_group() as waiters:
                for event in events:
                    waiters.start_soon(functools.partial(event.wait, timeout=10))
                await anyio.sleep(0.01)  # (parked: a bell armed per stream)
                sim.reset(0)  # their kernels and host functions never run
            doorbell = _doorbell._doorbell
            for (backend, device), pool in list(doorbell.lanes.items()):
                for lane in pool if device == 0 else ():  # (device 1's waits for the gate)
                    backend.synchronize_stream(lane.stream)
            stats = cs.stats()
            held.append(stats["doorbell_fds"] - before["doorbell_fds"])
            assert stats["doorbells_armed"] > before["doorbells_armed"]
        gate.set()
    # the keeper's bell at most (two descriptors), never the reset rounds'
    assert max(held) <= 2, held
    for s in streams:
        s.close()
    keep.close()


async def test_a_capturing_stream_never_gets_a_bell() -> None:
    cs.use_backend("sim")
    cs.configure(poll=cs.PollPolicy(wake="doorbell"))
    for capturing in (False, True):  # control first: the same wait arms a bell
        s = cs.Stream()
        t = cs.track(sim.empty(4))
        with t.writing(s):
            sim.launch(s, lambda: None, duration=0.02)
        backend = cs.current_backend()
        if capturing:
            backend.begin_capture(s.handle, "relaxed")
        before = cs.stats()["doorbells_armed"]
        await cs.consume(t, timeout=20)
        armed = cs.stats()["doorbells_armed"] - before
        if capturing:
            graph = backend.end_capture(s.handle)  # valid: nothing of the doorbell joined it
            backend.destroy_graph(graph)
        assert armed == (0 if capturing else 1)


def test_a_global_capture_in_another_thread_survives_the_doorbell() -> None:
    """Arming, firing and the doorbell's thread make no call that a global-mode
    capture forbids. (The poller's own queries are made capture-safe by
    exchanging the polling thread's mode to relaxed, as here.)"""
    backend = cs.use_backend("sim")
    cs.configure(poll=_sleepy("doorbell"))  # no pass wakes a waiter before its bell
    capturing, waited = threading.Event(), threading.Event()
    outcome: list[object] = []

    def capture() -> None:
        s = cs.Stream()
        backend.begin_capture(s.handle, "global")
        sim.launch(s, lambda: None)
        capturing.set()
        waited.wait(20)
        try:
            outcome.append(backend.end_capture(s.handle))
        except cs.CudaError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=capture)
    thread.start()
    assert capturing.wait(20)
    before = cs.stats()["doorbells_fired"]

    async def main() -> None:
        previous = backend.exchange_capture_mode("relaxed")
        try:
            for _ in range(3):
                await _time_one_wait(0.01)
        finally:
            backend.exchange_capture_mode(previous)

    try:
        anyio.run(main)
    finally:
        waited.set()
        thread.join(20)
    assert cs.stats()["doorbells_fired"] - before == 3
    (graph,) = outcome
    assert isinstance(graph, int), graph
    backend.destroy_graph(graph)


class _Entry:
    """What the doorbell needs of a poller entry."""

    def __init__(self, backend: cs.Backend, event: int) -> None:
        self.backend = backend
        self.event = event
        self.seq = -1
        self.bell = _doorbell.BellState.UNARMED
        self.waiters = [object()]


def test_arming_and_firing_make_no_call_that_a_global_capture_forbids() -> None:
    """Stricter than another thread's capture: this thread captures in global
    mode, where its own potentially unsafe calls would invalidate the capture,
    and arms a bell that fires meanwhile. The capture still ends valid."""
    backend = cs.use_backend("sim")
    producer, capturing = cs.Stream(), cs.Stream()
    sim.launch(producer, lambda: None, duration=0.01)
    event = producer.record()
    backend.begin_capture(capturing.handle, "global")
    try:
        sim.launch(capturing, lambda: None)
        entry = _Entry(backend, event.handle)
        bell = _doorbell._doorbell.arm(entry, ("lone event", event.handle))
        assert bell is not None
        readable, _, _ = select.select([bell.rfd], [], [], 20)  # what the loop would watch
        fired = _doorbell._has_fired(bell.rfd)
    finally:
        graph = backend.end_capture(capturing.handle)  # raises if it was invalidated
    backend.destroy_graph(graph)
    _doorbell._doorbell.done(bell, _doorbell._Phase.FIRED)
    os.close(bell.rfd)
    _doorbell._doorbell.done(bell, _doorbell._Phase.CLOSED)
    assert readable == [bell.rfd] and fired


async def test_random_waiters_see_their_data_and_bells_balance() -> None:
    """Model-based: random kernels on random streams, waiters that finish, time
    out or are cancelled at random. Oracle: a waiter that returns sees its
    kernel's write; every bell armed fires or is retired; no event leaks."""
    cs.use_backend("sim")
    cs.configure(poll=cs.PollPolicy(wake="doorbell"))
    rng = random.Random(20)
    before = _settled()
    fds = await _open_fds()
    streams = [cs.Stream() for _ in range(4)]
    n = 80
    arrays = [sim.empty(1, "int32") for _ in range(n)]
    plan = [
        (
            rng.choice(streams),
            rng.uniform(0, 0.01),
            rng.choice(["wait", "wait", "cancel", "timeout"]),
        )
        for _ in range(n)
    ]
    tracked = []
    for arr, (s, duration, _) in zip(arrays, plan, strict=True):
        t = cs.track(arr)
        with t.writing(s):
            sim.launch(s, lambda x: x.fill(7), arr, writes=[arr], duration=duration)
        tracked.append(t)
    seen: list[bool] = []

    async def waiter(i: int) -> None:
        kind = plan[i][2]
        with anyio.move_on_after(rng.uniform(0, 0.05) if kind == "cancel" else 30):
            try:
                view = await cs.consume(tracked[i], timeout=0.005 if kind == "timeout" else 20)
            except TimeoutError:
                return
            data = sim._numpy_view(view)
            seen.append(data is not None and bool((data == 7).all()))

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(waiter, i)
    for s in streams:
        s.synchronize()
    tracked.clear()
    arrays.clear()
    gc.collect()  # the tracked arrays held their writes' events
    assert seen and all(seen)
    assert await _open_fds() == fds  # every pipe closed, the poller ended
    after = _settled()
    armed = after["doorbells_armed"] - before["doorbells_armed"]
    fired = after["doorbells_fired"] - before["doorbells_fired"]
    retired = after["doorbells_retired"] - before["doorbells_retired"]
    assert armed > 0 and armed == fired + retired
    assert after["events_in_flight"] == before["events_in_flight"]


def test_uvloop_is_woken_by_the_bell() -> None:
    pytest.importorskip("uvloop")
    cs.use_backend("sim")
    cs.configure(poll=_sleepy("poll"))
    polled = anyio.run(_time_one_wait, 0.02, backend_options={"use_uvloop": True})
    cs.configure(poll=_sleepy("doorbell"))
    rung = anyio.run(_time_one_wait, 0.02, backend_options={"use_uvloop": True})
    assert rung < polled / 2, (rung, polled)


@pytest.mark.parametrize(
    "kwargs", [{"wake": "bell"}, {"wake": None}, {"fallback": -1.0}, {"fallback": float("inf")}]
)
def test_poll_policy_rejects_a_bad_wake_mode_or_fallback(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        cs.PollPolicy(**kwargs)  # type: ignore[arg-type]


def test_low_latency_never_rings() -> None:
    assert cs.PollPolicy.low_latency().wake == "poll"
    assert cs.PollPolicy().wake == "auto"


async def test_without_host_functions_the_poller_alone_serves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A driver without cuLaunchHostFunc (OSError): waits still complete, polled,
    and no bell is armed again for that backend."""
    backend = cs.use_backend("sim")
    cs.configure(poll=cs.PollPolicy(wake="doorbell"))

    def missing(stream: int, fn: int, user_data: int) -> None:
        raise OSError("no cuLaunchHostFunc")

    monkeypatch.setattr(backend, "launch_host_func", missing)
    before = cs.stats()["doorbells_armed"]
    try:
        for _ in range(2):
            await _time_one_wait(0.05)
        assert backend in _doorbell._doorbell.no_host_functions
    finally:
        _doorbell._doorbell.no_host_functions.discard(backend)
    assert cs.stats()["doorbells_armed"] == before


async def test_auto_rings_on_the_simulator_and_poll_never_does() -> None:
    """The default follows the benchmarks: bells on the simulator, under every
    event loop; ``wake="poll"`` (the control) arms none."""
    cs.use_backend("sim")
    armed = []
    for policy in (cs.PollPolicy(), cs.PollPolicy(wake="poll")):
        cs.configure(poll=policy)
        before = cs.stats()["doorbells_armed"]
        await _time_one_wait(0.05)
        armed.append(cs.stats()["doorbells_armed"] - before)
    assert armed == [1, 0]


def test_auto_polls_on_cuda_where_the_gpu_runs_measured_bells_worse() -> None:
    """The H100 runs of 2026-11-23: bells' p99 at 100 and 1,000 waiters was 5-10
    times the poller's. "auto" rings on the simulator only; "doorbell" anywhere."""
    for name, rings in (("sim", True), ("cuda", False), ("decoy", False)):
        backend = cast(cs.Backend, SimpleNamespace(name=name))
        assert _doorbell.wants_doorbell("auto", backend) is rings, name
        assert _doorbell.wants_doorbell("doorbell", backend)
        assert not _doorbell.wants_doorbell("poll", backend)


async def test_lanes_left_by_retired_bells_are_reclaimed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream per request: each waiter gives up before its kernel ends, so
    its bell is retired with its host function still queued on its lane.
    Once those lanes are idle, later streams reuse them: with two lanes at
    most, the last stream still gets a bell (control: without the reclaim it
    is refused, and polling alone serves it)."""
    backend = cs.use_backend("sim")
    monkeypatch.setattr(_doorbell, "MAX_LANES", 2)
    doorbell = _doorbell._Doorbell()  # no lanes yet: earlier tests left some free
    monkeypatch.setattr(_doorbell, "_doorbell", doorbell)
    cs.configure(poll=cs.PollPolicy(wake="doorbell"))
    before = _settled()
    for _ in range(4):
        s, gate = cs.Stream(), threading.Event()
        sim.launch(s, lambda g=gate: g.wait(20))
        event = s.record()
        with anyio.move_on_after(0.01):
            await event.wait()  # gives up: its bell stays queued behind the gate
        await _poller_ended()  # and retired its bell
        gate.set()
        s.synchronize()
        event.close()
        s.close()
    # (counters, not stats(): its sweep would free the lanes itself)
    assert _doorbell.counters.retired - before["doorbells_retired"] == 4
    armed = _doorbell.counters.armed
    await _time_one_wait(0.05)
    assert _doorbell.counters.armed - armed == 1
    await _poller_ended()
    lanes = [lane for pool in doorbell.lanes.values() for lane in pool]
    assert len(lanes) <= 2
    for lane in lanes:
        backend.synchronize_stream(lane.stream)
        backend.destroy_stream(lane.stream)
    _doorbell.counters.lanes -= len(lanes)


async def test_a_waiter_that_keeps_timing_out_rearms_one_pipe() -> None:
    """Each timed-out wait on a long kernel retires its bell unfired, its host
    function still queued; the next wait on the same record arms that bell
    again instead of a new pipe (control: without it, one pipe per wait)."""
    cs.use_backend("sim")
    cs.configure(poll=cs.PollPolicy(wake="doorbell"))
    before = _settled()
    fds = await _open_fds()
    s, gate = cs.Stream(), threading.Event()
    sim.launch(s, lambda: gate.wait(20))
    event = s.record()
    try:
        held = await _fds_after_timed_out_waits([event] * 20, before["doorbell_fds"])
    finally:
        gate.set()
    await event.wait()
    assert held == [2] * 20
    assert await _open_fds() == fds
    assert _settled()["doorbell_fds"] == before["doorbell_fds"]
    event.close()
    s.close()


@pytest.mark.parametrize("records", ["one record", "a record per wait"])
async def test_back_to_back_timed_out_waits_keep_one_pipe_while_the_poller_runs(
    monkeypatch: pytest.MonkeyPatch, records: str
) -> None:
    """The same, with no pause between the waits (the poller never ends).
    One record (an Event): each waiter that gives up retires its bell at
    once, and the next wait adopts it (each bell stayed watched, so every wait
    armed a new pipe). A record per wait (an untracked producer's host
    consume): while the stream's earlier bell is still queued, the next
    waiters are polled (each timed-out wait left a pipe). Either way the
    doorbell's limit refused bells to every waiter in the process, and an
    unrelated stream's waiter got none."""
    cs.use_backend("sim")
    monkeypatch.setattr(_doorbell, "MAX_FDS", 8)
    cs.configure(poll=cs.PollPolicy(wake="doorbell"))
    before = _settled()
    s, gate = cs.Stream(), threading.Event()
    x = sim.empty(16)
    sim.launch(s, lambda a: gate.wait(20), x, writes=[x])
    x.stream = s.handle
    event = s.record()
    wait = event.wait if records == "one record" else (lambda: cs.consume(x))
    held = []
    try:
        for _ in range(12):  # past the limit (4 pipes), without the fix
            with anyio.move_on_after(0.02):  # (long enough for a bell to be armed)
                await wait()
            held.append(_doorbell._doorbell.fds - before["doorbell_fds"])
        other = cs.Stream()
        sim.launch(other, lambda: None, duration=0.05)
        armed = cs.stats()["doorbells_armed"]
        await other.record().wait(timeout=10)
        assert cs.stats()["doorbells_armed"] > armed  # it still got a bell
    finally:
        gate.set()
    await event.wait(timeout=10)
    assert max(held) <= 2, held
    await _poller_ended()
    s.synchronize()
    _sync_lanes()
    assert _settled()["doorbell_fds"] == before["doorbell_fds"]
    event.close()
    s.close()
    other.close()


async def test_a_bell_refused_for_a_queued_orphan_is_armed_once_it_settles() -> None:
    """A waiter that timed out left its bell queued on the stream; the next
    waiter is refused a bell while it is, and armed once it settled (it was
    refused for good, and the poller passed at ``cap`` for the rest of the
    wait: about 8 times the passes)."""
    cs.use_backend("sim")
    cs.configure(poll=cs.PollPolicy(wake="doorbell"))
    x = sim.empty(16)
    t = cs.track(x)
    s, first, second = cs.Stream(), threading.Event(), threading.Event()
    with t.writing(s):
        sim.launch(s, lambda a: first.wait(20), x, writes=[x])
    with anyio.move_on_after(0.02):
        await cs.consume(t)  # times out: its bell stays queued behind the kernel
    with t.writing(s):
        sim.launch(s, lambda a: second.wait(20), x, writes=[x])
    before = cs.stats()
    threading.Timer(0.05, first.set).start()
    threading.Timer(0.5, second.set).start()
    try:
        await cs.consume(t, timeout=10)
    finally:
        first.set()
        second.set()
    assert cs.stats()["doorbells_armed"] > before["doorbells_armed"]
    s.synchronize()


async def test_waits_that_time_out_on_many_records_hold_at_most_max_fds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each timed-out wait on another record behind a long kernel leaves a
    retired bell whose write end stays open until the kernel ends. The
    doorbell holds at most MAX_FDS descriptors (beyond it, bells are refused
    and polling serves), and closes every one once the kernel ends (control:
    40 records would hold 80)."""
    cs.use_backend("sim")
    monkeypatch.setattr(_doorbell, "MAX_FDS", 8)
    cs.configure(poll=cs.PollPolicy(wake="doorbell"))
    before = _settled()
    fds = await _open_fds()
    s, gate = cs.Stream(), threading.Event()
    sim.launch(s, lambda: gate.wait(20))
    events = [s.record() for _ in range(40)]
    try:  # in reverse: each a new head of its stream
        held = await _fds_after_timed_out_waits(events[::-1], before["doorbell_fds"])
    finally:
        gate.set()
    s.synchronize()
    assert max(held) <= 8 and held[0] > 0  # bounded, and bells were armed
    assert await _open_fds() == fds
    assert _settled()["doorbell_fds"] == before["doorbell_fds"]
    for event in events:
        event.close()
    s.close()


async def test_an_earlier_waiter_is_not_woken_by_a_stale_entrys_reused_handle() -> None:
    """B waits on e2 with a timeout, gives up and closes it; its handle goes to
    an event on an idle stream. A then waits on e1, recorded before e2, behind
    a long kernel. When e0's bell rings, e2's entry (nobody waits on it) must
    not be armed: its handle now completes at once, and would wake A before
    e1's kernel wrote its data."""
    cs.use_backend("sim")
    cs.configure(poll=cs.PollPolicy(wake="doorbell"))
    s, idle = cs.Stream(), cs.Stream()
    data = sim.empty(4, "int32")
    _np(data)[:] = 0
    sim.launch(s, lambda: None, duration=0.05)
    e0 = s.record()
    sim.launch(s, lambda: _np(data).fill(1), duration=0.3)
    e1 = s.record()
    sim.launch(s, lambda: None, duration=0.01)
    e2 = s.record()
    seen: list[list[int]] = []
    reused: list[bool] = []

    async def a() -> None:
        await e0.wait()
        await e1.wait()
        seen.append(_np(data).tolist())

    async def b() -> None:
        with anyio.move_on_after(0.005):
            await e2.wait()
        handle = e2.handle
        e2.close()
        e3 = idle.record()
        reused.append(e3.handle == handle)
        await anyio.sleep(0.4)
        e3.close()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(a)
            tg.start_soon(b)
    s.synchronize()
    assert reused == [True]  # the simulator reuses handles as CUDA does
    assert seen == [[1, 1, 1, 1]]
    e0.close()
    e1.close()


async def test_closing_an_event_that_a_task_awaits_defers_its_destruction() -> None:
    """Another task closes the event A awaits: its handle is not freed under A
    (so no other event can take it, and no bell or query meant for it answers
    for another record). A returns once the work is done; then it is freed."""
    backend = cs.use_backend("sim")
    cs.configure(poll=cs.PollPolicy(wake="doorbell"))
    s = cs.Stream()
    data = sim.empty(4, "int32")
    _np(data)[:] = 0
    sim.launch(s, lambda: _np(data).fill(1), duration=0.2)
    event = s.record()
    handle = event.handle
    seen: list[list[int]] = []

    async def a() -> None:
        await event.wait()
        seen.append(_np(data).tolist())

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(a)
            await anyio.sleep(0.01)
            event.close()
            with pytest.raises(ValueError):
                event.handle  # noqa: B018 - closed for its owner at once
            other = backend.create_event()
            assert other != handle  # not freed while A waits
            backend.destroy_event(other)
    assert seen == [[1, 1, 1, 1]]
    again = backend.create_event()  # freed once A's wait ended
    assert again == handle
    backend.destroy_event(again)


def _held_events(gate: threading.Event) -> tuple[list[cs.Event], object]:
    """Under a policy whose passes are SLOW apart: 20 events on one stream,
    held until ``gate`` is set, and the stream's key."""
    cs.use_backend("sim")
    cs.configure(poll=_sleepy("doorbell"))
    slow = cs.Stream()
    sim.launch(slow, lambda: gate.wait(20))
    events = [slow.record() for _ in range(20)]
    return events, events[0]._mark.key


async def test_one_stream_waited_out_of_order_does_not_take_every_lane() -> None:
    """Waiters arriving in reverse record order each need a lane where nothing
    later is queued; one stream gets at most MAX_LANES_PER_STREAM, so another
    stream's waiter still gets a bell and wakes long before the slow pass."""
    gate = threading.Event()
    events, key = _held_events(gate)
    try:
        async with anyio.create_task_group() as tg:
            for event in reversed(events):
                tg.start_soon(event.wait)
                await anyio.sleep(0.002)  # each arrives as its stream's new head
            serving = [len(ls) for (_, k), ls in _doorbell._doorbell.serving.items() if k == key]
            woke = await _time_one_wait(0.01)
            gate.set()
    finally:
        gate.set()
    assert serving == [_doorbell.MAX_LANES_PER_STREAM]
    assert woke < SLOW / 2
    for event in events:
        event.close()


async def test_waiters_that_arrive_together_out_of_order_arm_one_bell() -> None:
    """Tasks started together register in any order (trio's is random; here
    reversed under asyncio): only the stream's oldest pending event gets a
    bell, not each waiter that was its head for a moment (the control is the
    test above: waiters 2 ms apart, each the head for a while, take
    MAX_LANES_PER_STREAM notifier streams, and the rest get none)."""
    gate = threading.Event()
    events, key = _held_events(gate)
    before = cs.stats()
    try:
        async with anyio.create_task_group() as tg:
            for event in reversed(events):
                tg.start_soon(event.wait)
            await anyio.sleep(0.01)
            armed = cs.stats()["doorbells_armed"] - before["doorbells_armed"]
            serving = [len(ls) for (_, k), ls in _doorbell._doorbell.serving.items() if k == key]
            gate.set()
    finally:
        gate.set()
    assert (armed, serving) == (1, [1])
    for event in events:
        event.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() here")
async def test_a_forked_child_does_not_hold_back_a_bell() -> None:
    """A child made by fork() while a bell is armed gets copies of its write
    end; it closes them, or the bell could not ring until the child exits
    (end-of-file needs every copy closed). The child lives 1 s; the bell's
    kernel takes 0.05 s, and passes are 2 s apart: a bell held back wakes the
    waiter when the child exits, at 1 s (a margin a loaded machine keeps)."""
    cs.use_backend("sim")
    cs.configure(poll=cs.PollPolicy(spin=0, first=2.0, cap=2.0, fallback=2.0, wake="doorbell"))
    s = cs.Stream()
    sim.launch(s, lambda: None, duration=0.05)
    event = s.record()
    woke: list[float] = []
    start = time.perf_counter()

    async def wait() -> None:
        await event.wait()
        woke.append(time.perf_counter() - start)

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        await anyio.sleep(0.01)  # the bell is armed: its write end handed over
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads
            pid = os.fork()
        if pid == 0:  # the child: hold whatever copies it kept, then leave
            time.sleep(1.0)  # noqa: ASYNC251 - the child's loop is not run again
            os._exit(0)
    os.waitpid(pid, 0)  # noqa: ASYNC222 - after the loop's work, in a test
    assert woke[0] < 0.5, woke
    event.close()


async def test_the_doorbell_never_closes_a_descriptor_that_is_not_its_own() -> None:
    """A retired bell's host function ran, but another copy of its write end
    (a forked child's, here a dup) kept the pipe from ending; the number the
    function closed went to an unrelated file. When the sweep finds the lane
    idle, it must close only what still names its pipe (control: closing the
    number unchecked closes the unrelated file)."""
    cs.use_backend("sim")
    cs.configure(poll=cs.PollPolicy(wake="doorbell"))
    _settled()
    s, gate = cs.Stream(), threading.Event()
    sim.launch(s, lambda: gate.wait(20))
    event = s.record()
    with anyio.move_on_after(0.005):
        await event.wait()
    await _poller_ended()
    (orphan,) = [b for pool in _doorbell._doorbell.lanes.values() for lane in pool
                 for b in lane.orphans if b.event == event.handle]  # fmt: skip
    copy = os.dup(orphan.wfd)
    gate.set()
    cs.current_backend().synchronize_stream(orphan.lane.stream)  # the function ran
    unrelated = os.open(os.devnull, os.O_RDONLY)
    if unrelated != orphan.wfd:  # make the freed number go to another file
        os.dup2(unrelated, orphan.wfd)
        os.close(unrelated)
        unrelated = orphan.wfd
    try:
        cs.stats()  # the sweep: the lane is idle, and the pipe did not end
        os.fstat(unrelated)  # still open
    finally:
        os.close(unrelated)
        os.close(copy)
    cs.stats()
    event.close()
    s.close()


def test_bells_of_a_loop_closed_with_its_poller_running_are_retired() -> None:
    """``loop.close()`` without cancelling its tasks leaves the poller and its
    bell behind; a sweep retires the bell and closes its pipe once it can
    (control: without it, two descriptors and a lane stay taken for good)."""
    import asyncio

    cs.use_backend("sim")
    cs.configure(poll=cs.PollPolicy(wake="doorbell"))
    before = _settled()
    s, gate = cs.Stream(), threading.Event()
    sim.launch(s, lambda: gate.wait(20))
    event = s.record()
    loop = asyncio.new_event_loop()

    async def start() -> None:
        loop.create_task(event.wait())  # noqa: RUF006 - abandoned on purpose
        await asyncio.sleep(0.01)

    try:
        loop.run_until_complete(start())
        assert _doorbell._doorbell.fds - before["doorbell_fds"] == 2  # armed
    finally:
        loop.close()
        gate.set()
    s.synchronize()
    _sync_lanes()  # the bell's host function ran
    after = _settled()
    assert after["doorbell_fds"] == before["doorbell_fds"]
    armed = after["doorbells_armed"] - before["doorbells_armed"]
    fired = after["doorbells_fired"] - before["doorbells_fired"]
    retired = after["doorbells_retired"] - before["doorbells_retired"]
    assert armed == fired + retired == 1
    s.close()


def test_a_loop_closed_in_the_turn_after_a_ring_leaves_no_read_end_open() -> None:
    """A bell's read end is closed one loop turn after it rings; a loop
    stopped in the turn that handles the ring and then closed never runs that
    turn: a sweep closes the read end (it stayed open, counted against the
    doorbell's limit, for good)."""
    import asyncio

    cs.use_backend("sim")
    cs.configure(poll=_sleepy("doorbell"))  # (no pass finds the event first)
    s = cs.Stream()
    asyncio.run(s.record().wait())  # (a lane made, imports done)
    before = _settled()
    fds = len(os.listdir("/proc/self/fd")) if _PROC_FDS else None
    gate = threading.Event()
    sim.launch(s, lambda: gate.wait(20))
    event = s.record()
    loop = asyncio.new_event_loop()
    task = loop.create_task(event.wait())

    rang = []

    def ring_while_busy() -> None:  # the bell rings while the loop is busy here,
        (bell,) = _doorbell._doorbell.watched  # and the stop below is due by the
        gate.set()  # time its turn comes
        deadline = time.monotonic() + 10
        while not _doorbell._has_fired(bell.rfd) and time.monotonic() < deadline:
            time.sleep(0.001)
        rang.append(_doorbell._has_fired(bell.rfd))
        time.sleep(0.02)  # (past the stop's due time)

    loop.call_later(0.05, ring_while_busy)
    loop.call_later(0.06, loop.stop)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (asyncio: "Task was destroyed but it is pending")
        loop.run_forever()
        loop.close()
        del task, loop
        gc.collect()
    assert rang == [True]
    s.synchronize()
    after = _settled()  # the sweep
    assert after["doorbells_fired"] == before["doorbells_fired"] + 1
    assert after["doorbell_fds"] == before["doorbell_fds"]
    if fds is not None:
        assert len(os.listdir("/proc/self/fd")) == fds
    s.close()


def test_a_late_fired_report_forgets_only_its_own_write_end() -> None:
    """A bell's host function closed write end N, and a new bell's pipe took
    the number before the old bell's FIRED report was applied: the report must
    not forget the new write end (then nothing would close it when its host
    function is skipped, a device reset say, nor a forked child its copy)."""
    doorbell = _doorbell._Doorbell()
    low = os.open(os.devnull, os.O_RDONLY)  # freed later: the new read end takes it
    r_old, w_old = os.pipe()
    old = SimpleNamespace(wfd=w_old, inode=os.fstat(r_old).st_ino)
    doorbell.handed[w_old] = old.inode
    os.close(w_old)  # the host function ran
    os.close(low)
    r_new, w_new = os.pipe()
    try:
        assert w_new == w_old  # the number went to the new bell's write end
        doorbell.handed[w_new] = os.fstat(r_new).st_ino
        doorbell._not_handed(cast(Any, old))  # the old bell's late report
        assert w_new in doorbell.handed
        doorbell._close_if_ours(w_new)  # its host function was skipped: closed here
        with pytest.raises(OSError):
            os.fstat(w_new)
    finally:
        os.close(r_old)
        os.close(r_new)
