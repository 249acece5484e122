"""An async service: many concurrent requests, each awaiting its GPU result.

Each request enqueues its own kernel and awaits the result with `cs.consume`. All
waiters share one poller, so the event loop stays free: a heartbeat task that wants
to tick every millisecond reports its largest gap, beside the same service written
with a blocking `stream.synchronize()`. Its kernels are simulated (`sim.launch`), so
it selects the simulated device itself and runs the same with or without a GPU.

    python examples/async_service.py [--requests 500]
"""

from __future__ import annotations

import argparse
import gc
import random
import time
import warnings
from functools import partial
from typing import Any

import anyio
import numpy as np

import cai_streams as cs
from cai_streams import sim


async def serve(requests: int, *, blocking: bool) -> tuple[float, int]:
    streams = [cs.Stream() for _ in range(8)]
    rng = random.Random(1)
    answered = 0
    largest_gap = 0.0

    async def handle(request: int) -> None:
        nonlocal answered
        s = streams[request % len(streams)]
        out = sim.empty(4, "int64")
        out.stream = s.handle  # where the result will be ready
        sim.launch(s, lambda x: x.fill(request), out, writes=[out], duration=rng.uniform(0, 0.004))
        data: np.ndarray[Any, Any]
        if blocking:
            with warnings.catch_warnings():  # (it stalls on purpose, for the comparison)
                warnings.simplefilter("ignore", cs.LoopBlockingWarning)
                s.synchronize()  # what a plain CuPy or Numba consumer does: the loop stalls
            data = out.to_host(stream=s)
        else:
            view = await cs.consume(out, timeout=30)
            data = sim.host_view(view)
        assert (data == request).all()
        answered += 1

    async def heartbeat() -> None:
        nonlocal largest_gap
        last = time.perf_counter()
        while answered < requests:
            await anyio.sleep(0.001)
            now = time.perf_counter()
            largest_gap = max(largest_gap, now - last)
            last = now

    async with anyio.create_task_group() as tg:
        tg.start_soon(heartbeat)
        for r in range(requests):
            tg.start_soon(handle, r)
            if r % 50 == 49:
                await anyio.sleep(0.002)  # requests arrive over time
    return largest_gap, answered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=500)
    args = parser.parse_args()
    cs.use_backend("sim")  # simulated kernels need simulated streams, even on a GPU machine
    # A long-running service's usual setting: the objects made at start-up are never
    # collected, so a full garbage collection does not walk them (a 30 ms pause here).
    gc.freeze()
    for blocking in (False, True):
        gap, answered = anyio.run(partial(serve, args.requests, blocking=blocking))
        how = "blocking synchronize" if blocking else "await cs.consume"
        print(f"{how:>22}: {answered} requests answered; largest heartbeat gap {gap * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
