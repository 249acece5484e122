"""Microseconds per CAI parse and export, beside the bare attribute read.

Run: python benchmarks/bench_interface.py. Figures are this thread's CPU time
per call on this machine; compare the ratios, which are measured in the same run.
"""

from __future__ import annotations

import time
import timeit
from collections.abc import Callable
from typing import Any

import cai_streams as cs
from cai_streams import sim
from cai_streams._interface import parse, v3_dict

PTR = 0x7F00_0000_0000


class V3Producer:
    """Builds a fresh dict on each access, as CuPy does."""

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (1024, 3), "typestr": "<f4", "data": (PTR, False), "strides": None,
                "version": 3, "stream": 1}  # fmt: skip


class V2Producer:
    """Version 2, no stream, as PyTorch does."""

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (1024, 3), "typestr": "<f4", "data": (PTR, False), "strides": None,
                "version": 2}  # fmt: skip


def per_call_us(fn: Callable[[], object], number: int = 20_000, repeat: int = 5) -> float:
    """This thread's CPU time per call: other load on the machine does not count."""
    times = timeit.repeat(fn, number=number, repeat=repeat, timer=time.thread_time)
    return min(times) / number * 1e6


def main() -> list[tuple[str, float, float]]:
    cs.use_backend("sim")
    v3, v2 = V3Producer(), V2Producer()
    tracked = cs.track(sim.empty((1024, 3)))
    view = parse(v3)
    rows = []
    for label, obj in (("v3 dict producer", v3), ("v2 producer", v2), ("tracked array", tracked)):
        bare = per_call_us(lambda o=obj: o.__cuda_array_interface__)  # type: ignore[misc]
        rows.append((f"parse: {label}", per_call_us(lambda o=obj: parse(o)), bare))  # type: ignore[misc]
    bare_v3 = per_call_us(lambda: v3.__cuda_array_interface__)
    rows.append(("export: ArrayView (cached dict, copied)",
                 per_call_us(lambda: view.__cuda_array_interface__), bare_v3))  # fmt: skip
    rows.append(
        ("export: ArrayView uncached (v3_dict)", per_call_us(lambda: v3_dict(view)), bare_v3)
    )
    rows.append(("export: tracked, nothing pending", per_call_us(tracked.export), bare_v3))
    return rows


if __name__ == "__main__":
    rows = main()
    print(f"{'operation':45} {'us/call':>9} {'floor us':>9} {'ratio':>7}")
    for label, us, floor in rows:
        print(f"{label:45} {us:9.3f} {floor:9.3f} {us / floor:7.2f}")
    print("floor = reading the producer's __cuda_array_interface__ alone (a fresh dict).")
