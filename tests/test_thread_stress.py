"""Threads that share tracked buffers and never synchronize with each other.

Each worker thread runs a random program over two shared buffers, using only
what the library guards on its own: ``writing()`` and ``reading()`` blocks
(on its own stream or its per-thread stream 2), exports and stream consumes
of the buffer onto its stream, ``consuming()`` blocks whose reads come after
an await, and closing its stream for a new one. Nothing orders one thread
after another but the library, so the sanitizer (on, as in every test) names
any access the library left unordered, and the writes, each an increment,
must add up. Python switches threads every 0.1 ms here instead of 5 ms, so
the interleavings a two-core CI machine sees once a week come on every run.

Found with it: a consumer's stream closed by its thread while another thread
recorded the consumer's read there (destroyed under the record), and a write
that overtook reads enqueued after an await in a ``consuming()`` body.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

import cai_streams as cs
from cai_streams import sim

STEPS = 300
THREADS = 4
OPS = "WWRRECAXP"


@pytest.fixture(autouse=True)
def _fast_switches() -> Iterator[None]:
    cs.use_backend("sim")
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


def _increment(x: np.ndarray[Any, Any]) -> None:
    value = x.copy()
    time.sleep(0)  # let an unordered writer interleave
    x[...] = value + 1


def _copy(dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any]) -> None:
    np.copyto(dst, src)


def _worker(seed: int, shared: list[cs.TrackedArray], writes: list[int]) -> None:
    """``writes``: this thread's own count per buffer (a shared counter's lock
    would order the threads, as the library must)."""
    rng = random.Random(seed)
    s = cs.Stream()
    out, out2 = sim.empty(8, "float64"), sim.empty(8, "float64")  # one per stream
    for _ in range(STEPS):
        i = rng.randrange(len(shared))
        t = shared[i]
        op = rng.choice(OPS)
        on: cs.Stream | int = s
        if op == "P":  # the thread's per-thread default stream
            on, op = 2, rng.choice("WR")
        if op == "W":
            with t.writing(on):
                sim.launch(on, _increment, t.array, reads=[t], writes=[t])
            writes[i] += 1
        elif op == "R":
            dst = out2 if on == 2 else out
            with t.reading(on):
                sim.launch(on, _copy, dst, t.array, reads=[t], writes=[dst])
        elif op == "E":
            t.export(s)
        elif op == "C":
            cs.consume_blocking(t, stream=s)
        elif op == "A":

            async def consumer(t: cs.TrackedArray = t, s: cs.Stream = s) -> None:
                async with cs.consuming(t, stream=s) as view:
                    await anyio.lowlevel.checkpoint()
                    sim.launch(s, _copy, out, view, reads=[view], writes=[out])

            anyio.run(consumer)
        elif op == "X":
            s.synchronize()  # ``out`` is written on the next stream
            s.close()
            s = cs.Stream()
    s.synchronize()


@pytest.mark.parametrize("seed", range(4))
def test_unsynchronized_threads_doing_only_guarded_work_race_nowhere(seed: int) -> None:
    shared = [cs.track(sim.asarray(np.zeros(8))) for _ in range(2)]
    writes = [[0, 0] for _ in range(THREADS)]
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            _worker(seed * 100 + k, shared, writes[k])
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not any(th.is_alive() for th in threads), "a worker hung"
    assert not errors, errors
    for t, n in zip(shared, map(sum, zip(*writes, strict=True)), strict=True):
        cs.consume_blocking(t, timeout=10)
        assert t.array.to_host()[0] == n
    assert cs.stats()["events_pinned"] == 0
