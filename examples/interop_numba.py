"""Numba as producer and as consumer, on a real GPU.

A Numba kernel writes a device array on a Numba stream; the array exports that
stream (CAI v3), and `await cs.consume` polls it. Then `numba.cuda.as_cuda_array`
takes a cai_streams export whose `stream` already covers two producer streams.

    python examples/interop_numba.py        (prints what it needs on a machine without a GPU)
"""

from __future__ import annotations

import anyio
import numpy as np
from _gpu import require

import cai_streams as cs

numba_cuda = require("numba.cuda")


@numba_cuda.jit
def fill(x, value):  # type: ignore[no-untyped-def]
    i = numba_cuda.grid(1)
    if i < x.size:
        x[i] = value


async def main() -> None:
    s = numba_cuda.stream()
    x = numba_cuda.device_array(1 << 20, dtype=np.float32, stream=s)
    fill[(x.size + 255) // 256, 256, s](x, 3.0)
    await cs.consume(x)  # x exports s: polled, never a blocking synchronize
    print(f"consume: Numba array ready, first value {x.copy_to_host()[0]}")

    a, b = numba_cuda.stream(), numba_cuda.stream()
    y = numba_cuda.device_array(1 << 20, dtype=np.float32)
    t = cs.track(y)
    half = y.size // 2
    with t.writing(cs.Stream.wrap(a), disjoint=True):
        fill[(half + 255) // 256, 256, a](y[:half], 1.0)
    with t.writing(cs.Stream.wrap(b), disjoint=True):
        fill[(half + 255) // 256, 256, b](y[half:], 2.0)
    z = numba_cuda.as_cuda_array(t)  # synchronizes on the joined export stream
    print(f"as_cuda_array of a two-stream buffer: sum {z.copy_to_host().sum():.0f}")


if __name__ == "__main__":
    anyio.run(main)
