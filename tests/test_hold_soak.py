"""A long run of handoffs whose owners are dropped at once: holds stay bounded
by the work actually pending, and memory stays flat.

Not a timed test: it counts. ``CAI_STREAMS_HOLD_SOAK`` sets the number of
handoffs (default 100,000). Each allocates a block from the simulator's
caching allocator, enqueues a read of it on one of three consumer streams
(every 5,000 handoffs one stream is held back for 900, so work piles up),
hands it over with ``cs.hold`` (19 in 20) or as a view from
``consume_blocking(stream=)`` (one in 20), and drops it at once. No
``stats()`` call and no poller runs during the run: only the bounded release
step at each library call frees holds.
"""

from __future__ import annotations

import gc
import os
import threading
from typing import Any

import numpy as np
import pytest

import cai_streams as cs
from cai_streams import sim
from cai_streams._backend._sim import SimBackend
from cai_streams._hold_table import table as holds

HANDOFFS = int(os.environ.get("CAI_STREAMS_HOLD_SOAK", "100000"))
STREAMS = 3
#: every GATE_EVERY handoffs one stream is held until GATE_OPEN handoffs later
GATE_EVERY = 5000
GATE_OPEN = 900
WAIT = 30.0
#: handoffs between two looks at the counts
EVERY = 97


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_handoffs_with_owners_dropped_at_once_keep_holds_bounded_and_memory_flat() -> None:
    backend = cs.use_backend("sim")
    assert isinstance(backend, SimBackend)
    device = sim.device()
    saved = device.jitter
    device.jitter = 0.0
    consumers = [cs.Stream() for _ in range(STREAMS)]
    seen = [0.0 for _ in consumers]
    completed = [0 for _ in consumers]  # each written only by its stream's worker
    launched = [0 for _ in consumers]
    gates: list[threading.Event] = []
    worst = {"holds": 0, "pending": 0, "over": -EVERY}
    last = {"pending": 0}

    def read(k: int, block: np.ndarray[Any, Any]) -> None:
        seen[k] = float(block[0])
        completed[k] += 1

    def handoffs(start: int, stop: int) -> None:
        for i in range(start, stop):
            k = i % len(consumers)
            c = consumers[k]
            if i % GATE_EVERY == 0:  # hold one stream back for a while: work piles up
                gate = threading.Event()
                gates.append(gate)
                sim.launch(c, gate.wait, WAIT, name="gate")
            elif i % GATE_EVERY == GATE_OPEN:
                gates[-1].set()
            a = sim.empty(16, "float32")
            if i % 20 == 0:
                view = cs.consume_blocking(a, stream=c)
                sim.launch(c, read, k, view)
                del view
            else:
                sim.launch(c, read, k, a)
                cs.hold(a, until=c)
            launched[k] += 1
            del a
            if i % EVERY == 0:
                done = sum(completed)  # first: the pending count may only be too high
                in_flight = holds.count
                pending = sum(launched) - done
                # A hold in flight now was pending at the last look, or made
                # since (a released view's, at the next call): a completed one
                # is released within EVERY handoffs. Each stream's last read
                # counts itself done just before the event after it completes.
                bound = last["pending"] + EVERY + 1 + STREAMS
                last["pending"] = pending
                worst["holds"] = max(worst["holds"], in_flight)
                worst["pending"] = max(worst["pending"], pending)
                worst["over"] = max(worst["over"], in_flight - bound)

    def mark() -> dict[str, int]:
        gc.collect()
        return {
            "segments": len(backend.memory._segments),
            "rss": _rss(),
            "objects": len(gc.get_objects()),
            "events": cs.stats()["events_created"],  # (stats() releases what completed)
            "made": holds.made,
            "released": holds.released,
        }

    try:
        with cs.sanitize(False):  # its shadow memory is not what is measured here
            warm = max(1, HANDOFFS // 10)
            handoffs(0, warm)  # one-time allocations happen here
            for c in consumers:
                c.synchronize()
            w = mark()
            handoffs(warm, HANDOFFS)
            for c in consumers:
                c.synchronize()
            e = mark()
    finally:
        device.jitter = saved
        for gate in gates:
            gate.set()
    print(f"\n{HANDOFFS} handoffs: worst {worst}; after warm-up {w}; at the end {e}")
    assert e["made"] - w["made"] == HANDOFFS - warm  # not a no-op: every handoff held
    assert e["released"] - w["released"] == HANDOFFS - warm  # and every hold let go
    assert holds.count == 0
    assert worst["over"] <= 0, worst  # in flight: only work pending (or just made)
    assert worst["pending"] > 2 * EVERY, worst  # work did pile up (the gates)
    # Blocks and events made during the run follow the pending work, not the
    # number of handoffs (a block is reused as soon as its hold is let go).
    # The allocator keeps every segment the process made, of every size.
    assert e["segments"] - w["segments"] <= worst["holds"] + 2 * EVERY, (w, e, worst)
    assert e["events"] - w["events"] <= worst["holds"] + 2 * EVERY, (w, e, worst)
    # flat: nothing per handoff is left (90,000 of them)
    assert e["objects"] - w["objects"] < 5000, (w, e)
    assert e["rss"] - w["rss"] < 8 * 1024 * 1024, (w, e)
