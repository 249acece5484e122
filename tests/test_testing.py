"""The pytest plugin users put on their own tests: run the documented example."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import cai_streams as cs
from cai_streams import sim
from cai_streams.testing import simulated

DOC = Path(__file__).resolve().parents[1] / "docs" / "testing.md"


def _example() -> str:
    text = DOC.read_text()
    found = re.search(r"<!-- testing-example -->\n```python\n(.*?)```", text, re.S)
    assert found, "docs/testing.md lost its example"
    return found.group(1)


def _pytest(tmp_path: Path, source: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_example.py").write_text(source)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAI_STREAMS_")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_the_documented_example_passes(tmp_path: Path) -> None:
    out = _pytest(tmp_path, _example())
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 passed" in out.stdout


def test_without_the_marker_the_race_goes_unnoticed(tmp_path: Path) -> None:
    """The control: the marker is what turns the sanitizer on."""
    source = _example().replace("@pytest.mark.cai_sim(seed=1)\n", "")
    out = _pytest(tmp_path, source)
    assert out.returncode == 1 and "DID NOT RAISE" in out.stdout, out.stdout


def test_simulated_restores_what_it_changed() -> None:
    device = sim.device()
    before = (cs.current_backend(), device.jitter, device.seed, cs.sanitizing())
    with cs.sanitize(False), simulated(jitter=0.01, seed=7) as inside:
        assert inside is device and cs.current_backend() is device
        assert (device.jitter, device.seed) == (0.01, 7) and cs.sanitizing()
    assert (cs.current_backend(), device.jitter, device.seed, cs.sanitizing()) == before
    with pytest.raises(ValueError, match="jitter"):
        with simulated(jitter=-1):
            pass
