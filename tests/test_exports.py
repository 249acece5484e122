from __future__ import annotations

import cai_streams as cs


def test_all_is_a_sorted_tuple_of_existing_names() -> None:
    assert isinstance(cs.__all__, tuple)
    assert list(cs.__all__) == sorted(cs.__all__)
    for name in cs.__all__:
        assert hasattr(cs, name), name


def test_public_objects_live_in_the_package() -> None:
    for name in cs.__all__:
        obj = getattr(cs, name)
        if isinstance(obj, type) or (callable(obj) and not isinstance(obj, type(cs))):
            assert obj.__module__ == "cai_streams", name
