"""Host cost of an export with 0, 1, 3 and 8 pending streams, beside the floor.

The floor is the hand-written join: one event record plus one stream wait per
pending stream, on pre-made events. Pending work is held pending by latched
streams so nothing is elided. Run: python benchmarks/bench_export.py [--backend sim].
"""

from __future__ import annotations

import argparse
import threading
import time

import cai_streams as cs
from cai_streams import sim


def measure(k: int, iterations: int) -> tuple[float, float, float]:
    backend = cs.current_backend()
    streams = [cs.Stream() for _ in range(k)]
    x = cs.Stream()
    gate = threading.Event()
    for s in streams:
        sim.launch(s, lambda: gate.wait(60), name="latch")
    t = cs.track(sim.empty(1024), stream=x)
    events = [backend.create_event() for _ in range(k)]
    before = cs.stats()["events_created"]
    export_s = floor_s = 0.0
    for _ in range(iterations):
        for s in streams:
            with t.writing(s, disjoint=True):
                pass
        start = time.perf_counter()
        t.export()
        export_s += time.perf_counter() - start
        start = time.perf_counter()
        for s, e in zip(streams, events, strict=True):
            backend.record(e, s.handle)
            backend.stream_wait_event(x.handle, e)
        floor_s += time.perf_counter() - start
    created = cs.stats()["events_created"] - before
    gate.set()
    x.synchronize()
    for e in events:
        backend.destroy_event(e)
    n = iterations
    return export_s / n * 1e6, floor_s / n * 1e6, created / n


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="sim", choices=("sim",))
    parser.add_argument("--iterations", type=int, default=300)
    args = parser.parse_args()
    cs.use_backend(args.backend)
    print(f"backend {args.backend}; {args.iterations} exports per row")
    header = ("pending streams", "export us", "floor us", "ratio", "new events/cycle")
    print("{:>15} {:>10} {:>9} {:>6} {:>16}".format(*header))
    for k in (0, 1, 3, 8):
        us, floor, created = measure(k, args.iterations)
        ratio = f"{us / floor:6.2f}" if floor else "     -"
        print(f"{k:15d} {us:10.2f} {floor:9.2f} {ratio} {created:16.2f}")
    print("new events/cycle: pool growth per writing-blocks-plus-export cycle while every")
    print("stream is held pending (nothing completes, so nothing can be reused).")


if __name__ == "__main__":
    main()
