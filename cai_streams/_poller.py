"""One poll loop per event loop: waiting for GPU events without blocking the loop.

Why polling: a CUDA host callback runs Python on a driver thread, which stalls
the stream and can deadlock against the GIL (numba-cuda #317). A query is a
short, non-blocking driver call, so the event loop can afford to make it.

How: every waiter registers its event with the poller of its event loop (an
``anyio.lowlevel.RunVar``, so asyncio, uvloop and trio each get their own) and
sleeps on a wake-up. The poller is a system task that starts with the first
waiter and ends with the last; the caller needs no thread and no task group.
Each pass queries every pending event once, with one shortcut: events recorded
on one stream complete in record order, so after finding one not done the pass
skips the later ones on that stream. Thousands of waiters on a few streams
cost a few queries per pass.

Between passes the poller sleeps according to :class:`PollPolicy`; a
doorbell (``_doorbell``) armed for each stream's oldest pending event cuts the
sleep short when that event completes, and the poller then sleeps at the slow
``fallback`` cadence that still finds errors.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import math
import numbers
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.lowlevel
import sniffio

from . import _capture_guard
from ._backend import Backend
from ._deadline import finished_within
from ._doorbell import (
    WAKE_MODES,
    BellState,
    Fired,
    PollerBells,
    WakeMode,
    Woken,
    loop_gone_or_closed,
    never_closed,
    wants_doorbell,
)
from ._events import Mark
from ._identity import StreamId, order_known
from ._loop_thread import loop_running, warn_if_loop_blocked
from ._observe import saw_complete
from ._sanitizer_threads import unseen

__all__ = ["PollPolicy", "poll_policy", "set_poll_policy", "wait_for_event", "wait_for_events"]


@dataclass(frozen=True, slots=True)
class PollPolicy:
    """How the shared poller spaces its passes over pending events.

    After a pass that woke a waiter, or when a new waiter arrived, the poller
    makes ``spin`` passes separated only by a yield to the event loop (other
    tasks run in between); then it sleeps ``first`` seconds, multiplying the
    sleep by ``growth`` after every pass that finds nothing done, up to
    ``cap`` (``first`` 0 only with ``cap`` 0: a sleep of 0 never grows). A
    pass yields to the loop after querying for ``slice`` seconds,
    so even ten thousand pending events never hold the loop longer than that.

    A waiter is therefore woken at most about ``cap`` (plus one pass) after
    its event completes. asyncio and trio sleep with millisecond granularity
    on Linux, so sleeps below 1 ms act as about 1 ms there.

    ``wake`` says whether a doorbell wakes the poller: ``"doorbell"`` arms, on
    a private notifier stream, a C host function (libc ``close`` on a pipe
    the event loop watches, no Python) after the oldest pending event of
    each stream, and the loop's own selector wakes it at once; while
    every pending stream has one armed, the poller sleeps ``fallback`` seconds
    between passes (the passes that still find errors and anything a bell
    missed). A bell that rang arms the same stream's next one while
    completions come at least ``cap`` apart on average; when they come
    faster, the passes see them as soon, for a query each instead of a bell
    each, and bells wait for the poller to back off to ``cap`` again.
    ``"poll"`` never arms one. ``"auto"`` (the default) rings bells where
    that was measured best: on the simulator (under asyncio, uvloop and trio),
    not on cuda (on an H100 their p99 at 100 and 1,000 waiters was 5-10 times
    the poller's). A capturing stream never gets a bell; the poller's own
    cadence covers it.

    ``PollPolicy()`` is the default: 2 spin passes, then 0.1 ms doubling to
    1 ms, a doorbell where it helps, and a 10 ms fallback while it is armed.
    :meth:`low_latency` never sleeps: the poller yields between passes, so a
    completion is seen within one turn of the event loop, at the price of a
    busy loop (one CPU core) for as long as anything is pending. A poller that
    does not sleep (that policy, the spin passes) lets go of the GIL once a
    millisecond, so the process's other threads still get it: that blocks its
    loop until the GIL comes back, about 75 µs beside threads that take it
    briefly (driver calls), about the switch interval (5 ms) beside one
    running Python, longer beside one in a long C call; the next release then
    waits ten times as long as that one took (at most ten switch intervals).
    """

    spin: int = 2
    first: float = 0.0001
    growth: float = 2.0
    cap: float = 0.001
    slice: float = 0.0005
    wake: WakeMode = "auto"
    fallback: float = 0.01

    def __post_init__(self) -> None:
        if isinstance(self.spin, bool) or not isinstance(self.spin, int) or self.spin < 0:
            raise ValueError(f"spin must be a non-negative int, got {self.spin!r}")
        if self.wake not in WAKE_MODES:
            raise ValueError(f"wake must be one of {', '.join(WAKE_MODES)}, got {self.wake!r}")
        for name in ("first", "cap", "slice", "fallback"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
        if not (isinstance(self.growth, int | float) and 1.0 <= self.growth < math.inf):
            raise ValueError(f"growth must be a finite number >= 1, got {self.growth!r}")
        if self.first > self.cap:
            raise ValueError(f"first ({self.first}) must not exceed cap ({self.cap})")
        if self.first == 0 and self.cap > 0:
            raise ValueError(
                f"first=0 never grows toward cap ({self.cap}): the poller would never sleep, "
                "a busy loop; give first > 0, or cap=0 for that on purpose "
                "(PollPolicy.low_latency())"
            )

    @classmethod
    def low_latency(cls) -> PollPolicy:
        """Never sleep between passes: lowest wake latency, one busy core while
        waiting. Only makes the policy (pass it to :func:`configure`)."""
        return cls(spin=0, first=0.0, growth=1.0, cap=0.0, wake="poll")

    def delays(self) -> Iterable[float]:
        """The sleeps between passes after a wake-up, in order (endless). Only
        computes them; does not sleep."""
        for _ in range(self.spin):
            yield 0.0
        delay = self.first
        while True:
            yield delay
            delay = min(self.cap, delay * self.growth)


_policy = PollPolicy()


def poll_policy() -> PollPolicy:
    """The policy the poller uses now. Does not block."""
    return _policy


def set_poll_policy(policy: PollPolicy) -> PollPolicy:
    """Use ``policy`` from the next pass on, in every event loop; returns the old one.

    A poller asleep between passes ends that sleep first (its length was the
    old policy's: at most its ``cap``, or its ``fallback`` while every stream
    has a bell). Does not block.
    """
    global _policy
    if not isinstance(policy, PollPolicy):
        raise TypeError(f"expected a PollPolicy, got {type(policy).__name__}")
    old, _policy = _policy, policy
    with _pollers_lock:
        pollers = list(_pollers)
    for poller in pollers:  # (each in its own event loop, maybe in another thread)
        poller.policy_changed()
    return old


#: every poller bound to its event loop, weakly: told of a new policy from
#: any thread, and swept for the event loops closed under them
_pollers: weakref.WeakSet[_Poller] = weakref.WeakSet()
_pollers_lock = threading.Lock()  # bookkeeping only


def _soon_in(loop_ref: weakref.ref[asyncio.AbstractEventLoop], fn: Callable[[], object]) -> None:
    """``fn()`` in the asyncio loop ``loop_ref`` names, from any thread;
    RuntimeError if the loop is closed."""
    loop = loop_ref()
    if loop is None:
        raise RuntimeError("the event loop is gone")
    unseen(loop.call_soon_threadsafe, fn)  # (no handoff of the user's, for the sanitizer)


def _soon_in_trio(token_ref: weakref.ref[Any], fn: Callable[[], object]) -> None:
    """``fn()`` in the trio run whose token ``token_ref`` names, from any
    thread; RuntimeError once that run has ended (``trio.RunFinishedError``
    is one too)."""
    token = token_ref()
    if token is None:
        raise RuntimeError("its trio run ended")
    token.run_sync_soon(fn)


def sweep_pollers() -> None:
    """Let go of what the pollers of event loops closed with their pollers
    running hold (``loop.close()`` without cancelling its tasks): their
    waiters, task and sleep hold the loop, which the poller is stored under
    weakly, so the loop, its tasks and what they keep would never be freed.
    Does not block."""
    with _pollers_lock:
        pollers = list(_pollers)
    for poller in pollers:
        if poller.loop_closed():
            poller.abandon()


#: bounded work done on every pass (releasing completed stream-ordered holds);
#: each must never block or raise
pass_hooks: list[Callable[[], None]] = []


class _Counters:
    """Process-wide poller counters (read through ``cs.stats()``)."""

    __slots__ = ("passes", "queries", "wakes")

    def __init__(self) -> None:
        self.passes = 0
        self.queries = 0
        self.wakes = 0


counters = _Counters()


class _State(enum.Enum):
    WAITING = "waiting"
    DONE = "done"
    #: the query raised: each waiter queries again in its own task, which
    #: raises the driver's error there (or finds the event complete after all)
    FAILED = "failed"
    #: the poller task ended (cancelled by shutdown code, say) before the event
    #: completed: the waiters register again, which starts a new poller
    ORPHANED = "orphaned"


class _Entry:
    """One pending event and the waiters woken when it completes."""

    __slots__ = ("backend", "bell", "event", "seq", "state", "waiters")

    def __init__(self, backend: Backend, event: int, seq: int) -> None:
        self.backend = backend
        self.event = event
        self.seq = seq
        self.waiters: list[anyio.Event] = []
        self.state = _State.WAITING
        self.bell = BellState.UNARMED


class _Poller:
    """The poll loop of one event loop."""

    def __init__(self) -> None:
        # per stream identity (or per lone event): entries in record order
        self.queues: dict[Hashable, deque[_Entry]] = {}
        self.entries: dict[tuple[Backend, int], _Entry] = {}
        self.running = False
        self.new_waiter = False
        self.generation = 0  # of the poller task: a new one per start
        #: when a bell or a pass last found an event complete (perf_counter),
        #: and the mean gap between such completions (moving average)
        self.last_completion = -math.inf
        self.mean_gap = math.inf
        self._task: object = None  # asyncio needs a strong reference to its task
        self.bells = PollerBells(self._rang)
        #: runs a function in this poller's event loop, from any thread (None
        #: until bound); an asyncio loop is held weakly (the poller is stored
        #: under it weakly: a strong reference would keep it for good)
        self._in_loop: Callable[[Callable[[], object]], object] | None = None
        #: whether its asyncio loop is closed (never, for trio)
        self.loop_closed: Callable[[], bool] = never_closed
        #: block waiters asleep in this loop (``policy_sleep``): woken by a new policy
        self.sleepers: set[anyio.Event] = set()

    def bind_loop(self) -> None:
        """In its event loop: say how to reach it from another thread."""
        if self._in_loop is not None:
            return
        if sniffio.current_async_library() == "trio":
            import trio

            # (weakly: the poller is stored under the run's token, weakly keyed;
            # a strong reference kept the token, the poller and its run for good)
            token_ref = weakref.ref(trio.lowlevel.current_trio_token())
            self._in_loop = functools.partial(_soon_in_trio, token_ref)
        else:  # asyncio, uvloop
            loop_ref = weakref.ref(asyncio.get_running_loop())
            self._in_loop = functools.partial(_soon_in, loop_ref)
            self.loop_closed = functools.partial(loop_gone_or_closed, loop_ref)
        with _pollers_lock:
            _pollers.add(self)

    def policy_changed(self) -> None:
        """Any thread: a new policy; end the sleeps under way in this loop,
        whose length was the old policy's."""
        call = self._in_loop
        if call is None:
            return
        try:
            call(self._follow_policy)
        except RuntimeError:  # its loop is closed, or its trio run ended
            pass

    def _follow_policy(self) -> None:
        if self.running:
            self.bells.wake_now()
        for sleeper in list(self.sleepers):
            sleeper.set()

    def abandon(self) -> None:
        """Its asyncio loop was closed with this poller running: drop the
        waiters, task and sleep that hold the loop (none is woken: the loop
        runs no more), so the loop and its tasks can be collected; their
        handoffs then let go of their events (``_consume``: at the next
        library call)."""
        self.generation += 1  # (its task's end, if it ever comes, is not this one's)
        self.running = False
        self._task = None
        self.bells.abandon()
        self.queues = {}
        self.entries = {}
        self.sleepers = set()

    def add(self, backend: Backend, event: int, mark: Mark | None, waiter: anyio.Event) -> _Entry:
        key: Hashable = mark.key if mark is not None else ("event", backend, event)
        entry = self.entries.get((backend, event))
        new = entry is None
        if entry is None:
            seq = mark.seq if mark is not None else -1
            entry = _Entry(backend, event, seq)
            self.entries[(backend, event)] = entry
            queue = self.queues.setdefault(key, deque())
            if not queue or queue[-1].seq <= seq:
                queue.append(entry)
            else:  # recorded before something already waited on: keep record order
                i = len(queue)
                while i and queue[i - 1].seq > seq:
                    i -= 1
                queue.insert(i, entry)
        entry.waiters.append(waiter)
        head = self.queues.get(key)
        if new and head and head[0] is entry and wants_doorbell(_policy.wake, backend):
            # The stream's oldest pending event: ring when it completes. Armed
            # by the poller, once the waiters that arrive together have: trio
            # starts tasks in any order, and a bell armed for each new head in
            # turn would take a notifier stream for each (at most 4).
            self.bells.chain(entry, key)
            self.bells.wake_now()
        self.new_waiter = True
        if not self.running:
            self._start()
        return entry

    def _rang(self, fired: list[Fired]) -> None:
        """Bells fired (in the loop): each one's event is complete, and so is every
        event recorded before it on its stream. Wake their waiters now, without a
        query. The next head of each stream that rang gets a bell after the
        woken waiters resume (under asyncio). Then the poller runs a pass for
        whatever else completed, unless every pending stream has a bell and
        each one that rang chained its next (``PollerBells.rang``)."""
        # Completions that come less than ``cap`` apart on average: the passes,
        # at their fast cadence while they keep finding work, see the next
        # ones about as soon as a bell would, for a query each instead of a
        # bell each (a pipe, the selector, the notifier stream). Only while
        # completions are sparse does a bell that rang chain the next one.
        sparse: bool | None = None  # found on the first completion a pass did not take
        chained = True  # every stream that rang has its next head chained, or none left
        for entry, key in fired:
            queue = self.queues.get(key)
            assert isinstance(entry, _Entry)
            if entry.state is not _State.WAITING or not queue:
                continue  # a pass took it already, or its poller ended
            if queue[0] is not entry and entry not in queue:
                continue  # all its waiters left, and a pass dropped it
            if sparse is None:
                sparse = self._completed() >= _policy.cap
            if isinstance(key, StreamId) and not order_known(key):
                # (another library's handle, maybe destroyed and given to a new
                # stream: the events before this one may be an old stream's)
                queue.remove(entry)
                queue.appendleft(entry)
            while queue:
                head = queue.popleft()
                if head.waiters and head.state is _State.WAITING:
                    head.state = _State.DONE
                    saw_complete(head.backend, head.event)  # what a query would tell observers
                    self.entries.pop((head.backend, head.event), None)
                    for waiter in head.waiters:
                        waiter.set()
                    counters.wakes += len(head.waiters)
                if head is entry:
                    break
            while queue and not queue[0].waiters:  # all its waiters left: never armed
                queue.popleft()
            if queue:
                if sparse:  # a bell that won keeps its stream rung: its next head
                    self.bells.chain(queue[0], key)  # gets one after the waiters resume
                else:
                    chained = False
            else:
                del self.queues[key]
        self.bells.rang(self.queues, _policy.wake, chained=chained and bool(self.queues))

    def _completed(self) -> float:
        """A bell or a pass found an event complete now: update the moving
        average of the gaps between completions (1/8 weight), and return it.
        A gap counts as at most 2 ``cap``: after an idle second, six dense
        completions make the average dense again, not fifty."""
        now = time.perf_counter()
        gap = min(now - self.last_completion, 2 * _policy.cap)
        self.last_completion = now
        if self.mean_gap == math.inf:
            self.mean_gap = gap
        else:
            self.mean_gap += (gap - self.mean_gap) / 8
        return self.mean_gap

    def known_pending(self, mark: Mark | None) -> bool:
        """Whether an older event of the same stream is already known not to be
        complete (then neither is this one, and it need not be queried)."""
        if mark is None:
            return False
        queue = self.queues.get(mark.key)
        return queue is not None and len(queue) > 0 and queue[0].seq < mark.seq

    def remove(self, entry: _Entry, waiter: anyio.Event) -> None:
        """A waiter gave up (cancelled or timed out). Its entry stays queued
        without waiters (skipped, never queried) so the stream's order holds;
        its bell, if armed, is retired for the next wait on it to adopt."""
        try:
            entry.waiters.remove(waiter)
        except ValueError:
            return
        if entry.waiters:
            return
        key = (entry.backend, entry.event)
        if self.entries.get(key) is entry:
            del self.entries[key]
        if entry.bell is BellState.ARMED:
            self.bells.retire_for(entry)

    def _start(self) -> None:
        self.bind_loop()
        sweep_pollers()  # (a new loop: an old one may have been closed under its poller)
        self.generation += 1
        generation = self.generation
        if sniffio.current_async_library() == "trio":
            import trio

            trio.lowlevel.spawn_system_task(self._run, generation, name="cai_streams poller")
        else:  # asyncio, uvloop
            import asyncio

            task = asyncio.get_running_loop().create_task(
                self._run(generation), name="cai_streams poller"
            )
            # A task cancelled before it first runs never runs its finally clause.
            task.add_done_callback(lambda _: self._ended(generation))
            self._task = task
        self.running = True

    async def _run(self, generation: int) -> None:
        try:
            built = _policy  # the policy ``delays`` follows: a new one restarts it
            delays = iter(built.delays())
            woken = Woken.PASS
            full_pass_at = 0.0  # when the last pass over every head began
            while self.queues:
                # After a ring, heads with an armed bell are skipped, unless the
                # last full pass is ``fallback`` old: a bell that never rings (its
                # device faulted) must not hide its event while others keep ringing.
                now = time.perf_counter()
                skip_armed = woken is Woken.RUNG and now - full_pass_at < _policy.fallback
                if not skip_armed:
                    full_pass_at = now
                # A ring woke waiters as a pass would have: the poller has not
                # found its streams idle, and must not back off to arm every head
                # (bells chain by themselves while completions are sparse).
                woke = await self._pass(skip_armed=skip_armed)
                if woke or self.new_waiter or woken is Woken.RUNG or _policy is not built:
                    self.new_waiter = False
                    built = _policy
                    delays = iter(built.delays())
                if not self.queues:
                    break  # end now, before the waiters just woken resume
                policy = _policy
                woken = await self.bells.sleep(
                    next(delays), self.queues, policy.wake, policy.cap, policy.fallback
                )
        finally:
            self._ended(generation)

    def _ended(self, generation: int) -> None:
        """The poller task of ``generation`` ended, done or cancelled (by shutdown
        code, say): wake the waiters it leaves, so they start a new one."""
        if generation != self.generation or not self.running:
            return
        self.running = False
        self._task = None
        self.bells.retire_all()
        queues, self.queues = self.queues, {}
        self.entries = {}
        for queue in queues.values():
            for entry in queue:
                if entry.state is _State.WAITING:
                    entry.state = _State.ORPHANED
                    for waiter in entry.waiters:
                        waiter.set()

    async def _pass(self, *, skip_armed: bool) -> bool:
        """Query each stream's oldest pending event; wake what completed.
        ``skip_armed`` (only bells rang since the last pass): not the events
        with an armed bell, which ring for themselves (the passes at the
        policy's cadence query them too: what a bell missed, a fault say)."""
        counters.passes += 1
        for hook in pass_hooks:
            hook()
        woke = False
        budget = _policy.slice
        started = time.perf_counter()
        relax = _capture_guard.RelaxedScope()  # restored before each await
        rung_out: set[_Entry] = set()  # popped with a bell still armed
        for qkey in list(self.queues):
            queue = self.queues.get(qkey)
            sparse = False
            while queue:
                entry = queue[0]
                if not entry.waiters:  # all its waiters left
                    queue.popleft()
                    continue
                if skip_armed and entry.bell is BellState.ARMED:
                    break
                counters.queries += 1
                relax.enter(entry.backend)
                try:
                    done = entry.backend.query(entry.event)
                except Exception:  # never strand waiters: each re-queries in its own task
                    entry.state = _State.FAILED
                else:
                    if not done:
                        break
                    entry.state = _State.DONE
                queue.popleft()
                self.entries.pop((entry.backend, entry.event), None)
                if entry.bell is BellState.ARMED:
                    rung_out.add(entry)
                for waiter in entry.waiters:
                    waiter.set()
                counters.wakes += len(entry.waiters)
                woke = True
                sparse = entry.state is _State.DONE and self._completed() >= _policy.cap
            if not queue:
                self.queues.pop(qkey, None)
            elif sparse:  # as after a ring: the stream's next head gets a bell
                self.bells.chain(queue[0], qkey)
            if time.perf_counter() - started > budget:
                relax.restore()
                if rung_out:
                    self.bells.retire_for_entries(rung_out)
                    rung_out = set()
                await anyio.lowlevel.checkpoint()
                started = time.perf_counter()
        relax.restore()
        if rung_out:
            self.bells.retire_for_entries(rung_out)
        return woke


_poller_var: anyio.lowlevel.RunVar[_Poller] = anyio.lowlevel.RunVar("cai_streams_poller")


def _current_poller() -> _Poller:
    try:
        return _poller_var.get()
    except LookupError:
        poller = _Poller()
        _poller_var.set(poller)
        return poller


async def policy_sleep(delay: float) -> None:
    """Sleep ``delay`` seconds, or until the poll policy is changed (from any
    thread): a waiter pacing itself by the policy follows a new one at once.
    A cancellation point. A sleep of 0 is a turn of the loop, which, once a
    millisecond, lets another thread take the GIL (as the poller's own)."""
    poller = _current_poller()
    if delay <= 0:
        poller.bells.share_gil()
        await anyio.lowlevel.checkpoint()
        return
    poller.bind_loop()
    woken = anyio.Event()
    poller.sleepers.add(woken)
    try:
        await finished_within(delay, woken.wait)
    finally:
        poller.sleepers.discard(woken)


def check_timeout(timeout: float | None) -> float | None:
    """``timeout`` as a float (None: no limit). ValueError unless it is None or
    a real number of seconds >= 0 (an int, a float, or NumPy's: a float16's
    deadline would be computed in float16, seconds apart at a day's uptime)
    that a float can hold (inf: no limit)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout >= 0:
        raise ValueError(f"timeout must be None or a number of seconds >= 0, got {timeout!r}")
    try:
        return float(timeout)
    except OverflowError:
        raise ValueError(
            f"timeout {timeout!r} is too large for a float: give None (or math.inf) for no limit"
        ) from None


async def wait_for_events(
    backend: Backend,
    events: Sequence[tuple[int, Mark | None]],
    *,
    timeout: float | None,
    keepalive: object = None,
    given: float | None = None,
) -> None:
    """Wait until every event is complete, yielding to the event loop.

    A cancellation point in every case (one checkpoint when all are already
    complete, which ``timeout=0`` accepts). Cancelling or timing out withdraws
    the waits and leaves the events alone: their owners release them. A failed
    event raises the driver's :class:`~cai_streams.CudaError` here, in the
    waiting task. If the shared poller task is cancelled, the waiters start a
    new one. ``given``: the caller's own timeout, which the TimeoutError names
    (``timeout`` is what is left of it), if it differs.
    """
    timeout = check_timeout(timeout)
    poller = _current_poller()
    with _capture_guard.relaxed(backend):
        pending = [
            (event, mark)
            for event, mark in events
            if poller.known_pending(mark) or not backend.query(event)
        ]
    if not pending:
        await anyio.lowlevel.checkpoint()
        return
    try:
        if timeout is None:  # no cancel scope to enter and leave: a quicker wake
            while pending:
                pending = await _wait_once(_current_poller(), backend, pending)
        else:
            # Not anyio.fail_after: its TimeoutError, raised in a generator's
            # __exit__, chains the cancellation, whose traceback holds the frames
            # of that __exit__, which hold the cancellation: a cycle that kept the
            # caller's frames (and the arrays in them) until a garbage collection
            # (Python 3.12). This TimeoutError chains nothing. Nor an anyio scope
            # under asyncio: a loop closed with this task parked kept it for good.
            box = [pending]

            async def until_done() -> None:
                while box[0]:
                    box[0] = await _wait_once(_current_poller(), backend, box[0])

            if not await finished_within(timeout, until_done):
                with _capture_guard.relaxed(backend):  # (those woken last; a failed one
                    late = [e for e in box[0] if not backend.query(e[0])]  # raises its error)
                if late:  # (none: all done at the deadline, as a blocking wait finds)
                    said = timeout if given is None else given
                    raise TimeoutError(f"GPU work not complete after {said} s{_late(late)}")
    except BaseException:
        keepalive = None  # a kept traceback keeps this frame, not what it kept
        raise
    del keepalive


async def _wait_once(
    poller: _Poller, backend: Backend, pending: list[tuple[int, Mark | None]]
) -> list[tuple[int, Mark | None]]:
    """One registration of every pending event; returns those to wait for again."""
    registered: list[tuple[_Entry, anyio.Event]] = []
    try:
        for event, mark in pending:
            waiter = anyio.Event()
            registered.append((poller.add(backend, event, mark, waiter), waiter))
        if _one_device(pending):  # a fault there fails every pending event of it
            for _, waiter in registered:
                await waiter.wait()
        else:
            await _all_or_a_failure(poller, backend, registered, pending)
    finally:
        for entry, waiter in registered:
            if not waiter.is_set():
                poller.remove(entry, waiter)
    again = []
    for (entry, waiter), item in zip(registered, pending, strict=True):
        if not waiter.is_set() or entry.state is _State.ORPHANED:
            again.append(item)
        elif entry.state is _State.FAILED:
            if not _capture_guard.query_event(backend, entry.event):  # may raise
                again.append(item)
    return again


def _one_device(pending: list[tuple[int, Mark | None]]) -> bool:
    """Whether the events are all of one device (a lone event's is not known)."""
    if len(pending) == 1:
        return True
    devices = set()
    for _, mark in pending:
        if mark is None:
            return False
        devices.add(mark.key.device)
    return len(devices) == 1


async def _all_or_a_failure(
    poller: _Poller,
    backend: Backend,
    registered: list[tuple[_Entry, anyio.Event]],
    pending: list[tuple[int, Mark | None]],
) -> None:
    """Events of several devices: a fault on one device leaves the others'
    pending, so waiting for them in turn would hear of it only once the
    events before it completed (never, behind work that never ends). Wakes
    at every completion instead (an alarm beside each pending waiter), and
    returns once all are done or one failed (its error is raised after)."""
    while True:
        waiting = []
        for (entry, waiter), item in zip(registered, pending, strict=True):
            if not waiter.is_set():
                waiting.append(item)
            elif entry.state is _State.FAILED:
                return
        if not waiting:
            return
        alarm = anyio.Event()
        added: list[_Entry] = []
        try:
            for event, mark in waiting:
                added.append(poller.add(backend, event, mark, alarm))
            await alarm.wait()
        finally:
            for entry in added:
                poller.remove(entry, alarm)


async def wait_for_event(
    backend: Backend, event: int, *, mark: Mark | None = None, timeout: float | None,
    keepalive: object = None,
) -> None:  # fmt: skip
    """Poll ``event`` until complete; a cancellation point that leaks nothing."""
    await wait_for_events(backend, [(event, mark)], timeout=timeout, keepalive=keepalive)


def wait_blocking(
    backend: Backend,
    events: Sequence[tuple[int, Mark | None]],
    *,
    timeout: float | None,
    keepalive: object = None,
    given: float | None = None,
) -> None:
    """Block the calling thread until every event is complete, at most ``timeout``
    s. ``given``: the caller's own timeout, which the TimeoutError names."""
    timeout = check_timeout(timeout)
    try:
        with _capture_guard.relaxed(backend):
            if timeout != 0 and loop_running() is not None:  # (a query more per wait)
                events = [e for e in events if not backend.query(e[0])]
                if not events:
                    return
                warn_if_loop_blocked(
                    "consume_blocking() is about to wait for pending GPU work",
                    "`await cs.consume()`",
                )
            _wait_blocking(backend, events, timeout, timeout if given is None else given)
    except BaseException:
        keepalive = None  # a kept traceback keeps this frame, not what it kept
        raise
    del keepalive


def _late(pending: Sequence[tuple[int, Mark | None]]) -> str:
    """Which streams the work still pending at a timeout was enqueued on."""
    streams = dict.fromkeys(
        mark.key.describe() if mark is not None else "a stream not known" for _, mark in pending
    )
    return f": still pending on {', '.join(streams)}" if streams else ""


def _wait_blocking(
    backend: Backend,
    events: Sequence[tuple[int, Mark | None]],
    timeout: float | None,
    given: float | None,
) -> None:
    forever = timeout is None or math.isinf(timeout)
    if forever and len(events) == 1:
        backend.synchronize_event(events[0][0])
        return
    deadline = math.inf if timeout is None else time.monotonic() + timeout
    delay = 0.00005
    pending = list(events)
    while True:  # each pass asks every pending event: a fault on one device (the
        pending = [e for e in pending if not backend.query(e[0])]  # others' still
        if not pending:  # pending) is heard at once, not after the events before it
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"GPU work not complete after {given} s{_late(pending)}")
        time.sleep(min(delay, left))
        delay = min(0.001, delay * 2)
