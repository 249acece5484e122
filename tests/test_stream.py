"""Stream.wrap over every kind of stream object, and every bad input."""

from __future__ import annotations

import gc
import threading
import warnings
from typing import Any

import anyio
import numpy as np
import pytest

import cai_streams as cs


class FakeCudaStream:
    """Any object following the __cuda_stream__ protocol (cuda.core's)."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def _fake_library_stream(module: str, attr: str, handle: Any) -> object:
    cls = type("Stream", (), {"__module__": module})
    obj = cls()
    setattr(obj, attr, handle)
    return obj


def test_wrap_int_and_protocol_objects(backend: cs.Backend) -> None:
    owner = cs.Stream()
    h = owner.handle
    assert cs.Stream.wrap(h).handle == h
    assert cs.Stream.wrap(FakeCudaStream(h)).handle == h
    assert cs.Stream.wrap(_fake_library_stream("torch.cuda.streams", "cuda_stream", h)).handle == h
    assert cs.Stream.wrap(_fake_library_stream("cupy.cuda.stream", "ptr", h)).handle == h


def test_wrap_keeps_the_object_alive(backend: cs.Backend) -> None:
    owner = cs.Stream()
    fake = FakeCudaStream(owner.handle)
    wrapped = cs.Stream.wrap(fake)
    del fake
    gc.collect()
    assert wrapped._keepalive is not None
    assert isinstance(wrapped._keepalive, FakeCudaStream)


def test_library_default_stream_zero_means_legacy(backend: cs.Backend) -> None:
    torch_default = _fake_library_stream("torch.cuda.streams", "cuda_stream", 0)
    assert cs.Stream.wrap(torch_default).handle == 1
    assert cs.Stream.wrap(FakeCudaStream(0)).handle == 1


def test_wrap_real_cupy_stream_object(backend: cs.Backend) -> None:
    cupy = pytest.importorskip("cupy")
    owner = cs.Stream()
    external = cupy.cuda.Stream.from_external(owner)  # no device call on creation
    assert type(external).__module__.startswith("cupy")
    wrapped = cs.Stream.wrap(external)
    assert wrapped.handle == owner.handle
    assert wrapped._keepalive is external


def test_wrap_cuda_bindings_handle(backend: cs.Backend) -> None:
    from cuda.bindings import runtime

    owner = cs.Stream()
    assert cs.Stream.wrap(runtime.cudaStream_t(owner.handle)).handle == owner.handle


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        ("x", TypeError, "cannot use str as a stream"),
        (1.5, TypeError, "cannot use float as a stream"),
        (None, TypeError, "cannot use NoneType as a stream"),
        (True, TypeError, "cannot use bool as a stream"),
        (-3, ValueError, "non-negative"),
        (0, ValueError, "ambiguous"),
        (object(), TypeError, "expected an int stream handle"),
    ],
)
def test_wrap_rejects_bad_input(bad: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        cs.Stream.wrap(bad)


def test_wrap_takes_numpy_integers_as_handles() -> None:
    """An int64 handle (as read from a NumPy array or a ctypes struct) names
    the same stream as the int (it was refused: TypeError)."""
    owner = cs.Stream()
    assert cs.Stream.wrap(np.int64(owner.handle)) == owner
    assert cs.Stream.wrap(np.uint64(1)).handle == 1
    with pytest.raises(ValueError, match="ambiguous"):
        cs.Stream.wrap(np.int32(0))


def test_wrap_rejects_bad_protocol_results() -> None:
    class Broken:
        def __cuda_stream__(self) -> object:
            return 5

    with pytest.raises(TypeError, match="must return"):
        cs.Stream.wrap(Broken())
    with pytest.raises(ValueError, match="non-negative"):
        cs.Stream.wrap(FakeCudaStream(-1))


def test_sim_unknown_handle_is_a_value_error() -> None:
    cs.use_backend("sim")
    with pytest.raises(ValueError, match="not a stream on the 'sim' backend"):
        cs.Stream.wrap(0x1234)
    s = cs.Stream()
    h = s.handle
    s.close()
    with pytest.raises(ValueError, match="not a stream"):
        cs.Stream.wrap(h)


def test_closed_stream_refuses_use(backend: cs.Backend) -> None:
    s = cs.Stream()
    s.close()
    for use in (s.record, s.synchronize, lambda: s.wait(cs.Stream()), s.__cuda_stream__):
        with pytest.raises(ValueError, match="closed"):
            use()


def test_wait_rejects_non_events(backend: cs.Backend) -> None:
    with pytest.raises(TypeError, match="takes an Event or a Stream"):
        cs.Stream().wait(42)  # type: ignore[arg-type]


def test_events_are_made_by_record() -> None:
    with pytest.raises(TypeError, match="Stream.record"):
        cs.Event()


def test_collected_stream_and_event_are_destroyed(
    backend: cs.Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dropping the last reference destroys the handle, through the backend (a
    destroyed handle cannot be queried safely on a GPU, so the calls are counted)."""
    destroyed: list[tuple[str, int]] = []
    for method in ("destroy_stream", "destroy_event"):
        real = getattr(backend, method)

        def spy(handle: int, _real: Any = real, _method: str = method) -> None:
            destroyed.append((_method, handle))
            _real(handle)

        monkeypatch.setattr(backend, method, spy)
    s = cs.Stream()
    h = s.handle
    e = s.record()
    e_handle = e._handle
    e.synchronize()
    del s, e
    gc.collect()
    assert ("destroy_stream", h) in destroyed and ("destroy_event", e_handle) in destroyed
    if backend.name == "sim":
        assert not backend.is_stream(h)


def test_failed_destroy_in_destructor_is_a_warning() -> None:
    cs.use_backend("sim")
    s = cs.Stream()
    cs.current_backend().destroy_stream(s.handle)  # destroyed behind its back
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s.__del__()
    assert [w.category for w in caught] == [cs.CudaWarning]
    s._closed = True


def test_mixing_backends_is_refused() -> None:
    from cai_streams._backend._sim import SimBackend

    cs.use_backend("sim")
    other = SimBackend()
    try:
        s = cs.Stream()
        foreign = cs.Stream.wrap(s)
        foreign._backend = other
        with pytest.raises(ValueError, match="another backend"):
            s.wait(foreign)
    finally:
        other.close()


@pytest.mark.anyio
async def test_event_wait_yields_and_completes(ops: Any) -> None:
    s = cs.Stream()
    latch = ops.latch(s)
    e = s.record()
    ticks = 0

    async def release_soon() -> None:
        nonlocal ticks
        for _ in range(5):
            ticks += 1
            await anyio.sleep(0.001)
        latch.release()

    async with anyio.create_task_group() as tg:
        tg.start_soon(release_soon)
        with anyio.fail_after(10):
            await e.wait()
    assert ticks == 5 and e.is_done


@pytest.mark.anyio
async def test_event_wait_timeout(ops: Any) -> None:
    s = cs.Stream()
    latch = ops.latch(s)
    e = s.record()
    try:
        with pytest.raises(TimeoutError):
            await e.wait(timeout=0.05)
    finally:
        latch.release()
    await e.wait(timeout=10)


@pytest.mark.parametrize("fixed", [True, False], ids=["closed once", "control"])
def test_two_threads_closing_one_stream_close_it_once(
    fixed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Thread A closes a consumer's stream and is preempted while it records
    the consumer's open read there (forced); the main thread closes it too:
    that close returns at once and destroys nothing, A records the read, and
    the producer's next write waits for it (the control closes twice: the
    stream was destroyed under A's record, which failed, and every later
    write of the array raised; the destroy could also take the stream a third
    thread was just given the handle for)."""
    from cai_streams import _access, _identity, sim

    cs.use_backend("sim")
    if not fixed:
        monkeypatch.setattr(_identity.Lifetime, "claim_close", lambda self: True)
    backend = cs.current_backend()
    w, s = cs.Stream(), cs.Stream()
    t = cs.track(sim.asarray(np.zeros(64, np.float32)))
    view = cs.consume_blocking(t, stream=s)  # a consumer read open on s: recorded at the close
    paused, resume = threading.Event(), threading.Event()
    real = _access.Access.stream_closing

    def preempted(self: Any) -> None:
        if threading.current_thread().name == "A" and not paused.is_set():
            paused.set()
            resume.wait(10)
        real(self)

    monkeypatch.setattr(_access.Access, "stream_closing", preempted)
    handle = s.handle
    errors: list[Exception] = []

    def close_in_a() -> None:
        try:
            s.close()
        except Exception as exc:  # noqa: BLE001 - (the control's)
            errors.append(exc)

    a = threading.Thread(target=close_in_a, name="A")
    a.start()
    assert paused.wait(10)
    s.close()  # the main thread's
    assert s.closed  # (for its caller: the other thread still records)
    exists = backend.is_stream(handle)
    resume.set()
    a.join(10)
    del view
    if fixed:
        assert exists and not errors
        with t.writing(w):
            pass
        assert not backend.is_stream(handle)
    else:
        assert not exists and errors
        with pytest.raises(ValueError, match="closed"):
            with t.writing(w):
                pass
