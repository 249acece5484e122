"""Shared by the interop examples: say plainly when no GPU is here, and exit 0;
on a GPU, select the cuda backend and check every part's answer."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

import cai_streams as cs
from cai_streams._backend import _backend_class


def require(module: str) -> ModuleType:
    """The imported ``module`` on a usable CUDA device, or a message and exit 0.

    Selects the ``cuda`` backend explicitly: these examples hand real device
    arrays around, and must not depend on the process's default backend.
    """
    reason = _backend_class("cuda").unavailable_reason()
    if reason is not None:
        print(f"this example needs a CUDA GPU: {reason}")
        sys.exit(0)
    try:
        found = importlib.import_module(module)
    except ImportError:
        print(f"this example needs {module}: pip install it for your CUDA version")
        sys.exit(0)
    cs.use_backend("cuda")
    return found


def check(part: int, what: str, ok: bool, detail: str = "") -> None:
    """Print ``part N: what: ok``, or exit 1 with the wrong answer."""
    if not ok:
        sys.exit(f"part {part}: {what}: WRONG ANSWER ({detail})")
    print(f"part {part}: {what}: ok")
