"""The report of ``benchmarks/run.py``: rows, the table, the plot and the machine.

A result row is ``{"benchmark", "case", "method", "figures": {name: {"median",
"spread"}}}``, each figure the median of its repeats with its spread (max -
min). A row that could not be measured (a peer that failed, deadlocked or is
unavailable, a case cut short by its section's time budget) has no figures and
a ``"note"`` saying why, so a run never loses a row silently.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

import cai_streams as cs

Figure = dict[str, float]  # {"median": ..., "spread": ...}
Result = dict[str, Any]  # {"benchmark", "case", "method", "figures": {name: Figure}[, "note"]}

SIM_PACKAGES = ("numpy", "anyio", "trio", "cuda-python", "cupy-cuda12x", "matplotlib")
CUDA_PACKAGES = (
    "numpy",
    "anyio",
    "uvloop",
    "trio",
    "cuda-bindings",
    "cuda-core",
    "cupy-cuda13x",
    "cupy-cuda12x",
    "torch",
    "numba",
    "numba-cuda",
    "matplotlib",
)


def describe(exc: BaseException, limit: int = 300) -> str:
    """``Type: message`` of an exception; an exception group by its first leaf
    (the error inside a task group, not the group)."""
    inner: BaseException = exc
    while getattr(inner, "exceptions", None):
        inner = inner.exceptions[0]  # type: ignore[attr-defined]
    return f"{type(inner).__name__}: {str(inner)[:limit]}"


def fig(values: Sequence[float]) -> Figure:
    return {"median": float(np.median(values)), "spread": float(max(values) - min(values))}


def result(benchmark: str, case: str, method: str, **figures: Sequence[float]) -> Result:
    return {
        "benchmark": benchmark,
        "case": case,
        "method": method,
        "figures": {k: fig(v) for k, v in figures.items()},
    }


def note_row(benchmark: str, case: str, method: str, note: str) -> Result:
    """A row without figures: why this method or case was not measured."""
    return {"benchmark": benchmark, "case": case, "method": method, "figures": {}, "note": note}


def machine(packages: Sequence[str] = SIM_PACKAGES) -> dict[str, Any]:
    versions = {}
    for package in packages:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "cai_streams": cs.__version__,
        "packages": versions,
    }


def table(results: Sequence[Result]) -> str:
    lines = ["| benchmark | case | method | figures (median ± spread) |", "|---|---|---|---|"]
    for r in results:
        figs = ", ".join(
            f"{k} {v['median']:.3g} ± {v['spread']:.2g}" for k, v in r["figures"].items()
        )
        if not figs:
            figs = str(r.get("note", ""))
        lines.append(f"| {r['benchmark']} | {r['case']} | {r['method']} | {figs} |")
    return "\n".join(lines)


def plot(results: Sequence[Result], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is not installed (pip install 'cai-streams[plot]')")
        return False
    keys = ("wake_p99_ms", "lag_p99_ms")
    rows = [  # asyncio's rows ("N waiters"); other loops' cases name their loop
        r
        for r in results
        if r["benchmark"] == "waiting"
        and "," not in r["case"]
        and all(k in r["figures"] for k in keys)
    ]
    fig_, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        n = [int(r["case"].split()[0]) for r in mine]
        for ax, key in zip(axes, keys, strict=True):
            ax.plot(
                n, [max(r["figures"][key]["median"], 1e-3) for r in mine], marker="o", label=method
            )
    for ax, title in zip(axes, ("wake latency p99 (ms)", "event-loop lag p99 (ms)"), strict=True):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("concurrent waiters")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize="small")
    fig_.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig_)
    return True
