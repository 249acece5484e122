"""Waiting for GPU work from an event loop: the shared poller beside its peers.

N waiters each wait for their own event, recorded after their own kernel; the
kernels (random durations) run on up to 16 streams, about 0.4 s of work per
stream whatever N. Every method runs in the same process on the same backend:

- ``cai_streams``: ``await event.wait()`` through the shared poller (what
  ``await cs.consume(arr)`` does), default policy: on the simulator, the poller
  woken by a doorbell (a ``close`` host function on a notifier stream ends a
  pipe the event loop watches; on cuda the default polls, and
  ``cuda_waiting.py`` has a doorbell row of its own);
- ``cai_streams poller``: the same with ``PollPolicy(wake="poll")``: polling
  only, the default before the doorbell;
- ``cai_streams low-latency``: the same with ``PollPolicy.low_latency()``;
- ``to_thread``: ``await anyio.to_thread.run_sync(event.synchronize)``;
- ``poll 1 ms``: per waiter, ``while not event.is_done: await anyio.sleep(0.001)``;
- ``blocking``: ``stream.synchronize()`` in the coroutine (what a CuPy or
  Numba consumer does), which stalls the loop.

Figures: wake latency (kernel end to coroutine resume) p50/p99, event-loop lag
p99 (how late a 1 ms heartbeat wakes), process CPU seconds for the run, and
event queries per completed wait. On the simulated device the stream workers
and the loop share the GIL, so latencies carry the interpreter's switch
interval: compare rows, not absolute values. Run:
python benchmarks/bench_consume.py [--quick] [--sizes 1 100 1000 10000].
"""

from __future__ import annotations

import argparse
import math
import random
import time
import warnings
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import anyio
import anyio.to_thread
import numpy as np

import cai_streams as cs
from cai_streams import sim

STREAMS = 16
WORK_PER_STREAM = 0.4  # seconds of kernels per stream, whatever the number of waiters

Waiter = Callable[[cs.Event, cs.Stream], Awaitable[None]]


async def _shared(event: cs.Event, stream: cs.Stream) -> None:
    await event.wait()


async def _to_thread(event: cs.Event, stream: cs.Stream) -> None:
    await anyio.to_thread.run_sync(event.synchronize)


async def _poll_1ms(event: cs.Event, stream: cs.Stream) -> None:
    while not event.is_done:  # noqa: ASYNC110 - the per-waiter polling peer, on purpose
        await anyio.sleep(0.001)


async def _blocking(event: cs.Event, stream: cs.Stream) -> None:
    with warnings.catch_warnings():  # (the peer that stalls the loop, on purpose)
        warnings.simplefilter("ignore", cs.LoopBlockingWarning)
        stream.synchronize()


METHODS: dict[str, tuple[Waiter, cs.PollPolicy | None]] = {
    "cai_streams": (_shared, cs.PollPolicy()),
    "cai_streams poller": (_shared, cs.PollPolicy(wake="poll")),
    "cai_streams low-latency": (_shared, cs.PollPolicy.low_latency()),
    "to_thread": (_to_thread, None),
    "poll 1 ms": (_poll_1ms, None),
    "blocking": (_blocking, None),
}


@dataclass
class Row:
    method: str
    waiters: int
    wake_p50_ms: float
    wake_p99_ms: float
    lag_p99_ms: float
    cpu_s: float
    queries_per_wait: float
    wall_s: float


class _CountingQuery:
    """Counts every event query the backend answers during a run."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.original = backend.query
        self.count = 0

    def __enter__(self) -> _CountingQuery:
        def query(event: int) -> bool:
            self.count += 1
            return bool(self.original(event))

        self.backend.query = query
        return self

    def __exit__(self, *exc: object) -> None:
        del self.backend.query


async def _one_run(method: str, n: int, seed: int) -> Row:
    waiter, policy = METHODS[method]
    if policy is not None:
        cs.configure(poll=policy)
    rng = random.Random(seed)
    streams = [cs.Stream() for _ in range(min(n, STREAMS))]
    per_stream = math.ceil(n / len(streams))
    mean = WORK_PER_STREAM / per_stream
    ends = np.zeros(n)
    resumed = np.zeros(n)
    gate = anyio.Event()
    gate_flag: list[bool] = []
    events: list[tuple[cs.Event, cs.Stream]] = []
    for s in streams:  # hold every stream until all waiters are in place
        sim.launch(s, lambda: _spin_until(gate_flag), name="gate")
    for i in range(n):
        s = streams[i % len(streams)]

        def kernel(i: int = i) -> None:
            ends[i] = time.perf_counter()

        sim.launch(s, kernel, duration=rng.uniform(0, 2 * mean))
        events.append((s.record(), s))
    lags: list[float] = []
    started = done = 0
    all_waiting = anyio.Event()

    # A blocking waiter cannot wait beside the others: it holds the loop from
    # its first call, so its kernels start with the gate and its lag is measured
    # from there.
    blocking = method == "blocking"

    async def heartbeat() -> None:
        await (gate if blocking else all_waiting).wait()
        while done < n:
            due = time.perf_counter() + 0.001
            await anyio.sleep(0.001)
            lags.append(max(0.0, time.perf_counter() - due))

    async def one(i: int) -> None:
        nonlocal started, done
        await gate.wait()
        event, stream = events[i]
        started += 1
        if started == n:
            all_waiting.set()
        await waiter(event, stream)
        resumed[i] = time.perf_counter()
        done += 1

    backend = cs.current_backend()
    with _CountingQuery(backend) as counter:
        async with anyio.create_task_group() as tg:
            tg.start_soon(heartbeat)
            for i in range(n):
                tg.start_soon(one, i)
            await anyio.sleep(0.01)
            gate.set()  # every waiter starts waiting, then the kernels are let go
            if not blocking:
                await all_waiting.wait()
                await anyio.sleep(0.001)
            cpu0, wall0 = time.process_time(), time.perf_counter()
            gate_flag.append(True)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    for s in streams:
        s.synchronize()
        s.close()
    for event, _ in events:
        event.close()
    cs.configure(poll=cs.PollPolicy())
    wake = (resumed - ends) * 1e3
    return Row(
        method=method,
        waiters=n,
        wake_p50_ms=float(np.percentile(wake, 50)),
        wake_p99_ms=float(np.percentile(wake, 99)),
        lag_p99_ms=float(np.percentile(lags, 99)) * 1e3 if lags else 0.0,
        cpu_s=cpu,
        queries_per_wait=counter.count / n,
        wall_s=wall,
    )


def _spin_until(flag: list[bool]) -> None:
    deadline = time.monotonic() + 60
    while not flag and time.monotonic() < deadline:
        time.sleep(0.0002)


def median_row(rows: Sequence[Row]) -> tuple[Row, dict[str, float]]:
    """The per-figure median over repeats, and each figure's spread (max - min)."""
    fields = [k for k in asdict(rows[0]) if k not in ("method", "waiters")]
    med = {k: float(np.median([getattr(r, k) for r in rows])) for k in fields}
    spread = {k: max(getattr(r, k) for r in rows) - min(getattr(r, k) for r in rows)
              for k in fields}  # fmt: skip
    return Row(rows[0].method, rows[0].waiters, **med), spread


#: event loops a run can use: anyio backend and its options
LOOPS: dict[str, tuple[str, dict[str, Any]]] = {
    "asyncio": ("asyncio", {}),
    "uvloop": ("asyncio", {"use_uvloop": True}),
    "trio": ("trio", {}),
}


def available_loops() -> list[str]:
    """asyncio and trio, and uvloop when it is installed."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return ["asyncio", "trio"]
    return list(LOOPS)


def run(sizes: Sequence[int], repeats: int, methods: Sequence[str] = tuple(METHODS),
        loop: str = "asyncio") -> list[tuple[Row, dict[str, float]]]:  # fmt: skip
    """Every method at every size on ``loop``, ``repeats`` times each, interleaved."""
    cs.use_backend("sim")
    sim.device().jitter = 0.0
    backend, options = LOOPS[loop]
    results = []
    for n in sizes:
        per_method: dict[str, list[Row]] = {m: [] for m in methods}
        for rep in range(repeats):
            for m in methods:
                row = anyio.run(_one_run, m, n, rep, backend=backend, backend_options=options)
                per_method[m].append(row)
        results += [median_row(rows) for rows in per_method.values()]
    return results


def table(results: Sequence[tuple[Row, dict[str, float]]]) -> str:
    head = ("waiters", "method", "wake p50 ms", "wake p99 ms", "lag p99 ms", "CPU s",
            "queries/wait")  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r, _ in results:
        lines.append(
            f"| {r.waiters} | {r.method} | {r.wake_p50_ms:.2f} | {r.wake_p99_ms:.2f} | "
            f"{r.lag_p99_ms:.2f} | {r.cpu_s:.3f} | {r.queries_per_wait:.2f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 100, 1000, 10000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one repeat")
    args = parser.parse_args(argv)
    repeats = 1 if args.quick else args.repeats
    print(f"sim backend, asyncio; median of {repeats} run(s) per row")
    print(table(run(args.sizes, repeats)))


if __name__ == "__main__":
    main()
