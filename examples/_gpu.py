"""Shared by the interop examples: say plainly when no GPU is here, and exit 0."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

import cai_streams as cs
from cai_streams._backend import _backend_class


def require(module: str) -> ModuleType:
    """The imported ``module`` on a usable CUDA device, or a message and exit 0."""
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
