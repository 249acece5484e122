"""The CUDA Array Interface's own example: work on streams 7, 9 and 15, one stream (3)
handed to the consumer.

Three producer streams each fill a third of one buffer. `cs.track` remembers that
work; exporting the buffer records an event on each of the three streams and makes
the export stream wait on them, so a consumer that only reads the interface (it
knows nothing of the three streams) enqueues its work on the exported stream and
sees complete data. Its kernels are simulated (`sim.launch`), so it selects the
simulated device itself and runs the same with or without a GPU.

    python examples/multi_stream_producer.py
"""

from __future__ import annotations

from typing import Any

import numpy as np

import cai_streams as cs
from cai_streams import sim

N = 3 * 1024


def fill(part: np.ndarray[Any, Any], value: float) -> None:
    part[...] = value


def library_that_only_reads_the_interface(obj: Any) -> float:
    """A consumer such as CuPy or Numba: it takes the `stream` entry and nothing else."""
    cai = obj.__cuda_array_interface__
    stream = cai["stream"] if cai["stream"] is not None else 1
    total = sim.empty(1, "float64")
    sim.launch(stream, lambda out, x: out.fill(x.sum()), total, obj, reads=[obj], writes=[total])
    return float(total.to_host(stream=stream)[0])


def main() -> None:
    cs.use_backend("sim")  # simulated kernels need simulated streams, even on a GPU machine
    s7, s9, s15, s3 = (cs.Stream() for _ in range(4))
    buffer = sim.empty(N, "float64")
    t = cs.track(buffer, stream=s3)  # stream "3" is what the consumer will get
    before = cs.stats()["joins"]
    for i, s in enumerate((s7, s9, s15)):
        with t.writing(s, disjoint=True):  # each stream fills its own third, concurrently
            part = buffer[i * N // 3 : (i + 1) * N // 3]
            sim.launch(s, fill, part, float(i + 1), writes=[part], duration=0.01)
    total = library_that_only_reads_the_interface(t)
    print(f"exported stream: {t.export_stream.handle:#x} (the spec's stream 3)")
    print(f"events joined onto it: {cs.stats()['joins'] - before} (one per producer stream)")
    print(f"sum seen by the consumer: {total:.0f} (expected {N // 3 * (1 + 2 + 3)})")
    assert total == N // 3 * 6


if __name__ == "__main__":
    main()
