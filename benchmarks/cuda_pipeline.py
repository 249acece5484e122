"""The demo's data-loading pipeline at real sizes on a GPU, against a blocking consumer.

The pipeline of ``cai_streams/_demo.py`` with real device work: a ring of
``BUFFERS`` input and output buffers (plain device allocations tracked by
cai_streams); each batch is copied host to device from pinned memory on one of
two copy streams (a size that takes about ``COPY_TARGET`` seconds, from the
bandwidth measured in the same run), preprocessed on a compute stream
(``out = 2 * in + 1 + bias``, then a spin kernel of ``COMPUTE_TIME``, then a
checksum of ``out`` copied to pinned host memory), and handed to an async
consumer that reads the checksum on the host and checks it against the value
expected from the batch's source and bias (so every batch's data is checked,
whole). Tracked reads make a copy wait on the GPU for the preprocessing that
still reads its buffer. Batches cycle through ``SOURCES`` (5) host sources, so a
buffer not refilled, or refilled while read, gives a wrong checksum.

Consumers compared, in the same run: ``await cs.consume(batch)`` (host
readiness polled from the event loop), and a blocking consumer: it reads the
batch's interface and synchronizes its stream in the coroutine (what CuPy and
Numba consumers do), which stalls the event loop and so the producer.

The ideal bound is the slowest stage's time per batch, measured alone in the
same run (copies through both copy streams, which share the host link, and the
compute stage), times the number of batches. Figures: batches/s, % of the
ideal, wrong batches.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio

import cai_streams as cs
from benchmarks.cuda_device import drain
from benchmarks.report import describe

COMPUTE_TIME = 0.003  # seconds of the fixed spin kernel in the compute stage
COPY_TARGET = 0.002  # seconds a batch's host-to-device copy should take
SOURCES = 5
BUFFERS = 4


@dataclass
class PipelineRun:
    batches: int
    seconds: float
    wrong: int
    host_waits: int

    @property
    def per_second(self) -> float:
        return self.batches / self.seconds


async def pipeline(
    ops: Any, *, batches: int, blocking: bool, compute_time: float = COMPUTE_TIME
) -> PipelineRun:
    """Run ``batches`` batches through the pipeline; count wrong checksums."""
    backend = cs.current_backend()
    copies, compute = [cs.Stream(), cs.Stream()], cs.Stream()
    inputs = [cs.track(ops.buffer()) for _ in range(BUFFERS)]
    outputs = [cs.track(ops.buffer()) for _ in range(BUFFERS)]
    free_send, free_recv = anyio.create_memory_object_stream[int](BUFFERS)
    ready_send, ready_recv = anyio.create_memory_object_stream[tuple[int, int]](BUFFERS)
    for slot in range(BUFFERS):
        free_send.send_nowait(slot)
    result = PipelineRun(batches, 0.0, 0, 0)

    async def produce() -> None:
        async with ready_send:
            for i in range(batches):
                slot = await free_recv.receive()
                src, dst = inputs[slot], outputs[slot]
                copy = copies[i % 2]
                with src.writing(copy):  # waits for the last preprocessing read of src
                    ops.copy_in(copy, src.array, i % SOURCES)
                with src.reading(compute), dst.writing(compute):
                    ops.compute(compute, dst.array, src.array, i % 7, compute_time, slot)
                await ready_send.send((i, slot))

    async def consume() -> None:
        async with ready_recv, free_send:
            async for i, slot in ready_recv:
                if blocking:
                    stream = outputs[slot].__cuda_array_interface__["stream"]
                    if stream is not None:
                        backend.synchronize_stream(stream)  # blocks the loop
                        result.host_waits += 1
                else:
                    await cs.consume(outputs[slot], timeout=30)
                    result.host_waits += 1
                got = ops.checksum(slot)
                result.wrong += int(got != ops.expected(i % SOURCES, i % 7))
                await free_send.send(slot)

    start = time.perf_counter()
    try:
        with anyio.fail_after(30 + batches * 0.1):
            async with anyio.create_task_group() as tg:
                tg.start_soon(produce)
                tg.start_soon(consume)
        result.seconds = time.perf_counter() - start
    finally:
        drain([*copies, compute])
        for s in (*copies, compute):
            s.close()
    return result


def stage_times(ops: Any, k: int, compute_time: float = COMPUTE_TIME) -> tuple[float, float]:
    """Seconds per batch of each stage run alone: (copy through both copy
    streams, compute), each the wall time of ``k`` batches over ``k``."""
    copies, compute = [cs.Stream(), cs.Stream()], cs.Stream()
    ins = [ops.buffer() for _ in range(2)]
    outs = [ops.buffer() for _ in range(2)]
    try:
        for warm in (True, False):
            start = time.perf_counter()
            for i in range(2 if warm else k):
                ops.copy_in(copies[i % 2], ins[i % 2], i % SOURCES)
            drain(copies)
            copy_s = (time.perf_counter() - start) / k
            start = time.perf_counter()
            for i in range(2 if warm else k):
                ops.compute(compute, outs[i % 2], ins[i % 2], 0, compute_time, 0)
            drain([compute])
            compute_s = (time.perf_counter() - start) / k
        return copy_s, compute_s
    finally:
        for s in (*copies, compute):
            s.close()


@dataclass
class PipelineFigures:
    """What the section reports: per consumer, batches/s per repeat, wrong batches."""

    case: str
    per_second: dict[str, list[float]]
    wrong: dict[str, int]
    copy_s: float
    compute_s: float
    failed: dict[str, str]

    @property
    def ideal(self) -> float:
        return 1 / max(self.copy_s, self.compute_s)


CONSUMERS = {"cai_streams (await consume)": False, "blocking host wait (stream synchronize)": True}


def run(
    device: Any,
    *,
    batches: int,
    repeats: int,
    elements: int,
    out_of_time: Callable[[], bool] = lambda: False,
) -> PipelineFigures:
    """Stage times, then each consumer ``repeats`` times, interleaved."""
    ops = device.pipeline_ops(elements, SOURCES, BUFFERS)
    try:
        copy_s, compute_s = stage_times(ops, 16)
        mib = elements * 4 / (1 << 20)
        size = f"{mib:.0f} MiB" if mib >= 1 else f"{elements * 4 >> 10} KiB"
        figures = PipelineFigures(
            case=f"{batches} batches of {size} (copy {copy_s * 1e3:.2f} ms, "
            f"compute {compute_s * 1e3:.2f} ms)",
            per_second={m: [] for m in CONSUMERS},
            wrong={m: 0 for m in CONSUMERS},
            copy_s=copy_s,
            compute_s=compute_s,
            failed={},
        )
        for _ in range(repeats):
            for method, blocking in CONSUMERS.items():
                if method in figures.failed:
                    continue
                if out_of_time():
                    figures.failed.setdefault(
                        method, "skipped: the section's time budget was spent"
                    )
                    continue
                try:
                    r = anyio.run(partial(pipeline, ops, batches=batches, blocking=blocking))
                except Exception as exc:
                    figures.failed[method] = f"failed: {describe(exc)}"
                    continue
                figures.per_second[method].append(r.per_second)
                figures.wrong[method] += r.wrong
        return figures
    finally:
        ops.close()
