"""The sanitizer: racy programs are named on every run, correct ones never are,
and its verdict on random programs equals a brute-force happens-before oracle."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import queue
import random
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import numpy as np
import pytest

import cai_streams as cs
from cai_streams import _identity, _sanitizer, sim

from .device_ops import SimOps

ops = SimOps()
HERE = os.path.basename(__file__)


@pytest.fixture(autouse=True)
def _sim() -> Iterator[None]:
    cs.use_backend("sim")
    yield
    cs.configure(sync=True, export_stream=True)


def _write(x: np.ndarray[Any, Any]) -> None:
    x[...] = 1


def _read(*_: object) -> None:
    pass


def w(s: cs.Stream | int, arr: Any, duration: float = 0.0) -> None:
    sim.launch(s, _write, arr, writes=[arr], duration=duration, name="w")


def r(s: cs.Stream | int, arr: Any) -> None:
    sim.launch(s, _read, arr, reads=[arr], name="r")


# -- the catalogue of racy programs ----------------------------------------------


def _missing_wait() -> None:
    a, b, x = cs.Stream(), cs.Stream(), sim.empty(64)
    w(a, x)
    r(b, x)


def _host_read_before_sync() -> None:
    s, x = cs.Stream(), sim.empty(64)
    w(s, x)
    x.to_host()


def _host_read_after_a_wait_on_an_event_recorded_again_outside_a_capture() -> None:
    """A wait refers to the event's latest record: recorded in a capture, then
    again outside it, the event does not draw its waiter into the capture, and
    that stream's kernels are real work a host read must wait for."""
    backend = cs.current_backend()
    c, x, y, data = cs.Stream(), cs.Stream(), cs.Stream(), sim.empty(64)
    event = backend.create_event()
    c.begin_capture("relaxed")
    try:
        sim.launch(c, lambda: None)
        backend.record(event, c.handle)  # a node of the graph
        backend.record(event, x.handle)  # the latest record: outside the capture
        backend.stream_wait_event(y.handle, event)
        w(y, data)
        data.to_host()
    finally:
        c.end_capture()
        backend.destroy_event(event)


def _host_consume_of_a_mislabelled_array() -> None:
    s, x = cs.Stream(), sim.empty(64)
    w(s, x)
    cs.consume_blocking(x)  # x exports stream None: "ready", but it is not


def _write_after_read_on_reuse() -> None:
    reader, writer, x = cs.Stream(), cs.Stream(), sim.empty(64)
    w(writer, x)
    reader.wait(writer.record())
    r(reader, x)
    w(writer, x)  # refill without waiting for the reader


def _write_after_write() -> None:
    a, b, x = cs.Stream(), cs.Stream(), sim.empty(64)
    w(a, x)
    w(b, x)


def _event_recorded_before_the_work() -> None:
    a, b, x = cs.Stream(), cs.Stream(), sim.empty(64)
    early = a.record()
    w(a, x)
    b.wait(early)
    r(b, x)


def _join_covering_some_streams() -> None:
    writers, three = [cs.Stream() for _ in range(3)], cs.Stream()
    x = sim.empty(96)
    for i, s in enumerate(writers):
        w(s, x[i * 32 : (i + 1) * 32])
    for s in writers[:2]:  # stream "15" forgotten
        three.wait(s.record())
    r(three, x)


def _export_of_an_undeclared_write() -> None:
    s, x = cs.Stream(), sim.empty(64)
    t = cs.track(x)
    w(s, x)  # written outside t.writing(s): the scheduler cannot join it
    t.export()


def _sync_false_then_read_elsewhere() -> None:
    s, c, x = cs.Stream(), cs.Stream(), sim.empty(64)
    w(s, x)
    x.stream = s.handle
    view = cs.consume_blocking(x, sync=False)
    r(c, view)


def _enqueue_consume_with_sync_false() -> None:
    s, c, x = cs.Stream(), cs.Stream(), sim.empty(64)
    w(s, x)
    x.stream = s.handle
    r(c, anyio.run(lambda: cs.consume(x, stream=c, sync=False)))


def _overlapping_slices() -> None:
    a, b, x = cs.Stream(), cs.Stream(), sim.empty(64)
    w(a, x[:40])
    r(b, x[32:])


def _two_devices() -> tuple[cs.Stream, cs.Stream]:
    """A stream on device 1 and one on device 0 (this thread stays on 0)."""
    if cs.device_count() < 2:
        pytest.skip("needs two simulated devices (CAI_STREAMS_SIM_DEVICES >= 2)")
    cs.set_device(1)
    try:
        one = cs.Stream()
    finally:
        cs.set_device(0)
    return one, cs.Stream()


def _cross_device_missing_wait() -> None:
    (a, b), x = _two_devices(), sim.empty(64, device=1)
    w(a, x)
    r(b, x)  # a peer read from device 0, not ordered after device 1's write


def _per_thread_streams_of_two_threads() -> None:
    x = sim.empty(64)
    th = threading.Thread(target=w, args=(2, x))
    th.start()
    th.join()  # orders the enqueue, not the work: handle 2 is that thread's own stream
    r(2, x)


def _fan_out_with_one_reader_not_waiting() -> None:
    p, x = cs.Stream(), sim.empty(64)
    readers = [cs.Stream() for _ in range(3)]
    w(p, x)
    done = p.record()
    for s in readers[:2]:
        s.wait(done)
    for s in readers:
        r(s, x)


def _captured_write(x: Any) -> int:
    """A graph that writes ``x``, captured on a stream of its own: the executable."""
    backend, c = cs.current_backend(), cs.Stream()
    backend.begin_capture(c.handle, "thread_local")
    try:
        w(c, x)
    finally:
        graph = backend.end_capture(c.handle)
    return backend.instantiate_graph(graph)


def _graph_replayed_again_unordered() -> None:
    backend, a, x = cs.current_backend(), cs.Stream(), sim.empty(64)
    graph = _captured_write(x)
    backend.launch_graph(graph, a.handle)
    a.synchronize()
    x.to_host()  # ordered: the first replay was waited for
    backend.launch_graph(graph, a.handle)
    x.to_host()  # the second replay was not


def _launched_into_a_capture(x: Any, on: cs.Stream) -> cs.Stream:
    """``x``'s write, captured in a graph that is launched into a second
    capture (a child graph: nothing runs there), whose graph runs on ``on``.
    Returns the stream of the second capture."""
    backend, inner_on = cs.current_backend(), cs.Stream()
    inner = _captured_write(x)
    backend.begin_capture(inner_on.handle, "relaxed")
    try:
        backend.launch_graph(inner, inner_on.handle)
    finally:
        outer = backend.end_capture(inner_on.handle)
    backend.launch_graph(backend.instantiate_graph(outer), on.handle)
    return inner_on


def _graph_in_a_graph_unordered() -> None:
    on, x = cs.Stream(), sim.empty(64)
    _launched_into_a_capture(x, on).synchronize()  # (the child ran on none of it)
    x.to_host()  # the outer graph's replay on ``on`` was not waited for


RACY: dict[str, tuple[Callable[[], None], str]] = {
    "missing wait": (_missing_wait, "stream"),
    "host read before sync": (_host_read_before_sync, "to_host"),
    "host read after a wait on an event recorded again outside a capture": (
        _host_read_after_a_wait_on_an_event_recorded_again_outside_a_capture,
        "to_host",
    ),
    "host consume of a mislabelled array": (_host_consume_of_a_mislabelled_array, "host thread"),
    "write after read on buffer reuse": (_write_after_read_on_reuse, "buffer is reused"),
    "write after write from two streams": (_write_after_write, "write of"),
    "event recorded before the work": (_event_recorded_before_the_work, "earlier work of"),
    "join covering some streams": (_join_covering_some_streams, "kernel 'r'"),
    "export of an undeclared write": (_export_of_an_undeclared_write, "export()"),
    "sync=False then a read elsewhere": (_sync_false_then_read_elsewhere, "kernel 'r'"),
    "consume(stream=, sync=False)": (_enqueue_consume_with_sync_false, "kernel 'r'"),
    "overlapping slices": (_overlapping_slices, "read of"),
    "cross-device, no wait": (_cross_device_missing_wait, "on device 1"),
    "handle 2 of two threads": (_per_thread_streams_of_two_threads, "per-thread default"),
    "fan-out, one reader not waiting": (_fan_out_with_one_reader_not_waiting, "kernel 'r'"),
    "graph replayed again, not waited for": (_graph_replayed_again_unordered, "graph replay"),
    "graph in a graph, not waited for": (_graph_in_a_graph_unordered, "graph replay"),
}


@pytest.mark.parametrize(("jitter", "seed"), [(0.0, 0), (0.0005, 1), (0.003, 2), (0.003, 3)])
@pytest.mark.parametrize("name", list(RACY))
def test_racy_programs_are_flagged_on_every_run(name: str, jitter: float, seed: int) -> None:
    program, needle = RACY[name]
    with sim.simulated(jitter=jitter, seed=seed), pytest.raises(cs.HazardError) as info:
        program()
    message = str(info.value)
    assert needle in message
    assert message.count(HERE) == 2, message  # both accesses, each with its line
    assert "is not ordered after" in message and "Fix:" in message
    assert info.value.first is not None and info.value.second is not None


def test_the_message_names_both_sides_and_the_fix() -> None:
    with pytest.raises(cs.HazardError) as info:
        _missing_wait()
    first, second = info.value.first, info.value.second
    assert isinstance(first, _sanitizer.Access) and isinstance(second, _sanitizer.Access)
    assert (first.kind, second.kind) == ("write", "read")
    assert first.actor != second.actor
    assert first.site == f"tests/{HERE}:{w.__code__.co_firstlineno + 1}"  # the launch
    assert "cs.export()" in str(info.value)


def test_the_message_names_the_librarys_own_streams_for_what_they_are() -> None:
    """A consumer's read on the export stream, then a write on another stream
    not ordered after it: the message names "cai_streams' export stream",
    which the user never made (it named a bare handle). A name goes with its
    stream's close: the next stream given the handle is named plainly."""
    t = cs.track(sim.empty(64))
    s = cs.Stream()
    with t.writing(s):
        w(s, t.array)
    export = cs.Stream.wrap(t.__cuda_array_interface__["stream"])
    r(export, t.array)
    s.synchronize()
    with pytest.raises(cs.HazardError) as info:
        w(cs.Stream(), t.array)
    assert f"read of 256 bytes at {t.array.ptr:#x} by cai_streams' export stream 0x" in str(
        info.value
    ), info.value
    key = t.export_stream._key()
    assert key.describe() == f"cai_streams' export stream {key.handle:#x}"
    mine = cs.Stream()
    mine_key = mine._key()
    _identity.name_stream(mine_key, "a named stream")
    assert mine_key.describe() == f"a named stream {mine.handle:#x}"
    mine.close()
    assert mine_key.describe() == f"stream {mine_key.handle:#x}"
    again = cs.Stream()  # (its handle, likely the same, names a stream of the user's)
    assert again._key().describe() == f"stream {again.handle:#x}"


# -- correct programs are never flagged -------------------------------------------


def _event_ordered() -> None:
    a, b, x = cs.Stream(), cs.Stream(), sim.empty(64)
    w(a, x)
    b.wait(a.record())
    r(b, x)
    a.wait(b.record())
    w(a, x)


def _host_sync() -> None:
    s, x = cs.Stream(), sim.empty(64)
    w(s, x)
    s.synchronize()
    x.to_host()


def _event_sync() -> None:
    s, x = cs.Stream(), sim.empty(64)
    w(s, x)
    s.record().synchronize()
    x.to_host()
    w(s, x)
    e = s.record()
    while not e.is_done:  # a query that says "done" orders the host too
        pass
    x.to_host()


def _transitive_chain() -> None:
    a, b, c, x = cs.Stream(), cs.Stream(), cs.Stream(), sim.empty(64)
    w(a, x)
    b.wait(a)
    c.wait(b)
    r(c, x)


def _spec_export() -> None:
    writers, three = [cs.Stream() for _ in range(3)], cs.Stream()
    x = sim.empty(96)
    t = cs.track(x, stream=three)
    for i, s in enumerate(writers):
        with t.writing(s, disjoint=True):
            w(s, x[i * 32 : (i + 1) * 32], duration=0.001)
    cai = t.__cuda_array_interface__
    r(cai["stream"], x)
    with t.writing(writers[0]):  # reuse after the consumer's read on "3"
        w(writers[0], x)


def _legacy_and_blocking_streams() -> None:
    x = sim.empty(64)
    w(2, x)  # the per-thread default stream is blocking: the legacy copy waits for it
    x.to_host()


async def _every_consume_mode() -> None:
    s, c = cs.Stream(), cs.Stream()
    x = sim.empty(64)
    x.stream = s.handle
    w(s, x)
    await cs.consume(x)
    w(s, x)
    r(c, await cs.consume(x, stream=c))
    async with cs.consuming(x, stream=c) as view:
        r(c, view)
    w(s, x)  # after the back-edge
    cs.consume_blocking(x)
    ys = [sim.empty(8) for _ in range(3)]
    for y in ys:
        y.stream = s.handle
        w(s, y)
    await cs.consume_all(*ys)
    t = cs.track(sim.empty(32))
    with t.writing(s):
        w(s, t.array)
    await cs.consume(t)
    with t.writing(s):
        w(s, t.array)
    r(c, await cs.consume(t, stream=c))
    with t.writing(s):  # waits for the read on c
        w(s, t.array)
    async with cs.consuming(t, stream=c) as view:
        r(c, view)
    with t.writing(s):
        w(s, t.array)


def _cross_device_wait() -> None:
    (a, b), x = _two_devices(), sim.empty(64, device=1)
    w(a, x)
    b.wait(a.record())  # waiting on another device's event is legal, and orders
    r(b, x)


def _produce(x: Any, handoff: Callable[[], None] = lambda: None) -> None:
    s = cs.Stream()
    w(s, x, duration=0.001)
    s.synchronize()
    handoff()


def _thread_handoffs() -> None:
    x = sim.empty(64)
    q: queue.Queue[Any] = queue.Queue()
    th = threading.Thread(target=_produce, args=(x, lambda: q.put(x)))
    th.start()
    q.get(timeout=10).to_host()
    th.join()
    ready = threading.Event()
    th = threading.Thread(target=_produce, args=(x, ready.set))
    th.start()
    assert ready.wait(10)
    x.to_host()
    th.join()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        pool.submit(_produce, x).result(10)
        x.to_host()
    th = threading.Thread(target=_produce, args=(x,))
    th.start()
    th.join()
    x.to_host()


async def _to_thread_handoffs() -> None:
    x = sim.empty(64)
    await asyncio.to_thread(_produce, x)
    x.to_host()
    await anyio.to_thread.run_sync(_produce, x)
    x.to_host()


def _graph_replay_waited_for() -> None:
    """Checked where the graph runs (on ``a``), not where it was captured."""
    backend, a, b, x = cs.current_backend(), cs.Stream(), cs.Stream(), sim.empty(64)
    graph = _captured_write(x)
    backend.launch_graph(graph, a.handle)
    b.wait(a.record())
    r(b, x)


def _graph_in_a_graph_waited_for() -> None:
    """Its accesses are the outer graph's, checked where that one runs."""
    on, x = cs.Stream(), sim.empty(64)
    _launched_into_a_capture(x, on)
    on.synchronize()
    x.to_host()


def _one_graph_launched_on_two_streams() -> None:
    """cudaGraphLaunch orders each launch of an executable behind its earlier ones."""
    backend, a, b, x = cs.current_backend(), cs.Stream(), cs.Stream(), sim.empty(64)
    graph = _captured_write(x)
    backend.launch_graph(graph, a.handle)
    backend.launch_graph(graph, b.handle)  # (a write after the first launch's write)
    b.synchronize()
    x.to_host()  # after both: the second one follows the first


CLEAN: dict[str, Callable[[], None]] = {
    "event-ordered streams": _event_ordered,
    "host sync": _host_sync,
    "event sync and query": _event_sync,
    "transitive chain": _transitive_chain,
    "7/9/15 -> 3 export": _spec_export,
    "legacy and per-thread default streams": _legacy_and_blocking_streams,
    "every consume mode": lambda: anyio.run(_every_consume_mode),
    "cross-device wait": _cross_device_wait,
    "graph replay waited for": _graph_replay_waited_for,
    "graph in a graph, waited for": _graph_in_a_graph_waited_for,
    "one graph launched on two streams": _one_graph_launched_on_two_streams,
    "host threads: queue, event, futures, join": _thread_handoffs,
    "host threads: asyncio and anyio to_thread": lambda: asyncio.run(_to_thread_handoffs()),
}


@pytest.mark.parametrize(("jitter", "seed"), [(0.0, 0), (0.003, 1), (0.003, 2)])
@pytest.mark.parametrize("name", list(CLEAN))
def test_correct_programs_are_never_flagged(name: str, jitter: float, seed: int) -> None:
    with sim.simulated(jitter=jitter, seed=seed):
        before = _sanitizer.checks()
        CLEAN[name]()
        assert _sanitizer.checks() > before  # it did look


# -- switching it on and off -----------------------------------------------------------


def test_sanitize_nests_and_restores() -> None:
    assert cs.sanitizing()  # the suite runs with it on
    with cs.sanitize(False):
        assert not cs.sanitizing()
        _missing_wait()  # not checked
        with cs.sanitize():
            assert cs.sanitizing()
            with pytest.raises(cs.HazardError):
                _missing_wait()
        assert not cs.sanitizing()
    assert cs.sanitizing()
    backend = cs.current_backend()
    with cs.sanitize(False):
        assert "record" not in vars(backend)  # nothing is paid when it is off


@pytest.mark.parametrize("freed", [True, False], ids=["freed", "control"])
def test_a_launch_of_a_graph_over_freed_memory_is_named(freed: bool) -> None:
    """A graph keeps raw pointers: its array freed after the capture (the
    block maybe handed to a new array), a launch writes memory that is gone or
    a new owner's. HazardError at the launch, before it runs; the control
    keeps the array."""
    import gc

    backend, on = cs.current_backend(), cs.Stream()
    x = sim.asarray(np.zeros(64, np.float32))
    graph = _captured_write(x)
    address = x.ptr
    if freed:
        del x
        gc.collect()
        z = sim.asarray(np.full(64, 5.0, np.float32))  # (the block may be handed to it)
        with pytest.raises(cs.HazardError, match="memory freed since the capture") as info:
            backend.launch_graph(graph, on.handle)
        assert f"{address:#x}" in str(info.value) and HERE in str(info.value)
        on.synchronize()
        assert (z.to_host() == 5.0).all()  # never launched
    else:
        backend.launch_graph(graph, on.handle)
        on.synchronize()
        assert (x.to_host() == 1.0).all()
    backend.destroy_graph_exec(graph)


def test_a_launch_of_a_graph_over_memory_freed_during_its_capture_is_named() -> None:
    """Freed while the capture is under way, and not taken again by it: a
    launch writes the block's new owner (it was accepted once frees during a
    capture were not looked at)."""
    import gc

    backend, c, on = cs.current_backend(), cs.Stream(), cs.Stream()
    x = sim.asarray(np.zeros(64, np.float32))
    backend.begin_capture(c.handle, "thread_local")
    try:
        w(c, x)
        del x
        gc.collect()  # (back to the pool, inside the capture)
    finally:
        graph = backend.instantiate_graph(backend.end_capture(c.handle))
    z = sim.asarray(np.full(64, 5.0, np.float32))
    with pytest.raises(cs.HazardError, match="memory freed since the capture"):
        backend.launch_graph(graph, on.handle)
    on.synchronize()
    assert (z.to_host() == 5.0).all()
    backend.destroy_graph_exec(graph)


@pytest.mark.parametrize("written", ["nothing", "half", "all, an input read before"])
def test_a_block_freed_in_a_capture_and_given_to_a_buffer_it_reads_is_named(written: str) -> None:
    """An array written in the capture (or an input written before it, which
    the capture reads) and freed there; a buffer made in the capture gets its
    block, and the capture reads it whole, having written none, half or all of
    it. None or half: the rest is its owner's data, which the scratch write
    overwrites at each launch (a later access in the block, or a first write
    there, was taken for a temporary that took the block). All: the input's
    read gets the buffer's bytes from the launch before (the accesses after
    the free alone were looked at)."""
    import gc

    backend, c, on = cs.current_backend(), cs.Stream(), cs.Stream()
    out = sim.asarray(np.zeros(64, np.float32))
    x = sim.asarray(np.full(64, 1.0, np.float32))
    address = x.ptr
    backend.begin_capture(c.handle, "thread_local")
    try:
        if written == "all, an input read before":
            sim.launch(c, lambda o, a: o.__setitem__(..., a), out, x, reads=[x], writes=[out])
        else:
            w(c, x)
        del x
        gc.collect()  # (back to the pool, inside the capture)
        y = sim.empty(64, "float32")
        assert y.ptr == address  # (the caching allocator gave it the block)
        if written != "nothing":
            part = y[:32] if written == "half" else y
            sim.launch(c, lambda a: a.fill(9.0), part, writes=[part])
            del part
        sim.launch(c, lambda o, a: o.__setitem__(..., a), out, y, reads=[y], writes=[out])
    finally:
        graph = backend.instantiate_graph(backend.end_capture(c.handle))
    with pytest.raises(cs.HazardError, match="memory freed since the capture"):
        backend.launch_graph(graph, on.handle)
    on.synchronize()
    del y
    backend.destroy_graph_exec(graph)


def test_a_temporary_freed_and_taken_again_inside_one_capture_is_no_hazard() -> None:
    """A capture frees a temporary and the pool gives its block to the next
    one, which lives as long as the graph: every launch is correct (each
    launch was refused as a replay over freed memory)."""
    backend, s, on = cs.current_backend(), cs.Stream(), cs.Stream()
    out = sim.asarray(np.zeros(4, np.float32))
    backend.begin_capture(s.handle, "relaxed")
    try:
        for i in range(2):
            tmp = sim.empty(4, "float32")
            sim.launch(s, lambda a: a.fill(1.0), tmp, writes=[tmp])
            sim.launch(s, lambda o, a: o.__iadd__(a), out, tmp, reads=[tmp], writes=[out])
            if i == 0:
                del tmp  # (back to the pool, inside the capture)
    finally:
        graph = backend.instantiate_graph(backend.end_capture(s.handle))
    backend.launch_graph(graph, on.handle)
    on.synchronize()
    assert (out.to_host() == 2.0).all()
    del tmp
    backend.destroy_graph_exec(graph)


def test_freed_memory_is_forgotten() -> None:
    import gc

    s = cs.Stream()
    x = sim.empty(1 << 12)
    w(s, x)
    s.synchronize()
    assert _sanitizer._state.shadows
    del x
    gc.collect()
    assert not _sanitizer._state.shadows


@pytest.mark.parametrize(("value", "on"), [("1", True), ("0", False), ("", False)])
def test_environment_switch(value: str, on: bool) -> None:
    env = {**os.environ, "CAI_STREAMS_SANITIZE": value, "CAI_STREAMS_BACKEND": "sim"}
    code = "import cai_streams as cs; print(cs.sanitizing())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60, check=True)  # fmt: skip
    assert out.stdout.strip() == str(on)


def test_environment_switch_rejects_nonsense_when_used_not_at_import() -> None:
    env = {**os.environ, "CAI_STREAMS_SANITIZE": "maybe", "CAI_STREAMS_BACKEND": "sim"}
    imported = subprocess.run([sys.executable, "-c", "import cai_streams"], env=env,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
    assert imported.returncode == 0, imported.stderr  # a project that never uses it is fine
    code = "import cai_streams as cs; cs.current_backend()"
    used = subprocess.run([sys.executable, "-c", code], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert used.returncode != 0 and "CAI_STREAMS_SANITIZE='maybe'" in used.stderr


# -- random programs against a brute-force oracle ----------------------------------------
#
# Two host threads run each program's operations (in program order, one at a
# time, driven through a C queue the sanitizer does not see); between them,
# handoffs through a queue.Queue, a threading.Event, a threading.Lock (give and
# take are both ``with lock: pass``) or happens_before/after.

N_STREAMS = 3  # plus the legacy stream, index 3
LEGACY = N_STREAMS
N_EVENTS = 2
N_THREADS = 2
N_TOKENS = 2
HANDOFF_KINDS = ("queue", "event", "lock", "tokens")
#: byte ranges of the buffers, as offsets into one allocation: 0 and 1 overlap
RANGES = [(0, 256), (128, 384), (512, 768)]

Op = tuple[Any, ...]  # (thread, kind, *arguments)


def _random_op(rng: random.Random, th: int) -> list[Op]:
    kinds = ["launch", "record", "wait", "sync_event", "sync_stream", "to_host"]
    kind = rng.choices(kinds, weights=[6, 3, 3, 2, 2, 1])[0]
    if kind == "launch":
        reads = frozenset(b for b in range(len(RANGES)) if rng.random() < 0.3)
        writes = frozenset(b for b in range(len(RANGES)) if rng.random() < 0.25)
        return [(th, "launch", rng.randrange(N_STREAMS + 1), reads, writes)]
    if kind == "record":
        return [(th, "record", rng.randrange(N_EVENTS), rng.randrange(N_STREAMS + 1))]
    if kind == "wait":
        return [(th, "wait", rng.randrange(N_STREAMS + 1), rng.randrange(N_EVENTS))]
    if kind == "sync_event":
        return [(th, "sync_event", rng.randrange(N_EVENTS))]
    if kind == "sync_stream":
        return [(th, "sync_stream", rng.randrange(N_STREAMS + 1))]
    read = frozenset([rng.randrange(len(RANGES))])
    return [(th, "launch", LEGACY, read, frozenset()), (th, "sync_stream", LEGACY)]


def _random_program(rng: random.Random) -> list[Op]:
    """Runs of a few operations by one thread; in two-thread programs, the
    thread changes after each run, usually with a handoff (sometimes through
    the wrong token, or none: those are the races between host threads)."""
    program: list[Op] = []
    threads = rng.choice([1, N_THREADS, N_THREADS, N_THREADS])
    target, th = rng.randint(2, 24), 0
    while len(program) < target:
        for _ in range(rng.randint(1, 4)):
            program += _random_op(rng, th)
        launched = [op[2] for op in program if op[0] == th and op[1] == "launch"]
        if threads > 1 and launched and rng.random() < 0.6:  # wait for it, then hand over
            program.append((th, "sync_stream", launched[-1]))
        if threads > 1:
            token = rng.randrange(N_TOKENS)
            if rng.random() < 0.8:
                program.append((th, "give", token))
            th = 1 - th
            if rng.random() < 0.8:
                program.append((th, "take", token if rng.random() < 0.8 else 1 - token))
    return program


def _oracle(program: list[Op], handoff: str, *, handoffs: bool = True) -> int | None:
    """The index of the first op whose access races with an earlier one, by
    reachability in the happens-before graph built from CUDA's rules and the
    host threads' handoffs alone (``handoffs=False``: as if they were unseen)."""
    # nodes: ("h", k) host issue of op k, ("d", k) device execution of op k
    edges: dict[tuple[str, int], set[tuple[str, int]]] = {}

    def edge(a: tuple[str, int], b: tuple[str, int]) -> None:
        edges.setdefault(a, set()).add(b)

    last_on: dict[int, int] = {}
    last_of: dict[int, int] = {}  # host thread -> its previous op
    recorded: dict[int, int] = {}
    given: dict[int, list[int]] = {}  # token -> the gives so far
    queued: dict[int, int] = {}  # token -> items in its queue
    accesses: list[tuple[int, str, int]] = []  # (op, kind, buffer)
    for k, (th, kind, *args) in enumerate(program):
        if th in last_of:
            edge(("h", last_of[th]), ("h", k))
        last_of[th] = k
        if kind in ("launch", "record", "wait"):
            stream = args[1] if kind == "record" else args[0]
            edge(("h", k), ("d", k))
            if stream in last_on:
                edge(("d", last_on[stream]), ("d", k))
            last_on[stream] = k
            if kind == "launch":
                accesses += [(k, "read", b) for b in args[1]] + [(k, "write", b) for b in args[2]]
            elif kind == "record":
                recorded[args[0]] = k
            elif args[1] in recorded:
                edge(("d", recorded[args[1]]), ("d", k))
        elif kind == "sync_event":
            if args[0] in recorded:
                edge(("d", recorded[args[0]]), ("h", k))
        elif kind == "sync_stream":
            if args[0] in last_on:
                edge(("d", last_on[args[0]]), ("h", k))
        elif kind in ("give", "take") and handoff == "lock":
            # both acquire (after every earlier release) and release the lock
            for g in given.get(args[0], []) if handoffs else ():
                edge(("h", g), ("h", k))
            given.setdefault(args[0], []).append(k)
        elif kind == "give":
            given.setdefault(args[0], []).append(k)
            queued[args[0]] = queued.get(args[0], 0) + 1
        elif kind == "take" and handoffs:
            if handoff == "queue":  # a get takes an item, when there is one
                if not queued.get(args[0]):
                    continue
                queued[args[0]] -= 1
            for g in given.get(args[0], []):  # ordered after every give so far
                edge(("h", g), ("h", k))

    def reaches(a: int, b: int) -> bool:
        seen, todo = set(), [("d", a)]
        while todo:
            node = todo.pop()
            if node == ("d", b):
                return True
            for nxt in edges.get(node, ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return False

    def overlap(b1: int, b2: int) -> bool:
        return RANGES[b1][0] < RANGES[b2][1] and RANGES[b2][0] < RANGES[b1][1]

    for j, (kb, kind_b, buf_b) in enumerate(accesses):
        for ka, kind_a, buf_a in accesses[:j]:
            if ka == kb or not overlap(buf_a, buf_b) or "write" not in (kind_a, kind_b):
                continue
            if not reaches(ka, kb):
                return kb
    return None


class _Handoffs:
    """One program's handoff objects, of one kind."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.queues: list[queue.Queue[None]] = [queue.Queue() for _ in range(N_TOKENS)]
        self.events = [threading.Event() for _ in range(N_TOKENS)]
        self.locks = [threading.Lock() for _ in range(N_TOKENS)]  # made while sanitizing

    def give(self, token: int) -> None:
        if self.kind == "queue":
            self.queues[token].put(None)
        elif self.kind == "event":
            self.events[token].set()
        elif self.kind == "lock":
            with self.locks[token]:
                pass
        else:
            cs.happens_before(("oracle token", token))

    def take(self, token: int) -> None:
        if self.kind == "queue":
            try:
                self.queues[token].get_nowait()
            except queue.Empty:
                pass
        elif self.kind == "event":
            self.events[token].wait(0)
        elif self.kind == "lock":
            with self.locks[token]:
                pass
        else:
            cs.happens_after(("oracle token", token))


def _step(op: Op, streams: list[int], events: list[int], views: list[Any],
          handoffs: _Handoffs) -> None:  # fmt: skip
    backend = cs.current_backend()
    _, kind, *args = op
    if kind == "launch":
        sim.launch(streams[args[0]], _read, reads=[views[b] for b in args[1]],
                   writes=[views[b] for b in args[2]])  # fmt: skip
    elif kind == "record":
        backend.record(events[args[0]], streams[args[1]])
    elif kind == "wait":
        backend.stream_wait_event(streams[args[0]], events[args[1]])
    elif kind == "sync_event":
        backend.synchronize_event(events[args[0]])
    elif kind == "sync_stream":
        backend.synchronize_stream(streams[args[0]])
    elif kind == "give":
        handoffs.give(args[0])
    else:
        handoffs.take(args[0])


class _Worker:
    """A host thread that runs the steps it is sent, through C queues (unseen)."""

    def __init__(self) -> None:
        self.inbox: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.outbox: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="oracle-worker", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while (step := self.inbox.get()) is not None:
            try:
                step()
            except BaseException as exc:  # noqa: BLE001 - handed back to the driver
                self.outbox.put(exc)
            else:
                self.outbox.put(None)

    def run(self, step: Callable[[], None]) -> None:
        self.inbox.put(step)
        got = self.outbox.get(timeout=60)
        if got is not None:
            raise got


def _run(program: list[Op], streams: list[int], events: list[int], base: Any,
         worker: _Worker, handoff: str) -> int | None:  # fmt: skip
    views = [base[lo // 4 : hi // 4] for lo, hi in RANGES]
    handoffs = _Handoffs(handoff)
    for k, op in enumerate(program):
        try:
            if op[0] == 0:
                _step(op, streams, events, views, handoffs)
            else:
                worker.run(functools.partial(_step, op, streams, events, views, handoffs))
        except cs.HazardError:
            return k
    return None


PROGRAMS = 5000


def test_random_programs_match_the_happens_before_oracle() -> None:
    rng = random.Random(2026)
    backend = cs.current_backend()
    owned = [cs.Stream() for _ in range(N_STREAMS)]
    streams = [s.handle for s in owned] + [1]
    base = sim.empty(1024 // 4, "float32")
    sim.device().jitter, saved = 0.0, sim.device().jitter
    worker = _Worker()
    racy = threaded = decided = 0
    try:
        for n in range(PROGRAMS):
            program = _random_program(rng)
            handoff = HANDOFF_KINDS[n % len(HANDOFF_KINDS)]
            events = [backend.create_event() for _ in range(N_EVENTS)]
            with cs.sanitize(False), cs.sanitize():  # a clean slate per program
                got = _run(program, streams, events, base, worker, handoff)
            for e in events:
                backend.destroy_event(e)
            expected = _oracle(program, handoff)
            assert got == expected, (
                f"program {n} ({handoff}): sanitizer {got}, oracle {expected}: {program}"
            )
            racy += expected is not None
            threaded += any(op[0] == 1 for op in program)
            decided += expected != _oracle(program, handoff, handoffs=False)
    finally:
        worker.inbox.put(None)
        worker.thread.join(10)
        sim.device().jitter = saved
        for s in owned:
            s.synchronize()
    # both verdicts are well represented, and so are programs whose verdict a
    # handoff between host threads decides
    assert 0.2 * PROGRAMS < racy < 0.8 * PROGRAMS, racy
    assert threaded > 0.5 * PROGRAMS and decided > 0.03 * PROGRAMS, (threaded, decided)


def _copy_into(out: np.ndarray[Any, Any], x: np.ndarray[Any, Any]) -> None:
    out[...] = x


@pytest.mark.parametrize("how", ["ended", "invalidated", "reset"])
def test_a_stream_whose_capture_is_over_is_checked_again_however_it_ended(how: str) -> None:
    """After a capture ends (with a graph, invalidated, or by a device reset),
    what the stream runs is checked again: an unordered read of its write is
    named. (An ended-in-error capture used to leave the stream capturing in
    the sanitizer: every later kernel on it was filed as a graph's, unchecked.)
    The control, unsanitized: the read really races (it sees the old data)."""
    for checked in (True, False):
        with cs.sanitize(checked):
            x, out = sim.asarray(np.zeros(64)), sim.asarray(np.zeros(64))
            s, b = cs.Stream(), cs.Stream()
            s.begin_capture("relaxed")
            sim.launch(s, lambda: None)
            if how == "invalidated":
                with pytest.raises(cs.CudaError):
                    s.synchronize()  # forbidden while capturing: invalidates it
                with pytest.raises(cs.CudaError):
                    s.end_capture()
            elif how == "reset":
                sim.reset(s.device)
            else:
                s.end_capture().close()
            assert not s.is_capturing
            gate = threading.Event()
            sim.launch(s, gate.wait, 10)
            sim.launch(s, _write, x, writes=[x])
            try:
                if checked:
                    with pytest.raises(cs.HazardError):
                        sim.launch(b, _copy_into, out, x, reads=[x], writes=[out])
                else:
                    sim.launch(b, _copy_into, out, x, reads=[x], writes=[out])
                    b.synchronize()
                    assert (out.to_host(stream=b) == 0).all()  # read before the write
            finally:
                gate.set()
            s.synchronize()


@pytest.mark.parametrize("held", [False, True], ids=["freed under the read", "held"])
def test_a_block_sim_empty_takes_under_a_pending_read_is_named(held: bool) -> None:
    """An array freed while a kernel on ``s`` still reads it, its block taken
    by ``sim.empty``, whose fill writes it on the host at once: named (the
    fill was not declared, and the kernel read the fill pattern silently).
    Held until ``s`` passes the read, the block is not reused under it."""
    import gc

    s = cs.Stream()
    out = sim.empty(1000, "float32")
    a = sim.asarray(np.full(1000, 1.0, np.float32))
    sim.launch(s, lambda o, x: o.__setitem__(..., x), out, a, reads=[a], writes=[out], duration=0.1)
    if held:
        cs.hold(a, until=s)
    del a
    gc.collect()
    if held:
        sim.empty(1000, "float32")  # (another block: the first is held)
    else:
        with pytest.raises(cs.HazardError, match="freed and reused"):
            sim.empty(1000, "float32")
    s.synchronize()
    assert (out.to_host() == 1.0).all() or not held


@pytest.mark.parametrize("pause", [0.0, 0.2], ids=["pending at export", "done at export"])
def test_an_export_that_names_no_stream_orders_its_reader(pause: float) -> None:
    """A tracked array's write, its export read by a consumer that follows the
    interface's ``stream`` entry (as CuPy and Numba do): named stream while the
    write is pending, None once it is done; neither is a hazard (None was
    named: the library's query that found the write done ordered no one)."""
    import time

    producer = cs.Stream()
    buf = sim.empty(1024, "float32")
    t = cs.track(buf)
    with t.writing(producer):
        w(producer, buf, duration=0.05)
    time.sleep(pause)
    stream = t.__cuda_array_interface__["stream"]
    assert (stream is None) == (pause > 0)
    out = sim.empty(1, "float64")
    sim.launch(1 if stream is None else stream, lambda o, x: o.fill(x.sum()), out, buf,
               reads=[buf], writes=[out])  # fmt: skip
    assert out.to_host(stream=1 if stream is None else stream)[0] == 1024.0


def _written_then_exported(
    producer: cs.Stream, buf: sim.SimArray, pause: float, duration: float = 0.05
) -> None:
    """``buf`` tracked and written on ``producer``; after ``pause``, its
    interface read (an export): it names the stream while the write is
    pending, None once it is done."""
    import time

    t = cs.track(buf)
    with t.writing(producer):
        w(producer, buf, duration=duration)
    time.sleep(pause)
    assert (t.__cuda_array_interface__["stream"] is None) == (pause > 0)


@pytest.mark.parametrize("pause", [0.0, 0.2], ids=["pending at export", "done at export"])
def test_an_export_that_names_no_stream_orders_no_other_buffer(pause: float) -> None:
    """Another array written on the producer's stream before the tracked one,
    read on the host with nothing in the program ordering it: named on every
    run. (Once the export found the tracked write done and named None, the
    whole thread was taken as ordered after the producer's stream, and the
    read passed: a verdict that depended on the GPU's timing.)"""

    producer = cs.Stream()
    other = sim.empty(1024, "float32")
    buf = sim.empty(1024, "float32")
    w(producer, other, duration=0.05)
    _written_then_exported(producer, buf, pause, duration=0.0)
    with pytest.raises(cs.HazardError, match="to_host"):
        other.to_host()
    producer.synchronize()


@pytest.mark.parametrize("pause", [0.0, 0.3], ids=["pending at export", "done at export"])
def test_an_export_that_names_no_stream_vouches_only_for_its_own_thread(pause: float) -> None:
    """A thread started before the producer's write (ordered after nothing of
    it) writes the same array later: named on every run. (An export that
    found the write done forgot it for every thread, and the write passed.)"""
    import time

    producer, other = cs.Stream(), cs.Stream()
    buf = sim.empty(1024, "float32")
    errors: list[Exception] = []

    def writer() -> None:
        time.sleep(0.6)  # (a sleep: no handoff the sanitizer sees)
        try:
            w(other, buf)
        except cs.HazardError as exc:
            errors.append(exc)

    th = threading.Thread(target=writer)
    th.start()
    _written_then_exported(producer, buf, pause)
    th.join(10)
    producer.synchronize()
    other.synchronize()
    assert len(errors) == 1 and "is not ordered after" in str(errors[0])


@pytest.mark.parametrize("then", ["a synchronize and a host read", "the next write", "a consume"])
def test_an_export_by_another_thread_leaves_what_is_ordered_after_the_write_alone(
    then: str,
) -> None:
    """Another thread reads the array's interface once the write is done (an
    export naming no stream); this thread is ordered after the write by its
    own synchronize, or waits for it with a consume: no hazard. (The export
    made the exporting thread the write's only witness, and these were named
    as not ordered after that thread.)"""
    import queue
    import time

    producer = cs.Stream()
    buf = sim.empty(1024, "float32")
    t = cs.track(buf)
    handed: queue.Queue[Any] = queue.Queue()

    def other() -> None:
        tt = handed.get()
        time.sleep(0.2)  # (the write is done by then)
        assert tt.__cuda_array_interface__["stream"] is None

    th = threading.Thread(target=other)
    th.start()
    with t.writing(producer):
        w(producer, buf, duration=0.05)
    handed.put(t)
    if then == "a consume":
        time.sleep(0.5)  # (after the export: timing only)
        cs.consume_blocking(t, timeout=10)
        buf.to_host()
    else:
        producer.synchronize()
        time.sleep(0.5)
        if then == "the next write":
            with t.writing(producer):
                w(producer, buf)
        else:
            buf.to_host()
    th.join(10)
    producer.synchronize()


@pytest.mark.parametrize("exports", ["one thread, twice", "two threads"])
def test_a_thread_ordered_after_the_first_of_two_exports_is_not_named(exports: str) -> None:
    """The write found done by two exports naming no stream; a worker is
    ordered after the first only (a queue): no hazard. (The second export's
    witness replaced the first's, and the worker was named.)"""
    import queue
    import time

    producer = cs.Stream()
    buf = sim.empty(1024, "float32")
    t = cs.track(buf)
    handed: queue.Queue[Any] = queue.Queue()
    errors: list[Exception] = []

    def worker() -> None:
        b = handed.get(timeout=10)
        time.sleep(0.3)  # (the second export happens meanwhile)
        try:
            b.to_host()
        except cs.HazardError as exc:
            errors.append(exc)

    def second() -> None:
        assert t.__cuda_array_interface__["stream"] is None

    th = threading.Thread(target=worker)
    th.start()
    with t.writing(producer):
        w(producer, buf, duration=0.05)
    time.sleep(0.2)  # (the write is done)
    assert t.__cuda_array_interface__["stream"] is None
    handed.put(buf)
    time.sleep(0.1)
    if exports == "two threads":
        other = threading.Thread(target=second)  # (started after: ordered after the
        other.start()  # first export too; its own export is the newer witness)
        other.join(10)
    else:
        second()
    th.join(10)
    producer.synchronize()
    assert not errors, errors


def test_the_legacy_stream_waits_for_a_gone_threads_per_thread_stream_after_a_sweep() -> None:
    """A worker thread writes on its per-thread stream (2) and ends; the
    sanitizer retires that stream (a sweep), and the legacy stream (1), which
    waits for every blocking stream's earlier work, reads the array: no
    hazard (the retired stream was dropped from the legacy rule)."""
    box: list[Any] = []

    def produce() -> None:
        x = sim.empty(4096, "float32")
        w(2, x, duration=0.2)
        box.append(x)

    th = threading.Thread(target=produce)
    th.start()
    th.join(10)
    _sanitizer._state.sweep()
    out = sim.empty(1, "float64")
    sim.launch(1, lambda o, x: o.fill(x.sum()), out, box[0], reads=[box[0]], writes=[out])
    assert out.to_host()[0] == 4096.0


def test_a_host_write_freed_by_a_collection_in_another_thread_is_no_hazard() -> None:
    """An array written on the host (``sim.asarray``) and dropped in a
    reference cycle; a garbage collection in another thread frees it, and that
    thread's next array takes the block: no hazard (the host write was over
    when its call returned, but the freeing thread was not ordered after it,
    and the reuse was named). A kernel's pending access stays named: the
    tests above."""
    import gc

    class Node:
        pass

    import time

    errors: list[Exception] = []
    go = [False]  # (a flag the sanitizer does not see: no ordering between the threads)
    ptrs: list[int] = []
    taken: list[Any] = []

    def other() -> None:
        deadline = time.monotonic() + 10
        while not go[0] and time.monotonic() < deadline:
            time.sleep(0.001)
        gc.collect()
        try:
            for _ in range(16):  # (until the pool hands out that block)
                taken.append(sim.asarray(np.zeros(64, np.int64)))
                if taken[-1].ptr == ptrs[0]:
                    break
        except cs.HazardError as exc:
            errors.append(exc)

    gc.disable()  # (the collection runs in the other thread)
    th = threading.Thread(target=other)
    th.start()  # (before the write: its start orders it after nothing of it)
    try:
        node = Node()
        node.self = node  # type: ignore[attr-defined]
        node.arr = sim.asarray(np.ones(64, np.int64))  # type: ignore[attr-defined]
        ptrs.append(node.arr.ptr)  # type: ignore[attr-defined]
        del node
        go[0] = True
        th.join(10)
    finally:
        gc.enable()
    assert not errors and taken[-1].ptr == ptrs[0], errors


class _RawPointer:
    """An interface over a raw pointer that keeps no owner alive (as a CuPy
    array over ``UnownedMemory``)."""

    def __init__(self, ptr: int, n: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (n,), "typestr": "<f4", "data": (ptr, False), "version": 3, "stream": None
        }  # fmt: skip


@pytest.mark.parametrize(
    "view",
    [
        "kept",
        "kept, its owner held on a stream",
        "kept, and another dropped",
        "kept, a kernel's read, another dropped",
        "kept, then a kernel's write, its owner held on that stream",
        "dropped",
        "dropped, after a kernel's read",
    ],
)
def test_a_block_freed_under_a_host_read_through_a_live_view_is_named(view: str) -> None:
    """The main thread consumes a raw-pointer alias of an array to the host;
    another thread, ordered after nothing of it, drops the array's last
    reference and takes its block: named while the main thread's view lives
    (it reads the new owner's data through it), also after a second read
    through a view dropped at once (which stands for the first); once every
    view is gone the read is over, and the reuse is no hazard."""
    import gc
    import time

    a = sim.asarray(np.ones(1024, np.float32))
    ptr = a.ptr
    box: list[Any] = [a]
    del a
    go, errors = [False], []

    def other() -> None:
        deadline = time.monotonic() + 10
        while not go[0] and time.monotonic() < deadline:  # (a flag the sanitizer does not see)
            time.sleep(0.001)
        box.clear()
        gc.collect()  # the array's block goes back to the pool, in this thread
        try:
            for _ in range(16):  # (until the pool hands out that block)
                box.append(sim.asarray(np.zeros(1024, np.float32)))
                if box[-1].ptr == ptr:
                    break
        except cs.HazardError as exc:
            errors.append(exc)

    if view == "dropped, after a kernel's read":  # (a stream's read the host's stands for)
        s = cs.Stream()
        r(s, box[0])
        s.synchronize()
    th = threading.Thread(target=other)
    th.start()
    got = cs.consume_blocking(_RawPointer(ptr, 1024))
    if view.endswith("held on a stream"):  # (the hold's release vouches for the stream's work)
        s = cs.Stream()
        r(s, box[0])
        cs.hold(box[0], until=s)
        s.synchronize()
        cs.stats()  # (the hold is released)
    if view.startswith("dropped"):
        del got
    elif "kernel's write" in view:  # (ordered after the host's read: a write does
        s = cs.Stream()  # not end a read through a live view; the hold's release
        w(s, box[0])  # vouches for the write)
        cs.hold(box[0], until=s)
        s.synchronize()
        cs.stats()
    elif view.endswith("another dropped"):
        if "kernel" in view:  # (ordered after the host's read: it stands for it)
            s = cs.Stream()
            r(s, box[0])
            s.synchronize()
        cs.consume_blocking(_RawPointer(ptr, 1024))
    go[0] = True
    th.join(10)
    if view.startswith("kept"):
        assert len(errors) == 1 and "freed and reused" in str(errors[0])
    else:
        assert not errors and box[-1].ptr == ptr, errors


def test_a_block_sim_empty_fills_is_not_a_write_later_work_is_ordered_after() -> None:
    """``sim.empty`` hands a new block to another thread through a flag the
    sanitizer does not see, which writes it on a stream: no hazard (on a GPU an
    allocation writes nothing; the fill is checked, not kept)."""
    import time

    box: list[Any] = []
    errors: list[Exception] = []

    def other() -> None:
        deadline = time.monotonic() + 10
        while not box and time.monotonic() < deadline:
            time.sleep(0.001)
        s = cs.Stream()
        try:
            w(s, box[0])
        except cs.HazardError as exc:
            errors.append(exc)
        s.synchronize()

    th = threading.Thread(target=other)
    th.start()
    box.append(sim.empty(1024, "float32"))
    th.join(10)
    assert not errors, errors


def test_a_view_consumed_again_and_again_is_one_view_of_its_read() -> None:
    """One view consumed to the host in a loop: its read carries that view
    once (a copy of its weakref per consume piled up: each consume slower)."""
    x = sim.asarray(np.ones(1024, np.float32))
    v = cs.consume_blocking(x)
    for _ in range(200):
        assert cs.consume_blocking(v) is v
    reads = [
        r
        for seg in _sanitizer._state.shadows.cover(x.ptr, x.ptr + 4096)
        for r in seg.reads.values()
    ]
    assert [len(r.until or ()) for r in reads] == [1]


def test_a_consume_that_did_not_know_of_the_work_says_so() -> None:
    """A slice of a tracked array is another, untracked array, whose interface
    names no stream: its consume does not wait for the tracked write, and the
    sanitizer names the host's read. The fix says why (it advised the very
    ``consume`` call that raised)."""
    s = cs.Stream()
    a = sim.empty(100, "float32")
    t = cs.track(a)
    with t.writing(s):
        w(s, a, duration=0.05)
    with pytest.raises(cs.HazardError, match="the consume did not know of that work"):
        cs.consume_blocking(a[0:10], timeout=5)
    s.synchronize()
