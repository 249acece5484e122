"""The real device: the CUDA runtime API through cuda.bindings.

Streams and events are made on the device's primary context, the one CuPy,
PyTorch and Numba use, so handles pass freely between them and this library.
Each method is one runtime call (``create_stream``/``create_event`` on another
device than the current one also set the device around it and restore it);
every result goes through :func:`check`, the one place a result becomes
:class:`~cai_streams.CudaError`. No Python ever runs on a driver thread.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from typing import Any, Final

from .._errors import CudaError, DeviceFaultError
from . import Backend, CaptureMode, CaptureStatus

__all__ = ["CudaBackend", "check"]

_runtime: Any = None
_import_lock = threading.Lock()
_SUCCESS: Final = 0
_NOT_READY: Final = 600  # cudaErrorNotReady
#: the errors after which the context is unusable and every later call fails
#: the same way (the runtime API's docs: "the process must be terminated and
#: relaunched", or "cannot be used again"): a device-side fault
STICKY: Final = frozenset({226, 700, 702, 710, 714, 715, 716, 717, 718, 719, 721, 810, 911})


def _rt() -> Any:
    global _runtime
    if _runtime is None:
        with _import_lock:
            if _runtime is None:
                from cuda.bindings import runtime

                _runtime = runtime
    return _runtime


def _error(code: int, during: str) -> CudaError:
    rt = _rt()
    try:
        err = rt.cudaError_t(code)
        _, raw_name = rt.cudaGetErrorName(err)
        _, raw_text = rt.cudaGetErrorString(err)
        name = raw_name.decode() if isinstance(raw_name, bytes) else str(raw_name)
        text = raw_text.decode() if isinstance(raw_text, bytes) else str(raw_text)
    except Exception:  # an unknown code still becomes a CudaError
        name, text = f"cudaError_{code}", "unknown error"
    kind = DeviceFaultError if code in STICKY else CudaError
    return kind(code, name, f"{text} (during {during})")


def check(result: tuple[Any, ...], during: str) -> Any:
    """The single place where a runtime result becomes a value or a CudaError."""
    code = int(result[0])
    if code != _SUCCESS:
        raise _error(code, during)
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


class CudaBackend(Backend):
    """The CUDA runtime on the current device's primary context."""

    name = "cuda"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            rt = _rt()
        except Exception as exc:  # ImportError, or a broken install
            return f"cuda-python is not importable ({type(exc).__name__}: {exc})"
        try:
            result = rt.cudaGetDeviceCount()
        except Exception as exc:  # no driver library at all
            return f"no CUDA driver ({type(exc).__name__}: {exc})"
        code = int(result[0])
        if code != _SUCCESS:
            return f"no usable CUDA driver or device ({_error(code, 'cudaGetDeviceCount')})"
        if int(result[1]) == 0:
            return "no CUDA device is present"
        # A device can be counted and still refuse a context (an exclusive-process
        # GPU in use by another process, a device in a bad state): try to make it.
        try:
            code = int(rt.cudaFree(0)[0])
        except Exception as exc:
            return f"the CUDA context could not be made ({type(exc).__name__}: {exc})"
        if code != _SUCCESS:
            return f"a CUDA device is present but unusable ({_error(code, 'cudaFree(0)')})"
        return None

    def __init__(self) -> None:
        self._rt = _rt()
        rt = self._rt
        self._launch_host_func: Any = None  # cuLaunchHostFunc, loaded on first use
        self._stream_t = rt.cudaStream_t
        self._event_t = rt.cudaEvent_t
        self._graph_t = rt.cudaGraph_t
        self._graph_exec_t = rt.cudaGraphExec_t
        self._non_blocking = rt.cudaStreamNonBlocking
        # Not cudaEventBlockingSync, although a host wait on such an event sleeps
        # instead of spinning: on an H100 (driver 580) about 56 pending records of
        # blocking-sync events on one stream made the next cudaEventRecord block
        # the host, so 1,000 waiters on one held stream deadlocked the thread that
        # had to release it (docs/gpu-runs/2026-11-22-NVIDIA-H100-80GB-HBM3.txt).
        # Plain events allowed about 1,000. Awaiting never spins: it polls.
        self._event_flags = int(rt.cudaEventDisableTiming)
        modes = rt.cudaStreamCaptureMode
        self._modes: dict[str, Any] = {
            "global": modes.cudaStreamCaptureModeGlobal,
            "thread_local": modes.cudaStreamCaptureModeThreadLocal,
            "relaxed": modes.cudaStreamCaptureModeRelaxed,
        }
        self._mode_names: dict[int, CaptureMode] = {
            int(modes.cudaStreamCaptureModeGlobal): "global",
            int(modes.cudaStreamCaptureModeThreadLocal): "thread_local",
            int(modes.cudaStreamCaptureModeRelaxed): "relaxed",
        }
        status = rt.cudaStreamCaptureStatus
        self._statuses: dict[int, CaptureStatus] = {
            int(status.cudaStreamCaptureStatusNone): "none",
            int(status.cudaStreamCaptureStatusActive): "active",
            int(status.cudaStreamCaptureStatusInvalidated): "invalidated",
        }
        memory = rt.cudaMemoryType
        self._device_memory = (int(memory.cudaMemoryTypeDevice), int(memory.cudaMemoryTypeManaged))
        # Make the primary context current on this thread (cudaFree(0) idiom).
        check(rt.cudaFree(0), "cudaFree(0) to initialize the primary context")

    # -- devices ---------------------------------------------------------------------

    def device_count(self) -> int:
        return int(check(self._rt.cudaGetDeviceCount(), "cudaGetDeviceCount"))

    def current_device(self) -> int:
        return int(check(self._rt.cudaGetDevice(), "cudaGetDevice"))

    def set_device(self, device: int) -> None:
        check(self._rt.cudaSetDevice(device), f"cudaSetDevice({device})")

    def pointer_device(self, ptr: int) -> int:
        attrs = check(self._rt.cudaPointerGetAttributes(ptr), "cudaPointerGetAttributes")
        if int(attrs.type) not in self._device_memory:
            raise ValueError(f"{ptr:#x} is not device memory (its memory type is {attrs.type!r})")
        return int(attrs.device)

    def _on_device(self, device: int | None, create: Any, during: str) -> int:
        """``create()`` with ``device`` current, the current device restored after."""
        if device is None:
            return int(check(create(), during))
        previous = self.current_device()
        if previous == device:
            return int(check(create(), during))
        self.set_device(device)
        try:
            return int(check(create(), during))
        finally:
            self.set_device(previous)

    # -- streams ---------------------------------------------------------------------

    def create_stream(self, device: int | None = None) -> int:
        flags = self._non_blocking
        return self._on_device(
            device, lambda: self._rt.cudaStreamCreateWithFlags(flags), "cudaStreamCreate"
        )

    def destroy_stream(self, stream: int) -> None:
        check(self._rt.cudaStreamDestroy(self._stream_t(stream)), "cudaStreamDestroy")

    def is_stream(self, stream: int) -> bool:
        # A raw cudaStream_t cannot be validated without risking a fault on a
        # garbage pointer; the driver reports misuse when the handle is used.
        return stream > 0

    def stream_device(self, stream: int) -> int:
        # cudaStreamGetDevice: CUDA 12.8 and later (cuda-bindings >= 12.9.1 has it).
        result = self._rt.cudaStreamGetDevice(self._stream_t(stream))
        return int(check(result, "cudaStreamGetDevice"))

    def query_stream(self, stream: int) -> bool:
        result = self._rt.cudaStreamQuery(self._stream_t(stream))
        if int(result[0]) == _NOT_READY:
            return False
        check(result, "cudaStreamQuery")
        return True

    def synchronize_stream(self, stream: int) -> None:
        check(self._rt.cudaStreamSynchronize(self._stream_t(stream)), "cudaStreamSynchronize")

    # -- events ----------------------------------------------------------------------

    def create_event(self, device: int | None = None) -> int:
        flags = self._event_flags
        return self._on_device(
            device, lambda: self._rt.cudaEventCreateWithFlags(flags), "cudaEventCreate"
        )

    def destroy_event(self, event: int) -> None:
        check(self._rt.cudaEventDestroy(self._event_t(event)), "cudaEventDestroy")

    def record(self, event: int, stream: int) -> None:
        check(
            self._rt.cudaEventRecord(self._event_t(event), self._stream_t(stream)),
            "cudaEventRecord",
        )

    def query(self, event: int) -> bool:
        result = self._rt.cudaEventQuery(self._event_t(event))
        if int(result[0]) == _NOT_READY:
            return False
        check(result, "cudaEventQuery")
        return True

    def synchronize_event(self, event: int) -> None:
        check(self._rt.cudaEventSynchronize(self._event_t(event)), "cudaEventSynchronize")

    def stream_wait_event(self, stream: int, event: int) -> None:
        check(
            self._rt.cudaStreamWaitEvent(self._stream_t(stream), self._event_t(event), 0),
            "cudaStreamWaitEvent",
        )

    def launch_host_func(self, stream: int, fn: int, user_data: int) -> None:
        # Through the driver's cuLaunchHostFunc, by ctypes, not cuda.bindings:
        # the bindings' cudaLaunchHostFunc has wrapped the function in a
        # trampoline that takes the GIL on the driver thread (the numba-cuda #317
        # and TensorRT-LLM #15855 deadlock). This passes ``fn`` itself: no Python
        # runs. cudaStream_t and CUstream are the same handle; the driver's codes
        # are the runtime's for every error this call returns.
        launch = self._host_func_launcher()
        code = launch(ctypes.c_void_p(stream), ctypes.c_void_p(fn), ctypes.c_void_p(user_data))
        check((code,), "cuLaunchHostFunc")

    def _host_func_launcher(self) -> Any:
        launch = self._launch_host_func
        if launch is None:  # OSError if the driver library or the symbol is missing
            driver = ctypes.CDLL(ctypes.util.find_library("cuda") or "libcuda.so.1")
            try:
                launch = driver.cuLaunchHostFunc
            except AttributeError as exc:
                raise OSError(f"the CUDA driver has no cuLaunchHostFunc: {exc}") from exc
            launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            launch.restype = ctypes.c_int
            self._launch_host_func = launch
        return launch

    # -- graph capture ---------------------------------------------------------------

    def begin_capture(self, stream: int, mode: CaptureMode) -> None:
        if mode not in self._modes:
            raise ValueError(f"capture mode must be one of {', '.join(self._modes)}, got {mode!r}")
        check(
            self._rt.cudaStreamBeginCapture(self._stream_t(stream), self._modes[mode]),
            "cudaStreamBeginCapture",
        )

    def end_capture(self, stream: int) -> int:
        graph = check(self._rt.cudaStreamEndCapture(self._stream_t(stream)), "cudaStreamEndCapture")
        return int(graph)

    def capture_status(self, stream: int) -> CaptureStatus:
        status = check(
            self._rt.cudaStreamIsCapturing(self._stream_t(stream)), "cudaStreamIsCapturing"
        )
        return self._statuses[int(status)]

    def exchange_capture_mode(self, mode: CaptureMode) -> CaptureMode:
        if mode not in self._modes:
            raise ValueError(f"capture mode must be one of {', '.join(self._modes)}, got {mode!r}")
        previous = check(
            self._rt.cudaThreadExchangeStreamCaptureMode(self._modes[mode]),
            "cudaThreadExchangeStreamCaptureMode",
        )
        return self._mode_names[int(previous)]

    def instantiate_graph(self, graph: int) -> int:
        graph_exec = check(
            self._rt.cudaGraphInstantiate(self._graph_t(graph), 0), "cudaGraphInstantiate"
        )
        return int(graph_exec)

    def launch_graph(self, graph_exec: int, stream: int) -> None:
        check(
            self._rt.cudaGraphLaunch(self._graph_exec_t(graph_exec), self._stream_t(stream)),
            "cudaGraphLaunch",
        )

    def destroy_graph(self, graph: int) -> None:
        check(self._rt.cudaGraphDestroy(self._graph_t(graph)), "cudaGraphDestroy")

    def destroy_graph_exec(self, graph_exec: int) -> None:
        check(self._rt.cudaGraphExecDestroy(self._graph_exec_t(graph_exec)), "cudaGraphExecDestroy")
