"""DLPack in and out, with the same join.

Ordering is shown with data: a latch holds the producer's stream, so a
consumer that was not ordered after it reads the old values; each guarantee
has a control that does read them (``stream=-1``, ``protocol="cai"`` on a
producer whose interface names no stream). Every capsule's deleter is counted:
the producer's registry of live tensors (``live_exports``) must come back to
where it was, with no deleter call for a tensor already deleted.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import anyio
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cai_streams as cs
from cai_streams import _dlpack, sim
from cai_streams._consume import Mode, _handoff
from cai_streams._dlpack_export import consumer_stream, live_exports
from cai_streams._dlpack_import import DLPackOwner, Held, read_capsule
from cai_streams._scheduler import _Spares

from .device_ops import DeviceOps, consume_after_latch

pytestmark = pytest.mark.anyio


class DLPackOnly:
    """A producer that speaks only DLPack, over any of ours; records each call."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[dict[str, Any]] = []

    def __dlpack__(self, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        return self.inner.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.inner.__dlpack_device__()  # type: ignore[no-any-return]


class TorchLike(DLPackOnly):
    """Like a PyTorch tensor: a version 2 interface, which names no stream, and
    a ``__dlpack__`` that orders the consumer's stream after its current one
    (``inner.stream``: a sim array exports it as a Numba array does)."""

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        cai = cs.read_interface(self.inner).__cuda_array_interface__
        del cai["stream"]
        cai["version"] = 2
        return cai


class Layout:
    """Any layout over device memory, as a version 3 interface."""

    def __init__(self, cai: dict[str, Any]) -> None:
        self.cai = cai

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return dict(self.cai)


@pytest.fixture(autouse=True)
def _simulated() -> None:
    """Sim arrays live on the simulator: views of them are exported on it (a
    test using ``ops`` gets its backend from the ``backend`` fixture instead)."""
    cs.use_backend("sim")


@pytest.fixture
def exports() -> Iterator[None]:
    """Every capsule made in the test has been deleted, exactly once, at its end."""
    before, stale = live_exports()
    yield
    gc.collect()  # views handed to a stream hold their owner until it passes their work:
    cs.stats()  # released views record those holds now
    assert sim.device().drain(timeout=30), "simulated work still running after 30 s"
    cs.stats()  # the pool lets go of completed events and holds, and of what they kept
    gc.collect()
    assert live_exports() == (before, stale), "a capsule's tensor was not deleted exactly once"


def _hold(ops: DeviceOps, value: float) -> tuple[cs.Stream, Any, Any]:
    """A stream held by a latch, with a fill of a new array enqueued behind it."""
    p = cs.Stream()
    arr = ops.array(np.zeros(64, "float32"))
    latch = ops.latch(p)
    ops.fill(p, arr, value)
    return p, arr, latch


def _view_of(capsule: Any, stream: int | None) -> cs.ArrayView:
    return read_capsule(capsule, stream=stream)


# -- producer: the join onto the consumer's stream ---------------------------------------


@pytest.mark.parametrize("consumer", ["stream", "legacy", "none", "per-thread"])
@pytest.mark.parametrize("ordered", [True, False], ids=["joined", "control"])
def test_tracked_dlpack_orders_the_consumer_after_every_writer(
    ops: DeviceOps, exports: None, consumer: str, ordered: bool
) -> None:
    """Two writers (one held by a latch) fill halves of a tracked array; the
    consumer reads it on its stream. ``stream=`` joined: it sees both writes;
    ``stream=-1`` (the control): it reads before the held writer ran."""
    s = {"stream": cs.Stream(), "legacy": cs.Stream.wrap(1), "none": cs.Stream.wrap(1)}.get(
        consumer, cs.Stream.wrap(2)
    )
    passed = {"stream": s.handle, "legacy": 1, "none": None, "per-thread": 2}[consumer]
    p1, p2 = cs.Stream(), cs.Stream()
    arr = ops.array(np.zeros(64, "float32"))
    t = cs.track(arr)
    out = ops.array(np.full(64, -1.0, "float32"))
    latch = ops.latch(p1)
    try:
        with t.writing(p1, disjoint=True):
            ops.fill(p1, arr[:32], 1.0)
        with t.writing(p2, disjoint=True):
            ops.fill(p2, arr[32:], 2.0, duration=0.002)
        capsule = t.__dlpack__(stream=passed if ordered else -1, max_version=(1, 0))
        view = _view_of(capsule, s.handle)
        with cs.sanitize(ordered):  # the control races on purpose
            ops.copy(s, out, view)
        if not ordered:
            s.synchronize()  # the copy ran while the writer was held
    finally:
        latch.release()
    s.synchronize()
    got = ops.to_host(out)
    if ordered:
        assert (got[:32] == 1.0).all() and (got[32:] == 2.0).all()
    else:  # the held writer's half was read before it ran
        assert (got[:32] == 0.0).all()


def test_the_consumers_later_work_counts_as_a_read(ops: DeviceOps, exports: None) -> None:
    """What the consumer enqueues on its stream after ``__dlpack__`` is a read
    of the array: the next writer elsewhere waits for it (write after read)."""
    s, w = cs.Stream(), cs.Stream()
    arr = ops.array(np.full(64, 1.0, "float32"))
    t = cs.track(arr)
    out = ops.array(np.zeros(1, "float32"))
    view = _view_of(t.__dlpack__(stream=s.handle), s.handle)
    latch = ops.latch(s)  # the consumer's read is held
    try:
        ops.sum_into(s, out, view)
        with t.writing(w):
            ops.fill(w, arr, 100.0)
    finally:
        latch.release()
    w.synchronize()
    s.synchronize()
    assert ops.to_host(out)[0] == 64.0


@pytest.mark.parametrize("ordered", [True, False], ids=["joined", "control"])
@pytest.mark.parametrize("producer", ["sim array", "view"])
def test_untracked_producers_join_their_stream(
    ops: DeviceOps, exports: None, producer: str, ordered: bool
) -> None:
    """A sim array's (Numba-style) ``stream`` and a view's ``stream`` are
    joined onto the consumer's; ``-1`` joins nothing."""
    if producer == "sim array" and ops.name != "sim":
        pytest.skip("sim arrays live on the simulator")
    p, arr, latch = _hold(ops, 5.0)
    s = cs.Stream()
    out = ops.array(np.zeros(64, "float32"))
    obj: Any
    if producer == "sim array":
        arr.stream = p.handle
        obj = arr
    else:
        obj = cs.read_interface(arr).with_stream(p.handle)
    try:
        view = _view_of(obj.__dlpack__(stream=s.handle if ordered else -1), s.handle)
        with cs.sanitize(ordered):
            ops.copy(s, out, view)
        if not ordered:
            s.synchronize()
    finally:
        latch.release()
    s.synchronize()
    assert (ops.to_host(out) == (5.0 if ordered else 0.0)).all()


def test_a_producer_on_the_consumers_stream_spends_no_event(exports: None) -> None:
    s = cs.Stream()
    arr = sim.asarray(np.ones(8, "float32"))
    arr.stream = s.handle
    t = cs.track(sim.asarray(np.ones(8, "float32")))
    with t.writing(s):
        pass
    before = cs.stats()["events_acquired"]
    _view_of(arr.__dlpack__(stream=s.handle), s.handle)
    _view_of(t.__dlpack__(stream=s.handle), s.handle)
    assert cs.stats()["events_acquired"] == before


# -- producer: the arguments, as the array API standard says -----------------------------


def test_stream_values_follow_the_standard() -> None:
    backend = cs.current_backend()
    assert consumer_stream(None, backend) == cs.Stream.wrap(1)
    assert consumer_stream(1, backend) == cs.Stream.wrap(1)
    assert consumer_stream(2, backend) == cs.Stream.wrap(2)
    s = cs.Stream()
    assert consumer_stream(s.handle, backend) == s
    assert consumer_stream(-1, backend) is None
    with pytest.raises(ValueError, match="ambiguous"):
        consumer_stream(0, backend)
    with pytest.raises(ValueError, match="-1 or a stream handle"):
        consumer_stream(-2, backend)
    for bad in (True, 1.0, "1", s):
        with pytest.raises(TypeError, match="None or an int"):
            consumer_stream(bad, backend)


@pytest.mark.parametrize("make", ["tracked", "view", "sim array"])
def test_device_version_copy_and_read_only(make: str, exports: None) -> None:
    if cs.device_count() < 2:
        pytest.skip("sim: one device (CAI_STREAMS_SIM_DEVICES=1); the test needs two")
    arr = sim.empty((2, 3), "float32", device=1)  # asked from device 0
    obj: Any = arr
    if make == "tracked":
        obj = cs.track(arr)
    elif make == "view":
        obj = cs.read_interface(arr)
    try:
        assert obj.__dlpack_device__() == (2, 1)
        assert _dlpack.capsule_name(obj.__dlpack__()) == "dltensor"
        assert _dlpack.capsule_name(obj.__dlpack__(max_version=(0, 8))) == "dltensor"
        for newer in ((1, 0), (1, 3), (2, 0)):
            assert _dlpack.capsule_name(obj.__dlpack__(max_version=newer)) == "dltensor_versioned"
        assert obj.__dlpack__(dl_device=(2, 1), copy=False) is not None
        for device, copy in (((2, 0), None), ((1, 0), None), ((2, 0), False), ((1, 0), True)):
            with pytest.raises(BufferError, match="copy"):
                obj.__dlpack__(dl_device=device, copy=copy)
        with pytest.raises(BufferError, match="never copies"):
            obj.__dlpack__(copy=True)
        with pytest.raises(ValueError, match="ambiguous"):
            obj.__dlpack__(stream=0)
        with pytest.raises(TypeError, match="max_version"):
            obj.__dlpack__(max_version=1)
    finally:
        cs.set_device(0)


def test_read_only_needs_a_versioned_capsule(exports: None) -> None:
    arr = sim.asarray(np.arange(4, dtype="int16"))
    cai = cs.read_interface(arr).__cuda_array_interface__
    cai["data"] = (cai["data"][0], True)
    view = cs.read_interface(Layout(cai))
    with pytest.raises(BufferError, match="read-only"):
        view.__dlpack__()
    back = _view_of(view.__dlpack__(max_version=(1, 0)), None)
    assert back.readonly and back.ptr == arr.ptr


def _over(arr: Any, **entries: Any) -> cs.ArrayView:
    """A view of ``arr``'s memory with other interface entries."""
    cai = cs.read_interface(arr).__cuda_array_interface__
    cai.update(entries)
    return cs.read_interface(Layout(cai))


@pytest.mark.parametrize("typestr", [">f4", "<M8[s]", "|V8", "|S8", "<U2"])
def test_types_dlpack_cannot_express_are_refused(typestr: str, exports: None) -> None:
    raw = sim.empty(64, "uint8")
    view = _over(raw, shape=(2,), typestr=typestr, strides=None)
    with pytest.raises(BufferError, match="DLPack has no type"):
        view.__dlpack__()


def test_byte_strides_that_are_not_whole_elements_are_refused(exports: None) -> None:
    raw = sim.empty(64, "uint8")
    view = _over(raw, shape=(3,), typestr="<f4", strides=(6,))
    with pytest.raises(BufferError, match="multiples of the item size"):
        view.__dlpack__()


def test_a_masked_array_is_refused_not_exported_without_its_mask(exports: None) -> None:
    data, mask = sim.empty(4, "float32"), sim.empty(4, "bool")
    view = _over(data, mask=mask)
    assert view.mask is not None
    with pytest.raises(BufferError, match="has no mask"):
        view.__dlpack__()
    with pytest.raises(BufferError, match="has no mask"):
        cs.track(Layout(view.__cuda_array_interface__)).__dlpack__()
    assert _over(data).__dlpack__() is not None  # the control: the same data, unmasked


# -- the parser: every capsule our producers make, and hand-built ones -------------------

DTYPES = ["b1", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16"]


@st.composite
def layouts(draw: st.DrawFn) -> tuple[np.ndarray[Any, Any], tuple[Any, ...], tuple[int, ...]]:
    """A host array, an index into it and an axis order: any strided view."""
    ndim = draw(st.integers(0, 4))
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim)))
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    host = (np.arange(int(np.prod(shape)), dtype="int64") * 7 % 251).reshape(shape).astype(dtype)
    index = tuple(
        slice(draw(st.integers(0, n)), None, draw(st.sampled_from([1, 2, -1, -2]))) for n in shape
    )
    order = tuple(draw(st.permutations(range(ndim))))
    return host, index, order


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layouts(),
    st.sampled_from(["tracked", "view", "sim array"]),
    st.sampled_from([None, (0, 8), (1, 0), (1, 9)]),
    st.booleans(),
)
def test_every_capsule_our_producers_make_parses_back(
    layout: tuple[np.ndarray[Any, Any], tuple[Any, ...], tuple[int, ...]],
    producer: str,
    max_version: tuple[int, int] | None,
    readonly: bool,
) -> None:
    """Model: the view parsed back from a capsule describes exactly the bytes
    of the numpy view the producer's layout was made from."""
    host, index, order = layout
    before = live_exports()
    device = sim.asarray(host)
    expected = host[index + (Ellipsis,)].transpose(order)
    offset = expected.ctypes.data - host.ctypes.data if expected.size else 0
    cai = {
        "shape": expected.shape,
        "typestr": expected.dtype.str,
        "data": (device.ptr + offset if expected.size else 0, readonly),
        "strides": expected.strides,
        "version": 3,
    }
    if producer == "sim array":  # strided, never read-only
        obj: Any = device[index] if order == tuple(range(len(order))) else None
        if obj is None:
            return
        expected_ro = False
    else:
        layout_obj = Layout(cai)
        obj = cs.track(layout_obj) if producer == "tracked" else cs.read_interface(layout_obj)
        expected_ro = readonly
    if expected_ro and (max_version is None or max_version[0] < 1):
        with pytest.raises(BufferError):
            obj.__dlpack__(max_version=max_version)
        return
    capsule = obj.__dlpack__(stream=-1, max_version=max_version)
    versioned = max_version is not None and max_version[0] >= 1
    name = "dltensor_versioned" if versioned else "dltensor"
    assert _dlpack.capsule_name(capsule) == name
    view = read_capsule(capsule, stream=None)
    assert _dlpack.capsule_name(capsule) == f"used_{name}"
    assert view.shape == expected.shape and view.dtype == expected.dtype
    assert view.readonly is expected_ro
    if expected.size:
        assert view.ptr == cai["data"][0]
        pairs = zip(view.strides, expected.strides, view.shape, strict=True)
        assert all(s == e for s, e, n in pairs if n > 1)
    got = sim._numpy_view(view)
    assert got is not None and np.array_equal(got, expected)
    assert isinstance(view.owner, DLPackOwner) and view.owner.state is Held.OWNED
    owner = weakref.ref(view.owner)
    del view, capsule, obj
    assert owner() is None  # no cycle: collected at once
    assert live_exports() == before


_counted: list[int] = []
_COUNTING = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(_counted.append)


def _hand_built(
    arr: Any,
    versioned: bool,
    *,
    shape: tuple[int, ...],
    strides: tuple[int, ...] | None,
    dtype: tuple[int, int, int],
    byte_offset: int = 0,
    flags: int = 0,
) -> tuple[Any, list[Any]]:
    """A capsule as another library's C code makes it, with a counting deleter."""
    managed: Any = _dlpack.DLManagedTensorVersioned() if versioned else _dlpack.DLManagedTensor()
    if versioned:
        managed.version.major, managed.version.minor = 1, 3
        managed.flags = flags
    c_shape = (ctypes.c_int64 * max(len(shape), 1))(*shape)
    c_strides = None if strides is None else (ctypes.c_int64 * max(len(shape), 1))(*strides)
    t = managed.dl_tensor
    t.data = arr.ptr
    t.device.device_type, t.device.device_id = 2, arr.device
    t.ndim = len(shape)
    t.dtype.code, t.dtype.bits, t.dtype.lanes = dtype
    t.shape = ctypes.cast(c_shape, ctypes.POINTER(ctypes.c_int64))
    if c_strides is not None:
        t.strides = ctypes.cast(c_strides, ctypes.POINTER(ctypes.c_int64))
    t.byte_offset = byte_offset
    managed.deleter = ctypes.cast(_COUNTING, ctypes.c_void_p).value
    capsule = _dlpack.new_capsule(ctypes.addressof(managed), versioned)
    return capsule, [managed, c_shape, c_strides, arr]


@pytest.mark.parametrize("versioned", [False, True], ids=["legacy", "versioned"])
def test_hand_built_capsules_parse_and_delete_once(versioned: bool) -> None:
    """Element strides become bytes, NULL strides mean C order, byte_offset
    moves the pointer, the read-only flag is read, bool and complex map to
    typestrs; the deleter runs once, when the view's owner goes."""
    host = np.arange(24, dtype="complex64").reshape(4, 6)
    arr = sim.asarray(host)
    cases = [
        ((4, 6), None, (5, 64, 1), 0, host),
        ((3, 2), (1, 6), (5, 64, 1), 8, host.T[1:4, :2]),  # element strides, offset one item
        ((2,), (-1,), (5, 64, 1), 8, host.reshape(-1)[1::-1]),
        ((4, 6), None, (1, 8, 1), 0, host.view("u1").reshape(4, 48)[:, :6].copy()),
    ]
    for shape, strides, dtype, offset, expected in cases:
        if dtype[0] == 1:  # bytes: a fresh C-ordered array of bools-as-uint8
            arr = sim.asarray(expected)
        _counted.clear()
        flags = _dlpack.FLAG_READ_ONLY if versioned else 0
        capsule, keep = _hand_built(
            arr,
            versioned,
            shape=shape,
            strides=strides,
            dtype=dtype,
            byte_offset=offset,
            flags=flags,
        )
        view = read_capsule(capsule, stream=None)
        got = sim._numpy_view(view)
        assert got is not None and np.array_equal(got, expected)
        assert view.readonly is versioned
        del got
        with pytest.raises(cs.InterfaceError, match="used_dltensor"):
            read_capsule(capsule, stream=None)  # taken once only
        assert _counted == []
        address = ctypes.addressof(keep[0])
        del view
        gc.collect()
        assert _counted == [address]
    bools = sim.asarray(np.array([True, False, True]))
    capsule, keep = _hand_built(bools, versioned, shape=(3,), strides=None, dtype=(6, 8, 1))
    view = read_capsule(capsule, stream=None)
    got = sim._numpy_view(view)
    assert view.typestr == "|b1" and got is not None and got.tolist() == [True, False, True]


CORRUPTIONS: dict[str, Any] = {
    "cpu device": lambda m: setattr(m.dl_tensor.device, "device_type", 1),
    "rocm device": lambda m: setattr(m.dl_tensor.device, "device_type", 10),
    "negative ndim": lambda m: setattr(m.dl_tensor, "ndim", -1),
    "huge ndim": lambda m: setattr(m.dl_tensor, "ndim", 1000),
    "bfloat16": lambda m: setattr(m.dl_tensor, "dtype", _dlpack.DLDataType(4, 16, 1)),
    "four lanes": lambda m: setattr(m.dl_tensor.dtype, "lanes", 4),
    "int12": lambda m: setattr(m.dl_tensor.dtype, "bits", 12),
    "null shape": lambda m: setattr(m.dl_tensor, "shape", None),
    "null data": lambda m: setattr(m.dl_tensor, "data", None),
    "negative extent": lambda m: m.dl_tensor.shape.__setitem__(0, -3),
    "beyond 64 bits": lambda m: m.dl_tensor.shape.__setitem__(0, 1 << 62),
    "major version 2": lambda m: setattr(getattr(m, "version", m), "major", 2),
}


@pytest.mark.parametrize("versioned", [False, True], ids=["legacy", "versioned"])
@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_malformed_capsules_are_refused_and_deleted_once(
    corruption: str, versioned: bool, exports: None
) -> None:
    if corruption == "major version 2" and not versioned:
        pytest.skip("a legacy struct has no version")
    arr = sim.asarray(np.arange(8, dtype="float32"))
    keep = weakref.ref(arr)
    capsule = arr.__dlpack__(max_version=(1, 0) if versioned else None)
    found = _dlpack.capsule_pointer(capsule)
    assert found is not None
    struct = _dlpack.DLManagedTensorVersioned if versioned else _dlpack.DLManagedTensor
    CORRUPTIONS[corruption](struct.from_address(found[0]))
    with pytest.raises(cs.InterfaceError, match="DLPack|__cuda_array_interface__"):
        read_capsule(capsule, stream=None)
    del arr, capsule
    gc.collect()
    assert keep() is None, "the tensor of a refused capsule was never deleted"


def test_what_is_not_a_dlpack_capsule_is_refused() -> None:
    class Returns:
        def __init__(self, value: Any) -> None:
            self.value = value

        def __dlpack__(self, **kwargs: Any) -> Any:
            return self.value

        def __dlpack_device__(self) -> tuple[int, int]:
            return (2, 0)

    with pytest.raises(cs.InterfaceError, match="expected a PyCapsule"):
        cs.consume_blocking(Returns(42), protocol="dlpack")
    with pytest.raises(cs.InterfaceError, match="named 'other': expected 'dltensor'"):
        cs.consume_blocking(Returns(_dlpack._New(1, _OTHER, None)))


_OTHER = ctypes.c_char_p(b"other")  # a capsule keeps its name's pointer


# -- consumer: any DLPack producer, the same join ----------------------------------------


@pytest.mark.parametrize(
    "row", [m for m in Mode if m.name.startswith("DLPACK")], ids=lambda m: m.name
)
async def test_each_dlpack_row(row: Mode, exports: None) -> None:
    """What each row passes to the producer, what it waits for (a held
    producer), and what the view names; the opt-out is the control: its
    reader runs before the producer's work."""
    ops = _sim_ops()
    p, arr, latch = _hold(ops, 3.0)
    arr.stream = p.handle  # where a Numba-style producer's work is pending
    obj = DLPackOnly(arr)
    c = cs.Stream()
    stream = None if row is Mode.DLPACK_HOST else c
    synced = row is not Mode.DLPACK_OPT_OUT
    assert _handoff(DLPackOnly(sim.empty(1)), stream, synced, cs.current_backend()).mode is row
    out = ops.array(np.full(64, -1.0, "float32"))
    try:
        if row is Mode.DLPACK_HOST:
            view = await consume_after_latch(obj, latch)
            sched = cs._scheduler.scheduler_for(cs.current_backend())
            landed = sched._landings.handles()  # (given back: kept for the next)
            assert obj.calls[0]["stream"] in landed
            assert obj.calls[0]["stream"] != sched.export_stream.handle
            assert view.stream is None and (ops.to_host(arr) == 3.0).all()
            return
        with cs.sanitize(synced):  # the opt-out races on purpose
            view = await cs.consume(obj, stream=stream, sync=synced)
            ops.copy(c, out, view)
        assert obj.calls[0]["stream"] == (c.handle if synced else -1)
        assert view.stream == c.handle
        if not synced:
            c.synchronize()  # ran while the producer was held
    finally:
        latch.release()
    c.synchronize()
    assert (ops.to_host(out) == (3.0 if synced else 0.0)).all()


def _sim_ops() -> DeviceOps:
    from .device_ops import ops_for

    return ops_for("sim")


@pytest.mark.parametrize("protocol", [None, "cai"], ids=["dlpack", "control-cai"])
async def test_a_torch_like_tensor_is_consumed_race_free(
    protocol: str | None, exports: None
) -> None:
    """A producer whose interface is version 2 (no stream, as PyTorch's) with
    work pending on its current stream: DLPack is chosen and the host waits
    for that work; forcing the interface reads the buffer too early."""
    ops = _sim_ops()
    p, arr, latch = _hold(ops, 9.0)
    arr.stream = p.handle
    obj = TorchLike(arr)
    c = cs.Stream()
    out = ops.array(np.full(64, -1.0, "float32"))
    try:
        with cs.sanitize(protocol is None):  # the control races (the sanitizer says so)
            view = await cs.consume(obj, stream=c, protocol=protocol)  # type: ignore[arg-type]
            ops.copy(c, out, view.with_stream(None))
        assert isinstance(view.owner, DLPackOwner) is (protocol is None)
        if protocol is not None:
            c.synchronize()
    finally:
        latch.release()
    c.synchronize()
    assert (ops.to_host(out) == (9.0 if protocol is None else 0.0)).all()


async def test_the_protocol_rule(exports: None) -> None:
    arr = sim.asarray(np.ones(4, "float32"))  # a version 3 interface and DLPack
    assert (await cs.consume(arr)).owner is arr
    assert isinstance((await cs.consume(arr, protocol="dlpack")).owner, DLPackOwner)
    assert isinstance((await cs.consume(TorchLike(arr))).owner, DLPackOwner)
    assert (await cs.consume(TorchLike(arr), protocol="cai")).owner.__class__ is TorchLike
    with pytest.raises(ValueError, match="protocol must be"):
        await cs.consume(arr, protocol="both")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="no __dlpack__"):
        await cs.consume(Layout({}), protocol="dlpack")
    t = cs.track(arr)  # a tracked array: its pending work, whatever the protocol
    assert (await cs.consume(t, protocol="dlpack")).owner is arr
    with pytest.raises(ValueError, match="protocol must be"):  # checked for tracked ones too
        cs.consume_blocking(t, protocol="bogus")  # type: ignore[arg-type]


# -- the deleter runs exactly once, whatever happens ---------------------------------------


def _counted_producer(value: float) -> tuple[Any, Any, Any, cs.Stream]:
    """A DLPack-only producer over a tracked array written on a held stream."""
    ops = _sim_ops()
    p, arr, latch = _hold(ops, value)
    t = cs.track(sim.asarray(np.zeros(64, "float32")))
    with t.writing(p):
        ops.copy(p, t.array, arr)
    return DLPackOnly(t), t, latch, p


async def test_deleter_once_when_cancelled_or_timed_out(exports: None) -> None:
    obj, t, latch, p = _counted_producer(1.0)
    before = live_exports()[0]
    with anyio.move_on_after(0.02) as scope:
        await cs.consume(obj)
    assert scope.cancelled_caught
    with pytest.raises(TimeoutError):
        await cs.consume(obj, timeout=0.02)
    assert live_exports()[0] == before + 2  # the owners live until the work completes
    latch.release()
    assert sim.device().drain(timeout=30)  # the producer, and the export stream's events
    cs.stats()  # reclaims completed events, and the views they kept
    gc.collect()
    assert live_exports()[0] == before


@pytest.mark.parametrize("how", ["consume", "consume_all", "consuming", "cancelled", "blocking"])
async def test_a_kept_exception_does_not_keep_the_owner_of_a_failed_consume(
    how: str, exports: None
) -> None:
    """A timed-out or cancelled consume made its view in frames that the
    exception's traceback keeps: the caller keeping the exception (here
    stored; on Python 3.12 the timeout's own chaining sufficed, in the test
    above) must not keep the view's owner, a DLPack tensor, once the work it
    waited for is done."""
    obj, t, latch, p = _counted_producer(1.0)
    before = live_exports()[0]
    kept: list[BaseException] = []
    try:
        if how == "consume":
            await cs.consume(obj, timeout=0.02)
        elif how == "consume_all":
            await cs.consume_all(obj, obj, timeout=0.02)
        elif how == "consuming":
            async with cs.consuming(obj, timeout=0.02):
                pass
        elif how == "blocking":
            cs.consume_blocking(obj, timeout=0.02)
        else:
            with anyio.move_on_after(0.02):
                try:
                    await cs.consume(obj)
                except BaseException as exc:  # the cancellation, kept
                    kept.append(exc)
                    raise
    except TimeoutError as exc:
        kept.append(exc)
    assert kept and kept[0].__traceback__ is not None
    assert live_exports()[0] > before  # the owners live until the work completes
    latch.release()
    assert sim.device().drain(timeout=30)
    cs.stats()
    gc.collect()
    assert live_exports()[0] == before
    del kept


async def test_deleter_once_when_the_producers_kernel_failed(exports: None) -> None:
    ops = _sim_ops()
    p = cs.Stream()
    arr = sim.asarray(np.zeros(8, "float32"))
    arr.stream = p.handle
    ops.fail(p)
    obj = DLPackOnly(arr)
    keep = weakref.ref(arr)
    with pytest.raises(cs.KernelError):
        await cs.consume(obj, timeout=10)
    sim.reset()
    # the hold on p's mark after the fault lasts until p's worker passes it
    # (marks still complete): it may not have yet when the consume raised
    assert sim.device().drain(timeout=30)
    del obj, arr
    cs.stats()
    gc.collect()
    assert keep() is None


async def test_deleter_once_on_every_other_path(exports: None) -> None:
    obj, t, latch, p = _counted_producer(2.0)
    c = cs.Stream()
    latch.release()
    with pytest.raises(KeyError):
        async with cs.consuming(obj, stream=c) as view:
            raise KeyError("the consumer failed")
    with pytest.raises(cs.InterfaceError, match="kDLCPU"):
        await cs.consume_all(obj, np.zeros(3), stream=c)
    view = cs.consume_blocking(obj, timeout=10)
    got = sim._numpy_view(view)
    assert got is not None and (got == 2.0).all()
    views = await cs.consume_all(obj, obj, timeout=10)
    assert views[0].owner is not views[1].owner
    del view, views, got


# -- other libraries' producers on a CPU ---------------------------------------------------


def test_numpy_refuses_our_cuda_capsule_cleanly(exports: None) -> None:
    """NumPy takes only CPU tensors: it refuses ours with its own error (no
    crash, no SystemError) and the tensor is still deleted once."""
    t = cs.track(sim.asarray(np.arange(4, dtype="float32")))
    keep = weakref.ref(t.array)
    with pytest.raises((BufferError, RuntimeError), match="device"):
        np.from_dlpack(t)
    with pytest.raises((BufferError, RuntimeError), match="device"):
        np.from_dlpack(cs.read_interface(t.array))
    del t
    gc.collect()
    assert keep() is None


def test_cpu_producers_are_refused_before_a_capsule_is_made() -> None:
    host = DLPackOnly(np.arange(3.0))
    with pytest.raises(cs.InterfaceError, match=r"\(1, 0\) \(kDLCPU\).*kDLCUDA"):
        cs.consume_blocking(host)
    assert host.calls == []  # refused from __dlpack_device__, before any capsule
    with pytest.raises(cs.InterfaceError, match="kDLCPU"):
        cs.consume_blocking(np.arange(3.0))  # numpy's own object


@pytest.mark.parametrize("stream", [None, "a stream"])
@pytest.mark.parametrize(
    ("device", "says"),
    [
        ((2, -1), "CUDA device -1 does not exist"),
        ((2, 5), "CUDA device 5 does not exist"),
        ((2, 1.7), "two integers"),
        ("21", "two integers"),
        ((2,), "two integers"),
    ],
)
def test_a_malformed_or_missing_dlpack_device_is_refused_before_a_capsule(
    device: object, says: str, stream: str | None
) -> None:
    """``__dlpack_device__`` naming a device the backend does not have, or not
    two integers: InterfaceError naming the producer, before any capsule is
    taken (a float or a string was read as a device, and a missing device made
    a scheduler for it, or raised "device 5 does not exist" from deep inside)."""
    cs.use_backend("sim")
    inner = sim.asarray(np.ones(4, np.float32))

    class Odd(DLPackOnly):
        def __dlpack_device__(self) -> Any:
            return device

    odd = Odd(inner)
    before = cs._scheduler.schedulers_of(cs.current_backend())
    with pytest.raises(cs.InterfaceError, match=f"Odd.__dlpack_device__.*{says}"):
        cs.consume_blocking(odd, stream=None if stream is None else cs.Stream(), protocol="dlpack")
    assert odd.calls == []
    assert cs._scheduler.schedulers_of(cs.current_backend()) == before


def test_a_lying_producer_is_refused_and_its_capsule_deleted_by_numpy() -> None:
    """__dlpack_device__ says CUDA, the capsule says CPU: refused, untaken, so
    NumPy's own capsule destructor frees it."""

    class Lying(DLPackOnly):
        def __dlpack__(self, **kwargs: Any) -> Any:
            return self.inner.__dlpack__(max_version=kwargs["max_version"])  # CPU: no stream

        def __dlpack_device__(self) -> tuple[int, int]:
            return (2, 0)

    base = np.arange(5.0)
    before = sys.getrefcount(base)
    with pytest.raises(cs.InterfaceError, match=r"capsule reports device \(1, 0\)"):
        cs.consume_blocking(Lying(base))
    gc.collect()
    assert sys.getrefcount(base) == before


def _on_device_1() -> Any:
    """A simulated array on device 1 (the test is skipped with one device)."""
    backend = cs.current_backend()
    if backend.device_count() < 2:
        pytest.skip("needs two simulated devices")
    previous = backend.current_device()
    backend.set_device(1)
    try:
        return sim.asarray(np.ones(4, np.float32))
    finally:
        backend.set_device(previous)


@pytest.mark.parametrize("stream", [None, "a stream"])
def test_a_capsule_on_another_device_than_dlpack_device_says_is_refused(
    exports: None, stream: str | None
) -> None:
    """``__dlpack_device__`` says device 0, the capsule's tensor is on device 1:
    the producer was handed (and ordered its work after) a stream of the wrong
    device, so the view would name the wrong device's stream. Refused,
    naming both devices; the capsule is not taken (its own destructor frees
    it) and the producer's array is not kept. (It was taken as is.)"""
    inner = _on_device_1()

    class WrongDevice(DLPackOnly):
        def __dlpack_device__(self) -> tuple[int, int]:
            return (2, 0)

    odd = WrongDevice(inner)
    before = sys.getrefcount(inner)
    with pytest.raises(cs.InterfaceError, match="on CUDA device 1.*reported device 0"):
        cs.consume_blocking(odd, stream=None if stream is None else cs.Stream(), protocol="dlpack")
    assert len(odd.calls) == 1
    gc.collect()
    assert sys.getrefcount(inner) == before


def test_dlpack_device_is_asked_once_so_a_producer_cannot_answer_two_ways(exports: None) -> None:
    """The stream is chosen by the device ``__dlpack_device__`` says; the
    capsule is checked against that same answer (it was asked again, and a
    second answer that matched the capsule let a stream of the wrong device
    through)."""
    inner = _on_device_1()

    class Flipping(DLPackOnly):
        asked = 0

        def __dlpack_device__(self) -> tuple[int, int]:
            self.asked += 1
            return (2, 0) if self.asked == 1 else (2, 1)

    with pytest.raises(cs.InterfaceError, match="on CUDA device 1.*reported device 0"):
        cs.consume_blocking(Flipping(inner), protocol="dlpack", timeout=5)


@pytest.mark.parametrize("lent", [True, False], ids=["lent", "control"])
def test_a_dlpack_consume_onto_another_librarys_stream_object_keeps_the_read_open(
    lent: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``consume(producer, stream=obj)`` of a DLPack-only producer over a
    tracked array, ``obj`` another library's stream object: the producer's
    ``__dlpack__`` gets the handle, and sees the library's wrapper of ``obj``
    (kept alive), so the consumer's later kernels count as its read and the
    next writer waits for them. Control (no lending, as before): the handle
    was a bare int, the read ended at the handoff, and the write came first."""
    from cai_streams import _consume

    if not lent:
        monkeypatch.setattr(_consume, "lending", lambda s: contextlib.nullcontext())
    backend = cs.current_backend()

    class ForeignStream:
        def __init__(self) -> None:
            self.ptr = backend.create_stream()

        def __cuda_stream__(self) -> tuple[int, int]:
            return (0, self.ptr)

    a = sim.asarray(np.zeros(16, np.float32))
    t = cs.track(a)
    consumer = ForeignStream()
    out = sim.asarray(np.full(16, -1.0, np.float32))
    with cs.sanitize(lent):  # (the control races on purpose)
        view = cs.consume_blocking(DLPackOnly(t), stream=consumer, timeout=5)
        sim.launch(consumer, lambda o, v: o.__setitem__(..., v), out, view, duration=0.2)
        w = cs.Stream()
        with t.writing(w):
            sim.launch(w, lambda d: d.fill(9.0), a, writes=[a])
        w.synchronize()
        backend.synchronize_stream(consumer.ptr)
    assert (out.to_host() == (0.0 if lent else 9.0)).all()
    del view
    gc.collect()
    cs.stats()  # (the view's hold, recorded on the stream before it goes)
    backend.destroy_stream(consumer.ptr)


@pytest.mark.parametrize("own", [True, False], ids=["landing stream", "control"])
def test_a_dlpack_host_consume_waits_for_its_producer_only(
    exports: None, own: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another tracked array's slow write, exported: a host consume of a
    DLPack producer whose work is long done returns at once, and its landing
    stream is kept for the next one. The control lands on the device's shared
    export stream (as before), which waits for that unrelated write: the
    consume times out."""
    sched = cs._scheduler.scheduler_for(cs.current_backend())
    spares = _Spares(sched, "cai_streams' landing stream")  # (none kept by earlier tests)
    monkeypatch.setattr(sched, "_landings", spares)
    if not own:
        monkeypatch.setattr(type(sched), "landing", lambda self: self.export_stream)
        monkeypatch.setattr(type(sched), "landed", lambda self, s: None)
    fast = cs.Stream()
    a = sim.asarray(np.arange(4, dtype=np.float32))
    a.stream = fast.handle
    sim.launch(fast, lambda v: v.__imul__(2), a, writes=[a])
    fast.synchronize()
    slow = cs.Stream()
    other = cs.track(sim.empty(64))
    with other.writing(slow):
        sim.launch(slow, lambda v: v.fill(1), other.array, writes=[other.array], duration=1.0)
    other.__cuda_array_interface__  # noqa: B018 - joins the slow write onto the export stream
    producer = DLPackOnly(a)
    if own:
        for _ in range(3):
            view = cs.consume_blocking(producer, timeout=0.5, protocol="dlpack")
            got = sim._numpy_view(view)
            assert got is not None and (got == [0, 2, 4, 6]).all()
        assert len({call["stream"] for call in producer.calls}) == 1  # taken and given back
        (landing,) = spares._kept
        assert landing._key().describe() == f"cai_streams' landing stream {landing.handle:#x}"
        del view, got
    else:
        with pytest.raises(TimeoutError, match="pending on cai_streams' export stream 0x"):
            cs.consume_blocking(producer, timeout=0.2, protocol="dlpack")
    slow.synchronize()


def test_a_torch_cpu_tensor_is_refused() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(cs.InterfaceError, match="kDLCPU"):
        cs.consume_blocking(torch.arange(3))
