"""Exception and warning types raised by cai_streams."""

from __future__ import annotations

__all__ = [
    "CaiStreamsError",
    "CaptureError",
    "CudaError",
    "CudaWarning",
    "DeviceFaultError",
    "HazardError",
    "HoldWarning",
    "InterfaceError",
    "KernelError",
    "LoopBlockingWarning",
]


def _rebuilt(
    cls: type[BaseException], args: tuple[object, ...], state: dict[str, object]
) -> object:
    """An error as pickled (:meth:`CaiStreamsError.__reduce__`), without
    calling its ``__init__``, whose arguments are not its ``args``."""
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error


class CaiStreamsError(Exception):
    """Base class of every error this library raises on purpose.

    Errors pickle and copy with their attributes (``.code``, ``.name``...),
    so one raised in a worker process reaches its parent; as with any Python
    exception, the copy has no ``__cause__`` (a KernelError's message names
    the kernel's exception).
    """

    def __reduce__(self) -> tuple[object, ...]:
        # (as any exception's pickle or copy, it leaves ``__cause__`` behind: a
        # user's exception there may not unpickle, and a chain may loop)
        return (_rebuilt, (type(self), self.args, self._state()))

    def _state(self) -> dict[str, object]:
        """The attributes a pickled or copied error keeps."""
        return self.__dict__


class InterfaceError(CaiStreamsError, ValueError):
    """A ``__cuda_array_interface__`` is malformed or not supported.

    The message names the field, the value received and what was expected.
    """


class CudaError(CaiStreamsError, RuntimeError):
    """A device call failed.

    ``code`` is the integer result code and ``name`` its symbolic name
    (``"cudaErrorInvalidResourceHandle"``, ...), as the driver reports them.
    """

    def __init__(self, code: int, name: str, message: str) -> None:
        super().__init__(f"{name} ({code}): {message}")
        self.code = code
        self.name = name
        #: the message without the name and code
        self.detail = message


class DeviceFaultError(CudaError):
    """The device faulted, and every later call on it fails the same way.

    On a GPU, the driver's errors that leave the context unusable until the
    process restarts: ``cudaErrorContained`` (226),
    ``cudaErrorIllegalAddress`` (700), ``cudaErrorLaunchTimeout`` (702),
    ``cudaErrorAssert`` (710), ``cudaErrorHardwareStackError`` (714) through
    ``cudaErrorLaunchFailure`` (719), ``cudaErrorTensorMemoryLeak`` (721),
    ``cudaErrorMpsClientTerminated`` (810) and ``cudaErrorExternalDevice``
    (911; the runtime's docs call it sticky when reported asynchronously). On
    the simulator, a :class:`KernelError` (a subclass). Catch this one to
    handle a fault the same way on both. It pickles with its attributes,
    so a parent that runs GPU work in a worker to survive a fault receives it.
    """


class KernelError(DeviceFaultError):
    """A kernel faulted; the simulated device's launch failure.

    The fault is sticky for its device, as a device-side fault is on a GPU:
    the next synchronizing call on that device (a query or synchronize of any
    of its streams or events, so any ``await consume`` polling there) raises
    it, and every call on the device after that does too, so every waiter on
    the device hears of it. ``sim.reset()`` clears it on the simulator; other
    devices are not affected. ``kernel`` names the kernel and ``stream`` its
    stream; ``__cause__`` is the exception the kernel raised.
    """

    def __init__(self, kernel: str, stream: int, cause: BaseException) -> None:
        super().__init__(
            719,
            "cudaErrorLaunchFailure",
            f"kernel {kernel!r} on stream {stream:#x} raised {type(cause).__name__}: {cause}",
        )
        self.kernel = kernel
        self.stream = stream
        self.__cause__ = cause


class CaptureError(CudaError):
    """A library call that cannot be made on a stream that is capturing a graph.

    Raised before anything is enqueued or queried, so the capture stays valid.
    The message names the call, the capturing stream and what to do instead
    (usually: pass ``stream=`` so the wait becomes a graph edge, or consume
    after ``end_capture()`` and ``Graph.launch``). ``code`` and ``name`` are
    those of the driver error the call would have caused
    (``cudaErrorStreamCaptureUnsupported``, 900).
    """

    def __init__(self, message: str, *, code: int = 900) -> None:
        super().__init__(code, "cudaErrorStreamCaptureUnsupported", message)


class HazardError(CaiStreamsError, RuntimeError):
    """Two accesses to overlapping memory are not ordered (sanitizer).

    The message names both accesses (read or write, which stream or host
    thread, what made it and where in the program), the missing ordering and
    the fix. ``first`` and ``second`` hold the two accesses (the sanitizer's
    records, which live in this process: a pickled or copied error has None
    there, and the message).
    """

    def __init__(self, message: str, *, first: object = None, second: object = None) -> None:
        super().__init__(message)
        self.first = first
        self.second = second

    def _state(self) -> dict[str, object]:
        return {**self.__dict__, "first": None, "second": None}


class CudaWarning(RuntimeWarning):
    """A device call failed in cleanup, where raising would do more harm.

    Following cuda.core, a failed destroy becomes a warning: a leaked handle is
    preferable to a dangling one.
    """


class LoopBlockingWarning(RuntimeWarning):
    """A blocking call is about to wait in a thread that runs an event loop.

    Given when :func:`~cai_streams.consume_blocking`, ``Stream.synchronize()``
    or ``Event.synchronize()`` is about to wait for GPU work that is still
    pending, or a synchronous access for another thread's ``writing()``,
    ``reading()`` or ``consuming()`` block, in the thread of a running asyncio
    (uvloop included) or trio loop: every task and callback of that loop
    waits with it. The message names the awaitable to use instead. It is a
    warning, not an error, because a blocking wait there is sometimes meant
    (a short script, a test); filter it with :mod:`warnings` where it is.
    Nothing is given when the work is already complete or the call would not
    wait (``timeout=0``), nor outside a loop's thread: the check is one query,
    made only in a loop's thread. A Jupyter kernel runs its cells in a
    loop too, so a cell's blocking wait is warned of (``await`` works at a
    cell's top level).
    """


class HoldWarning(ResourceWarning):
    """Stream-ordered holds past ``hold_limit_count`` or ``hold_limit_bytes``.

    Given once per limit setting (each :func:`~cai_streams.configure` call
    that sets a limit is a new one), after the completed holds were released: it
    says how many holds are in flight, how many bytes they keep alive, and on
    which streams the oldest wait. Holds never block; raise the limit with
    :func:`~cai_streams.configure` or find the stream that makes no progress.
    """
