"""GPU probe: how many host functions a held stream takes before a launch blocks.

On an H100 (2026-11-23) about 62 pending ``cuLaunchHostFunc`` calls on each of 16
held streams blocked the host in the next launch, where 1,024 plain event
records on one held stream did not. This holds STREAMS streams with latches and
enqueues harmless host functions (libc's ``close`` of descriptor -1, which only
returns EBADF) round-robin, timing each launch: the first that takes longer than
``SLOW`` seconds blocked, and the count before it is the limit (per stream with
one stream, in all with several). The latches give up after ``LATCH`` seconds,
which ends any block. Prints one line per configuration; about 30 s at most.

    PYTHONPATH=.:SITE python3 scripts/probe-host-func-limit.py [--sim]
"""

from __future__ import annotations

import ctypes
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cai_streams as cs  # noqa: E402
from tests import device_ops  # noqa: E402

LATCH = 3.0
SLOW = 0.5
MOST = 4096


def one(ops: device_ops.DeviceOps, streams: int) -> str:
    """Launches made before the first slow one, with ``streams`` streams held."""
    backend = cs.current_backend()
    close = ctypes.cast(ctypes.CDLL(None).close, ctypes.c_void_p).value
    assert close, "no close() in this process"
    held = [cs.Stream() for _ in range(streams)]
    latches = [ops.latch(s) for s in held]
    made = 0
    blocked = 0.0
    try:
        for i in range(MOST):
            started = time.perf_counter()
            backend.launch_host_func(held[i % streams].handle, close, 2**64 - 1)
            took = time.perf_counter() - started
            if took > SLOW:
                blocked = took
                break
            made += 1
    finally:
        for latch in latches:
            latch.release()
        for s in held:
            s.synchronize()
            s.close()
        try:
            ops.release_all()
        except AssertionError:
            pass  # a latch gave up: that is how a block ends here
    if not blocked:
        return f"{streams:2d} held streams: {made} host functions, none blocked"
    return (f"{streams:2d} held streams: launch {made + 1} blocked for {blocked:.2f} s "
            f"({made} pending, {made / streams:.0f} a stream)")  # fmt: skip


def main() -> None:
    device_ops.LATCH_TIMEOUT = LATCH  # read at each latch launch
    if "--sim" in sys.argv:  # the script's own check: the simulator has no such limit
        cs.use_backend("sim")
        ops: device_ops.DeviceOps = device_ops.SimOps()
    else:
        cs.use_backend("cuda")
        ops = device_ops.CupyOps()
    with cs.sanitize(False):
        for streams in (1, 4, 16):
            print(one(ops, streams), flush=True)


if __name__ == "__main__":
    main()
