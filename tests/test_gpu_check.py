"""scripts/gpu-check.sh --dry-run: the GPU tier's plumbing, on a machine without one.

A GPU machine is lent rarely and briefly, so everything but the device is proven
here: wheels installed into a target directory and found through PYTHONPATH
(their entry points too, as pytest-asyncio's is), the project run from
PYTHONPATH with its pytest plugin loaded by module, the versions printed, the
log written into $OUT as the run goes, and the cuda benchmarks refusing clearly.
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu-check.sh"

_PROBE = """
def pytest_sessionstart(session):
    session.config.get_terminal_writer().line("caiprobe plugin loaded from " + __file__)
"""


def _probe_wheel(directory: Path) -> Path:
    """A minimal wheel whose module is a pytest plugin (entry point pytest11)."""
    dist = "caiprobe-0.1.dist-info"
    files = {
        "caiprobe.py": _PROBE,
        f"{dist}/METADATA": "Metadata-Version: 2.1\nName: caiprobe\nVersion: 0.1\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
        f"{dist}/entry_points.txt": "[pytest11]\ncaiprobe = caiprobe\n",
    }
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{name},sha256={digest.decode()},{len(text.encode())}")
    record.append(f"{dist}/RECORD,,")
    path = directory / "caiprobe-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, text in files.items():
            wheel.writestr(name, text)
        wheel.writestr(f"{dist}/RECORD", "\n".join(record) + "\n")
    return path


@pytest.mark.slow
def test_dry_run_exercises_everything_but_the_device(tmp_path: Path) -> None:
    wheels, out = tmp_path / "wheels", tmp_path / "out"
    wheels.mkdir()
    _probe_wheel(wheels)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAI_STREAMS_")}
    env.update(
        PYTHON=sys.executable, WHEELS=str(wheels), OUT=str(out), GPU_CHECK_BUDGET="300",
        TMPDIR=str(tmp_path),
    )  # fmt: skip
    run = subprocess.run(["bash", str(SCRIPT), "--dry-run"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=330)  # fmt: skip
    logs = list(out.glob("*-dry-run.txt"))
    assert len(logs) == 1, run.stdout + run.stderr
    log = logs[0].read_text()
    assert run.returncode == 0, log + run.stderr
    assert log == run.stdout  # the file in $OUT is the whole log, written as it went
    assert "DRY RUN" in log and "installed: caiprobe-0.1" in log
    assert f"caiprobe plugin loaded from {tmp_path}" in log  # entry point via PYTHONPATH
    assert f"cai_streams from {ROOT / 'cai_streams'}" in log
    for dist in ("numpy", "cuda-bindings", "pytest", "pytest-asyncio", "anyio", "trio"):
        assert f"  {dist} " in log or f"  {dist}: not installed" in log
    assert "2 passed" in log  # the plugin's fixture, by -p; pytest-asyncio's marker
    assert "benchmarks/run.py --backend cuda without a device: exit 2" in log
    assert "gpu-check: PASSED" in log
    assert not (ROOT / "docs" / "gpu-runs" / logs[0].name).exists()


def test_dry_run_refuses_unknown_arguments() -> None:
    run = subprocess.run(["bash", str(SCRIPT), "--wet"], capture_output=True, text=True,
                         timeout=30)  # fmt: skip
    assert run.returncode == 2 and "usage" in run.stderr
