"""Numba as producer and as consumer, on a real GPU, every answer checked.

A Numba device array exports (CAI v3) the stream it is *bound* to
(``device_array(..., stream=s)``, ``arr.bind(s)``), not the stream of the
last kernel that wrote it: bind it to the producer's stream before handing it
over. As a consumer, ``numba.cuda.as_cuda_array(obj)`` blocks the host in a
synchronize of the CAI stream unless ``sync=False``.

1. ``await cs.consume(x)`` polls the stream ``x`` is bound to.
2. ``cs.consume(x, stream=c)`` makes another Numba stream wait on the GPU.
3. Two streams fill a tracked buffer's halves; ``numba.cuda.as_cuda_array(t)``
   synchronizes on the export, which joins both.

The streams are cai_streams' own (non-blocking; ``numba.cuda.stream()`` makes
blocking ones), seen by Numba through ``numba.cuda.external_stream``. Every
check reads on a stream that waits for nothing, so a missing wait shows as a
wrong answer, and the script exits 1.

    python examples/interop_numba.py        (prints what it needs on a machine without a GPU)
"""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
from _gpu import check, require

import cai_streams as cs

numba_cuda = require("numba.cuda")

N = 1 << 20
ROUNDS = 100
THREADS = 256


@numba_cuda.jit
def fill(x, value):  # type: ignore[no-untyped-def]
    i = numba_cuda.grid(1)
    if i < x.size:
        x[i] = value


@numba_cuda.jit
def add(x, value):  # type: ignore[no-untyped-def]
    i = numba_cuda.grid(1)
    if i < x.size:
        x[i] += value


def launch(kernel: Any, stream: Any, x: Any, value: float) -> None:
    kernel[(x.size + THREADS - 1) // THREADS, THREADS, stream](x, value)


def numba_stream() -> tuple[Any, cs.Stream]:
    """A non-blocking stream as Numba sees it, and its owner (keep both)."""
    owned = cs.Stream()
    return numba_cuda.external_stream(owned.handle), owned


def read(x: Any) -> np.ndarray[Any, Any]:
    """``x`` on the host, copied on a stream that waits for nothing."""
    reader, owner = numba_stream()
    out: np.ndarray[Any, Any] = x.copy_to_host(stream=reader)
    owner.synchronize()
    return out


async def main() -> None:
    s, s_owner = numba_stream()
    x = numba_cuda.device_array(N, dtype=np.float32, stream=s)  # bound to s
    assert x.__cuda_array_interface__["stream"] == s_owner.handle
    launch(fill, s, x, 0.0)
    for _ in range(ROUNDS):
        launch(add, s, x, 1.0)  # pending on s
    await cs.consume(x)  # x exports s: polled, never a blocking synchronize
    check(1, "await cs.consume waited for the kernels on the array's stream",
          bool((read(x) == ROUNDS).all()), f"expected {ROUNDS} everywhere")  # fmt: skip

    c, c_owner = numba_stream()
    for _ in range(ROUNDS):
        launch(add, s, x, 1.0)
    view = await cs.consume(x, stream=c)  # `c` waits for s on the GPU
    y = numba_cuda.as_cuda_array(view, sync=False)  # sync=True would block the host
    launch(add, c, y, 1.0)
    out = y.copy_to_host(stream=c)
    c_owner.synchronize()
    check(2, "consumer stream ordered after the producer on the GPU",
          bool((out == 2 * ROUNDS + 1).all()), f"expected {2 * ROUNDS + 1}")  # fmt: skip

    (a, a_owner), (b, b_owner) = numba_stream(), numba_stream()
    z = numba_cuda.device_array(N, dtype=np.float32)  # bound to no stream
    t = cs.track(z)
    half = N // 2
    for i, (w, owner) in enumerate([(a, a_owner), (b, b_owner)]):
        with t.writing(owner, disjoint=True):  # each writes its own half
            part = z[i * half : (i + 1) * half]
            launch(fill, w, part, 0.0)
            for _ in range(ROUNDS):
                launch(add, w, part, float(i + 1))
    joined = numba_cuda.as_cuda_array(t)  # synchronizes on the joined export stream
    got = read(joined)
    halves = [bool((got[i * half : (i + 1) * half] == (i + 1) * ROUNDS).all()) for i in range(2)]
    check(3, "Numba consumer saw both writers", all(halves), f"halves complete: {halves}")


if __name__ == "__main__":
    anyio.run(main)
