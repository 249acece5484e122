"""The ``cai_streams.testing`` plugin is loaded: by its entry point when the
project is installed, by ``-p cai_streams.testing`` when it runs from PYTHONPATH
(scripts/gpu-check.sh)."""

from __future__ import annotations

import cai_streams as cs
from cai_streams._backend._sim import SimBackend


def test_the_cai_sim_fixture_is_there(cai_sim: SimBackend) -> None:
    assert cs.current_backend() is cai_sim and cs.sanitizing()
