"""Two devices each fill half of a result; one consumer on device 0 reads it all.

Device 0 and device 1 each compute one half of a result on a stream of their
own. The halves are tracked, so the consumer (a stream on device 0) is ordered
after both writers with one event each, recorded on the writer's own device
(an event can only be recorded on streams of its device) and waited on from
device 0 (waits across devices are legal). The consumer copies both halves
into one array on device 0 and sums it. Nobody synchronizes the host until the
answer is read.

Its kernels are simulated (`sim.launch`), so it selects the simulated device
itself: it has two devices unless `CAI_STREAMS_SIM_DEVICES=1`, and then both
halves are made on device 0 and the example still runs.

    python examples/multi_device.py
"""

from __future__ import annotations

from typing import Any

import numpy as np

import cai_streams as cs
from cai_streams import sim

N = 1 << 12


def fill_range(out: np.ndarray[Any, Any], start: int) -> None:
    out[...] = np.arange(start, start + out.size, dtype=out.dtype)


def gather(out: np.ndarray[Any, Any], lo: np.ndarray[Any, Any], hi: np.ndarray[Any, Any]) -> None:
    out[: lo.size] = lo
    out[lo.size :] = hi


def main() -> None:
    cs.use_backend("sim")  # simulated kernels need simulated streams, even on a GPU machine
    devices = min(2, cs.device_count())
    halves: list[cs.TrackedArray] = []
    for d in (0, 1):
        device = d % devices
        writer = cs.Stream(device=device)
        half = sim.empty(N // 2, "float64", device=device)
        t = cs.track(half)
        with t.writing(writer):  # slow on purpose: the consumer must wait for it
            sim.launch(writer, fill_range, half, d * N // 2, writes=[half], duration=0.02)
        halves.append(t)
        print(f"half {d}: written on device {writer.device}, lives on device {t.view.device}")

    consumer = cs.Stream(device=0)
    result = sim.empty(N, "float64", device=0)
    lo, hi = (cs.consume_blocking(t, stream=consumer) for t in halves)  # only enqueues waits
    sim.launch(consumer, gather, result, lo, hi, reads=[lo, hi], writes=[result])
    total = float(result.to_host(stream=consumer).sum())
    expected = N * (N - 1) / 2
    print(f"consumer on device {consumer.device}: sum {total:.0f} (expected {expected:.0f})")
    assert total == expected, "the consumer read before a writer finished"
    print("multi-device join: ok")


if __name__ == "__main__":
    main()
