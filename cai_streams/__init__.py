"""Race-free, non-blocking handoff of CUDA arrays (CUDA Array Interface v3).

Producers: :func:`track` records pending work per array across streams and
joins it onto one stream at export. Consumers: ``await consume(obj)`` waits for
the producer's work by polling from the event loop, or orders a stream after it.
"""

from __future__ import annotations

from . import sim as sim
from ._backend import Backend as Backend
from ._backend import current_backend as current_backend
from ._backend import use_backend as use_backend
from ._capture import Graph as Graph
from ._config import configure as configure
from ._consume import consume as consume
from ._consume import consume_all as consume_all
from ._consume import consume_blocking as consume_blocking
from ._consume import consuming as consuming
from ._device import current_device as current_device
from ._device import device_count as device_count
from ._device import set_device as set_device
from ._errors import CaiStreamsError as CaiStreamsError
from ._errors import CaptureError as CaptureError
from ._errors import CudaError as CudaError
from ._errors import CudaWarning as CudaWarning
from ._errors import DeviceFaultError as DeviceFaultError
from ._errors import HazardError as HazardError
from ._errors import HoldWarning as HoldWarning
from ._errors import InterfaceError as InterfaceError
from ._errors import KernelError as KernelError
from ._errors import LoopBlockingWarning as LoopBlockingWarning
from ._hold import hold as hold
from ._interface import ArrayView as ArrayView
from ._interface import parse as read_interface
from ._poller import PollPolicy as PollPolicy
from ._sanitizer import happens_after as happens_after
from ._sanitizer import happens_before as happens_before
from ._sanitizer import sanitize as sanitize
from ._sanitizer import sanitizing as sanitizing
from ._scheduler import stats as stats
from ._stream import Event as Event
from ._stream import Stream as Stream
from ._trace import Trace as Trace
from ._trace import trace as trace
from ._tracked import TrackedArray as TrackedArray
from ._tracked import export as export
from ._tracked import track as track

__all__ = (
    "ArrayView",
    "Backend",
    "CaiStreamsError",
    "CaptureError",
    "CudaError",
    "CudaWarning",
    "DeviceFaultError",
    "Event",
    "Graph",
    "HazardError",
    "HoldWarning",
    "InterfaceError",
    "KernelError",
    "LoopBlockingWarning",
    "PollPolicy",
    "Stream",
    "Trace",
    "TrackedArray",
    "configure",
    "consume",
    "consume_all",
    "consume_blocking",
    "consuming",
    "current_backend",
    "current_device",
    "device_count",
    "export",
    "happens_after",
    "happens_before",
    "hold",
    "read_interface",
    "sanitize",
    "sanitizing",
    "set_device",
    "sim",
    "stats",
    "trace",
    "track",
    "use_backend",
)

__version__ = "0.1.0"


def _fix_module_names() -> None:
    for name in __all__:
        obj = globals()[name]
        if isinstance(obj, type) or callable(obj):
            try:
                obj.__module__ = __name__
            except (AttributeError, TypeError):
                pass


_fix_module_names()
