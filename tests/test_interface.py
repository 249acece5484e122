"""CUDA Array Interface v0-v3: a table of valid and invalid cases, and properties."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cai_streams as cs
from cai_streams import sim
from cai_streams._interface import c_strides, parse

PTR = 0x7F00_0000_0000


class Exports:
    """An object whose __cuda_array_interface__ is whatever the test says."""

    def __init__(self, cai: Any) -> None:
        self.cai = cai
        self.reads = 0

    @property
    def __cuda_array_interface__(self) -> Any:
        self.reads += 1
        return self.cai


class DictLike:
    """Version 0 allowed 'dictionary-like' objects."""

    def __init__(self, data: dict[str, Any]) -> None:
        self._data = data

    def keys(self) -> Any:
        return self._data.keys()

    def __getitem__(self, key: str) -> Any:
        return self._data[key]


def cai(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"shape": (4, 3), "typestr": "<f4", "data": (PTR, False), "version": 3}
    base.update(over)
    return {k: v for k, v in base.items() if v is not _DROP}


_DROP = object()
MASK = Exports(cai(typestr="|b1"))

VALID: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("v3 minimal", cai(), {"strides": (12, 4), "stream": None, "size": 12, "nbytes": 48}),
    ("v3 stream 1", cai(stream=1), {"stream": 1}),
    ("v3 stream 2", cai(stream=2), {"stream": 2}),
    ("v3 stream handle", cai(stream=PTR), {"stream": PTR}),
    ("v3 stream None", cai(stream=None), {"stream": None}),
    ("v2 ignores stream", cai(version=2, stream=77), {"stream": None, "version": 2}),
    ("v2 ignores even stream 0", cai(version=2, stream=0), {"stream": None}),
    ("v1", cai(version=1), {"version": 1}),
    ("v0", cai(version=0), {"version": 0}),
    ("v0 mask unknown", cai(version=0, mask=42), {"mask": None}),
    ("strides None", cai(strides=None), {"strides": (12, 4)}),
    ("fortran", cai(strides=(4, 16)), {"strides": (4, 16)}),
    ("negative strides", cai(strides=(-12, 4)), {"strides": (-12, 4)}),
    ("zero-size null", cai(shape=(0, 3), data=(0, False)), {"size": 0, "ptr": 0}),
    ("zero-size pointer", cai(shape=(5, 0), data=(PTR, False)), {"size": 0, "ptr": 0}),
    ("scalar", cai(shape=()), {"size": 1, "strides": (), "nbytes": 4}),
    ("read-only", cai(data=(PTR, True)), {"readonly": True}),
    ("numpy bool flag", cai(data=(PTR, np.bool_(True))), {"readonly": True}),
    ("numpy ints", cai(shape=(np.int64(2),), data=(np.uint64(PTR), False)), {"shape": (2,)}),
    ("unknown keys", cai(extra="ignored"), {}),
    ("mask", cai(mask=MASK), {}),
    ("mask on the array's stream", cai(stream=7, mask=Exports(cai(typestr="|b1", stream=7))), {}),
    ("big endian", cai(typestr=">i8"), {"dtype": np.dtype(">i8")}),
    ("datetime", cai(typestr="<M8[ns]"), {"dtype": np.dtype("<M8[ns]")}),
    ("structured", cai(typestr="|V8", descr=[("a", "<f4"), ("b", "<i4")]), {"nbytes": 96}),
    ("trivial descr", cai(descr=[("", "<f4")]), {"dtype": np.dtype("<f4")}),
]
for _kind in ("|b1", "|i1", "<i2", "<i4", "<i8", "|u1", "<u2", "<u4", "<u8", "<f2", "<f4", "<f8",
              "<c8", "<c16", "<m8[s]", "|S4", "<U2", "|V16"):  # fmt: skip
    VALID.append((f"dtype {_kind}", cai(typestr=_kind), {"dtype": np.dtype(_kind)}))


@pytest.mark.parametrize(("label", "entry", "expected"), VALID, ids=[v[0] for v in VALID])
def test_valid(label: str, entry: dict[str, Any], expected: dict[str, Any]) -> None:
    producer = Exports(entry)
    view = parse(producer)
    assert producer.reads == 1
    assert view.owner is producer
    assert view.shape == tuple(int(n) for n in entry["shape"])
    assert view.typestr == entry["typestr"]
    for name, value in expected.items():
        assert getattr(view, name) == value, name
    assert len(view.strides) == len(view.shape)
    if "mask" in entry and entry["version"] >= 1 and entry["mask"] is MASK:
        assert view.mask is not None and view.mask.dtype == np.bool_


def test_v0_dictionary_like() -> None:
    view = parse(Exports(DictLike(cai(version=0))))
    assert view.version == 0 and view.shape == (4, 3)


class IndexOnly:
    """An integer-like type with ``__index__`` and no comparisons: validation
    compared it with ints (a TypeError from inside the library)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


INVALID: list[tuple[str, Any, str]] = [
    ("not a dict", [1, 2], "expected a dict"),
    ("dict-like needs v0", DictLike(cai(version=1)), "only version 0"),
    ("no shape", cai(shape=_DROP), "no 'shape' entry"),
    ("no typestr", cai(typestr=_DROP), "no 'typestr' entry"),
    ("no data", cai(data=_DROP), "no 'data' entry"),
    ("no version", cai(version=_DROP), "no 'version' entry"),
    ("shape list", cai(shape=[4, 3]), "'shape'.*tuple of non-negative ints"),
    ("shape negative", cai(shape=(4, -1)), "'shape'"),
    ("shape bool", cai(shape=(True, 3)), "'shape'"),
    ("shape float", cai(shape=(4.0, 3)), "'shape'"),
    ("typestr int", cai(typestr=4), "'typestr'"),
    ("typestr no byte order", cai(typestr="f4"), "byte order"),
    ("typestr native order", cai(typestr="=f4"), "byte order"),
    ("typestr unknown kind", cai(typestr="<x4"), "'typestr'"),
    ("typestr object", cai(typestr="|O8"), "'typestr'"),
    ("typestr bad size", cai(typestr="<f3"), "'typestr'"),
    ("descr inconsistent", cai(descr=[("a", "<f8")]), "'descr'"),
    ("descr garbage", cai(typestr="|V8", descr=[("a", "nope")]), "'descr'"),
    ("data list", cai(data=[PTR, False]), "'data'.*2-tuple"),
    ("data 3-tuple", cai(data=(PTR, False, 0)), "'data'"),
    ("data negative", cai(data=(-8, False)), "non-negative int pointer"),
    ("data float", cai(data=(1.0, False)), "non-negative int pointer"),
    ("data flag int", cai(data=(PTR, 0)), "bool read-only flag"),
    ("data null", cai(data=(0, False)), "non-null pointer"),
    ("strides short", cai(strides=(4,)), "'strides'.*tuple of 2 ints"),
    ("strides list", cai(strides=[12, 4]), "'strides'"),
    ("strides float", cai(strides=(12.0, 4)), "'strides'"),
    ("version bool", cai(version=True), "'version'"),
    ("version negative", cai(version=-1), "'version'"),
    ("version str", cai(version="3"), "'version'"),
    ("version future", cai(version=4), "newer versions"),
    ("stream 0", cai(stream=0), "0 is disallowed by the spec"),
    ("stream negative", cai(stream=-2), "positive stream handle"),
    ("stream bool", cai(stream=True), "'stream'"),
    ("stream str", cai(stream="1"), "'stream'"),
    ("stream float", cai(stream=1.0), "'stream'"),
    ("mask shape", cai(mask=Exports(cai(shape=(3,), typestr="|b1"))), "mask of the array's shape"),
    ("mask plain", cai(mask=[True] * 12), "'mask'"),
    (
        "mask with a stream of its own",
        cai(mask=Exports(cai(typestr="|b1", stream=7))),
        "names no stream or the array's own \\(None\\), not stream 7",
    ),
    ("version index-only", cai(version=IndexOnly(3)), "'version'"),
    ("shape index-only", cai(shape=(IndexOnly(4), 3)), "'shape'"),
    ("data index-only", cai(data=(IndexOnly(PTR), False)), "'data'"),
    ("strides index-only", cai(strides=(IndexOnly(12), 4)), "'strides'"),
    ("stream index-only", cai(stream=IndexOnly(5)), "'stream'"),
]


@pytest.mark.parametrize(("label", "entry", "match"), INVALID, ids=[v[0] for v in INVALID])
def test_invalid(label: str, entry: Any, match: str) -> None:
    with pytest.raises(cs.InterfaceError, match=match):
        parse(Exports(entry))


def test_interface_error_is_a_value_error() -> None:
    assert issubclass(cs.InterfaceError, ValueError)
    assert issubclass(cs.InterfaceError, cs.CaiStreamsError)


def test_no_interface_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="does not expose __cuda_array_interface__"):
        parse(np.zeros(3))

    class CpuTensor:  # PyTorch raises AttributeError for CPU tensors
        @property
        def __cuda_array_interface__(self) -> Any:
            raise AttributeError("Can't get __cuda_array_interface__ on non-CUDA tensor")

    with pytest.raises(TypeError, match="non-CUDA tensor"):
        parse(CpuTensor())


def test_export_is_v3_and_normalized() -> None:
    out = parse(Exports(cai(version=1, strides=(12, 4)))).__cuda_array_interface__
    assert out == {
        "shape": (4, 3),
        "typestr": "<f4",
        "data": (PTR, False),
        "strides": None,
        "version": 3,
        "stream": None,
    }
    fortran = parse(Exports(cai(strides=(4, 16), stream=5))).__cuda_array_interface__
    assert fortran["strides"] == (4, 16) and fortran["stream"] == 5
    empty = parse(Exports(cai(shape=(0,), data=(PTR, False)))).__cuda_array_interface__
    assert empty["data"] == (0, False)
    structured = parse(Exports(cai(typestr="|V8", descr=[("a", "<f4"), ("b", "<i4")])))
    assert parse(structured).dtype == structured.dtype
    masked = parse(Exports(cai(mask=MASK))).__cuda_array_interface__
    assert parse(Exports(masked)).mask is not None


def test_view_is_frozen_and_export_is_a_copy() -> None:
    view = parse(Exports(cai()))
    with pytest.raises(AttributeError, match="frozen"):
        view.ptr = 0
    first = view.__cuda_array_interface__
    first["stream"] = 99
    assert view.__cuda_array_interface__["stream"] is None
    assert view.with_stream(7).stream == 7 and view.stream is None


@pytest.mark.parametrize(
    ("bad", "error"),
    [(0, ValueError), (-1, ValueError), (1 << 64, ValueError), ("7", TypeError),
     (7.0, TypeError), (True, TypeError), ([7], TypeError)],
)  # fmt: skip
def test_with_stream_takes_a_v3_stream_entry_or_none(bad: object, error: type) -> None:
    """What it makes re-exports a version 3 interface: its ``stream`` is a
    handle from 1 to 2**64 - 1 (0 is ambiguous there) or None."""
    view = parse(Exports(cai()))
    with pytest.raises(error, match="with_stream"):
        view.with_stream(bad)  # type: ignore[arg-type]
    assert view.with_stream(np.uint64(7)).stream == 7
    assert type(view.with_stream(np.uint64(7)).stream) is int
    assert view.with_stream(2**64 - 1).with_stream(None).stream is None


def test_with_stream_names_the_handle_a_stream_object_has() -> None:
    with sim.simulated(sanitizer=False), pytest.raises(TypeError, match=r"pass its \.handle"):
        parse(Exports(cai())).with_stream(cs.Stream())  # type: ignore[arg-type]


# -- properties ---------------------------------------------------------------

TYPESTRS = ["|b1", "|i1", "<i2", ">i4", "<i8", "|u1", "<u4", "<f2", "<f4", ">f8", "<c8",
            "<c16", "<M8[us]", "|S3", "<U1", "|V4"]  # fmt: skip


@st.composite
def valid_cai(draw: st.DrawFn) -> dict[str, Any]:
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=4)))
    typestr = draw(st.sampled_from(TYPESTRS))
    itemsize = np.dtype(typestr).itemsize
    size = int(np.prod(shape, dtype=np.int64))
    ptr = draw(st.integers(2**16, 2**48)) if size else draw(st.sampled_from([0, PTR]))
    version = draw(st.integers(0, 3))
    entry: dict[str, Any] = {
        "shape": shape,
        "typestr": typestr,
        "data": (ptr, draw(st.booleans())),
        "version": version,
    }
    layout = draw(st.sampled_from(["absent", "none", "c", "any"]))
    if layout == "none":
        entry["strides"] = None
    elif layout == "c":
        entry["strides"] = c_strides(shape, itemsize)
    elif layout == "any":
        entry["strides"] = tuple(draw(st.integers(-64, 64)) for _ in shape)
    if version == 3:
        entry["stream"] = draw(st.one_of(st.none(), st.integers(1, 2**48)))
    return entry


@settings(max_examples=10_000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_cai())
def test_round_trip(entry: dict[str, Any]) -> None:
    view = parse(Exports(entry))
    again = parse(Exports(view.__cuda_array_interface__))
    assert again.version == 3
    for field in ("ptr", "shape", "strides", "dtype", "typestr", "readonly", "size", "nbytes",
                  "mask", "stream"):  # fmt: skip
        assert getattr(again, field) == getattr(view, field), field
    assert parse(Exports(again.__cuda_array_interface__))._key() == again._key()


ANY_VALUE = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=8),
        st.sampled_from(TYPESTRS + ["<f4", "=f4", "<M8[zz]", "|O8", "<f3", "f"]),
    ),
    lambda inner: st.one_of(st.tuples(inner, inner), st.lists(inner, max_size=4),
                            st.tuples(inner), st.tuples(inner, inner, inner)),
    max_leaves=8,
)  # fmt: skip
KEYS = st.sampled_from(["shape", "typestr", "data", "version", "strides", "stream", "mask",
                        "descr", "other"])  # fmt: skip


@settings(max_examples=3_000, deadline=None)
@given(st.one_of(st.dictionaries(KEYS, ANY_VALUE), valid_cai().flatmap(
    lambda d: st.dictionaries(KEYS, ANY_VALUE).map(lambda extra: {**d, **extra}))))  # fmt: skip
def test_fuzz_only_documented_errors_escape(entry: dict[str, Any]) -> None:
    try:
        view = parse(Exports(entry))
    except (cs.InterfaceError, TypeError):
        return
    assert isinstance(view.__cuda_array_interface__, dict)


# -- the same rules through the consumer API, on every backend ---------------------


@pytest.mark.parametrize(("label", "entry", "match"), INVALID, ids=[v[0] for v in INVALID])
def test_invalid_through_consume(backend: cs.Backend, label: str, entry: Any, match: str) -> None:
    import anyio

    with pytest.raises(cs.InterfaceError, match=match):
        cs.consume_blocking(Exports(entry))
    for loop in ("asyncio", "trio"):
        with pytest.raises(cs.InterfaceError, match=match):
            anyio.run(lambda: cs.consume(Exports(entry)), backend=loop)


@pytest.mark.parametrize(("label", "entry", "expected"), VALID, ids=[v[0] for v in VALID])
def test_valid_through_consume(
    backend: cs.Backend, label: str, entry: dict[str, Any], expected: dict[str, Any]
) -> None:
    import anyio

    producer = Exports(entry)
    reference = parse(producer)
    # sync=False: the view as read, the producer's stream included
    assert cs.consume_blocking(producer, sync=False) == reference
    assert anyio.run(lambda: cs.consume(producer, sync=False)) == reference
    if reference.stream in (None, 1, 2):  # streams that exist on every backend
        assert cs.consume_blocking(producer, timeout=20) == reference.with_stream(None)
        for loop in ("asyncio", "trio"):
            view = anyio.run(lambda: cs.consume(producer, timeout=20), backend=loop)
            assert view == reference.with_stream(None)
        s = cs.Stream()
        assert cs.consume_blocking(producer, stream=s) == reference.with_stream(s.handle)


@pytest.mark.parametrize(("label", "entry", "expected"), VALID, ids=[v[0] for v in VALID])
def test_stream_of_reads_the_stream_as_parse_does(
    label: str, entry: dict[str, Any], expected: dict[str, Any]
) -> None:
    from cai_streams._interface import stream_of

    assert stream_of(Exports(entry)) == parse(Exports(entry)).stream


@pytest.mark.parametrize("stream", [0, -2, 1 << 64, 1.5, "2", True])
def test_stream_of_refuses_what_parse_refuses(stream: object) -> None:
    from cai_streams._interface import stream_of

    with pytest.raises(cs.InterfaceError, match="stream"):
        stream_of(Exports(cai(stream=stream)))
