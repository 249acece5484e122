"""Choosing the backend: environment, default, errors, and the one INFO line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import cai_streams as cs


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k != "CAI_STREAMS_BACKEND"}
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
