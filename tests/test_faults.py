"""The library under a sticky device-side fault (simulator only: on a GPU one
failing kernel would poison the CUDA context for the rest of the run).

Every waiter on the faulted device hears of it (awaiting on any event loop,
blocking in any thread, enqueueing), none hangs, a device that did not fault
goes on working, and after ``sim.reset()`` the library works again with no
event or tracked state left behind.
"""

from __future__ import annotations

import concurrent.futures
import copy
import gc
import multiprocessing
import pickle
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import anyio
import numpy as np
import pytest

import cai_streams as cs
from cai_streams import sim
from cai_streams._backend import _sim_stream

pytestmark = pytest.mark.anyio

N = 16


@pytest.fixture(autouse=True)
def _on_sim() -> Iterator[None]:
    previous = cs.current_backend()
    cs.use_backend("sim")
    # What earlier tests left to the next library call (a collected stream's
    # close records what listened) runs now, not inside a call made while the
    # device is faulted: there it would fail, with a warning this suite raises.
    gc.collect()
    cs.stats()
    try:
        with cs.sanitize(False):  # work after a fault never runs: the sanitizer cannot know
            yield
    finally:
        sim.reset(0)
        cs.use_backend(previous.name)


@pytest.fixture(params=["sim", "driver"])
def fault_style(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """``driver``: the faulted device raises what the cuda backend raises for a
    sticky fault (a :class:`cs.DeviceFaultError` with the driver's code, no
    kernel named), not the simulator's :class:`cs.KernelError`; the library
    must handle both alike."""
    if request.param == "driver":

        def raise_fault(fault: cs.KernelError) -> None:
            raise cs.DeviceFaultError(700, "cudaErrorIllegalAddress", "an illegal memory access")

        monkeypatch.setattr(_sim_stream, "raise_fault", raise_fault)
    return str(request.param)


def _fill(x: np.ndarray[Any, Any], value: float) -> None:
    x[...] = value


def _boom() -> None:
    raise ZeroDivisionError("device-side fault")


def _in_flight() -> int:
    gc.collect()
    return cs.stats()["events_in_flight"]


async def test_every_waiter_on_the_faulted_device_sees_the_fault_then_reset_recovers() -> None:
    writers = [cs.Stream() for _ in range(4)]
    base = _in_flight()
    gate = threading.Event()
    arrays = []
    for i in range(200):
        arr = sim.empty(N)
        t = cs.track(arr)
        w = writers[i % len(writers)]
        if i < len(writers):
            sim.launch(w, lambda: gate.wait(20))  # hold each writer until the fault
        with t.writing(w):
            sim.launch(w, _fill, arr, float(i), writes=[arr])
        arrays.append(t)
    failures: list[BaseException] = []
    blocked: list[BaseException] = []

    async def waiter(t: cs.TrackedArray) -> None:
        try:
            await cs.consume(t, timeout=20)
        except cs.CudaError as exc:
            failures.append(exc)

    def blocking_waiter(t: cs.TrackedArray) -> None:
        try:
            cs.consume_blocking(t, timeout=20)
        except cs.CudaError as exc:
            blocked.append(exc)

    threads = [threading.Thread(target=blocking_waiter, args=(t,)) for t in arrays[:8]]
    for thread in threads:
        thread.start()
    async with anyio.create_task_group() as tg:
        for t in arrays:
            tg.start_soon(waiter, t)
        await anyio.sleep(0.05)
        culprit = cs.Stream()
        sim.launch(culprit, _boom)
        await anyio.sleep(0.05)
        gate.set()
    for thread in threads:
        thread.join(30)
    assert len(failures) == len(arrays) and all(isinstance(e, cs.KernelError) for e in failures)
    assert len(blocked) == len(threads) and all(isinstance(e, cs.KernelError) for e in blocked)
    with pytest.raises(cs.KernelError):  # sticky: new work on the device fails too
        await cs.consume(arrays[0], timeout=5)

    sim.reset(0)
    fresh = sim.empty(N)
    t = cs.track(fresh)
    with t.writing(writers[0]):
        sim.launch(writers[0], _fill, fresh, 42.0, writes=[fresh], duration=0.01)
    view = await cs.consume(t, timeout=20)
    np.testing.assert_array_equal(sim._numpy_view(view), 42.0)
    del arrays, arr, t, view, fresh
    failures.clear()  # their tracebacks hold the arrays
    blocked.clear()
    for w in writers:
        w.synchronize()
    assert _in_flight() == base


async def test_a_fault_on_one_device_leaves_the_other_working() -> None:
    if cs.device_count() < 2:
        pytest.skip("sim: one device; the rule needs two")
    healthy = cs.Stream(device=1)
    arr = sim.empty(N, device=1)
    t = cs.track(arr)
    with t.writing(healthy):
        sim.launch(healthy, _fill, arr, 5.0, writes=[arr], duration=0.02)
    culprit = cs.Stream(device=0)
    sim.launch(culprit, _boom)
    with pytest.raises(cs.KernelError):
        culprit.synchronize()
    view = await cs.consume(t, timeout=20)
    np.testing.assert_array_equal(sim._numpy_view(view), 5.0)
    other = cs.Stream(device=1)
    view = await cs.consume(t, stream=other, timeout=20)  # a join on device 1
    other.synchronize()


def test_a_consumer_stream_closed_on_a_faulted_device_leaves_its_array_writable_after_reset(
    fault_style: str,
) -> None:
    """The consumer's read is open on ``c`` when the device faults; closing
    ``c`` cannot record it (every call raises) and destroys the stream. The
    read goes with it: after a reset, the producer writes and reads again.
    (It stayed open, naming the destroyed stream: every later write of the
    array raised ``ValueError: this Stream is closed``.)"""
    producer, culprit, c = cs.Stream(), cs.Stream(), cs.Stream()
    arr = sim.empty(N)
    t = cs.track(arr)
    with t.writing(producer):
        sim.launch(producer, _fill, arr, 1.0, writes=[arr], duration=0.001)
    view = cs.consume_blocking(t, stream=c, timeout=20)  # a read open on c
    sim.launch(culprit, _boom)
    with pytest.raises(cs.DeviceFaultError):
        culprit.synchronize()
    with pytest.raises(cs.DeviceFaultError):
        c.close()
    assert c.closed
    sim.reset(0)
    with t.writing(producer):
        sim.launch(producer, _fill, arr, 2.0, writes=[arr], duration=0.001)
    got = cs.consume_blocking(t, timeout=20)
    np.testing.assert_array_equal(sim._numpy_view(got), 2.0)
    del view


@pytest.mark.parametrize("kind", ["writing", "reading"])
def test_a_block_whose_stream_closed_on_a_faulted_device_raises_the_fault_at_exit(
    kind: str, fault_style: str
) -> None:
    """The block's stream is closed inside it after a kernel faulted: the
    close cannot record the block (every call raises), and the exit raises
    the device's fault, adding nothing (it raised ``ValueError: this Stream
    is closed``, recording on the destroyed stream). After a reset the array
    works again."""
    arr = sim.empty(N)
    t = cs.track(arr)
    tmp, culprit = cs.Stream(), cs.Stream()
    with pytest.raises(cs.DeviceFaultError) as at_exit:
        with getattr(t, kind)(tmp):
            sim.launch(culprit, _boom)
            with pytest.raises(cs.DeviceFaultError):
                culprit.synchronize()
            with pytest.raises(cs.DeviceFaultError) as at_close:
                tmp.close()
    # a fresh instance: one raised again would carry every frame it passed
    assert at_exit.value is not at_close.value
    assert type(at_exit.value) is type(at_close.value)
    assert (at_exit.value.code, str(at_exit.value)) == (at_close.value.code, str(at_close.value))
    sim.reset(0)
    s = cs.Stream()
    with t.writing(s):
        sim.launch(s, _fill, arr, 7.0, writes=[arr], duration=0.001)
    got = cs.consume_blocking(t, timeout=20)
    np.testing.assert_array_equal(sim._numpy_view(got), 7.0)


def test_a_view_let_go_on_a_faulted_device_lets_its_owner_go(fault_style: str) -> None:
    """A consumer's view on ``c`` is let go after the device faulted: the
    hold that would keep the owner until ``c`` passes the consumer's work
    cannot be recorded, and that work never runs, so the owner goes, with no
    warning. (With the driver's fault, a plain CudaError to the library
    before DeviceFaultError, the owner was kept for good with a
    CudaWarning, as for a stream that is gone while its work may still run.)"""
    producer, culprit, c = cs.Stream(), cs.Stream(), cs.Stream()
    arr = sim.empty(N)
    owner = weakref.ref(arr)
    t = cs.track(arr)
    with t.writing(producer):
        sim.launch(producer, _fill, arr, 1.0, writes=[arr], duration=0.001)
    view = cs.consume_blocking(t, stream=c, timeout=20)  # the owner leased to c
    producer.synchronize()
    sim.launch(culprit, _boom)
    with pytest.raises(cs.DeviceFaultError):
        culprit.synchronize()
    del view, t, arr
    for _ in range(3):  # (a released view settles at a later library call)
        gc.collect()
        cs.stats()
    assert owner() is None, "the owner was kept after a fault"


async def test_work_that_failed_when_the_timeout_expires_raises_the_fault(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The wait's own timeout expires just as the producer's kernel faults
    (here: a wait that gives up at once, over a kernel failed by then): the
    consume raises the ``KernelError``, as ``consume_blocking`` does, not a
    ``TimeoutError`` naming the stream as still pending."""
    from cai_streams import _poller

    s = cs.Stream()
    t = cs.track(sim.empty(N))
    gate = threading.Event()
    sim.launch(s, lambda: gate.wait(10))
    with t.writing(s):
        sim.launch(s, _boom)

    async def gives_up(seconds: float, fn: Any) -> bool:
        gate.set()
        with pytest.raises(cs.KernelError):
            s.synchronize()  # (failed by the time the wait looks again)
        return False

    monkeypatch.setattr(_poller, "finished_within", gives_up)
    with pytest.raises(cs.KernelError):
        await cs.consume(t, timeout=5)


@pytest.mark.parametrize(
    ("code", "sticky"),
    [(226, True), (700, True), (702, True), (710, True), (714, True), (719, True), (721, True),
     (810, True), (911, True),
     (1, False), (400, False), (600, False), (701, False), (720, False), (901, False)],
)  # fmt: skip
def test_the_cuda_backend_raises_a_sticky_fault_as_a_device_fault(code: int, sticky: bool) -> None:
    """What the library's fault handling catches on a GPU: the driver's codes
    that leave the context unusable are DeviceFaultError (as KernelError is on
    the simulator); every other failure stays a plain CudaError."""
    from cai_streams._backend import _cuda

    with pytest.raises(cs.CudaError) as info:
        _cuda.check((code,), "a call")
    assert isinstance(info.value, cs.DeviceFaultError) is sticky
    assert not isinstance(info.value, cs.KernelError)
    assert info.value.code == code and "(during a call)" in str(info.value)


def test_the_sticky_codes_are_those_the_runtime_calls_fatal() -> None:
    """The cuda backend's list against cuda.bindings' own docs of each error:
    the ones after which "the process must be terminated and relaunched" (or
    the device "cannot be used again")."""
    from cai_streams._backend import _cuda

    runtime = pytest.importorskip("cuda.bindings.runtime")
    documented = {
        int(member)
        for name in dir(runtime.cudaError_t)
        if name.startswith("cudaError")
        for member in [getattr(runtime.cudaError_t, name)]
        if any(s in (member.__doc__ or "") for s in ("relaunched", "cannot be used again"))
    }
    if not documented:
        pytest.skip("this cuda.bindings carries no docs of its error codes")
    assert documented == _cuda.STICKY


class _TileError(Exception):
    """A user's exception that pickles but does not unpickle (two arguments)."""

    def __init__(self, tile: int, reason: str) -> None:
        super().__init__(f"tile {tile}: {reason}")


def _child_fault() -> None:
    raise cs.DeviceFaultError(700, "cudaErrorIllegalAddress", "an illegal memory access")


@pytest.mark.parametrize(
    "error",
    [
        cs.DeviceFaultError(700, "cudaErrorIllegalAddress", "an illegal memory access"),
        cs.KernelError("fill", 0x7F0000001400, _TileError(3, "NaN in input")),
        cs.CudaError(400, "cudaErrorInvalidResourceHandle", "invalid resource handle"),
        cs.CaptureError("not while capturing", code=900),
        cs.InterfaceError("bad shape"),
        cs.HazardError("two writes unordered", first=threading.RLock(), second=threading.RLock()),
    ],
    ids=lambda e: type(e).__name__,
)
def test_errors_pickle_and_copy_whole(error: cs.CaiStreamsError) -> None:
    """A worker process's error reaches its parent (multiprocessing pickles it;
    a CudaError's __init__ takes other arguments than its args, which made
    unpickling raise TypeError and a ProcessPoolExecutor break). As any
    exception's, the copy has no cause (a user's exception there may not
    unpickle); a HazardError's accesses (the sanitizer's records, with their
    locks) stay behind."""
    for again in (
        pickle.loads(pickle.dumps(error)),
        copy.copy(error),
        copy.deepcopy(error),
    ):
        assert type(again) is type(error)
        assert str(again) == str(error)
        if isinstance(again, cs.HazardError):
            assert (again.first, again.second) == (None, None)
        else:
            assert again.__dict__ == error.__dict__
        assert again.__cause__ is None


def test_a_fault_in_a_worker_process_reaches_the_parent() -> None:
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        with pytest.raises(cs.DeviceFaultError) as info:
            pool.submit(_child_fault).result(timeout=60)
    assert (info.value.code, info.value.name) == (700, "cudaErrorIllegalAddress")
