"""python -m cai_streams demo: the pipeline, its summary, its trace and its timeline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import cai_streams as cs
from cai_streams import sim
from cai_streams.__main__ import main


def test_demo_runs_and_reports(tmp_path: Path) -> None:
    trace_file, png = tmp_path / "trace.json", tmp_path / "timeline.png"
    out = subprocess.run(
        [sys.executable, "-m", "cai_streams", "demo", "--batches", "12", "--seed", "7",
         "--trace", str(trace_file), "--plot", str(png)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "jitter seed 7" in out.stdout
    for row in ("batches", "throughput", "stream overlap", "host waits", "wake latency",
                "events", "wrong batches   0"):  # fmt: skip
        assert row in out.stdout, out.stdout
    assert "12/12 batches" in out.stderr  # the progress bar
    events = json.loads(trace_file.read_text())["traceEvents"]
    tracks = [e["args"]["name"] for e in events if e.get("name") == "thread_name"]
    assert tracks[0] == "host" and sum(t.startswith(("copy", "compute")) for t in tracks) == 3
    kernels = {e["name"] for e in events if e.get("cat") == "kernel"}
    assert kernels == {"h2d copy", "preprocess"}
    flows = [e for e in events if e["ph"] in ("s", "f")]
    assert any(e["ph"] == "f" for e in flows)  # arrows from records to their waits
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with cs.trace() as recording:
        pass
    with pytest.raises(RuntimeError, match=r"pip install 'cai-streams\[plot\]'"):
        recording.plot(tmp_path / "x.png")


def test_name_stream_takes_what_stream_wrap_takes_and_refuses_the_rest() -> None:
    """A str raised AttributeError from inside; a stream object of another
    kind (``__cuda_stream__``) was refused the same way."""

    class Foreign:
        def __init__(self, handle: int) -> None:
            self.handle = handle

        def __cuda_stream__(self) -> tuple[int, int]:
            return (0, self.handle)

    cs.use_backend("sim")
    s = cs.Stream()
    with cs.trace() as recording:
        recording.name_stream(Foreign(s.handle), "mine")
        recording.name_stream(1, "legacy")
        with pytest.raises(TypeError, match="cannot use str as a stream"):
            recording.name_stream("x", "label")
    assert "mine (" in recording._track(s._key())


def test_a_trace_names_the_librarys_own_streams_as_messages_do() -> None:
    """The export stream's track was a bare handle the user never made."""
    cs.use_backend("sim")
    s = cs.Stream()
    t = cs.track(sim.empty(8))
    with cs.trace() as recording:
        with t.writing(s):
            sim.launch(s, lambda x: x.fill(1), t.array, writes=[t.array])
        export = t.__cuda_array_interface__["stream"]
        cs.consume_blocking(t, timeout=10)
    tracks = {m[0] for m in recording.marks} | {span.track for span in recording.spans}
    assert tracks == {f"stream {s.handle:#x}", f"cai_streams' export stream {export:#x}"}


@pytest.mark.parametrize("option", ["--batches", "--buffers"])
def test_demo_rejects_bad_counts(option: str) -> None:
    with pytest.raises(SystemExit) as info:
        main(["demo", option, "0"])
    assert info.value.code == 2


def test_demo_on_cuda_says_it_is_simulated(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--backend", "cuda"]) == 2
    assert "--backend sim" in capsys.readouterr().out
