"""Stream capture on the simulated device: the rules the driver enforces.

Probed on an H100 (CUDA 13, driver 580), with the same error codes:

* Work enqueued on a capturing stream is recorded, not run. The legacy stream
  cannot capture (900); a capturing stream cannot begin again (401).
* Synchronizing a capturing stream fails (900) and invalidates its capture;
  querying or synchronizing an event recorded in a capture under way fails
  (907) and invalidates it; once that capture has ended, the event is
  unusable until recorded again (1, cudaErrorInvalidValue).
* Potentially unsafe calls (a query, a host synchronize, cudaMalloc) fail
  (900) and invalidate the captures that forbid them: any non-relaxed capture
  begun by the calling thread, unless the thread's mode is relaxed; and, when
  the thread's mode is global, every global capture of other threads.
* Using the legacy stream while a blocking stream of its device captures
  fails (906) and invalidates that capture; asking whether the legacy stream
  captures fails too (906), without invalidating.
* A capturing stream waiting on an event recorded outside the capture fails
  (905, invalidating); on a never-recorded event it is a no-op.
* Waiting on an event recorded in a capture forks the waiting stream into it;
  ``end_capture`` fails (904) if some fork's work was never joined back to the
  stream that began the capture. After an invalidation every use of the
  capture fails (901), ``end_capture`` included, which still ends it.
* A non-relaxed capture ends in the thread that began it; from another thread
  ``end_capture`` fails (908) and the capture is over.
"""

from __future__ import annotations

import threading
from typing import Any

from . import CaptureMode, CaptureStatus
from ._sim_graph import Capture, Graph, GraphExec
from ._sim_stream import Device, Handles, SimEvent, SimStream, sim_error

__all__ = ["CaptureRules"]

_Op = tuple[Any, ...]


def _invalidated() -> Exception:
    return sim_error(901, "operation failed due to a previous error during capture")


class CaptureRules:
    """A backend's capture sequences and graphs. Methods take streams and
    events already resolved; ``lock`` is the backend's (re-entrant) lock."""

    def __init__(self, lock: threading.RLock, handles: Handles) -> None:
        self._lock = lock
        self._handles = handles
        #: capture sequences begun and not yet ended
        self.active: set[Capture] = set()
        self._graphs: dict[int, Graph] = {}
        self._graph_execs: dict[int, GraphExec] = {}

    def _invalidate(self, captures: list[Capture]) -> None:
        with self._lock:
            for capture in captures:
                capture.invalidated = True

    def _end(self, capture: Capture) -> None:
        capture.ended = True
        self.active.discard(capture)
        for stream in capture.streams:
            stream.capture = None
            stream.tail = frozenset()

    def end_all(self, device: int) -> list[int]:
        """End (invalidated) every capture on ``device``: a reset. Returns the
        handles of the streams that were capturing."""
        ended: list[int] = []
        with self._lock:
            for capture in [c for c in self.active if c.device == device]:
                capture.invalidated = True
                ended += [stream.handle for stream in capture.streams]
                self._end(capture)
        return ended

    # -- what a capture forbids ------------------------------------------------------

    def check_unsafe(self, call: str, mode: CaptureMode) -> None:
        """``call`` is potentially unsafe; the calling thread's mode is ``mode``."""
        if not self.active or mode == "relaxed":
            return
        me = threading.get_ident()
        with self._lock:
            hit = [
                c
                for c in self.active
                if c.mode != "relaxed" and (c.thread == me or (mode == "global" == c.mode))
            ]
            for capture in hit:
                capture.invalidated = True
        if hit:
            whose = "this thread's" if any(c.thread == me for c in hit) else "another thread's"
            raise sim_error(
                900,
                f"{call} is not permitted during {whose} {hit[0].mode!r} capture "
                f"(this thread's capture mode is {mode!r})",
            )

    def _blocking_captures(self, device: Device) -> list[Capture]:
        return [
            c
            for c in self.active
            if c.device == device.ordinal and any(s.blocking for s in c.streams)
        ]

    def check_legacy(self, device: Device) -> None:
        """The legacy stream of ``device`` is about to be used."""
        if not self.active:
            return
        with self._lock:
            hit = self._blocking_captures(device)
            for capture in hit:
                capture.invalidated = True
        if hit:
            raise sim_error(
                906, f"the legacy stream of device {device.ordinal} would depend on a capture"
            )

    def check_sync(self, stream: SimStream) -> None:
        """``stream`` is about to be synchronized."""
        capture = stream.capture
        if capture is not None:
            self._invalidate([capture])
            raise sim_error(900, f"cannot synchronize stream {stream.handle:#x}: it is capturing")
        if stream is stream.device.legacy:
            self.check_legacy(stream.device)

    def check_event(self, event: SimEvent, call: str) -> None:
        """``event`` is about to be queried or synchronized."""
        capture = event.captured
        if capture is None:
            return
        if capture.ended:
            raise sim_error(1, f"{call}: the event was last recorded in a capture that has ended")
        self._invalidate([capture])
        raise sim_error(907, f"{call}: the event was last recorded in a capturing stream")

    # -- recording -------------------------------------------------------------------

    def record_ops(self, stream: SimStream, ops: tuple[_Op, ...]) -> None:
        """Kernels and graph launches enqueued on a capturing ``stream``."""
        with self._lock:
            capture = stream.capture
            if capture is None:  # ended meanwhile (relaxed mode, another thread)
                raise sim_error(401, f"stream {stream.handle:#x} stopped capturing meanwhile")
            if capture.invalidated:
                raise _invalidated()
            for op in ops:
                if op[0] == "kernel":
                    capture.add(stream, op[:4])
                elif op[0] == "graph":
                    capture.add(stream, op[:2])
                elif op[0] == "host":  # a host node, replayed on each launch
                    capture.add(stream, op[:3])

    def record_event(self, event: SimEvent, stream: SimStream) -> None:
        """``event`` recorded on the capturing ``stream``: a point in the graph."""
        with self._lock:
            capture = stream.capture
            if capture is None:
                raise sim_error(401, f"stream {stream.handle:#x} stopped capturing meanwhile")
            if capture.invalidated:
                raise _invalidated()
            event.captured, event.deps, event.point = capture, stream.tail, None

    def wait(self, stream: SimStream, event: SimEvent) -> None:
        """``stream`` waits on ``event``, one of them being in a capture."""
        with self._lock:
            theirs, mine = event.captured, stream.capture
            if theirs is None:
                assert mine is not None
                if mine.invalidated:
                    raise _invalidated()
                if event.point is None:
                    return  # a never-recorded event: a no-op, as outside a capture
                mine.invalidated = True
                raise sim_error(905, "a capturing stream cannot wait on an event recorded outside")
            if theirs.ended:
                raise sim_error(1, "the event was last recorded in a capture that has ended")
            if theirs.invalidated:
                raise _invalidated()
            if mine is theirs:
                stream.tail = stream.tail | event.deps
            elif mine is not None:
                mine.invalidated = theirs.invalidated = True
                raise sim_error(902, "waiting would merge two capture sequences")
            elif stream is stream.device.legacy:
                theirs.invalidated = True
                raise sim_error(900, "the legacy stream cannot join a capture")
            else:  # the stream forks into the capture
                stream.capture, stream.tail = theirs, event.deps
                theirs.streams.add(stream)

    # -- beginning and ending --------------------------------------------------------

    def begin(self, stream: SimStream, mode: CaptureMode) -> None:
        if stream is stream.device.legacy:
            raise sim_error(900, "the legacy stream cannot be captured")
        with self._lock:
            if stream.capture is not None:
                raise sim_error(401, f"stream {stream.handle:#x} is already capturing")
            capture = Capture(stream, mode, threading.get_ident())
            stream.capture, stream.tail = capture, frozenset()
            self.active.add(capture)

    def end(self, stream: SimStream) -> int:
        """End the capture ``stream`` began; the graph's handle."""
        with self._lock:
            capture = stream.capture
            if capture is None:
                raise sim_error(401, f"stream {stream.handle:#x} is not capturing")
            if capture.origin is not stream:
                capture.invalidated = True
                raise sim_error(903, "end the capture on the stream that began it")
            if capture.mode != "relaxed" and capture.thread != threading.get_ident():
                self._end(capture)
                raise sim_error(908, f"a {capture.mode!r} capture ends in the thread that began it")
            unjoined = capture.unjoined()
            self._end(capture)
            if capture.invalidated:
                raise _invalidated()
            if unjoined:
                raise sim_error(904, "a stream forked into the capture was never joined back")
            handle = self._handles.take("graph")
            self._graphs[handle] = Graph(capture.device, tuple(capture.nodes))
        return handle

    def status(self, stream: SimStream) -> CaptureStatus:
        if stream is stream.device.legacy:
            with self._lock:
                if self._blocking_captures(stream.device):
                    raise sim_error(906, "the legacy stream would depend on a capture")
            return "none"
        capture = stream.capture
        if capture is None:
            return "none"
        return "invalidated" if capture.invalidated else "active"

    # -- graphs ----------------------------------------------------------------------

    def instantiate(self, graph: int) -> int:
        with self._lock:
            found = self._graphs.get(graph)
            if found is None:
                raise sim_error(400, f"no simulated graph has handle {graph:#x}")
            handle = self._handles.take("graph_exec")
            self._graph_execs[handle] = GraphExec(found)
        return handle

    def executable(self, graph_exec: int) -> GraphExec:
        found = self._graph_execs.get(graph_exec)
        if found is None:
            raise sim_error(400, f"no simulated executable graph has handle {graph_exec:#x}")
        return found

    def destroy(self, graph: int) -> None:
        with self._lock:
            if self._graphs.pop(graph, None) is None:
                raise sim_error(400, f"no simulated graph has handle {graph:#x}")
            self._handles.release("graph", graph)

    def destroy_executable(self, graph_exec: int) -> None:
        with self._lock:
            if self._graph_execs.pop(graph_exec, None) is None:
                raise sim_error(400, f"no simulated executable graph has handle {graph_exec:#x}")
            self._handles.release("graph_exec", graph_exec)
