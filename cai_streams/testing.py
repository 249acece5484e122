"""Test your own pipeline without a GPU: the simulated device with the sanitizer on.

Installed as a pytest plugin (entry point ``pytest11``), so with ``cai-streams``
installed these are available in every test suite without an import. The
plugin registers the marker and the fixture and does nothing else: a test
that uses neither runs exactly as without the package, and nothing reads a
``CAI_STREAMS_*`` variable until the library is used.

* the ``cai_sim`` fixture: the test runs on the simulated device with the
  sanitizer on, and gets the device (``cai_sim.jitter``, ``cai_sim.seed``);
* the ``@pytest.mark.cai_sim(jitter=..., seed=...)`` marker: the same for a
  test that does not ask for the fixture (or for every test of a module, with
  ``pytestmark``); ``jitter`` is the largest random delay added to each kernel
  (seconds), ``seed`` makes that delay sequence repeat;
* :func:`cai_streams.sim.simulated`, the context manager behind both, for
  use outside pytest (also importable from here).

A race in the pipeline raises :class:`~cai_streams.HazardError` at the
offending access, on every run; the jitter makes the data wrong as well, the
way a GPU would when timing is unlucky. See ``docs/testing.md``.

On a GPU machine the default backend is ``cuda``, whose streams simulated kernels
refuse: run the suite once more with ``CAI_STREAMS_SIM_DECOY=1`` (a decoy default
they refuse too) to find tests that run them without the fixture or the marker.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from ._backend._sim import SimBackend
from .sim import simulated

__all__ = ["cai_sim", "simulated"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "cai_sim(jitter=None, seed=None, sanitizer=True): run on cai_streams' simulated "
        "device with its sanitizer on",
    )


@pytest.fixture
def cai_sim(request: pytest.FixtureRequest) -> Iterator[SimBackend]:
    """The simulated device, current for the test, with the sanitizer on."""
    marker = request.node.get_closest_marker("cai_sim")
    kwargs: dict[str, Any] = dict(marker.kwargs) if marker is not None else {}
    with simulated(**kwargs) as sim_device:
        yield sim_device


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test marked ``cai_sim`` that does not ask for the fixture gets it; no
    other test is touched (no autouse fixture: projects that have the package
    installed but never use it see nothing of it)."""
    for item in items:
        if item.get_closest_marker("cai_sim") is None:
            continue
        names = getattr(item, "fixturenames", None)
        if isinstance(names, list) and "cai_sim" not in names:
            names.insert(0, "cai_sim")
