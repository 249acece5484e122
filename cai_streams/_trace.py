"""What the streams did, as a Chrome/Perfetto trace and a timeline picture.

``with cs.trace() as tr:`` records, until the block ends, every simulated
kernel (start and end, its duration and jitter included, on its stream's
track), every event record and stream wait (instants on the stream's track,
with a flow arrow from each record to the waits on it) and the host spans you
add with :meth:`Trace.host_span`.
Records and waits are stamped when the host enqueues them; kernels when the
device runs them. Kernels are timed on the simulated device only (a real
GPU's kernels belong to their library's profiler).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from os import PathLike
from typing import Any

from . import _observe
from ._backend import Backend, current_backend
from ._identity import StreamId, stream_id_now, thread_name
from ._observe import Observer

__all__ = ["Trace", "trace"]


@dataclass(frozen=True, slots=True)
class Span:
    track: str
    name: str
    start: float  # seconds since the trace began
    end: float


@dataclass
class Trace(Observer):
    """A recording of stream activity (see :func:`trace`). Its methods only
    read or add to the recording: none enqueues GPU work or waits for it
    (``to_chrome`` and ``plot`` write their file)."""

    t0: float = field(default_factory=time.perf_counter)
    spans: list[Span] = field(default_factory=list)
    #: (track, "record" | "wait", time, flow id)
    marks: list[tuple[str, str, float, int]] = field(default_factory=list)
    _last_record: dict[tuple[Backend, int], int] = field(default_factory=dict)
    _labels: dict[StreamId, str] = field(default_factory=dict)
    _flows: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    #: on a simulated stream's worker thread: the track of the kernel it runs
    _worker: threading.local = field(default_factory=threading.local)

    # -- recording --------------------------------------------------------------

    def _now(self) -> float:
        return time.perf_counter() - self.t0

    def name_stream(self, stream: Any, label: str) -> None:
        """Show ``stream`` (a Stream, or a handle on the current backend) as
        ``label`` on its track."""
        from ._stream import Stream, as_stream, stream_handle_of  # late: it imports much

        if isinstance(stream, Stream):
            key = stream._key()
        elif isinstance(stream, int) and not isinstance(stream, bool):
            key = stream_id_now(current_backend(), stream_handle_of(stream))
        else:  # (anything Stream.wrap takes; TypeError for what it does not)
            key = as_stream(stream, current_backend())._key()
        self._labels[key] = f"{label} ({key.handle:#x})"

    def _track(self, key: StreamId) -> str:
        label = self._labels.get(key)
        if label is not None:
            return label
        if key.handle == 1:
            return "stream 0x1 (legacy)"
        if key.handle == 2:
            return f"stream 0x2 ({thread_name(key.thread)})"
        return key.describe()  # ("cai_streams' export stream 0x...": the library's own)

    def kernel(
        self, backend: Backend, stream: int, fn: Callable[[], object], name: str
    ) -> Callable[[], object]:
        # Enqueued now, by this thread: the track is this thread's view of the
        # handle. The kernel hook runs later on the stream's worker thread,
        # after fn, and finds it there.
        track = self._track(stream_id_now(backend, stream))
        worker = self._worker

        def kernel() -> object:
            worker.track = track
            return fn()

        return kernel

    def kernel_ran(self, stream: int, name: str, start: float, end: float) -> None:
        """A simulated kernel ran (its duration and jitter included)."""
        track = getattr(self._worker, "track", None)
        self._worker.track = None
        if track is None:
            track = self._track(stream_id_now(current_backend(), stream))
        self.spans.append(Span(track, name, start - self.t0, end - self.t0))

    def recorded(self, backend: Backend, event: int, stream: int) -> None:
        with self._lock:
            self._flows += 1
            self._last_record[(backend, event)] = self._flows
            track = self._track(stream_id_now(backend, stream))
            self.marks.append((track, "record", self._now(), self._flows))

    def waited(self, backend: Backend, stream: int, event: int) -> None:
        with self._lock:
            flow = self._last_record.get((backend, event), 0)
            track = self._track(stream_id_now(backend, stream))
            self.marks.append((track, "wait", self._now(), flow))

    def host_span(self, name: str, start: float, end: float) -> None:
        """Add a host activity (``time.perf_counter()`` values) to the host track."""
        self.spans.append(Span("host", name, start - self.t0, end - self.t0))

    # -- reading ------------------------------------------------------------------

    def tracks(self) -> list[str]:
        """Every track, the host first, then the streams in order of first use."""
        seen = dict.fromkeys(["host"])
        for s in sorted(self.spans, key=lambda s: s.start):
            seen.setdefault(s.track)
        for track, *_ in self.marks:
            seen.setdefault(track)
        return list(seen)

    def overlap(self) -> float:
        """Of the time any stream ran a kernel, the fraction when two or more did."""
        edges = sorted(
            [(s.start, 1) for s in self.spans if s.track != "host"]
            + [(s.end, -1) for s in self.spans if s.track != "host"]
        )
        busy = both = 0.0
        running, last = 0, 0.0
        for t, step in edges:
            if running >= 1:
                busy += t - last
            if running >= 2:
                both += t - last
            running += step
            last = t
        return both / busy if busy else 0.0

    def to_chrome(self) -> dict[str, Any]:
        """The trace in Chrome's Trace Event format (opens in Perfetto)."""
        tids = {track: i for i, track in enumerate(self.tracks())}
        out: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "cai_streams"}}
        ]
        for track, tid in tids.items():
            out.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": tid,
                        "args": {"name": track}})  # fmt: skip
            out.append({"ph": "M", "name": "thread_sort_index", "pid": 1, "tid": tid,
                        "args": {"sort_index": tid}})  # fmt: skip
        for s in self.spans:
            out.append({"ph": "X", "name": s.name, "cat": "host" if s.track == "host" else "kernel",
                        "pid": 1, "tid": tids[s.track], "ts": s.start * 1e6,
                        "dur": max(s.end - s.start, 1e-6) * 1e6})  # fmt: skip
        for track, kind, t, flow in self.marks:
            ts = t * 1e6
            out.append({"ph": "X", "name": kind, "cat": "event", "pid": 1, "tid": tids[track],
                        "ts": ts, "dur": 1.0})  # fmt: skip
            if flow:
                flow_event = {"name": "event", "cat": "event", "id": flow, "pid": 1,
                              "tid": tids[track], "ts": ts}  # fmt: skip
                if kind == "record":
                    out.append({"ph": "s", **flow_event})
                else:
                    out.append({"ph": "f", "bp": "e", **flow_event})
        return {"traceEvents": out, "displayTimeUnit": "ms"}

    def save(self, path: str | PathLike[str]) -> None:
        """Write :meth:`to_chrome` as JSON to ``path``. Blocks on file I/O."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_chrome(), f)

    def plot(self, path: str | PathLike[str], *, title: str = "") -> None:
        """Draw the timeline (one row per track) to a PNG; needs matplotlib."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            from matplotlib.patches import Patch
        except ImportError as exc:
            raise RuntimeError(
                "plotting needs matplotlib: pip install 'cai-streams[plot]'"
            ) from exc
        tracks = self.tracks()
        fig, ax = plt.subplots(figsize=(12, 0.6 * len(tracks) + 1.2))
        colors = plt.get_cmap("tab10")
        names = sorted({_kind(s.name) for s in self.spans})
        for row, track in enumerate(tracks):
            for s in (s for s in self.spans if s.track == track):
                color = colors(names.index(_kind(s.name)) % 10)
                ax.broken_barh([(s.start * 1e3, (s.end - s.start) * 1e3)], (row - 0.4, 0.8),
                               facecolors=color)  # fmt: skip
        ax.set_yticks(range(len(tracks)), tracks)
        ax.invert_yaxis()
        ax.set_xlabel("ms")
        handles = [Patch(color=colors(i % 10), label=n) for i, n in enumerate(names)]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
        ax.set_title(title or f"streams overlapped {self.overlap():.0%} of the busy time")
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)


def _kind(name: str) -> str:
    """A span's name without its trailing number ("consume 12" -> "consume")."""
    head, _, tail = name.rpartition(" ")
    return head if head and tail.isdigit() else name


@contextmanager
def trace() -> Iterator[Trace]:
    """Record stream activity inside the block (see :class:`Trace`).

    Does not block; costs a little host time per record, wait and kernel.
    """
    recording = Trace()
    _observe.add(recording)
    try:
        yield recording
    finally:
        _observe.remove(recording)
