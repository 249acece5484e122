"""``__dlpack__`` for tracked arrays, views and simulated arrays: the same join.

The consumer passes the stream it will use; the producer orders that stream
after its pending work before the capsule is handed out (no export-stream hop)
and, for a tracked array, what the consumer enqueues there from now on counts
as a read. The stream values are the array API standard's for CUDA:

========  ===========================================================
``None``  the legacy default stream (1)
``1``     the legacy default stream
``2``     the calling thread's per-thread default stream
``> 2``   a ``cudaStream_t`` of the consumer's
``-1``    no synchronization at all (the consumer takes care of it)
``0``     refused (ambiguous), ValueError
========  ===========================================================

A capsule's tensor owns one reference to the exported object (so to its
memory) and the structs it points at; its deleter, a C callable kept alive
here, lets go of both exactly once. A consumer that takes the capsule calls
it; a capsule nobody took is found by :func:`sweep` once nobody holds it (at
the next export or garbage collection), since a destructor written in Python
cannot run while a refusing consumer's error is pending (see ``_dlpack``).
"""

from __future__ import annotations

import ctypes
import gc
import operator
import sys
import threading
from collections.abc import Callable
from typing import Any, Final

from . import _dlpack
from ._backend import LEGACY_DEFAULT_STREAM, Backend
from ._deferred import as_finalizer
from ._device import OnDevice, view_stream_id
from ._interface import ArrayView
from ._scheduler import scheduler_for
from ._stream import Stream, as_stream

__all__ = [
    "consumer_stream",
    "export_view",
    "live_exports",
    "make_capsule",
    "sweep",
]

#: the stream value by which a consumer asks for no synchronization
NO_SYNC: Final = -1
LEGACY: Final = 1


class _Export:
    """What one capsule's tensor owns until its deleter runs."""

    __slots__ = ("capsule", "keep", "managed", "shape", "strides", "versioned")

    def __init__(
        self, managed: ctypes.Structure, shape: Any, strides: Any, keep: object, versioned: bool
    ) -> None:
        self.managed = managed
        self.shape = shape
        self.strides = strides
        self.keep = keep
        self.versioned = versioned
        self.capsule: object = None  # until a consumer takes it (see sweep)


_exports: dict[int, _Export] = {}  # every tensor made here and not yet deleted
_untaken: dict[int, _Export] = {}  # those whose capsule no consumer has taken yet
_lock = threading.RLock()  # bookkeeping only (reentrant: a sweep may free a capsule)
_stale_deletes = 0  # a deleter called for a tensor it no longer owns (must stay 0)
_sweeping = False
#: references to an untaken capsule when only the registry holds it: the
#: entry's slot, and getrefcount's argument
_ONLY_OURS: Final = 2


def _delete(address: int) -> None:
    """The deleter of every tensor made here: lets go of the structs and the
    exported object. Called through a C pointer; ctypes takes the GIL."""
    global _stale_deletes
    with _lock:
        entry = _exports.pop(address, None)
        _untaken.pop(address, None)
        if entry is None:
            _stale_deletes += 1
    del entry  # the structs and the owner go here, after the last use of address


#: the C callable every tensor made here points at (kept alive by this module)
_deleter: Final = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(_delete)
_DELETER: Final = ctypes.cast(_deleter, ctypes.c_void_p).value


def sweep() -> int:
    """Delete the tensors of capsules that no consumer took and nobody holds
    (a consumer that refused one, as NumPy does a CUDA tensor, dropped it);
    let go of capsules a consumer took (it calls the deleter). How many tensors
    were deleted. Runs at each export and after each garbage collection.
    Does not block."""
    global _sweeping
    if not _untaken:
        return 0
    dropped: list[_Export] = []
    deleted = 0
    with _lock:
        if _sweeping:  # a collection inside a sweep, in this thread
            return 0
        _sweeping = True
        try:
            for address, entry in list(_untaken.items()):
                if not _dlpack.is_untaken(entry.capsule, entry.versioned):
                    del _untaken[address]  # taken: its consumer calls the deleter
                elif sys.getrefcount(entry.capsule) <= _ONLY_OURS:
                    del _untaken[address]  # nobody can take it any more: delete it
                    del _exports[address]
                    deleted += 1
                else:
                    continue
                entry.capsule = None
                dropped.append(entry)
        finally:
            _sweeping = False
    del dropped  # the capsules, structs and owners go outside the lock
    return deleted


def live_exports() -> tuple[int, int]:
    """``(tensors made here not yet deleted, deleter calls for no live tensor)``,
    after a :func:`sweep`."""
    sweep()
    with _lock:
        return len(_exports), _stale_deletes


def consumer_stream(stream: object, backend: Backend) -> Stream | None:
    """The consumer's stream as the standard spells it for CUDA (see the module
    docstring); None for ``-1``. TypeError for a non-int, ValueError for 0,
    values below -1 and handles that are not streams of ``backend``."""
    if stream is None:
        return as_stream(LEGACY, backend)
    if isinstance(stream, bool) or not isinstance(stream, int):
        raise TypeError(
            f"__dlpack__(stream=) takes None or an int for a CUDA array, got "
            f"{type(stream).__name__}: 1 legacy default, 2 per-thread default, a "
            "cudaStream_t, or -1 for no synchronization"
        )
    if stream == NO_SYNC:
        return None
    if stream == 0:
        raise ValueError(
            "__dlpack__(stream=0) is ambiguous and disallowed by the array API standard: "
            "pass 1 (legacy default stream), 2 (per-thread default stream) or a cudaStream_t"
        )
    if stream < NO_SYNC:
        raise ValueError(f"__dlpack__(stream=) must be -1 or a stream handle, got {stream}")
    return as_stream(stream, backend)


def _versioned(max_version: object) -> bool:
    if max_version is None:
        return False
    try:
        major, _minor = (operator.index(v) for v in max_version)  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        raise TypeError(
            f"__dlpack__(max_version=) takes None or a (major, minor) tuple of ints, "
            f"got {max_version!r}"
        ) from None
    return major >= _dlpack.VERSION[0]


def check_request(
    device: tuple[int, int], *, readonly: bool, max_version: object, dl_device: object, copy: object
) -> bool:
    """Validate what the consumer asked for; True for a versioned capsule.

    BufferError where the standard says so: another device or ``copy=True``
    (copies are not implemented: the data is always shared), and a read-only
    array asked for a legacy capsule, which cannot say it is read-only.
    """
    if copy is not None and not isinstance(copy, bool):
        raise TypeError(f"__dlpack__(copy=) takes None, True or False, got {copy!r}")
    versioned = _versioned(max_version)
    if dl_device is not None:
        try:
            wanted = tuple(operator.index(v) for v in dl_device)  # type: ignore[attr-defined]
        except TypeError:
            raise TypeError(
                f"__dlpack__(dl_device=) takes None or a (device_type, device_id) tuple, "
                f"got {dl_device!r}"
            ) from None
        if wanted != device:
            raise BufferError(
                f"the array is on DLPack device {device} (kDLCUDA, device {device[1]}); "
                f"exporting to {wanted} would need a copy, which cai_streams does not make"
                + (" (copy=False)" if copy is False else "")
            )
    if copy:
        raise BufferError(
            "__dlpack__(copy=True): cai_streams shares device memory and never copies; "
            "copy the array yourself, or pass copy=None"
        )
    if readonly and not versioned:
        raise BufferError(
            "the array is read-only and the consumer asked for a legacy capsule, which "
            "cannot say so: pass max_version=(1, 0) or newer"
        )
    return versioned


def make_capsule(view: ArrayView, device: int, *, versioned: bool, keep: object) -> Any:
    """A DLPack capsule describing ``view`` on CUDA ``device``; the tensor
    keeps ``keep`` alive until its deleter runs. BufferError for a dtype or
    strides DLPack cannot express. Does not block; enqueues nothing."""
    dtype = view.dtype
    code = _dlpack.dl_dtype(dtype)
    if code is None:
        raise BufferError(
            f"DLPack has no type for {dtype} (typestr {view.typestr!r}): expected a native "
            "bool, int, uint, float16/32/64 or complex64/128 array"
        )
    itemsize = dtype.itemsize
    if any(s % itemsize for s in view.strides):
        raise BufferError(
            f"DLPack strides count elements: byte strides {view.strides} are not "
            f"multiples of the item size {itemsize}"
        )
    ndim = len(view.shape)
    shape = (ctypes.c_int64 * max(ndim, 1))(*view.shape)
    strides = (ctypes.c_int64 * max(ndim, 1))(*(s // itemsize for s in view.strides))
    managed: _dlpack.DLManagedTensor | _dlpack.DLManagedTensorVersioned
    if versioned:
        managed = _dlpack.DLManagedTensorVersioned()
        managed.version.major, managed.version.minor = _dlpack.VERSION
        managed.flags = _dlpack.FLAG_READ_ONLY if view.readonly else 0
    else:
        managed = _dlpack.DLManagedTensor()
    t = managed.dl_tensor
    t.data = view.ptr or None
    t.device.device_type = _dlpack.DeviceType.CUDA
    t.device.device_id = device
    t.ndim = ndim
    t.dtype.code, t.dtype.bits, t.dtype.lanes = code
    t.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
    t.strides = ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64))
    t.byte_offset = 0
    managed.deleter = _DELETER
    address = ctypes.addressof(managed)
    entry = _Export(managed, shape, strides, keep, versioned)
    capsule = _dlpack.new_capsule(address, versioned)
    sweep()
    with _lock:
        entry.capsule = capsule
        _exports[address] = entry
        _untaken[address] = entry
    return capsule


def export_view(
    view: ArrayView,
    backend: Backend,
    device: int,
    keep: object,
    *,
    stream: object,
    max_version: object,
    dl_device: object,
    copy: object,
    join: Callable[[Stream], None] | None = None,
) -> Any:
    """``__dlpack__`` of an untracked array whose pending work is on
    ``view.stream`` (None: none): that stream is joined onto the consumer's
    (one pooled event, none when they are the same stream), unless the
    consumer passed -1. ``join``, when given, does the join instead (a tracked
    array's pending work). Only enqueues GPU work. A masked view raises
    BufferError: a DLPack tensor has no mask (its interface carries one)."""
    if view.mask is not None:
        raise BufferError(
            "a masked array cannot be exported through DLPack, which has no mask "
            "(the consumer would read the masked elements): hand over its "
            "__cuda_array_interface__, which carries the mask"
        )
    versioned = check_request(
        (int(_dlpack.DeviceType.CUDA), device),
        readonly=view.readonly,
        max_version=max_version,
        dl_device=dl_device,
        copy=copy,
    )
    # None, 1 and 2 name the default streams of the array's device, whichever
    # is current (a consumer computes them for the device __dlpack_device__
    # gave: torch.from_dlpack does not switch to it)
    default = LEGACY_DEFAULT_STREAM if stream is None else 0
    if isinstance(stream, int) and not isinstance(stream, bool):  # (an IntEnum too)
        default = int(stream)
    with OnDevice(backend, device, default):
        consumer = consumer_stream(stream, backend)
        if consumer is not None:
            if join is not None:
                join(consumer)
            elif view.stream is not None:
                sched = scheduler_for(backend, device)
                producer = view_stream_id(backend, view)
                if producer != consumer._key():
                    sched.join(consumer.handle, producer, keepalive=consumer, what="__dlpack__()")
                    sched.counters.add(joins=1)
                sched.declare_stream_read(consumer, view, "__dlpack__(): the consumer's read")
    return make_capsule(view, device, versioned=versioned, keep=keep)


def _after_collection(phase: str, info: dict[str, Any]) -> None:
    if phase == "stop" and _untaken:
        # the collection may have started inside the library, holding its
        # locks: what the sweep lets go calls back in as a finalizer would
        with as_finalizer():
            sweep()


gc.callbacks.append(_after_collection)
