"""The sanitizer learns of a free before the block can be handed on.

A block goes back to the simulator's caching pool when its last array is
collected, in whatever thread that is; the next allocation of its size class
may take it at once. The sanitizer's free hook (which forgets the accesses the
freeing thread knew done, or that a released hold vouched for, and marks the
rest freed) must have run by then: a block handed on first is checked against
accesses of the old owner the free would have forgotten, and a correct program
gets a HazardError (the model test saw this under a 0.1 ms switch interval).

These tests free an owner in one thread and stop that thread inside the free
hooks, just before the sanitizer's, while this thread allocates: the block is
not handed on until the hooks ran, and a correct program gets no hazard. The
control: the same interleaving where the old owner's read may still run (no
hold, no synchronize) is named as a reuse once the block is handed on.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

import cai_streams as cs
from cai_streams import sim
from cai_streams._backend import _sim_memory

WAIT = 10.0  # seconds: every wait here is bounded by this
N = 256


@pytest.fixture(autouse=True)
def _sim() -> Iterator[None]:
    cs.use_backend("sim")
    gc.collect()  # nothing else of this size class is freed in between
    yield


def _copy(dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any]) -> None:
    dst[...] = src


def _until_no_holds() -> None:
    """Library calls (each releases completed holds) until none is left, bounded."""
    deadline = time.monotonic() + WAIT
    while cs.stats()["holds"]:
        assert time.monotonic() < deadline, "no hold was released"
        time.sleep(0.0005)


@contextmanager
def _first_free_hook(hook: Callable[[int, int], None]) -> Iterator[None]:
    """``hook`` runs first at every free (before the sanitizer's), in place:
    turning the sanitizer off and on edits the same list."""
    _sim_memory.free_hooks.insert(0, hook)
    try:
        yield
    finally:
        _sim_memory.free_hooks.remove(hook)


def _free_elsewhere_while_allocating(how: str) -> tuple[float, bool, bool]:
    """An owner of 1s is read on a stream (gated for ``how="unheld"``); its
    read is done for the free (``"held"``: this thread releases the owner's
    hold, which vouches for it; ``"synchronized"``: the freeing thread
    synchronizes the stream), and another thread drops the owner's last
    reference. Inside the free, before the sanitizer's hook, that thread stops
    until this one, whose program never waited for the stream, has made an
    array of 2s. Returns what the reader saw, whether the array of 2s got the
    owner's block, and whether the next array did, made after the free ended."""
    s = cs.Stream()
    gate = threading.Event()
    out = sim.empty(N, "float32")
    owner = sim.asarray(np.full(N, 1.0, np.float32))
    ptr = owner.ptr
    if how == "unheld":
        sim.launch(s, lambda: gate.wait(WAIT), name="gate")
    else:
        gate.set()
    sim.launch(s, _copy, out, owner, reads=[owner], writes=[out], name="reader")
    if how == "held":
        cs.hold(owner, until=s)
    freeing, allocated = threading.Event(), threading.Event()

    def stop_inside_the_free(lo: int, hi: int) -> None:
        if lo <= ptr < hi and threading.current_thread().name == "freer":
            freeing.set()
            allocated.wait(WAIT)

    given = [owner]
    del owner
    if how == "held":  # here, not where it is freed: only the hold vouches for the read
        _until_no_holds()  # (released: the owner is still ours)
    errors: list[BaseException] = []

    def free() -> None:
        try:
            if how == "synchronized":
                s.synchronize()
            given.clear()  # the last reference: freed here
        except BaseException as exc:  # reported below
            errors.append(exc)
            freeing.set()

    t = threading.Thread(target=free, name="freer")
    with _first_free_hook(stop_inside_the_free):
        t.start()
        try:
            assert freeing.wait(WAIT), "the owner was not freed"
            try:
                during = sim.asarray(np.full(N, 2.0, np.float32))  # kept: not freed again
            finally:
                allocated.set()
                t.join(WAIT)
            assert not t.is_alive() and not errors, errors
            after = sim.asarray(np.full(N, 3.0, np.float32))
        finally:
            allocated.set()
            gate.set()
            s.synchronize()
    return float(out.to_host()[0]), during.ptr == ptr, after.ptr == ptr


@pytest.mark.parametrize("how", ["held", "synchronized"])
def test_a_block_freed_in_another_thread_is_handed_on_only_after_the_free_hooks(how: str) -> None:
    """The owner's read is done for the free (a released hold vouched for it,
    or the freeing thread synchronized): the block is not handed on while the
    free is being announced, then it is, and nothing is a hazard."""
    assert _free_elsewhere_while_allocating(how) == (1.0, False, True)


def test_the_control_a_block_freed_under_a_pending_read_is_named_once_handed_on() -> None:
    """Nothing holds the owner and its read is gated: the same interleaving
    hands the block on after the free, under the read (wrong data with the
    sanitizer off), and the sanitizer names it as a reuse."""
    with cs.sanitize(False):
        assert _free_elsewhere_while_allocating("unheld") == (3.0, False, True)
    with pytest.raises(cs.HazardError, match=r"(?s)'reader'.*freed and reused while stream"):
        _free_elsewhere_while_allocating("unheld")
