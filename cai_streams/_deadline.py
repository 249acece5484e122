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
import sniffio

__all__ = ["finished_within"]

_asyncio_timeout: Any = getattr(asyncio, "timeout", None)  # (3.11 and later)


async def finished_within(seconds: float, fn: Callable[[], Awaitable[object]]) -> bool:
    """Await ``fn()``; False if ``seconds`` passed first (``fn()`` was then
    cancelled). An exception of ``fn()`` propagates, a ``TimeoutError`` of its
    own included. Yields to the event loop."""
    if _asyncio_timeout is not None and sniffio.current_async_library() == "asyncio":
        scope = _asyncio_timeout(seconds)
        try:
            async with scope:
                await fn()
        except TimeoutError:
            if not scope.expired():
                raise
            return False  # (raised again by the caller, outside this handler)
        return True
    with anyio.move_on_after(seconds) as cancel:
        await fn()
    return not cancel.cancelled_caught
