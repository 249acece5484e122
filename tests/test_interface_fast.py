"""The fast parse of common interface dicts agrees with full validation.

Model-based: random valid dicts and random corruptions of them. Full
validation (with the layout cache empty) is the oracle; the fast path, with
the layout of the valid dict already cached, must give the same view, and
must never accept what full validation refuses.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cai_streams import InterfaceError, _interface
from cai_streams._interface import ArrayView, _parse_common, parse, parse_read

PTR = 0x7F00_0000_0000


class Exports:
    def __init__(self, cai: Any) -> None:
        self.cai = cai

    @property
    def __cuda_array_interface__(self) -> Any:
        return dict(self.cai) if isinstance(self.cai, dict) else self.cai


TYPESTRS = ["<f4", "<f8", "|u1", "<i8", "|b1", "<c8", "<f2"]


@st.composite
def valid(draw: st.DrawFn) -> dict[str, Any]:
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=0, max_size=4)))
    typestr = draw(st.sampled_from(TYPESTRS))
    itemsize = np.dtype(typestr).itemsize
    strides = draw(
        st.one_of(
            st.none(), st.tuples(*[st.integers(-64, 64).map(lambda s: s * itemsize) for _ in shape])
        )
    )
    cai: dict[str, Any] = {
        "shape": shape,
        "typestr": typestr,
        "data": (PTR + draw(st.integers(0, 4096)) * itemsize, draw(st.booleans())),
        "strides": strides,
        "version": draw(st.sampled_from([2, 3])),
    }
    if draw(st.booleans()):
        cai["stream"] = draw(st.sampled_from([None, 1, 2, PTR]))
    return cai


CORRUPTIONS: list[tuple[str, Any]] = [
    ("shape", "float"),
    ("shape", "bool"),
    ("shape", "numpy int"),
    ("shape", "list"),
    ("shape", "negative"),
    ("data", (True, False)),
    ("data", (0, False)),
    ("data", (PTR, 1)),
    ("data", (PTR, np.bool_(True))),
    ("data", [PTR, False]),
    ("data", (-8, False)),
    ("data", (2**64 - 4, False)),
    ("stream", 0),
    ("stream", -1),
    ("stream", 1.0),
    ("stream", True),
    ("stream", 2**64),
    ("version", 4),
    ("version", True),
    ("version", "3"),
    ("version", 1),
    ("typestr", "f4"),
    ("typestr", b"<f4"),
    ("typestr", "<f3"),
    ("strides", "float"),
    ("strides", "short"),
    ("mask", "self"),
    ("descr", [("", "<f4")]),
    ("shape", "missing"),
    ("data", "missing"),
]
#: values equal to valid ones (a cached layout's key) that full validation refuses,
#: and descrs the fast path must leave to it
MORE_CORRUPTIONS: list[tuple[str, Any]] = [
    ("version", 3.0),
    ("version", 2.0),
    ("data", (PTR, 0)),
    ("stream", np.int64(PTR)),
    ("descr", [("", "<f8")]),
    ("descr", (("", "<f4"),)),
    ("descr", [("x", "<f4"), ("y", "<f4")]),
]


def _corrupt(cai: dict[str, Any], field: str, how: Any, owner: object) -> dict[str, Any]:
    out = dict(cai)
    shape = cai["shape"]
    if how == "missing":
        del out[field]
    elif field == "shape" and how == "float":
        out["shape"] = tuple(float(n) for n in shape) or (1.0,)
    elif field == "shape" and how == "bool":
        out["shape"] = tuple(True for _ in shape) or (True,)
    elif field == "shape" and how == "numpy int":
        out["shape"] = tuple(np.int64(n) for n in shape)
    elif field == "shape" and how == "list":
        out["shape"] = list(shape)
    elif field == "shape" and how == "negative":
        out["shape"] = (*shape, -1)
    elif field == "strides" and how == "float":
        out["strides"] = tuple(float(s) for s in cai["strides"] or (4,) * len(shape)) or (4.0,)
    elif field == "strides" and how == "short":
        out["strides"] = (4,) * (len(shape) + 1)
    elif field == "mask" and how == "self":
        out["mask"] = owner
    else:
        out[field] = how
    return out


def _outcome(obj: object) -> Any:
    try:
        view = parse(obj)
    except Exception as exc:  # noqa: BLE001 - the outcome is compared, whatever it is
        return (type(exc), str(exc))
    return view


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid(), st.sampled_from(CORRUPTIONS), st.booleans())
def test_fast_path_agrees_with_full_validation(
    cai: dict[str, Any], corruption: tuple[str, Any], corrupt: bool
) -> None:
    base = Exports(cai)
    obj = Exports(None)
    obj.cai = _corrupt(cai, *corruption, owner=obj) if corrupt else dict(cai)
    _interface._layouts.clear()
    oracle = _outcome(obj)  # full validation
    _interface._layouts.clear()
    parse(base)  # the valid dict's layout is now cached
    size = int(np.prod(cai["shape"]))
    if size and not corrupt:
        assert _parse_common(obj, obj.__cuda_array_interface__) is not None  # it is taken
    fast = _outcome(obj)
    assert fast == oracle


def _fields(outcome: Any) -> Any:
    """Every public attribute of a view (and its class), or the error: what a
    fast path must give exactly as full validation does."""
    if not isinstance(outcome, ArrayView):
        return outcome
    names = ("ptr", "shape", "strides", "dtype", "typestr", "readonly", "size", "nbytes")
    more = ("version", "mask", "stream")
    return (type(outcome), *(getattr(outcome, n) for n in names + more), outcome.owner)


@st.composite
def cupy_style(draw: st.DrawFn) -> dict[str, Any]:
    """A valid dict, with CuPy's trivial descr half of the time."""
    cai = draw(valid())
    if draw(st.booleans()):
        cai["descr"] = [("", cai["typestr"])]
    return cai


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cupy_style(), st.sampled_from(CORRUPTIONS + MORE_CORRUPTIONS), st.booleans())
def test_read_once_parse_agrees_with_full_validation(
    cai: dict[str, Any], corruption: tuple[str, Any], corrupt: bool
) -> None:
    """``parse_read`` (a handoff's parse of the dict it read to choose the
    protocol) gives every attribute full validation gives, and refuses what it
    refuses, the fast path taken or not; the view stays frozen."""
    base = Exports(cai)
    obj = Exports(None)
    obj.cai = _corrupt(cai, *corruption, owner=obj) if corrupt else dict(cai)
    _interface._layouts.clear()
    oracle = _fields(_outcome(obj))  # full validation
    _interface._layouts.clear()
    parse(base)  # the valid dict's layout is now cached
    if int(np.prod(cai["shape"])) and not corrupt:  # the trivial descr too is taken
        assert _parse_common(obj, obj.__cuda_array_interface__) is not None
    try:
        got = parse_read(obj, obj.__cuda_array_interface__)
    except Exception as exc:  # noqa: BLE001 - compared with the oracle's
        assert (type(exc), str(exc)) == oracle
        return
    assert _fields(got) == oracle
    with pytest.raises(AttributeError, match="frozen"):
        got.ptr = 0
    assert parse_read(got, {"not": "read"}) is got  # a view is its own parse


def test_hash_equal_values_never_take_the_fast_path() -> None:
    """Control for the exact-type checks: 3.0, 0, 4.0 and True equal 3, False,
    4 and 1, so each dict below finds the cached layout of the valid one; full
    validation refuses each all the same."""
    good = {"shape": (4, 1), "typestr": "<f4", "data": (PTR, False), "strides": (4, 4),
            "version": 3, "stream": 1}  # fmt: skip
    parse(Exports(good))
    corrupt = [("version", 3.0), ("data", (PTR, 0)), ("shape", (4.0, 1)),
               ("shape", (4, True)), ("stream", True), ("strides", (4.0, 4))]  # fmt: skip
    for field, value in corrupt:
        bad = Exports({**good, field: value})
        assert value == good[field] and hash(value) == hash(good[field])
        with pytest.raises(InterfaceError):
            parse(bad)


def test_an_unreadable_interface_keeps_its_cause() -> None:
    """The TypeError of a property that fails names the AttributeError as its
    cause; an object with no interface at all stands alone."""

    class Failing:
        @property
        def __cuda_array_interface__(self) -> Any:
            raise AttributeError("released")

    with pytest.raises(TypeError, match="not available") as failing:
        parse(Failing())
    assert isinstance(failing.value.__cause__, AttributeError)
    with pytest.raises(TypeError, match="does not expose") as missing:
        parse(object())
    assert missing.value.__cause__ is None and missing.value.__suppress_context__
