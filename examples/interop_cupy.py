"""CuPy as producer and as consumer, on a real GPU, every answer checked.

CuPy's ``__cuda_array_interface__`` names CuPy's *current* stream (1 for the
null stream), not the stream that wrote the array. Hand a CuPy array over
inside ``with producer:`` (or track it with ``writing()``), never after.

1. ``await cs.consume(x)`` inside ``with producer:`` polls the producer's
   stream from the event loop instead of blocking the host.
2. ``cs.consume(x, stream=consumer)`` makes another CuPy stream wait for the
   producer on the GPU; the host does not wait at all.
3. A buffer filled on three CuPy streams, tracked: ``cupy.asarray(t)`` reads
   the export, which joins the three streams onto one, so CuPy's own
   synchronization on that stream covers all of them.

Every check reads on a stream that does not wait for the producers (the null
stream does not wait for non-blocking streams), so a missing wait shows as a
wrong answer, and the script exits 1.

    python examples/interop_cupy.py        (prints what it needs on a machine without a GPU)
"""

from __future__ import annotations

import anyio
from _gpu import check, require

import cai_streams as cs

cp = require("cupy")

N = 1 << 22
ROUNDS = 100


async def main() -> None:
    producer = cp.cuda.Stream(non_blocking=True)
    x = cp.zeros(N, dtype=cp.float32)
    cp.cuda.Stream.null.synchronize()  # `producer` does not wait for the null stream
    with producer:
        for _ in range(ROUNDS):
            x += 1  # ROUNDS kernels, pending on `producer`
        # Inside `with producer:` CuPy's CAI names `producer`. After the block
        # it would name the null stream (1), which does not wait for `producer`,
        # and consume would return before these kernels ran.
        view = await cs.consume(x)  # polled from the event loop: the host never blocks
    assert view.stream is None  # ready on the host: CuPy will not synchronize on it
    got = cp.asarray(view)
    check(1, "await cs.consume inside `with producer:` waited for its kernels",
          bool((got == ROUNDS).all()), f"expected {ROUNDS} everywhere")  # fmt: skip

    consumer = cp.cuda.Stream(non_blocking=True)
    with producer:
        for _ in range(ROUNDS):
            x += 1
        view = await cs.consume(x, stream=consumer)  # `consumer` waits on the GPU
    with consumer:
        # cp.asarray(view) would block the host in cudaStreamSynchronize on
        # view.stream (the consumer's); it is already ordered, so drop the entry.
        total = cp.asarray(view.with_stream(None)) == 2 * ROUNDS
        check(2, "consumer stream ordered after the producer on the GPU",
              bool(total.all()), f"expected {2 * ROUNDS} everywhere")  # fmt: skip

    writers = [cp.cuda.Stream(non_blocking=True) for _ in range(3)]
    buf = cp.zeros(3 * N, dtype=cp.float32)
    cp.cuda.Stream.null.synchronize()  # the writers do not wait for the null stream
    t = cs.track(buf)
    for i, s in enumerate(writers):
        with t.writing(s, disjoint=True), s:  # each writes its own third
            part = buf[i * N : (i + 1) * N]
            for _ in range(ROUNDS):
                part += i + 1
    joined = cp.asarray(t)  # reads t.__cuda_array_interface__: three streams joined
    thirds = [bool((joined[i * N : (i + 1) * N] == (i + 1) * ROUNDS).all()) for i in range(3)]
    check(3, "CuPy consumer saw all 3 writers", all(thirds), f"thirds complete: {thirds}")


if __name__ == "__main__":
    anyio.run(main)
