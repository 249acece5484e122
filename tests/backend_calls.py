"""Counting the backend calls an operation makes (a test helper).

``with counting(backend) as calls: ...`` shadows every method of the
:class:`~cai_streams.Backend` protocol on ``backend`` with an instance
attribute that counts the call by name and calls what was there before (the
observation channel's shadow, if one is installed), then puts back exactly
what it found. The counts are per method name, over every thread.
"""

from __future__ import annotations

import inspect
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from cai_streams import Backend

#: every method of the protocol: what a driver call is, on a GPU
METHODS = tuple(
    name
    for name, member in vars(Backend).items()
    if not name.startswith("_") and inspect.isfunction(member) and name != "close"
)


@contextmanager
def counting(backend: Backend) -> Iterator[Counter[str]]:
    """The calls made to ``backend`` inside the block, by method name."""
    calls: Counter[str] = Counter()
    lock = threading.Lock()
    missing = object()
    saved = {name: backend.__dict__.get(name, missing) for name in METHODS}

    def wrap(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            with lock:
                calls[name] += 1
            return method(*args, **kwargs)

        return counted

    for name in METHODS:
        setattr(backend, name, wrap(name, getattr(backend, name)))
    try:
        yield calls
    finally:
        for name, before in saved.items():
            if before is missing:
                delattr(backend, name)
            else:
                setattr(backend, name, before)
