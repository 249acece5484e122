"""CuPy as producer and as consumer, on a real GPU.

1. A CuPy array written on a CuPy stream: CuPy exports that stream in the CAI, and
   `await cs.consume(arr)` polls it from the event loop instead of blocking.
2. A buffer filled on three CuPy streams, tracked by cai_streams: `cupy.asarray`
   reads the export, which joins the three streams onto one, so CuPy's own
   synchronization on that stream covers all of them.

    python examples/interop_cupy.py        (prints what it needs on a machine without a GPU)
"""

from __future__ import annotations

import anyio
from _gpu import require

import cai_streams as cs

cp = require("cupy")


async def main() -> None:
    producer = cp.cuda.Stream(non_blocking=True)
    with producer:
        x = cp.arange(1 << 20, dtype=cp.float32)
        x *= 2  # pending on `producer`
    view = await cs.consume(x)  # x exports producer's handle; polled, not blocked
    assert view.stream is None
    print(f"consume: CuPy array ready on the host, sum {float(x.sum()):.0f}")

    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(3)]
    buf = cp.zeros(3 << 20, dtype=cp.float32)
    t = cs.track(buf)
    n = buf.size // 3
    for i, s in enumerate(streams):
        with t.writing(cs.Stream.wrap(s), disjoint=True), s:
            buf[i * n : (i + 1) * n] = i + 1
    joined = cp.asarray(t)  # reads t.__cuda_array_interface__: three streams joined
    with cp.cuda.Stream(ptr=t.export_stream.handle):
        total = float(joined.sum())
    print(f"export: CuPy consumer sum {total:.0f} (expected {n * 6})")
    assert total == n * 6


if __name__ == "__main__":
    anyio.run(main)
