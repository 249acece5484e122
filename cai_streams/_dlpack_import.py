"""Taking any DLPack producer: which protocol, the capsule, and its owner.

:func:`take` asks the producer for a capsule ordered onto the stream the
consumer will use, validates the tensor, takes it (renames the capsule
``"used_..."``) and returns an :class:`~cai_streams.ArrayView` whose ``owner``
is a :class:`DLPackOwner`: the one object that calls the tensor's deleter,
exactly once, when it is collected. Whatever keeps a view's owner alive (a
pending event, a stream-ordered hold) therefore delays the deleter too.

Which protocol, when an object offers both: the one that orders the work.
An interface of version 3 names the stream the producer's work is pending
on, and the interface path also gives ``consuming()`` its back-edge (DLPack
has no way back to the producer) and needs no capsule: it is used. An older
interface names no stream (PyTorch's and JAX's are version 2): DLPack is
used, since its producer orders the consumer's stream itself. So is an
interface that cannot be read (a CPU tensor's). ``protocol="cai"`` or
``"dlpack"`` forces one.
"""

from __future__ import annotations

import enum
import operator
import sys
import threading
import warnings
from collections.abc import Mapping
from typing import Any, Final, Literal

from . import _dlpack
from ._backend import current_backend
from ._errors import CudaWarning, InterfaceError
from ._interface import ArrayView, parse
from ._unique import Unique

__all__ = [
    "DLPackOwner",
    "Protocol",
    "Unread",
    "check_protocol",
    "choose_protocol",
    "read_capsule",
    "take",
    "uses_dlpack",
]

Protocol = Literal["cai", "dlpack"]
PROTOCOLS: Final = ("cai", "dlpack")
#: what the consumer tells producers it reads: DLPack 1.x, versioned capsules
MAX_VERSION: Final = _dlpack.VERSION
#: more dimensions than any library makes: a larger ndim is a corrupt struct
MAX_NDIM: Final = 64


class Unread(enum.Enum):
    """What :func:`choose_protocol` gives for an interface it did not read."""

    UNREAD = "the interface was not read"


def uses_dlpack(obj: object, protocol: object) -> bool:
    """Whether to take ``obj`` through DLPack (see the module docstring).
    May read ``obj``'s interface (user code); enqueues nothing."""
    return choose_protocol(obj, protocol)[0]


def choose_protocol(obj: object, protocol: object) -> tuple[bool, Any]:
    """Whether to take ``obj`` through DLPack, and the interface read to
    decide (``Unread.UNREAD`` if none was), so that the interface path need
    not read it again. May read the interface (user code); enqueues nothing."""
    if protocol is None:
        if type(obj) is ArrayView:  # (its own: version 3, read by parse, never exported)
            return False, Unread.UNREAD
        if not has_dlpack(obj):
            return False, Unread.UNREAD
        cai = _interface_naming_stream(obj)
        return cai is Unread.UNREAD, cai
    check_protocol(protocol)
    if protocol == "dlpack" and not has_dlpack(obj):
        raise TypeError(
            f"{type(obj).__qualname__} has no __dlpack__ and __dlpack_device__ "
            "(protocol='dlpack' was asked for)"
        )
    return protocol == "dlpack", Unread.UNREAD


def check_protocol(protocol: object) -> None:
    """ValueError unless ``protocol`` is None, ``"cai"`` or ``"dlpack"``."""
    if protocol is not None and protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be None, 'cai' or 'dlpack', got {protocol!r}")


def _interface_naming_stream(obj: object) -> Any:
    """``obj``'s interface if it is readable and of version 3 or later, else
    ``Unread.UNREAD``."""
    if not hasattr(type(obj), "__cuda_array_interface__"):
        return Unread.UNREAD
    try:
        cai = obj.__cuda_array_interface__  # type: ignore[attr-defined]
    except Exception:  # e.g. a CPU tensor's: DLPack gives the clear error
        return Unread.UNREAD
    # type(...) is dict first: an ABC isinstance check is a Python-level call
    mapping = type(cai) is dict or isinstance(cai, Mapping)
    version = cai.get("version") if mapping else None
    return cai if isinstance(version, int) and version >= 3 else Unread.UNREAD


def has_dlpack(obj: object) -> bool:
    t = type(obj)
    return hasattr(t, "__dlpack__") and hasattr(t, "__dlpack_device__")


class Held(enum.Enum):
    """Where a taken tensor is in its life."""

    OWNED = "owned: the deleter has not run"
    DELETED = "deleted: the deleter ran"


class DLPackOwner(Unique):
    """Owns one DLPack tensor taken from a capsule: calls its deleter exactly
    once, when this object is collected (so after every view of it).

    It exposes the tensor as a CUDA Array Interface dict, so it can be
    consumed, tracked or re-exported like any array.
    """

    __slots__ = ("__weakref__", "_cai", "_lock", "address", "producer", "state", "versioned")

    def __init__(self, address: int, versioned: bool, cai: dict[str, Any], producer: str) -> None:
        self.address = address
        self.versioned = versioned
        self.producer = producer
        self._cai = cai
        self._lock = threading.Lock()
        self.state = Held.OWNED

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return dict(self._cai)

    def _delete(self) -> None:
        with self._lock:
            if self.state is Held.DELETED:
                return
            self.state = Held.DELETED
        _dlpack.call_deleter(self.address, self.versioned)

    def __del__(self) -> None:
        if sys.is_finalizing():
            return  # prefer a leak to a call into a library that is being torn down
        try:
            self._delete()
        except Exception as exc:  # a destructor must not raise
            warnings.warn(
                f"the deleter of a {self.producer} DLPack tensor failed: {exc!r}",
                CudaWarning,
                stacklevel=1,
            )

    def __repr__(self) -> str:
        return f"<DLPackOwner of a {self.producer} tensor, {self.state.name.lower()}>"


def _bad(what: str, value: object, expected: str) -> InterfaceError:
    return InterfaceError(f"DLPack tensor {what} is {value!r}: expected {expected}")


def _read_tensor(
    address: int, versioned: bool, stream: int | None, device_id: int | None
) -> dict[str, Any]:
    """The tensor at ``address`` as a v3 interface dict; ``device_id``, if
    given, is the CUDA device the tensor must report."""
    readonly = False
    if versioned:
        head = _dlpack.DLManagedTensorVersioned.from_address(address)
        major, minor = head.version.major, head.version.minor
        if major != _dlpack.VERSION[0]:
            raise _bad("version", (major, minor), f"major version {_dlpack.VERSION[0]}")
        readonly = bool(head.flags & _dlpack.FLAG_READ_ONLY)
        t = head.dl_tensor
    else:
        t = _dlpack.DLManagedTensor.from_address(address).dl_tensor
    device = (t.device.device_type, t.device.device_id)
    if device[0] != _dlpack.DeviceType.CUDA:
        raise _not_cuda(device, "its capsule")
    if device_id is not None and device[1] != device_id:
        raise InterfaceError(
            f"the DLPack capsule's tensor is on CUDA device {device[1]}, but its producer's "
            f"__dlpack_device__() reported device {device_id}: the stream it was handed "
            "belongs to the wrong device; the producer is inconsistent"
        )
    ndim = t.ndim
    if not 0 <= ndim <= MAX_NDIM:
        raise _bad("ndim", ndim, f"0 to {MAX_NDIM}")
    code, bits, lanes = t.dtype.code, t.dtype.bits, t.dtype.lanes
    dtype = _dlpack.numpy_dtype(code, bits, lanes)
    if dtype is None:
        raise _bad(
            "dtype",
            _dlpack.describe_dtype(code, bits, lanes),
            "bool, int/uint 8-64, float 16-64 or complex 64/128 with one lane "
            "(the types a CUDA Array Interface typestr can express)",
        )
    if ndim and not t.shape:
        raise _bad("shape", "NULL", f"{ndim} extents")
    shape = tuple(int(t.shape[i]) for i in range(ndim))
    if any(n < 0 for n in shape):
        raise _bad("shape", shape, "non-negative extents")
    strides = None
    if t.strides and ndim:
        strides = tuple(int(t.strides[i]) * dtype.itemsize for i in range(ndim))
    data = t.data or 0
    size = 1
    for n in shape:
        size *= n
    if size and not data:
        raise _bad("data", "NULL", f"a device pointer for {size} elements")
    ptr = data + t.byte_offset if size else 0
    cai: dict[str, Any] = {
        "shape": shape,
        "typestr": dtype.str,
        "data": (ptr, readonly),
        "strides": strides,
        "version": 3,
        "stream": stream,
    }
    return cai


_DEVICE_NAMES: Final = {
    1: "kDLCPU",
    3: "kDLCUDAHost",
    4: "kDLOpenCL",
    7: "kDLVulkan",
    8: "kDLMetal",
    10: "kDLROCM",
    11: "kDLROCMHost",
    13: "kDLCUDAManaged",
    14: "kDLOneAPI",
}


def _not_cuda(device: tuple[int, int], where: str) -> InterfaceError:
    name = _DEVICE_NAMES.get(device[0], f"device type {device[0]}")
    return InterfaceError(
        f"DLPack {where} reports device {tuple(device)} ({name}): cai_streams consumes "
        "CUDA device memory only (device type 2, kDLCUDA); copy the array to a GPU first"
    )


def read_capsule(
    capsule: object, *, stream: int | None, producer: str = "DLPack", device_id: int | None = None
) -> ArrayView:
    """Validate and take a DLPack capsule: an ArrayView whose ``stream`` is
    ``stream`` and whose owner calls the tensor's deleter once, when collected.
    ``device_id``: the CUDA device the producer said the tensor is on, if
    asked (another device in the tensor raises InterfaceError).

    A malformed tensor raises InterfaceError and is not taken: the capsule's
    own destructor deletes it. Does not block; enqueues nothing.
    """
    found = _dlpack.capsule_pointer(capsule)
    if found is None:
        name = _dlpack.capsule_name(capsule)
        if name is None:
            raise InterfaceError(
                f"__dlpack__() returned a {type(capsule).__name__}: expected a PyCapsule "
                "named 'dltensor' or 'dltensor_versioned'"
            )
        raise InterfaceError(
            f"__dlpack__() returned a capsule named {name!r}: expected 'dltensor' or "
            "'dltensor_versioned' (a 'used_' capsule was already taken by a consumer)"
        )
    address, versioned = found
    if not address:
        raise _bad("pointer", "NULL", "a DLManagedTensor")
    cai = _read_tensor(address, versioned, stream, device_id)
    _dlpack.mark_used(capsule, versioned)
    owner = DLPackOwner(address, versioned, cai, producer)
    return parse(owner)


def cuda_device_of(obj: Any) -> int:
    """The CUDA device ``obj.__dlpack_device__()`` reports; InterfaceError for
    any other kind of device, a device the current backend does not have, or
    a malformed answer (two integers, as ``operator.index`` takes them: an
    enum member or a NumPy integer, not a float or a string). Does not block."""
    device = obj.__dlpack_device__()
    try:
        kind, ordinal = device
        kind, ordinal = operator.index(kind), operator.index(ordinal)
    except (TypeError, ValueError):
        raise InterfaceError(
            f"{type(obj).__qualname__}.__dlpack_device__() returned {device!r}: expected "
            "(device_type, device_id), two integers"
        ) from None
    if kind != _dlpack.DeviceType.CUDA:
        raise _not_cuda((kind, ordinal), f"producer {type(obj).__qualname__}")
    backend = current_backend()
    count = backend.device_count()
    if not 0 <= ordinal < count:
        raise InterfaceError(
            f"{type(obj).__qualname__}.__dlpack_device__() returned {device!r}: CUDA device "
            f"{ordinal} does not exist (the {backend.name!r} backend has {count} device(s))"
        )
    return ordinal


def take(obj: Any, stream: int | None, device_id: int | None = None) -> ArrayView:
    """``obj.__dlpack__(stream=...)`` taken as an ArrayView (see the module docstring).

    ``stream``: the handle the producer orders after its work, and the
    view's ``stream``; None passes -1 (no synchronization). ``device_id``:
    what :func:`cuda_device_of` said of ``obj`` when ``stream`` was chosen
    (None: asked here), which the capsule's tensor must be on. A producer not
    on a CUDA device raises InterfaceError before any capsule is made.
    Only enqueues GPU work (the producer's join).
    """
    if device_id is None:
        device_id = cuda_device_of(obj)
    passed = -1 if stream is None else stream
    try:
        capsule = obj.__dlpack__(stream=passed, max_version=MAX_VERSION)
    except TypeError:  # a producer older than the 2023 standard: no max_version
        capsule = obj.__dlpack__(stream=passed)
    producer = type(obj).__module__.partition(".")[0] or type(obj).__qualname__
    return read_capsule(capsule, stream=stream, producer=producer, device_id=device_id)
