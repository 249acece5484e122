"""The simulated devices' public face: device arrays, kernel launches, reset.

Memory lives in host RAM at real, 256-byte aligned addresses, handed out by a
caching allocator per device (a freed block goes to the next allocation of its
size at once, as in CuPy's and PyTorch's pools). Kernels are Python callables
that run on a stream's worker thread, in stream order, over zero-copy numpy
views of device memory; like a GPU kernel, a pending kernel holds a pointer, not
the arrays, so it sees whatever lives there when it runs. See
``cai_streams._backend._sim`` for the rules the devices follow (ordering,
devices, sticky faults, graph capture, handle reuse).

Timing: every kernel sleeps its ``duration`` plus a random jitter drawn from a
per-stream sequence seeded by ``CAI_STREAMS_SIM_SEED`` (random when unset; read
it back from ``device().seed``). ``CAI_STREAMS_SIM_JITTER`` sets the jitter's upper
bound in seconds (default 0.0005); raise it, or call ``device().jitter = 0.005``,
to make ordering bugs show up more often as wrong data.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from . import _backend, _observe, _sanitizer
from ._backend import _instance
from ._backend._sim import SimBackend, check_sim_seconds
from ._dlpack_export import export_view
from ._interface import ArrayView, byte_range, extent, parse, runs
from ._stream import Stream, stream_handle_of

__all__ = ["SimArray", "asarray", "device", "empty", "host_view", "launch", "reset", "simulated"]


def _simulator() -> SimBackend:
    backend = _instance("sim")
    assert isinstance(backend, SimBackend)
    return backend


def device() -> SimBackend:
    """The simulator backend, all its devices (it exists whatever the current
    backend is): ``device().seed``, ``device().jitter``. Does not block."""
    return _simulator()


def reset(device: int | None = None) -> None:
    """Reset a simulated device (None: this thread's current one), as
    ``cudaDeviceReset`` does, as far as the simulator models it:

    * its sticky fault is cleared, so calls on it work again;
    * kernels enqueued on it before the reset never run (marks and waits still
      complete, so nothing waits forever);
    * captures under way on its streams end, invalidated;
    * the free blocks cached by its memory pool are released.

    Unlike CUDA, streams, events, graphs and arrays made before the reset stay
    valid (CUDA destroys them all), so objects a library keeps across a reset
    keep working. Does not block.
    """
    backend = _simulator()
    for stream in backend.reset(device):  # (the sanitizer: what they took never runs)
        _observe.capture_abandoned(backend, stream)


class SimArray:
    """An array in simulated device memory, exporting the CUDA Array Interface.

    Like a Numba device array, it has a default ``stream`` (None unless set),
    which it exports as the CAI ``stream`` entry.
    """

    __slots__ = ("__weakref__", "_device", "_view", "stream")

    def __init__(
        self, view: np.ndarray[Any, Any], stream: int | None = None, *, device: int = 0
    ) -> None:
        """Wrap a numpy view of device memory (use :func:`empty` or :func:`asarray`)."""
        self._view = view
        self._device = device
        #: the stream exported in the CAI ``stream`` entry, or None
        self.stream = stream

    @property
    def device(self) -> int:
        """The simulated device whose memory holds the array."""
        return self._device

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._view.shape)

    @property
    def dtype(self) -> np.dtype[Any]:
        dtype: np.dtype[Any] = self._view.dtype
        return dtype

    @property
    def strides(self) -> tuple[int, ...]:
        return tuple(self._view.strides)

    @property
    def size(self) -> int:
        return int(self._view.size)

    @property
    def nbytes(self) -> int:
        return int(self._view.nbytes)

    @property
    def ndim(self) -> int:
        return int(self._view.ndim)

    @property
    def ptr(self) -> int:
        """The device address of the first element (0 for a zero-size array)."""
        return int(self._view.ctypes.data) if self._view.size else 0

    def __len__(self) -> int:
        return len(self._view)

    def __getitem__(self, key: Any) -> SimArray:
        """A view of part of this array, sharing its memory (no device work)."""
        index = key if isinstance(key, tuple) else (key,)
        sub: np.ndarray[Any, Any] = self._view[index + (Ellipsis,)]  # always a view
        return SimArray(sub, self.stream, device=self._device)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        view = self._view
        return {
            "shape": tuple(view.shape),
            "typestr": view.dtype.str,
            "data": (self.ptr, False),
            "strides": None if view.flags.c_contiguous else tuple(view.strides),
            "version": 3,
            "stream": self.stream,
        }

    def __dlpack__(
        self,
        *,
        stream: int | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        """A DLPack capsule (device type 2, kDLCUDA, on the simulated device);
        like a Numba array's, ``self.stream`` is joined onto the consumer's
        ``stream`` (the array API standard's values; -1: no synchronization),
        or, for an array tracked with :func:`cai_streams.track`, its pending
        writes, as the TrackedArray's ``__dlpack__`` does. Only enqueues
        simulated work; for a tracked array, waits only for another thread's
        open ``writing()`` block of it (bounded)."""
        from ._tracked import dlpack_join  # (tracked state sits above the simulator)

        backend = _simulator()
        return export_view(
            parse(self),
            backend,
            self._device,
            self,
            stream=stream,
            max_version=max_version,
            dl_device=dl_device,
            copy=copy,
            join=dlpack_join(self, backend),
        )

    def __dlpack_device__(self) -> tuple[int, int]:
        """``(2, device)``: kDLCUDA and the simulated device. Does not block."""
        return (2, self._device)

    def to_host(self, stream: Stream | int | None = None) -> np.ndarray[Any, Any]:
        """Copy to a new numpy array: enqueued on ``stream`` (the current device's
        legacy default stream when None, like ``cudaMemcpy``), then waited for. Blocks.
        """
        backend = _simulator()
        handle = 1 if stream is None else _simulated_stream(stream, backend)
        out = np.empty(self.shape, self.dtype)
        src = self._view

        def copy() -> None:
            np.copyto(out, src)

        if _observe.active:
            _observe.stream_access(
                backend, handle, reads=_ranges(self), writes=[], what="to_host() copy"
            )
        backend.launch(handle, copy, "to_host", 0.0)
        backend.synchronize_stream(handle)
        return out

    def __repr__(self) -> str:
        return (
            f"<SimArray shape={self.shape} dtype={self.dtype} ptr={self.ptr:#x} "
            f"device={self._device}>"
        )


def empty(
    shape: int | Iterable[int], dtype: DTypeLike = "float32", device: int | None = None
) -> SimArray:
    """A new array on ``device`` (None: this thread's current device), from
    that device's memory pool; its contents are undefined, as in CUDA.
    Does not block."""
    if isinstance(shape, int):
        shape_t: tuple[object, ...] = (shape,)
    elif isinstance(shape, Iterable):
        shape_t = tuple(shape)
    else:
        raise TypeError(f"shape must be an int or a tuple of ints, got {type(shape).__name__}")
    for n in shape_t:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"shape must be non-negative ints, got {shape!r}")
    dims = tuple(int(n) for n in shape_t)  # type: ignore[call-overload]
    dt = np.dtype(dtype)
    nbytes = int(np.prod(dims, dtype=np.int64)) * dt.itemsize
    backend = _simulator()
    ordinal = backend.current_device() if device is None else device
    address, block = backend.allocate(nbytes, ordinal)
    view = block.view(dt).reshape(dims) if nbytes else np.empty(dims, dt)
    # Undefined contents: fill with a pattern so code that reads before writing
    # sees garbage, as it would on a GPU, rather than convenient zeros. (A block
    # from the pool holds whatever its last owner left, as on a GPU.)
    if nbytes:
        if _observe.active:  # checked as a host write: a block reused under pending work
            # is named (not kept: on a GPU nothing is written, nothing orders after it)
            _observe.host_access("fill", [(address, address + nbytes)], "sim.empty() fill")
        block[:] = 0xCD
    return SimArray(view, device=ordinal)


def asarray(
    array: ArrayLike, dtype: DTypeLike | None = None, device: int | None = None
) -> SimArray:
    """Copy host data to a new array on ``device`` (None: this thread's current
    device). Blocks until the data is there."""
    host = np.asarray(array, dtype=dtype)
    out = empty(host.shape, host.dtype, device)
    if _observe.active:  # a host write: a block reused too early is named
        _observe.host_access("write", _ranges(out), "sim.asarray() copy")
    np.copyto(out._view, host)
    return out


def _interface_of(obj: object) -> ArrayView | None:
    """The interface of ``obj`` without exporting it (a TrackedArray's wrapped
    array: reading its interface would join its pending work)."""
    if isinstance(obj, ArrayView):
        return obj
    inner = getattr(obj, "_cai_streams_array", None)
    if inner is not None:
        return _interface_of(inner)
    if not hasattr(obj, "__cuda_array_interface__"):
        return None
    return parse(obj)


def host_view(obj: object) -> np.ndarray[Any, Any]:
    """The simulated device memory behind ``obj`` as a numpy array, to read on
    the host what a consume handed over: a ``SimArray``, a view ``consume``
    returned, or any CUDA Array Interface in simulated memory. No copy: it
    reads the memory as it is now, so order it first (``await cs.consume(obj)``,
    ``consume_blocking``, a synchronize), as a GPU program reads a mapped
    buffer; and keep ``obj`` (or the view's owner) alive while you use it, as a
    device pointer does not. Read-only where the interface says so. TypeError
    for an object with no interface, ValueError for memory the simulator does
    not hold. Does not block."""
    view = _numpy_view(obj)
    if view is None:
        raise TypeError(f"{type(obj).__name__} has no __cuda_array_interface__")
    interface = None if isinstance(obj, SimArray) else _interface_of(obj)
    if interface is not None and interface.readonly:
        view.flags.writeable = False  # (as its interface says: read, not write)
    return view


def _numpy_view(obj: object) -> np.ndarray[Any, Any] | None:
    """The numpy view of device memory behind ``obj``, or None if not an array.

    Like a device pointer, it does not keep ``obj`` (or any owner) alive: once
    the owner is collected, its block may belong to the next allocation.
    """
    if isinstance(obj, SimArray):
        v = obj._view
        if v.size == 0:
            return np.empty(v.shape, v.dtype)
        ptr = int(v.ctypes.data)
        low, high = extent(ptr, v.shape, v.strides, v.itemsize)
        shape, dtype, strides = v.shape, v.dtype, v.strides
    else:
        view = _interface_of(obj)
        if view is None:
            return None
        if view.nbytes == 0:
            return np.empty(view.shape, view.dtype)
        low, high = byte_range(view)
        ptr, shape, dtype, strides = view.ptr, view.shape, view.dtype, view.strides
    found = _simulator().memory.find(low, high - low)
    if found is None:
        raise ValueError(f"{type(obj).__name__} at {ptr:#x} is not in simulated device memory")
    block, offset = found
    out: np.ndarray[Any, Any] = np.ndarray(
        shape, dtype, buffer=block, offset=offset + ptr - low, strides=strides
    )
    return out


def launch(
    stream: Stream | int | object,
    fn: Callable[..., object],
    *args: object,
    reads: Iterable[object] = (),
    writes: Iterable[object] = (),
    duration: float | None = None,
    name: str | None = None,
) -> None:
    """Enqueue ``fn(*args)`` on ``stream``. Only enqueues; never blocks.

    Array arguments (anything in simulated device memory exposing the CUDA Array
    Interface) reach ``fn`` as numpy views of device memory. ``reads`` and
    ``writes`` declare the arrays the kernel accesses, for the sanitizer.
    ``duration`` (seconds) is how long the kernel takes, before jitter.
    ``stream`` must be a stream of the simulated device: one made on a cuda
    backend, or on the decoy default of ``CAI_STREAMS_SIM_DECOY=1``, raises
    ValueError (select ``sim`` first: ``cs.use_backend("sim")``, ``simulated()``).
    """
    if not callable(fn):
        raise TypeError(f"launch() needs a callable kernel, got {type(fn).__name__}")
    if duration is not None:
        duration = check_sim_seconds("duration", duration)
    backend = _simulator()
    handle = _simulated_stream(stream, backend)
    resolved = tuple(_kernel_arg(a) for a in args)
    reads, writes = tuple(reads), tuple(writes)
    declared = (*reads, *writes)
    for arr in declared:
        if _numpy_view(arr) is None:
            raise TypeError(f"reads= and writes= take device arrays, got {type(arr).__name__}")

    def kernel() -> None:
        fn(*resolved)

    label = name if name is not None else str(getattr(fn, "__name__", repr(fn)))
    if _observe.active:
        _observe.stream_access(
            backend,
            handle,
            reads=[r for a in reads for r in _ranges(a)],
            writes=[r for a in writes for r in _ranges(a)],
            what=f"kernel {label!r}",
        )
    backend.launch(handle, kernel, label, duration or 0.0)


def _simulated_stream(stream: Stream | int | object, backend: SimBackend) -> int:
    """The handle of ``stream`` if it is a stream of the simulated device, else
    ValueError: a cuda stream, or one of the decoy default backend (see
    ``CAI_STREAMS_SIM_DECOY``), cannot run simulated work."""
    if isinstance(stream, Stream) and stream.backend is not backend:
        raise ValueError(
            f"{stream!r} is not a simulated stream: make it while 'sim' is the backend "
            "(cs.use_backend('sim') or sim.simulated()); the default backend is 'cuda' "
            "on a GPU machine"
        )
    handle = stream_handle_of(stream)
    if not backend.is_stream(handle):
        raise ValueError(f"{handle:#x} is not a stream of the simulated device")
    return handle


def _ranges(obj: object) -> list[tuple[int, int]]:
    """The bytes ``obj`` touches, as contiguous runs (a strided view's parts
    leave the bytes between them alone: see ``_interface.runs``)."""
    if isinstance(obj, SimArray):  # the common case, without building an ArrayView
        v = obj._view
        return runs(int(v.ctypes.data), v.shape, v.strides, v.itemsize)
    view = _interface_of(obj)
    assert view is not None
    return runs(view.ptr, view.shape, view.strides, view.dtype.itemsize)


def _kernel_arg(arg: object) -> object:
    view = _numpy_view(arg)
    return arg if view is None else view


@contextmanager
def simulated(
    *, sanitizer: bool = True, jitter: float | None = None, seed: int | None = None
) -> Iterator[SimBackend]:
    """Run the block on the simulated device, with the sanitizer on by default.

    ``jitter`` and ``seed`` apply to streams made inside the block (``jitter``
    to every kernel); both are restored afterwards, as is the backend that was
    current. Does not block; enqueues nothing.
    """
    if jitter is not None:
        jitter = check_sim_seconds("jitter", jitter)
    previous = _backend._current
    sim_device = _simulator()
    saved = (sim_device.jitter, sim_device.seed)
    _backend.use_backend("sim")
    if jitter is not None:
        sim_device.jitter = float(jitter)
    if seed is not None:
        sim_device.seed = int(seed)
    try:
        with _sanitizer.sanitize(sanitizer):
            yield sim_device
    finally:
        sim_device.jitter, sim_device.seed = saved
        with _backend._lock:
            _backend._current = previous
