"""The sanitizer's state and cost stay flat over a long run (streams and host
threads that come and go), and an access costs the same whatever its extent."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import cai_streams as cs
from benchmarks.bench_sanitizer_soak import _read, in_a_thread, request
from cai_streams import _sanitizer, sim


@pytest.fixture(autouse=True)
def _sim() -> Iterator[None]:
    with sim.simulated(jitter=0.0):
        yield


def state_size() -> int:
    """Entries the sanitizer holds: actors, every clock's entries, shadows."""
    st = _sanitizer._state
    tables: list[Any] = [st.clocks, st.events, st.tokens, st.scopes, st.weak_tokens, st.ended]
    entries = sum(len(c) for table in tables for c in list(table.values()))
    reads = sum(len(segment.reads) for segment in st.shadows)
    return len(st.clocks) + len(st.retired) + entries + len(st.shadows) + reads


def _run(cycles: int, weights: sim.SimArray) -> tuple[list[int], list[float]]:
    sizes, times = [], []
    for _ in range(cycles):
        start = time.thread_time()  # this thread's CPU: other jobs on the machine do not count
        request(weights)
        times.append(time.thread_time() - start)
        sizes.append(state_size())
    return sizes, times


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]  # robust to a stall of the shared CPU


def _flat(sizes: list[int]) -> tuple[int, int]:
    """The largest state in an early window and in the last one (retirement
    runs when actors double, so the state is a sawtooth: compare its peaks)."""
    return max(sizes[200:600]), max(sizes[-400:])


CYCLES = 2000


@pytest.mark.slow
def test_thousands_of_short_lived_streams_keep_state_and_cost_flat() -> None:
    weights = sim.asarray(np.ones(256, "float32"))
    sizes, times = _run(CYCLES, weights)
    early, late = _flat(sizes)
    assert late <= 1.25 * early + 64, (early, late)  # flat, not 2,000 streams' worth
    assert _sanitizer._state.sweeps > 10
    # cost per cycle, relative to the start of the same run
    assert _median(times[-400:]) < 2.0 * _median(times[200:600])


@pytest.mark.slow
def test_without_retiring_the_same_run_grows() -> None:
    """The control: with retirement held off, state grows with every stream."""
    weights = sim.asarray(np.ones(256, "float32"))
    _sanitizer._state.sweep_at = 10**9
    sizes, _ = _run(600, weights)
    assert sizes[-1] > 2.5 * sizes[300], (sizes[300], sizes[-1])  # and on, with every stream


@pytest.mark.slow
def test_a_thousand_threads_keep_state_flat() -> None:
    x = sim.empty(64)
    sizes = []
    for _ in range(1000):
        in_a_thread(x)
        sizes.append(state_size())
    early, late = _flat(sizes)
    assert late <= 1.25 * early + 64, (early, late)


class _Claimed:
    """A foreign array claiming ``n`` bytes at a simulated allocation."""

    def __init__(self, base: sim.SimArray, n: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (n,),
            "typestr": "|u1",
            "data": (base.ptr, False),
            "version": 3,
            "stream": None,
        }


def _consume_cost(obj: object) -> float:
    best = float("inf")
    for _ in range(5):
        start = time.thread_time()
        cs.consume_blocking(obj)
        best = min(best, time.thread_time() - start)
    return best


def test_a_huge_claimed_extent_costs_what_a_small_one_does() -> None:
    base = sim.empty(1 << 16, "uint8")
    with cs.sanitize(False):
        parts = [base[i * 64 : (i + 1) * 64] for i in range(256)]
    s = cs.Stream()
    for part in parts:  # many shadows, so a walk over them would show
        sim.launch(s, _read, reads=[part], name="part")
    s.synchronize()
    small = _consume_cost(_Claimed(base, 64))
    huge = _consume_cost(_Claimed(base, 2**44))
    assert huge < 10 * small + 0.001, (small, huge)
    assert len(_sanitizer._state.shadows) <= 260


# -- the caching allocator: a freed block handed on at once ---------------------------


def _fill(value: float) -> Any:
    def fill(x: np.ndarray[Any, Any]) -> None:
        x[...] = value

    return fill


def _reuse(synchronize_first: bool) -> sim.SimArray:
    """An old owner's slow write on ``s``, its last reference dropped (after
    synchronizing ``s``, or not); the next allocation gets the same block and
    its new owner writes 2 on ``t``."""
    import gc

    gc.collect()  # nothing else of this size class is freed in between
    s, t = cs.Stream(), cs.Stream()
    x = sim.empty(64)
    ptr = x.ptr
    sim.launch(s, _fill(1.0), x, writes=[x], duration=0.03, name="old owner")
    if synchronize_first:
        s.synchronize()
    del x
    gc.collect()
    y = sim.empty(64)
    assert y.ptr == ptr  # the pool hands the block on at once
    sim.launch(t, _fill(2.0), y, writes=[y], name="new owner")
    t.synchronize()
    s.synchronize()
    return y


def test_a_block_reused_while_its_old_owner_may_still_write_it_is_named() -> None:
    with pytest.raises(cs.HazardError, match="freed and reused while stream") as info:
        _reuse(synchronize_first=False)
    assert "cs.hold(owner, until=stream)" in str(info.value)


def test_the_reuse_hazard_is_real_and_the_ordered_new_owner_is_not_flagged() -> None:
    """The controls: unsanitized, the old owner's write lands in the new
    owner's array; after a synchronize the new owner is ordered, and the freed
    block's accesses are forgotten."""
    with cs.sanitize(False):
        assert (_reuse(synchronize_first=False).to_host() == 1).all()  # wrong: 2 expected
    assert (_reuse(synchronize_first=True).to_host() == 2).all()
    assert not any(a.freed for seg in _sanitizer._state.shadows for a in seg.accesses())


@pytest.mark.parametrize("synchronize_first", [False, True], ids=["too-early", "ordered"])
def test_a_reused_block_filled_by_asarray_is_named_when_too_early(synchronize_first: bool) -> None:
    """``sim.asarray`` writes the new owner's data from the host (a cudaMemcpy):
    a stream still reading the freed block is named; after a synchronize, not."""
    import gc

    gc.collect()
    s = cs.Stream()
    x = sim.empty(64)
    out = sim.empty(64)
    ptr = x.ptr
    sim.launch(s, lambda o, i: o.__setitem__(..., i), out, x, reads=[x], writes=[out],
               duration=0.03, name="old owner's reader")  # fmt: skip
    if synchronize_first:
        s.synchronize()
    del x
    gc.collect()
    try:
        if synchronize_first:
            assert sim.asarray(np.full(64, 2.0, np.float32)).ptr == ptr
        else:
            with pytest.raises(cs.HazardError, match="freed and reused while stream"):
                sim.asarray(np.full(64, 2.0, np.float32))
    finally:
        s.synchronize()
