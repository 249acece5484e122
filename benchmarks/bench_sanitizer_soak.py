"""What a long run costs with the sanitizer on: memory and host time per access
stay flat as streams and host threads come and go.

A service that makes a stream per request: each request allocates its buffer
(from the simulator's caching pool), writes it and reads shared weights on a
new stream, synchronizes, copies to the host and closes the stream. Reported at
10 and at 10,000 streams created over the run, and, in a second run, at 10 and
1,000 host threads (each makes a stream, writes, synchronizes and ends; the
main thread joins it and copies). ``memory`` is the Python heap held since the start of
the run, traced by ``tracemalloc`` (in a second pass, so the timings are not
slowed by it); ``time per access`` is what the sanitizer adds to enqueueing a
kernel that declares a read and a write, with the state the run has built by
then (a probe of 2,000 launches on latched streams, on minus off).
Run: python benchmarks/bench_sanitizer_soak.py [--streams 10000] [--threads 1000].
"""

from __future__ import annotations

import argparse
import threading
import time
import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import cai_streams as cs
from cai_streams import sim


def _ones(x: np.ndarray[Any, Any]) -> None:
    x[...] = 1


def _read(*_: object) -> None:
    pass


def request(weights: sim.SimArray) -> None:
    s = cs.Stream()
    y = sim.empty(64)
    sim.launch(s, _ones, y, writes=[y], name="produce")
    sim.launch(s, _read, reads=[weights, y], name="use weights")
    s.synchronize()
    y.to_host()
    s.close()


def in_a_thread(x: sim.SimArray) -> None:
    def work() -> None:
        s = cs.Stream()
        sim.launch(s, _ones, x, writes=[x], name="in a thread")
        s.synchronize()
        s.close()

    th = threading.Thread(target=work)
    th.start()
    th.join()
    x.to_host()


PROBE_LAUNCHES = 2000


def _probe() -> float:
    """Host seconds to enqueue ``PROBE_LAUNCHES`` no-op kernels declaring a read
    and a write each, on 4 latched streams (so none runs while timed), with
    whatever state the sanitizer holds now: median of 3."""
    gate = threading.Event()
    streams = [cs.Stream() for _ in range(4)]
    with cs.sanitize(False):
        for s in streams:
            sim.launch(s, lambda: gate.wait(60), name="latch")
    buf = sim.empty(8 * 256, "float32")
    parts = [buf[i * 256 : (i + 1) * 256] for i in range(8)]
    times = []
    try:
        for _ in range(3):
            start = time.perf_counter()
            for i in range(PROBE_LAUNCHES):
                part = parts[i % 8]
                sim.launch(streams[i % 4], _read, reads=[part], writes=[part])
            times.append(time.perf_counter() - start)
            for j in range(4):  # reorder, so the next round is not a race
                streams[(j + 1) % 4].wait(streams[j].record())
    finally:
        gate.set()
        for s in streams:
            s.synchronize()
            s.close()
    return sorted(times)[1]


def _soak(cycle: Callable[[], None], count: int, at: Sequence[int]) -> dict[int, dict[str, float]]:
    """At ``at`` cycles: the sanitizer's host time per declared access (a probe
    of enqueues, on minus off) and memory held since the start (a second,
    traced pass, so the timings are not slowed by tracing)."""
    out: dict[int, dict[str, float]] = {n: {} for n in at}
    with cs.sanitize(False):
        off = _probe()
    with cs.sanitize(False), cs.sanitize():
        for i in range(1, count + 1):
            cycle()
            if i in at:
                out[i]["us_per_access"] = (_probe() - off) / (2 * PROBE_LAUNCHES) * 1e6
    tracemalloc.start()
    try:
        with cs.sanitize(False), cs.sanitize():
            base = tracemalloc.get_traced_memory()[0]
            for i in range(1, count + 1):
                cycle()
                if i in at:
                    out[i]["mib"] = (tracemalloc.get_traced_memory()[0] - base) / 2**20
    finally:
        tracemalloc.stop()
    return out


def run(streams: int = 10_000, threads: int = 1_000) -> dict[str, float]:
    cs.use_backend("sim")
    device = sim.device()
    saved, device.jitter = device.jitter, 0.0
    try:
        weights = sim.asarray(np.ones(256, "float32"))
        s = _soak(lambda: request(weights), streams, (10, streams))
        x = sim.empty(64)
        t = _soak(lambda: in_a_thread(x), threads, (10, threads))
    finally:
        device.jitter = saved
    return {
        "streams_10_us": s[10]["us_per_access"],
        "streams_10_mib": s[10]["mib"],
        "streams_n_us": s[streams]["us_per_access"],
        "streams_n_mib": s[streams]["mib"],
        "threads_10_us": t[10]["us_per_access"],
        "threads_10_mib": t[10]["mib"],
        "threads_n_us": t[threads]["us_per_access"],
        "threads_n_mib": t[threads]["mib"],
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="sanitizer state and cost over a long run")
    parser.add_argument("--streams", type=int, default=10_000)
    parser.add_argument("--threads", type=int, default=1_000)
    args = parser.parse_args(argv)
    r = run(args.streams, args.threads)
    print("| created over the run | memory held since the start | sanitizer time per access |")
    print("|---|---|---|")
    for label, key in (
        ("10 streams", "streams_10"),
        (f"{args.streams:,} streams", "streams_n"),
        ("10 threads", "threads_10"),
        (f"{args.threads:,} threads", "threads_n"),
    ):
        print(f"| {label} | {r[key + '_mib']:.2f} MiB | {r[key + '_us']:.1f} us |")


if __name__ == "__main__":
    main()
