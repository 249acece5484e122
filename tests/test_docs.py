"""The documentation site builds with every warning an error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_docs_build_cleanly(tmp_path: Path) -> None:
    pytest.importorskip("sphinx")
    pytest.importorskip("myst_parser")
    out = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         str(DOCS), str(tmp_path / "html")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    api = (tmp_path / "html" / "api.html").read_text()
    for name in ("consume", "consuming", "track", "export", "sanitize", "PollPolicy"):
        assert f'<span class="pre">{name}</span>' in api, name
    assert (tmp_path / "html" / "_images" / "timeline.png").exists()
