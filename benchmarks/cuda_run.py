"""``benchmarks/run.py --backend cuda``: every benchmark on a GPU, beside its GPU peers.

    python benchmarks/run.py --backend cuda [--quick] [--out DIR]

Four sections, each a list of rows in the sim run's format (``report.py``):

- handoff (``cuda_handoff.py``): host µs per parse, export with 0/1/3/8 pending
  streams, and consume in host and enqueue mode, beside driver-call floors
  (cuda.bindings) and the peers' own handoff (``cupy.asarray``,
  ``numba.cuda.as_cuda_array``, ``torch.as_tensor``, cuda.core's
  ``StridedMemoryView``);
- waiting (``cuda_waiting.py``): 1, 100, 1,000 and 10,000 waiters; wake latency
  from the GPU's own completion stamp, event-loop lag, CPU seconds and queries
  per wait, for cai_streams (default and low-latency polling), ``to_thread``,
  per-waiter 1 ms polling, a blocking synchronize, and numba-cuda's
  ``async_done`` (in a subprocess under a timeout: it can deadlock);
- pipeline (``cuda_pipeline.py``): the demo's data-loading pipeline with real
  copies and kernels, ``await cs.consume`` against a blocking consumer and the
  ideal bound, every batch's data checked;
- sanitizer: host cost per declared access (the kernels run on the simulated
  device: it is host bookkeeping, the same code on either backend).

Bounds. Every section has a wall-clock budget: it checks its guard between
cases and reports the cases it did not reach as rows noted "skipped"; every
device wait is bounded (gate kernels open themselves after a timeout, host
waits poll with a deadline, the numba subprocess is killed when a result does
not come). A watchdog ends the whole run at a hard limit (145 s with
``--quick``), writing the rows measured so far first. Progress lines are
printed (flushed) as each section starts, so a killed run shows where it was.

``--quick`` on an H100 took 75 s (setup 3 s, handoff 9 s, waiting 54 s of which
40 s for the subprocess, 15 s of that waiting on a case that deadlocked before
killing it, pipeline 2 s, sanitizer 1.5 s); budgets: handoff 20 s, waiting 75 s
(25 s of it kept for the subprocess), pipeline 20 s, sanitizer 10 s. Without
``--quick`` (3 repeats, twice the work per run) expect 3-5 minutes, 15 at most.

Without a usable CUDA device the run exits with status 2 and says why. The
test suite runs this same code on CPU with the simulated device standing in for
the GPU (``--stand-in``, for tests only): its report is named ``standin-sim-*``
and its figures are the simulator's, never GPU figures.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cai_streams as cs
from benchmarks import cuda_handoff, cuda_pipeline, cuda_waiting
from benchmarks.report import (
    CUDA_PACKAGES,
    Result,
    describe,
    machine,
    note_row,
    plot,
    result,
    table,
)
from cai_streams._backend import _backend_class


@dataclass
class Plan:
    """How much of each benchmark a run does, and its time budgets (seconds)."""

    sizes: list[int]
    wait_repeats: int
    work: float  # seconds of kernels per stream in the waiting benchmark
    handoff_calls: int
    handoff_repeats: int
    export_iterations: int
    batches: int
    pipeline_repeats: int
    sanitizer_launches: int
    sanitizer_repeats: int
    budgets: dict[str, float]
    hard_limit: float
    numba_reserve: float  # seconds of the waiting budget kept for the numba subprocess


def plan(quick: bool, stand_in: bool) -> Plan:
    sizes = [1, 100, 1000, 10000]
    if stand_in:
        return Plan(
            [1, 50],
            1,
            0.05,
            50,
            2,
            20,
            8,
            1,
            200,
            1,
            {"handoff": 30, "waiting": 60, "pipeline": 30, "sanitizer": 30},
            hard_limit=240,
            numba_reserve=0,
        )
    if quick:
        return Plan(
            sizes,
            1,
            0.2,
            1000,
            3,
            100,
            32,
            2,
            1000,
            1,
            {"handoff": 20, "waiting": 75, "pipeline": 20, "sanitizer": 10},
            hard_limit=145,
            numba_reserve=25,
        )
    return Plan(
        sizes,
        3,
        0.4,
        5000,
        5,
        300,
        96,
        3,
        4000,
        3,
        {"handoff": 90, "waiting": 480, "pipeline": 120, "sanitizer": 60},
        hard_limit=900,
        numba_reserve=60,
    )


@dataclass
class Guard:
    """A section's deadline: cases check it and are skipped once it has passed."""

    deadline: float

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def out_of_time(self) -> bool:
        return self.left() <= 0


@dataclass
class RunState:
    """Everything a run has so far: what the watchdog writes if it must cut."""

    started: float
    results: list[Result] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    section: str = "setup"
    failed: list[str] = field(default_factory=list)

    def say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.started:6.1f} s] {text}", flush=True)


SectionFn = Callable[[Any, Plan, Guard, RunState], None]


def run_section(
    state: RunState,
    name: str,
    budget: float,
    fn: SectionFn,
    device: Any,
    p: Plan,
    hard_deadline: float,
) -> None:
    """Run one section under its guard; a crash becomes a noted row, never the run's end."""
    budget = min(budget, hard_deadline - time.monotonic() - 5)
    state.section = name
    state.say(f"{name}: starting (budget {budget:.0f} s)")
    t0 = time.monotonic()
    before = len(state.results)
    guard = Guard(time.monotonic() + budget)
    if budget <= 0:
        state.results.append(
            note_row(name, "(section)", "all", "skipped: no time left before the hard limit")
        )
        state.say(f"{name}: skipped, no time left")
        return
    try:
        fn(device, p, guard, state)
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        state.results.append(note_row(name, "(section)", "all", f"failed: {describe(exc)}"))
        state.failed.append(f"{name}: {type(exc).__name__}: {exc}")
    took = time.monotonic() - t0
    over = " (over its budget)" if took > budget + 1 else ""
    state.notes.append(f"section {name}: {took:.1f} s of a {budget:.0f} s budget{over}")
    state.say(f"{name}: done in {took:.1f} s, {len(state.results) - before} rows")


# ---------------------------------------------------------------- sections


def handoff(device: Any, p: Plan, guard: Guard, state: RunState) -> None:
    rows = cuda_handoff.measure(
        device,
        n=p.handoff_calls,
        repeats=p.handoff_repeats,
        export_iterations=p.export_iterations,
        out_of_time=guard.out_of_time,
    )
    for case, method, figures, note in cuda_handoff.summary(rows):
        if figures is None:
            state.results.append(note_row("handoff", case, method, note))
        else:
            state.results.append(result("handoff", case, method, us=figures))


def _waiting_row(row: cuda_waiting.Row, spread: dict[str, float]) -> Result:
    figures = {k: v for k, v in vars(row).items() if k not in ("method", "waiters")}
    return {
        "benchmark": "waiting",
        "case": cuda_waiting.case(row.waiters),
        "method": row.method,
        "figures": {k: {"median": v, "spread": spread[k]} for k, v in figures.items()},
    }


def waiting(device: Any, p: Plan, guard: Guard, state: RunState) -> None:
    reserve = p.numba_reserve

    def in_process_out_of_time() -> bool:
        return guard.left() <= reserve

    def on_row(row: cuda_waiting.Row, spread: dict[str, float]) -> None:
        state.results.append(_waiting_row(row, spread))

    def on_note(method: str, n: int, note: str) -> None:
        state.results.append(note_row("waiting", cuda_waiting.case(n), method, note))

    for n in p.sizes:
        state.say(f"waiting: {cuda_waiting.case(n)}")
        cuda_waiting.run(
            device,
            [n],
            p.wait_repeats,
            p.work,
            on_row=on_row,
            on_note=on_note,
            out_of_time=in_process_out_of_time,
        )
    names = cuda_waiting.CHILD_METHODS
    budget = guard.left() - 1
    why = ""
    if device.name != "cuda":
        why = f"not run on the {device.name}: it needs a GPU"
    elif budget < 8:
        why = "skipped: the section's time budget was spent"
    if why:
        for n in p.sizes:
            for name in names:
                state.results.append(note_row("waiting", cuda_waiting.case(n), name, why))
        return
    state.say(f"waiting: {', '.join(names)} in a subprocess (at most {budget:.0f} s)")
    child = cuda_waiting.child_rows(p.sizes, p.wait_repeats, p.work, budget)
    for n in p.sizes:
        for name in names:
            if (name, n) in child.rows:
                state.results.append(_waiting_row(*child.rows[(name, n)]))
            else:
                note = child.errors.get((name, n), "no result")
                state.results.append(note_row("waiting", cuda_waiting.case(n), name, note))


def pipeline(device: Any, p: Plan, guard: Guard, state: RunState) -> None:
    elements = device.pipeline_elements(cuda_pipeline.COPY_TARGET)
    figures = cuda_pipeline.run(
        device,
        batches=p.batches,
        repeats=p.pipeline_repeats,
        elements=elements,
        out_of_time=guard.out_of_time,
    )
    ideal = figures.ideal
    for method in cuda_pipeline.CONSUMERS:
        per = figures.per_second[method]
        if per:
            state.results.append(
                result(
                    "pipeline",
                    figures.case,
                    method,
                    batches_per_s=per,
                    pct_of_ideal=[100 * v / ideal for v in per],
                    wrong=[figures.wrong[method]],
                )
            )
            if figures.wrong[method]:
                state.failed.append(f"pipeline: {method}: {figures.wrong[method]} wrong batches")
        else:
            state.results.append(
                note_row("pipeline", figures.case, method, figures.failed.get(method, "no run"))
            )
        if method in figures.failed and per:
            state.notes.append(f"pipeline {method}: {figures.failed[method]}")
    state.results.append(
        result(
            "pipeline",
            figures.case,
            "ideal bound (slowest stage × batches)",
            batches_per_s=[ideal],
            copy_ms=[figures.copy_s * 1e3],
            compute_ms=[figures.compute_s * 1e3],
        )
    )


def sanitizer(device: Any, p: Plan, guard: Guard, state: RunState) -> None:
    from benchmarks import bench_sanitizer

    previous = cs.current_backend().name
    try:
        runs: list[dict[str, float]] = []
        for _ in range(p.sanitizer_repeats):
            if guard.out_of_time() and runs:
                break
            runs.append(bench_sanitizer.run(p.sanitizer_launches))
    finally:
        cs.use_backend(previous)
    state.results.append(
        result(
            "sanitizer",
            "declared access",
            "cai_streams (host cost; kernels on the sim device)",
            per_access_us=[r["per_access_us"] for r in runs],
            launch_off_us=[r["launch_off_us"] for r in runs],
            launch_on_us=[r["launch_on_us"] for r in runs],
        )
    )


SECTIONS: tuple[tuple[str, SectionFn], ...] = (
    ("handoff", handoff),
    ("waiting", waiting),
    ("pipeline", pipeline),
    ("sanitizer", sanitizer),
)


# ---------------------------------------------------------------- the run


def unavailable_message(reason: str) -> str:
    return (
        f"benchmarks/run.py --backend cuda needs a usable CUDA device, and here there is "
        f"none: {reason}. The cuda run measures cai_streams on a GPU beside its GPU peers "
        "(CuPy, PyTorch, Numba, cuda.core), so it does not fall back to the simulator. Run "
        "it on a machine with an NVIDIA GPU, its driver, cuda-bindings and CuPy (PyTorch, "
        "numba-cuda and cuda.core add their peers' rows): `python benchmarks/run.py --backend "
        "cuda [--quick] --out DIR`, or the whole GPU tier with `scripts/gpu-check.sh` (see "
        "docs/gpu.md). Without a GPU, `python benchmarks/run.py --backend sim` runs the same "
        "benchmarks on the simulated device."
    )


def _write(
    state: RunState, out: Path, stem: str, date: str, quick: bool, backend: str, partial: str = ""
) -> tuple[Path, bool]:
    out.mkdir(parents=True, exist_ok=True)
    results = list(state.results)
    notes = list(state.notes) + ([partial] if partial else [])
    report = {
        "backend": backend,
        "quick": quick,
        "date": date,
        "seconds": time.monotonic() - state.started,
        "machine": machine(CUDA_PACKAGES),
        "device": state.info,
        "notes": notes,
        "complete": not partial,
        "results": results,
    }
    path = out / f"{stem}.json"
    path.write_text(json.dumps(report, indent=1))
    print(table(results), flush=True)
    for note in notes:
        print(f"- {note}")
    try:
        plotted = plot(results, out / f"{stem}.png")
    except Exception as exc:
        print(f"no plot: {type(exc).__name__}: {exc}")
        plotted = False
    return path, plotted


def _device(stand_in: bool, state: RunState) -> Any:
    from benchmarks.cuda_device import CudaDevice, SimStandIn

    if stand_in:
        device: Any = SimStandIn()
        state.info.update({"name": device.name, "gpu": device.gpu})
        return device
    cs.use_backend("cuda")
    device = CudaDevice()
    device.mark()
    cap = device.pending_record_cap()
    state.info.update(
        {
            "name": device.name,
            "gpu": device.gpu,
            "multiprocessors": device.sms,
            "globaltimer_step_ns": device.timer_step_ns(),
            "clock_bracket_us": round(device.clock_uncertainty_us(), 2),
            "to_thread_limiter": cuda_waiting.thread_limiter_size(),
            "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8"),
            "event_records_a_held_stream_holds": cap,
            "waiting_events_per_stream": cuda_waiting.set_events_per_stream(
                cuda_waiting.usable_events_per_stream(cap)
            ),
        }
    )
    try:
        import subprocess

        smi = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,clocks.max.sm",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=10,
        )
        state.info["nvidia_smi"] = smi.stdout.strip()
    except Exception as exc:
        state.info["nvidia_smi"] = f"unavailable: {type(exc).__name__}"
    return device


def main(*, quick: bool, out: Path, stand_in: bool = False) -> int:
    """Run every section on the GPU (or the stand-in); 0 when the report is written
    and cai_streams' own rows ran and were right, 1 otherwise, 2 without a GPU."""
    if not stand_in:
        # One hardware queue per stream (up to 32; the default is 8): the waiting
        # benchmark's 16 streams then never wait behind each other's kernels.
        # Read when the context is made, so set before anything touches CUDA.
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
        reason = _backend_class("cuda").unavailable_reason()
        if reason is not None:
            print(unavailable_message(reason), flush=True)
            return 2
    p = plan(quick, stand_in)
    state = RunState(started=time.monotonic())
    hard_deadline = state.started + p.hard_limit
    date = datetime.date.today().isoformat()
    stem = f"standin-sim-{date}" if stand_in else f"cuda-{date}"
    backend = "sim stand-in (not GPU figures)" if stand_in else "cuda"
    state.say(
        f"cuda benchmarks{' (sim stand-in)' if stand_in else ''}: "
        f"{'quick, ' if quick else ''}hard limit {p.hard_limit:.0f} s; report {out / stem}.json"
    )
    done = threading.Event()

    def watchdog() -> None:
        if done.wait(max(0.0, hard_deadline - time.monotonic())):
            return
        print(
            f"\n!! hard time limit ({p.hard_limit:.0f} s) reached in section "
            f"{state.section!r}: writing the rows measured so far, then exiting",
            flush=True,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        try:
            _write(
                state,
                out,
                stem,
                date,
                quick,
                backend,
                partial=f"cut by the hard time limit in section {state.section!r}",
            )
        finally:
            sys.stdout.flush()
            os._exit(3)

    threading.Thread(target=watchdog, name="benchmark watchdog", daemon=True).start()
    try:
        try:
            state.say("setup: device, kernels, clock calibration")
            device = _device(stand_in, state)
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            print(
                f"the cuda benchmarks could not set up the device ({type(exc).__name__}: "
                f"{exc}); on a GPU they need CuPy (pip install cupy-cuda13x) and "
                "cuda-bindings",
                flush=True,
            )
            return 2
        state.say(f"device: {json.dumps(state.info)}")
        for name, fn in SECTIONS:
            run_section(state, name, p.budgets[name], fn, device, p, hard_deadline)
        done.set()
        for r in state.results:  # cai_streams' own rows must run: a failure is the run's
            if r["method"].startswith("cai_streams") and r.get("note", "").startswith("failed"):
                state.failed.append(f"{r['benchmark']}: {r['case']}: {r['method']}: {r['note']}")
        path, plotted = _write(state, out, stem, date, quick, backend)
        print(f"\nwrote {path}" + (f" and {stem}.png" if plotted else ""), flush=True)
        for failure in state.failed:
            print(f"!! {failure}", flush=True)
        return 1 if state.failed else 0
    finally:
        done.set()
