"""``_tracebacks.release_frames``: a kept exception keeps none of the library's locals."""

from __future__ import annotations

import sys
from types import FrameType, TracebackType

import cai_streams as cs
from cai_streams._tracebacks import release_frames


def _frames(tb: TracebackType | None) -> list[FrameType]:
    found = []
    while tb is not None:
        found.append(tb.tb_frame)
        tb = tb.tb_next
    return found


def _users_helper(marker: object) -> None:
    cs.configure(sync=marker)  # type: ignore[arg-type]  # TypeError inside the library


def _caught() -> BaseException:
    try:
        _users_helper(object())
    except TypeError as exc:
        return exc
    raise AssertionError("configure accepted a non-bool")


def test_the_librarys_finished_frames_lose_their_locals_and_no_other_frame_does() -> None:
    exc = _caught()
    head, helper, library = _frames(exc.__traceback__)
    assert library.f_globals["__name__"] == "cai_streams._config"
    assert "sync" in library.f_locals  # the control: a kept traceback keeps them
    release_frames(exc)
    assert library.f_locals == {}
    assert "marker" in helper.f_locals  # the user's own frames are left alone
    assert head.f_code is _caught.__code__


def test_chained_and_grouped_exceptions_are_visited_and_a_running_frame_is_left() -> None:
    inner = _caught()
    library = _frames(inner.__traceback__)[-1]
    try:
        try:
            raise inner
        except TypeError as exc:
            raise RuntimeError("outer") from exc
    except RuntimeError as outer:
        group = [outer]
        release_frames(outer)  # this frame is the head: it runs on, untouched
        assert group  # (a cleared running frame would have lost this local)
    assert library.f_locals == {}
    if sys.version_info >= (3, 11):
        again = _caught()
        library = _frames(again.__traceback__)[-1]
        release_frames(BaseExceptionGroup("group", [again]))  # noqa: F821
        assert library.f_locals == {}


def test_an_exception_without_a_traceback_is_fine() -> None:
    exc = ValueError("never raised")
    release_frames(exc)
    assert exc.__traceback__ is None
