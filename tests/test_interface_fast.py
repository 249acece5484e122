"""The fast parse of common interface dicts agrees with full validation.

Model-based: random valid dicts and random corruptions of them. Full
validation (with the layout cache empty) is the oracle; the fast path, with
the layout of the valid dict already cached, must give the same view, and
must never accept what full validation refuses.
"""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cai_streams import InterfaceError, _interface
from cai_streams._interface import ArrayView, _parse_common, parse, parse_read

from .test_interface import DictLike  # keys() and [], no Mapping: only version 0 allows it

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


# --- near misses: the fast path against full validation, and mutants of it --------


class Tuple(tuple):  # type: ignore[type-arg]
    """Equal to, and hashed as, the tuple it holds: only its type tells."""


class Int(int):
    """An int subclass: full validation takes it (through ``__index__``)."""


class Mask:
    def __init__(self, shape: Any) -> None:
        self.__cuda_array_interface__ = {
            "shape": shape, "typestr": "|b1", "data": (PTR, True), "version": 2,
        }  # fmt: skip


def _elements(values: tuple[int, ...], how: str) -> Any:
    """``values`` with one element (or the container) replaced by an equal
    value of another type."""
    if how == "tuple subclass":
        return Tuple(values)
    if how == "list":
        return list(values)
    kinds = {"float": float, "bool": bool, "np.int64": np.int64, "np.int32": np.int32}
    kinds["int subclass"] = Int
    convert = kinds[how]
    out = list(values)
    out[-1] = convert(out[-1]) if how != "bool" else (out[-1] == 1 if out[-1] in (0, 1) else True)
    return tuple(out)


ELEMENT_MISSES = ["float", "bool", "np.int64", "np.int32", "int subclass", "tuple subclass", "list"]
#: (field, value or rule): values equal or close to valid ones, of every kind
#: the fast path must either refuse or treat exactly as full validation does
NEAR_MISSES: list[tuple[str, Any]] = [
    *[("shape", how) for how in ELEMENT_MISSES],
    *[("strides", how) for how in ELEMENT_MISSES],
    ("strides", "c strides"),
    ("strides", "missing"),
    ("ptr", float),
    ("ptr", "bool"),
    ("ptr", np.uint64),
    ("ptr", np.int64),
    ("ptr", Int),
    ("ptr", 0),
    ("ptr", -8),
    ("ptr", 2**64 - 8),
    ("ptr", 2**64),
    ("readonly", 0),
    ("readonly", 1),
    ("readonly", np.bool_(True)),
    ("readonly", None),
    ("data", "list"),
    ("data", "tuple subclass"),
    ("data", "three"),
    *[("version", v) for v in (0, 1, 2, 3, 4, 2.0, 3.0, True, np.int64(3), Int(3), "3", None)],
    *[("stream", v) for v in (0, None, 1, 2, PTR, 2**64 - 1, 2**64, -1, True, 1.0)],
    *[("stream", v) for v in (np.int64(PTR), Int(PTR), "missing")],
    ("mask", None),
    ("mask", "same shape"),
    ("mask", "other shape"),
    ("mask", "self"),
    ("descr", None),
    ("descr", "trivial"),
    ("descr", "trivial tuple"),
    ("descr", "trivial lists"),
    ("descr", [("", "<f8")]),
    ("descr", [("x", "<f4"), ("y", "<f4")]),
    ("typestr", "other"),
    ("typestr", "str subclass"),
    ("typestr", b"<f4"),
    ("extra", "key"),
    ("cai", "dict-like"),
    *[(field, "missing") for field in ("shape", "typestr", "data", "version")],
]


class StrSub(str):
    pass


def _near_miss(
    cai: dict[str, Any], field: str, how: Any, owner: object, into: dict[str, Any] | None = None
) -> Any:
    """``into`` (default: a copy of the valid ``cai``) with one near miss of
    ``cai``'s values applied."""
    out = dict(cai) if into is None else into
    shape: tuple[int, ...] = cai["shape"]
    ptr, readonly = cai["data"]
    itemsize = np.dtype(cai["typestr"]).itemsize
    c_strides = _interface.c_strides(shape, itemsize)
    if how == "missing":
        out.pop(field, None)
    elif field in ("shape", "strides"):
        given = cai.get("strides") or c_strides
        values = shape if field == "shape" else given
        out[field] = c_strides if how == "c strides" else _elements(values or (1,), how)
    elif field == "ptr":
        bad = True if how == "bool" else how(ptr) if callable(how) else how
        out["data"] = (bad, readonly)
    elif field == "readonly":
        out["data"] = (ptr, how)
    elif field == "data":
        data = cai["data"]
        out["data"] = {"list": list(data), "tuple subclass": Tuple(data)}.get(how, (*data, 0))
    elif field == "mask" and isinstance(how, str):
        masks = {"same shape": Mask(shape), "other shape": Mask((*shape, 2)), "self": owner}
        out["mask"] = masks[how]
    elif field == "descr" and isinstance(how, str):
        trivial = ("", cai["typestr"])
        descrs = {"trivial": [trivial], "trivial tuple": (trivial,), "trivial lists": [[*trivial]]}
        out["descr"] = descrs[how]
    elif field == "typestr" and isinstance(how, str):
        other = "<f8" if cai["typestr"] != "<f8" else "<i8"
        out["typestr"] = other if how == "other" else StrSub(cai["typestr"])
    elif field == "extra":
        out["extra"] = object()
    elif field == "cai":
        return DictLike(out)
    else:
        out[field] = how
    return out


def _typed(view: ArrayView) -> Any:
    """A view's fields with their types (np.bool_(True) == True, 3.0 == 3)."""
    names = ("ptr", "shape", "strides", "dtype", "typestr", "readonly", "size", "nbytes")
    values = [getattr(view, n) for n in (*names, "version", "stream")]
    shapes = [tuple(map(type, view.shape)), tuple(map(type, view.strides))]
    mask = None if view.mask is None else _typed(view.mask)
    return (type(view), [(type(v), v) for v in values], shapes, mask, view.owner)


Fast = Callable[[object, Any], "ArrayView | None"]


def _disagreement(fast: Fast, valid: dict[str, Any], case: Any) -> str | None:
    """How ``fast(obj, case)`` (a fast path: a view, or None for "ask full
    validation"), run with ``valid``'s layout cached, departs from full
    validation of ``case`` run with the cache empty; None if it does not."""
    obj = Exports(None)
    obj.cai = case
    _interface._layouts.clear()
    try:
        oracle: Any = _interface._validate(obj, case, ())
    except Exception as exc:  # noqa: BLE001 - any refusal must be the fast path's too
        oracle = exc
    _interface._layouts.clear()
    parse(Exports(valid))  # any case equal to the valid dict finds its layout
    try:
        got = fast(obj, case)
    except Exception as exc:  # noqa: BLE001 - a fast path never raises
        return f"raised {exc!r}"
    finally:
        _interface._layouts.clear()
    if got is None:
        return None
    if not isinstance(oracle, ArrayView):
        return f"took what full validation refuses: {oracle!r}"
    if _typed(got) != _typed(oracle):
        return f"gave {got!r}, full validation {oracle!r}"
    return None


def _disagreements(fast: Fast, valid: dict[str, Any], corpus: list[tuple[str, Any]]) -> list[str]:
    owner = Exports(None)
    found = []
    for field, how in corpus:
        case = _near_miss(valid, field, how, owner)
        problem = _disagreement(fast, valid, case)
        if problem is not None:
            found.append(f"{field} {how!r}: {problem}")
    return found


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cupy_style(), st.lists(st.sampled_from(NEAR_MISSES), min_size=0, max_size=3))
def test_near_misses_are_refused_or_agree(
    cai: dict[str, Any], misses: list[tuple[str, Any]]
) -> None:
    """Model-based: a valid dict with up to three near misses applied (values
    equal to valid ones but of another type, subclassed containers, null and
    out-of-range pointers, versions 0-4, streams 0, None and past 2**64, masks,
    descrs, missing and extra keys). The fast path either leaves the dict to
    full validation or gives exactly its view, field types included; without
    misses (and with data to point at) it takes the dict."""
    owner = Exports(None)
    case: Any = dict(cai)
    for field, how in misses:
        if isinstance(case, dict):
            case = _near_miss(cai, field, how, owner, into=case)
    assert _disagreement(_parse_common, cai, case) is None
    if not misses and int(np.prod(cai["shape"])):
        parse(Exports(cai))
        assert _parse_common(Exports(None), dict(cai)) is not None
        _interface._layouts.clear()


#: a valid dict of each kind the mutants below need: 2-d, explicit (negative)
#: strides, a stream, version 2
VALID: list[dict[str, Any]] = [
    {"shape": (4, 3), "typestr": "<f4", "data": (PTR, False), "strides": None,
     "version": 3, "stream": 1},
    {"shape": (4, 1), "typestr": "<f8", "data": (PTR + 64, True), "strides": (-8, 8),
     "version": 3, "stream": PTR},
    {"shape": (1,), "typestr": "|u1", "data": (PTR, False), "strides": (1,), "version": 2},
]  # fmt: skip
#: checks of the fast path, each removed in turn: (what it reads, what a
#: mutant skipping it reads instead)
MUTANTS: list[tuple[str, str]] = [
    ("type(raw_shape) is not tuple", "False"),
    ("type(version) is not int", "False"),
    ("type(data) is not tuple", "False"),
    ("or len(data) != 2", ""),
    ("for n in raw_shape:\n        if type(n) is not int:",
     "for n in raw_shape:\n        if False:"),
    ("if type(raw_strides) is not tuple:", "if False:"),
    ("for n in raw_strides:\n            if type(n) is not int:",
     "for n in raw_strides:\n            if False:"),
    ("type(ptr) is not int or ", ""),
    ("type(readonly) is not bool or ", ""),
    ("or not ptr_min <= ptr <= ptr_max", ""),
    ("if version == _LATEST else None", "if True else None"),
    ("type(stream) is not int or ", ""),
    ("or not 0 < stream < _ADDRESS_LIMIT", ""),
    ('if "mask" in cai and cai["mask"] is not None:', "if False:"),
    ('if "descr" in cai:', "if False:"),
    (" or descr != trivial_descr", ""),
    ("if type(cai) is not dict:", "if False:"),
]  # fmt: skip


def _mutant(check: str, instead: str) -> Fast:
    source = textwrap.dedent(inspect.getsource(_interface._parse_common))
    assert source.count(check) == 1, check  # the check is there, once
    namespace = dict(vars(_interface))
    exec(source.replace(check, instead), namespace)  # noqa: S102 - a test's own mutant
    mutant: Fast = namespace["_parse_common"]
    return mutant


def test_the_fast_path_agrees_on_every_near_miss() -> None:
    """The control's baseline: the real fast path, on the mutants' corpus."""
    for valid in VALID:
        assert _disagreements(_parse_common, valid, NEAR_MISSES) == []


@pytest.mark.parametrize(
    ("check", "instead"), MUTANTS, ids=[" ".join(m[0].split())[:40] for m in MUTANTS]
)
def test_a_fast_path_skipping_a_check_is_caught(check: str, instead: str) -> None:
    """Control for the tests above: a fast path that skips any one of its
    checks (the exact-type checks included, since 4.0, True and np.int64(4)
    equal 4) disagrees with full validation on some near miss of the corpus.
    Not among them: ``type(typestr) is str`` and ``type(descr) is list``, as
    full validation takes equal subclasses too; those checks only keep user
    code (a subclass's ``__hash__`` or ``__eq__``) out of the fast path."""
    mutant = _mutant(check, instead)
    found = [d for valid in VALID for d in _disagreements(mutant, valid, NEAR_MISSES)]
    assert found, f"a fast path without {check!r} went unnoticed"


#: near misses that change nothing full validation gives for a dict whose
#: layout is cached: the fast path must take them (CuPy's trivial descr, a
#: stream or none, an absent strides entry, which the spec allows, keys it ignores)
HARMLESS: list[tuple[str, Any]] = [
    ("mask", None),
    ("descr", None),
    ("descr", "trivial"),
    ("extra", "key"),
    *[("stream", v) for v in (None, 1, 2, PTR, 2**64 - 1, "missing")],
    ("strides", "missing"),
]


@pytest.mark.parametrize(("field", "how"), HARMLESS, ids=[f"{f} {h!r}" for f, h in HARMLESS])
def test_the_fast_path_takes_what_changes_nothing(field: str, how: Any) -> None:
    """Beside the refusals: what full validation treats as the cached dict is
    taken by the fast path, with full validation's view (else a producer
    sending it would pay full validation on every handoff)."""
    valid = VALID[0]
    case = _near_miss(valid, field, how, Exports(None))
    assert _disagreement(_parse_common, valid, case) is None
    parse(Exports(valid))
    try:
        assert _parse_common(Exports(None), case) is not None
    finally:
        _interface._layouts.clear()


# --- the cache itself: keyed by what validation read, and only user-code-free --


class _Given:
    """Exposes ``cai`` itself (``Exports`` copies a dict, which would drop a
    subclass's ``__getitem__``)."""

    def __init__(self, cai: Any) -> None:
        self.__cuda_array_interface__ = cai


class _ShapeOnce(dict[str, Any]):
    """A dict subclass (full validation takes it as a mapping) whose "shape"
    is a large one when first read, and (4, 3) after."""

    def __init__(self, cai: dict[str, Any]) -> None:
        super().__init__(cai)
        self.reads = 0

    def __getitem__(self, key: str) -> Any:
        if key == "shape":
            self.reads += 1
            return (1 << 20, 1 << 10) if self.reads == 1 else (4, 3)
        return super().__getitem__(key)


class _EditsOnCompare(tuple[str, str]):
    """A descr element equal to ``("", "<f4")`` whose comparison edits ``cai``
    (user code that full validation runs)."""

    cai: dict[str, Any] = {}

    def __eq__(self, other: object) -> bool:
        self.cai["shape"] = (4, 3)
        return tuple.__eq__(self, other)

    __hash__ = tuple.__hash__


@pytest.mark.parametrize("how", ["a mapping read twice", "a dict edited by its descr"])
def test_a_layout_is_cached_under_what_validation_read(how: str) -> None:
    """A mapping that answers differently the second time, or a dict that user
    code run by validation edits, must not cache the layout it validated under
    another key: an honest dict of that key would get a view of the other
    layout. Control: the honest dict with the cache empty."""
    honest = {"shape": (4, 3), "typestr": "<f4", "data": (PTR, False), "version": 3}
    _interface._layouts.clear()
    expected = parse(Exports(dict(honest)))  # (full validation: nothing cached yet)
    _interface._layouts.clear()
    cai: dict[str, Any]
    if how == "a mapping read twice":
        cai = _ShapeOnce({**honest, "shape": None})
    else:
        cai = {**honest, "shape": (1 << 20, 1 << 10), "descr": [_EditsOnCompare(("", "<f4"))]}
        _EditsOnCompare.cai = cai
    first = parse(_Given(cai))
    assert first.shape == (1 << 20, 1 << 10)  # what validation saw, and gave
    got = parse(Exports(dict(honest)))
    assert (got.shape, got.strides, got.nbytes) == (expected.shape, expected.strides, 48)


@pytest.mark.parametrize("strides", [None, (-8,)])
def test_a_zero_size_item_type_keeps_the_pointer_below_2_64(strides: Any) -> None:
    """An item type of no bytes (``|S0``) touches no byte, so the layout's own
    extent allows any pointer; the pointer itself must still be below 2**64,
    cached or not."""
    _interface._layouts.clear()

    def cai(ptr: int) -> dict[str, Any]:
        return {"shape": (2,), "typestr": "|S0", "data": (ptr, False), "version": 3,
                "strides": strides}  # fmt: skip

    with pytest.raises(InterfaceError, match="below 2\\*\\*64"):
        parse(Exports(cai(2**64)))  # control: full validation refuses it
    assert parse(Exports(cai(0x1000))).ptr == 0x1000  # its layout is cached now
    assert _interface._layouts
    with pytest.raises(InterfaceError, match="below 2\\*\\*64"):
        parse(Exports(cai(2**64)))
    assert parse(Exports(cai(2**64 - 1))).ptr == 2**64 - 1


def _counting(base: type[Any], calls: list[str], *names: str) -> Any:
    """A subclass of ``base`` whose methods ``names`` note each call in ``calls``
    (as ``"base.name"``), then do what ``base``'s do."""

    def noting(name: str) -> Callable[..., Any]:
        real = getattr(base, name)

        def method(self: Any, *args: Any) -> Any:
            calls.append(f"{base.__name__}.{name}")
            return real(self, *args)

        return method

    return type(f"Counting{base.__name__}", (base,), {name: noting(name) for name in names})


def test_the_fast_path_runs_no_user_code() -> None:
    """Subclasses of str, tuple, int and list in every field of a dict whose
    layout is cached: the fast path refuses them without calling their
    ``__hash__``, ``__eq__``, ``__index__``, ``__len__`` or ``__iter__`` (full
    validation may, after). Control: the same classes do count when called."""
    calls: list[str] = []
    S = _counting(str, calls, "__hash__", "__eq__")
    T = _counting(tuple, calls, "__hash__", "__eq__", "__len__", "__iter__")
    N = _counting(int, calls, "__hash__", "__eq__", "__index__")
    L = _counting(list, calls, "__eq__", "__ne__")

    good = {"shape": (4, 3), "typestr": "<f4", "data": (PTR, False), "strides": None,
            "version": 3}  # fmt: skip
    cases = [
        {**good, "typestr": S("<f4")},
        {**good, "shape": T((4, 3))},
        {**good, "shape": (4, N(3))},
        {**good, "strides": T((12, 4))},
        {**good, "strides": (12, N(4))},
        {**good, "version": N(3)},
        {**good, "data": T((PTR, False))},
        {**good, "data": (N(PTR), False)},
        {**good, "stream": N(5)},
        {**good, "descr": L([("", "<f4")])},
    ]
    _interface._layouts.clear()
    parse(Exports(dict(good)))  # cached
    for cai in cases:
        assert _parse_common(Exports(cai), cai) is None, cai
    assert calls == []
    hash(S("x")), T((1,)) == (1,), len(T(())), N(1) == 1  # noqa: B015 - the control
    assert calls == ["str.__hash__", "tuple.__eq__", "tuple.__len__", "int.__eq__"]


class _AsAnother(str):
    """A type string that hashes and compares as ``'<f4'`` whatever it says."""

    __slots__ = ()

    def __hash__(self) -> int:
        return hash("<f4")

    def __eq__(self, other: object) -> bool:
        return True


def test_a_str_subclass_typestr_neither_takes_nor_leaves_a_cached_dtype() -> None:
    """Full validation caches dtypes by type string: a subclass that hashes
    and compares as ``'<f4'`` gets its own dtype (it took the cached float32,
    unchecked), and leaves none behind (a plain ``'<f4'`` parsed after it
    took its float64)."""
    parse(Exports({"shape": (4,), "typestr": "<f4", "data": (PTR, False), "version": 3}))
    odd = parse(
        Exports({"shape": (4,), "typestr": _AsAnother("<f8"), "data": (PTR, False), "version": 3})
    )
    assert odd.dtype == np.float64 and odd.nbytes == 32
    _interface._dtypes.clear()
    _interface._layouts.clear()
    parse(
        Exports({"shape": (4,), "typestr": _AsAnother("<f8"), "data": (PTR, False), "version": 3})
    )
    plain = parse(Exports({"shape": (4,), "typestr": "<f4", "data": (PTR, False), "version": 3}))
    assert plain.dtype == np.float32 and plain.nbytes == 16
    with pytest.raises(InterfaceError, match="typestr"):
        parse(
            Exports({"shape": (4,), "typestr": _AsAnother("?"), "data": (PTR, False), "version": 3})
        )
