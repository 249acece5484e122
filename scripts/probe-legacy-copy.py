"""GPU probe: does a legacy-stream copy wait for held non-blocking streams?

On an H100 (2026-11-23) ``CupyOps.array`` (``cudaMemcpy`` from pageable memory,
then ``cudaStreamSynchronize(0)``) in another thread waited until eight latched
non-blocking streams' latches gave up, 20 s later; the CUDA documentation says the
legacy stream synchronizes with blocking streams only. This holds N non-blocking
streams (N = 1, 2, 4, ... 64), each with a latch and a kernel behind it, times the
allocation, the copy and the synchronize of one small array made meanwhile, and
releases the latches after RELEASE seconds: a step that takes about RELEASE waited
for them. Prints ``CUDA_DEVICE_MAX_CONNECTIONS`` too (streams beyond it share
hardware queues). Blocks for at most about 10 s.

    PYTHONPATH=.:SITE python3 scripts/probe-legacy-copy.py
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cai_streams as cs  # noqa: E402
from tests import device_ops  # noqa: E402

RELEASE = 0.25


def main() -> None:
    cs.use_backend("cuda")
    device_ops.LATCH_TIMEOUT = 2.0  # read at each latch launch: a stuck probe ends soon
    ops = device_ops.CupyOps()
    cp = ops.cp
    print("CUDA_DEVICE_MAX_CONNECTIONS =", os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"))
    with cs.sanitize(False):
        for n in (1, 2, 4, 8, 16, 32, 64):
            streams = [cs.Stream() for _ in range(n)]
            arrays = [ops.array(np.zeros(8, np.int64)) for _ in streams]
            latches = [ops.latch(s) for s in streams]
            for s, a in zip(streams, arrays, strict=True):
                ops.fill(s, a, 1.0)
            timer = threading.Timer(RELEASE, lambda ls=latches: [x.release() for x in ls])
            timer.start()
            t0 = time.perf_counter()
            out = cp.empty(8, np.float32)
            t1 = time.perf_counter()
            src = np.zeros(8, np.float32)
            out.data.copy_from_host(src.ctypes.data, src.nbytes)
            t2 = time.perf_counter()
            cp.cuda.Stream.null.synchronize()
            t3 = time.perf_counter()
            timer.join()
            try:
                ops.release_all()
            except AssertionError as exc:  # a step outlasted the latches' 2 s
                print("  ", exc, flush=True)
            for s in streams:
                s.synchronize()
                s.close()
            print(f"{n:3d} held non-blocking streams: empty {1e3 * (t1 - t0):7.2f} ms, "
                  f"copy {1e3 * (t2 - t1):7.2f} ms, null sync {1e3 * (t3 - t2):7.2f} ms "
                  f"(latches released at {1e3 * RELEASE:.0f} ms)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
