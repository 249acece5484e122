"""The simulated device's own rules: memory, kernels, errors, default streams."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

import cai_streams as cs
from cai_streams import sim

from .device_ops import SimOps


@pytest.fixture(autouse=True)
def _sim() -> None:
    cs.use_backend("sim")


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
    with pytest.raises(ValueError, match="duration"):
        sim.launch(s, print, duration=-1)
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


def test_failing_kernel_surfaces_at_the_next_synchronize() -> None:
    ops = SimOps()
    s = cs.Stream()
    ops.fail(s)
    after = s.record()
    x = ops.array(np.zeros(2, np.float32))
    ops.fill(s, x, 4.0)  # later kernels still run
    with pytest.raises(cs.KernelError, match="'broken'.*ZeroDivisionError: boom") as info:
        s.synchronize()
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    assert info.value.name == "cudaErrorLaunchFailure" and isinstance(info.value, cs.CudaError)
    s.synchronize()  # reported once, then cleared
    np.testing.assert_array_equal(x.to_host(), 4.0)
    for _ in range(2):  # events recorded after the failure keep reporting it
        with pytest.raises(cs.KernelError):
            after.synchronize()
        with pytest.raises(cs.KernelError):
            _ = after.is_done
    assert s.record().is_done in (True, False)
    s.synchronize()


def test_errors_do_not_cross_streams() -> None:
    ops = SimOps()
    a, b = cs.Stream(), cs.Stream()
    ops.fail(a)
    b.wait(a.record())
    b.synchronize()
    with pytest.raises(cs.KernelError):
        a.synchronize()


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
