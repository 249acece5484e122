"""Backend.launch_host_func on every backend: a C function called at its place
in the stream's order. Two libc functions: ``sem_post``, so whether and how
often a function ran is read back from a semaphore; and ``close`` on a pipe's
write end, the doorbell's building block, read back as end-of-file."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import pytest

import cai_streams as cs
from cai_streams import sim
from cai_streams._doorbell import _close_address, _has_fired, _pipe

from .device_ops import DeviceOps


class _Libc:
    """libc's sem_post, and a way to count its calls."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        self.sem_init = libc.sem_init
        self.sem_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
        self.sem_trywait = libc.sem_trywait
        self.sem_trywait.argtypes = [ctypes.c_void_p]
        self.post_address: int = ctypes.cast(libc.sem_post, ctypes.c_void_p).value or 0


class _Semaphore:
    def __init__(self, libc: _Libc) -> None:
        self.buffer = ctypes.create_string_buffer(64)  # sizeof(sem_t) is at most 32 on glibc
        self.address = ctypes.addressof(self.buffer)
        assert libc.sem_init(self.address, 0, 0) == 0

    def take_all(self, libc: _Libc) -> int:
        n = 0
        while libc.sem_trywait(self.address) == 0:
            n += 1
        return n


@pytest.fixture
def libc() -> _Libc:
    try:
        return _Libc()
    except (OSError, AttributeError) as exc:
        pytest.skip(f"no POSIX semaphores here: {exc}")


def test_a_closing_host_function_ends_the_pipe_only_after_the_work_before_it(
    ops: DeviceOps, backend: cs.Backend
) -> None:
    close = _close_address()
    if not close:
        pytest.skip("no libc close() here")
    rfd, wfd = _pipe()
    s = cs.Stream()
    latch = ops.latch(s)
    try:
        backend.launch_host_func(s.handle, close, wfd)
        assert not _has_fired(rfd)  # held behind the latched kernel
    finally:
        latch.release()
    s.synchronize()
    try:
        assert _has_fired(rfd)
        with pytest.raises(OSError):
            os.fstat(wfd)  # the host function closed it (nothing reused the number here)
    finally:
        os.close(rfd)


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
