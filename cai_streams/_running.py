"""The async library running in this thread, asked cheaply: the task running
now, and a bare checkpoint.

Every handoff asks both. anyio answers through its backend dispatch (sniffio,
then a ``TaskInfo`` object built per call: about 2 µs under asyncio); these
ask the running library directly and give the same answers: a task is named
by ``id()`` of the library's task object, as ``anyio.get_current_task().id``
names it, and a checkpoint is what anyio's is (``asyncio.sleep(0)``, or
``trio.lowlevel.checkpoint()``). Another library sniffio names goes through
anyio.
"""

from __future__ import annotations

import asyncio
import sys

import anyio
import anyio.lowlevel
import sniffio

__all__ = ["checkpoint", "current_task_id"]


def _library() -> str | None:
    """What sniffio would name, without its exception when nothing runs
    (None: no library set one; asyncio may still run)."""
    name = sniffio.thread_local.name
    return sniffio.current_async_library_cvar.get() if name is None else name


def current_task_id() -> int | None:
    """The task running in this thread (``anyio.get_current_task().id``), or
    None outside any task (synchronous code, a loop callback). Does not block."""
    name = _library()
    if name is None or name == "asyncio":
        if asyncio._get_running_loop() is None:
            return None
        task = asyncio.current_task()
        return None if task is None else id(task)
    try:
        if name == "trio":
            return id(sys.modules["trio"].lowlevel.current_task())
        return anyio.get_current_task().id
    except RuntimeError:  # outside any task
        return None


async def checkpoint() -> None:
    """``anyio.lowlevel.checkpoint()``: yields to the event loop once, and is a
    cancellation point."""
    name = _library()
    if name == "trio":
        await sys.modules["trio"].lowlevel.checkpoint()
    elif name in (None, "asyncio") and asyncio._get_running_loop() is not None:
        await asyncio.sleep(0)
    else:
        await anyio.lowlevel.checkpoint()
