"""Stream capture on the simulated device: capture sequences and graphs.

A capture sequence records the work enqueued on its streams as graph nodes,
each depending on the nodes its stream had reached (the stream's ``tail``).
Recording an event in a capture and waiting on it from another stream forks
that stream into the capture; the same in the other direction joins it back.
A graph replays its nodes in a random order that respects every dependency,
so captured branches that the program forgot to order come out in varying
orders, as they would run concurrently on a GPU.
"""

from __future__ import annotations

import itertools
import random
from typing import TYPE_CHECKING, Any

from . import CaptureMode

if TYPE_CHECKING:
    from ._sim_stream import Point, SimStream

__all__ = ["Capture", "Graph", "GraphExec", "Node"]

_capture_ids = itertools.count(1)


class Node:
    """One captured operation: ``("kernel", fn, name, duration)`` or ``("graph", exec)``."""

    __slots__ = ("deps", "id", "op")

    def __init__(self, node_id: int, op: tuple[Any, ...], deps: frozenset[int]) -> None:
        self.id = node_id
        self.op = op
        self.deps = deps


class Capture:
    """One capture sequence (cudaStreamBeginCapture ... cudaStreamEndCapture)."""

    __slots__ = ("device", "ended", "id", "invalidated", "mode", "nodes", "origin", "streams",
                 "thread")  # fmt: skip

    def __init__(self, origin: SimStream, mode: CaptureMode, thread: int) -> None:
        self.id = next(_capture_ids)
        self.origin = origin
        self.device = origin.device.ordinal
        self.mode: CaptureMode = mode
        self.thread = thread
        self.streams: set[SimStream] = {origin}
        self.nodes: list[Node] = []
        self.invalidated = False
        self.ended = False

    def add(self, stream: SimStream, op: tuple[Any, ...]) -> None:
        """Record ``op`` on ``stream``: after the stream's tail, and its new tail."""
        node = Node(len(self.nodes), op, stream.tail)
        self.nodes.append(node)
        stream.tail = frozenset((node.id,))

    def unjoined(self) -> list[SimStream]:
        """Forked streams whose captured work the origin stream never waited for."""
        reached: set[int] = set()
        todo = list(self.origin.tail)
        while todo:
            node_id = todo.pop()
            if node_id not in reached:
                reached.add(node_id)
                todo.extend(self.nodes[node_id].deps)
        return [s for s in self.streams if not s.tail <= reached]


class Graph:
    """A captured graph (cudaGraph_t): nodes and their dependencies."""

    __slots__ = ("device", "nodes")

    def __init__(self, device: int, nodes: tuple[Node, ...]) -> None:
        self.device = device
        self.nodes = nodes


class GraphExec:
    """An executable graph (cudaGraphExec_t); launches of it run one at a time."""

    __slots__ = ("device", "last", "nodes")

    def __init__(self, graph: Graph) -> None:
        self.device = graph.device
        self.nodes = graph.nodes
        #: the end of the latest launch: the next launch waits for it
        self.last: Point | None = None

    def order(self, rng: random.Random) -> list[Node]:
        """The nodes in a random order that respects every dependency."""
        waiting = {node.id: len(node.deps) for node in self.nodes}
        dependents: dict[int, list[int]] = {}
        for node in self.nodes:
            for dep in node.deps:
                dependents.setdefault(dep, []).append(node.id)
        ready = [node.id for node in self.nodes if not node.deps]
        out: list[Node] = []
        while ready:
            i = rng.randrange(len(ready))
            ready[i], ready[-1] = ready[-1], ready[i]
            node_id = ready.pop()
            out.append(self.nodes[node_id])
            for after in dependents.get(node_id, ()):
                waiting[after] -= 1
                if waiting[after] == 0:
                    ready.append(after)
        return out
