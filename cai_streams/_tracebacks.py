"""What a raised exception keeps alive: the library's frames in its traceback.

A traceback keeps every frame the exception passed through, and each frame
its local variables, for as long as anything keeps the exception: an
``except ... as e`` stored away, a log record, a task group's
``ExceptionGroup``, a debugger, or the ``TimeoutError`` a cancel scope raised
in place of the cancellation (it chains it, with its frames). A consume that
failed, timed out or was cancelled made views in those frames, and a view
keeps its owner: a DLPack producer's tensor (its deleter would not run), a
buffer the caller has dropped. The work those owners wait for is held by the
library's own holds, which let go once it completes; the frames would keep
them for as long as the exception lives, on the GPU too.

:func:`release_frames` clears the locals of the library's own frames that an
exception (and every exception it chains) has left. Each of those frames has
finished: an exception passes through a frame only by leaving it, except the
one that caught it, which may still run and is left alone (the caller deletes
its own locals). Tracebacks still name every frame and line; a debugger sees
no locals in the library's frames.
"""

from __future__ import annotations

import contextlib
from typing import Final

__all__ = ["release_frames"]

_PREFIX: Final = __name__.rpartition(".")[0] + "."
#: at most this many exceptions of a chain (a cycle or a huge group is cut short)
_MAX_EXCEPTIONS: Final = 64


def release_frames(exc: BaseException) -> None:
    """Clear the local variables of this package's finished frames in the
    tracebacks of ``exc``, its causes, contexts and group members. Does not
    block; never raises."""
    seen: set[int] = set()
    todo = [exc]
    while todo and len(seen) < _MAX_EXCEPTIONS:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        tb = e.__traceback__
        tb = None if tb is None else tb.tb_next  # the head caught it: it may still run
        while tb is not None:
            frame = tb.tb_frame
            if str(frame.f_globals.get("__name__", "")).startswith(_PREFIX):
                with contextlib.suppress(RuntimeError):  # a frame still executing
                    frame.clear()
            tb = tb.tb_next
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
        members = getattr(e, "exceptions", ())  # an exception group (3.11+ or the backport)
        if isinstance(members, tuple):
            todo.extend(m for m in members if isinstance(m, BaseException))
