"""What a :class:`~cai_streams.HazardError` says: both accesses, which
ordering is missing (on the GPU, or between host threads), and a fix that fits."""

from __future__ import annotations

from collections.abc import Hashable

from ._errors import HazardError
from ._identity import StreamId
from ._sanitizer_ranges import Access

__all__ = ["actor_name", "describe", "hazard"]

Clock = dict[Hashable, int]

_HOST_HANDOFF = (
    "hand the work over between the threads with something the sanitizer sees "
    "(`queue.Queue`, `threading.Event`, `threading.Lock`, `concurrent.futures`, "
    "`asyncio.to_thread`, `anyio.to_thread.run_sync`, `Thread.join`), or say it with "
    "`cs.happens_before(token)` in the giving thread and `cs.happens_after(token)` "
    "in the receiving one"
)


def actor_name(actor: Hashable) -> str:
    assert isinstance(actor, tuple)
    if actor[0] == "host":
        return f"host thread {actor[2]!r}"
    key: StreamId = actor[1]
    return key.describe() + (f" on device {key.device}" if key.device else "")


def describe(a: Access) -> str:
    return (
        f"{a.kind} of {a.hi - a.lo} bytes at {a.lo:#x} by "
        f"{actor_name(a.actor)} ({a.what}, {a.site})"
    )


def _is_host(a: Access) -> bool:
    assert isinstance(a.actor, tuple)
    return bool(a.actor[0] == "host")


def hazard(first: Access, second: Access, clock: Clock, ordered_host: str | None) -> HazardError:
    """``ordered_host``: another host thread that is ordered after ``first``
    (it waited for it), when there is one: then the missing ordering is
    between host threads."""
    if first.freed:
        missing = (
            f"the block was freed and reused while {actor_name(first.actor)} still used it "
            "(the caching allocator hands a freed block to the next allocation at once)"
        )
        fix = (
            f"keep the old owner alive until {actor_name(first.actor)} has passed that work, "
            "`cs.hold(owner, until=stream)`, or synchronize that stream before dropping it; "
            "or order the new owner's stream after it"
        )
    elif ordered_host is not None or (_is_host(first) and _is_host(second)):
        who = ordered_host or actor_name(first.actor)
        missing = (
            f"{who} is ordered after that access, but nothing orders "
            f"{actor_name(second.actor)} after {who}: a host-thread ordering is missing"
        )
        fix = _HOST_HANDOFF
        if not _is_host(second):
            fix += ", before enqueueing the second access"
    else:
        missing = f"nothing orders {actor_name(second.actor)} after that access on the GPU"
        if first.actor in clock:
            missing = (
                f"{actor_name(second.actor)} is ordered after earlier work of "
                f"{actor_name(first.actor)} (an event recorded, or a synchronization made, "
                "before that access) but not after the access itself"
            )
        fix = _gpu_fix(first, second)
    return HazardError(
        f"{describe(second)}\n  is not ordered after\n{describe(first)}:\n"
        f"  {missing}.\n  Fix: {fix}.",
        first=first,
        second=second,
    )


def _gpu_fix(first: Access, second: Access) -> str:
    if second.what.startswith("to_host"):
        return (
            "to_host() copies on the legacy default stream, which does not wait for "
            "non-blocking streams: synchronize the writer first, or copy on it with "
            "`x.to_host(stream=s)`"
        )
    if _is_host(second) and second.what.startswith("consume"):
        return (
            "the consume did not know of that work: the interface it read named no stream "
            "where it is pending, and no `writing()` block of a tracked array covered it (a "
            "slice of a tracked array is another array): consume the tracked array or "
            "`t.view`, write a tracked array inside `with t.writing(s)`, or make the "
            "interface name the stream that writes it"
        )
    if _is_host(second):
        return (
            "wait on the host before touching the data: `await cs.consume(arr)`, "
            "`cs.consume_blocking(arr)`, or synchronize an event recorded after that work"
        )
    if first.kind == "read" and second.kind == "write":
        return (
            "the buffer is reused while a reader may still run: write inside "
            "`with t.writing(s)` on a tracked array (it waits for pending reads), or read "
            "inside `async with cs.consuming(arr, stream=r)` (it joins the reader back)"
        )
    return (
        "order the streams: `cs.export()` joins pending work onto one stream, "
        "`cs.consume(arr, stream=s)` orders s after the producer, "
        "`with t.writing(s)` / `t.reading(s)` order s after conflicting work, "
        "or record an event after the first access and make the second stream wait on it"
    )
