"""The fast parse of common interface dicts agrees with full validation.

Model-based: random valid dicts and random corruptions of them. Full
validation (with the layout cache empty) is the oracle; the fast path, with
the layout of the valid dict already cached, must give the same view, and
must never accept what full validation refuses.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cai_streams import _interface
from cai_streams._interface import _parse_common, parse

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
