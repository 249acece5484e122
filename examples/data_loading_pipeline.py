"""A data-loading pipeline: copy in on two streams, preprocess on a third, consume async.

A ring of device buffers. Each host batch is copied to a free buffer on one of two
copy streams; a compute stream preprocesses it into an output buffer; an async
consumer awaits each result with `await cs.consume(...)` (polled from the event loop,
never blocking it) and hands the buffer back. Tracked reads make a copy wait on the
GPU for the preprocessing that still reads its buffer, so nothing is overwritten
under a reader. Prints throughput and how much of the time the streams overlapped.
Its kernels are simulated (`sim.launch`), so it selects the simulated device itself
and runs the same with or without a GPU.

    python examples/data_loading_pipeline.py [--batches 48]
"""

from __future__ import annotations

import argparse
import time

import anyio
import numpy as np

import cai_streams as cs
from cai_streams import sim

SHAPE = (128, 1024)
RING = 3


async def pipeline(batches: int) -> tuple[float, int]:
    copy_streams, compute = [cs.Stream(), cs.Stream()], cs.Stream()
    raw = [cs.track(sim.empty(SHAPE)) for _ in range(RING)]
    ready = [cs.track(sim.empty(SHAPE)) for _ in range(RING)]
    free_tx, free_rx = anyio.create_memory_object_stream[int](RING)
    work_tx, work_rx = anyio.create_memory_object_stream[tuple[int, int]](RING)
    for slot in range(RING):
        free_tx.send_nowait(slot)
    wrong = 0

    async def loader() -> None:
        async with work_tx:
            for i in range(batches):
                slot = await free_rx.receive()  # a buffer nobody reads any more
                host = np.full(SHAPE, i, np.float32)
                copy = copy_streams[i % 2]
                with raw[slot].writing(copy):
                    sim.launch(copy, np.copyto, raw[slot].array, host,
                               writes=[raw[slot].array], duration=0.004)  # fmt: skip
                with raw[slot].reading(compute), ready[slot].writing(compute):
                    sim.launch(compute, lambda out, x: np.multiply(x, 2, out=out),
                               ready[slot].array, raw[slot].array, reads=[raw[slot].array],
                               writes=[ready[slot].array], duration=0.002)  # fmt: skip
                await work_tx.send((i, slot))

    async def consumer() -> None:
        nonlocal wrong
        async with work_rx, free_tx:
            async for i, slot in work_rx:
                view = await cs.consume(ready[slot], timeout=30)
                values = sim.host_view(view)
                wrong += int(not (values == 2 * i).all())
                await free_tx.send(slot)

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        tg.start_soon(loader)
        tg.start_soon(consumer)
    return time.perf_counter() - start, wrong


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--batches", type=int, default=48)
    args = parser.parse_args()
    cs.use_backend("sim")  # simulated kernels need simulated streams, even on a GPU machine
    with cs.trace() as recording:
        seconds, wrong = anyio.run(pipeline, args.batches)
    mb = args.batches * np.prod(SHAPE) * 4 / 1e6
    print(f"{args.batches} batches in {seconds:.2f} s: {args.batches / seconds:.0f} batches/s, "
          f"{mb / seconds:.0f} MB/s")  # fmt: skip
    print(f"streams overlapped {recording.overlap():.0%} of the time one was busy")
    print(f"wrong batches: {wrong}")
    assert wrong == 0


if __name__ == "__main__":
    main()
