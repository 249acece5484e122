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


class _Settings:
    __slots__ = ("export_stream", "sync")

    def __init__(self) -> None:
        self.sync = _flag("CAI_STREAMS_SYNC")
        self.export_stream = _flag("CAI_STREAMS_EXPORT_STREAM")


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
    *, sync: bool | None = None, export_stream: bool | None = None, poll: PollPolicy | None = None
) -> None:
    """Change process-wide defaults; None leaves a setting as it is. Does not block.

    ``sync`` and ``export_stream`` are what ``CAI_STREAMS_SYNC`` and
    ``CAI_STREAMS_EXPORT_STREAM`` set: turning either off makes you responsible
    for synchronization, as the CUDA Array Interface says. ``poll`` is the
    :class:`PollPolicy` of the shared poller behind ``await consume()``, for
    example ``PollPolicy.low_latency()``.
    """
    if poll is not None:
        set_poll_policy(poll)
    for name, value in (("sync", sync), ("export_stream", export_stream)):
        if value is not None:
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
            setattr(settings, name, value)
