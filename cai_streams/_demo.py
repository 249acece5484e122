"""The demo behind ``python -m cai_streams demo``."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from . import sim
from ._backend import current_backend, use_backend
from ._stream import Stream


def run_demo(*, backend: str | None, rounds: int, seed: int | None) -> int:
    if seed is not None:
        os.environ["CAI_STREAMS_SIM_SEED"] = str(seed)
    chosen = use_backend(backend) if backend else current_backend()
    if chosen.name != "sim":
        print("The demo's kernels run on the simulated device; pass --backend sim.")
        return 2
    print(f"backend: sim (jitter seed {sim.device().seed}, jitter up to {sim.device().jitter}s)")
    n = 3 * 1024
    writers = [Stream() for _ in range(3)]
    consumer = Stream()
    data = sim.empty(n, "float64")
    total = sim.empty(1, "float64")
    wrong = 0
    start = time.perf_counter()
    for r in range(rounds):
        for i, s in enumerate(writers):
            part = data[i * n // 3 : (i + 1) * n // 3]
            sim.launch(s, _fill, part, float(r + 1), writes=[part], duration=0.0005)
        for s in writers:  # the spec's rule: events on each writer, consumer waits
            consumer.wait(s.record())
        sim.launch(consumer, _sum, total, data, reads=[data], writes=[total])
        result = total.to_host(stream=consumer)[0]
        wrong += int(result != n * (r + 1))
    elapsed = time.perf_counter() - start
    print(f"{rounds} handoffs: 3 writer streams joined onto 1 consumer stream")
    print(f"wrong sums: {wrong}; {elapsed / rounds * 1e3:.2f} ms per handoff")
    return 0 if wrong == 0 else 1


def _fill(x: np.ndarray[Any, Any], value: float) -> None:
    x[...] = value


def _sum(out: np.ndarray[Any, Any], x: np.ndarray[Any, Any]) -> None:
    out[0] = x.sum()
