from __future__ import annotations

import subprocess
import sys

from cai_streams.__main__ import main


def test_demo_runs_and_reports() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "cai_streams", "demo", "--rounds", "3", "--seed", "7"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "jitter seed 7" in out.stdout
    assert "wrong sums: 0" in out.stdout


def test_demo_rejects_bad_rounds(capsys: object) -> None:
    try:
        main(["demo", "--rounds", "0"])
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError("--rounds 0 was accepted")
