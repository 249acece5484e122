"""Backend.launch_host_func on every backend: a C function called at its place
in the stream's order (the doorbell's building block). The function is libc's
``sem_post``, so whether and how often it ran is read back from a semaphore."""

from __future__ import annotations

import pytest

import cai_streams as cs
from cai_streams import sim
from cai_streams._doorbell import _Libc, _Semaphore

from .device_ops import DeviceOps


@pytest.fixture
def libc() -> _Libc:
    try:
        return _Libc()
    except (OSError, AttributeError) as exc:
        pytest.skip(f"no POSIX semaphores here: {exc}")


def test_a_host_function_runs_once_after_the_work_before_it(
    ops: DeviceOps, backend: cs.Backend, libc: _Libc
) -> None:
    sem = _Semaphore(libc)
    s = cs.Stream()
    latch = ops.latch(s)
    try:
        backend.launch_host_func(s.handle, libc.post_address, sem.address)
        assert sem.take_all(libc) == 0  # held behind the latched kernel
    finally:
        latch.release()
    s.synchronize()
    assert sem.take_all(libc) == 1


def test_a_host_function_never_runs_after_a_fault(libc: _Libc) -> None:
    backend = cs.use_backend("sim")
    sem = _Semaphore(libc)
    s = cs.Stream()
    sim.launch(s, lambda: None)
    backend.launch_host_func(s.handle, libc.post_address, sem.address)  # control: runs
    sim.launch(s, lambda: 1 / 0, name="broken")
    backend.launch_host_func(s.handle, libc.post_address, sem.address)
    with pytest.raises(cs.KernelError):
        s.synchronize()
    sim.reset()
    assert sem.take_all(libc) == 1


def test_a_captured_host_function_is_a_node_of_the_graph(backend: cs.Backend, libc: _Libc) -> None:
    sem = _Semaphore(libc)
    s = cs.Stream()
    backend.begin_capture(s.handle, "thread_local")
    backend.launch_host_func(s.handle, libc.post_address, sem.address)
    graph = backend.end_capture(s.handle)
    assert sem.take_all(libc) == 0  # recorded, not run
    graph_exec = backend.instantiate_graph(graph)
    try:
        for _ in range(2):
            backend.launch_graph(graph_exec, s.handle)
        s.synchronize()
    finally:
        backend.destroy_graph_exec(graph_exec)
        backend.destroy_graph(graph)
    assert sem.take_all(libc) == 2


def test_bad_arguments_are_refused() -> None:
    backend = cs.use_backend("sim")
    s = cs.Stream()
    with pytest.raises(TypeError):
        backend.launch_host_func(s.handle, "sem_post", 0)  # type: ignore[arg-type]
    with pytest.raises(cs.CudaError):
        backend.launch_host_func(s.handle, 0, 0)
