"""A simulated stream that waits for another is woken when the point it waits
for is reached, not when the wait is enqueued.

A driver wakes no host thread for a stream wait. On the simulator every wake
of a stream's worker is a thread switch and a GIL handoff, which the
doorbell's notifier streams paid twice per bell (once for the wait, once for
its end). Seen in the worker thread's voluntary context switches, which only
change while the thread runs (Linux).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest

import cai_streams as cs
from cai_streams import sim

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self/task"), reason="needs per-thread counters in /proc"
)


@pytest.fixture(autouse=True)
def _sim() -> Iterator[None]:
    cs.use_backend("sim")
    yield


def _worker(stream: int) -> threading.Thread:
    """The worker thread of ``stream`` (by the stream, not its name: a
    destroyed stream whose handle this one took may still be draining under
    the same name)."""
    worker = cs.current_backend()._resolve(stream)._thread  # type: ignore[attr-defined]
    assert isinstance(worker, threading.Thread)
    return worker


def _switches(thread: threading.Thread) -> int:
    with open(f"/proc/self/task/{thread.native_id}/status") as status:
        for line in status:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches line")


def _parked(thread: threading.Thread) -> int:
    """The thread's switch count once it stopped changing (it sleeps)."""
    last = _switches(thread)
    for _ in range(100):
        time.sleep(0.01)
        now = _switches(thread)
        if now == last:
            return now
        last = now
    raise AssertionError("the worker never went to sleep")


def test_a_stream_wait_wakes_the_waiting_worker_only_once_its_point_is_reached() -> None:
    backend = cs.current_backend()
    producer, lane = backend.create_stream(), backend.create_stream()
    release = threading.Event()
    ran: list[str] = []
    try:
        sim.launch(producer, lambda: release.wait(10), name="held")
        event = backend.create_event()
        backend.record(event, producer)
        worker = _worker(lane)

        # control: work the lane can run at once wakes its worker
        before = _parked(worker)
        sim.launch(lane, lambda: ran.append("first"), name="first")
        backend.synchronize_stream(lane)
        assert _parked(worker) > before

        # a wait for the held producer, and work behind it: no wake until it ends
        before = _parked(worker)
        backend.stream_wait_event(lane, event)
        sim.launch(lane, lambda: ran.append("after the wait"), name="after")
        backend.launch_host_func(lane, _noop_address(), 0)
        time.sleep(0.05)  # time enough for a woken worker to run and sleep again
        woken_early = _switches(worker) - before
        assert not backend.query_stream(lane)
        release.set()
        backend.synchronize_stream(lane)
        assert ran == ["first", "after the wait"]
        assert woken_early == 0
        backend.destroy_event(event)
    finally:
        release.set()
        backend.synchronize_stream(producer)
        backend.destroy_stream(producer)
        backend.destroy_stream(lane)


def _noop_address() -> int:
    """A C function that ignores its argument: libc's ``getpid``."""
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
    address = ctypes.cast(libc.getpid, ctypes.c_void_p).value
    assert address
    return address
