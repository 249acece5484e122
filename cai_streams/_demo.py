"""The demo behind ``python -m cai_streams demo``: a data-loading pipeline.

A ring of device buffers; host batches copied in on two copy streams;
preprocessing on a compute stream; an async consumer that awaits each batch
with ``cs.consume`` and checks every value. Buffers are refilled only once
their reader is done: the input ring through tracked reads (the copy stream
waits for the compute stream on the GPU), the output ring through the
consumer handing its slot back.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

import anyio
import numpy as np

from . import sim
from ._consume import consume, consume_blocking
from ._scheduler import stats
from ._stream import Stream
from ._trace import Trace, trace
from ._tracked import TrackedArray, track

SHAPE = (256, 1024)  # float32: 1 MiB a batch
COPY_TIME = 0.004  # seconds per host-to-device copy
COMPUTE_TIME = 0.003  # seconds per preprocessing kernel


@dataclass
class Summary:
    batches: int
    seconds: float
    overlap: float
    host_waits: int
    wake_ms: list[float]
    events_created: int
    events_acquired: int
    wrong: int

    @property
    def per_second(self) -> float:
        return self.batches / self.seconds

    def table(self) -> str:
        mb = self.per_second * np.prod(SHAPE) * 4 / 1e6
        ideal = 1 / max(COPY_TIME / 2, COMPUTE_TIME)
        wake = (
            f"p50 {np.percentile(self.wake_ms, 50):.2f} ms, "
            f"p99 {np.percentile(self.wake_ms, 99):.2f} ms"
            if self.wake_ms
            else "no waits"
        )
        rows = [
            ("batches", f"{self.batches}"),
            (
                "throughput",
                f"{self.per_second:.1f} batches/s ({mb:.0f} MB/s); "
                f"ideal bound {ideal:.0f} batches/s",
            ),  # fmt: skip
            ("stream overlap", f"{self.overlap:.0%} of the time a stream was busy"),
            ("host waits", f"{self.host_waits} (polled from the event loop, none blocking)"),
            ("wake latency", wake),
            (
                "events",
                f"{self.events_created} created, {self.events_acquired} handed out "
                f"({self.events_acquired - self.events_created} reused)",
            ),  # fmt: skip
            ("wrong batches", f"{self.wrong}"),
        ]
        return "\n".join(f"{name:<16}{value}" for name, value in rows)


def _copy_in(dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any]) -> None:
    np.copyto(dst, src)


async def data_loading_pipeline(
    *, batches: int, buffers: int, recording: Trace, out: TextIO | None = None,
    blocking: bool = False,
) -> Summary:  # fmt: skip
    """Run the pipeline on the current (simulated) device; report what it did.

    ``blocking=True`` is the same pipeline with the consumer written the way a
    CuPy or Numba consumer is: a blocking host wait inside the coroutine (the
    benchmarks' peer).
    """
    rng = np.random.default_rng(0)
    bases = [rng.random(SHAPE, dtype=np.float32) for _ in range(4)]
    sums = [float(b.sum(dtype=np.float64)) for b in bases]
    copies, compute = [Stream(), Stream()], Stream()
    for n, s in enumerate(copies):
        recording.name_stream(s, f"copy {n}")
    recording.name_stream(compute, "compute")
    inputs: list[TrackedArray] = [track(sim.empty(SHAPE)) for _ in range(buffers)]
    outputs: list[TrackedArray] = [track(sim.empty(SHAPE)) for _ in range(buffers)]
    done_at = np.zeros(batches)
    free_send, free_recv = anyio.create_memory_object_stream[int](buffers)
    ready_send, ready_recv = anyio.create_memory_object_stream[tuple[int, int]](buffers)
    for slot in range(buffers):
        free_send.send_nowait(slot)
    before = stats()
    result = Summary(batches, 0.0, 0.0, 0, [], 0, 0, 0)

    async def produce() -> None:
        async with ready_send:
            for i in range(batches):
                slot = await free_recv.receive()
                host = bases[i % 4] + np.float32(i)
                src, dst = inputs[slot], outputs[slot]
                copy = copies[i % 2]
                with src.writing(copy):  # waits for the last preprocessing read of src
                    sim.launch(copy, _copy_in, src.array, host, writes=[src.array],
                               duration=COPY_TIME, name="h2d copy")  # fmt: skip

                def preprocess(
                    o: np.ndarray[Any, Any], x: np.ndarray[Any, Any], i: int = i
                ) -> None:
                    np.multiply(x, 2, out=o)
                    o += 1
                    done_at[i] = time.perf_counter()

                with src.reading(compute), dst.writing(compute):
                    sim.launch(compute, preprocess, dst.array, src.array, reads=[src.array],
                               writes=[dst.array], duration=COMPUTE_TIME,
                               name="preprocess")  # fmt: skip
                await ready_send.send((i, slot))

    async def consume_all() -> None:
        async with ready_recv, free_send:
            async for i, slot in ready_recv:
                asked = time.perf_counter()
                if blocking:
                    view = consume_blocking(outputs[slot], timeout=60)
                else:
                    view = await consume(outputs[slot], timeout=60)
                resumed = time.perf_counter()
                data = sim._numpy_view(view)
                assert data is not None
                expected = 2 * (sums[i % 4] + i * data.size) + data.size
                result.wrong += int(abs(float(data.sum(dtype=np.float64)) - expected)
                                    > 1e-4 * abs(expected))  # fmt: skip
                if done_at[i] == 0 or done_at[i] > asked:  # it had to wait
                    result.host_waits += 1
                    result.wake_ms.append((resumed - done_at[i]) * 1e3)
                recording.host_span(f"consume {i}", asked, resumed)
                await free_send.send(slot)
                if out is not None:
                    filled = (i + 1) * 30 // batches
                    out.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {i + 1}/{batches} batches")
                    out.flush()

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        tg.start_soon(produce)
        tg.start_soon(consume_all)
    result.seconds = time.perf_counter() - start
    if out is not None:
        out.write("\n")
    for s in (*copies, compute):
        await s.record().wait()
    after = stats()
    result.overlap = recording.overlap()
    result.events_created = after["events_created"] - before["events_created"]
    result.events_acquired = after["events_acquired"] - before["events_acquired"]
    return result


def run_demo(*, backend: str | None, batches: int, buffers: int, seed: int | None,
             trace_path: str | None, plot_path: str | None) -> int:  # fmt: skip
    if backend == "cuda":
        print("The demo's kernels are simulated: run it with --backend sim (the default).")
        return 2
    with sim.simulated(sanitizer=False, seed=seed) as device:
        print(f"backend: sim (jitter seed {device.seed}, jitter up to {device.jitter * 1e3:.1f} ms"
              f" a kernel); {buffers} buffers, 2 copy streams, 1 compute stream")  # fmt: skip
        with trace() as recording:
            summary = anyio.run(lambda: data_loading_pipeline(
                batches=batches, buffers=buffers, recording=recording, out=sys.stderr))  # fmt: skip
    print(summary.table())
    if trace_path:
        recording.save(trace_path)
        print(f"trace: {trace_path} (open it in https://ui.perfetto.dev)")
    if plot_path:
        try:
            recording.plot(plot_path)
        except RuntimeError as exc:
            print(exc, file=sys.stderr)
            return 2
        print(f"timeline: {plot_path}")
    return 0 if summary.wrong == 0 else 1
