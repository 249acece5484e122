"""Every environment switch, parsed in one place, when the library first needs it.

One rule for every ``CAI_STREAMS_*`` variable: unset or blank means the
default; anything else must parse, or the first library call that needs it
raises :class:`ValueError` naming the variable, its value and what was
expected. Nothing is read at import, so a malformed value never breaks a
program (or a pytest run) that has the package installed but does not use it.
Booleans accept ``1/true/yes/on`` and ``0/false/no/off``, in any case.

``CAI_STREAMS_SYNC=0``: consumers ignore the producer's stream (the spec's
consumer opt-out). ``CAI_STREAMS_EXPORT_STREAM=0``: producers export
``stream: None`` and join nothing (the spec's producer opt-out): the user then
owns all synchronization. Both are on by default, as the spec requires.

``CAI_STREAMS_BACKEND``: ``sim`` or ``cuda`` instead of the automatic choice.
``CAI_STREAMS_SANITIZE=1``: the sanitizer is on for the whole process (read
when the first backend is made, or by ``sanitizing()``).

``CAI_STREAMS_SIM_DECOY=1``, for testing that code never assumes the default
backend is the simulator: the default backend is then a decoy simulator whose
streams ``sim.launch`` refuses, as it refuses cuda streams on a GPU machine.
Read when the default backend is chosen (:func:`sim_decoy`). Off by default.

``CAI_STREAMS_SIM_DEVICES=N``: how many devices the simulator has (default 2,
at least 1). ``CAI_STREAMS_SIM_SEED`` and ``CAI_STREAMS_SIM_JITTER``: the
simulator's jitter seed (random when unset) and upper bound in seconds (at
most 86400, a day). Read when the simulator starts.

``CAI_STREAMS_HOLD_LIMIT_COUNT=N`` and ``CAI_STREAMS_HOLD_LIMIT_BYTES=N``: how
many stream-ordered holds (``cs.hold``, views handed to a stream), and how many
bytes of their owners, may be in flight before a new hold first releases the
completed ones and then warns once (:class:`~cai_streams.HoldWarning`). Holds
never block. Defaults 10,000 holds and no byte limit; 0 means no limit. Read
when the first hold is made.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TypeVar

from ._poller import PollPolicy, set_poll_policy

__all__ = [
    "backend_name",
    "configure",
    "flag",
    "sanitize_requested",
    "settings",
    "sim_decoy",
    "sim_devices",
    "sim_jitter",
    "sim_seed",
]

T = TypeVar("T")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _read(name: str, parse: Callable[[str], T | None], default: T, expected: str) -> T:
    """The one rule: blank is ``default``; a value ``parse`` refuses (None or
    ValueError) is an error that names the variable."""
    raw = os.environ.get(name, "")
    value = raw.strip()
    if value == "":
        return default
    try:
        parsed = parse(value)
    except ValueError:
        parsed = None
    if parsed is None:
        raise ValueError(f"{name}={raw!r}: expected {expected}")
    return parsed


def _bool(value: str) -> bool | None:
    low = value.lower()
    return True if low in _TRUE else False if low in _FALSE else None


def flag(name: str, default: bool) -> bool:
    """A boolean switch (see the module docstring for the rule)."""
    return _read(name, _bool, default, "0 or 1 (or true/false, yes/no, on/off)")


def _whole(minimum: int) -> Callable[[str], int | None]:
    def parse(value: str) -> int | None:
        number = int(value)
        return number if number >= minimum else None

    return parse


def _sim_seconds(value: str) -> float | None:
    from ._backend._sim import MAX_SIM_SECONDS  # (a stream's worker sleeps it)

    number = float(value)
    return number if 0 <= number <= MAX_SIM_SECONDS else None  # (NaN fails too)


def sim_decoy() -> bool:
    """Whether ``CAI_STREAMS_SIM_DECOY`` asks for the decoy default backend."""
    return flag("CAI_STREAMS_SIM_DECOY", False)


def sim_devices() -> int:
    """How many devices the simulator has: ``CAI_STREAMS_SIM_DEVICES``, default 2."""
    return _read("CAI_STREAMS_SIM_DEVICES", _whole(1), 2, "a whole number >= 1")


def sim_seed() -> int | None:
    """``CAI_STREAMS_SIM_SEED``: the simulator's jitter seed (None: random)."""
    return _read("CAI_STREAMS_SIM_SEED", _whole(0), None, "a whole number >= 0")


def sim_jitter(default: float) -> float:
    """``CAI_STREAMS_SIM_JITTER``: the largest random delay per kernel, in seconds."""
    return _read(
        "CAI_STREAMS_SIM_JITTER", _sim_seconds, default, "a number of seconds from 0 to 86400"
    )


def backend_name(choices: tuple[str, ...]) -> str | None:
    """``CAI_STREAMS_BACKEND``: one of ``choices``, or None for the automatic choice."""
    return _read(
        "CAI_STREAMS_BACKEND",
        lambda v: v if v in choices else None,
        None,
        f"one of {', '.join(choices)}",
    )


def sanitize_requested() -> bool:
    """``CAI_STREAMS_SANITIZE``: whether the sanitizer is on for the whole process."""
    return flag("CAI_STREAMS_SANITIZE", False)


def _checked_limit(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int (0: no limit), got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0 (0: no limit), got {value}")
    return value


def _limit(name: str, default: int) -> int:
    return _read(name, _whole(0), default, "a whole number >= 0 (0: no limit)")


class _Settings:
    """The switches a call reads each time: from the environment on first
    read, then whatever :func:`configure` set."""

    __slots__ = ("_export_stream", "_hold_limit_bytes", "_hold_limit_count", "_sync", "limits_set")

    def __init__(self) -> None:
        self._sync: bool | None = None
        self._export_stream: bool | None = None
        self._hold_limit_count: int | None = None
        self._hold_limit_bytes: int | None = None
        #: how many times configure() set a hold limit: each is a new setting,
        #: whose first excursion past it warns again (even with the same values)
        self.limits_set = 0

    @property
    def sync(self) -> bool:
        found = self._sync
        if found is None:
            found = self._sync = flag("CAI_STREAMS_SYNC", True)
        return found

    @sync.setter
    def sync(self, value: bool) -> None:
        self._sync = value

    @property
    def export_stream(self) -> bool:
        found = self._export_stream
        if found is None:
            found = self._export_stream = flag("CAI_STREAMS_EXPORT_STREAM", True)
        return found

    @export_stream.setter
    def export_stream(self, value: bool) -> None:
        self._export_stream = value

    @property
    def hold_limit_count(self) -> int:
        found = self._hold_limit_count
        if found is None:
            found = self._hold_limit_count = _limit("CAI_STREAMS_HOLD_LIMIT_COUNT", 10_000)
        return found

    @hold_limit_count.setter
    def hold_limit_count(self, value: int) -> None:
        self._hold_limit_count = value

    @property
    def hold_limit_bytes(self) -> int:
        found = self._hold_limit_bytes
        if found is None:
            found = self._hold_limit_bytes = _limit("CAI_STREAMS_HOLD_LIMIT_BYTES", 0)
        return found

    @hold_limit_bytes.setter
    def hold_limit_bytes(self, value: int) -> None:
        self._hold_limit_bytes = value

    def hold_limits(self) -> tuple[int, int, int]:
        """``(hold_limit_count, hold_limit_bytes, limits_set)`` of one setting,
        as :func:`configure` left them (never half of a concurrent call's)."""
        with _limits_lock:
            return self.hold_limit_count, self.hold_limit_bytes, self.limits_set


#: configure()'s hold limits and their count, changed and read as one
_limits_lock = threading.Lock()
settings = _Settings()


def configure(
    *,
    sync: bool | None = None,
    export_stream: bool | None = None,
    poll: PollPolicy | None = None,
    hold_limit_count: int | None = None,
    hold_limit_bytes: int | None = None,
) -> None:
    """Change process-wide defaults; None leaves a setting as it is. Does not block.

    ``sync`` and ``export_stream`` are what ``CAI_STREAMS_SYNC`` and
    ``CAI_STREAMS_EXPORT_STREAM`` set: turning either off makes you responsible
    for synchronization, as the CUDA Array Interface says. ``poll`` is the
    :class:`PollPolicy` of the shared poller behind ``await consume()``, for
    example ``PollPolicy.low_latency()``. ``hold_limit_count`` and
    ``hold_limit_bytes`` are what ``CAI_STREAMS_HOLD_LIMIT_COUNT`` and
    ``CAI_STREAMS_HOLD_LIMIT_BYTES`` set (0: no limit; see :func:`hold`); a
    call that sets either re-arms the :class:`HoldWarning`, even with the same values.
    Every argument is checked before any setting changes.
    """
    for name, value in (("sync", sync), ("export_stream", export_stream)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    limits = {"hold_limit_count": hold_limit_count, "hold_limit_bytes": hold_limit_bytes}
    checked = {k: _checked_limit(k, v) for k, v in limits.items() if v is not None}
    if poll is not None:
        set_poll_policy(poll)
    if sync is not None:
        settings.sync = sync
    if export_stream is not None:
        settings.export_stream = export_stream
    if checked:
        with _limits_lock:
            for name, limit in checked.items():
                setattr(settings, name, limit)
            settings.limits_set += 1
