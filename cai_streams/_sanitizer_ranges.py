"""The sanitizer's shadow memory: byte ranges in a sorted interval map.

Memory is cut into disjoint segments, sorted by start; each holds the last
write to its bytes and the reads since (one per actor, only those no later
read is ordered after). Finding what an access overlaps is a binary search
plus the segments it covers, so its cost is logarithmic in the number of
segments whatever the extent it claims (an interface claiming 2**44 elements
is one segment, not a walk over every megabyte). A write replaces every
segment it covers by one, so the map holds at most about one segment per
live boundary between accesses.
"""

from __future__ import annotations

import weakref
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Access", "Segment", "ShadowMap"]


@dataclass(frozen=True, slots=True)
class Access:
    """One recorded access: who, when (its tick), where in the program."""

    kind: str  # "read" or "write"
    actor: Hashable
    tick: int
    lo: int
    hi: int
    what: str  # "kernel 'fill'", "writing() block", "to_host()", ...
    site: str  # "file.py:12"
    #: the memory was freed (to the caching pool) after this access, which the
    #: freeing thread was not ordered after: the work may still use the block
    freed: bool = False
    #: a hold of the memory's owner was let go after the library saw this
    #: access's work complete: the memory is freed after that, in any thread
    held: bool = False
    #: a host thread's read through views (a ``consume``'s, and those of the
    #: reads it stands for), which lasts as long as one of them does; None: a
    #: read whose end is not known (a stream's, a host read of another kind)
    until: tuple[weakref.ref[Any], ...] | None = field(default=None, compare=False)
    #: more witnesses of its end: ``(actor, tick)`` of each host thread that an
    #: export naming no stream told the data was ready (whatever is ordered
    #: after one of them is ordered after this access too)
    vouched: tuple[tuple[Hashable, int], ...] = ()


class Segment:
    __slots__ = ("hi", "lo", "reads", "write")

    def __init__(
        self, lo: int, hi: int, write: Access | None, reads: dict[Hashable, Access]
    ) -> None:
        self.lo, self.hi = lo, hi
        self.write = write
        self.reads = reads

    def accesses(self) -> Iterator[Access]:
        if self.write is not None:
            yield self.write
        yield from self.reads.values()


class ShadowMap:
    """Disjoint segments sorted by start (parallel lists, for ``bisect``)."""

    __slots__ = ("_segments", "_starts")

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._segments: list[Segment] = []

    def __len__(self) -> int:
        return len(self._segments)

    def __iter__(self) -> Iterator[Segment]:
        return iter(self._segments)

    def _first(self, lo: int) -> int:
        """Index of the first segment that ends after ``lo``."""
        i = bisect_right(self._starts, lo) - 1
        if i < 0 or self._segments[i].hi <= lo:
            i += 1
        return i

    def overlapping(self, lo: int, hi: int) -> Iterator[Segment]:
        segments = self._segments
        i = self._first(lo)
        while i < len(segments) and segments[i].lo < hi:
            yield segments[i]
            i += 1

    def _split(self, at: int) -> None:
        """Make ``at`` a segment boundary (both halves keep what the segment knew)."""
        i = bisect_right(self._starts, at) - 1
        if i >= 0:
            s = self._segments[i]
            if s.lo < at < s.hi:
                self._starts.insert(i + 1, at)
                self._segments.insert(i + 1, Segment(at, s.hi, s.write, dict(s.reads)))
                s.hi = at

    def cover(self, lo: int, hi: int) -> list[Segment]:
        """The segments that exactly cover ``[lo, hi)``, gaps filled with empty ones."""
        self._split(lo)
        self._split(hi)
        starts, segments = self._starts, self._segments
        i = bisect_left(starts, lo)
        out: list[Segment] = []
        at = lo
        while at < hi:
            if i < len(segments) and segments[i].lo == at:
                out.append(segments[i])
                at = segments[i].hi
            else:
                end = min(hi, segments[i].lo) if i < len(segments) else hi
                new = Segment(at, end, None, {})
                starts.insert(i, at)
                segments.insert(i, new)
                out.append(new)
                at = end
            i += 1
        return out

    def assign(self, lo: int, hi: int, write: Access) -> None:
        """``[lo, hi)`` is now one segment: this write, no reads since."""
        self._split(lo)
        self._split(hi)
        i = bisect_left(self._starts, lo)
        j = bisect_left(self._starts, hi, lo=i)
        self._starts[i:j] = [lo]
        self._segments[i:j] = [Segment(lo, hi, write, {})]

    def keep(self, lo: int, hi: int, keep: Callable[[Access], Access | None]) -> None:
        """Replace each access in ``[lo, hi)`` by ``keep(access)``, or drop it
        (None); segments left with nothing are dropped."""
        self._split(lo)
        self._split(hi)
        i = bisect_left(self._starts, lo)
        while i < len(self._segments) and self._segments[i].lo < hi:
            segment = self._segments[i]
            write = segment.write
            segment.write = None if write is None else keep(write)
            segment.reads = {k: a for k, r in segment.reads.items() if (a := keep(r)) is not None}
            if segment.write is None and not segment.reads:
                del self._starts[i]
                del self._segments[i]
            else:
                i += 1

    def forget(self, lo: int, hi: int) -> None:
        """Nothing is known of ``[lo, hi)`` any more."""
        self._split(lo)
        self._split(hi)
        i = bisect_left(self._starts, lo)
        j = bisect_left(self._starts, hi, lo=i)
        del self._starts[i:j]
        del self._segments[i:j]
