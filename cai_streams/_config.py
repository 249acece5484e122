"""Process-wide switches, read from the environment at import.

``CAI_STREAMS_SYNC=0``: consumers ignore the producer's stream (the spec's
consumer opt-out). ``CAI_STREAMS_EXPORT_STREAM=0``: producers export
``stream: None`` and join nothing (the spec's producer opt-out): the user then
owns all synchronization. Both are on by default, as the spec requires.

``CAI_STREAMS_SIM_DECOY=1``, for testing that code never assumes the default
backend is the simulator: the default backend is then a decoy simulator whose
streams ``sim.launch`` refuses, as it refuses cuda streams on a GPU machine.
Read when the default backend is chosen (:func:`sim_decoy`). Off by default.

``CAI_STREAMS_SIM_DEVICES=N``: how many devices the simulator has (default 2,
at least 1). Read when the simulator starts (:func:`sim_devices`).

``CAI_STREAMS_HOLD_LIMIT_COUNT=N`` and ``CAI_STREAMS_HOLD_LIMIT_BYTES=N``: how
many stream-ordered holds (``cs.hold``, views handed to a stream), and how many
bytes of their owners, may be in flight before a new hold first releases the
completed ones and then warns once (:class:`~cai_streams.HoldWarning`). Holds
never block. Defaults 10,000 holds and no byte limit; 0 means no limit.
"""

from __future__ import annotations

import os

from ._poller import PollPolicy, set_poll_policy

__all__ = ["configure", "settings", "sim_decoy", "sim_devices"]


def _flag(name: str, default: bool = True) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value == "":
        return default
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={value!r}: expected 0 or 1")


def _limit(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    if value == "":
        return default
    try:
        return _checked_limit(name, int(value))
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r}: expected a whole number >= 0 (0: no limit)") from None


def _checked_limit(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int (0: no limit), got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0 (0: no limit), got {value}")
    return value


class _Settings:
    __slots__ = ("export_stream", "hold_limit_bytes", "hold_limit_count", "sync")

    def __init__(self) -> None:
        self.sync = _flag("CAI_STREAMS_SYNC")
        self.export_stream = _flag("CAI_STREAMS_EXPORT_STREAM")
        self.hold_limit_count = _limit("CAI_STREAMS_HOLD_LIMIT_COUNT", 10_000)
        self.hold_limit_bytes = _limit("CAI_STREAMS_HOLD_LIMIT_BYTES", 0)


settings = _Settings()


def sim_decoy() -> bool:
    """Whether ``CAI_STREAMS_SIM_DECOY`` asks for the decoy default backend."""
    return _flag("CAI_STREAMS_SIM_DECOY", default=False)


def sim_devices() -> int:
    """How many devices the simulator has: ``CAI_STREAMS_SIM_DEVICES``, default 2."""
    value = os.environ.get("CAI_STREAMS_SIM_DEVICES", "").strip()
    if value == "":
        return 2
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise ValueError(f"CAI_STREAMS_SIM_DEVICES={value!r}: expected a whole number >= 1")
    return count


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
    ``CAI_STREAMS_HOLD_LIMIT_BYTES`` set (0: no limit; see :func:`hold`).
    """
    limits = {"hold_limit_count": hold_limit_count, "hold_limit_bytes": hold_limit_bytes}
    checked = {k: _checked_limit(k, v) for k, v in limits.items() if v is not None}
    if poll is not None:
        set_poll_policy(poll)
    for name, value in (("sync", sync), ("export_stream", export_stream)):
        if value is not None:
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
            setattr(settings, name, value)
    for name, limit in checked.items():
        setattr(settings, name, limit)
