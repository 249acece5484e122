"""A captured pipeline replayed while the shared poller serves other waiters.

A worker thread captures a small pipeline into a CUDA graph in "global" mode
(what `torch.cuda.graph` uses), taking its time as a model's tracing does,
while the event loop in the main thread keeps serving requests that each
`await cs.consume(...)`: the shared poller queries their events the whole
time. A query from another thread in global mode invalidates a global capture
(the bug PyTorch's watchdog thread had, pytorch #104555); the library makes
its queries in "relaxed" mode, so the capture survives. The graph is then
replayed for a few batches while requests keep coming; each result is
consumed race-free (the launch is ordered like a `writing()` block of the
arrays the capture wrote) and checked.

The pipeline forks onto a second stream and joins back inside the capture:
`mid = 2 * x` on the capture stream, then `out = mid + 1` on the side stream.
Every array is made before the capture begins: an allocation the pool cannot
serve is a cudaMalloc, which a global capture forbids in every thread.

    python examples/graph_capture.py [--requests 300] [--batches 4]
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from typing import Any

import anyio
import anyio.to_thread
import numpy as np

import cai_streams as cs
from cai_streams import sim

N = 1024


class Pipeline:
    """The arrays and streams of the captured pipeline (made before capturing)."""

    def __init__(self) -> None:
        self.stream, self.side = cs.Stream(), cs.Stream()
        self.x = cs.track(sim.empty(N, "float32"))
        self.mid = cs.track(sim.empty(N, "float32"))
        self.out = cs.track(sim.empty(N, "float32"))
        self.passes_during_capture = 0

    def capture(self) -> cs.Graph:
        """Runs in a worker thread, whose capture mode is "global"."""
        s, side = self.stream, self.side
        before = cs.stats()["poll_passes"]
        s.begin_capture("global")
        try:
            with self.x.reading(s), self.mid.writing(s):
                x, mid = self.x.array, self.mid.array
                sim.launch(s, np.multiply, x, 2.0, mid, reads=[x], writes=[mid], duration=0.001)
            time.sleep(0.02)  # tracing a real model takes a while: the poller keeps polling
            side.wait(s.record())  # fork: side joins the capture
            with self.mid.reading(side), self.out.writing(side):
                mid, out = self.mid.array, self.out.array
                sim.launch(side, np.add, mid, 1.0, out, reads=[mid], writes=[out], duration=0.001)
            time.sleep(0.02)
            s.wait(side.record())  # join back
        finally:
            graph = s.end_capture()  # raises CudaError if anything invalidated it
        self.passes_during_capture = cs.stats()["poll_passes"] - before
        return graph

    async def run_batch(self, graph: cs.Graph, value: float) -> bool:
        s = self.stream
        with self.x.writing(s):
            sim.launch(s, lambda a: a.fill(value), self.x.array, writes=[self.x.array])
        graph.launch(s)  # only enqueues
        view = await cs.consume(self.out, timeout=30)  # waits for the launch
        return bool((sim.host_view(view) == 2 * value + 1).all())


async def serve(requests: int, batches: int) -> dict[str, Any]:
    streams = [cs.Stream() for _ in range(4)]
    buffers = [sim.empty(4, "int64") for _ in range(requests)]  # allocated up front
    rng = random.Random(1)
    served = wrong = 0
    pipeline = Pipeline()
    result: dict[str, Any] = {}

    async def handle(request: int) -> None:
        nonlocal served, wrong
        s, out = streams[request % len(streams)], buffers[request]
        out.stream = s.handle
        sim.launch(s, lambda a: a.fill(request), out, writes=[out], duration=rng.uniform(0, 0.004))
        view = await cs.consume(out, timeout=30)
        wrong += not (sim.host_view(view) == request).all()
        served += 1

    async def requests_over_time() -> None:
        async with anyio.create_task_group() as tg:
            for r in range(requests):
                tg.start_soon(handle, r)
                if r % 20 == 19:
                    await anyio.sleep(0.003)

    async with anyio.create_task_group() as tg:
        tg.start_soon(requests_over_time)
        await anyio.sleep(0.005)  # requests are in flight when the capture begins
        graph = await anyio.to_thread.run_sync(pipeline.capture)
        result["served_during_capture"] = served
        with graph:
            checks = [await pipeline.run_batch(graph, float(b)) for b in range(1, batches + 1)]
    result.update(
        served=served,
        wrong=wrong,
        passes=pipeline.passes_during_capture,
        batches=len(checks),
        wrong_batches=checks.count(False),
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--batches", type=int, default=4)
    args = parser.parse_args()
    cs.use_backend("sim")  # simulated kernels need simulated streams, even on a GPU machine
    assert threading.current_thread() is threading.main_thread()
    r = anyio.run(serve, args.requests, args.batches)
    print(
        f"capture in a global-mode worker thread: valid, after {r['passes']} poll passes during it"
    )
    print(f"graph replays: {r['batches']} batches, wrong batches: {r['wrong_batches']}")
    print(f"requests served meanwhile: {r['served']}, wrong results: {r['wrong']}")
    if r["passes"] == 0:
        sys.exit("the poller never ran while the capture was under way: nothing was shown")
    if r["wrong_batches"] or r["wrong"] or r["served"] != args.requests:
        sys.exit("WRONG RESULTS")


if __name__ == "__main__":
    main()
