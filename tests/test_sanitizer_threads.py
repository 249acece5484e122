"""The sanitizer's verdict does not depend on timing nor on the library's own
queries, and host threads that hand data over through what Python offers are
never flagged, while a handoff made too early always is."""

from __future__ import annotations

import _thread
import asyncio
import concurrent.futures
import contextlib
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import numpy as np
import pytest

import cai_streams as cs
from cai_streams import sim

SLOW = 0.03  # long enough that a copy which does not wait reads the old data


@pytest.fixture(autouse=True)
def _sim() -> Iterator[None]:
    with sim.simulated(jitter=0.0):
        yield


def _ones(x: np.ndarray[Any, Any]) -> None:
    x[...] = 1


def write(s: cs.Stream, x: sim.SimArray, duration: float = 0.0) -> None:
    sim.launch(s, _ones, x, writes=[x], duration=duration, name="ones")


def zeros() -> sim.SimArray:
    return sim.asarray(np.zeros(64, "float32"))


# -- the library's own queries never order the user's host read -------------------


def _library_calls(s: cs.Stream, c: cs.Stream) -> None:
    """Calls whose internal queries see work on ``s`` complete: a consume of an
    unrelated array onto another stream (an event on ``s``, released to the
    pool), then ``stats()``, which reclaims that event by querying it."""
    y = sim.empty(8)
    y.stream = s.handle
    anyio.run(lambda: cs.consume(y, stream=c))
    cs.stats()


@pytest.mark.parametrize("timing", ["work done, then library calls", "slow work"])
def test_an_unordered_host_read_is_named_on_every_run(timing: str) -> None:
    s, c, x = cs.Stream(), cs.Stream(), zeros()
    write(s, x, duration=0.0 if timing.startswith("work done") else SLOW)
    _library_calls(s, c)
    if timing.startswith("work done"):
        assert sim.device().drain()  # the write has run; the program never waited for it
    cs.stats()
    with pytest.raises(cs.HazardError, match="to_host"):
        x.to_host()


def test_the_unordered_read_is_a_real_race_and_the_synchronized_one_is_not() -> None:
    """The controls: unsanitized, the same read gets the old data when the
    work is slow; with the writer synchronized it is never flagged."""
    s, c, x = cs.Stream(), cs.Stream(), zeros()
    with cs.sanitize(False):
        write(s, x, duration=SLOW)
        _library_calls(s, c)
        assert (x.to_host() == 0).all()  # wrong: the write had not run
    s.synchronize()
    write(s, x, duration=SLOW)
    _library_calls(s, c)
    s.synchronize()
    assert (x.to_host() == 1).all()


# -- host threads handing data over -------------------------------------------------
#
# A producer thread writes on its stream, synchronizes it, and hands the array
# to a consumer thread, which copies it to the host. Correct: the handoff comes
# after the synchronize. The control makes the handoff before the synchronize:
# the consumer's copy is then really unordered with the write (unsanitized, it
# reads zeros), and must be named, as a missing host-thread ordering.

Produce = Callable[[Callable[[], None]], Callable[[], np.ndarray[Any, Any]]]


def _producer(x: sim.SimArray, early: bool) -> Callable[[Callable[[], None]], None]:
    """The producer's body, calling ``handoff()`` after (or, ``early``, before)
    its synchronize."""

    def produce(handoff: Callable[[], None]) -> None:
        s = cs.Stream()
        write(s, x, duration=SLOW)
        if early:
            handoff()
        s.synchronize()
        if not early:
            handoff()

    return produce


def _via_queue(x: sim.SimArray, early: bool) -> np.ndarray[Any, Any]:
    q: queue.Queue[sim.SimArray] = queue.Queue()
    th = threading.Thread(target=_producer(x, early), args=(lambda: q.put(x),))
    th.start()
    try:
        return q.get(timeout=10).to_host()
    finally:
        th.join()


def _via_event(x: sim.SimArray, early: bool) -> np.ndarray[Any, Any]:
    ready = threading.Event()
    th = threading.Thread(target=_producer(x, early), args=(ready.set,))
    th.start()
    try:
        assert ready.wait(10)
        return x.to_host()
    finally:
        th.join()


def _via_join(x: sim.SimArray, early: bool) -> np.ndarray[Any, Any]:
    if early:  # the thread hands over by ending: "early" is an unjoined read
        got: list[np.ndarray[Any, Any]] = []
        reader = threading.Thread(target=lambda: got.append(x.to_host()))

        def produce() -> None:
            s = cs.Stream()
            write(s, x, duration=SLOW)
            reader.start()  # started before the synchronize: not ordered after it
            s.synchronize()

        th = threading.Thread(target=produce)
        th.start()
        th.join()
        reader.join()
        if not got:
            raise _thread_errors.pop()
        return got[0]
    th = threading.Thread(target=_producer(x, early), args=(lambda: None,))
    th.start()
    th.join()
    return x.to_host()


def _via_futures(x: sim.SimArray, early: bool) -> np.ndarray[Any, Any]:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        if early:
            done: concurrent.futures.Future[None] = concurrent.futures.Future()
            pool.submit(_producer(x, True), lambda: done.set_result(None))
            done.result(10)
        else:
            pool.submit(_producer(x, False), lambda: None).result(10)
        return x.to_host()


def _via_asyncio_to_thread(x: sim.SimArray, early: bool) -> np.ndarray[Any, Any]:
    async def main() -> np.ndarray[Any, Any]:
        if early:
            loop = asyncio.get_running_loop()
            handed: asyncio.Future[None] = loop.create_future()

            def handoff() -> None:
                loop.call_soon_threadsafe(handed.set_result, None)  # not seen

            task = asyncio.ensure_future(asyncio.to_thread(_producer(x, True), handoff))
            await handed
            try:
                return x.to_host()
            finally:
                await task
        await asyncio.to_thread(_producer(x, False), lambda: None)
        return x.to_host()

    return asyncio.run(main())


def _via_call_soon_threadsafe(x: sim.SimArray, early: bool) -> np.ndarray[Any, Any]:
    """A plain thread resolves a future the loop awaits, through the loop's
    ``call_soon_threadsafe`` (the usual way out of a callback thread)."""

    async def main() -> np.ndarray[Any, Any]:
        loop = asyncio.get_running_loop()
        handed: asyncio.Future[None] = loop.create_future()

        def handoff() -> None:
            loop.call_soon_threadsafe(handed.set_result, None)

        th = threading.Thread(target=_producer(x, early), args=(handoff,))
        th.start()
        try:
            await asyncio.wait_for(handed, 10)
            return x.to_host()
        finally:
            th.join()

    return asyncio.run(main())


def _via_anyio_to_thread(backend: str) -> Callable[[sim.SimArray, bool], np.ndarray[Any, Any]]:
    def run(x: sim.SimArray, early: bool) -> np.ndarray[Any, Any]:
        async def main() -> np.ndarray[Any, Any]:
            if early:
                handed = anyio.Event()
                token = anyio.lowlevel.current_token()

                def handoff() -> None:
                    anyio.from_thread.run_sync(handed.set, token=token)  # not seen

                got: list[Any] = []
                async with anyio.create_task_group() as tg:
                    tg.start_soon(anyio.to_thread.run_sync, _producer(x, True), handoff)
                    await handed.wait()
                    try:
                        got.append(x.to_host())
                    except cs.HazardError as exc:  # raised here, not in a group
                        got.append(exc)
                if isinstance(got[0], BaseException):
                    raise got[0]
                return np.asarray(got[0])
            await anyio.to_thread.run_sync(_producer(x, False), lambda: None)
            return x.to_host()

        return anyio.run(main, backend=backend)

    return run


def _via_tokens(x: sim.SimArray, early: bool) -> np.ndarray[Any, Any]:
    lock = _thread.allocate_lock()  # made through _thread: not seen, so the program says it
    lock.acquire()

    def handoff() -> None:
        cs.happens_before("tokens test")
        lock.release()

    th = threading.Thread(target=_producer(x, early), args=(handoff,))
    th.start()
    try:
        assert lock.acquire(timeout=10)
        cs.happens_after("tokens test")
        return x.to_host()
    finally:
        th.join()


def _via_lock(make: Callable[[], Any], reentered: bool) -> Callable[..., np.ndarray[Any, Any]]:
    """The writer enqueues its write holding the lock (re-entered, for an RLock)
    and synchronizes before (or, ``early``, after) letting go; the reader
    blocks on the lock until then. The only ordering is the writer's release
    and the reader's later acquire (the reader learns that the writer holds
    the lock through a ``_thread`` lock, which is not seen)."""

    def run(x: sim.SimArray, early: bool) -> np.ndarray[Any, Any]:
        lock, holding = make(), _thread.allocate_lock()
        holding.acquire()

        def produce() -> None:
            s = cs.Stream()
            with lock, lock if reentered else contextlib.nullcontext():
                holding.release()
                write(s, x, duration=SLOW)
                if not early:
                    s.synchronize()
            s.synchronize()

        th = threading.Thread(target=produce)
        th.start()
        try:
            assert holding.acquire(timeout=10)
            assert lock.acquire(timeout=10)  # waits for the writer to let go
            try:
                return x.to_host()
            finally:
                lock.release()
        finally:
            th.join()

    return run


def _via_condition(make: Callable[[], threading.Condition]) -> Callable[..., np.ndarray[Any, Any]]:
    """The reader waits on a condition (made while sanitizing: its lock is a
    seen one, and ``wait`` fully releases and re-acquires it)."""

    def run(x: sim.SimArray, early: bool) -> np.ndarray[Any, Any]:
        cond, published = make(), []

        def publish() -> None:
            with cond:
                published.append(True)
                cond.notify()

        th = threading.Thread(target=_producer(x, early), args=(publish,))
        th.start()
        try:
            with cond:
                assert cond.wait_for(lambda: published, 10)
                return x.to_host()
        finally:
            th.join()

    return run


HANDOFFS: dict[str, Callable[[sim.SimArray, bool], np.ndarray[Any, Any]]] = {
    "queue.Queue": _via_queue,
    "threading.Event": _via_event,
    "Thread.join": _via_join,
    "concurrent.futures": _via_futures,
    "asyncio.to_thread": _via_asyncio_to_thread,
    "loop.call_soon_threadsafe": _via_call_soon_threadsafe,
    "anyio.to_thread (asyncio)": _via_anyio_to_thread("asyncio"),
    "anyio.to_thread (trio)": _via_anyio_to_thread("trio"),
    "happens_before/after": _via_tokens,
    "threading.Lock": _via_lock(lambda: threading.Lock(), reentered=False),
    "threading.RLock": _via_lock(lambda: threading.RLock(), reentered=True),
    "threading.Condition": _via_condition(lambda: threading.Condition()),
    "threading.Condition (as a lock)": _via_lock(lambda: threading.Condition(), reentered=True),
    "threading.Condition(Lock())": _via_condition(lambda: threading.Condition(threading.Lock())),
}

_thread_errors: list[BaseException] = []


@pytest.fixture(autouse=True)
def _collect_thread_errors() -> Iterator[None]:
    previous = threading.excepthook
    threading.excepthook = lambda args: _thread_errors.append(args.exc_value)  # type: ignore[arg-type]
    try:
        yield
    finally:
        threading.excepthook = previous
        _thread_errors.clear()


@pytest.mark.parametrize("name", list(HANDOFFS))
def test_a_host_thread_handoff_after_the_synchronize_is_never_flagged(name: str) -> None:
    x = zeros()
    assert (HANDOFFS[name](x, False) == 1).all()
    assert not _thread_errors


@pytest.mark.parametrize("name", list(HANDOFFS))
def test_a_handoff_before_the_synchronize_is_always_flagged(name: str) -> None:
    x = zeros()
    with pytest.raises(cs.HazardError, match="to_host") as info:
        HANDOFFS[name](x, True)
    assert "kernel 'ones'" in str(info.value)


def test_a_free_in_a_thread_not_yet_registered_leaves_it_unregistered() -> None:
    """A garbage collection can free memory inside ``Thread.start``, in the new
    thread before ``threading`` registers it. The free hook must not make a
    ``_DummyThread`` there (``current_thread()`` would): registered first, the
    dummy gives the thread an identity without what its starter handed it, so
    its first access is checked as unordered (a race missed or made up). A
    ``_thread`` thread is never registered: it shows the state for good."""
    box = [zeros()]
    registered: list[bool] = []
    done = _thread.allocate_lock()
    done.acquire()

    def run() -> None:
        box.clear()  # the last reference: the block is freed here
        registered.append(threading.get_ident() in threading._active)  # type: ignore[attr-defined]
        done.release()

    _thread.start_new_thread(run, ())
    assert done.acquire(timeout=10)
    assert registered == [False]


def test_an_unseen_handoff_is_named_as_a_missing_host_thread_ordering() -> None:
    """A lock made through ``_thread`` hands over after the synchronize, and the
    program does not say so: the producer thread is ordered after the write, the
    consumer is not, and the message says which ordering is missing and how to
    state it."""
    x = zeros()
    lock = _thread.allocate_lock()
    lock.acquire()
    th = threading.Thread(target=_producer(x, False), args=(lock.release,))
    th.start()
    try:
        assert lock.acquire(timeout=10)
        with pytest.raises(cs.HazardError) as info:
            x.to_host()
    finally:
        th.join()
    message = str(info.value)
    assert "host-thread ordering is missing" in message, message
    assert "cs.happens_before(token)" in message and "queue.Queue" in message


@pytest.mark.parametrize("sweep", [False, True], ids=["no sweep", "a sweep in between"])
def test_a_thread_started_before_the_write_is_checked_the_same_after_a_sweep(sweep: bool) -> None:
    """A thread started before the write, and not seen by the sanitizer yet,
    reads after an unseen handoff (a ``_thread`` lock): the read is unordered.
    The main thread synchronized, so a sweep finds every *registered* host
    thread ordered after the write; it forgot the write, and the same program
    passed or failed depending on whether a sweep ran first. A thread started
    and not seen yet now counts at the sweep, from its start."""
    x = zeros()
    go = _thread.allocate_lock()
    go.acquire()
    got: list[object] = []

    def reader() -> None:
        if not go.acquire(timeout=10):
            got.append(TimeoutError("never handed over"))
            return
        try:
            got.append(x.to_host())
        except cs.HazardError as exc:
            got.append(exc)

    th = threading.Thread(target=reader)
    th.start()  # before the write: it starts from nothing of it
    try:
        s = cs.Stream()
        write(s, x)
        s.synchronize()
        if sweep:
            from cai_streams import _sanitizer

            with _sanitizer._state.lock:  # (as the sanitizer sweeps: under its lock)
                _sanitizer._state.sweep()
    finally:
        go.release()  # the handoff the sanitizer does not see
        th.join(10)
    assert len(got) == 1 and isinstance(got[0], cs.HazardError), got
    assert "kernel 'ones'" in str(got[0])


@pytest.mark.parametrize("name", list(HANDOFFS))
def test_the_early_handoff_reads_wrong_data_unsanitized(name: str) -> None:
    """The control: the program the sanitizer names really races."""
    x = zeros()
    with cs.sanitize(False):
        got = HANDOFFS[name](x, True)
    assert (got == 0).all()


def test_a_read_that_skips_the_lock_is_flagged_and_really_races() -> None:
    """The writer holds the lock across its write and synchronize; a reader
    that does not take the lock (it only learns, unseen, that the writer has
    begun) reads during the write: wrong data unsanitized, named sanitized."""

    def skip_the_lock(x: sim.SimArray) -> np.ndarray[Any, Any]:
        lock, holding = threading.Lock(), _thread.allocate_lock()
        holding.acquire()

        def produce() -> None:
            s = cs.Stream()
            with lock:
                holding.release()
                write(s, x, duration=SLOW)
                s.synchronize()

        th = threading.Thread(target=produce)
        th.start()
        try:
            assert holding.acquire(timeout=10)
            return x.to_host()
        finally:
            th.join()

    with cs.sanitize(False):
        assert (skip_the_lock(zeros()) == 0).all()
    with pytest.raises(cs.HazardError, match="kernel 'ones'"):
        skip_the_lock(zeros())


def test_installed_packages_generated_code_and_kept_factories_get_plain_locks() -> None:
    """trio checks that its locks are ``_thread``'s: locks made by installed
    packages and by generated code (attrs' ``__init__``) stay plain, and a
    reference to the factory kept past the sanitizer's end makes plain locks."""
    plain_r = type(_thread.RLock())
    factory = threading.RLock  # the sanitizer is on (the project's conftest)
    generated: dict[str, Any] = {}
    exec("def make(factory):\n    return factory()\n", generated)  # noqa: S102 - "<string>" code
    assert type(generated["make"](factory)) is plain_r
    assert type(factory()) is not plain_r  # this file is the user's code
    with cs.sanitize(False):
        assert type(factory()) is plain_r

    async def noop() -> None:
        await anyio.lowlevel.checkpoint()

    anyio.run(noop, backend="trio")  # trio made (and checks) its locks while sanitizing


def test_locks_are_wrapped_only_while_sanitizing() -> None:
    """While on, ``threading.Lock`` / ``RLock`` (and the stdlib objects built on
    them) are seen wrappers, and this package's own locks are not; turned off,
    the originals are back and a wrapper made meanwhile still works."""
    plain, plain_r = type(_thread.allocate_lock()), type(_thread.RLock())
    seen, seen_r = threading.Lock(), threading.RLock()
    assert type(seen) is not plain and type(seen_r) is not plain_r
    assert type(threading.Condition()._lock) is not plain_r  # a condition's own lock too
    assert type(queue.Queue().mutex) is plain  # a primitive's private lock is not
    assert type(cs.track(zeros())._work.lock) is plain  # the library's own
    with cs.sanitize(False):
        assert type(threading.Lock()) is plain and type(threading.RLock()) is plain_r
        with seen, seen_r, seen_r:
            assert seen.locked() and seen_r._is_owned()
        assert not seen.locked() and seen.acquire(False)
        seen.release()
    assert type(threading.Lock()) is not plain


def test_observers_hear_of_a_destroy_while_the_handle_is_still_the_callers() -> None:
    """Handles are reused, the last freed first, by any thread: were observers
    told of a destroy after it, another thread could be handed the handle and
    record it in between, and the sanitizer would forget that record (a
    consume whose pooled event reused a handle another thread had just freed
    found no record of what it waited for, and named a false hazard). Here the
    observer asks for an event at that moment, as the other thread would."""
    from cai_streams import _observe

    backend = cs.use_backend("sim")
    handed: list[tuple[int, int]] = []

    class OtherThread(_observe.Observer):
        def destroyed(self, b: cs.Backend, event: int) -> None:
            if not handed:
                fresh = b.create_event()
                handed.append((event, fresh))
                b.destroy_event(fresh)

    spy = OtherThread()
    _observe.add(spy)
    try:
        backend.destroy_event(backend.create_event())
    finally:
        _observe.remove(spy)
    ((destroyed, fresh),) = handed
    assert fresh != destroyed  # still the destroyer's when the observers heard


def test_a_sanitizer_that_fails_to_turn_on_is_left_off_with_nothing_patched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """All or nothing: if wrapping the locks fails after the thread calls were
    wrapped, both are undone and the sanitizer is off."""
    from cai_streams import _observe, _sanitizer_locks

    def broken(h: Any) -> None:
        raise RuntimeError("cannot wrap")

    with cs.sanitize(False), monkeypatch.context() as patched:
        wait, observers = threading.Event.wait, _observe._observers
        patched.setattr(_sanitizer_locks, "install", broken)
        with pytest.raises(RuntimeError, match="cannot wrap"):
            with cs.sanitize():
                pass
        assert not cs.sanitizing()
        assert threading.Event.wait is wait and _observe._observers == observers


def test_a_to_thread_module_another_thread_is_still_importing_is_left_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A module in ``sys.modules`` with no ``run_sync`` yet (its import is under
    way in another thread) is not wrapped, and turning the sanitizer on works."""
    import sys
    import types

    half = types.ModuleType("trio.to_thread")
    monkeypatch.setitem(sys.modules, "trio.to_thread", half)
    with cs.sanitize(False):
        with cs.sanitize():
            assert cs.sanitizing()
        assert not hasattr(half, "run_sync")


def test_call_soon_threadsafe_leaves_the_callback_as_given() -> None:
    """The sanitizer's wrapper hands asyncio the callback itself: debug mode
    still refuses a coroutine function, and an error names the callback (it
    handed a wrapper of its own, which asyncio accepted and reported)."""

    async def job() -> None:
        pass

    async def main() -> str:
        loop = asyncio.get_running_loop()
        got: list[str] = []

        def other() -> None:
            try:
                loop.call_soon_threadsafe(job)
                got.append("accepted")
            except TypeError as exc:
                got.append(str(exc))

        th = threading.Thread(target=other)
        th.start()
        th.join(10)
        return got[0]

    assert "coroutines cannot be used" in asyncio.run(main(), debug=True)


def _the_loops_write_is_named(buf: sim.SimArray, th: threading.Thread) -> None:
    """The loop's thread writes ``buf`` on a stream of its own: named, as not
    ordered after ``th``'s read of it; then ``th`` is joined."""
    s = cs.Stream()
    try:
        with pytest.raises(cs.HazardError, match="is not ordered after"):
            write(s, buf)
    finally:
        th.join(10)
        s.synchronize()


def test_a_poll_policy_change_from_another_thread_is_no_handoff() -> None:
    """``cs.configure(poll=...)`` wakes the loops through their
    ``call_soon_threadsafe``: the library's own call, which orders nothing of
    the calling thread before the loop's later work (it was taken for a
    handoff, and the loop's unordered write after the thread's read passed)."""
    import time

    async def main() -> None:
        buf = zeros()
        warm = cs.track(zeros())
        ws = cs.Stream()
        with warm.writing(ws):
            write(ws, warm.array, duration=0.02)
        await cs.consume(warm, timeout=10)  # (the loop's poller is bound now)

        def reader() -> None:  # started now: ordered after the above only
            time.sleep(0.05)
            buf.to_host()
            cs.configure(poll=cs.PollPolicy())  # a library call, not a handoff

        th = threading.Thread(target=reader)
        th.start()
        await asyncio.sleep(0.3)  # (timing only)
        _the_loops_write_is_named(buf, th)

    asyncio.run(main())


@pytest.mark.parametrize("how", ["cancelled", "refused in debug mode"])
def test_a_call_soon_threadsafe_that_hands_nothing_over_orders_nothing(how: str) -> None:
    """A thread reads an array, then schedules a callback in the loop that it
    cancels (or that asyncio refuses): nothing was handed over, so the loop's
    later write is named. (The receipt was a callback of its own, which ran
    all the same.)"""
    import time

    async def job() -> None:
        pass

    async def main() -> None:
        loop = asyncio.get_running_loop()
        buf = zeros()

        def other() -> None:
            buf.to_host()
            if how == "cancelled":
                loop.call_soon_threadsafe(lambda: None).cancel()
            else:
                with contextlib.suppress(TypeError):
                    loop.call_soon_threadsafe(job)

        th = threading.Thread(target=other)
        th.start()
        # the loop is held while the thread schedules and cancels: the callback
        # cannot run in between (then it would have handed over)
        time.sleep(0.3)  # noqa: ASYNC251 - the loop held on purpose
        await asyncio.sleep(0.05)  # (the loop's turn: a receipt scheduled would run)
        _the_loops_write_is_named(buf, th)

    asyncio.run(main(), debug=how != "cancelled")


def test_call_soon_threadsafe_on_a_closed_debug_loop_says_it_is_closed() -> None:
    """asyncio checks that the loop is open before it checks the callback;
    the sanitizer's wrapper, checking the callback first in debug mode, raised
    TypeError for a closed loop."""
    loop = asyncio.new_event_loop()
    loop.set_debug(True)
    loop.close()
    with pytest.raises(RuntimeError, match="closed"):
        loop.call_soon_threadsafe(123)  # type: ignore[arg-type]


def test_call_soon_threadsafe_formats_no_callback_it_is_not_asked_to() -> None:
    """A callable object whose ``__repr__`` must not run (it raises, or would
    copy a device array to the host): the sanitizer's wrapper formatted every
    callback with no name at each call, so the call raised and the callback
    never ran. asyncio formats one only when it prints a handle."""
    ran: list[str] = []

    class Job:
        def __call__(self) -> None:
            ran.append("ran")

        def __repr__(self) -> str:
            raise RuntimeError("not to be formatted here")

        def __getattr__(self, name: str) -> Any:  # (a proxy: not to be asked either)
            raise KeyError(name)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        done = asyncio.Event()

        def other() -> None:
            loop.call_soon_threadsafe(Job())
            loop.call_soon_threadsafe(done.set)

        th = threading.Thread(target=other)
        th.start()
        await asyncio.wait_for(done.wait(), 10)
        th.join(10)

    asyncio.run(main())
    assert ran == ["ran"]
