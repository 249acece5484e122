"""Every example runs (with the sanitizer on) and says what it should."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import cai_streams as cs
from cai_streams._backend import DECOY_NAME, _backend_class
from cai_streams._config import sim_decoy

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
HAS_GPU = _backend_class("cuda").unavailable_reason() is None

EXPECTED = {
    "multi_stream_producer.py": ["events joined onto it: 3", "sum seen by the consumer: 6144"],
    "multi_device.py": ["consumer on device 0: sum 8386560", "multi-device join: ok"],
    "data_loading_pipeline.py": ["batches/s", "streams overlapped", "wrong batches: 0"],
    "async_service.py": [
        "await cs.consume: 500 requests answered",
        "blocking synchronize: 500 requests answered",
    ],  # fmt: skip
    "graph_capture.py": [
        "capture in a global-mode worker thread: valid",
        "wrong batches: 0",
        "wrong results: 0",
    ],
    "trio_pipeline.py": [
        "every one complete",
        "raised TimeoutError",
        "in flight after the abandoned waits: 0",
    ],  # fmt: skip
}
INTEROP = ["interop_cupy.py", "interop_torch.py", "interop_numba.py"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``python *args`` in ``examples/`` with the sanitizer on, in this process's
    environment: in CI's second pass (``CAI_STREAMS_SIM_DECOY=1``) the default
    backend is the decoy, which simulated kernels refuse, as on a GPU machine."""
    env = {**os.environ, "CAI_STREAMS_SANITIZE": "1"}
    return subprocess.run([sys.executable, *args], env=env, cwd=EXAMPLES,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def test_every_example_is_covered() -> None:
    found = {p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_")}
    assert found == set(EXPECTED) | set(INTEROP)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_runs(name: str) -> None:
    out = _run(str(EXAMPLES / name))
    assert out.returncode == 0, out.stdout + out.stderr
    for line in EXPECTED[name]:
        assert line in out.stdout, out.stdout


@pytest.mark.parametrize("name", INTEROP)
def test_interop_example(name: str) -> None:
    out = _run(str(EXAMPLES / name))
    assert out.returncode == 0, out.stdout + out.stderr
    if not HAS_GPU:
        assert "needs a CUDA GPU" in out.stdout
        return
    # each part checks its data and says so; a wrong answer exits 1
    parts = [line for line in out.stdout.splitlines() if line.startswith("part ")]
    assert [p.split(":", 1)[0] for p in parts] == ["part 1", "part 2", "part 3"], out.stdout
    assert all(p.endswith(": ok") for p in parts), out.stdout


@pytest.mark.skipif(
    not sim_decoy() or "CAI_STREAMS_BACKEND" in os.environ,
    reason="CI's second pass only (CAI_STREAMS_SIM_DECOY=1)",
)
def test_the_decoy_pass_runs_examples_on_the_decoy() -> None:
    """CI's second pass is not silently the first one again: this process and the
    examples it runs default to the decoy, so an example that assumes the default
    backend is the simulator fails here as it would on a GPU machine."""
    assert cs.current_backend().name == DECOY_NAME
    out = _run("-c", "import cai_streams as cs; print(cs.current_backend().name)")
    assert out.stdout.strip() == DECOY_NAME, out.stderr
