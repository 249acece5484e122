"""What a bell costs the event loop: no more than the wake-up it replaces.

Counter-based, each beside a control that shows the cost coming back
without the saving.
"""

from __future__ import annotations

from collections.abc import Iterator

import anyio
import pytest

import cai_streams as cs
from cai_streams import _doorbell, sim

pytestmark = pytest.mark.anyio

#: a fallback far longer than the test: the poller's timer never ends a sleep
SLOW = 0.5


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # rings arm the next bell in the loop's next turn there


@pytest.fixture(autouse=True)
def _defaults() -> Iterator[None]:
    yield
    cs.configure(poll=cs.PollPolicy())


def _settled() -> dict[str, int]:
    cs.current_backend().synchronize_stream(1)
    return cs.stats()


async def _chained_rings(n: int) -> dict[str, int]:
    """``n`` waiters, all in place first, on ``n`` kernels of one stream that
    end 10 ms apart (sparse for a 1 ms ``cap``: each ring chains the next
    bell, and the stream always has one). The counters' changes."""
    cs.use_backend("sim")
    cs.configure(
        poll=cs.PollPolicy(
            spin=0, first=0.001, growth=1.0, cap=0.001, fallback=SLOW, wake="doorbell"
        )
    )
    s = cs.Stream()
    sim.launch(s, lambda: None, duration=0.02)  # every waiter in place first
    events = []
    for _ in range(n):
        sim.launch(s, lambda: None, duration=0.01)
        events.append(s.record())
    before = _settled()
    async with anyio.create_task_group() as tg:
        for event in events:
            tg.start_soon(event.wait)
    after = _settled()
    for event in events:
        event.close()
    s.close()
    return {k: after[k] - before[k] for k in before}


async def test_a_ring_that_chains_the_next_bell_makes_no_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While every pending stream has a bell the poller sleeps its fallback,
    and a ring that chains its stream's next bell leaves it asleep: the
    waiters are woken and the bell armed in the loop's next turn, without
    the poller's pass (which would query nothing: every other stream rings
    for itself) and its new sleep. The control: a ring that always wakes the
    poller, as before, makes a pass per ring."""
    n = 8
    quiet = await _chained_rings(n)

    def always_wake(self: _doorbell.PollerBells, *args: object, chained: bool) -> None:
        self.wake_now(_doorbell.Woken.RUNG)

    monkeypatch.setattr(_doorbell.PollerBells, "rang", always_wake)
    woken = await _chained_rings(n)
    for counts in (quiet, woken):  # every wait was a bell's, and each one rang
        assert counts["doorbells_armed"] == counts["doorbells_fired"] == n, counts
        assert counts["poll_wakes"] == n, counts
    assert woken["poll_passes"] >= n, woken
    assert quiet["poll_passes"] <= 3, quiet
