"""Conformance: stream capture, as the driver does it (probed on an H100, CUDA 13).

Each rule runs on the simulator and, where a device is usable, on cuda (CuPy
kernels launched inside ``with cupy_stream:`` are capturable). A capture is
always ended before the test returns, so a failure never leaves a stream
capturing for the next test. The sanitizer is off here: it does not model
graphs yet (captured kernels are declared to it as if they had run).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import numpy as np
import pytest

import cai_streams as cs
from cai_streams._backend import CaptureMode

from .device_ops import DeviceOps

T = TypeVar("T")


@pytest.fixture(autouse=True)
def _unsanitized() -> Iterator[None]:
    with cs.sanitize(False):
        yield


def _code(call: Callable[[], object]) -> str:
    """The name of the CudaError ``call`` raises ("" if it returns)."""
    try:
        call()
    except cs.CudaError as exc:
        return exc.name
    return ""


def _in_thread(fn: Callable[[], T]) -> T:
    out: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the other thread did not finish"
    if errors:
        raise errors[0]
    return out[0]


@contextlib.contextmanager
def _capturing(backend: cs.Backend, stream: int, mode: CaptureMode = "global") -> Iterator[None]:
    """Capture on ``stream`` in the block; whatever happens, it is not capturing after."""
    backend.begin_capture(stream, mode)
    try:
        yield
    finally:
        if backend.capture_status(stream) != "none":
            with contextlib.suppress(cs.CudaError):
                backend.destroy_graph(backend.end_capture(stream))


@contextlib.contextmanager
def _events(backend: cs.Backend, n: int) -> Iterator[list[int]]:
    events = [backend.create_event() for _ in range(n)]
    try:
        yield events
    finally:
        for event in events:
            backend.destroy_event(event)


def _replay(backend: cs.Backend, graph: int, stream: int, times: int = 1) -> None:
    graph_exec = backend.instantiate_graph(graph)
    try:
        for _ in range(times):
            backend.launch_graph(graph_exec, stream)
        backend.synchronize_stream(stream)
    finally:
        backend.destroy_graph_exec(graph_exec)
        backend.destroy_graph(graph)


def test_captured_work_is_recorded_not_run_and_replays_on_each_launch(
    ops: DeviceOps, backend: cs.Backend
) -> None:
    s = cs.Stream()
    x = ops.array(np.zeros(64, np.float32))
    with _capturing(backend, s.handle):
        ops.add(s, x, 1.0)
        ops.add(s, x, 2.0)
        assert backend.capture_status(s.handle) == "active"
        assert backend.is_capturing(s.handle)
        graph = backend.end_capture(s.handle)
    assert backend.capture_status(s.handle) == "none"
    np.testing.assert_array_equal(ops.to_host(x), 0.0)  # recorded, not run
    _replay(backend, graph, s.handle, times=2)
    np.testing.assert_array_equal(ops.to_host(x), 6.0)


def test_a_graph_launch_runs_after_earlier_work_on_its_stream(
    ops: DeviceOps, backend: cs.Backend
) -> None:
    s, other = cs.Stream(), cs.Stream()
    x = ops.array(np.zeros(16, np.float32))
    with _capturing(backend, s.handle):
        ops.add(s, x, 1.0)
        graph = backend.end_capture(s.handle)
    graph_exec = backend.instantiate_graph(graph)
    with _events(backend, 1) as (done,):
        latch = ops.latch(other)
        ops.fill(other, x, 10.0)
        backend.launch_graph(graph_exec, other.handle)
        backend.record(done, other.handle)
        assert backend.query(done) is False
        latch.release()
        backend.synchronize_event(done)
    np.testing.assert_array_equal(ops.to_host(x), 11.0)
    backend.destroy_graph_exec(graph_exec)
    backend.destroy_graph(graph)


def test_synchronizing_a_capturing_stream_fails_and_invalidates_the_capture(
    backend: cs.Backend,
) -> None:
    s = cs.Stream()
    with _events(backend, 1) as (event,), _capturing(backend, s.handle):
        assert _code(lambda: backend.synchronize_stream(s.handle)) == (
            "cudaErrorStreamCaptureUnsupported"
        )
        assert backend.capture_status(s.handle) == "invalidated"
        # every later use of the capture fails, up to its end
        assert _code(lambda: backend.record(event, s.handle)) == "cudaErrorStreamCaptureInvalidated"
        assert _code(lambda: backend.end_capture(s.handle)) == "cudaErrorStreamCaptureInvalidated"
        assert backend.capture_status(s.handle) == "none"
    backend.synchronize_stream(s.handle)  # an ordinary stream again


def test_querying_an_event_recorded_in_a_capture_fails_and_invalidates_it(
    backend: cs.Backend,
) -> None:
    s, other = cs.Stream(), cs.Stream()
    with _events(backend, 1) as (event,):
        with _capturing(backend, s.handle):
            backend.record(event, s.handle)
            assert _code(lambda: backend.query(event)) == "cudaErrorCapturedEvent"
            assert backend.capture_status(s.handle) == "invalidated"
            assert _code(lambda: backend.end_capture(s.handle)) == (
                "cudaErrorStreamCaptureInvalidated"
            )
        # last recorded in a capture that is over: unusable until recorded again
        assert _code(lambda: backend.query(event)) == "cudaErrorInvalidValue"
        assert _code(lambda: backend.synchronize_event(event)) == "cudaErrorInvalidValue"
        assert _code(lambda: backend.stream_wait_event(other.handle, event)) == (
            "cudaErrorInvalidValue"
        )
        backend.record(event, other.handle)
        backend.synchronize_event(event)
        assert backend.query(event) is True


def test_an_event_recorded_in_a_finished_capture_is_unusable_until_recorded_again(
    backend: cs.Backend,
) -> None:
    s, other = cs.Stream(), cs.Stream()
    with _events(backend, 1) as (event,):
        with _capturing(backend, s.handle):
            backend.record(event, s.handle)
            graph = backend.end_capture(s.handle)
        backend.destroy_graph(graph)
        assert _code(lambda: backend.query(event)) == "cudaErrorInvalidValue"
        assert _code(lambda: backend.stream_wait_event(other.handle, event)) == (
            "cudaErrorInvalidValue"
        )
        backend.record(event, other.handle)
        assert _code(lambda: backend.synchronize_event(event)) == ""


@pytest.mark.parametrize(
    ("capture_mode", "other_mode", "invalidates"),
    [
        ("global", "global", True),
        ("global", "thread_local", False),
        ("global", "relaxed", False),
        ("thread_local", "global", False),
        ("relaxed", "global", False),
    ],
)
def test_a_query_from_another_thread_during_a_capture(
    backend: cs.Backend, capture_mode: CaptureMode, other_mode: CaptureMode, invalidates: bool
) -> None:
    """A global capture forbids potentially unsafe calls (a query, a host sync)
    in every thread whose mode is global; a thread that exchanged its mode to
    relaxed (as a watchdog or poller should) does not disturb it."""
    s, other = cs.Stream(), cs.Stream()
    with _events(backend, 1) as (done,):
        backend.record(done, other.handle)
        backend.synchronize_event(done)

        def from_another_thread() -> tuple[str, str]:
            previous = backend.exchange_capture_mode(other_mode)
            try:
                return (
                    _code(lambda: backend.query(done)),
                    _code(lambda: backend.synchronize_stream(other.handle)),
                )
            finally:
                backend.exchange_capture_mode(previous)

        with _capturing(backend, s.handle, capture_mode):
            codes = _in_thread(from_another_thread)
            if invalidates:
                assert codes == ("cudaErrorStreamCaptureUnsupported",) * 2
                assert backend.capture_status(s.handle) == "invalidated"
                assert _code(lambda: backend.end_capture(s.handle)) == (
                    "cudaErrorStreamCaptureInvalidated"
                )
            else:
                assert codes == ("", "")
                assert backend.capture_status(s.handle) == "active"
                backend.destroy_graph(backend.end_capture(s.handle))


@pytest.mark.parametrize(
    ("capture_mode", "prohibited"),
    [("global", True), ("thread_local", True), ("relaxed", False)],
)
def test_the_capturing_thread_may_not_query_unless_its_capture_is_relaxed(
    backend: cs.Backend, capture_mode: CaptureMode, prohibited: bool
) -> None:
    s, other = cs.Stream(), cs.Stream()
    with _events(backend, 1) as (done,):
        backend.record(done, other.handle)
        backend.synchronize_event(done)
        with _capturing(backend, s.handle, capture_mode):
            code = _code(lambda: backend.query(done))
            if prohibited:
                assert code == "cudaErrorStreamCaptureUnsupported"
                assert backend.capture_status(s.handle) == "invalidated"
            else:
                assert code == ""
                assert backend.capture_status(s.handle) == "active"


@pytest.mark.parametrize("capture_mode", ["global", "thread_local"])
def test_the_capturing_thread_may_query_once_its_own_mode_is_relaxed(
    backend: cs.Backend, capture_mode: CaptureMode
) -> None:
    """What the library relies on to check, from the capturing thread itself,
    whether a producer outside the capture is done: an exchange to relaxed."""
    s, other = cs.Stream(), cs.Stream()
    with _events(backend, 1) as (done,):
        backend.record(done, other.handle)
        backend.synchronize_event(done)
        with _capturing(backend, s.handle, capture_mode):
            previous = backend.exchange_capture_mode("relaxed")
            try:
                assert backend.query(done) is True
                assert backend.query_stream(other.handle) is True
            finally:
                backend.exchange_capture_mode(previous)
            assert backend.capture_status(s.handle) == "active"
            backend.destroy_graph(backend.end_capture(s.handle))


def test_exchange_capture_mode_is_per_thread_and_returns_the_previous_mode(
    backend: cs.Backend,
) -> None:
    def in_a_new_thread() -> list[str]:
        modes: list[CaptureMode] = ["relaxed", "thread_local", "global"]
        return [backend.exchange_capture_mode(m) for m in modes]

    assert _in_thread(in_a_new_thread) == ["global", "relaxed", "thread_local"]
    previous = backend.exchange_capture_mode("relaxed")
    try:
        assert _in_thread(lambda: backend.exchange_capture_mode("global")) == "global"
    finally:
        assert backend.exchange_capture_mode(previous) == "relaxed"


def test_the_legacy_stream_is_unusable_while_a_blocking_stream_captures(
    backend: cs.Backend,
) -> None:
    """The per-thread default stream is blocking: while it captures, the legacy
    stream would depend on the capture."""
    with _events(backend, 1) as (event,), _capturing(backend, 2):
        # asking is an error too, but does not invalidate
        assert _code(lambda: backend.capture_status(1)) == "cudaErrorStreamCaptureImplicit"
        assert backend.capture_status(2) == "active"
        assert _code(lambda: backend.record(event, 1)) == "cudaErrorStreamCaptureImplicit"
        assert backend.capture_status(2) == "invalidated"
        assert _code(lambda: backend.end_capture(2)) == "cudaErrorStreamCaptureInvalidated"


def test_a_non_blocking_capture_leaves_the_legacy_stream_usable(backend: cs.Backend) -> None:
    s = cs.Stream()
    with _events(backend, 1) as (event,), _capturing(backend, s.handle):
        backend.record(event, 1)
        assert backend.capture_status(s.handle) == "active"
        backend.destroy_graph(backend.end_capture(s.handle))


def test_the_legacy_stream_cannot_capture_and_captures_do_not_nest(backend: cs.Backend) -> None:
    s = cs.Stream()
    assert _code(lambda: backend.begin_capture(1, "global")) == "cudaErrorStreamCaptureUnsupported"
    assert _code(lambda: backend.end_capture(s.handle)) == "cudaErrorIllegalState"
    with _capturing(backend, s.handle):
        assert _code(lambda: backend.begin_capture(s.handle, "global")) == "cudaErrorIllegalState"
        backend.destroy_graph(backend.end_capture(s.handle))
    with pytest.raises(ValueError, match="capture mode"):
        backend.begin_capture(s.handle, "local")  # type: ignore[arg-type]


def test_a_capturing_stream_may_not_wait_on_work_recorded_outside(backend: cs.Backend) -> None:
    s, other = cs.Stream(), cs.Stream()
    with _events(backend, 2) as (outside, never):
        backend.record(outside, other.handle)
        backend.synchronize_event(outside)
        with _capturing(backend, s.handle):
            backend.stream_wait_event(s.handle, never)  # never recorded: a no-op
            assert backend.capture_status(s.handle) == "active"
            assert _code(lambda: backend.stream_wait_event(s.handle, outside)) == (
                "cudaErrorStreamCaptureIsolation"
            )
            assert backend.capture_status(s.handle) == "invalidated"


def test_record_and_wait_fork_and_join_other_streams_into_the_capture(
    ops: DeviceOps, backend: cs.Backend
) -> None:
    s, side = cs.Stream(), cs.Stream()
    x = ops.array(np.zeros(32, np.float32))
    y = ops.array(np.zeros(32, np.float32))
    with _events(backend, 2) as (forked, joined), _capturing(backend, s.handle):
        ops.fill(s, x, 1.0)
        backend.record(forked, s.handle)
        backend.stream_wait_event(side.handle, forked)  # side joins the capture
        assert backend.capture_status(side.handle) == "active"
        ops.copy(side, y, x)
        ops.add(side, y, 1.0)
        backend.record(joined, side.handle)
        backend.stream_wait_event(s.handle, joined)  # and comes back
        ops.add(s, x, 10.0)
        graph = backend.end_capture(s.handle)
        assert backend.capture_status(side.handle) == "none"
    np.testing.assert_array_equal(ops.to_host(x), 0.0)
    np.testing.assert_array_equal(ops.to_host(y), 0.0)
    _replay(backend, graph, s.handle)
    np.testing.assert_array_equal(ops.to_host(y), 2.0)
    np.testing.assert_array_equal(ops.to_host(x), 11.0)


def test_a_fork_that_never_joins_fails_end_capture(ops: DeviceOps, backend: cs.Backend) -> None:
    s, side = cs.Stream(), cs.Stream()
    y = ops.array(np.zeros(8, np.float32))
    with _events(backend, 1) as (forked,), _capturing(backend, s.handle):
        backend.record(forked, s.handle)
        backend.stream_wait_event(side.handle, forked)
        ops.add(side, y, 1.0)  # captured on side, never waited for by s
        assert _code(lambda: backend.end_capture(s.handle)) == "cudaErrorStreamCaptureUnjoined"
        assert backend.capture_status(s.handle) == "none"
        assert backend.capture_status(side.handle) == "none"


def test_a_capture_ends_in_the_thread_that_began_it_unless_relaxed(backend: cs.Backend) -> None:
    s = cs.Stream()
    with _capturing(backend, s.handle, "global"):
        assert _in_thread(lambda: _code(lambda: backend.end_capture(s.handle))) == (
            "cudaErrorStreamCaptureWrongThread"
        )
        assert backend.capture_status(s.handle) == "none"  # the driver ended it
        assert _code(lambda: backend.end_capture(s.handle)) == "cudaErrorIllegalState"
    with _capturing(backend, s.handle, "relaxed"):
        graph = _in_thread(lambda: backend.end_capture(s.handle))
        backend.destroy_graph(graph)
