"""What one wait costs the process with a bell, against polling, and which threads pay.

One waiter at a time, on the simulator: a kernel of ``--duration`` seconds,
an event recorded after it, ``await event.wait()``; ``--waits`` times under
``PollPolicy(wake="doorbell")`` and ``PollPolicy(wake="poll")``, in turn.
Reported per wait: process CPU, and each thread's CPU and voluntary /
involuntary context switches (``/proc/self/task``, Linux), grouped as the
event loop, the producer stream's worker and the notifier streams' workers.
On the simulator every switch of a stream worker is a GIL handoff: this is
where a bell's cost shows (``docs/performance.md``, "Where a bell's CPU went").
Run: python benchmarks/bench_bell.py [--waits 300] [--duration 0.002] [--rounds 2].
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import anyio

import cai_streams as cs
from cai_streams import _doorbell, sim

#: per thread id: (CPU ns, voluntary switches, involuntary switches)
Snapshot = dict[int, tuple[int, int, int]]


def _snapshot() -> Snapshot:
    """Every thread's CPU time and context switches so far (empty off Linux)."""
    out: Snapshot = {}
    if not os.path.isdir("/proc/self/task"):
        return out
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                run_ns = int(f.read().split()[0])
            voluntary = involuntary = 0
            with open(f"/proc/self/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches:"):
                        voluntary = int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches:"):
                        involuntary = int(line.split()[1])
        except OSError:  # the thread ended meanwhile
            continue
        out[int(tid)] = (run_ns, voluntary, involuntary)
    return out


@dataclass
class Row:
    wake: str
    process_us: float
    #: per group of threads: (CPU µs, voluntary, involuntary switches), per wait
    threads: dict[str, tuple[float, float, float]]
    queries_per_wait: float
    bells_per_wait: float


def _group(tid: int, names: dict[int, str], lanes: set[str], producer: str) -> str:
    name = names.get(tid, "?")
    if name == producer:
        return "producer stream"
    if name in lanes:
        return "notifier streams"
    if tid == threading.main_thread().native_id:
        return "event loop"
    return "other"


async def _measure(wake: str, waits: int, duration: float) -> Row:
    cs.configure(poll=cs.PollPolicy(wake=wake))  # type: ignore[arg-type]
    stream = cs.Stream()
    for _ in range(5):  # lanes made, workers started
        sim.launch(stream, lambda: None, duration=duration)
        event = stream.record()
        await event.wait()
        event.close()
    before, armed, queries = _snapshot(), _doorbell.counters.armed, cs.stats()["poll_queries"]
    cpu = time.process_time()
    for _ in range(waits):
        sim.launch(stream, lambda: None, duration=duration)
        event = stream.record()
        await event.wait()
        event.close()
    cpu = time.process_time() - cpu
    after = _snapshot()
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    backend = cs.current_backend()
    lanes = {
        f"cai-streams-{backend.name}-0-{lane.stream:#x}"
        for pool in _doorbell._doorbell.lanes.values()
        for lane in pool
    }
    producer = f"cai-streams-{backend.name}-0-{stream.handle:#x}"
    groups: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for tid, (run_ns, voluntary, involuntary) in after.items():
        run0, voluntary0, involuntary0 = before.get(tid, (0, 0, 0))
        group = groups[_group(tid, names, lanes, producer)]
        group[0] += (run_ns - run0) / 1e3 / waits
        group[1] += (voluntary - voluntary0) / waits
        group[2] += (involuntary - involuntary0) / waits
    stream.close()
    cs.configure(poll=cs.PollPolicy())
    return Row(
        wake=wake,
        process_us=cpu / waits * 1e6,
        threads={k: (v[0], v[1], v[2]) for k, v in sorted(groups.items())},
        queries_per_wait=(cs.stats()["poll_queries"] - queries) / waits,
        bells_per_wait=(_doorbell.counters.armed - armed) / waits,
    )


def run(waits: int, duration: float, rounds: int) -> list[Row]:
    """Doorbell and polling in turn, ``rounds`` times each, on the simulator."""
    cs.use_backend("sim")
    sim.device().jitter = 0.0
    return [
        anyio.run(_measure, wake, waits, duration)
        for _ in range(rounds)
        for wake in ("doorbell", "poll")
    ]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--waits", type=int, default=300)
    parser.add_argument("--duration", type=float, default=0.002)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    print(f"sim backend, asyncio; one waiter, {args.duration * 1e3:g} ms kernels; per wait")
    for row in run(args.waits, args.duration, args.rounds):
        print(
            f"{row.wake:8} process {row.process_us:6.0f} µs, {row.queries_per_wait:.1f} "
            f"queries, {row.bells_per_wait:.2f} bells"
        )
        for group, (cpu, voluntary, involuntary) in row.threads.items():
            print(f"  {group:17} {cpu:6.0f} µs, switches {voluntary:.2f} + {involuntary:.2f}")


if __name__ == "__main__":
    main()
