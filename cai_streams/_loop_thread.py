"""Whether this thread runs an event loop, and the warning a blocking wait
made in it gives (:class:`~cai_streams.LoopBlockingWarning`).

A blocking wait in the loop's thread stalls every task of the loop, which is
what ``await consume`` exists to avoid; the blocking calls ask
:func:`warn_if_loop_blocked` just before they would wait (never when nothing
is pending, nor when they would not wait at all, as with ``timeout=0``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import warnings

from ._errors import LoopBlockingWarning

__all__ = ["loop_running", "warn_if_loop_blocked"]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_CONTEXTLIB = os.path.abspath(contextlib.__file__)
#: code file -> whether a warning skips its frames (this package's, contextlib's)
_skipped: dict[str, bool] = {}


def loop_running() -> str | None:
    """The async library whose event loop runs in this thread (``"asyncio"``,
    uvloop's included, or ``"trio"``), or None. Does not block.

    A worker thread of ``to_thread`` runs none (its loop runs elsewhere); trio
    in guest mode runs inside its host's asyncio loop, which is named, and so
    is the loop a Jupyter kernel runs its cells in.
    """
    if asyncio._get_running_loop() is not None:
        return "asyncio"
    trio = sys.modules.get("trio")
    if trio is not None:
        in_run = getattr(trio.lowlevel, "in_trio_run", None)
        if in_run is not None and in_run():
            return "trio"
    return None


def _skips(path: str) -> bool:
    found = _skipped.get(path)
    if found is None:
        full = os.path.abspath(path)  # (a frame's file may be named through "..")
        found = _skipped[path] = full.startswith(_PACKAGE_DIR) or full == _CONTEXTLIB
    return found


def _user_stacklevel() -> int:
    """The ``stacklevel`` that names the first caller outside this package and
    contextlib (``writing()`` is a generator context), counted from the
    function calling ``warnings.warn``."""
    frame = sys._getframe(2)  # the caller of warn_if_loop_blocked
    level = 2
    while frame is not None and _skips(frame.f_code.co_filename):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


def warn_if_loop_blocked(what: str, instead: str | None) -> None:
    """Give :class:`~cai_streams.LoopBlockingWarning` if this thread runs an
    event loop: the caller is about to block it. ``what`` says what is about
    to wait for what; ``instead``, the awaitable that does not block (None:
    there is none, and only a worker thread helps). Does not block."""
    library = loop_running()
    if library is None:
        return
    fix = "call it in a worker thread (anyio.to_thread.run_sync)"
    if instead is not None:
        fix = f"use {instead} from a coroutine, or {fix}"
    warnings.warn(
        f"{what} in the thread of a running {library} event loop: every task of "
        f"the loop waits with it. To keep the loop running, {fix}",
        LoopBlockingWarning,
        stacklevel=_user_stacklevel(),
    )
