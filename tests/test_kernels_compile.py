"""Every CUDA C source in the repository compiles for sm_90 (H100 / H200).

A GPU is lent rarely; a syntax error in a kernel must not wait for one. Kernels
live in ``.cu`` files (loaded with ``cupy.RawModule`` on a GPU), never inline in
Python, so this test sees all of them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_SKIP_DIRS = {".git", ".venv", "build", "dist", "node_modules", ".whl"}


def _sources(suffixes: tuple[str, ...]) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")]
        found += [Path(dirpath) / f for f in filenames if f.endswith(suffixes)]
    return sorted(found)


CU_FILES = _sources((".cu",))


def test_kernels_live_in_cu_files() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in CU_FILES}
    assert "tests/kernels/device_ops.cu" in names
    inline = [
        p.relative_to(ROOT).as_posix()
        for p in _sources((".py",))
        if p != Path(__file__).resolve() and "__global__" in p.read_text(errors="replace")
    ]
    assert inline == [], "CUDA C inside Python escapes the compile check: move it to a .cu file"


@pytest.mark.parametrize("source", CU_FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_compiles_for_sm_90(source: Path, tmp_path: Path) -> None:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        if os.environ.get("CI"):
            pytest.fail("nvcc is not on PATH in CI: kernels would first compile on a GPU")
        pytest.skip("nvcc is not on PATH")
    run = subprocess.run(
        [nvcc, "-arch=sm_90", "-std=c++17", "-Werror", "all-warnings", "-c", str(source),
         "-o", str(tmp_path / "k.o")],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
