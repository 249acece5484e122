"""The pytest plugin users put on their own tests: run the documented example."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterable, Sequence
from importlib.metadata import EntryPoint, entry_points
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


PLUGIN = "cai_streams.testing"


def _plugin_args(entry_points: Iterable[EntryPoint]) -> list[str]:
    """``-p cai_streams.testing`` unless a ``pytest11`` entry point loads the plugin.

    Installed, the package's entry point loads it, and pluggy refuses the same
    module under a second name ("Plugin already registered under a different
    name"); run from ``PYTHONPATH`` (as on a GPU machine) there is no entry point.
    """
    if any(ep.module == PLUGIN for ep in entry_points):
        return []
    return ["-p", PLUGIN]


def _pytest(
    tmp_path: Path, source: str, *args: str, plugin: Sequence[str] | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run pytest on ``source`` in a child, with the plugin (``plugin``: these
    arguments instead of :func:`_plugin_args`), the decoy switch (so the second
    CI pass reaches the child) and ``env``, but none of this process's other
    ``CAI_STREAMS_*`` settings."""
    (tmp_path / "test_example.py").write_text(source)
    full = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("CAI_STREAMS_") or k == "CAI_STREAMS_SIM_DECOY"
    }
    full.update(env)
    if plugin is None:
        plugin = _plugin_args(entry_points(group="pytest11"))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin, *args,
         str(tmp_path)],
        cwd=tmp_path, env=full, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_the_documented_example_passes(tmp_path: Path) -> None:
    out = _pytest(tmp_path, _example())
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 passed" in out.stdout


def test_without_the_marker_the_race_goes_unnoticed(tmp_path: Path) -> None:
    """The control: the marker is what turns the sanitizer on. Without it the
    test runs on the default backend, so the child makes that the simulator
    (on a GPU machine it would be cuda, whose streams simulated kernels refuse)."""
    source = _example().replace("@pytest.mark.cai_sim(seed=1)\n", "")
    out = _pytest(tmp_path, source, CAI_STREAMS_BACKEND="sim")
    assert out.returncode == 1 and "DID NOT RAISE" in out.stdout, out.stdout


def test_the_plugin_is_named_on_the_command_line_only_without_an_entry_point() -> None:
    installed = EntryPoint("cai_streams", PLUGIN, "pytest11")
    other = EntryPoint("timeout", "pytest_timeout", "pytest11")
    assert _plugin_args([other, installed]) == []
    assert _plugin_args([other]) == ["-p", PLUGIN]
    assert _plugin_args([]) == ["-p", PLUGIN]


def test_the_documented_example_passes_without_the_entry_point(tmp_path: Path) -> None:
    """As from PYTHONPATH on a GPU machine: with the entry point's plugin blocked
    (``-p no:cai_streams``) the fixture is missing, and ``-p`` brings it back."""
    no_entry_point = ("-p", "no:cai_streams")
    control = _pytest(tmp_path, _example(), *no_entry_point, plugin=[])
    assert control.returncode != 0, control.stdout
    assert "fixture 'cai_sim' not found" in control.stdout, control.stdout
    out = _pytest(tmp_path, _example(), *no_entry_point, plugin=_plugin_args([]))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 passed" in out.stdout


def test_naming_an_installed_plugin_again_is_refused(tmp_path: Path) -> None:
    """Why ``_plugin_args`` checks the entry points: pluggy refuses the module a
    second time under another name."""
    if _plugin_args(entry_points(group="pytest11")):
        pytest.skip("cai_streams is not installed here: no pytest11 entry point")
    out = _pytest(tmp_path, _example(), plugin=["-p", PLUGIN])
    assert out.returncode != 0
    assert "already registered under a different name" in out.stdout + out.stderr


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


_UNRELATED = """
import sys

import pytest


def test_plain(request):
    assert "cai_streams.testing" in sys.modules  # the plugin is loaded...
    ours = [n for n in request.fixturenames if "cai" in n]
    assert ours == [], ours  # ...and applies nothing to a test that does not ask


@pytest.mark.cai_sim(seed=3)
def test_marked(request):
    import cai_streams as cs

    assert "cai_sim" in request.fixturenames and cs.sanitizing()
"""


def test_an_unrelated_project_sees_nothing_of_the_plugin(tmp_path: Path) -> None:
    """A project that has the package installed and never uses it: no fixture
    of ours on its tests, and a malformed switch in the environment is not
    read, so its run passes. The marked test is the control: it gets the fixture."""
    source = _UNRELATED.split("@pytest.mark.cai_sim")[0]
    out = _pytest(tmp_path, source, CAI_STREAMS_SYNC="maybe", CAI_STREAMS_SANITIZE="perhaps")
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout + out.stderr
    out = _pytest(tmp_path, _UNRELATED, CAI_STREAMS_BACKEND="sim")
    assert out.returncode == 0 and "2 passed" in out.stdout, out.stdout + out.stderr


def test_a_malformed_switch_is_named_when_the_library_is_used(tmp_path: Path) -> None:
    source = "import cai_streams as cs\n\ndef test_it():\n    cs.current_backend()\n"
    out = _pytest(tmp_path, source, CAI_STREAMS_SANITIZE="perhaps")
    assert out.returncode == 1, out.stdout
    assert "CAI_STREAMS_SANITIZE='perhaps': expected 0 or 1" in out.stdout, out.stdout
