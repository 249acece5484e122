"""DLPack's C structs and capsules, through ctypes (no compiler, no extension).

The structs are those of ``dlpack.h`` 1.x: ``DLTensor``, the legacy
``DLManagedTensor`` (capsule ``"dltensor"``) and ``DLManagedTensorVersioned``
(capsule ``"dltensor_versioned"``). A consumer takes a capsule by renaming it
``"used_..."``; from then on it calls the tensor's deleter, exactly once.

Capsules made here have no destructor. A destructor written in Python (all
ctypes offers) cannot keep an exception that is pending when the capsule is
freed, and NumPy frees a refused capsule with its BufferError set: the error
would turn into a SystemError and the deleter would not run. The exporter
keeps each capsule until a consumer takes it, and deletes the tensors of
capsules nobody else holds any more (``_dlpack_export.sweep``).

The Python C API is called through prototypes of our own (``PYFUNCTYPE``: the
GIL is held and a Python error raises), never by setting ``argtypes`` on the
shared ``ctypes.pythonapi`` functions, which other libraries use too.
"""

from __future__ import annotations

import ctypes
import enum
from typing import Any, Final

import numpy as np

__all__ = [
    "DLDataType",
    "DLDevice",
    "DLManagedTensor",
    "DLManagedTensorVersioned",
    "DLPackVersion",
    "DLTensor",
    "DeviceType",
    "FLAG_IS_COPIED",
    "FLAG_READ_ONLY",
    "call_deleter",
    "capsule_name",
    "capsule_pointer",
    "describe_dtype",
    "dl_dtype",
    "is_untaken",
    "mark_used",
    "new_capsule",
    "numpy_dtype",
]

#: the DLPack ABI version this module reads and writes
VERSION: Final = (1, 0)
FLAG_READ_ONLY: Final = 1 << 0
FLAG_IS_COPIED: Final = 1 << 1


class DeviceType(enum.IntEnum):
    """``DLDeviceType``: the ones a CUDA library meets (others are refused by value)."""

    CPU = 1
    CUDA = 2
    CUDA_HOST = 3
    OPENCL = 4
    VULKAN = 7
    METAL = 8
    VPI = 9
    ROCM = 10
    ROCM_HOST = 11
    EXT_DEV = 12
    CUDA_MANAGED = 13
    ONE_API = 14
    WEBGPU = 15
    HEXAGON = 16
    MAIA = 17


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    """The legacy struct (DLPack < 1.0): no version, no flags."""

    _fields_ = [
        ("dl_tensor", DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),  # void (*)(DLManagedTensor *)
    ]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    """The 1.x struct; everything up to ``flags`` is stable across majors."""

    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),  # void (*)(DLManagedTensorVersioned *)
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


# -- the Python C API, through our own prototypes ---------------------------------------

_api = ctypes.pythonapi
_obj = ctypes.py_object
_New = ctypes.PYFUNCTYPE(_obj, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", _api)
)
_IsValid = ctypes.PYFUNCTYPE(ctypes.c_int, _obj, ctypes.c_char_p)(("PyCapsule_IsValid", _api))
_GetPointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, _obj, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", _api)
)
_SetName = ctypes.PYFUNCTYPE(ctypes.c_int, _obj, ctypes.c_char_p)(("PyCapsule_SetName", _api))
_GetName = ctypes.PYFUNCTYPE(ctypes.c_char_p, _obj)(("PyCapsule_GetName", _api))

#: a deleter, ``void (*)(DLManagedTensor*)``; called with the GIL held
_Deleter = ctypes.PYFUNCTYPE(None, ctypes.c_void_p)

# A capsule keeps the char* of its name: these live as long as the process.
_NAME: Final = {False: ctypes.c_char_p(b"dltensor"), True: ctypes.c_char_p(b"dltensor_versioned")}
_USED: Final = {
    False: ctypes.c_char_p(b"used_dltensor"),
    True: ctypes.c_char_p(b"used_dltensor_versioned"),
}


def _struct_of(versioned: bool) -> type[DLManagedTensor] | type[DLManagedTensorVersioned]:
    return DLManagedTensorVersioned if versioned else DLManagedTensor


def call_deleter(address: int, versioned: bool) -> bool:
    """Call the deleter of the managed tensor at ``address`` (if it has one).

    The caller owns the tensor and calls this once. False when the tensor has
    no deleter (the standard allows NULL). Blocks only as long as the deleter.
    """
    deleter = _struct_of(versioned).from_address(address).deleter
    if not deleter:
        return False
    _Deleter(deleter)(address)
    return True


def new_capsule(address: int, versioned: bool) -> Any:
    """A capsule named ``"dltensor"`` or ``"dltensor_versioned"`` holding the
    managed tensor at ``address``, with no destructor: its maker deletes the
    tensor if no consumer takes it (see ``_dlpack_export``). Does not block."""
    return _New(address, _NAME[versioned], None)


def is_untaken(capsule: object, versioned: bool) -> bool:
    """Whether no consumer has renamed the capsule ``"used_..."`` yet."""
    return bool(_IsValid(capsule, _NAME[versioned]))


def capsule_name(capsule: object) -> str | None:
    """The capsule's name ("" for none), or None if ``capsule`` is not a capsule."""
    if type(capsule).__name__ != "PyCapsule":
        return None
    name = _GetName(capsule)
    return "" if name is None else name.decode("ascii", "replace")


def capsule_pointer(capsule: object) -> tuple[int, bool] | None:
    """``(address, versioned)`` of an untaken DLPack capsule, else None."""
    if type(capsule).__name__ != "PyCapsule":
        return None
    for versioned in (True, False):
        if _IsValid(capsule, _NAME[versioned]):
            return int(_GetPointer(capsule, _NAME[versioned])), versioned
    return None


def mark_used(capsule: object, versioned: bool) -> None:
    """Rename the capsule ``"used_..."``: its destructor will not delete the
    tensor any more; whoever called this must, once."""
    if _SetName(capsule, _USED[versioned]) != 0:
        raise RuntimeError("PyCapsule_SetName failed")  # pragma: no cover - sets an error


# -- dtypes -------------------------------------------------------------------------------

#: DLDataTypeCode values this library can express as a CUDA Array Interface typestr
_INT, _UINT, _FLOAT, _COMPLEX, _BOOL = 0, 1, 2, 5, 6
_CODE_NAMES: Final = {
    0: "int",
    1: "uint",
    2: "float",
    3: "opaque handle",
    4: "bfloat",
    5: "complex",
    6: "bool",
}
_KINDS: Final = {"i": _INT, "u": _UINT, "f": _FLOAT, "c": _COMPLEX, "b": _BOOL}
_NUMPY: Final = {
    (_INT, 8): "i1",
    (_INT, 16): "i2",
    (_INT, 32): "i4",
    (_INT, 64): "i8",
    (_UINT, 8): "u1",
    (_UINT, 16): "u2",
    (_UINT, 32): "u4",
    (_UINT, 64): "u8",
    (_FLOAT, 16): "f2",
    (_FLOAT, 32): "f4",
    (_FLOAT, 64): "f8",
    (_COMPLEX, 64): "c8",
    (_COMPLEX, 128): "c16",
    (_BOOL, 8): "b1",
}


def dl_dtype(dtype: np.dtype[Any]) -> tuple[int, int, int] | None:
    """``(code, bits, lanes)`` for a numpy dtype, or None if DLPack has no such
    type (structured, strings, datetimes, long double, non-native byte order)."""
    code = _KINDS.get(dtype.kind)
    if code is None or dtype.fields is not None or not dtype.isnative:
        return None
    bits = dtype.itemsize * 8
    if (code, bits) not in _NUMPY:
        return None
    return code, bits, 1


def numpy_dtype(code: int, bits: int, lanes: int) -> np.dtype[Any] | None:
    """The native numpy dtype of a DLPack type, or None if no typestr expresses it."""
    name = _NUMPY.get((code, bits)) if lanes == 1 else None
    return None if name is None else np.dtype(name)


def describe_dtype(code: int, bits: int, lanes: int) -> str:
    """A DLPack type in words, for error messages."""
    kind = _CODE_NAMES.get(code, f"code {code}")
    return f"{kind}{bits}" + (f"x{lanes}" if lanes != 1 else "")
