"""GPU diagnostic: where a late doorbell wake goes (benchmarks/cuda_waiting.py's case).

On an H100 (2026-11-23) the doorbell's p99 wake at 100 and 1,000 waiters sat near
its 10 ms fallback, against the poller's 1.3-2 ms. This runs the benchmark's
doorbell case (``one_run``: gated streams, one kernel and event per group of
waiters, each kernel's end stamped by the GPU clock) and traces, per event, when
its bell was armed and when it rang (the loop saw the pipe's end-of-file), beside
when its kernel ended and its waiters resumed. For each wake later than 2 ms it
says which of these came late. Blocks for at most about a minute.

    PYTHONPATH=.:SITE python3 scripts/diagnose-bell-latency.py [--variant V] [WAITERS ...]

``--variant``: ``lane`` (the library's way: a notifier stream waits on the
event, then runs the host function) or ``flush`` (the same, then a
``cudaStreamQuery`` of the notifier stream, in case the driver submits the
work late).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cai_streams as cs  # noqa: E402
from benchmarks import cuda_waiting as cw  # noqa: E402
from cai_streams import _doorbell, _poller  # noqa: E402

armed: dict[int, tuple[int, bool]] = {}  # event -> (ns, whether a bell was armed)
rang: dict[int, int] = {}  # event -> ns the loop saw its bell
order: list[int] = []  # kernel k -> its event
resumed: dict[int, int] = {}  # event -> first waiter's resume ns


_variant = "lane"


def _redirect(backend: Any) -> None:
    """``--variant flush``: query the notifier stream after each bell's host
    function (the cuda backend's own method, patched on this instance)."""
    real_launch = backend.launch_host_func

    def launch_host_func(stream: int, fn: int, user_data: int) -> None:
        real_launch(stream, fn, user_data)
        if _variant == "flush":
            backend.query_stream(stream)

    backend.launch_host_func = launch_host_func


def _trace() -> None:
    real_arm = _doorbell._Doorbell.arm
    real_rang = _poller._Poller._rang

    def arm(self: Any, entry: Any, key: Any) -> Any:
        bell = real_arm(self, entry, key)
        armed.setdefault(entry.event, (time.perf_counter_ns(), bell is not None))
        return bell

    def rang_(self: Any, fired: Any) -> None:
        now = time.perf_counter_ns()
        for entry, _ in fired:
            rang.setdefault(entry.event, now)
        real_rang(self, fired)

    _doorbell._Doorbell.arm = arm  # type: ignore[method-assign]
    _poller._Poller._rang = rang_  # type: ignore[method-assign]


def _record(stream: cs.Stream) -> cs.Event:
    event = stream.record()
    order.append(event.handle)
    return event


async def _wait(event: cs.Event, stream: cs.Stream) -> None:
    await event.wait(timeout=cw.RUN_TIMEOUT)
    resumed.setdefault(event.handle, time.perf_counter_ns())


def one(device: Any, n: int, seed: int) -> None:
    for d in (armed, rang, resumed):
        d.clear()
    order.clear()
    ends: list[Any] = []
    real_completion = device.completion_ns

    def completion_ns() -> Any:
        got = real_completion()
        ends.append(got)
        return got

    device.completion_ns = completion_ns
    method = cw.Method(_record, _wait, cs.PollPolicy(wake="doorbell"), close=cw._close)
    row = anyio.run(cw.one_run, device, "doorbell traced", method, n, seed, 0.4)
    device.completion_ns = real_completion
    end = ends[-1]
    n_streams = cw.layout(n)[0]
    print(f"\n{n} waiters, seed {seed}: p50 {row.wake_p50_ms:.2f} p99 {row.wake_p99_ms:.2f} "
          f"max {row.wake_max_ms:.2f} ms; {len(order)} events, bells armed "
          f"{sum(ok for _, ok in armed.values())}, refused "
          f"{sum(not ok for _, ok in armed.values())}, rang {len(rang)}", flush=True)  # fmt: skip
    late = []
    for k, h in enumerate(order):
        if h not in resumed:
            continue
        e = int(end[k])
        wake = (resumed[h] - e) / 1e6
        a = armed.get(h)
        r = rang.get(h)
        late.append((wake, k, (a[0] - e) / 1e6 if a else None, a[1] if a else None,
                     (r - e) / 1e6 if r else None))  # fmt: skip
    late.sort(reverse=True)
    rows = [x for x in late if x[0] > 2.0]
    wakes = np.array([x[0] for x in late])
    rung = np.array([x[4] for x in late if x[4] is not None])
    print(f"  events woken later than 2 ms: {len(rows)} of {len(late)}; "
          f"by a ring: {sum(x[4] is not None for x in late)}; ring-end p50/p99 ms: "
          f"{np.percentile(rung, 50) if rung.size else float('nan'):.2f}/"
          f"{np.percentile(rung, 99) if rung.size else float('nan'):.2f}; "
          f"wake p50 {np.percentile(wakes, 50):.2f}", flush=True)  # fmt: skip
    for wake, k, arm_at, ok, ring_at in rows[:12]:

        def ms(x: float | None) -> str:
            return "never" if x is None else f"{x:+8.2f}"

        how = "bell" if ok else "refused" if ok is not None else "-"
        print(f"  kernel {k:4d} (stream {k % n_streams:2d}, #{k // n_streams:3d}): wake "
              f"{wake:7.2f} ms after its end; armed {ms(arm_at)} ({how}), rang {ms(ring_at)}",
              flush=True)  # fmt: skip


def main() -> None:
    from benchmarks.cuda_device import CudaDevice

    global _variant
    args = sys.argv[1:]
    if "--variant" in args:
        i = args.index("--variant")
        _variant = args[i + 1]
        del args[i : i + 2]
    sizes = [int(a) for a in args] or [100, 1000]
    print("variant", _variant, flush=True)
    cs.use_backend("cuda")
    _redirect(cs.current_backend())
    device = CudaDevice()
    cw.set_events_per_stream(cw.usable_events_per_stream(device.pending_record_cap()))
    _trace()
    for n in sizes:
        for seed in range(2):
            one(device, n, seed)


if __name__ == "__main__":
    main()
