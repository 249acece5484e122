"""A model-based test: random handoff programs against a sequential oracle.

See ``tests/model.py`` for what a program is. CI runs 2,000 programs over
asyncio, trio and uvloop; ``CAI_STREAMS_MODEL_PROGRAMS=20000`` runs more
(``CAI_STREAMS_MODEL_SEED`` moves the first seed).
"""

from __future__ import annotations

import os

import pytest

from .model import run_count

PROGRAMS = int(os.environ.get("CAI_STREAMS_MODEL_PROGRAMS", "2000"))
FIRST_SEED = int(os.environ.get("CAI_STREAMS_MODEL_SEED", "0"))


@pytest.mark.slow
@pytest.mark.timeout(max(600, PROGRAMS // 2))
def test_random_programs_match_the_sequential_oracle_and_leak_nothing() -> None:
    failures = run_count(PROGRAMS, FIRST_SEED, stop_at=1)
    assert not failures, failures
