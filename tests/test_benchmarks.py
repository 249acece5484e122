"""benchmarks/run.py --quick: runs, and its JSON and table name every CPU-side peer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

RUN = Path(__file__).resolve().parents[1] / "benchmarks" / "run.py"

PEERS = {
    "handoff": {"cai_streams", "floor: read the interface", "floor: hand-written record + wait"},
    "waiting": {"cai_streams", "cai_streams low-latency", "to_thread", "poll 1 ms", "blocking"},
    "pipeline": {
        "cai_streams (await consume)",
        "blocking host wait",
        "ideal bound max(copy, compute)",
    },  # fmt: skip
    "sanitizer": {"cai_streams"},
}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_run_reports_every_peer(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(RUN), "--backend", "sim", "--quick",
                          "--out", str(tmp_path)], capture_output=True, text=True,
                         timeout=280)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    (report_file,) = tmp_path.glob("sim-*.json")
    report = json.loads(report_file.read_text())
    assert report["machine"]["cores"] and report["quick"] is True
    for benchmark, peers in PEERS.items():
        found = {r["method"] for r in report["results"] if r["benchmark"] == benchmark}
        assert found == peers, benchmark
        for peer in peers:
            assert f"| {benchmark} |" in out.stdout and f"| {peer} |" in out.stdout
    sizes = {r["case"] for r in report["results"] if r["benchmark"] == "waiting"}
    assert sizes == {"1 waiters", "100 waiters", "1000 waiters", "10000 waiters"}
    for r in report["results"]:
        for figure in r["figures"].values():
            assert set(figure) == {"median", "spread"}
    assert (tmp_path / report_file.name.replace(".json", ".png")).exists()


def test_cuda_says_what_is_missing() -> None:
    out = subprocess.run([sys.executable, str(RUN), "--backend", "cuda"], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2 and "need a session with a GPU" in out.stdout
