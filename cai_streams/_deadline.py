"""Timeouts for the library's own awaits that keep nothing past a closed loop.

anyio keeps each asyncio task's cancel scope in a module-level
``WeakKeyDictionary`` keyed by the task, whose value (the scope, its timer
handle) refers back to the task: an asyncio loop closed while a task is
parked inside ``anyio.move_on_after`` keeps that task, its frames and all
they hold (arrays, pinned events) for the rest of the process. Under asyncio
(3.11 and later) :func:`finished_within` uses ``asyncio.timeout``, whose only
reference is the loop's timer; under trio, whose runs end every task, and on
Python 3.10, anyio's scope.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel
import sniffio

__all__ = ["finished_within"]

_asyncio_timeout: Any = getattr(asyncio, "timeout", None)  # (3.11 and later)


async def finished_within(seconds: float, fn: Callable[[], Awaitable[object]]) -> bool:
    """Await ``fn()``; False if ``seconds`` passed first (``fn()`` was then
    cancelled), unless a cancel scope around the caller expired too: then that
    cancellation is raised, for the caller's scope to catch. An exception of
    ``fn()`` propagates, a ``TimeoutError`` of its own included. Yields to the
    event loop."""
    if _asyncio_timeout is not None and sniffio.current_async_library() == "asyncio":
        scope = _asyncio_timeout(seconds)
        try:
            async with scope:
                await fn()
        except TimeoutError:
            if not scope.expired():
                raise
        else:
            return True
        # A cancel scope around the caller that expired too, in the same loop
        # turn (its cancellation held back: the task was being cancelled) or
        # due but not yet run, goes in at one more turn of the loop, and the
        # caller's scope catches it. (The caller raises its TimeoutError
        # outside this handler: nothing chained.)
        await anyio.lowlevel.checkpoint()
        return False
    with anyio.move_on_after(seconds) as cancel:
        await fn()
    if cancel.cancelled_caught:
        await anyio.lowlevel.checkpoint()  # (as above: a scope of the caller's)
        return False
    return True
