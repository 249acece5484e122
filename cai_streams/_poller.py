"""Waiting for events from an event loop without blocking it."""

from __future__ import annotations

import math

import anyio

from ._backend import Backend

__all__ = ["wait_for_event"]


async def wait_for_event(
    backend: Backend, event: int, *, timeout: float | None, keepalive: object
) -> None:
    """Poll ``event`` until complete; a cancellation point that leaks nothing."""
    if timeout is not None and (math.isnan(timeout) or timeout < 0):
        raise ValueError(f"timeout must be a non-negative number of seconds, got {timeout}")
    with anyio.fail_after(timeout):
        await anyio.lowlevel.checkpoint()
        delay = 0.0
        while not backend.query(event):
            await anyio.sleep(delay)
            delay = min(0.001, delay * 2 or 0.00005)
    del keepalive
