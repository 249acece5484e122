"""Conformance: devices, as the driver has them.

Each host thread has a current device (0 until it sets one), streams and
events belong to a device, an event is recorded only on streams of its device,
and a stream may wait on another device's event. Rules that need two devices
are skipped, with the reason, where the backend has one (a one-GPU machine;
the simulator under ``CAI_STREAMS_SIM_DEVICES=1``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import numpy as np
import pytest

import cai_streams as cs

from .device_ops import DeviceOps

T = TypeVar("T")


def _needs_two(backend: cs.Backend) -> None:
    if backend.device_count() < 2:
        pytest.skip(f"{backend.name}: one device; the rule needs two")


def _in_thread(fn: Callable[[], T]) -> T:
    out: list[T] = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join(30)
    assert out, "the other thread failed or did not finish"
    return out[0]


@contextmanager
def _on_device(backend: cs.Backend, device: int) -> Iterator[None]:
    previous = backend.current_device()
    backend.set_device(device)
    try:
        yield
    finally:
        backend.set_device(previous)


def test_every_host_thread_starts_on_device_0(backend: cs.Backend) -> None:
    assert backend.device_count() >= 1
    assert _in_thread(backend.current_device) == 0


def test_set_device_is_per_thread(backend: cs.Backend) -> None:
    _needs_two(backend)
    before = backend.current_device()

    def elsewhere() -> tuple[int, int]:
        backend.set_device(1)
        return backend.current_device(), backend.stream_device(2)

    assert _in_thread(elsewhere) == (1, 1)
    assert backend.current_device() == before


def test_a_device_that_does_not_exist_is_invalid_device(backend: cs.Backend) -> None:
    before = backend.current_device()
    with pytest.raises(cs.CudaError) as info:
        backend.set_device(backend.device_count())
    assert (info.value.code, info.value.name) == (101, "cudaErrorInvalidDevice")
    assert backend.current_device() == before


def test_a_stream_belongs_to_the_device_it_was_made_on(backend: cs.Backend) -> None:
    before = backend.current_device()
    for device in range(min(backend.device_count(), 2)):
        stream = backend.create_stream(device=device)
        try:
            assert backend.stream_device(stream) == device
            assert backend.current_device() == before  # made there, and restored
        finally:
            backend.destroy_stream(stream)
    stream = backend.create_stream()
    assert backend.stream_device(stream) == before
    backend.destroy_stream(stream)


def test_the_default_streams_are_the_current_devices(backend: cs.Backend) -> None:
    current = backend.current_device()
    assert backend.stream_device(1) == backend.stream_device(2) == current
    if backend.device_count() > 1:
        with _on_device(backend, 1):
            assert backend.stream_device(1) == backend.stream_device(2) == 1


def test_an_event_is_recorded_only_on_streams_of_its_device(backend: cs.Backend) -> None:
    _needs_two(backend)
    mine, theirs = backend.create_stream(device=0), backend.create_stream(device=1)
    event = backend.create_event(device=0)
    try:
        backend.record(event, mine)
        with pytest.raises(cs.CudaError) as info:
            backend.record(event, theirs)
        assert info.value.name == "cudaErrorInvalidResourceHandle"
        other = backend.create_event(device=1)
        backend.record(other, theirs)  # an event made on device 1 is
        backend.synchronize_event(other)
        backend.destroy_event(other)
    finally:
        backend.destroy_event(event)
        backend.destroy_stream(mine)
        backend.destroy_stream(theirs)


def test_a_stream_may_wait_on_another_devices_event(ops: DeviceOps, backend: cs.Backend) -> None:
    _needs_two(backend)
    producer = cs.Stream.wrap(backend.create_stream(device=0))
    consumer = backend.create_stream(device=1)
    produced, consumed = backend.create_event(device=0), backend.create_event(device=1)
    try:
        with _on_device(backend, 0):
            latch = ops.latch(producer)
        backend.record(produced, producer.handle)
        backend.stream_wait_event(consumer, produced)
        backend.record(consumed, consumer)
        assert backend.query(consumed) is False  # held by device 0's work
        latch.release()
        backend.synchronize_event(consumed)
    finally:
        backend.destroy_event(produced)
        backend.destroy_event(consumed)
        backend.destroy_stream(producer.handle)
        backend.destroy_stream(consumer)


def test_the_device_of_a_pointer(ops: DeviceOps, backend: cs.Backend) -> None:
    x = ops.array(np.zeros(64, np.float32))
    ptr = cs.read_interface(x).ptr
    assert backend.pointer_device(ptr) == backend.current_device()
    assert backend.pointer_device(ptr + 4 * 63) == backend.current_device()
    host = np.zeros(64, np.float32)
    with pytest.raises(ValueError, match="not .*device memory"):
        backend.pointer_device(host.ctypes.data)
    if backend.device_count() > 1:
        with _on_device(backend, 1):
            y = ops.array(np.zeros(64, np.float32))
        assert backend.pointer_device(cs.read_interface(y).ptr) == 1
