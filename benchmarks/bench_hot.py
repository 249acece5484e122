"""The lean-hot-path ratios of issue #20, and nothing else: each handoff's
host cost over its floor, measured in the same run.

Run: python benchmarks/bench_hot.py [--repeats N]. Figures are this thread's
CPU time per call (``time.thread_time``) on the simulator, so the other load
of a shared machine does not count; each ratio is the median over the repeats
of (cost / floor), the two measured back to back.

The ``await consume`` rows (no goal in the issue) are the same handoffs from
a task under asyncio, beside the same floors plus the one checkpoint every
await consume is (``asyncio.sleep(0)``): what the async API adds.

Beside three rows, ``required``: the steps no handoff of that kind can skip
without dropping a guarantee, made back to back with no bookkeeping between
them, and their ratio to the same floor (measured in the same repeats). A
goal below that ratio cannot be met by trimming bookkeeping. Parse: read the
dict, find its cached layout, fill a view in, check nothing. Enqueue: read
and parse the interface (a malformed one must raise), ask the consumer's and
the producer's stream whether they capture (a join across a capture
invalidates it or must raise), the record and the wait. Untracked host: read
and parse, ask the producer's stream whether it captures (a query of a
capturing stream invalidates the capture), and the query inside a relaxed
capture scope (in the global mode a query invalidates another thread's
capture): two mode exchanges.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` and the project importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cai_streams as cs  # noqa: E402
from benchmarks.bench_interface import V3Producer  # noqa: E402
from cai_streams import sim  # noqa: E402
from cai_streams._interface import _key_of, _layouts, _make, parse, parse_read  # noqa: E402

#: the goals of issue #20: (case, ratio it must stay within)
GOALS = {
    "parse, CuPy-style v3 dict": 3.0,
    "consume_blocking(arr, stream=s)": 1.5,
    "consume_blocking(t), tracked, complete": 1.5,
    "consume_blocking(arr), untracked, idle stream": 1.5,
}


def per_call_us(fn: Callable[[], object], n: int) -> float:
    start = time.thread_time()
    for _ in range(n):
        fn()
    return (time.thread_time() - start) / n * 1e6


def per_await_us(make: Callable[[], Awaitable[object]], n: int) -> float:
    """This thread's CPU time per ``await make()``, in a task under asyncio."""

    async def run() -> float:
        start = time.thread_time()
        for _ in range(n):
            await make()
        return (time.thread_time() - start) / n * 1e6

    return asyncio.run(run())


Case = tuple[Callable[[], Any], Callable[[], Any], Callable[[], Any] | None]


def cases() -> dict[str, Case]:
    """(measured, floor, required or None) per case, on the simulator."""
    cs.use_backend("sim")
    backend = cs.current_backend()
    v3 = V3Producer()
    producer_stream, mine, idle_stream = cs.Stream(), cs.Stream(), cs.Stream()
    arr = sim.empty(1024)
    arr.stream = producer_stream.handle
    tracked = cs.track(sim.empty(1024))
    idle = sim.empty(1024)
    idle.stream = idle_stream.handle  # nothing is ever enqueued on it
    event = backend.create_event()

    def record_wait() -> None:
        backend.record(event, producer_stream.handle)
        backend.stream_wait_event(mine.handle, event)

    def read_query(obj: object) -> None:
        obj.__cuda_array_interface__  # type: ignore[attr-defined]  # noqa: B018
        backend.query_stream(idle_stream.handle)

    async def checkpointed(floor: Callable[[], object]) -> None:
        floor()
        await asyncio.sleep(0)

    parse(v3)  # (its layout cached, as in the measured row)

    def parse_unchecked() -> object:
        cai = v3.__cuda_array_interface__
        shape, strides, dtype, size, nbytes, *_ = _layouts[_key_of(cai)]
        ptr, readonly = cai["data"]
        return _make(
            ptr, shape, strides, dtype, cai["typestr"], readonly, size, nbytes, 3, None,
            cai["stream"], v3,
        )  # fmt: skip

    def enqueue_required() -> None:
        view = parse_read(arr, arr.__cuda_array_interface__)
        backend.capture_status(mine.handle)
        backend.capture_status(view.stream)  # type: ignore[arg-type]
        record_wait()

    def host_required() -> None:
        view = parse_read(idle, idle.__cuda_array_interface__)
        backend.capture_status(view.stream)  # type: ignore[arg-type]
        mode = backend.exchange_capture_mode("relaxed")
        try:
            backend.query_stream(view.stream)  # type: ignore[arg-type]
        finally:
            backend.exchange_capture_mode(mode)

    return {
        "parse, CuPy-style v3 dict": (
            lambda: parse(v3),
            lambda: v3.__cuda_array_interface__,
            parse_unchecked,
        ),
        "consume_blocking(arr, stream=s)": (
            lambda: cs.consume_blocking(arr, stream=mine),
            record_wait,
            enqueue_required,
        ),
        "consume_blocking(t), tracked, complete": (
            lambda: cs.consume_blocking(tracked),
            lambda: read_query(arr),
            None,
        ),
        "consume_blocking(arr), untracked, idle stream": (
            lambda: cs.consume_blocking(idle),
            lambda: read_query(idle),
            host_required,
        ),
        "await consume(arr, stream=s)": (
            lambda: cs.consume(arr, stream=mine),
            lambda: checkpointed(record_wait),
            None,
        ),
        "await consume(t), tracked, complete": (
            lambda: cs.consume(tracked),
            lambda: checkpointed(lambda: read_query(arr)),
            None,
        ),
    }


Row = tuple[str, float, float, float, float | None]


def main(repeats: int, n: int) -> list[Row]:
    """(case, µs, floor µs, ratio, required's ratio or None) per case: medians."""
    rows: list[Row] = []
    for case, (fn, floor, required) in cases().items():
        measure = per_await_us if case.startswith("await") else per_call_us
        measure(fn, 1), measure(floor, 1)  # warm: caches, pools
        if required is not None:
            measure(required, 1)
        us, base, ratio, need = [], [], [], []
        for _ in range(repeats):
            a, b = measure(fn, n), measure(floor, n)
            us.append(a)
            base.append(b)
            ratio.append(a / b)
            if required is not None:  # (beside the same floor, in the same repeat)
                need.append(measure(required, n) / b)
        least = statistics.median(need) if need else None
        rows.append(
            (case, statistics.median(us), statistics.median(base), statistics.median(ratio), least)
        )
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("-n", type=int, default=2000, help="calls per repeat")
    args = parser.parse_args()
    print(f"{'case':48} {'us/call':>8} {'floor':>8} {'ratio':>6} {'goal':>5} {'required':>8}")
    for case, us, floor, ratio, least in main(args.repeats, args.n):
        goal = f"{GOALS[case]:5.1f}" if case in GOALS else "    -"
        need = "       -" if least is None else f"{least:8.2f}"
        print(f"{case:48} {us:8.2f} {floor:8.2f} {ratio:6.2f} {goal} {need}")
