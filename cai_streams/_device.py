"""The devices of the current backend: how many, and this thread's current one.

Thin wrappers over the backend (cudaGetDeviceCount, cudaGetDevice,
cudaSetDevice on a GPU; the simulator's ``CAI_STREAMS_SIM_DEVICES`` devices
otherwise). None of them blocks.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

from ._backend import LEGACY_DEFAULT_STREAM, PER_THREAD_DEFAULT_STREAM, Backend, current_backend
from ._identity import StreamId, is_open, stream_id_now

if TYPE_CHECKING:
    from ._interface import ArrayView

__all__ = [
    "OnDevice",
    "current_device",
    "device_count",
    "device_of",
    "make_current",
    "set_device",
    "view_stream_id",
]


def device_count() -> int:
    """How many devices the current backend has. Does not block."""
    return current_backend().device_count()


def current_device() -> int:
    """This host thread's current device (0 in a new thread). Does not block."""
    return current_backend().current_device()


def set_device(device: int) -> None:
    """Make ``device`` this host thread's current device, like cudaSetDevice.

    Other threads keep theirs. New streams (``Stream()``), events and
    ``sim.empty()`` arrays go to the current device unless given one. A
    ``device`` that is not an int raises TypeError; one out of range raises
    :class:`CudaError` (``cudaErrorInvalidDevice``). Does not block.
    """
    if isinstance(device, bool):
        raise TypeError("device must be an int, got bool")
    try:
        ordinal = operator.index(device)
    except TypeError:
        raise TypeError(f"device must be an int, got {type(device).__name__}") from None
    current_backend().set_device(ordinal)


def device_of(backend: Backend, view: ArrayView) -> int:
    """The device whose memory ``view`` points into (cudaPointerGetAttributes);
    the calling thread's current device for a zero-size array, or for memory
    the backend does not know as device memory. Does not block."""
    if view.ptr:
        try:
            return backend.pointer_device(view.ptr)
        except ValueError:
            pass
    return backend.current_device()


class OnDevice:
    """``with OnDevice(backend, device, handle):`` handles 1 and 2 name the
    current device's streams: make it ``device`` inside. (A class: a handoff
    enters one for every view it hands to a stream.)"""

    __slots__ = ("_backend", "_default", "_device", "_previous")

    def __init__(self, backend: Backend, device: int, handle: int) -> None:
        self._backend = backend
        self._device = device
        self._default = handle in (LEGACY_DEFAULT_STREAM, PER_THREAD_DEFAULT_STREAM)
        self._previous: int | None = None

    def __enter__(self) -> None:
        if self._default:
            self._previous = make_current(self._backend, self._device)

    def __exit__(self, *exc_info: object) -> None:
        if self._previous is not None:
            self._backend.set_device(self._previous)


def make_current(backend: Backend, device: int) -> int | None:
    """Make ``device`` this thread's current one; the device to make current
    again after (None: it was current, nothing switched). One ``cudaGetDevice``,
    no object made (a default stream's capture ask on every host consume)."""
    now = backend.current_device()
    if now == device:
        return None
    backend.set_device(device)
    return now


def view_stream_id(backend: Backend, view: ArrayView) -> StreamId:
    """The stream ``view.stream`` names, for work the calling thread enqueues
    now (``view.stream`` is not None). A stream the library handed the view
    to keeps its identity: another thread's handle 2 is that thread's stream
    (a record for it is made on the legacy stream, which waits for it:
    ``_events.record_asked``), another device's 1 or 2 that device's; a
    stream closed since raises ValueError (its handle may name another
    stream now). Handles 1 and 2 read from an interface are the default
    streams of the array's device. Does not block."""
    handle = view.stream
    assert handle is not None
    key: StreamId | None = view._stream_key
    if key is None or key.handle != handle:
        if handle in (LEGACY_DEFAULT_STREAM, PER_THREAD_DEFAULT_STREAM):
            now = stream_id_now(backend, handle)
            device = device_of(backend, view)
            if device == now.device:
                return now
            return StreamId(backend, device, handle, 0, now.thread)
        return stream_id_now(backend, handle)
    if key.generation and not is_open(key):
        raise ValueError(
            f"this view names stream {handle:#x}, which was closed after the view was "
            "handed to it: its work can no longer be waited for by that handle (a new "
            "stream may have it now). Hand the view on before closing its stream; if you "
            "know that work complete (you synchronized the stream), hand on "
            "view.with_stream(None)"
        )
    return key
