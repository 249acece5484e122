"""Objects that stand for one thing of this process: a CUDA stream, event or
graph, a buffer's tracked state, a view of device memory. A copy of one would
be a second owner of the same handle (destroyed twice: the second time, a
stream or event that CUDA gave the recycled handle to) or a second wrapper of
the same state, so ``copy.copy`` and ``copy.deepcopy`` give the object itself,
as they do for other immutable values, and pickling it raises TypeError:
its handles and pointers mean nothing in another process.
"""

from __future__ import annotations

from typing import Any, NoReturn, TypeVar

__all__ = ["Unique"]

_T = TypeVar("_T", bound="Unique")


class Unique:
    __slots__ = ()

    def __copy__(self: _T) -> _T:
        return self

    def __deepcopy__(self: _T, memo: dict[int, Any]) -> _T:
        return self

    def __reduce__(self) -> NoReturn:
        raise TypeError(
            f"cannot pickle a {type(self).__name__}: it stands for a CUDA object or device "
            "memory of this process, which another process cannot use; share the object "
            "itself (copy.copy gives the same object), or hand the data on through CUDA IPC"
        )
