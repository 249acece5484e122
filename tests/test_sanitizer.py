"""The sanitizer: racy programs are named on every run, correct ones never are,
and its verdict on random programs equals a brute-force happens-before oracle."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import numpy as np
import pytest

import cai_streams as cs
from cai_streams import _sanitizer, sim

from .device_ops import SimOps

ops = SimOps()
HERE = os.path.basename(__file__)


@pytest.fixture(autouse=True)
def _sim() -> Iterator[None]:
    cs.use_backend("sim")
    yield
    cs.configure(sync=True, export_stream=True)


def _write(x: np.ndarray[Any, Any]) -> None:
    x[...] = 1


def _read(*_: object) -> None:
    pass


def w(s: cs.Stream | int, arr: Any, duration: float = 0.0) -> None:
    sim.launch(s, _write, arr, writes=[arr], duration=duration, name="w")


def r(s: cs.Stream | int, arr: Any) -> None:
    sim.launch(s, _read, arr, reads=[arr], name="r")


# -- the catalogue of racy programs ----------------------------------------------


def _missing_wait() -> None:
    a, b, x = cs.Stream(), cs.Stream(), sim.empty(64)
    w(a, x)
    r(b, x)


def _host_read_before_sync() -> None:
    s, x = cs.Stream(), sim.empty(64)
    w(s, x)
    x.to_host()


def _host_consume_of_a_mislabelled_array() -> None:
    s, x = cs.Stream(), sim.empty(64)
    w(s, x)
    cs.consume_blocking(x)  # x exports stream None: "ready", but it is not


def _write_after_read_on_reuse() -> None:
    reader, writer, x = cs.Stream(), cs.Stream(), sim.empty(64)
    w(writer, x)
    reader.wait(writer.record())
    r(reader, x)
    w(writer, x)  # refill without waiting for the reader


def _write_after_write() -> None:
    a, b, x = cs.Stream(), cs.Stream(), sim.empty(64)
    w(a, x)
    w(b, x)


def _event_recorded_before_the_work() -> None:
    a, b, x = cs.Stream(), cs.Stream(), sim.empty(64)
    early = a.record()
    w(a, x)
    b.wait(early)
    r(b, x)


def _join_covering_some_streams() -> None:
    writers, three = [cs.Stream() for _ in range(3)], cs.Stream()
    x = sim.empty(96)
    for i, s in enumerate(writers):
        w(s, x[i * 32 : (i + 1) * 32])
    for s in writers[:2]:  # stream "15" forgotten
        three.wait(s.record())
    r(three, x)


def _export_of_an_undeclared_write() -> None:
    s, x = cs.Stream(), sim.empty(64)
    t = cs.track(x)
    w(s, x)  # written outside t.writing(s): the scheduler cannot join it
    t.export()


def _sync_false_then_read_elsewhere() -> None:
    s, c, x = cs.Stream(), cs.Stream(), sim.empty(64)
    w(s, x)
    x.stream = s.handle
    view = cs.consume_blocking(x, sync=False)
    r(c, view)


def _enqueue_consume_with_sync_false() -> None:
    s, c, x = cs.Stream(), cs.Stream(), sim.empty(64)
    w(s, x)
    x.stream = s.handle
    r(c, anyio.run(lambda: cs.consume(x, stream=c, sync=False)))


def _overlapping_slices() -> None:
    a, b, x = cs.Stream(), cs.Stream(), sim.empty(64)
    w(a, x[:40])
    r(b, x[32:])


RACY: dict[str, tuple[Callable[[], None], str]] = {
    "missing wait": (_missing_wait, "stream"),
    "host read before sync": (_host_read_before_sync, "to_host"),
    "host consume of a mislabelled array": (_host_consume_of_a_mislabelled_array, "host thread"),
    "write after read on buffer reuse": (_write_after_read_on_reuse, "buffer is reused"),
    "write after write from two streams": (_write_after_write, "write of"),
    "event recorded before the work": (_event_recorded_before_the_work, "earlier work of"),
    "join covering some streams": (_join_covering_some_streams, "kernel 'r'"),
    "export of an undeclared write": (_export_of_an_undeclared_write, "export()"),
    "sync=False then a read elsewhere": (_sync_false_then_read_elsewhere, "kernel 'r'"),
    "consume(stream=, sync=False)": (_enqueue_consume_with_sync_false, "kernel 'r'"),
    "overlapping slices": (_overlapping_slices, "read of"),
}


@pytest.mark.parametrize(("jitter", "seed"), [(0.0, 0), (0.0005, 1), (0.003, 2), (0.003, 3)])
@pytest.mark.parametrize("name", list(RACY))
def test_racy_programs_are_flagged_on_every_run(name: str, jitter: float, seed: int) -> None:
    program, needle = RACY[name]
    with sim.simulated(jitter=jitter, seed=seed), pytest.raises(cs.HazardError) as info:
        program()
    message = str(info.value)
    assert needle in message
    assert message.count(HERE) == 2, message  # both accesses, each with its line
    assert "is not ordered after" in message and "Fix:" in message
    assert info.value.first is not None and info.value.second is not None


def test_the_message_names_both_sides_and_the_fix() -> None:
    with pytest.raises(cs.HazardError) as info:
        _missing_wait()
    first, second = info.value.first, info.value.second
    assert isinstance(first, _sanitizer.Access) and isinstance(second, _sanitizer.Access)
    assert (first.kind, second.kind) == ("write", "read")
    assert first.actor != second.actor
    assert first.site == f"tests/{HERE}:{w.__code__.co_firstlineno + 1}"  # the launch
    assert "cs.export()" in str(info.value)


# -- correct programs are never flagged -------------------------------------------


def _event_ordered() -> None:
    a, b, x = cs.Stream(), cs.Stream(), sim.empty(64)
    w(a, x)
    b.wait(a.record())
    r(b, x)
    a.wait(b.record())
    w(a, x)


def _host_sync() -> None:
    s, x = cs.Stream(), sim.empty(64)
    w(s, x)
    s.synchronize()
    x.to_host()


def _event_sync() -> None:
    s, x = cs.Stream(), sim.empty(64)
    w(s, x)
    s.record().synchronize()
    x.to_host()
    w(s, x)
    e = s.record()
    while not e.is_done:  # a query that says "done" orders the host too
        pass
    x.to_host()


def _transitive_chain() -> None:
    a, b, c, x = cs.Stream(), cs.Stream(), cs.Stream(), sim.empty(64)
    w(a, x)
    b.wait(a)
    c.wait(b)
    r(c, x)


def _spec_export() -> None:
    writers, three = [cs.Stream() for _ in range(3)], cs.Stream()
    x = sim.empty(96)
    t = cs.track(x, stream=three)
    for i, s in enumerate(writers):
        with t.writing(s, disjoint=True):
            w(s, x[i * 32 : (i + 1) * 32], duration=0.001)
    cai = t.__cuda_array_interface__
    r(cai["stream"], x)
    with t.writing(writers[0]):  # reuse after the consumer's read on "3"
        w(writers[0], x)


def _legacy_and_blocking_streams() -> None:
    x = sim.empty(64)
    w(2, x)  # the per-thread default stream is blocking: the legacy copy waits for it
    x.to_host()


async def _every_consume_mode() -> None:
    s, c = cs.Stream(), cs.Stream()
    x = sim.empty(64)
    x.stream = s.handle
    w(s, x)
    await cs.consume(x)
    w(s, x)
    r(c, await cs.consume(x, stream=c))
    async with cs.consuming(x, stream=c) as view:
        r(c, view)
    w(s, x)  # after the back-edge
    cs.consume_blocking(x)
    ys = [sim.empty(8) for _ in range(3)]
    for y in ys:
        y.stream = s.handle
        w(s, y)
    await cs.consume_all(*ys)
    t = cs.track(sim.empty(32))
    with t.writing(s):
        w(s, t.array)
    await cs.consume(t)
    with t.writing(s):
        w(s, t.array)
    r(c, await cs.consume(t, stream=c))
    with t.writing(s):  # waits for the read on c
        w(s, t.array)
    async with cs.consuming(t, stream=c) as view:
        r(c, view)
    with t.writing(s):
        w(s, t.array)


CLEAN: dict[str, Callable[[], None]] = {
    "event-ordered streams": _event_ordered,
    "host sync": _host_sync,
    "event sync and query": _event_sync,
    "transitive chain": _transitive_chain,
    "7/9/15 -> 3 export": _spec_export,
    "legacy and per-thread default streams": _legacy_and_blocking_streams,
    "every consume mode": lambda: anyio.run(_every_consume_mode),
}


@pytest.mark.parametrize(("jitter", "seed"), [(0.0, 0), (0.003, 1), (0.003, 2)])
@pytest.mark.parametrize("name", list(CLEAN))
def test_correct_programs_are_never_flagged(name: str, jitter: float, seed: int) -> None:
    with sim.simulated(jitter=jitter, seed=seed):
        before = _sanitizer.checks()
        CLEAN[name]()
        assert _sanitizer.checks() > before  # it did look


# -- switching it on and off -----------------------------------------------------------


def test_sanitize_nests_and_restores() -> None:
    assert cs.sanitizing()  # the suite runs with it on
    with cs.sanitize(False):
        assert not cs.sanitizing()
        _missing_wait()  # not checked
        with cs.sanitize():
            assert cs.sanitizing()
            with pytest.raises(cs.HazardError):
                _missing_wait()
        assert not cs.sanitizing()
    assert cs.sanitizing()
    backend = cs.current_backend()
    with cs.sanitize(False):
        assert "record" not in vars(backend)  # nothing is paid when it is off


def test_freed_memory_is_forgotten() -> None:
    import gc

    s = cs.Stream()
    x = sim.empty(1 << 12)
    w(s, x)
    s.synchronize()
    assert _sanitizer._state.shadows
    del x
    gc.collect()
    assert not _sanitizer._state.shadows


@pytest.mark.parametrize(("value", "on"), [("1", True), ("0", False), ("", False)])
def test_environment_switch(value: str, on: bool) -> None:
    env = {**os.environ, "CAI_STREAMS_SANITIZE": value, "CAI_STREAMS_BACKEND": "sim"}
    code = "import cai_streams as cs; print(cs.sanitizing())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60, check=True)  # fmt: skip
    assert out.stdout.strip() == str(on)


def test_environment_switch_rejects_nonsense_when_used_not_at_import() -> None:
    env = {**os.environ, "CAI_STREAMS_SANITIZE": "maybe", "CAI_STREAMS_BACKEND": "sim"}
    imported = subprocess.run([sys.executable, "-c", "import cai_streams"], env=env,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
    assert imported.returncode == 0, imported.stderr  # a project that never uses it is fine
    code = "import cai_streams as cs; cs.current_backend()"
    used = subprocess.run([sys.executable, "-c", code], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert used.returncode != 0 and "CAI_STREAMS_SANITIZE='maybe'" in used.stderr


# -- random programs against a brute-force oracle ----------------------------------------

N_STREAMS = 3  # plus the legacy stream, index 3
LEGACY = N_STREAMS
N_EVENTS = 2
#: byte ranges of the buffers, as offsets into one allocation: 0 and 1 overlap
RANGES = [(0, 256), (128, 384), (512, 768)]

Op = tuple[Any, ...]


def _random_program(rng: random.Random) -> list[Op]:
    program: list[Op] = []
    for _ in range(rng.randint(2, 24)):
        kind = rng.choices(["launch", "record", "wait", "sync_event", "sync_stream", "to_host"],
                           weights=[6, 3, 3, 1, 1, 1])[0]  # fmt: skip
        if kind == "launch":
            reads = frozenset(b for b in range(len(RANGES)) if rng.random() < 0.3)
            writes = frozenset(b for b in range(len(RANGES)) if rng.random() < 0.25)
            program.append(("launch", rng.randrange(N_STREAMS + 1), reads, writes))
        elif kind == "record":
            program.append(("record", rng.randrange(N_EVENTS), rng.randrange(N_STREAMS + 1)))
        elif kind == "wait":
            program.append(("wait", rng.randrange(N_STREAMS + 1), rng.randrange(N_EVENTS)))
        elif kind == "sync_event":
            program.append(("sync_event", rng.randrange(N_EVENTS)))
        elif kind == "sync_stream":
            program.append(("sync_stream", rng.randrange(N_STREAMS + 1)))
        else:
            program.append(("launch", LEGACY, frozenset([rng.randrange(len(RANGES))]), frozenset()))
            program.append(("sync_stream", LEGACY))
    return program


def _oracle(program: list[Op]) -> int | None:
    """The index of the first op whose access races with an earlier one, by
    reachability in the happens-before graph built from CUDA's rules alone."""
    # nodes: ("h", k) host issue of op k, ("d", k) device execution of op k
    edges: dict[tuple[str, int], set[tuple[str, int]]] = {}

    def edge(a: tuple[str, int], b: tuple[str, int]) -> None:
        edges.setdefault(a, set()).add(b)

    last_on: dict[int, int] = {}
    recorded: dict[int, int] = {}
    accesses: list[tuple[int, str, int]] = []  # (op, kind, buffer)
    for k, op in enumerate(program):
        if k:
            edge(("h", k - 1), ("h", k))
        kind = op[0]
        if kind in ("launch", "record", "wait"):
            stream = op[1] if kind != "record" else op[2]
            edge(("h", k), ("d", k))
            if stream in last_on:
                edge(("d", last_on[stream]), ("d", k))
            last_on[stream] = k
            if kind == "launch":
                accesses += [(k, "read", b) for b in op[2]] + [(k, "write", b) for b in op[3]]
            elif kind == "record":
                recorded[op[1]] = k
            elif op[2] in recorded:
                edge(("d", recorded[op[2]]), ("d", k))
        elif kind == "sync_event":
            if op[1] in recorded:
                edge(("d", recorded[op[1]]), ("h", k))
        elif kind == "sync_stream" and op[1] in last_on:
            edge(("d", last_on[op[1]]), ("h", k))

    def reaches(a: int, b: int) -> bool:
        seen, todo = set(), [("d", a)]
        while todo:
            node = todo.pop()
            if node == ("d", b):
                return True
            for nxt in edges.get(node, ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return False

    def overlap(b1: int, b2: int) -> bool:
        return RANGES[b1][0] < RANGES[b2][1] and RANGES[b2][0] < RANGES[b1][1]

    for j, (kb, kind_b, buf_b) in enumerate(accesses):
        for ka, kind_a, buf_a in accesses[:j]:
            if ka == kb or not overlap(buf_a, buf_b) or "write" not in (kind_a, kind_b):
                continue
            if not reaches(ka, kb):
                return kb
    return None


def _run(program: list[Op], streams: list[int], events: list[int], base: Any) -> int | None:
    backend = cs.current_backend()
    views = [base[lo // 4 : hi // 4] for lo, hi in RANGES]
    for k, op in enumerate(program):
        kind = op[0]
        try:
            if kind == "launch":
                sim.launch(streams[op[1]], _read, reads=[views[b] for b in op[2]],
                           writes=[views[b] for b in op[3]])  # fmt: skip
            elif kind == "record":
                backend.record(events[op[1]], streams[op[2]])
            elif kind == "wait":
                backend.stream_wait_event(streams[op[1]], events[op[2]])
            elif kind == "sync_event":
                backend.synchronize_event(events[op[1]])
            else:
                backend.synchronize_stream(streams[op[1]])
        except cs.HazardError:
            return k
    return None


def test_random_programs_match_the_happens_before_oracle() -> None:
    rng = random.Random(2026)
    backend = cs.current_backend()
    owned = [cs.Stream() for _ in range(N_STREAMS)]
    streams = [s.handle for s in owned] + [1]
    base = sim.empty(1024 // 4, "float32")
    sim.device().jitter, saved = 0.0, sim.device().jitter
    racy = 0
    try:
        for n in range(2000):
            program = _random_program(rng)
            events = [backend.create_event() for _ in range(N_EVENTS)]
            with cs.sanitize(False), cs.sanitize():  # a clean slate per program
                got = _run(program, streams, events, base)
            for e in events:
                backend.destroy_event(e)
            expected = _oracle(program)
            assert got == expected, f"program {n}: sanitizer {got}, oracle {expected}: {program}"
            racy += expected is not None
    finally:
        sim.device().jitter = saved
        for s in owned:
            s.synchronize()
    assert 400 < racy < 1600, racy  # both verdicts are well represented
