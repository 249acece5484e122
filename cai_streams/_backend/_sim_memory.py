"""Simulated device memory: a per-device caching allocator, as CuPy's and PyTorch's.

Memory is host RAM at real, 256-byte aligned addresses, in segments that the
pool keeps for the life of the process (or until ``sim.reset()``). An
allocation hands out a segment of its size class (a multiple of 512 bytes),
the most recently freed one first. When the last array over an allocation is
collected, its segment goes back to its device's pool and the next allocation
of that size class on that device may get it at once, whatever work other
streams still have enqueued on it: a kernel holds a pointer, not its arrays,
so a pending kernel reads or writes whatever now lives there.
"""

from __future__ import annotations

import bisect
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, Final

import numpy as np

__all__ = ["Memory", "free_hooks"]

#: called with (start, end) of every block that goes back to the pool, before
#: any allocation can take it (the sanitizer forgets what it knew of that memory)
free_hooks: list[Callable[[int, int], None]] = []

_ALIGN: Final = 256
_SIZE_CLASS: Final = 512

Buffer = np.ndarray[Any, np.dtype[np.uint8]]


class _Segment:
    __slots__ = ("device", "live", "nbytes", "ptr", "raw", "size")

    def __init__(self, ptr: int, device: int, raw: Buffer) -> None:
        self.ptr = ptr
        self.device = device
        self.raw = raw  # owned by the pool: kernels' views keep it, never the arrays
        self.size = int(raw.size)
        self.nbytes = 0  # of the allocation now using it
        self.live: _Live | None = None


def _collected(ref: weakref.ref[Buffer]) -> None:
    # No lock here: this runs in whatever collection frees the array. The
    # block is free from now on: the hooks are told first (the sanitizer
    # forgets what the free makes done), and only then is it queued, so no
    # allocation in another thread can take it before the free is known there;
    # the next allocation or lookup files it in its pool.
    assert isinstance(ref, _Live)
    segment = ref.segment
    try:
        for hook in free_hooks:
            hook(segment.ptr, segment.ptr + segment.size)
    finally:  # (a hook that raised: the block is still free)
        ref.released.append(segment)


class _Live(weakref.ref[Buffer]):
    """The allocation's arrays, weakly; one object per allocation, no closure."""

    __slots__ = ("released", "segment")

    def __new__(cls, block: Buffer, segment: _Segment, released: deque[_Segment]) -> _Live:
        return super().__new__(cls, block, _collected)

    def __init__(self, block: Buffer, segment: _Segment, released: deque[_Segment]) -> None:
        self.segment = segment
        self.released = released


class Memory:
    """All devices' segments, found again by pointer, and their free pools."""

    def __init__(self) -> None:
        # Re-entrant: kept so, as callers may hold it while a collection runs
        # (collected arrays only append to a queue, drained on the next call).
        self._lock = threading.RLock()
        self._starts: list[int] = []
        self._segments: dict[int, _Segment] = {}
        self._free: dict[tuple[int, int], list[_Segment]] = {}
        self._released: deque[_Segment] = deque()

    def allocate(
        self, nbytes: int, device: int, before_new_segment: Callable[[], None]
    ) -> tuple[int, Buffer]:
        """A block of ``nbytes`` on ``device`` and its address; a freed block of
        the same size class when there is one, else a new segment (after
        ``before_new_segment()``, which may refuse, as cudaMalloc may)."""
        if nbytes == 0:
            return 0, np.empty(0, dtype=np.uint8)
        self.drain()
        size = -(-nbytes // _SIZE_CLASS) * _SIZE_CLASS
        with self._lock:
            cached = self._free.get((device, size))
            segment = cached.pop() if cached else None
        if segment is None:
            before_new_segment()
            raw = np.empty(size + _ALIGN, dtype=np.uint8)
            offset = (-raw.ctypes.data) % _ALIGN
            segment = _Segment(int(raw.ctypes.data) + offset, device, raw[offset : offset + size])
            with self._lock:
                bisect.insort(self._starts, segment.ptr)
                self._segments[segment.ptr] = segment
        # The array's base is a memoryview, so numpy stops collapsing views at
        # `block`: it lives exactly as long as some array over this allocation.
        block: Buffer = np.frombuffer(segment.raw.data[:nbytes], dtype=np.uint8)
        segment.nbytes = nbytes
        segment.live = _Live(block, segment, self._released)
        return segment.ptr, block

    def drain(self) -> None:
        """Put the blocks of collected arrays back in their pools."""
        if not self._released:
            return
        with self._lock:
            while self._released:
                segment = self._released.popleft()
                segment.live = None
                self._free.setdefault((segment.device, segment.size), []).append(segment)

    def _segment_at(self, ptr: int) -> _Segment | None:
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i < 0:
            return None
        segment = self._segments[self._starts[i]]
        return segment if ptr < segment.ptr + segment.size else None

    def find(self, ptr: int, nbytes: int) -> tuple[Buffer, int] | None:
        """The live allocation holding ``[ptr, ptr + nbytes)`` and the offset
        into it; the buffer does not keep the allocation's arrays alive."""
        self.drain()
        with self._lock:
            segment = self._segment_at(ptr)
            if segment is None:
                return None
            live, size = segment.live, segment.nbytes
        if live is None or live() is None or ptr + nbytes > segment.ptr + size:
            return None
        return segment.raw[:size], ptr - segment.ptr

    def device_of(self, ptr: int) -> int | None:
        """The device whose memory (in use or cached) holds ``ptr``."""
        with self._lock:
            segment = self._segment_at(ptr)
            return None if segment is None else segment.device

    def cached(self, device: int) -> int:
        """How many free blocks ``device``'s pool holds."""
        self.drain()
        with self._lock:
            return sum(len(v) for (d, _), v in self._free.items() if d == device)

    def release_cached(self, device: int) -> None:
        """Give ``device``'s free blocks back (they are forgotten by address)."""
        self.drain()
        with self._lock:
            for key in [k for k in self._free if k[0] == device]:
                for segment in self._free.pop(key):
                    del self._segments[segment.ptr]
                    del self._starts[bisect.bisect_left(self._starts, segment.ptr)]
