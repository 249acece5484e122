"""Every benchmark, beside its peers, in one run: one table, a JSON file and a plot.

    python benchmarks/run.py --backend sim [--quick] [--out DIR]

Writes DIR/<backend>-<date>.json (the machine, package versions, and each figure
as the median of its repeats with its spread, max - min) and DIR/<backend>-<date>.png
(wake latency and loop lag against the number of waiters). ``--quick`` uses fewer
repeats and iterations (under two minutes on a 2-core CPU machine). Ratios are
what carries between machines; absolute times count only from a GPU.

    python benchmarks/run.py --backend cuda [--quick] [--out DIR]

runs the same benchmarks on a CUDA device beside the GPU peers (CuPy, PyTorch,
Numba, cuda.core), with the same report format: see ``cuda_run.py``. Without a
usable device it exits with status 2 and says why.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import anyio

if __package__ in (None, ""):  # run as a script: make `benchmarks` and the project importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cai_streams as cs  # noqa: E402
from benchmarks import bench_consume, bench_export, bench_interface, bench_sanitizer  # noqa: E402
from benchmarks.report import Result, machine, plot, table  # noqa: E402
from benchmarks.report import result as _result  # noqa: E402
from cai_streams import sim  # noqa: E402


def handoff(quick: bool) -> list[Result]:
    """Host overhead of a handoff: parse, export with 0/1/3/8 pending streams,
    consume in host and enqueue mode, beside the floors."""
    repeats = 3 if quick else 5
    results: list[Result] = []
    rows = [bench_interface.main() for _ in range(repeats)]
    for i, (label, _, _) in enumerate(rows[0]):
        results.append(_result("handoff", label, "cai_streams", us=[r[i][1] for r in rows]))
        results.append(_result("handoff", label, "floor: read the interface",
                               us=[r[i][2] for r in rows]))  # fmt: skip
    iterations = 100 if quick else 300
    for k in (0, 1, 3, 8):
        runs = [bench_export.measure(k, iterations) for _ in range(repeats)]
        case = f"export, {k} pending streams"
        results.append(_result("handoff", case, "cai_streams", us=[r[0] for r in runs]))
        results.append(_result("handoff", case, "floor: hand-written record + wait",
                               us=[r[1] for r in runs]))  # fmt: skip
    results += _consume_overhead(repeats, 200 if quick else 1000)
    return results


def _consume_overhead(repeats: int, n: int) -> list[Result]:
    backend = cs.current_backend()
    producer_stream, mine = cs.Stream(), cs.Stream()
    arr = sim.empty(1024)
    arr.stream = producer_stream.handle
    tracked = cs.track(sim.empty(1024))
    event = backend.create_event()

    def per_call(fn: Callable[[], object]) -> float:
        # this thread's CPU time: the 2-core machine's other load does not count
        start = time.thread_time()
        for _ in range(n):
            fn()
        return (time.thread_time() - start) / n * 1e6

    def hand_written() -> None:
        backend.record(event, producer_stream.handle)
        backend.stream_wait_event(mine.handle, event)

    idle_stream = cs.Stream()
    idle = sim.empty(1024)
    idle.stream = idle_stream.handle  # nothing is ever enqueued on it

    def floor_host(obj: Any) -> None:
        obj.__cuda_array_interface__  # noqa: B018 - the read is what is measured
        backend.query_stream(idle_stream.handle)

    cases: dict[str, dict[str, Callable[[], object]]] = {
        "consume, enqueue mode": {
            "cai_streams": lambda: cs.consume_blocking(arr, stream=mine),
            "floor: hand-written record + wait": hand_written,
        },
        "consume, host mode, work complete": {
            "cai_streams": lambda: cs.consume_blocking(tracked),
            "floor: read the interface + one query": lambda: floor_host(arr),
        },
        "consume, host mode, untracked, work complete": {
            "cai_streams": lambda: cs.consume_blocking(idle),
            "floor: read the interface + one query": lambda: floor_host(idle),
        },
    }
    results = []
    for case, methods in cases.items():
        for method, fn in methods.items():
            results.append(_result("handoff", case, method,
                                   us=[per_call(fn) for _ in range(repeats)]))  # fmt: skip
    mine.synchronize()
    backend.destroy_event(event)
    return results


#: the methods measured under every event loop on the simulator (blocking stalls
#: any loop alike; the default policy rings the doorbell there: no twin row)
OTHER_LOOP_METHODS = (
    "cai_streams",
    "cai_streams poller",
    "cai_streams low-latency",
    "to_thread",
    "poll 1 ms",
)


def waiting(quick: bool) -> list[Result]:
    """asyncio: every method at 1 to 10,000 waiters. uvloop (when installed) and
    trio: the methods that do not stall the loop, at the same sizes (``--quick``:
    the default, the poller and to_thread at 1 and 100 waiters). One waiter
    gives one wake per run, and the p99 of 100 is one of its two slowest, so
    those sizes get five times the runs (not in ``--quick``)."""
    sizes = [1, 100, 1000, 10000]
    repeats = 1 if quick else 3
    runs = [("asyncio", sizes, tuple(bench_consume.METHODS))]
    quick_methods = ("cai_streams", "cai_streams poller", "to_thread")
    other = quick_methods if quick else OTHER_LOOP_METHODS
    for loop in bench_consume.available_loops()[1:]:
        runs.append((loop, [1, 100] if quick else sizes, other))
    results = []
    for loop, loop_sizes, methods in runs:
        suffix = "" if loop == "asyncio" else f", {loop}"
        for n in loop_sizes:
            n_repeats = repeats * (5 if n <= 100 and not quick else 1)
            for row, spread in bench_consume.run([n], n_repeats, methods, loop):
                figures = {k: v for k, v in vars(row).items() if k not in ("method", "waiters")}
                results.append({
                    "benchmark": "waiting", "case": f"{row.waiters} waiters{suffix}",
                    "method": row.method,
                    "figures": {k: {"median": v, "spread": spread[k]} for k, v in figures.items()},
                })  # fmt: skip
    return results


def pipeline(quick: bool) -> list[Result]:
    from cai_streams._demo import COMPUTE_TIME, COPY_TIME, data_loading_pipeline

    batches = 32 if quick else 96
    repeats = 2 if quick else 3
    per: dict[str, list[float]] = {"cai_streams (await consume)": [], "blocking host wait": []}
    overlap: dict[str, list[float]] = {k: [] for k in per}
    for _ in range(repeats):
        for method, blocking in (("cai_streams (await consume)", False),
                                 ("blocking host wait", True)):  # fmt: skip
            with cs.sanitize(False), sim.simulated(sanitizer=False), cs.trace() as tr:
                summary = anyio.run(partial(data_loading_pipeline, batches=batches, buffers=4,
                                            recording=tr, blocking=blocking))  # fmt: skip
            assert summary.wrong == 0
            per[method].append(summary.per_second)
            overlap[method].append(summary.overlap)
    results = [_result("pipeline", f"{batches} batches of 1 MiB", m, batches_per_s=v,
                       overlap=overlap[m]) for m, v in per.items()]  # fmt: skip
    ideal = 1 / max(COPY_TIME / 2, COMPUTE_TIME)
    results.append(_result("pipeline", f"{batches} batches of 1 MiB",
                           "ideal bound max(copy, compute)", batches_per_s=[ideal]))  # fmt: skip
    return results


def sanitizer(quick: bool) -> list[Result]:
    runs = [bench_sanitizer.run(1000 if quick else 4000) for _ in range(1 if quick else 3)]
    return [_result("sanitizer", "declared access", "cai_streams",
                    per_access_us=[r["per_access_us"] for r in runs],
                    launch_off_us=[r["launch_off_us"] for r in runs],
                    launch_on_us=[r["launch_on_us"] for r in runs])]  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="cai_streams benchmarks beside their peers")
    parser.add_argument("--backend", choices=("sim", "cuda"), default="sim")
    parser.add_argument("--quick", action="store_true", help="fewer repeats (CI-sized)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--stand-in", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.backend == "cuda":
        from benchmarks import cuda_run

        return cuda_run.main(quick=args.quick, out=args.out, stand_in=args.stand_in)
    cs.use_backend("sim")
    started = time.perf_counter()
    results: list[Result] = []
    for name, bench in (("handoff", handoff), ("waiting", waiting), ("pipeline", pipeline),
                        ("sanitizer", sanitizer)):  # fmt: skip
        t0 = time.perf_counter()
        with cs.sanitize(False):
            results += bench(args.quick)
        print(f"{name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"{args.backend}-{datetime.date.today().isoformat()}"
    report = {"backend": args.backend, "quick": args.quick, "date": stem.split("-", 1)[1],
              "seconds": time.perf_counter() - started, "machine": machine(),
              "results": results}  # fmt: skip
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1))
    print(table(results))
    plotted = plot(results, args.out / f"{stem}.png")
    print(f"\nwrote {args.out / (stem + '.json')}" + (f" and {stem}.png" if plotted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
