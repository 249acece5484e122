"""GPU probe: do the doorbell's notifier streams hold up other streams' kernels?

A bell waits on its event from a private notifier stream (``cudaStreamWaitEvent``),
so that producers are never stalled behind it; but a device has a few hardware
queues (``CUDA_DEVICE_MAX_CONNECTIONS``, 8 by default) and streams beyond them
share one, in order. This holds HELD non-blocking producer streams with latches,
parks one ``await cs.consume`` on each (under ``wake="poll"``, then
``wake="doorbell"``), enqueues one short kernel on each of FREE fresh streams,
and counts how many of those kernels are still pending after 100 ms, while
nothing they depend on is held. The poll row is the control: a fresh stream can
share a queue with a held producer either way; what the doorbell row adds is
the notifier streams' waits. Blocks for at most about 10 s.

    PYTHONPATH=.:SITE python3 scripts/probe-bell-stall.py [--held N] [--sim]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import anyio
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cai_streams as cs  # noqa: E402
from cai_streams import _doorbell  # noqa: E402
from tests import device_ops  # noqa: E402

#: producer streams held (``--held N``): fewer than the hardware queues, so that
#: the polling control leaves some queues free for the bells' notifier streams
HELD = int(sys.argv[sys.argv.index("--held") + 1]) if "--held" in sys.argv else 16
FREE = 32


def one(ops: device_ops.DeviceOps, wake: str) -> tuple[int, int]:
    """(kernels on fresh streams still pending after 100 ms, bells armed)."""
    cs.configure(poll=cs.PollPolicy(wake=wake))  # type: ignore[arg-type]
    held = [cs.Stream() for _ in range(HELD)]
    arrays = [ops.array(np.zeros(8, np.int64)) for _ in held]
    free = [cs.Stream() for _ in range(FREE)]
    outs = [ops.array(np.zeros(8, np.float32)) for _ in free]  # before any latch
    latches = [ops.latch(s) for s in held]
    for s, a in zip(held, arrays, strict=True):
        ops.fill(s, a, 1.0)
    producers = [
        cs.read_interface(a).with_stream(s.handle) for a, s in zip(arrays, held, strict=True)
    ]
    pending = 0
    armed = 0

    async def take(producer: object) -> None:
        await cs.consume(producer, timeout=5)

    async def main() -> None:
        nonlocal pending, armed
        async with anyio.create_task_group() as tg:
            for p in producers:
                tg.start_soon(take, p)
            await anyio.sleep(0.05)  # every consumer parked (and its bell armed)
            armed = _doorbell.counters.armed
            for s, x in zip(free, outs, strict=True):
                ops.add(s, x, 1.0)
            await anyio.sleep(0.1)
            pending = sum(not s.backend.query_stream(s.handle) for s in free)
            for latch in latches:
                latch.release()

    try:
        anyio.run(main)
    finally:
        try:
            ops.release_all()
        except AssertionError as exc:
            print("  ", exc, flush=True)
        for s in held + free:
            s.synchronize()
            s.close()
    return pending, armed


def main() -> None:
    device_ops.LATCH_TIMEOUT = 3.0  # read at each latch launch: a stuck probe ends soon
    if "--sim" in sys.argv:  # the script's own check: no hardware queues, nothing pending
        cs.use_backend("sim")
        ops: device_ops.DeviceOps = device_ops.SimOps()
    else:
        cs.use_backend("cuda")
        ops = device_ops.CupyOps()
    print("CUDA_DEVICE_MAX_CONNECTIONS =", os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"))
    with cs.sanitize(False):
        for wake in ("poll", "doorbell", "poll", "doorbell"):
            pending, armed = one(ops, wake)
            print(f"wake={wake:8s}: {pending:2d} of {FREE} kernels on fresh streams pending "
                  f"after 100 ms ({HELD} producers held; bells armed so far {armed})",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
