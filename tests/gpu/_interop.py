"""Helpers of the interop tests: latched windows that never deadlock.

A test holds a producer's (or a consumer's) stream with a latch kernel,
enqueues work behind it, and proves the ordering with the data a consumer
sees; beside it, a control runs the same program without the ordering and
sees the wrong data. While a latch is held the test's thread never
synchronizes on anything that waits for it: it *polls* events
(``cudaEventQuery``) with a deadline, and releases the latch itself, or from
a timer thread when it must block (a host-mode consume, CuPy's own
``cudaStreamSynchronize`` on a CAI stream).

Every stream a latch holds, or that waits on a held one, is non-blocking, so
the legacy default stream (used to make and read arrays) never waits for a
latch. Every kernel launched while a latch is held ran once before, unlatched
(first use loads a module, which may synchronize the context).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import cai_streams as cs

from ..device_ops import Latch

#: elements of every test array (float32); a third of it is 128 elements
N = 384
#: what a buffer holds before the producer's write, and what the write puts there
OLD, NEW = 1.0, 7.0
#: seconds allowed for GPU work that waits for no latch (it takes microseconds)
SETTLES = 10.0
#: seconds GPU work ordered after a held latch is watched, to see it stay pending
HELD = 0.2
#: seconds after which a timer releases a latch the test's thread is blocked on
RELEASE_AFTER = 0.1
#: bound of every host wait in these tests
TIMEOUT = 20.0


def done(stream: cs.Stream) -> Callable[[], bool]:
    """A query: is the work enqueued on ``stream`` so far complete? Never blocks."""
    event = stream.record()
    return lambda: event.is_done


def poll(ready: Callable[[], bool], seconds: float) -> bool:
    """Whether ``ready()`` became true within ``seconds`` (polls; never blocks)."""
    deadline = time.monotonic() + seconds
    while not ready():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0005)
    return True


def settles(stream: cs.Stream) -> None:
    """Assert that the work enqueued on ``stream`` so far completes with no release."""
    assert poll(done(stream), SETTLES), f"{stream!r} never finished: it waits on a latch"


def still_held(stream: cs.Stream) -> None:
    """Assert that the work enqueued on ``stream`` so far stays pending for ``HELD`` s:
    it is ordered after a latched stream."""
    assert not poll(done(stream), HELD), f"{stream!r} finished while the latch was held"


async def asettles(stream: cs.Stream) -> None:
    """:func:`settles` for coroutines: polled from the event loop (never blocks it)."""
    await stream.record().wait(timeout=SETTLES)


def racing(on_purpose: bool) -> contextlib.AbstractContextManager[None]:
    """The sanitizer is off in a control, which races on purpose."""
    return cs.sanitize(False) if on_purpose else contextlib.nullcontext()


def ordered_elsewhere() -> contextlib.AbstractContextManager[None]:
    """The sanitizer is off where another library orders the consumer's stream:
    cuda.core's StridedMemoryView waits with an event of its own, which the
    sanitizer (it sees the calls made through cai_streams) cannot see. The data
    proves the order, and its control shows the race."""
    return cs.sanitize(False)


class Releaser:
    """Releases a latch from a timer thread, for a test thread that blocks (or
    awaits) until the latched work is done. ``fired`` is set just before the
    release: a waiter that returns only after the release finds it set."""

    def __init__(self, latch: Latch, after: float = RELEASE_AFTER) -> None:
        self._latch = latch
        self.fired = threading.Event()
        self._timer = threading.Timer(after, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        self.fired.set()
        self._latch.release()

    def join(self) -> None:
        self._timer.join(TIMEOUT)

    def cancel(self) -> None:
        """Stop the timer if it has not fired (the test releases the latch itself)."""
        self._timer.cancel()
        self._timer.join(TIMEOUT)


def thirds(*values: float) -> np.ndarray[Any, Any]:
    """The expected contents of a buffer written a third at a time."""
    return np.repeat(np.asarray(values, dtype=np.float32), N // 3)


def release_writers(
    latches: Sequence[Latch], writers: Sequence[cs.Stream], consumer: cs.Stream, last: int | None
) -> None:
    """Release three latched writers so that the consumer's ordering shows.

    ``last`` None (the control: the consumer waits for writer 2's stream
    only): release writer 2; the consumer completes while writers 0 and 1 are
    still held. Otherwise release every writer but ``last``, let their writes
    finish, check that the consumer is still held (it waits for ``last`` too),
    then release ``last``.
    """
    if last is None:
        latches[2].release()
        settles(consumer)
        for latch in latches[:2]:
            latch.release()
        return
    for i, latch in enumerate(latches):
        if i != last:
            latch.release()
            settles(writers[i])
    still_held(consumer)
    latches[last].release()


def expected_thirds(last: int | None) -> np.ndarray[Any, Any]:
    """All NEW when the consumer waited for every writer; the control saw only writer 2's."""
    return thirds(NEW, NEW, NEW) if last is not None else thirds(OLD, OLD, NEW)


def warm_cupy(cp: Any) -> None:
    """Run the CuPy work these tests enqueue while a latch is held, once, unlatched."""
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        a = cp.full(N, OLD, dtype=cp.float32)
        b = cp.zeros(N, dtype=cp.float32)
        a.fill(NEW)
        for i in range(3):
            a[i * (N // 3) : (i + 1) * (N // 3)].fill(NEW)
        cp.copyto(b, a)
        cp.copyto(b, cp.asarray(cs.read_interface(a).with_stream(None)))
    s.synchronize()
    cp.asnumpy(b, stream=s)


def warm_torch(torch: Any) -> None:
    """Run the PyTorch work these tests enqueue while a latch is held, once, unlatched."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        a = torch.full((N,), OLD, device="cuda", dtype=torch.float32)
        b = torch.zeros(N, device="cuda", dtype=torch.float32)
        a.fill_(NEW)
        for i in range(3):
            a[i * (N // 3) : (i + 1) * (N // 3)].fill_(NEW)
        b.copy_(a)
        b.copy_(torch.as_tensor(cs.read_interface(a), device="cuda"))
    s.synchronize()
    b.cpu()
