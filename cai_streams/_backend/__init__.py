"""The backend protocol and the process-wide choice of backend.

A backend is the only code that talks to a device. Its methods take and return
plain integer handles (streams as they go into a CAI ``stream`` entry, events,
graphs, device ordinals), make one runtime call each, and raise
:class:`~cai_streams.CudaError` on failure, with the driver's code and name.
Everything above it (streams, scheduling, polling, sanitizing) is shared by all
backends, so the simulated devices exercise the same code that runs on a GPU.

Devices are per host thread, as in the CUDA runtime: ``current_device`` is the
calling thread's (0 until it calls ``set_device``), and handles 1 and 2 name
the legacy and per-thread default streams of that device.
"""

from __future__ import annotations

import atexit
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Final, Literal

from .._errors import CaiStreamsError

__all__ = [
    "BACKEND_NAMES",
    "CAPTURE_MODES",
    "Backend",
    "CaptureMode",
    "CaptureStatus",
    "current_backend",
    "use_backend",
]

logger = logging.getLogger("cai_streams")

LEGACY_DEFAULT_STREAM: Final = 1
PER_THREAD_DEFAULT_STREAM: Final = 2
BACKEND_NAMES: Final = ("sim", "cuda")
#: the simulator under another name, made the default by ``CAI_STREAMS_SIM_DECOY=1``
#: (a test switch: not one of ``BACKEND_NAMES``, not accepted by ``CAI_STREAMS_BACKEND``)
DECOY_NAME: Final = "decoy"

#: how a stream capture interacts with potentially unsafe calls (cudaStreamCaptureMode)
CaptureMode = Literal["global", "thread_local", "relaxed"]
CAPTURE_MODES: Final[tuple[CaptureMode, ...]] = ("global", "thread_local", "relaxed")
#: a stream's capture state (cudaStreamCaptureStatus): not capturing, capturing,
#: or capturing but invalidated (only ``end_capture`` is left to do)
CaptureStatus = Literal["none", "active", "invalidated"]


class Backend(ABC):
    """The devices of one runtime, seen through integer handles."""

    #: ``"sim"`` or ``"cuda"`` (``"decoy"`` under ``CAI_STREAMS_SIM_DECOY=1``)
    name: str

    @classmethod
    @abstractmethod
    def unavailable_reason(cls) -> str | None:
        """None when this backend can be used here, else a one-line reason."""

    # -- devices -------------------------------------------------------------------

    @abstractmethod
    def device_count(self) -> int:
        """How many devices there are (cudaGetDeviceCount). Does not block."""

    @abstractmethod
    def current_device(self) -> int:
        """The calling thread's current device (cudaGetDevice); 0 in a new thread."""

    @abstractmethod
    def set_device(self, device: int) -> None:
        """Make ``device`` the calling thread's current device (cudaSetDevice).

        This thread only. An ordinal out of range raises CudaError
        (cudaErrorInvalidDevice). Does not block.
        """

    @abstractmethod
    def pointer_device(self, ptr: int) -> int:
        """The device whose memory holds ``ptr`` (cudaPointerGetAttributes).

        ValueError if ``ptr`` is not device memory. Does not block.
        """

    # -- streams ---------------------------------------------------------------------

    @abstractmethod
    def create_stream(self, device: int | None = None) -> int:
        """A new non-blocking stream (never synchronizes with the legacy stream)
        on ``device`` (None: the current device; the current device is left as
        it was). Does not block."""

    @abstractmethod
    def destroy_stream(self, stream: int) -> None:
        """Release ``stream``; work already enqueued on it still completes.

        Its handle may be handed out again by the next create. Does not block.
        """

    @abstractmethod
    def is_stream(self, stream: int) -> bool:
        """Whether ``stream`` can be used as a stream handle on this backend."""

    @abstractmethod
    def stream_device(self, stream: int) -> int:
        """The device of ``stream`` (cudaStreamGetDevice); for 1 and 2, the
        calling thread's current device. Does not block."""

    @abstractmethod
    def query_stream(self, stream: int) -> bool:
        """True when all work enqueued on ``stream`` so far is complete, False while
        it is not (cudaStreamQuery). Never blocks; a failure raises."""

    @abstractmethod
    def synchronize_stream(self, stream: int) -> None:
        """Block the calling thread until all work on ``stream`` is complete."""

    # -- events ----------------------------------------------------------------------

    @abstractmethod
    def create_event(self, device: int | None = None) -> int:
        """A new event without timing on ``device`` (None: the current device);
        never recorded, so it counts as complete. It can be recorded only on
        streams of its device. Does not block."""

    @abstractmethod
    def destroy_event(self, event: int) -> None:
        """Release ``event``; a pending record of it still completes. Does not block."""

    @abstractmethod
    def record(self, event: int, stream: int) -> None:
        """Make ``event`` capture the work enqueued on ``stream`` so far.

        ``stream`` must be on the event's device (else cudaErrorInvalidResourceHandle).
        Only enqueues.
        """

    @abstractmethod
    def query(self, event: int) -> bool:
        """True when the captured work is complete, False while it is not.

        "Not ready" is a value; any other result raises. Does not block.
        """

    @abstractmethod
    def synchronize_event(self, event: int) -> None:
        """Block the calling thread until the captured work is complete."""

    @abstractmethod
    def stream_wait_event(self, stream: int, event: int) -> None:
        """Make later work on ``stream`` wait for the work ``event`` captured.

        Waiting on a never-recorded event is a no-op, as in CUDA; the event may
        belong to another device. Only enqueues.
        """

    @abstractmethod
    def launch_host_func(self, stream: int, fn: int, user_data: int) -> None:
        """Enqueue a call of the C function at address ``fn`` with ``user_data``
        on ``stream`` (cudaLaunchHostFunc): it runs on a driver thread once the
        work enqueued before it is complete, and later work waits for it to
        return. ``fn`` must be a ``void (*)(void *)`` that runs no Python and
        never calls CUDA: the library passes libc's ``close``. It never runs
        after the device has faulted. Only enqueues.
        """

    # -- graph capture ---------------------------------------------------------------

    @abstractmethod
    def begin_capture(self, stream: int, mode: CaptureMode) -> None:
        """Start capturing the work enqueued on ``stream`` into a graph
        (cudaStreamBeginCapture): it is recorded, not run. Does not block."""

    @abstractmethod
    def end_capture(self, stream: int) -> int:
        """End the capture begun on ``stream`` and return the graph
        (cudaStreamEndCapture). CudaError if the capture was invalidated; the
        stream has left capture mode either way. Does not block."""

    @abstractmethod
    def capture_status(self, stream: int) -> CaptureStatus:
        """Whether ``stream`` is capturing (cudaStreamIsCapturing). Does not block."""

    def is_capturing(self, stream: int) -> bool:
        """Whether ``stream`` is in capture mode, valid or invalidated. Does not block."""
        return self.capture_status(stream) != "none"

    @abstractmethod
    def exchange_capture_mode(self, mode: CaptureMode) -> CaptureMode:
        """Set the calling thread's capture interaction mode and return the
        previous one (cudaThreadExchangeStreamCaptureMode). Does not block."""

    @abstractmethod
    def instantiate_graph(self, graph: int) -> int:
        """An executable graph made from ``graph`` (cudaGraphInstantiate)."""

    @abstractmethod
    def launch_graph(self, graph_exec: int, stream: int) -> None:
        """Replay ``graph_exec`` on ``stream`` after the work enqueued on it so
        far, and after earlier launches of the same graph (cudaGraphLaunch).
        Only enqueues."""

    @abstractmethod
    def destroy_graph(self, graph: int) -> None:
        """Release ``graph`` (cudaGraphDestroy); executables made from it stay."""

    @abstractmethod
    def destroy_graph_exec(self, graph_exec: int) -> None:
        """Release ``graph_exec`` (cudaGraphExecDestroy); a pending launch still runs."""

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to do by default
        """Release what the backend holds; called at interpreter exit."""


_lock = threading.Lock()
_instances: dict[str, Backend] = {}
_current: Backend | None = None


def _backend_class(name: str) -> type[Backend]:
    if name == "sim":
        from ._sim import SimBackend

        return SimBackend
    if name == "cuda":
        from ._cuda import CudaBackend

        return CudaBackend
    if name == DECOY_NAME:
        from ._sim import DecoyBackend

        return DecoyBackend
    raise ValueError(f"unknown backend {name!r}: expected one of {', '.join(BACKEND_NAMES)}")


#: set by the observation channel (``_observe``) while anyone observes: called
#: with every backend made
instrument: Callable[[Backend], None] | None = None
#: called once, before the first backend is made (the sanitizer reads its switch)
first_use: list[Callable[[], None]] = []


def _instance(name: str) -> Backend:
    backend = _instances.get(name)
    if backend is None:
        for first in list(first_use):
            first()  # may raise (a malformed switch): then it runs again next time
            first_use.remove(first)
        cls = _backend_class(name)
        reason = cls.unavailable_reason()
        if reason is not None:
            raise CaiStreamsError(f"the {name!r} backend cannot be used here: {reason}")
        backend = cls()
        _instances[name] = backend
        hook = instrument
        if hook is not None:
            hook(backend)
    return backend


def use_backend(name: str) -> Backend:
    """Make ``name`` (``"sim"`` or ``"cuda"``) the process-wide backend.

    Streams and events made before the switch stay on their own backend. Blocks
    briefly the first time a backend is started; enqueues no GPU work.
    (``"decoy"`` is accepted too, so that ``use_backend(current_backend().name)``
    restores the default under ``CAI_STREAMS_SIM_DECOY=1`` as it does on a GPU.)
    """
    global _current
    if not isinstance(name, str):
        raise TypeError(f"backend name must be a str, got {type(name).__name__}")
    with _lock:
        _current = _instance(name)
        return _current


def current_backend() -> Backend:
    """The process-wide backend, chosen on first use.

    ``CAI_STREAMS_BACKEND`` if set; otherwise ``cuda`` when a device is usable,
    else ``sim`` (said once at INFO level on the ``cai_streams`` logger).
    Does not block after the first call.

    ``CAI_STREAMS_SIM_DECOY=1``, for testing that code never assumes the default
    backend is the simulator: the default is then the ``decoy`` backend, picked
    where a GPU machine picks ``cuda``. It runs exactly like the simulator, but
    ``sim.launch`` and ``SimArray.to_host`` refuse its streams as they refuse
    cuda streams, so such code fails on CPU CI as it would on every GPU.
    ``CAI_STREAMS_BACKEND`` still wins over it.
    """
    backend = _current
    if backend is not None:
        return backend
    return _select_default()


class _BadSwitch(CaiStreamsError, ValueError):
    """A malformed ``CAI_STREAMS_BACKEND``: a ValueError naming it, as for every
    environment switch, and one of the library's errors."""


def _select_default() -> Backend:
    global _current
    with _lock:
        if _current is not None:
            return _current
        from .._config import backend_name, sim_decoy  # late: _config imports this package

        try:
            requested = backend_name(BACKEND_NAMES)
        except ValueError as exc:  # (a ValueError, as for every environment switch)
            raise _BadSwitch(str(exc)) from None
        if requested is not None:
            _current = _instance(requested)
            return _current
        if sim_decoy():
            _current = _instance(DECOY_NAME)  # silently, as cuda is chosen on a GPU
            return _current
        reason = _backend_class("cuda").unavailable_reason()
        if reason is None:
            _current = _instance("cuda")
        else:
            logger.info("cai_streams: using the simulated device (%s)", reason)
            _current = _instance("sim")
        return _current


def _close_all() -> None:
    with _lock:
        for backend in _instances.values():
            backend.close()


atexit.register(_close_all)
