"""Random handoff programs against a sequential oracle (driver for test_model.py).

A program is a list of steps over three buffers: two tracked ones (``B0``,
``B1``) and one untracked producer (``U``, a Numba-style array that names its
stream in its interface). Each step runs on one of four host threads: the event
loop's (``loop``, where the async API is used) or a worker (``w0``..``w2``,
with the blocking API). Steps run one after the other, except groups that run
at once on several threads when their order does not matter to the oracle
(concurrent readers, disjoint writers) or is fixed by the library's rules
(a consumer that starts while another thread's ``writing()`` block is open
sees that write).

A ``dropped_owner`` step gives a fresh array to a stream (``cs.hold``, a
view from ``consume(stream=)`` or ``consuming()``, or two views on one stream,
the first released before the second is made, which may merge their holds, or
two views on two streams, whose holds may be released by two threads),
enqueues a read of it and drops it at once; the next allocation of its size,
which the caching allocator may serve from its block, is written at once: the
read must still see the dropped array's values.

Every write stores fresh values, every read copies the buffer to a result
array (or to the host), and the oracle is the same program run sequentially
on numpy. After each program every stream is synchronized, every result is
compared, every array and wrapper is dropped, and no event may be in flight
or pinned. Kernels run with seeded jitter and random durations, and the
sanitizer is on, so a missing ordering is a wrong value or a HazardError.

The driver uses only the public API (and ``cs.stats()``), so it runs against
older versions of the library as well (see ``run_count``).
"""

from __future__ import annotations

import gc
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np

import cai_streams as cs
from cai_streams import sim

PARTS = 3
PART = 4
N = PARTS * PART
THREADS = ("loop", "w0", "w1", "w2")
WORKERS = THREADS[1:]
WAIT = 10.0  # seconds: every wait in a program is bounded by this

#: a stream as a program names it: ("own", i), ("consumer", j), ("legacy",),
#: ("ptds",) (the executing thread's per-thread stream), ("int", i) (a bare handle)
Spec = tuple[Any, ...]


@dataclass
class Step:
    kind: str
    thread: str
    args: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self.args.items())
        return f"{self.kind}@{self.thread}({inner})"


@dataclass
class Group:
    """Steps that run at once, one per thread."""

    steps: list[Step]

    def __repr__(self) -> str:
        return f"Group{self.steps!r}"


Program = list[Step | Group]


# -- generating programs ----------------------------------------------------------


class _Gen:
    def __init__(self, rng: random.Random, n_own: int, n_consumers: int) -> None:
        self.rng = rng
        self.n_own = n_own
        self.n_consumers = n_consumers
        self.value = 0
        #: parts written by the open disjoint group of each buffer (a read or a
        #: whole write closes it): writing one again in the group is a program error
        self.open_parts: dict[str, set[int]] = {"B0": set(), "B1": set()}

    def fresh(self) -> int:
        self.value += 1
        return self.value

    def write_stream(self) -> Spec:
        r = self.rng.random()
        if r < 0.65:
            return ("own", self.rng.randrange(self.n_own))
        if r < 0.8:
            return ("ptds",)
        if r < 0.9:
            return ("int", self.rng.randrange(self.n_own))
        return ("legacy",)

    def read_stream(self) -> Spec:
        r = self.rng.random()
        if r < 0.45:
            return ("consumer", self.rng.randrange(self.n_consumers))
        if r < 0.7:
            return ("own", self.rng.randrange(self.n_own))
        if r < 0.85:
            return ("ptds",)
        if r < 0.93:
            return ("int", self.rng.randrange(self.n_own))
        return ("legacy",)

    def duration(self) -> float:
        return self.rng.choice([0.0, 0.0, 0.0005, 0.001, 0.002, 0.003])

    def any_thread(self) -> str:
        return self.rng.choice(THREADS)

    def tracked(self) -> str:
        return self.rng.choice(["B0", "B1"])

    def via(self) -> str:
        """How a step names a tracked buffer: its TrackedArray if the program
        still holds one, a fresh track(), or the raw array."""
        return self.rng.choice(["wrapper", "wrapper", "track", "array"])

    def step(self) -> Step | Group:
        rng = self.rng
        kind = rng.choices(
            [
                "write",
                "disjoint",
                "read_block",
                "export",
                "consume_host",
                "consume_enqueue",
                "consume_opt_out",
                "consuming",
                "consume_all",
                "close",
                "drop",
                "cancel",
                "interface_write",
                "produce",
                "consume_untracked",
                "track_race",
                "readers",
                "held_write",
                "held_read",
                "export_in_block",
                "dropped_owner",
            ],
            weights=[10, 4, 6, 6, 6, 6, 3, 4, 3, 3, 3, 2, 1, 4, 5, 1, 3, 2, 2, 2, 4],
        )[0]
        b = self.tracked()
        free = [p for p in range(PARTS) if p not in self.open_parts[b]]
        if kind == "disjoint" and not free:
            kind = "write"
        if kind == "disjoint":
            parts = rng.sample(free, rng.randint(1, len(free)))
            self.open_parts[b].update(parts)
        elif kind == "consume_all":
            pass  # closes the groups of the buffers it names (below)
        elif kind not in (
            "drop",
            "cancel",
            "track_race",
            "produce",
            "consume_untracked",
            "close",
            "dropped_owner",
        ):
            self.open_parts[b] = set()
        if kind == "write":
            return Step(
                kind,
                self.any_thread(),
                {
                    "b": b,
                    "s": self.write_stream(),
                    "value": self.fresh(),
                    "via": self.via(),
                    "d": self.duration(),
                },
            )
        if kind == "disjoint":
            writes = [
                Step(
                    "part",
                    rng.choice(THREADS),
                    {
                        "b": b,
                        "s": self.write_stream(),
                        "part": p,
                        "value": self.fresh(),
                        "via": self.via(),
                        "d": self.duration(),
                    },
                )
                for p in parts
            ]
            if rng.random() < 0.5:  # at once, from distinct threads
                threads = rng.sample(THREADS, len(writes))
                for w, th in zip(writes, threads, strict=True):
                    w.thread = th
                return Group(writes)
            return Group([writes[0]]) if len(writes) == 1 else _Seq(writes)
        if kind == "export_in_block":
            return Step(
                kind,
                self.any_thread(),
                {
                    "b": b,
                    "s": self.write_stream(),
                    "value": self.fresh(),
                    "x": rng.choice([None, self.read_stream()]),
                    "via": self.via(),
                    "d": self.duration(),
                },
            )
        if kind == "read_block":
            return Step(
                kind,
                self.any_thread(),
                {"b": b, "s": self.read_stream(), "via": self.via(), "d": self.duration()},
            )
        if kind == "export":
            x = rng.choice([None, self.read_stream()])
            how = (
                rng.choice(["method", "function", "property"])
                if x is None
                else rng.choice(["method", "function"])
            )
            return Step(
                kind,
                self.any_thread(),
                {"b": b, "x": x, "how": how, "via": self.via(), "d": self.duration()},
            )
        if kind == "consume_host":
            return Step(kind, self.any_thread(), {"b": b, "via": self.via()})
        if kind == "consume_enqueue":
            return Step(
                kind,
                self.any_thread(),
                {"b": b, "s": self.read_stream(), "via": self.via(), "d": self.duration()},
            )
        if kind == "consume_opt_out":
            return Step(kind, self.any_thread(), {"b": b, "via": self.via(), "d": self.duration()})
        if kind == "consuming":
            return Step(
                kind,
                "loop",
                {"b": b, "s": self.read_stream(), "via": self.via(), "d": self.duration()},
            )
        if kind == "consume_all":
            names = [rng.choice(["B0", "B1", "U"]) for _ in range(rng.randint(2, 4))]
            for name in names:
                if name in self.open_parts:
                    self.open_parts[name] = set()
            return Step(kind, "loop", {"names": names, "via": self.via()})
        if kind == "close":
            return Step(kind, self.any_thread(), {"j": rng.randrange(self.n_consumers)})
        if kind == "drop":
            return Step(kind, self.any_thread(), {"b": b})
        if kind == "cancel":
            return Step(
                kind,
                "loop",
                {
                    "b": rng.choice(["B0", "B1", "U"]),
                    "via": self.via(),
                    "how": rng.choice(["scope", "timeout"]),
                },
            )
        if kind == "interface_write":
            return Step(kind, "loop", {"b": b, "value": self.fresh(), "d": self.duration()})
        if kind == "produce":
            return Step(kind, self.any_thread(), {"value": self.fresh(), "d": self.duration()})
        if kind == "consume_untracked":
            mode = rng.choice(["host", "consuming", "opt_out", "export"])
            thread = "loop" if mode == "consuming" else self.any_thread()
            return Step(kind, thread, {"mode": mode, "s": self.read_stream(), "d": self.duration()})
        if kind == "track_race":
            return Step(kind, "loop", {"b": b})
        if kind == "dropped_owner":
            how = rng.choice(["hold", "consume", "consuming", "consume_twice", "two_streams"])
            s = self.read_stream()
            s2 = self.read_stream() if how == "two_streams" else s
            if how in ("consume", "consume_twice", "two_streams") and "int" in (s[0], s2[0]):
                how = "hold"  # a bare handle's view keeps its owner only while it lives
            thread = "loop" if how == "consuming" else self.any_thread()
            args = {"how": how, "s": s, "value": self.fresh(), "d": self.duration()}
            if how == "two_streams":
                args["s2"] = s2
            return Step(kind, thread, args)
        if kind == "readers":
            threads = rng.sample(THREADS, rng.randint(2, 4))
            return Group(
                [
                    Step(
                        rng.choice(["consume_host", "consume_enqueue", "read_block"])
                        if th != "loop"
                        else rng.choice(
                            ["consume_host", "consume_enqueue", "read_block", "consuming"]
                        ),
                        th,
                        {"b": b, "s": self.read_stream(), "via": self.via(), "d": self.duration()},
                    )
                    for th in threads
                ]
            )
        if kind == "held_write":
            return Step(
                kind,
                "loop",
                {
                    "b": b,
                    "s": self.write_stream(),
                    "value": self.fresh(),
                    "writer": rng.choice(WORKERS),
                    "consumer": rng.choice(["host", "enqueue"]),
                    "r": self.read_stream(),
                },
            )
        # held_read: a worker holds a reading() block open while another writes
        w1, w2 = rng.sample(WORKERS, 2)
        return Step(
            "held_read",
            "loop",
            {
                "b": b,
                "r": self.read_stream(),
                "reader": w1,
                "s": self.write_stream(),
                "writer": w2,
                "value": self.fresh(),
            },
        )


class _Seq(Group):
    """Steps of a group that run one after the other."""


def generate(rng: random.Random, n_own: int = 3, n_consumers: int = 3) -> Program:
    gen = _Gen(rng, n_own, n_consumers)
    program: Program = []
    for _ in range(rng.randint(4, 14)):
        item = gen.step()
        if isinstance(item, _Seq):
            program.extend(item.steps)
        else:
            program.append(item)
    return program


# -- running programs ----------------------------------------------------------------


class ProgramFailed(AssertionError):
    pass


def _fill(x: np.ndarray[Any, Any], value: int) -> None:
    x[...] = value


def _copy(dst: np.ndarray[Any, Any], src: np.ndarray[Any, Any]) -> None:
    np.copyto(dst, src)


class _Worker:
    """A host thread that runs steps handed to it (blocking API only)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.jobs: queue.Queue[tuple[Callable[[], None], threading.Event, list[BaseException]]]
        self.jobs = queue.Queue()
        self.busy = False
        self.thread = threading.Thread(target=self._run, name=f"model-{name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            job, done, errors = self.jobs.get()
            self.busy = True
            try:
                job()
            except BaseException as exc:  # reported by the caller
                errors.append(exc)
            finally:
                self.busy = False
                done.set()

    def submit(self, job: Callable[[], None]) -> tuple[threading.Event, list[BaseException]]:
        done: threading.Event = threading.Event()
        errors: list[BaseException] = []
        self.jobs.put((job, done, errors))
        return done, errors


class Runner:
    """Runs programs on the current (simulated) backend."""

    def __init__(self, n_own: int = 3, n_consumers: int = 3) -> None:
        self.n_own = n_own
        self.n_consumers = n_consumers
        # streams and arrays are spread over the devices there are: every join
        # may cross devices (an event of the producer's device, waited on anywhere)
        self.devices = cs.device_count()
        self.own = [cs.Stream(device=i % self.devices) for i in range(n_own)]
        self.iface = cs.Stream(device=self.devices - 1)  # untracked producers': never closed
        self.workers = {name: _Worker(name) for name in WORKERS}
        self.backend = cs.current_backend()

    def restart_worker(self, name: str) -> None:
        """A worker stuck in a step (older library versions) is abandoned."""
        self.workers[name] = _Worker(name)

    # -- one program ---------------------------------------------------------

    async def run(self, program: Program, seed: int) -> None:
        state = _State(self, seed)
        try:
            for item in program:
                if isinstance(item, Group):
                    await state.group(item.steps)
                else:
                    await state.step(item)
            await state.check()
        finally:
            await state.close()


async def until(condition: Callable[[], bool], timeout: float = WAIT) -> None:
    """Poll ``condition`` (set by another thread) from the event loop, bounded."""
    with anyio.fail_after(timeout):
        while True:
            if condition():
                return
            await anyio.sleep(0.0002)


def _before(token: int) -> None:
    handover = getattr(cs, "happens_before", None)  # older versions lack it
    if handover is not None:
        handover(("model step", token))


def _after(token: int) -> None:
    handover = getattr(cs, "happens_after", None)
    if handover is not None:
        handover(("model step", token))


def _host(view: Any) -> np.ndarray[Any, Any]:
    data = sim._numpy_view(view)
    assert data is not None
    return np.array(data, copy=True)


class _State:
    """One program's arrays, streams, oracle and results."""

    def __init__(self, runner: Runner, seed: int) -> None:
        self.runner = runner
        self.rng = random.Random(seed)
        self.consumers = [
            cs.Stream(device=(j + 1) % runner.devices) for j in range(runner.n_consumers)
        ]
        self.closed_events: list[cs.Event] = []
        self.arrays: dict[str, sim.SimArray] = {}
        self.wrappers: dict[str, cs.TrackedArray | None] = {}
        self.oracle: dict[str, np.ndarray[Any, Any]] = {}
        for k, name in enumerate(("B0", "B1", "U")):
            arr = sim.asarray(np.zeros(N, np.int64), device=k % runner.devices)
            self.arrays[name] = arr
            self.oracle[name] = np.zeros(N, np.int64)
        # the untracked producer names its stream from the start (as a Numba array
        # with a default stream does), so consumers join back onto it
        self.arrays["U"].stream = runner.iface.handle
        self.export_streams: list[cs.Stream] = []
        for name in ("B0", "B1"):
            x = None if self.rng.random() < 0.6 else self.runner.own[self.rng.randrange(3)]
            t = cs.track(self.arrays[name], stream=x)
            self.wrappers[name] = t
            self.export_streams.append(t.export_stream)
        #: (what, result array or host copy, expected)
        self.results: list[tuple[str, Any, np.ndarray[Any, Any]]] = []
        self.lock = threading.Lock()
        self.seq = 0  # steps run so far: the sanitizer hears of their order
        _before(0)  # the setup above (the loop's thread) is before the first step's thread

    # -- resolving names -----------------------------------------------------

    def stream(self, spec: Spec) -> Any:
        if spec[0] == "own":
            return self.runner.own[spec[1]]
        if spec[0] == "consumer":
            return self.consumers[spec[1]]
        if spec[0] == "int":
            return self.runner.own[spec[1]].handle
        if spec[0] == "legacy":
            return 1
        return 2  # the executing thread's per-thread default stream

    def target(self, b: str, via: str) -> Any:
        """What a step hands to the library for buffer ``b``."""
        if b == "U":
            return self.arrays["U"]
        wrapper = self.wrappers.get(b)
        if via == "wrapper" and wrapper is not None:
            return wrapper
        if via == "array":
            return self.arrays[b]
        return cs.track(self.arrays[b])

    def tracked(self, b: str, via: str) -> cs.TrackedArray:
        t = self.target(b, via)
        return t if isinstance(t, cs.TrackedArray) else cs.track(self.arrays[b])

    def expect(self, what: str, result: Any, b: str) -> None:
        with self.lock:
            self.results.append((what, result, self.oracle[b].copy()))

    def new_result(self) -> sim.SimArray:
        return sim.asarray(np.full(N, -1, np.int64))

    def launch_copy(self, s: Any, out: Any, src: Any, d: float) -> None:
        sim.launch(s, _copy, out, src, reads=[src], writes=[out], duration=d, name="copy")

    # -- running steps ---------------------------------------------------------

    async def step(self, st: Step) -> None:
        token = self.next_token()
        if st.thread == "loop":
            _after(token - 1)
            await self.run_async(st)
            _before(token)  # (a step that hands work to workers wraps it in_step)
        else:
            await self.on_worker(st.thread, lambda: self.sequenced(token, st))

    def next_token(self) -> int:
        self.seq += 1
        return self.seq

    def in_step(self, job: Callable[[], None]) -> Callable[[], None]:
        """``job`` on a worker, as part of the step the loop is running now."""
        token = self.seq

        def run() -> None:
            _after(token - 1)
            job()
            _before(token)

        return run

    def sequenced(self, token: int, st: Step) -> None:
        """A step ordered after step ``token - 1``: the program's host threads
        hand over to each other, which the sanitizer is told."""
        _after(token - 1)
        self.run_sync(st)
        _before(token)

    async def on_worker(self, name: str, job: Callable[[], None]) -> None:
        done, errors = self.runner.workers[name].submit(job)
        await self.joined([(done, errors)])

    async def joined(self, waits: list[tuple[threading.Event, list[BaseException]]]) -> None:
        """Wait for worker jobs of the current step; the loop is then behind them."""
        for done, errors in waits:
            await until(done.is_set)
            if errors:
                raise errors[0]
        _after(self.seq)

    async def group(self, steps: list[Step]) -> None:
        """Steps of a group start together (a barrier), each on its own thread."""
        start = threading.Barrier(len(steps), timeout=WAIT)
        token = self.next_token()
        waits = []
        for st in steps:
            if st.thread != "loop":

                def job(st: Step = st) -> None:
                    start.wait()
                    self.sequenced(token, st)

                waits.append(self.runner.workers[st.thread].submit(job))
        for st in steps:
            if st.thread == "loop":
                start.wait()
                _after(token - 1)
                await self.run_async(st)
                _before(token)
        await self.joined(waits)

    def write_value(self, b: str, value: int, part: int | None = None) -> None:
        with self.lock:
            if part is None:
                self.oracle[b][...] = value
            else:
                self.oracle[b][part * PART : (part + 1) * PART] = value

    def run_sync(self, st: Step) -> None:
        """A step on a worker thread (or a synchronous step on the loop's)."""
        a = st.args
        kind = st.kind
        if kind == "write":
            t = self.tracked(a["b"], a["via"])
            s = self.stream(a["s"])
            with t.writing(s):
                sim.launch(
                    s, _fill, t.array, a["value"], writes=[t.array], duration=a["d"], name="fill"
                )
                self.write_value(a["b"], a["value"])
        elif kind == "part":
            t = self.tracked(a["b"], a["via"])
            s = self.stream(a["s"])
            part = self.arrays[a["b"]][a["part"] * PART : (a["part"] + 1) * PART]
            with t.writing(s, disjoint=True):
                sim.launch(
                    s, _fill, part, a["value"], writes=[part], duration=a["d"], name="fill part"
                )
                self.write_value(a["b"], a["value"], a["part"])
        elif kind == "export_in_block":
            # the writer exports what its own open block enqueued so far
            t = self.tracked(a["b"], a["via"])
            s = self.stream(a["s"])
            with t.writing(s):
                sim.launch(
                    s, _fill, t.array, a["value"], writes=[t.array], duration=a["d"], name="fill"
                )
                self.write_value(a["b"], a["value"])
                cai = t.export(None if a["x"] is None else self.stream(a["x"]))
                self.read_export(cai, a["b"], a["d"])
        elif kind == "read_block":
            t = self.tracked(a["b"], a["via"])
            s = self.stream(a["s"])
            out = self.new_result()
            with t.reading(s):
                self.launch_copy(s, out, t.array, a["d"])
                self.expect("reading()", out, a["b"])
        elif kind == "export":
            self.export(st)
        elif kind == "consume_host":
            view = cs.consume_blocking(self.target(a["b"], a["via"]), timeout=WAIT)
            self.expect("consume_blocking()", _host(view), a["b"])
        elif kind == "consume_enqueue":
            s = self.stream(a["s"])
            view = cs.consume_blocking(self.target(a["b"], a["via"]), stream=s, timeout=WAIT)
            out = self.new_result()
            self.launch_copy(s, out, view, a["d"])
            self.expect("consume_blocking(stream=)", out, a["b"])
        elif kind == "consume_opt_out":
            view = cs.consume_blocking(self.target(a["b"], a["via"]), sync=False, timeout=WAIT)
            self.opt_out_read(view, a["b"], a["d"])
        elif kind == "close":
            self.close_consumer(a["j"])
        elif kind == "drop":
            self.wrappers[a["b"]] = None
        elif kind == "produce":
            self.produce(a["value"], a["d"])
        elif kind == "consume_untracked":
            self.consume_untracked_sync(st)
        elif kind == "dropped_owner":
            self.dropped_owner_sync(st)
        else:
            raise AssertionError(f"no synchronous step {kind}")

    def dropped_owner_sync(self, st: Step) -> None:
        a = st.args
        s = self.stream(a["s"])
        owner = sim.asarray(np.full(N, a["value"], np.int64))
        out = self.new_result()
        if a["how"] == "hold":
            self.launch_copy(s, out, owner, a["d"])
            cs.hold(owner, until=s)
        else:
            view = cs.consume_blocking(owner, stream=s, timeout=WAIT)
            self.launch_copy(s, out, view, a["d"])
            del view
        if a["how"] in ("consume_twice", "two_streams"):  # on one stream: may be merged
            s2 = self.stream(a["s2"]) if a["how"] == "two_streams" else s
            again = cs.consume_blocking(owner, stream=s2, timeout=WAIT)
            out2 = self.new_result()
            self.launch_copy(s2, out2, again, a["d"])
            del again
            self.owner_dropped(f"dropped owner (second view, {a['how']})", out2, a["value"])
        del owner
        self.owner_dropped(f"dropped owner ({a['how']})", out, a["value"])

    def owner_dropped(self, what: str, out: sim.SimArray, value: int) -> None:
        """The owner of ``value`` is gone: the next allocation of its size
        (which may be its block) is written now, on the host."""
        sim.asarray(np.full(N, -value, np.int64))  # and given back: the next may take it too
        with self.lock:
            self.results.append((what, out, np.full(N, value, np.int64)))

    def opt_out_read(self, view: cs.ArrayView, b: str, d: float) -> None:
        """sync=False: the consumer orders itself after the stream the view
        names (for a tracked array, the export stream: a consumer read the
        library counts); a view naming none is ready now, on the host."""
        if view.stream is None:
            self.expect("consume(sync=False), stream None", _host(view), b)
            return
        out = self.new_result()
        self.launch_copy(view.stream, out, view, d)
        self.expect("consume(sync=False)", out, b)

    def export(self, st: Step) -> None:
        a = st.args
        t = self.target(a["b"], a["via"])
        x = None if a["x"] is None else self.stream(a["x"])
        if a["how"] == "function":
            cai = cs.export(t, stream=x)
        else:
            tracked = t if isinstance(t, cs.TrackedArray) else cs.track(self.arrays[a["b"]])
            cai = tracked.__cuda_array_interface__ if a["how"] == "property" else tracked.export(x)
        self.read_export(cai, a["b"], a["d"])

    def read_export(self, cai: dict[str, Any], b: str, d: float) -> None:
        arr = self.arrays[b]
        if cai["stream"] is None:  # "ready now, anywhere": read it on the host now
            self.expect("export() naming no stream", _host(arr), b)
            return
        out = self.new_result()
        self.launch_copy(cai["stream"], out, arr, d)
        self.expect("export()", out, b)

    def close_consumer(self, j: int) -> None:
        old = self.consumers[j]
        self.closed_events.append(old.record())  # the program's own end-of-run sync
        old.close()
        self.consumers[j] = cs.Stream(device=old.device)

    def sync_all(self) -> None:
        """Host-wait for every stream's work (before a write the library does not see)."""
        for s in (*self.runner.own, self.runner.iface, *self.consumers, *self.export_streams):
            s.synchronize()
        self.runner.backend.synchronize_stream(1)  # and every per-thread stream, which it waits for
        for e in self.closed_events:
            e.synchronize()

    async def interface_write(self, b: str, value: int, d: float) -> None:
        """A producer the tracked array does not see writes it on its own stream
        and says so in its interface (after a full host sync, so it conflicts
        with nothing)."""
        await self.sync_threads()
        self.sync_all()
        arr = self.arrays[b]
        p = self.runner.iface
        sim.launch(p, _fill, arr, value, writes=[arr], duration=d, name="interface fill")
        arr.stream = p.handle
        self.write_value(b, value)

    def produce(self, value: int, d: float) -> None:
        """The untracked producer refills U on its stream. Its consumers were all
        joined back (host reads, consuming(), explicit waits), so stream order
        suffices."""
        arr = self.arrays["U"]
        p = self.runner.iface
        sim.launch(p, _fill, arr, value, writes=[arr], duration=d, name="produce")
        arr.stream = p.handle
        self.write_value("U", value)

    def consume_untracked_sync(self, st: Step) -> None:
        a = st.args
        arr = self.arrays["U"]
        mode = a["mode"]
        if mode == "host":
            view = cs.consume_blocking(arr, timeout=WAIT)
            self.expect("consume_blocking(U)", _host(view), "U")
        elif mode == "opt_out":
            self.opt_out_read(cs.consume_blocking(arr, sync=False, timeout=WAIT), "U", a["d"])
        elif mode == "export":
            cai = cs.export(arr, stream=self.stream(a["s"]))
            if cai["stream"] is None:
                self.expect("export(U) naming no stream", _host(arr), "U")
                return
            out = self.new_result()
            self.launch_copy(cai["stream"], out, arr, a["d"])
            # the consumer joins itself back onto the producer's stream
            self.runner.iface.wait(cs.Stream.wrap(cai["stream"]))
            self.expect("export(U)", out, "U")
        else:
            raise AssertionError(mode)

    async def run_async(self, st: Step) -> None:
        a = st.args
        kind = st.kind
        if kind == "consume_host":
            view = await cs.consume(self.target(a["b"], a["via"]), timeout=WAIT)
            self.expect("consume()", _host(view), a["b"])
        elif kind == "consume_enqueue":
            s = self.stream(a["s"])
            view = await cs.consume(self.target(a["b"], a["via"]), stream=s, timeout=WAIT)
            out = self.new_result()
            self.launch_copy(s, out, view, a["d"])
            self.expect("consume(stream=)", out, a["b"])
        elif kind == "consume_opt_out":
            view = await cs.consume(self.target(a["b"], a["via"]), sync=False, timeout=WAIT)
            self.opt_out_read(view, a["b"], a["d"])
        elif kind == "consuming":
            s = self.stream(a["s"])
            out = self.new_result()
            async with cs.consuming(self.target(a["b"], a["via"]), stream=s, timeout=WAIT) as view:
                self.launch_copy(s, out, view, a["d"])
            self.expect("consuming()", out, a["b"])
        elif kind == "consume_all":
            objs = [self.target(n, a["via"]) for n in a["names"]]
            views = await cs.consume_all(*objs, timeout=WAIT)
            for n, view in zip(a["names"], views, strict=True):
                self.expect("consume_all()", _host(view), n)
        elif kind == "cancel":
            obj = self.target(a["b"], a["via"])
            if a["how"] == "scope":
                with anyio.CancelScope() as scope:
                    scope.cancel()
                    await cs.consume(obj)
            else:
                try:
                    await cs.consume(obj, timeout=0.0002)
                except TimeoutError:
                    pass
        elif kind == "consume_untracked":
            await self.consume_untracked_async(st)
        elif kind == "track_race":
            await self.track_race(a["b"])
        elif kind == "held_write":
            await self.held_write(st)
        elif kind == "held_read":
            await self.held_read(st)
        elif kind == "interface_write":
            await self.interface_write(a["b"], a["value"], a["d"])
        elif kind == "dropped_owner" and a["how"] == "consuming":
            s = self.stream(a["s"])
            owner = sim.asarray(np.full(N, a["value"], np.int64))
            out = self.new_result()
            async with cs.consuming(owner, stream=s, timeout=WAIT) as view:
                self.launch_copy(s, out, view, a["d"])
            del view, owner
            self.owner_dropped("dropped owner (consuming)", out, a["value"])
        else:
            self.run_sync(st)

    async def consume_untracked_async(self, st: Step) -> None:
        a = st.args
        arr = self.arrays["U"]
        mode = a["mode"]
        if mode == "host":
            view = await cs.consume(arr, timeout=WAIT)
            self.expect("consume(U)", _host(view), "U")
        elif mode == "consuming":
            s = self.stream(a["s"])
            out = self.new_result()
            async with cs.consuming(arr, stream=s, timeout=WAIT) as view:
                self.launch_copy(s, out, view, a["d"])
            self.expect("consuming(U)", out, "U")
        elif mode == "opt_out":
            self.opt_out_read(await cs.consume(arr, sync=False, timeout=WAIT), "U", a["d"])
        else:
            self.consume_untracked_sync(st)

    async def track_race(self, b: str) -> None:
        """Three workers track the same array at once: one TrackedArray."""
        got: list[cs.TrackedArray] = []
        arr = self.arrays[b]
        start = threading.Barrier(len(WORKERS), timeout=WAIT)

        def job() -> None:
            start.wait()
            got.append(cs.track(arr))

        await self.joined([self.runner.workers[w].submit(self.in_step(job)) for w in WORKERS])
        if len({id(t) for t in got}) != 1:
            raise ProgramFailed("track() from three threads at once gave several TrackedArrays")

    async def held_write(self, st: Step) -> None:
        """A worker holds a writing() block open; the loop consumes meanwhile
        and must see that write."""
        a = st.args
        entered, leave = threading.Event(), threading.Event()
        t = self.tracked(a["b"], "wrapper")
        b = a["b"]

        def job() -> None:
            s = self.stream(a["s"])
            with t.writing(s):
                entered.set()
                if not leave.wait(1.0):  # the loop lets go after 2 ms, unless it is blocked
                    raise ProgramFailed("the event loop stalled while a consumer waited")
                sim.launch(s, _fill, t.array, a["value"], writes=[t.array], name="held fill")
                self.write_value(b, a["value"])

        done, errors = self.runner.workers[a["writer"]].submit(self.in_step(job))
        await until(lambda: entered.is_set() or done.is_set())

        async def let_go() -> None:
            await anyio.sleep(0.002)
            leave.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(let_go)
            if a["consumer"] == "host":
                view = await cs.consume(self.target(b, "array"), timeout=WAIT)
                self.expect("consume() during another thread's writing()", _host(view), b)
            else:
                s = self.stream(a["r"])
                view = await cs.consume(self.target(b, "array"), stream=s, timeout=WAIT)
                out = self.new_result()
                self.launch_copy(s, out, view, 0.0)
                self.expect("consume(stream=) during another thread's writing()", out, b)
        leave.set()
        await self.joined([(done, errors)])

    async def held_read(self, st: Step) -> None:
        """A worker holds a reading() block open; another worker's writing()
        must wait for it, so the read sees the old value."""
        a = st.args
        b = a["b"]
        t = self.tracked(b, "wrapper")
        entered = threading.Event()
        out = self.new_result()
        self.expect("reading() held open", out, b)

        def read() -> None:
            r = self.stream(a["r"])
            with t.reading(r):
                self.launch_copy(r, out, t.array, 0.001)
                entered.set()
                time.sleep(0.002)

        def write() -> None:
            entered.wait(WAIT)
            s = self.stream(a["s"])
            with t.writing(s):
                sim.launch(s, _fill, t.array, a["value"], writes=[t.array], name="fill")
            self.write_value(b, a["value"])

        await self.joined(
            [
                self.runner.workers[a["reader"]].submit(self.in_step(read)),
                self.runner.workers[a["writer"]].submit(self.in_step(write)),
            ]
        )

    # -- the end of a program -----------------------------------------------------

    async def sync_threads(self) -> None:
        """Each host thread synchronizes its per-thread default stream."""
        for name in WORKERS:
            await self.on_worker(
                name, self.in_step(lambda: self.runner.backend.synchronize_stream(2))
            )
        self.runner.backend.synchronize_stream(2)

    async def check(self) -> None:
        await self.sync_threads()
        self.sync_all()
        for i, (what, result, expected) in enumerate(self.results):
            got = result if isinstance(result, np.ndarray) else result.to_host()
            if not np.array_equal(got, expected):
                raise ProgramFailed(
                    f"read {i} ({what}) saw {got.tolist()}, expected {expected.tolist()}"
                )

    async def close(self) -> None:
        with cs.sanitize(False):
            try:
                self.sync_all()
            except Exception:
                pass
        for s in self.consumers:
            s.close()
        self.results.clear()
        self.wrappers.clear()
        self.arrays.clear()
        self.closed_events.clear()


# -- leak accounting that works on older versions too ------------------------------


def events_pinned() -> int:
    found = cs.stats().get("events_pinned")
    if found is not None:
        return int(found)
    from cai_streams import _scheduler  # older versions: the pool kept the pins

    sched = _scheduler.scheduler_for(cs.current_backend())
    return sum(getattr(sched.pool, "_pins", {}).values())


def events_in_flight() -> int:
    return int(cs.stats()["events_in_flight"])


def settle() -> None:
    """Let every released event complete and be reclaimed."""
    gc.collect()
    cs.current_backend().synchronize_stream(1)
    for _ in range(200):
        if events_in_flight() == 0 or not cs.stats():
            break
        time.sleep(0.001)


def run_programs(
    runner: Runner,
    seeds: list[int],
    *,
    backend: str,
    on_failure: Callable[[int, Program, BaseException], None],
    sanitize: bool = True,
) -> None:
    """Run the programs of ``seeds`` in one event loop of ``backend``."""
    device = sim.device()

    async def main() -> None:
        for seed in seeds:
            rng = random.Random(seed)
            program = generate(rng, runner.n_own, runner.n_consumers)
            device.seed = seed
            try:
                before = await _wait_in_flight(0)
                pinned_before = events_pinned()
                if sanitize:
                    with cs.sanitize(False), cs.sanitize():  # a clean slate per program
                        await runner.run(program, seed)
                else:
                    with cs.sanitize(False):
                        await runner.run(program, seed)
                in_flight = await _wait_in_flight(before)
                if in_flight > before:
                    raise ProgramFailed(f"{in_flight - before} events still in flight")
                pinned = events_pinned() - pinned_before
                if pinned:
                    raise ProgramFailed(f"{pinned} events still pinned")
            except BaseException as exc:
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                on_failure(seed, program, exc)
                for name in WORKERS:  # a worker may be stuck in a step
                    if runner.workers[name].busy:
                        runner.restart_worker(name)

    options = {"use_uvloop": True} if backend == "uvloop" else {}
    anyio.run(main, backend="asyncio" if backend == "uvloop" else backend, backend_options=options)


async def _wait_in_flight(target: int) -> int:
    """Events released while their work ran are reclaimed once complete."""
    n = events_in_flight()
    for _ in range(100):
        if n <= target:
            return n
        await anyio.sleep(0.001)
        n = events_in_flight()
    return n


@contextmanager
def recycled_stream_handles(backend: Any) -> Iterator[None]:
    """The simulated device hands a destroyed stream's handle to the next stream
    created, as CUDA does: the simulator does it itself now, so this is only a
    check that it does (kept so programs say where they rely on it)."""
    assert hasattr(backend, "_handles") or backend.name == "cuda", "no handle reuse"
    yield


BACKENDS = ("asyncio", "trio", "uvloop")


def run_count(
    programs: int, first_seed: int = 0, *, stop_at: int | None = None, sanitize: bool = True
) -> list[str]:
    """Run ``programs`` programs (seeds from ``first_seed``), each event loop in
    turn, and return one line per failing program."""
    cs.use_backend("sim")
    device = sim.device()
    saved = device.jitter
    device.jitter = 0.0005
    failures: list[str] = []

    def failed(seed: int, program: Program, exc: BaseException) -> None:
        first = (str(exc) or repr(exc)).splitlines()[0][:160]
        failures.append(f"seed {seed}: {type(exc).__name__}: {first}")
        if stop_at is not None and len(failures) >= stop_at:
            raise ProgramFailed(f"program {seed} failed: {exc!r}\n{program!r}") from exc

    try:
        with recycled_stream_handles(cs.current_backend()):
            runner = Runner()
            settle()
            chunk = 50
            seeds = list(range(first_seed, first_seed + programs))
            for i in range(0, len(seeds), chunk):
                backend = BACKENDS[(i // chunk) % len(BACKENDS)]
                run_programs(
                    runner,
                    seeds[i : i + chunk],
                    backend=backend,
                    on_failure=failed,
                    sanitize=sanitize,
                )
            for s in runner.own:
                s.synchronize()
    finally:
        device.jitter = saved
    return failures


if __name__ == "__main__":  # python -m tests.model N: count failing programs
    import sys

    count = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    sanitizer = "--no-sanitizer" not in sys.argv
    started = time.perf_counter()
    lines = run_count(count, sanitize=sanitizer)
    for line in lines:
        print(line)
    print(f"{len(lines)} of {count} programs failed ({time.perf_counter() - started:.0f} s)")
