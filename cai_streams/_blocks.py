"""``writing()`` and ``reading()`` blocks open on a buffer, and who holds them.

A block's work is enqueued while its body runs, so until it ends nothing can
wait for it on a stream. An access by another owner (thread, or task) that
conflicts with an open block waits for the block to end: blocking, bounded,
in synchronous code; yielding to the event loop in a coroutine. The block's
own owner instead sees what it enqueued so far.
"""

from __future__ import annotations

import threading
import time
from typing import NamedTuple

import anyio
import anyio.lowlevel

from ._access import Access, Kind
from ._errors import DeviceFaultError, KernelError
from ._identity import StreamId
from ._loop_thread import warn_if_loop_blocked
from ._poller import policy_sleep, poll_policy
from ._running import current_task_id
from ._stream import Stream

__all__ = ["Blocked", "OpenBlock", "Owner", "current_owner", "wait_block_async", "wait_block_sync"]

#: who holds a block: (thread ident, task id or None outside async code)
Owner = tuple[int, "int | None"]


def current_owner() -> Owner:
    """This thread, and the task running in it if any. Cheap (no exception
    raised and caught, as ``sniffio.current_async_library`` does; no anyio
    dispatch: see ``_running``)."""
    return (threading.get_ident(), current_task_id())


def fault_again(fault: DeviceFaultError) -> DeviceFaultError:
    """A fresh error for device fault ``fault``, to raise once more: one
    instance raised again and again would keep every frame it passed through
    (and so their arrays) in its traceback, and be shared between threads."""
    if isinstance(fault, KernelError):
        return KernelError(fault.kernel, fault.stream, fault.__cause__ or fault)
    again = DeviceFaultError(fault.code, fault.name, fault.detail)
    again.__cause__ = fault.__cause__
    return again


class OpenBlock:
    """A ``writing()`` or ``reading()`` block whose body is running.

    Its work is not enqueued yet, so nothing can wait for it on a stream: an
    access by another owner that conflicts with it waits (on the host, or
    awaiting) until ``done`` is set; the block's own owner sees the work
    enqueued so far (an event recorded on its stream now).
    """

    __slots__ = (
        "at_close",
        "began_capturing",
        "capture",
        "covered",
        "disjoint",
        "done",
        "group",
        "key",
        "kind",
        "name",
        "owner",
        "serial",
        "stream",
    )

    def __init__(
        self,
        kind: Kind,
        disjoint: bool,
        stream: Stream,
        key: StreamId,
        owner: Owner,
        covered: list[Access],
        group: int,
        name: str = "writing()/reading()",
        *,
        began_capturing: bool = False,
        capture: object | None = None,
        serial: int = 0,
    ) -> None:
        self.name = name  # what opened it, for the messages
        #: its stream was capturing when it opened: a capture still under way
        #: when it ends began before the block's work, or in it (``_pending``)
        self.began_capturing = began_capturing
        #: that capture, if this library began it (``_capture.under_way``): one
        #: that ends in the block and another that begins in it tell apart
        self.capture = capture
        #: the newest capture's serial when it opened (``_capture.serial_now``):
        #: a capture of its stream that began and ended in it is told by it
        self.serial = serial
        self.kind = kind
        self.disjoint = disjoint
        self.group = group
        self.stream = stream
        self.key = key
        self.owner = owner
        self.covered = covered  # what the block's write replaces at exit
        #: its record, made when its stream closed while it was open (nothing
        #: can be enqueued there after): its exit adds this one (``_pending``);
        #: or the device's fault that made that record fail: its exit adds
        #: nothing and raises it (none of the block's work runs)
        self.at_close: Access | DeviceFaultError | None = None
        self.done = threading.Event()

    def conflicts(self, kind: Kind, disjoint: bool) -> bool:
        if self.kind is Kind.READ:
            return kind is Kind.WRITE
        return kind is Kind.READ or not (self.disjoint and disjoint)


class Blocked(NamedTuple):
    """Another owner's open block must end first."""

    block: OpenBlock


def wait_block_sync(block: OpenBlock, me: Owner, deadline: float, what: str) -> None:
    """Block the calling thread until ``block`` ends (at most until ``deadline``,
    ``time.monotonic()`` seconds)."""
    if block.owner[0] == me[0]:
        fix = (
            "Let the consuming() body end before it awaits, or write once it ended"
            if block.name == "consuming()"
            else "Close the block before awaiting, or use `await cs.consume()`"
        )
        raise RuntimeError(
            f"{what} of an array while another task of this thread holds a "
            f"{block.name} block of it across an await: waiting here would never end. {fix}"
        )
    if not block.done.is_set() and deadline > time.monotonic():  # (else it raises at once)
        warn_if_loop_blocked(
            f"{what} is about to wait for another thread's {block.name} block",
            "`await cs.consume()`" if what == "consume_blocking()" else None,
        )
    while (left := deadline - time.monotonic()) > 0:
        if block.done.wait(min(left, threading.TIMEOUT_MAX)):  # (timeout=inf: the longest)
            return
    raise TimeoutError(  # (a body that waits for this thread, by to_thread say, never ends)
        f"{what}: another thread's {block.name} block of this array did not end in time "
        "(if its body waits for this thread, it never will: access the array before "
        "the block or after it)"
    )


async def wait_block_async(block: OpenBlock, deadline: float | None) -> None:
    """Wait until ``block`` ends, yielding to the event loop (never holding a
    thread lock); TimeoutError at ``deadline`` (``anyio.current_time()``)."""
    policy = poll_policy()
    delays = iter(policy.delays())
    while not block.done.is_set():
        if poll_policy() is not policy:  # (set_poll_policy: from the next pass on)
            policy = poll_policy()
            delays = iter(policy.delays())
        delay = next(delays)
        if deadline is not None:
            left = deadline - anyio.current_time()
            if left <= 0:
                # a cancel scope around the caller that expired with it (due,
                # its timer not run yet) catches it: two more turns of the loop
                # (asyncio runs a task woken by the first before that turn's
                # due timers)
                await anyio.lowlevel.checkpoint()
                await anyio.lowlevel.checkpoint()
                holder = (
                    "another task's"
                    if block.owner[0] == threading.get_ident()
                    else "another thread's"
                )
                raise TimeoutError(  # (a consume waits only for writes)
                    f"{holder} writing() block of this array did not end in time"
                )
            delay = min(delay, left)
        await policy_sleep(delay)  # (a new policy ends it: the old one's length)
