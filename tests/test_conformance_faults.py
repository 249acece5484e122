"""Conformance: a device-side fault is sticky.

A kernel that fails poisons its device: the next synchronizing call on that
device, for any of its streams or events, reports it, and so does every call
after it; waiters anywhere see it. On a GPU the fault lasts until the process
ends (cudaDeviceReset at best), so these rules are shown on the simulator only
and skipped on cuda: one failing kernel would poison the rest of the run.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest

import cai_streams as cs
from cai_streams import sim

from .device_ops import DeviceOps


@pytest.fixture
def faulty(ops: DeviceOps) -> Iterator[DeviceOps]:
    if ops.name == "cuda":  # before any latch or kernel
        pytest.skip("cuda: a device-side fault would poison the CUDA context for the whole run")
    try:
        with cs.sanitize(False):  # work after a fault never runs: the sanitizer cannot know
            yield ops
    finally:
        sim.reset()


def test_the_next_synchronizing_call_on_the_device_reports_the_fault(
    faulty: DeviceOps, backend: cs.Backend
) -> None:
    failing, bystander = cs.Stream(), cs.Stream()
    event = backend.create_event()
    try:
        backend.record(event, bystander.handle)  # complete before the fault
        backend.synchronize_event(event)
        faulty.fail(failing)
        with pytest.raises(cs.KernelError) as info:
            failing.synchronize()
        assert (info.value.code, info.value.name) == (719, "cudaErrorLaunchFailure")
        # sticky: every call on the device now reports it, whatever the stream
        with pytest.raises(cs.KernelError):
            bystander.synchronize()
        with pytest.raises(cs.KernelError):
            backend.query(event)
        with pytest.raises(cs.KernelError):
            backend.record(event, bystander.handle)
        with pytest.raises(cs.KernelError):
            backend.create_stream()
        with pytest.raises(cs.KernelError):
            failing.synchronize()
    finally:
        backend.destroy_event(event)


def test_waiters_on_other_streams_see_the_fault(faulty: DeviceOps, backend: cs.Backend) -> None:
    failing, held = cs.Stream(), cs.Stream()
    event = backend.create_event()
    seen: list[BaseException] = []

    def wait() -> None:
        try:
            backend.synchronize_event(event)
        except cs.CudaError as exc:
            seen.append(exc)

    try:
        latch = faulty.latch(held)
        backend.record(event, held.handle)
        waiter = threading.Thread(target=wait)
        waiter.start()
        faulty.fail(failing)
        with pytest.raises(cs.KernelError):
            failing.synchronize()
        latch.release()
        waiter.join(20)
        assert len(seen) == 1 and isinstance(seen[0], cs.KernelError)
    finally:
        backend.destroy_event(event)


def test_work_enqueued_after_the_fault_never_runs(faulty: DeviceOps, backend: cs.Backend) -> None:
    s = cs.Stream()
    x = faulty.array(np.zeros(4, np.float32))
    faulty.fail(s)
    faulty.fill(s, x, 1.0)
    with pytest.raises(cs.KernelError):
        s.synchronize()
    np.testing.assert_array_equal(faulty.to_host(x), 0.0)
