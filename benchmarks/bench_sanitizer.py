"""What the sanitizer costs: host time per declared access, on and off.

Each row enqueues the same kernels (a no-op declaring one read and one write of
its own slice of a buffer, 8 slices, 4 streams ordered by events every 8
launches) on latched streams, so the kernels do not run while the host is
timed. ``per access`` is (on - off) / accesses declared. Run:
python benchmarks/bench_sanitizer.py [--launches 4000].
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Sequence

import cai_streams as cs
from cai_streams import sim


def _noop(*_: object) -> None:
    pass


def measure(launches: int, sanitized: bool) -> float:
    """Seconds of host time to enqueue ``launches`` kernels (median of 5)."""
    cs.use_backend("sim")
    gate = threading.Event()
    times = []
    for _ in range(5):
        streams = [cs.Stream() for _ in range(4)]
        for s in streams:
            sim.launch(s, lambda: gate.wait(60), name="latch")
        buf = sim.empty(8 * 256, "float32")
        parts = [buf[i * 256 : (i + 1) * 256] for i in range(8)]
        with cs.sanitize(sanitized):
            start = time.perf_counter()
            for i in range(launches):
                s = streams[i % 4]
                if i % 8 == 7:
                    streams[(i + 1) % 4].wait(s.record())
                part = parts[i % 8]
                sim.launch(s, _noop, reads=[part], writes=[part])
            times.append(time.perf_counter() - start)
        gate.set()
        for s in streams:
            s.synchronize()
        gate.clear()
    return sorted(times)[2]


def run(launches: int) -> dict[str, float]:
    off = measure(launches, False)
    on = measure(launches, True)
    return {
        "launch_off_us": off / launches * 1e6,
        "launch_on_us": on / launches * 1e6,
        "per_access_us": (on - off) / (2 * launches) * 1e6,
        "ratio": on / off,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="sanitizer cost per declared access")
    parser.add_argument("--launches", type=int, default=4000)
    args = parser.parse_args(argv)
    r = run(args.launches)
    print("| launch, sanitizer off | launch, sanitizer on | ratio | cost per access |")
    print("|---|---|---|---|")
    print(f"| {r['launch_off_us']:.1f} us | {r['launch_on_us']:.1f} us | {r['ratio']:.2f}x "
          f"| {r['per_access_us']:.1f} us |")  # fmt: skip


if __name__ == "__main__":
    main()
