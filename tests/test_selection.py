"""Choosing the backend: environment, default, errors, and the one INFO line;
the decoy default (``CAI_STREAMS_SIM_DECOY=1``) that simulated kernels refuse."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import cai_streams as cs
from cai_streams import _backend, sim

_SELECTION = ("CAI_STREAMS_BACKEND", "CAI_STREAMS_SIM_DECOY")
_CUDA_REASON = _backend._backend_class("cuda").unavailable_reason()


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a child whose backend selection is only what ``env`` says
    (these tests pass in both CI passes, with and without the decoy)."""
    full = {k: v for k, v in os.environ.items() if k not in _SELECTION}
    full.update(env)
    return subprocess.run(
        [sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=60
    )


def test_default_is_sim_without_a_device_and_says_so_once() -> None:
    if cs._backend._backend_class("cuda").unavailable_reason() is None:
        pytest.skip("a CUDA device is usable here: the default is cuda")
    out = _run(
        "import logging; logging.basicConfig(level=logging.INFO)\n"
        "import cai_streams as cs\n"
        "print(cs.current_backend().name); print(cs.current_backend().name)"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["sim", "sim"]
    assert out.stderr.count("using the simulated device") == 1


def test_environment_chooses() -> None:
    out = _run(
        "import cai_streams as cs; print(cs.current_backend().name)", CAI_STREAMS_BACKEND="sim"
    )
    assert out.stdout.strip() == "sim"
    bad = _run("import cai_streams as cs; cs.current_backend()", CAI_STREAMS_BACKEND="opencl")
    assert bad.returncode != 0 and "expected one of sim, cuda" in bad.stderr
    caught = _run(  # a ValueError, as docs/testing.md says of every switch (and the library's)
        "import cai_streams as cs\n"
        "try:\n    cs.current_backend()\n"
        "except ValueError as exc:\n    print(isinstance(exc, cs.CaiStreamsError))",
        CAI_STREAMS_BACKEND="opencl",
    )
    assert caught.stdout.strip() == "True", caught.stderr


def test_requesting_cuda_without_a_device_says_why() -> None:
    reason = cs._backend._backend_class("cuda").unavailable_reason()
    if reason is None:
        pytest.skip("a CUDA device is usable here")
    out = _run("import cai_streams as cs; cs.current_backend()", CAI_STREAMS_BACKEND="cuda")
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert "the 'cuda' backend cannot be used here" in last


def test_use_backend_validates() -> None:
    with pytest.raises(ValueError, match="unknown backend"):
        cs.use_backend("opencl")
    with pytest.raises(TypeError):
        cs.use_backend(3)  # type: ignore[arg-type]
    assert cs.use_backend("sim") is cs.current_backend()


def test_the_decoy_switch_takes_the_place_of_cuda() -> None:
    code = "import cai_streams as cs; print(cs.current_backend().name)"
    assert _run(code, CAI_STREAMS_SIM_DECOY="1").stdout.strip() == "decoy"
    assert _run(code, CAI_STREAMS_SIM_DECOY="0").stdout.strip() in ("sim", "cuda")
    for name in ("sim", "cuda") if _CUDA_REASON is None else ("sim",):
        forced = _run(code, CAI_STREAMS_SIM_DECOY="1", CAI_STREAMS_BACKEND=name)
        assert forced.stdout.strip() == name, forced.stderr
    hidden = _run("import cai_streams as cs; cs.current_backend()", CAI_STREAMS_BACKEND="decoy")
    assert hidden.returncode != 0 and "expected one of sim, cuda" in hidden.stderr
    bad = _run("import cai_streams as cs; cs.current_backend()", CAI_STREAMS_SIM_DECOY="maybe")
    assert bad.returncode != 0 and "CAI_STREAMS_SIM_DECOY='maybe'" in bad.stderr


@pytest.fixture
def decoy_default(monkeypatch: pytest.MonkeyPatch) -> cs.Backend:
    """The default backend as ``CAI_STREAMS_SIM_DECOY=1`` chooses it, in this process."""
    monkeypatch.delenv("CAI_STREAMS_BACKEND", raising=False)
    monkeypatch.setenv("CAI_STREAMS_SIM_DECOY", "1")
    monkeypatch.setattr(_backend, "_current", None)
    return cs.current_backend()


def test_under_the_decoy_default_simulated_kernels_refuse_default_streams(
    decoy_default: cs.Backend,
) -> None:
    assert decoy_default.name == "decoy" and decoy_default is not sim.device()
    s = cs.Stream()
    assert s.backend is decoy_default
    a = sim.empty(4)
    refused = r"is not a simulated stream: make it while 'sim' is the backend"
    with pytest.raises(ValueError, match=refused):
        sim.launch(s, lambda x: x.fill(1.0), a, writes=[a])
    with pytest.raises(ValueError, match=refused):
        a.to_host(stream=s)
    with pytest.raises(ValueError, match="not a stream of the simulated device"):
        sim.launch(s.handle, print)  # its handles never name a simulator stream
    cs.use_backend("sim")  # what code that runs simulated kernels does
    mine = cs.Stream()
    sim.launch(mine, lambda x: x.fill(2.0), a, writes=[a])
    assert (a.to_host(stream=mine) == 2.0).all()
    assert cs.use_backend("decoy") is decoy_default  # use_backend(current.name) round-trips
    with sim.simulated():
        assert cs.current_backend() is sim.device()
    assert cs.current_backend() is decoy_default


@pytest.mark.skipif(_CUDA_REASON is not None, reason=f"cuda: {_CUDA_REASON}")
def test_simulated_kernels_refuse_cuda_streams_the_same_way() -> None:
    cs.use_backend("cuda")
    s = cs.Stream()
    with pytest.raises(ValueError, match=r"is not a simulated stream: make it while 'sim'"):
        sim.launch(s, print)
    with pytest.raises(ValueError, match="not a stream of the simulated device"):
        sim.launch(s.handle, print)
    s.close()


class _Runtime:
    """A stand-in for cuda.bindings' runtime module: one device counted, whose
    context cannot be made (an exclusive-process GPU in use by another process)."""

    class cudaError_t(int):  # noqa: N801 - the bindings' name
        pass

    def cudaGetDeviceCount(self) -> tuple[int, int]:  # noqa: N802
        return (0, 1)

    def cudaFree(self, ptr: int) -> tuple[int]:  # noqa: N802
        return (46,)  # cudaErrorDevicesUnavailable

    def cudaGetErrorName(self, err: int) -> tuple[int, bytes]:  # noqa: N802
        return (0, b"cudaErrorDevicesUnavailable")

    def cudaGetErrorString(self, err: int) -> tuple[int, bytes]:  # noqa: N802
        return (0, b"CUDA-capable device(s) is/are busy or unavailable")


def test_a_counted_device_without_a_context_falls_back_to_sim(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from cai_streams._backend import _cuda

    monkeypatch.setattr(_cuda, "_runtime", _Runtime())
    reason = _cuda.CudaBackend.unavailable_reason()
    assert reason is not None and "present but unusable" in reason
    assert "cudaErrorDevicesUnavailable" in reason
    for name in _SELECTION:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(_backend, "_current", None)
    with caplog.at_level("INFO", logger="cai_streams"):
        assert _backend._select_default().name == "sim"
    assert "cudaErrorDevicesUnavailable" in caplog.text
    monkeypatch.setenv("CAI_STREAMS_BACKEND", "cuda")
    monkeypatch.setattr(_backend, "_current", None)
    # on a GPU machine the cuda backend is running already: a new one is checked
    monkeypatch.delitem(_backend._instances, "cuda", raising=False)
    with pytest.raises(cs.CaiStreamsError, match="present but unusable"):
        _backend._select_default()


def test_a_tracked_array_consumed_while_another_backend_is_current_waits_on_its_own(
    decoy_default: cs.Backend,
) -> None:
    """A host consume of a simulator array tracked earlier, while the decoy is
    current, waits on the simulator (it asked the decoy of the simulator's
    events: cudaErrorInvalidResourceHandle); a consumer stream must be the
    array's backend's."""
    import threading

    import numpy as np

    sim_backend = cs.use_backend("sim")
    arr = sim.asarray(np.zeros(16, np.float32))
    t = cs.track(arr)
    s = cs.Stream()
    gate = threading.Event()
    with cs.sanitize(False), t.writing(s):
        sim.launch(s, lambda x: (gate.wait(10), x.fill(4.0)), arr, writes=[arr])
    cs.use_backend("decoy")
    assert cs.current_backend() is decoy_default and sim_backend is not decoy_default
    try:
        with pytest.raises(TimeoutError):
            cs.consume_blocking(t, timeout=0.05)  # the fill is held: a wait, not an error
    finally:
        gate.set()
    with cs.sanitize(False):
        got = sim._numpy_view(cs.consume_blocking(t, timeout=10))
        assert got is not None and (got == 4.0).all()
        assert cs.consume_blocking(t, stream=s).stream == s.handle
    with pytest.raises(ValueError, match="belongs to the 'decoy' backend"):
        cs.consume_blocking(t, stream=cs.Stream())
    gate.clear()
    with cs.sanitize(False), t.writing(s):  # the raw array, tracked, is found too
        sim.launch(s, lambda x: (gate.wait(10), x.fill(5.0)), arr, writes=[arr])
    try:
        with pytest.raises(TimeoutError):
            cs.consume_blocking(arr, timeout=0.05)
    finally:
        gate.set()
    with cs.sanitize(False):
        got = sim._numpy_view(cs.consume_blocking(arr, timeout=10))
        assert got is not None and (got == 5.0).all()


def test_buffers_collected_on_a_backend_no_longer_current_are_released(
    decoy_default: cs.Backend,
) -> None:
    """Their state (events, the consumer streams their reads keep) is released
    by the lookups of the backend that is current now, a few per lookup."""
    import gc
    import weakref

    import numpy as np

    from cai_streams import _scheduler

    sim_backend = cs.use_backend("sim")
    consumers = []
    kept = []
    for _ in range(20):
        arr = sim.asarray(np.zeros(16, np.float32))
        t = cs.track(arr)
        s = cs.Stream()
        cs.consume_blocking(t, stream=s)  # a read left open on s
        consumers.append(weakref.ref(s))
        kept.append((arr, t))
        del arr, t, s
    cs.use_backend("decoy")
    del kept
    gc.collect()
    mine = sim.asarray(np.zeros(16, np.float32))
    x = cs.Stream()
    with cs.sanitize(False):
        for _ in range(20):
            cs.consume_blocking(mine, stream=x)  # lookups on the decoy
            gc.collect()
    assert sum(len(s.buffers) for s in _scheduler.schedulers_of(sim_backend)) == 0
    assert all(ref() is None for ref in consumers)
