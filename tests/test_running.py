"""``_running``: the task running now and a checkpoint, asked of the async
library directly, give what anyio gives (the blocks' owners depend on it)."""

from __future__ import annotations

import asyncio
import importlib.util
import threading

import anyio
import pytest

from cai_streams._blocks import current_owner
from cai_streams._running import checkpoint, current_task_id

LOOPS = [
    ("asyncio", {}),
    ("trio", {}),
    pytest.param(
        "asyncio",
        {"use_uvloop": True},
        id="uvloop",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("uvloop") is None, reason="uvloop is not installed"
        ),
    ),
]


def test_outside_any_loop_there_is_no_task() -> None:
    assert current_task_id() is None
    assert current_owner() == (threading.get_ident(), None)


@pytest.mark.parametrize(("library", "options"), LOOPS)
def test_each_task_is_named_as_anyio_names_it(library: str, options: dict[str, bool]) -> None:
    seen: list[tuple[int | None, int]] = []

    async def one() -> None:
        seen.append((current_task_id(), anyio.get_current_task().id))
        await checkpoint()  # the same task after a checkpoint
        seen.append((current_task_id(), anyio.get_current_task().id))

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(one)
        await one()

    anyio.run(main, backend=library, backend_options=options)
    assert [mine for mine, _ in seen] == [theirs for _, theirs in seen]
    assert len({mine for mine, _ in seen}) == 4  # four tasks, four names


def test_a_loop_callback_outside_any_task_has_none() -> None:
    found: list[int | None] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        done = asyncio.Event()

        def callback() -> None:
            found.append(current_task_id())
            done.set()

        loop.call_soon(callback)
        await done.wait()
        found.append(current_task_id())

    asyncio.run(main())
    assert found[0] is None
    assert found[1] is not None


@pytest.mark.parametrize(("library", "options"), LOOPS)
def test_checkpoint_yields_to_other_tasks_and_is_a_cancellation_point(
    library: str, options: dict[str, bool]
) -> None:
    ran: list[str] = []
    checkpoints: list[int] = []
    reached_after: list[bool] = []

    async def other() -> None:
        ran.append("other")

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(other)
            # Without a yield, `other` never runs here (trio runs a batch of
            # ready tasks in random order: one checkpoint may not be enough)
            for n in range(100):
                if ran:
                    checkpoints.append(n)
                    break
                await checkpoint()
        with anyio.CancelScope() as scope:
            scope.cancel()
            await checkpoint()
            reached_after.append(True)  # pragma: no cover - cancelled above

    anyio.run(main, backend=library, backend_options=options)
    assert ran == ["other"]
    assert checkpoints and checkpoints[0] >= 1  # it ran while this task waited in one
    assert reached_after == []
