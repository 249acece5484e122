"""The simulated device's own rules: memory, kernels, errors, default streams."""

from __future__ import annotations

import gc
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import cai_streams as cs
from cai_streams import sim

from .device_ops import SimOps

WAIT = 10.0  # seconds: a bound on a join here


@pytest.fixture(autouse=True)
def _sim() -> Iterator[None]:
    cs.use_backend("sim")
    yield
    for device in range(sim.device().device_count()):  # a failed test leaves no poison
        sim.reset(device)


def test_asarray_round_trip_and_alignment() -> None:
    host = np.arange(24, dtype=np.int16).reshape(4, 6)
    a = sim.asarray(host)
    assert a.ptr % 256 == 0
    np.testing.assert_array_equal(a.to_host(), host)
    cai = a.__cuda_array_interface__
    assert cai["data"] == (a.ptr, False) and cai["shape"] == (4, 6) and cai["version"] == 3
    assert cai["strides"] is None and cai["typestr"] == "<i2" and cai["stream"] is None


def test_empty_is_not_zeroed() -> None:
    a = sim.empty((16,), "uint8")
    assert (a.to_host() != 0).all()


def test_zero_size_array() -> None:
    a = sim.empty((0, 3))
    assert a.ptr == 0 and a.__cuda_array_interface__["data"] == (0, False)
    assert a.to_host().shape == (0, 3)


@pytest.mark.parametrize("shape", [-1, (2, -2), (1.5,), (True,)])
def test_empty_rejects_bad_shapes(shape: Any) -> None:
    with pytest.raises(ValueError, match="non-negative ints"):
        sim.empty(shape)
    with pytest.raises(TypeError, match="int or a tuple"):
        sim.empty(1.5)  # type: ignore[arg-type]


def test_kernels_see_zero_copy_views_of_slices() -> None:
    s = cs.Stream()
    a = sim.asarray(np.zeros((4, 4), np.float32))

    def set_value(x: np.ndarray[Any, Any], v: float) -> None:
        x[...] = v

    sim.launch(s, set_value, a[1:3, ::2], 5.0, writes=[a])
    s.synchronize()
    expected = np.zeros((4, 4), np.float32)
    expected[1:3, ::2] = 5
    np.testing.assert_array_equal(a.to_host(), expected)
    view = a[::-1]
    assert view.strides[0] < 0
    sim.launch(s, set_value, view, 1.0)
    s.synchronize()
    np.testing.assert_array_equal(a.to_host(), 1.0)


def test_launch_rejects_bad_input() -> None:
    s = cs.Stream()
    with pytest.raises(TypeError, match="callable"):
        sim.launch(s, 42)  # type: ignore[arg-type]
    for bad in (-1, math.nan, math.inf, 1e300, 86400.5):  # (a worker sleeps it: at most a day)
        with pytest.raises(ValueError, match="duration"):
            sim.launch(s, print, duration=bad)
    with pytest.raises(TypeError, match="duration"):
        sim.launch(s, print, duration="1")  # type: ignore[arg-type]
    device = sim.device()
    for bad in (-1, math.inf, 1e300):
        with pytest.raises(ValueError, match="jitter"):
            device.jitter = bad
        with pytest.raises(ValueError, match="jitter"):
            with sim.simulated(jitter=bad):
                pass
    with pytest.raises(TypeError, match="jitter"):
        device.jitter = True
    done = s.record()  # the stream's worker is alive: it runs what comes next
    done.synchronize()
    with pytest.raises(TypeError, match="device arrays"):
        sim.launch(s, print, reads=[np.zeros(3)])
    with pytest.raises(ValueError, match="not a stream of the simulated device"):
        sim.launch(0x999, print)
    with pytest.raises(ValueError, match="not in simulated device memory"):
        sim.launch(s, print, cs.read_interface(_ForeignArray()))


def test_memory_is_found_by_pointer_while_the_array_lives() -> None:
    """A kernel argument that is only an interface (a view, another library's
    object) reaches the same memory, as long as the array that owns it lives."""
    a = sim.asarray(np.arange(64, dtype="float32"))
    s = cs.Stream()

    def double(x: np.ndarray[Any, Any]) -> None:
        x *= 2

    part = cs.read_interface(a[8:16])
    sim.launch(s, double, part, writes=[part])
    s.synchronize()
    expected = np.arange(64, dtype="float32")
    expected[8:16] *= 2
    assert (a.to_host() == expected).all()
    stale = {"shape": (64,), "typestr": "<f4", "data": (a.ptr, False), "version": 3}
    del a, part
    gc.collect()
    with pytest.raises(ValueError, match="not in simulated device memory"):
        sim.launch(
            s, double, cs.read_interface(type("Freed", (), {"__cuda_array_interface__": stale})())
        )


class _ForeignArray:
    __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (64, False), "version": 3}


def test_a_failed_kernel_poisons_its_device_until_reset() -> None:
    """The sim's side of the sticky-fault rule (tests/test_conformance_faults.py
    states it over both backends): what runs and what does not after a fault."""
    ops = SimOps()
    s = cs.Stream()
    x = ops.array(np.zeros(2, np.float32))
    ops.fail(s)
    ops.fill(s, x, 4.0)  # enqueued after the failure: never runs
    with pytest.raises(cs.KernelError, match="'broken'.*ZeroDivisionError: boom") as info:
        s.synchronize()
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    assert info.value.name == "cudaErrorLaunchFailure" and isinstance(info.value, cs.CudaError)
    for _ in range(2):  # sticky: every later call on the device raises
        with pytest.raises(cs.KernelError):
            s.synchronize()
        with pytest.raises(cs.KernelError):
            ops.fill(s, x, 5.0)
        with pytest.raises(cs.KernelError):
            cs.Stream()
        with pytest.raises(cs.KernelError):
            sim.empty(4)
    sim.reset()
    np.testing.assert_array_equal(ops.to_host(x), 0.0)  # the fill never ran
    with cs.sanitize(False):  # it saw the fill that never ran, and no sync after it
        ops.fill(s, x, 6.0)
    s.synchronize()
    np.testing.assert_array_equal(ops.to_host(x), 6.0)


def test_a_fault_is_reported_by_every_call_once_it_happened() -> None:
    """No synchronize needed: once the kernel has faulted, a record, a wait,
    a launch, an allocation and a new stream raise, as the driver's calls do
    once it has noticed (the simulator notices at once). Before the fault
    happened (the failing kernel latched), the same calls succeed."""
    ops = SimOps()
    backend = sim.device()
    s, other = cs.Stream(), cs.Stream()
    x = ops.array(np.zeros(2, np.float32))
    event = backend.create_event()
    try:
        latch = ops.latch(s)
        ops.fail(s)
        backend.record(event, other.handle)  # the control: not failed yet
        backend.stream_wait_event(other.handle, event)
        deadline = time.monotonic() + 10
        latch.release()
        while sim.device()._device(0).fault is None:  # the worker ran it
            assert time.monotonic() < deadline
            time.sleep(0.001)
        with pytest.raises(cs.KernelError):
            backend.record(event, other.handle)
        with pytest.raises(cs.KernelError):
            backend.stream_wait_event(other.handle, event)
        with pytest.raises(cs.KernelError):
            ops.fill(other, x, 1.0)
        with pytest.raises(cs.KernelError):
            sim.empty(4)
        with pytest.raises(cs.KernelError):
            cs.Stream()
    finally:
        sim.reset()
        backend.destroy_event(event)


def test_kernels_enqueued_before_a_reset_never_run() -> None:
    ops = SimOps()
    s = cs.Stream()
    x = ops.array(np.zeros(2, np.float32))
    latch = ops.latch(s)
    ops.fill(s, x, 1.0)
    sim.reset()  # as cudaDeviceReset: the queued work is abandoned
    latch.release()
    s.synchronize()  # marks still complete: nothing waits forever
    np.testing.assert_array_equal(ops.to_host(x), 0.0)


def test_a_fault_stays_on_its_device() -> None:
    ops = SimOps()
    if sim.device().device_count() < 2:
        pytest.skip("needs two simulated devices (CAI_STREAMS_SIM_DEVICES >= 2)")
    backend = sim.device()
    other = cs.Stream.wrap(backend.create_stream(device=1))
    try:
        failing = cs.Stream()
        ops.fail(failing)
        with pytest.raises(cs.KernelError):
            failing.synchronize()
        x = sim.asarray(np.zeros(2, np.float32), device=1)
        ops.fill(other, x, 3.0)
        other.synchronize()  # device 1 is not poisoned by device 0's fault
        np.testing.assert_array_equal(ops.to_host(x), 3.0)
        with pytest.raises(cs.KernelError):
            cs.Stream.wrap(1).synchronize()  # device 0 still is
    finally:
        backend.destroy_stream(other.handle)
        sim.reset(0)


def test_legacy_stream_waits_for_per_thread_default_stream() -> None:
    ops = SimOps()
    ptds, legacy = cs.Stream.wrap(2), cs.Stream.wrap(1)
    x = ops.array(np.zeros(4, np.float32))
    latch = ops.latch(ptds)
    ops.fill(ptds, x, 3.0)
    ops.add(legacy, x, 1.0)  # implicitly after the per-thread stream's work
    done = legacy.record()
    assert not done.is_done
    latch.release()
    done.synchronize()
    np.testing.assert_array_equal(x.to_host(), 4.0)


def test_non_blocking_streams_do_not_sync_with_legacy() -> None:
    ops = SimOps()
    mine, legacy = cs.Stream(), cs.Stream.wrap(1)
    latch = ops.latch(mine)
    x = ops.array(np.zeros(4, np.float32))
    ops.fill(legacy, x, 9.0)
    legacy.synchronize()  # would hang behind the latch if 'mine' were blocking
    latch.release()
    np.testing.assert_array_equal(x.to_host(), 9.0)


def test_to_host_without_sync_reads_stale_data() -> None:
    """to_host() copies on the legacy stream: work on a non-blocking stream
    is not waited for, as with cudaMemcpy on a real device."""
    ops = SimOps()
    s = cs.Stream()
    x = ops.array(np.zeros(4, np.float32))
    latch = ops.latch(s)
    ops.fill(s, x, 1.0)
    with cs.sanitize(False):  # racy on purpose (the sanitizer's catalogue flags it)
        np.testing.assert_array_equal(x.to_host(), 0.0)
    latch.release()
    s.synchronize()
    np.testing.assert_array_equal(x.to_host(), 1.0)
    np.testing.assert_array_equal(x.to_host(stream=s), 1.0)


def test_seed_and_jitter_come_from_the_environment() -> None:
    code = "from cai_streams import sim; d = sim.device(); print(d.seed, d.jitter)"
    env = {**os.environ, "CAI_STREAMS_SIM_SEED": "1234", "CAI_STREAMS_SIM_JITTER": "0.003"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.split() == ["1234", "0.003"]


@pytest.mark.parametrize("raw", ["-1", "nan", "inf", "1e300", "86401"])
def test_a_jitter_from_the_environment_past_a_day_is_named(
    raw: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cai_streams import _config

    monkeypatch.setenv("CAI_STREAMS_SIM_JITTER", raw)
    with pytest.raises(ValueError, match="CAI_STREAMS_SIM_JITTER.*from 0 to 86400"):
        _config.sim_jitter(0.0005)


def test_interpreter_exits_cleanly_with_work_in_flight() -> None:
    code = (
        "import cai_streams as cs, numpy as np\n"
        "from cai_streams import sim\n"
        "cs.use_backend('sim')\n"  # simulated kernels, whatever the default backend
        "s = cs.Stream(); a = sim.asarray(np.zeros(3))\n"
        "for _ in range(50): sim.launch(s, lambda x: None, a, duration=0.001)\n"
        "print('bye')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "bye" and out.stderr == ""


def test_destructors_running_under_the_backend_lock_do_not_deadlock() -> None:
    """A garbage collection can run Stream/Event destructors on a thread that
    already holds the backend's lock (it happened inside create_stream)."""
    import gc
    import threading

    backend = sim.device()

    def collect_under_lock() -> None:
        s = cs.Stream()
        cycle: list[object] = [s.record(), s]
        cycle.append(cycle)  # only the cycle collector frees these
        del s, cycle
        with backend._lock, backend.memory._lock:
            gc.collect()

    worker = threading.Thread(target=collect_under_lock, daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "a destructor deadlocked on the backend lock"


def test_per_thread_default_streams_are_reclaimed_with_their_thread() -> None:
    """500 short-lived threads touching handle 2 leave no worker behind, and the
    legacy stream does not wait on 500 idle streams afterwards."""
    backend = sim.device()
    device = backend._devices[0]
    x = sim.asarray(np.zeros(4, np.float32))
    before = _fastest_to_host(x)  # (its stream's worker counted below)
    before_threads = threading.active_count()
    before_blocking = len(device.blocking)

    def touch() -> None:
        s = cs.Stream.wrap(2)
        sim.launch(s, lambda: None)
        s.synchronize()

    for _ in range(5):
        threads = [threading.Thread(target=touch) for _ in range(100)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
    gc.collect()
    deadline = time.monotonic() + 10
    while (
        threading.active_count() > before_threads or len(device.blocking) > before_blocking
    ) and time.monotonic() < deadline:  # (a thread's stream goes just after the thread)
        time.sleep(0.01)
    assert threading.active_count() <= before_threads
    assert len(device.blocking) == before_blocking
    after = _fastest_to_host(x)  # (a legacy-stream synchronize)
    assert after < 20 * before, (after, before)  # was 94 ms with 500 leaked streams


def _fastest_to_host(x: sim.SimArray) -> float:
    """The fastest of ten ``to_host`` calls, in seconds."""
    best = float("inf")
    for _ in range(10):
        start = time.perf_counter()
        x.to_host()
        best = min(best, time.perf_counter() - start)
    return best


def test_a_destroyed_streams_worker_drains_and_ends() -> None:
    backend = sim.device()
    s = cs.Stream()
    worker = backend._streams[s.handle]._thread
    assert worker is not None and worker.is_alive()
    done: list[int] = []
    sim.launch(s, lambda: done.append(1), duration=0.01)
    s.close()
    worker.join(5)
    assert not worker.is_alive() and done == [1]


def test_destroyed_handles_are_handed_out_again() -> None:
    """Streams, events and graphs: the next create of the kind gets the handle
    of the last one destroyed (CUDA recycles addresses; an H100 reused a
    stream's at once, its events' later)."""
    backend = sim.device()
    stream = backend.create_stream()
    backend.destroy_stream(stream)
    assert backend.create_stream() == stream
    event = backend.create_event()
    backend.destroy_event(event)
    assert backend.create_event() == event
    backend.destroy_event(event)
    backend.destroy_stream(stream)


def test_each_device_has_its_own_memory_and_arrays_know_it() -> None:
    backend = sim.device()
    if backend.device_count() < 2:
        pytest.skip("needs two simulated devices (CAI_STREAMS_SIM_DEVICES >= 2)")
    a = sim.empty(16, device=0)
    b = sim.asarray(np.arange(16, dtype="float32"), device=1)
    assert (a.device, b.device, b[2:].device) == (0, 1, 1)
    assert backend.pointer_device(a.ptr) == 0 and backend.pointer_device(b.ptr + 8) == 1
    with pytest.raises(ValueError, match="not simulated device memory"):
        backend.pointer_device(np.zeros(4).ctypes.data)
    backend.set_device(1)
    try:
        assert sim.empty(4).device == 1  # the current device is the default
    finally:
        backend.set_device(0)
    with pytest.raises(cs.CudaError, match="cudaErrorInvalidDevice"):
        sim.empty(4, device=backend.device_count())


def test_the_pool_is_per_device_and_reset_releases_its_cached_blocks() -> None:
    backend = sim.device()
    a = sim.empty(100, device=0)
    ptr = a.ptr
    del a
    if backend.device_count() > 1:
        assert sim.empty(100, device=1).ptr != ptr  # another device's pool
    again = sim.empty(100, device=0)
    assert again.ptr == ptr  # the freed block, at once
    del again
    assert backend.memory.cached(0) >= 1
    sim.reset(0)
    assert backend.memory.cached(0) == 0
    with pytest.raises(ValueError):
        backend.pointer_device(ptr)  # released: no longer device memory


def test_the_number_of_devices_comes_from_the_environment() -> None:
    code = "from cai_streams import sim; print(sim.device().device_count())"
    for value, expected in (("", "2"), ("1", "1"), ("3", "3")):
        env = {**os.environ, "CAI_STREAMS_SIM_DEVICES": value}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
        )
        assert out.stdout.strip() == expected, out.stderr
    env = {**os.environ, "CAI_STREAMS_SIM_DEVICES": "0"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert "CAI_STREAMS_SIM_DEVICES='0'" in out.stderr


def test_graph_replay_runs_unordered_branches_in_varying_orders() -> None:
    """Two captured branches the program never ordered: replays interleave them
    differently, as concurrent branches would on a GPU, so a missing join in a
    captured graph shows as wrong data rather than passing by luck."""
    backend = sim.device()
    s = cs.Stream()
    other = cs.Stream()
    seen: list[str] = []
    event = backend.create_event()
    with cs.sanitize(False):  # raw backend calls: this checks the simulator alone
        backend.begin_capture(s.handle, "global")
        backend.record(event, s.handle)
        backend.stream_wait_event(other.handle, event)  # fork
        for i in range(4):
            sim.launch(s, lambda i=i: seen.append(f"a{i}"))
            sim.launch(other, lambda i=i: seen.append(f"b{i}"))
        backend.record(event, other.handle)
        backend.stream_wait_event(s.handle, event)  # join
        graph = backend.end_capture(s.handle)
        graph_exec = backend.instantiate_graph(graph)
        orders = set()
        for _ in range(20):
            seen.clear()
            backend.launch_graph(graph_exec, s.handle)
            s.synchronize()
            assert [x for x in seen if x[0] == "a"] == ["a0", "a1", "a2", "a3"]  # stream order
            assert [x for x in seen if x[0] == "b"] == ["b0", "b1", "b2", "b3"]
            orders.add(tuple(seen))
    assert len(orders) > 1
    backend.destroy_graph_exec(graph_exec)
    backend.destroy_graph(graph)
    backend.destroy_event(event)


def test_a_capture_begun_during_a_record_comes_wholly_before_or_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another thread begins a capture on the stream while a record is being
    enqueued there. The record lands in the capture, as on the driver (or
    before it), never in between: the simulator used to hand the record's mark
    to the capture, which dropped it, and the event never completed."""
    backend = cs.use_backend("sim")
    s = cs.Stream()
    event = backend.create_event()
    real = backend._enqueue  # type: ignore[attr-defined]
    others: list[threading.Thread] = []

    def begin_meanwhile(stream: Any, *ops: Any) -> None:
        monkeypatch.setattr(backend, "_enqueue", real)
        other = threading.Thread(target=backend.begin_capture, args=(s.handle, "relaxed"))
        other.start()
        other.join(WAIT)  # the capture begins between the check and the enqueue
        others.append(other)
        real(stream, *ops)

    monkeypatch.setattr(backend, "_enqueue", begin_meanwhile)
    try:
        backend.record(event, s.handle)
        others[0].join(10)
        assert not others[0].is_alive()
        backend.destroy_graph(backend.end_capture(s.handle))
        s.synchronize()
        with pytest.raises(cs.CudaError, match="last recorded in a capture that has ended"):
            backend.query(event)  # (a lost record was never complete: False)
    finally:
        backend.destroy_event(event)


def test_a_record_whose_capture_ends_as_it_is_made_lands_on_the_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The capture a record found ends before the record reaches it (another
    thread's, relaxed): the simulator records on the stream, as the driver
    would; it raised cudaErrorIllegalState ("stopped capturing meanwhile")."""
    backend = cs.use_backend("sim")
    s = cs.Stream()
    event = backend.create_event()
    backend.begin_capture(s.handle, "relaxed")
    rules = backend._captures  # type: ignore[attr-defined]
    real = rules.record_event

    def ends_first(ev: Any, stream: Any) -> None:
        monkeypatch.setattr(rules, "record_event", real)
        backend.destroy_graph(backend.end_capture(s.handle))
        real(ev, stream)

    monkeypatch.setattr(rules, "record_event", ends_first)
    try:
        backend.record(event, s.handle)
        s.synchronize()
        assert backend.query(event)
    finally:
        backend.destroy_event(event)


def test_host_view_reads_what_a_consume_handed_over() -> None:
    """``sim.host_view`` is the public way to read a consumed view on the
    host (the examples used the private helper): the memory itself, no copy."""
    s = cs.Stream()
    out = sim.empty(8, "float32")
    out.stream = s.handle
    sim.launch(s, lambda x: x.fill(3.0), out, writes=[out], duration=0.01)
    view = cs.consume_blocking(out, timeout=20)
    got = sim.host_view(view)
    np.testing.assert_array_equal(got, 3.0)
    assert np.shares_memory(got, sim.host_view(out))  # (the same memory, not a copy)
    with pytest.raises(TypeError, match="no __cuda_array_interface__"):
        sim.host_view(object())
    readonly = cs.read_interface(out)
    interface = dict(readonly.__cuda_array_interface__, data=(out.ptr, True))
    ro = cs.consume_blocking(type("RO", (), {"__cuda_array_interface__": interface})())
    assert ro.readonly and not sim.host_view(ro).flags.writeable


def test_a_kernel_running_when_another_faults_is_aborted_with_it() -> None:
    """A kernel still running (its duration not over) when a kernel of another
    stream faults is aborted with the device's work, as a GPU's context is torn
    down: its body never runs, neither during the fault nor after a reset (it
    wrote its data after the reset, into what the library had let go by then).
    Control: with no fault, the same kernel writes."""
    ops = SimOps()
    for fault in (False, True):
        slow, culprit = cs.Stream(), cs.Stream()
        x = ops.array(np.zeros(2, np.float32))
        with cs.sanitize(False):
            sim.launch(slow, lambda a: a.fill(9.0), x, writes=[x], duration=0.3)
        time.sleep(0.05)  # (it is running)
        if fault:
            ops.fail(culprit)
            with pytest.raises(cs.KernelError):
                culprit.synchronize()
            sim.reset()
        time.sleep(0.4)  # (past its end)
        np.testing.assert_array_equal(sim.host_view(x), 9.0 if not fault else 0.0)
