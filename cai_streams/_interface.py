"""CUDA Array Interface v0-v3: reading and validating it, and writing v3.

``parse(obj)`` reads ``obj.__cuda_array_interface__`` exactly once and returns a
frozen :class:`ArrayView`, or raises :class:`InterfaceError` naming the field,
the value received and what is expected (:class:`TypeError` when ``obj`` has no
interface at all).
"""

from __future__ import annotations

import operator
import re
from collections.abc import Mapping
from typing import Any, Final

import numpy as np

from ._errors import InterfaceError
from ._identity import stream_id_now
from ._unique import Unique

__all__ = ["ArrayView", "c_strides", "is_c_contiguous", "parse", "stream_of", "v3_dict"]

_REQUIRED: Final = ("shape", "typestr", "data", "version")
_TYPESTR: Final = re.compile(r"[<>|][bifucmMSUV]\d+(\[\d*[A-Za-z]+\])?")
_LATEST: Final = 3
#: pointers and stream handles are 64-bit values; byte extents must stay within them
_ADDRESS_LIMIT: Final = 1 << 64
#: a mask may have a mask of its own; beyond this depth it is taken for a cycle
_MAX_MASK_DEPTH: Final = 8
_dtypes: dict[str, np.dtype[Any]] = {}


def c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """Byte strides of a C-contiguous array of ``shape``."""
    strides = []
    step = itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def extent(
    ptr: int, shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int
) -> tuple[int, int]:
    """The bytes ``[lo, hi)`` an array of this layout can touch (empty for zero-size)."""
    lo = hi = ptr
    for n, s in zip(shape, strides, strict=True):
        if n == 0:
            return (ptr, ptr)
        if s < 0:
            lo += (n - 1) * s
        else:
            hi += (n - 1) * s
    return (lo, hi + itemsize)


#: a strided layout is declared as its contiguous runs of bytes up to this
#: many runs; beyond, as the bytes between its first and last (see :func:`runs`)
MAX_RUNS: Final = 1024


def runs(
    ptr: int, shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int
) -> list[tuple[int, int]]:
    """The bytes an array of this layout touches, as sorted disjoint runs
    ``[lo, hi)``: the parts of a strided view (columns of a matrix, every
    other element) do not touch the bytes between them. Beyond
    :data:`MAX_RUNS` runs, or for elements that overlap, the one run of
    :func:`extent` (which covers them all)."""
    if len(shape) == 1 and strides[0] == itemsize:  # the common case, at once
        return [(ptr, ptr + shape[0] * itemsize)] if shape[0] else []
    if any(n == 0 for n in shape):
        return []
    base = ptr
    dims = []
    for n, st in zip(shape, strides, strict=True):
        if n == 1 or st == 0:  # (one element, or the same ones again)
            continue
        if st < 0:  # the same bytes, walked the other way
            base += (n - 1) * st
            st = -st
        dims.append((st, n))
    dims.sort()
    run = itemsize
    i = 0
    while i < len(dims) and dims[i][0] == run:  # contiguous: one run so far
        run *= dims[i][1]
        i += 1
    outer = dims[i:]
    count = 1
    for _, n in outer:
        count *= n
    if count > MAX_RUNS or (outer and outer[0][0] < run):  # too many, or overlapping
        return [extent(ptr, shape, strides, itemsize)]
    starts = [base]
    for st, n in outer:
        starts = [s0 + k * st for s0 in starts for k in range(n)]
    starts.sort()
    merged: list[tuple[int, int]] = []
    for lo in starts:
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], lo + run))
        else:
            merged.append((lo, lo + run))
    return merged


def byte_runs(view: ArrayView) -> list[tuple[int, int]]:
    """The bytes ``view`` touches, as :func:`runs` gives them (for the
    sanitizer: a strided part leaves the bytes between its runs alone)."""
    return runs(view.ptr, view.shape, view.strides, view.dtype.itemsize)


def byte_range(view: ArrayView) -> tuple[int, int]:
    """The bytes ``[lo, hi)`` that ``view`` can touch (empty for zero-size)."""
    return extent(view.ptr, view.shape, view.strides, view.dtype.itemsize)


def is_c_contiguous(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    """numpy's rule: dimensions of length 1 may have any stride; empty is contiguous."""
    if 0 in shape:
        return True
    step = itemsize
    for n, s in zip(reversed(shape), reversed(strides), strict=True):
        if n != 1 and s != step:
            return False
        step *= n
    return True


class _ViewSlots(Unique):
    """The storage of an :class:`ArrayView`: plain slots, so that filling in a
    new view is fifteen specialized stores (see :func:`_make`)."""

    __slots__ = (
        "__weakref__",
        "_cai",
        "_leases",
        "_stream_key",
        "dtype",
        "mask",
        "nbytes",
        "owner",
        "ptr",
        "readonly",
        "shape",
        "size",
        "stream",
        "strides",
        "typestr",
        "version",
    )

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: np.dtype[Any]
    typestr: str
    readonly: bool
    size: int
    nbytes: int
    version: int
    mask: ArrayView | None
    stream: int | None
    owner: object
    _cai: dict[str, Any] | None
    #: the view's leases (``_hold.ViewLease``): one per handoff to a stream
    #: (a list once there is one); a view made from it with ``with_stream``
    #: joins each still counting it
    _leases: tuple[()] | list[Any]
    #: the identity (``_identity.StreamId``) of ``stream`` when the library
    #: handed the view to a stream it knows: handed on later, the view names
    #: that stream, not whichever the handle names then (another thread's
    #: handle 2, another device's 1, a new stream given a closed one's handle);
    #: None for a handle read from an interface or given to ``with_stream``
    _stream_key: Any


class ArrayView(_ViewSlots):
    """A validated description of device memory (frozen).

    ``strides`` are in bytes and always filled in. ``stream`` is where pending
    work on the data must be waited for (None: nothing to wait for). ``owner``
    is the object the view keeps alive. ``__cuda_array_interface__`` re-exports
    it as version 3, so CuPy, Numba and PyTorch accept a view directly.
    """

    __slots__ = ()

    def __init__(self) -> None:
        raise TypeError("ArrayView is made by cai_streams (consume, read_interface)")

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"ArrayView is frozen: cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"ArrayView is frozen: cannot delete {name!r}")

    def with_stream(self, stream: int | None) -> ArrayView:
        """The same view with another ``stream`` entry. Only bookkeeping.

        A view handed to a stream (``consume(obj, stream=s)``) keeps its owner
        until ``s`` has passed the work enqueued while it is in use; the view
        made here counts as in use too, for as long as it lives (hand it to
        CuPy or Numba and enqueue on ``s``: the owner outlives that work).
        ``stream``: a handle, as a version 3 interface names one (1 to 2**64 - 1;
        0 is ambiguous there), or None; else TypeError or ValueError."""
        if stream is not None and (type(stream) is not int or not 0 < stream < _ADDRESS_LIMIT):
            stream = _stream_entry(stream)
        if stream == self.stream:
            return self
        view = self._replace(stream, self.owner)
        if self._leases:
            from ._hold import join_leases  # (only for a view handed to a stream)

            join_leases(self, view)
        return view

    def _with_owner(self, owner: object) -> ArrayView:
        """The same view keeping ``owner`` alive instead (None: nothing)."""
        if owner is self.owner:
            return self
        view = self._replace(self.stream, owner)
        _set_stream_key(view, self._stream_key)
        return view

    def _on_stream(self, handle: int, key: Any) -> ArrayView:
        """``with_stream(handle)`` for a stream the library knows, whose
        identity (``key``, a ``StreamId``) the view keeps. Only bookkeeping."""
        if self.stream == handle and self._stream_key == key:
            return self
        view = self._replace(handle, self.owner)
        _set_stream_key(view, key)
        if self._leases:
            from ._hold import join_leases

            join_leases(self, view)
        return view

    def _replace(self, stream: int | None, owner: object) -> ArrayView:
        return _make(
            self.ptr,
            self.shape,
            self.strides,
            self.dtype,
            self.typestr,
            self.readonly,
            self.size,
            self.nbytes,
            self.version,
            self.mask,
            stream,
            owner,
        )

    @property
    def device(self) -> int:
        """The device where the data lives, asked of the current backend by
        pointer (cudaPointerGetAttributes on a GPU); for a zero-size array the
        current device. Does not block."""
        from ._backend import current_backend
        from ._device import device_of

        return device_of(current_backend(), self)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """The view as a version 3 interface (a new dict each time).

        Where its ``stream`` handle names the stream it was handed to (that
        thread's stream 2, that device's 1 or 2, a stream of the library's
        still open, or another library's stream), only bookkeeping. Handed on
        where the handle names another stream (another thread, another device
        current), that stream is joined onto the device's export stream, which
        the dict names, as :func:`export` does: only enqueues GPU work, and for
        a view of a tracked array waits only for another thread's open
        ``writing()`` block of it (bounded). Once that stream was closed,
        ValueError (its work can no longer be waited for by handle).
        """
        key = self._stream_key
        if key is not None and self._handed_on_elsewhere(key):
            from ._tracked import export

            return export(self)
        return self._v3()

    def _v3(self) -> dict[str, Any]:
        """The view's own version 3 dict (a copy), whatever its stream names now."""
        cai = self._cai
        if cai is None:
            cai = v3_dict(self)
            _set_cai(self, cai)
        return dict(cai)

    def _handed_on_elsewhere(self, key: Any) -> bool:
        """Whether ``view.stream``, a handle the library handed the view to as
        the stream ``key``, names another stream for this thread now."""
        if self.stream != key.handle or (key.generation == 0 and key.handle > 2):
            return False  # (another library's handle, not a default stream 1 or 2: it
            # names what it named; a stream given it since cannot be told apart)
        try:
            return bool(stream_id_now(key.backend, key.handle) != key)
        except Exception:  # noqa: BLE001 - a handle that names nothing now: another stream's
            return True

    def __dlpack__(
        self,
        *,
        stream: int | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        """A DLPack capsule of the view (it keeps the view, so its owner, alive).

        ``view.stream``, if any, is joined onto the consumer's ``stream`` (the
        array API standard's values for CUDA; -1: no synchronization); for a
        view of a tracked array (``consume(t, stream=s)``), that array's
        pending writes, and the consumer's read counts for it. See
        :meth:`TrackedArray.__dlpack__ <cai_streams.TrackedArray.__dlpack__>`
        for the other arguments. Only enqueues GPU work; for a view of a
        tracked array, waits only for another thread's open ``writing()``
        block of that array (bounded).
        """
        from ._backend import current_backend
        from ._device import device_of
        from ._dlpack_export import export_view
        from ._tracked import dlpack_join

        backend = current_backend()
        device = device_of(backend, self)
        return export_view(
            self,
            backend,
            device,
            self,
            stream=stream,
            max_version=max_version,
            dl_device=dl_device,
            copy=copy,
            join=dlpack_join(self, backend),
        )

    def __dlpack_device__(self) -> tuple[int, int]:
        """``(2, device)``: kDLCUDA and the device holding the data. Does not block."""
        from ._backend import current_backend
        from ._device import device_of

        return (2, device_of(current_backend(), self))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ArrayView):
            return NotImplemented
        return self._key() == other._key() and self.owner is other.owner

    def __hash__(self) -> int:
        return hash(self._key())

    def _key(self) -> tuple[Any, ...]:
        mask = None if self.mask is None else self.mask._key()
        return (
            self.ptr,
            self.shape,
            self.strides,
            self.dtype,
            self.typestr,
            self.readonly,
            self.version,
            mask,
            self.stream,
        )

    def __repr__(self) -> str:
        return (
            f"ArrayView(ptr={self.ptr:#x}, shape={self.shape}, dtype={self.dtype}, "
            f"strides={self.strides}, readonly={self.readonly}, version={self.version}, "
            f"stream={self.stream}, mask={'yes' if self.mask is not None else None})"
        )


_set_cai = _ViewSlots.__dict__["_cai"].__set__  # the cached export, once made
_set_leases = _ViewSlots.__dict__["_leases"].__set__  # (``_hold``, under its lock)
_set_stream_key = _ViewSlots.__dict__["_stream_key"].__set__


class _Filling(_ViewSlots):
    """An ArrayView being filled in: the same storage without the frozen
    ``__setattr__``, so each store is a plain slot store. :func:`_make` turns
    it into an ArrayView (same layout: ``__class__`` assignment is allowed)."""

    __slots__ = ()


def _make(
    ptr: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    dtype: np.dtype[Any],
    typestr: str,
    readonly: bool,
    size: int,
    nbytes: int,
    version: int,
    mask: ArrayView | None,
    stream: int | None,
    owner: object,
) -> ArrayView:
    view = _Filling()
    view.ptr = ptr
    view.shape = shape
    view.strides = strides
    view.dtype = dtype
    view.typestr = typestr
    view.readonly = readonly
    view.size = size
    view.nbytes = nbytes
    view.version = version
    view.mask = mask
    view.stream = stream
    view.owner = owner
    view._cai = None
    view._leases = ()
    view._stream_key = None
    view.__class__ = ArrayView  # type: ignore[assignment]
    return view  # type: ignore[return-value]


def v3_dict(view: ArrayView) -> dict[str, Any]:
    """A version 3 interface dict for ``view`` (never ``stream: 0``)."""
    dtype = view.dtype
    cai: dict[str, Any] = {
        "shape": view.shape,
        "typestr": view.typestr,
        "data": (view.ptr if view.size else 0, view.readonly),
        # None only for exactly the strides a reader would compute, so that
        # parse(export(view)) gives back the same strides.
        "strides": None if view.strides == c_strides(view.shape, dtype.itemsize) else view.strides,
        "version": _LATEST,
        "stream": view.stream or None,
    }
    if dtype.fields is not None:
        cai["descr"] = dtype.descr
    if view.mask is not None:
        cai["mask"] = view.mask
    return cai


def _bad(field: str, value: object, expected: str) -> InterfaceError:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return InterfaceError(
        f"__cuda_array_interface__[{field!r}] is {shown} ({type(value).__name__}): "
        f"expected {expected}"
    )


def _stream_entry(stream: object) -> int:
    """``stream`` as a version 3 ``stream`` entry (an int from 1 to 2**64 - 1:
    numpy's ints too); TypeError or ValueError saying what it got."""
    if not _is_int(stream):
        hint = " (a Stream: pass its .handle)" if hasattr(stream, "handle") else ""
        raise TypeError(
            f"with_stream() takes a stream handle (an int) or None, got "
            f"{type(stream).__name__}{hint}"
        )
    handle = operator.index(stream)  # type: ignore[arg-type]
    if not 0 < handle < _ADDRESS_LIMIT:
        raise ValueError(
            f"with_stream() takes a stream handle from 1 to 2**64 - 1 (a version 3 "
            f"interface may not name 0: it is ambiguous), got {handle}"
        )
    return handle


def _is_int(value: object) -> bool:
    """An int, or an integer of NumPy's, not a bool (a type that only has
    ``__index__`` may not compare with ints: it is refused, naming the field)."""
    if type(value) is int:
        return True
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _read(obj: object) -> Any:
    try:
        return obj.__cuda_array_interface__  # type: ignore[attr-defined]
    except AttributeError as exc:
        raise _unreadable(obj, exc)  # noqa: B904 - its cause is set there


def _unreadable(obj: object, exc: AttributeError) -> TypeError:
    """The TypeError for an object whose interface could not be read: caused
    by ``exc`` when the type has an interface (a property that failed), else
    standing alone (as ``raise ... from None``)."""
    if hasattr(type(obj), "__cuda_array_interface__"):
        error = TypeError(
            f"{type(obj).__qualname__} has __cuda_array_interface__ but it is not "
            f"available on this object: {exc}"
        )
        error.__cause__ = exc
    else:
        error = TypeError(
            f"{type(obj).__module__}.{type(obj).__qualname__} does not expose "
            "__cuda_array_interface__; accepted are objects exposing it (CuPy, PyTorch, "
            "Numba, JAX arrays, cai_streams views, tracked and simulated arrays)"
        )
    error.__suppress_context__ = True
    return error


def _dtype(typestr: object, descr: object) -> np.dtype[Any]:
    if not isinstance(typestr, str):
        raise _bad("typestr", typestr, "a numpy array-interface type string such as '<f4'")
    # (cached for exact strs only: a subclass may hash and compare as another
    # type string, and would take its dtype, or leave its own under that key)
    exact = type(typestr) is str
    dtype = _dtypes.get(typestr) if descr is None and exact else None
    if dtype is not None:
        return dtype
    if _TYPESTR.fullmatch(typestr) is None:
        raise _bad(
            "typestr",
            typestr,
            "a numpy array-interface type string: byte order (<, > or |), kind, size, "
            "such as '<f4' or '|u1'",
        )
    try:
        dtype = np.dtype(typestr)
    except (TypeError, ValueError) as exc:
        raise _bad("typestr", typestr, f"a type numpy understands ({exc})") from None
    if descr is not None and descr != [("", typestr)]:
        try:
            described: np.dtype[Any] = np.dtype(descr)  # type: ignore[call-overload]
        except (TypeError, ValueError) as exc:
            raise _bad("descr", descr, f"a numpy array-interface descr ({exc})") from None
        if described.itemsize != dtype.itemsize or (
            described.fields is not None and dtype.kind != "V"
        ):
            raise _bad("descr", descr, f"a description consistent with typestr {typestr!r}")
        return described
    if exact and len(_dtypes) < 1024:
        _dtypes[typestr] = dtype
    return dtype


def stream_of(obj: object) -> int | None:
    """Only the ``stream`` entry of ``obj``'s interface, validated as :func:`parse`
    validates it (None before version 3). Reads the interface once; enqueues nothing.
    """
    if isinstance(obj, ArrayView):
        return obj.stream
    cai = _read(obj)
    if type(cai) is not dict and not isinstance(cai, Mapping):  # the ABC check is slow
        return parse(obj).stream  # the unusual cases, with parse's messages
    version: Any = cai.get("version")
    if not _is_int(version) or not 0 <= version <= _LATEST:
        return parse(obj).stream
    stream: Any = cai.get("stream") if version >= 3 else None
    if stream is None:
        return None
    if not _is_int(stream) or not 0 < stream < _ADDRESS_LIMIT:
        return parse(obj).stream  # raises, naming the field
    return int(stream)


def parse(obj: object) -> ArrayView:
    """Read and validate ``obj.__cuda_array_interface__`` (once). Does not block,
    enqueues nothing; ``view.stream`` says where pending work must be waited for.

    Integers are ints or NumPy's integers; a ``mask`` must have the array's
    shape (no broadcasting) and name no stream or the array's own (the one a
    handoff waits for). Anything else raises :class:`InterfaceError` naming
    the field, the value and what is expected.
    """
    if isinstance(obj, ArrayView):
        return obj
    try:
        cai = obj.__cuda_array_interface__  # type: ignore[attr-defined]
    except AttributeError as exc:
        raise _unreadable(obj, exc)  # noqa: B904 - its cause is set there
    return _parse_common(obj, cai) or _validate(obj, cai, ())


def parse_read(obj: object, cai: Any) -> ArrayView:
    """:func:`parse` of an interface the caller has just read from ``obj``
    (so that a handoff reads it once). A view is its own parse."""
    if isinstance(obj, ArrayView):
        return obj
    return _parse_common(obj, cai) or _validate(obj, cai, ())


#: validated layouts of the common shape: (shape, typestr, strides as given,
#: version) -> (shape, strides, dtype, size, nbytes, lowest and highest pointer
#: it allows, the trivial descr ``[("", typestr)]`` CuPy sends, made once)
_Layout = tuple[
    tuple[int, ...], tuple[int, ...], "np.dtype[Any]", int, int, int, int, list[tuple[str, str]]
]
_layouts: dict[tuple[Any, ...], _Layout] = {}
#: the one element type the fast path takes in shapes and strides: a value of
#: another type may equal an int (4.0, True) and so find its cached layout
_INT: Final = frozenset((int,))
#: a dict's cache key in one C-level call (KeyError when one is missing)
_key_of: Final = operator.itemgetter("shape", "typestr", "strides", "version")


def _exact_ints(values: object) -> bool:
    return type(values) is tuple and _INT.issuperset(map(type, values))


def _remember(
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    dtype: np.dtype[Any],
    size: int,
    version: int,
    *,
    raw_shape: Any,
    raw_strides: Any,
    typestr: Any,
) -> None:
    """After full validation: cache a layout the fast path may take (exact ints
    only). Its key is what validation read (``raw_*``, ``typestr``), never the
    dict read again: a mapping may answer differently the second time, and
    user code validation ran (a descr's ``__eq__``) may have edited the dict."""
    if size == 0 or len(_layouts) >= 1024 or type(typestr) is not str:
        return
    if not _exact_ints(raw_shape) or not (raw_strides is None or _exact_ints(raw_strides)):
        return
    lo, hi = extent(0, shape, strides, dtype.itemsize)
    nbytes = size * dtype.itemsize
    # the pointers that keep every byte in [1, 2**64), and the pointer itself
    # below 2**64 (a zero-size item type touches no byte): one chained comparison
    ptr_range = (max(1, -lo), min(_ADDRESS_LIMIT - 1, _ADDRESS_LIMIT - hi))
    key = (raw_shape, typestr, raw_strides, version)
    _layouts[key] = (shape, strides, dtype, size, nbytes, *ptr_range, [("", typestr)])


def _parse_common(obj: object, cai: Any) -> ArrayView | None:
    """The fast path: a dict of version 2 or 3 with exact int and bool values,
    no mask, no descr but the trivial one (``[("", typestr)]``, which CuPy
    sends), and a layout that full validation already accepted. None sends
    everything else through full validation.

    Written for speed (issue #20: within 3x of reading the dict). The cache
    key is taken by one C-level ``itemgetter`` and holds the version, so one
    lookup checks the layout and the version; the exact-type checks stay,
    since 4.0 and True equal (and hash as) 4 and 1, which full validation
    refuses; the trivial descr to compare with is made once per layout.
    tests/test_interface_fast.py removes each check in turn and shows that a
    near miss then gets through.
    """
    if type(cai) is not dict:  # else its subscripts could run user code
        return None
    try:
        key = _key_of(cai)
        data = cai["data"]
    except KeyError:
        if "strides" in cai:  # another key missing: full validation names it
            return None
        key = (cai.get("shape"), cai.get("typestr"), None, cai.get("version"))
        data = cai.get("data")
    raw_shape, typestr, raw_strides, version = key
    # exact types first: only they hash and compare without calling user code
    if (
        type(raw_shape) is not tuple
        or type(typestr) is not str
        or type(version) is not int
        or type(data) is not tuple
        or len(data) != 2
    ):
        return None
    for n in raw_shape:
        if type(n) is not int:
            return None
    if raw_strides is not None:
        if type(raw_strides) is not tuple:
            return None
        for n in raw_strides:
            if type(n) is not int:
                return None
    try:  # a subscript: cheaper than get() on a hit, and a miss goes the slow way anyway
        layout = _layouts[key]
    except KeyError:
        return None
    ptr, readonly = data
    shape, strides, dtype, size, nbytes, ptr_min, ptr_max, trivial_descr = layout
    if type(ptr) is not int or type(readonly) is not bool or not ptr_min <= ptr <= ptr_max:
        return None
    stream = cai.get("stream") if version == _LATEST else None
    if stream is not None and (type(stream) is not int or not 0 < stream < _ADDRESS_LIMIT):
        return None
    if "mask" in cai and cai["mask"] is not None:
        return None
    if "descr" in cai:
        descr = cai["descr"]
        if descr is not None and (type(descr) is not list or descr != trivial_descr):
            return None
    return _make(
        ptr, shape, strides, dtype, typestr, readonly, size, nbytes, version, None, stream, obj
    )


def _parse(obj: object, masking: tuple[int, ...]) -> ArrayView:
    """``masking``: the ids of the arrays whose mask this is (a cycle is refused)."""
    if isinstance(obj, ArrayView):
        return obj
    return _validate(obj, _read(obj), masking)


def _validate(obj: object, cai: Any, masking: tuple[int, ...]) -> ArrayView:
    """Full validation of ``cai``, read from ``obj``."""
    if not isinstance(cai, Mapping):
        if hasattr(cai, "keys") and hasattr(cai, "__getitem__"):
            cai = {key: cai[key] for key in cai.keys()}
            if cai.get("version") != 0:
                raise InterfaceError(
                    f"{type(obj).__qualname__}.__cuda_array_interface__ must be a dict "
                    "(only version 0 allowed dictionary-like objects)"
                )
        else:
            raise InterfaceError(
                f"{type(obj).__qualname__}.__cuda_array_interface__ is a "
                f"{type(cai).__name__}: expected a dict"
            )
    for key in _REQUIRED:
        if key not in cai:
            raise InterfaceError(
                f"{type(obj).__qualname__}.__cuda_array_interface__ has no {key!r} entry "
                f"(required: {', '.join(_REQUIRED)})"
            )

    version = cai["version"]
    if not _is_int(version) or version < 0:
        raise _bad("version", version, "a non-negative int")
    version = int(version)
    if version > _LATEST:
        raise _bad("version", version, f"0 to {_LATEST} (newer versions are not supported)")

    shape = raw_shape = cai["shape"]
    if type(shape) is not tuple or not all(_is_int(n) and n >= 0 for n in shape):
        raise _bad("shape", shape, "a tuple of non-negative ints")
    shape = tuple(int(n) for n in shape)

    typestr, descr = cai["typestr"], cai.get("descr")
    dtype = _dtype(typestr, descr)
    itemsize = dtype.itemsize
    size = 1
    for n in shape:
        size *= n

    data = cai["data"]
    if type(data) is not tuple or len(data) != 2:
        raise _bad("data", data, "a 2-tuple (pointer: int, read-only: bool)")
    ptr, readonly = data
    if not _is_int(ptr) or not 0 <= ptr < _ADDRESS_LIMIT:
        raise _bad("data", data, "a non-negative int pointer below 2**64 as its first element")
    if not isinstance(readonly, (bool, np.bool_)):
        raise _bad("data", data, "a bool read-only flag as its second element")
    ptr = int(ptr) if size else 0  # a zero-size array has no data to point at
    if ptr == 0 and size:
        raise _bad("data", data, f"a non-null pointer for a non-empty array of shape {shape}")

    raw_strides = cai.get("strides")
    if raw_strides is None:
        strides = c_strides(shape, itemsize)
    elif (
        type(raw_strides) is not tuple
        or len(raw_strides) != len(shape)
        or not all(_is_int(s) for s in raw_strides)
    ):
        raise _bad("strides", raw_strides, f"None or a tuple of {len(shape)} ints (bytes)")
    else:
        strides = tuple(int(s) for s in raw_strides)
    lo, hi = extent(ptr, shape, strides, itemsize)
    if size and not (0 <= lo and hi <= _ADDRESS_LIMIT):
        raise _bad(
            "strides" if raw_strides is not None else "shape",
            raw_strides if raw_strides is not None else shape,
            f"a layout whose bytes stay within 64-bit addresses (it reaches [{lo:#x}, {hi:#x}))",
        )

    stream = None
    if version >= 3:
        stream = cai.get("stream")
        if stream is not None:
            if not _is_int(stream):
                raise _bad("stream", stream, "None or an int stream handle")
            stream = int(stream)
            if stream == 0:
                raise _bad(
                    "stream",
                    0,
                    "None, 1 (legacy default), 2 (per-thread default) or a stream handle; "
                    "0 is disallowed by the spec",
                )
            if not 0 < stream < _ADDRESS_LIMIT:
                raise _bad("stream", stream, "a positive stream handle below 2**64")

    mask = None
    if version >= 1:
        raw_mask = cai.get("mask")
        if raw_mask is not None:
            if not hasattr(raw_mask, "__cuda_array_interface__"):
                raise _bad("mask", raw_mask, "None or an object exposing __cuda_array_interface__")
            here = (*masking, id(obj))
            if id(raw_mask) in here or len(here) > _MAX_MASK_DEPTH:
                raise _bad(
                    "mask", raw_mask, "a mask that is not the array, nor masks nested without end"
                )
            mask = _parse(raw_mask, here)
            if mask.shape != shape:  # (no broadcasting: NumPy's masked arrays need none)
                raise _bad(
                    "mask", raw_mask, f"a mask of the array's shape {shape}, not {mask.shape}"
                )
            if mask.stream is not None and mask.stream != stream:
                # a handoff waits for the array's stream only: the mask's work
                # elsewhere would be read before it is done
                raise _bad(
                    "mask",
                    raw_mask,
                    f"a mask whose interface names no stream or the array's own ({stream}), "
                    f"not stream {mask.stream}: cai_streams waits for the array's stream only",
                )

    if mask is None and 2 <= version and (descr is None or descr == [("", typestr)]):
        _remember(
            shape,
            strides,
            dtype,
            size,
            version,
            raw_shape=raw_shape,
            raw_strides=raw_strides,
            typestr=typestr,
        )
    return _make(
        ptr,
        shape,
        strides,
        dtype,
        typestr,
        bool(readonly),
        size,
        size * itemsize,
        version,
        mask,
        stream,
        obj,
    )
