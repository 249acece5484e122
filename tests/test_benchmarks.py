"""benchmarks/run.py --quick: runs, and its JSON and table name every CPU-side peer."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import bench_consume, bench_hot, cuda_handoff, cuda_pipeline, cuda_run, cuda_waiting
from benchmarks.report import note_row
from cai_streams._backend import _backend_class

RUN = Path(__file__).resolve().parents[1] / "benchmarks" / "run.py"

PEERS = {
    "handoff": {
        "cai_streams",
        "floor: read the interface",
        "floor: hand-written record + wait",
        "floor: read the interface + one query",
    },
    "waiting": set(bench_consume.METHODS),  # every method, the poller without the doorbell too
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
    assert {"1 waiters", "100 waiters", "1000 waiters", "10000 waiters"} <= sizes
    assert {"1 waiters, trio", "100 waiters, trio"} <= sizes  # other event loops too
    for r in report["results"]:
        for figure in r["figures"].values():
            assert set(figure) == {"median", "spread"}
    assert (tmp_path / report_file.name.replace(".json", ".png")).exists()


def test_hot_path_rows_each_have_a_floor_and_the_required_steps_run() -> None:
    rows = bench_hot.main(repeats=1, n=5)
    assert {case for case, *_ in rows} >= set(bench_hot.GOALS)
    for case, us, floor, ratio, least in rows:
        assert us > 0 and floor > 0 and ratio > 0, case
        # a required ratio for each unmet goal's row (parse, enqueue, untracked host)
        assert (least is not None) == (case in bench_hot.GOALS and "tracked, complete" not in case)


def test_cuda_says_what_is_missing() -> None:
    """Without a usable device: exit 2 and one paragraph naming the reason, no traceback."""
    reason = _backend_class("cuda").unavailable_reason()
    if reason is None:
        pytest.skip("a CUDA device is usable here")
    out = subprocess.run([sys.executable, str(RUN), "--backend", "cuda"], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    text = out.stdout.strip()
    assert "\n" not in text  # one paragraph
    assert reason in text
    assert "scripts/gpu-check.sh" in text and "--backend sim" in text


CUDA_PEERS = {
    "handoff": {
        "cai_streams",
        "floor: read the interface",
        "cai_streams consume_blocking(obj)",
        "cai_streams consume_blocking(obj, stream=s)",
        "cai_streams consume_blocking(t)",
        *cuda_handoff.PEERS,
    },
    "waiting": {
        "cai_streams",
        "cai_streams doorbell",
        "cai_streams low-latency",
        "poll 1 ms",
        "blocking",
        cuda_waiting.PIPE_METHOD,
        *cuda_waiting.CHILD_METHODS,
    },
    "pipeline": {*cuda_pipeline.CONSUMERS, "ideal bound (slowest stage × batches)"},
    "sanitizer": {"cai_streams (host cost; kernels on the sim device)"},
}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cuda_code_path_runs_with_the_simulator_standing_in(tmp_path: Path) -> None:
    """The cuda run's own code (sections, guards, rows, JSON, table, plot) on CPU.

    The report is named and labelled as the stand-in's, never as GPU figures; GPU
    peers and the numba subprocess are rows saying they were not measured.
    """
    out = subprocess.run([sys.executable, str(RUN), "--backend", "cuda", "--stand-in", "--quick",
                          "--out", str(tmp_path)], capture_output=True, text=True,
                         timeout=280)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert not list(tmp_path.glob("cuda-*")), "stand-in figures must not pass as GPU figures"
    (report_file,) = tmp_path.glob("standin-sim-*.json")
    assert (tmp_path / report_file.name.replace(".json", ".png")).exists()
    report = json.loads(report_file.read_text())
    assert report["backend"].startswith("sim stand-in") and report["complete"] is True
    for section in ("handoff", "waiting", "pipeline", "sanitizer"):
        assert f"] {section}: starting" in out.stdout  # progress lines
    for benchmark, peers in CUDA_PEERS.items():
        rows = [r for r in report["results"] if r["benchmark"] == benchmark]
        assert peers <= {r["method"] for r in rows}, benchmark
        for r in rows:
            assert r["figures"] or r["note"], r
            for figure in r["figures"].values():
                assert set(figure) == {"median", "spread"}
            assert f"| {r['method']} |" in out.stdout
    by = {(r["benchmark"], r["method"], r["case"]): r for r in report["results"]}
    for name in cuda_handoff.PEERS:
        (row,) = [r for k, r in by.items() if k[:2] == ("handoff", name)]
        assert "not measured on the sim stand-in" in row["note"]
    waiting = [r for r in report["results"] if r["benchmark"] == "waiting" and r["figures"]]
    assert {r["case"] for r in waiting} == {"1 waiters", "50 waiters"}
    for r in waiting:
        assert r["figures"]["early"]["median"] == 0, r  # nobody resumed before its work ended
        assert r["figures"]["wake_p50_ms"]["median"] >= 0
    pipeline = [r for r in report["results"] if r["benchmark"] == "pipeline" and "wrong" in
                r["figures"]]  # fmt: skip
    assert len(pipeline) == 2 and all(r["figures"]["wrong"]["median"] == 0 for r in pipeline)


def test_a_crashing_section_is_a_row_and_an_overrun_is_cut() -> None:
    """A section that raises becomes a noted row; cases past the budget are skipped."""
    state = cuda_run.RunState(started=time.monotonic())
    p = cuda_run.plan(quick=True, stand_in=True)

    def crash(device: object, p: cuda_run.Plan, guard: cuda_run.Guard,
              state: cuda_run.RunState) -> None:  # fmt: skip
        raise RuntimeError("boom")

    seen: list[bool] = []

    def slow(device: object, p: cuda_run.Plan, guard: cuda_run.Guard,
             state: cuda_run.RunState) -> None:  # fmt: skip
        for _ in range(50):
            seen.append(guard.out_of_time())
            if seen[-1]:
                state.results.append(note_row("slow", "case", "m", "skipped: budget spent"))
                return
            time.sleep(0.02)

    far = time.monotonic() + 100
    cuda_run.run_section(state, "crash", 10, crash, None, p, far)
    cuda_run.run_section(state, "slow", 0.2, slow, None, p, far)
    cuda_run.run_section(state, "late", 10, slow, None, p, time.monotonic() + 1)
    assert state.results[0]["note"] == "failed: RuntimeError: boom"
    assert state.failed == ["crash: RuntimeError: boom"]
    assert seen[-1] is True and len(seen) < 50
    assert state.results[1]["note"] == "skipped: budget spent"
    assert state.results[2]["note"].startswith("skipped: no time left")
    assert len(state.notes) == 2  # the two sections that ran


def _child(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_subprocess_rows_deadlock_and_failure() -> None:
    """The numba subprocess's harness: rows as they come, a hang becomes "deadlocked"
    (after a stack dump), an exit without rows becomes "failed"."""
    row = {"method": "m", "waiters": 1, "row": {"method": "m", "waiters": 1,
           "wake_p50_ms": 1.0, "wake_p99_ms": 1.0, "wake_max_ms": 1.0, "lag_p99_ms": 0.0,
           "lag_max_ms": 0.0, "cpu_s": 0.1, "queries_per_wait": 0.0, "early": 0.0,
           "wall_s": 0.2}, "spread": {}}  # fmt: skip
    hang = _child(
        "import faulthandler, json, signal, sys, time\n"
        "faulthandler.register(signal.SIGUSR1, all_threads=True)\n"
        f"print(json.dumps({row!r}), flush=True)\n"
        "time.sleep(60)\n"
    )
    start = time.monotonic()
    got = cuda_waiting.run_child(hang, [("m", 1), ("m", 100), ("m", 1000)], first_timeout=20,
                                 next_timeout=1.0, total_timeout=30)  # fmt: skip
    assert time.monotonic() - start < 15
    assert got.rows[("m", 1)][0].wake_p50_ms == 1.0
    assert got.errors[("m", 100)].startswith("deadlocked: no result within 1 s, killed")
    assert "line 4" in got.errors[("m", 100)]  # the child's stack, where it hung
    assert got.errors[("m", 1000)] == (
        "not measured: the subprocess was killed while it measured m with 100 waiters"
    )

    crash = _child("import sys; sys.exit('no GPU here')")
    got = cuda_waiting.run_child(crash, [("m", 1), ("m", 100)], first_timeout=20,
                                 next_timeout=5, total_timeout=30)  # fmt: skip
    assert not got.rows
    assert got.errors[("m", 1)].startswith("failed: exit code 1")
    assert "no GPU here" in got.errors[("m", 1)]

    err = _child('print(\'{"method": "m", "waiters": 1, "error": "CudaError: boom"}\')')
    got = cuda_waiting.run_child(err, [("m", 1)], first_timeout=20, next_timeout=5,
                                 total_timeout=30)  # fmt: skip
    assert got.errors == {("m", 1): "failed: CudaError: boom"}


def test_waiting_layout_stays_inside_what_a_held_stream_holds() -> None:
    """Pending events a stream are capped (the driver blocks a record beyond what a
    hardware queue holds, ~56 for blocking-sync events on an H100); waiters beyond
    the cap share events, and the case says so."""
    default = cuda_waiting.MAX_KERNELS // cuda_waiting.STREAMS
    try:
        assert cuda_waiting.set_events_per_stream(10_000) == default
        assert cuda_waiting.layout(1) == (1, 1, 1)
        assert cuda_waiting.layout(1000) == (16, 1000, 1)
        streams, events, group = cuda_waiting.layout(10_000)
        assert events <= cuda_waiting.MAX_KERNELS and events * group >= 10_000
        assert cuda_waiting.case(10_000) == f"10000 waiters ({group} share each of {events} events)"
        cap = cuda_waiting.set_events_per_stream(cuda_waiting.usable_events_per_stream(56))
        assert cap == 42
        assert cuda_waiting.layout(100) == (16, 100, 1)
        streams, events, group = cuda_waiting.layout(1000)
        assert events / streams <= cap and events * group >= 1000 and group == 2
        assert cuda_waiting.case(100) == "100 waiters"
    finally:
        cuda_waiting.set_events_per_stream(default)


def test_a_method_is_not_run_above_its_most_waiters(monkeypatch: pytest.MonkeyPatch) -> None:
    """A method with ``max_waiters`` runs up to that size and is a note above it
    (the pipe peer: held streams block the host beyond a few dozen host functions)."""
    ran: list[tuple[str, int]] = []

    async def one_run(device: object, name: str, method: object, n: int, seed: int,
                      work: float) -> cuda_waiting.Row:  # fmt: skip
        ran.append((name, n))
        return cuda_waiting.Row(name, n, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)

    async def wait(token: object, stream: object) -> None:
        pass

    capped = cuda_waiting.Method(lambda s: None, wait, max_waiters=(10, "why not"))
    free = cuda_waiting.Method(lambda s: None, wait)
    monkeypatch.setattr(cuda_waiting, "methods", lambda: {"capped": capped, "free": free})
    monkeypatch.setattr(cuda_waiting, "one_run", one_run)
    rows: list[tuple[str, int]] = []
    notes: list[tuple[str, int, str]] = []
    cuda_waiting.run(object(), [1, 10, 100], 1, 0.0,  # type: ignore[arg-type]
                     on_row=lambda row, _: rows.append((row.method, row.waiters)),
                     on_note=lambda m, n, note: notes.append((m, n, note)))  # fmt: skip
    assert ran == rows == [("capped", 1), ("free", 1), ("capped", 10), ("free", 10), ("free", 100)]
    assert notes == [("capped", 100, "not measured above 10 waiters: why not")]


def test_cuda_modules_import_without_a_gpu() -> None:
    """Every benchmark module imports with no cupy, torch or numba (they are
    imported inside the cuda code paths only)."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('cupy', 'torch', 'numba'):\n"
        "            raise ImportError(name + ' is blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from benchmarks import run, cuda_run, cuda_device, cuda_waiting, cuda_handoff\n"
        "from benchmarks import cuda_pipeline, report\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=RUN.parents[1])  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
