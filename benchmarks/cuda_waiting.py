"""Waiting for GPU work from an event loop, on a real GPU, beside the GPU peers.

The cuda counterpart of ``bench_consume.py``, with the same structure: N waiters
each wait for their own event, recorded after their own kernel; the kernels
(random durations, seeded) run on up to 16 streams, ``work`` seconds of kernels
per stream whatever N; every stream is held by a gate kernel until all waiters
are waiting, then released at once. Methods, all in one process, asyncio:

- ``cai_streams``: ``await event.wait()`` through the shared poller (what
  ``await cs.consume(arr)`` does), default policy (on cuda: polling only, since
  the H100 runs of 2026-11-23);
- ``cai_streams doorbell``: the same with ``PollPolicy(wake="doorbell")``: a
  ``close`` host function on a notifier stream ends a pipe the event loop
  watches, no Python on the driver thread; the goal: p99 wake at most 100 us at
  1 to 100 waiters, at most 2% of one core (``cpu_s / wall_s``) while waiting
  (not met on an H100: docs/performance.md);
- ``cai_streams poller``: the same with ``PollPolicy(wake="poll")``, polling only;
- ``cai_streams low-latency``: the same with ``PollPolicy.low_latency()``;
- ``to_thread (40 threads)``: ``await anyio.to_thread.run_sync(event.synchronize)``
  with anyio's default thread limiter (its size is read at run time and named);
- ``poll 1 ms``: per waiter, ``while not event.is_done: await anyio.sleep(0.001)``;
- ``blocking``: ``stream.synchronize()`` in the coroutine, what a CuPy or Numba
  consumer does; it stalls the loop;
- ``close() host function on the waiter's stream``: by hand, per event, a pipe
  whose write end a ``close`` host function on the producer's own stream ends,
  enqueued right after the kernel (no notifier stream, no cross-stream wait, no
  Python on the driver thread); the loop watches the read end. What a doorbell on
  the producer's stream would do, against the library's notifier streams, whose
  host functions ran late on an H100 (docs/gpu.md). Run up to 100 waiters only:
  a gated stream blocks the host after a few dozen pending host functions;
- ``numba async_done``: ``await stream.async_done()`` of numba-cuda on
  numba-owned streams (a driver host callback per waiter, enqueued in place of
  the event; asyncio only);
- ``host callback by hand``: what ``async_done`` does, written against
  cuda.bindings (``cuStreamAddCallback`` of a ctypes function that resolves an
  asyncio future with ``call_soon_threadsafe``), so the callback mechanism is
  measured even where numba's own method fails.

The last two run in a subprocess (``--numba-async-done``) under a timeout,
because a Python callback on a driver thread can deadlock against the GIL
(numba-cuda issue #317): a hang is reported as a "deadlocked" row (with the
child's thread stacks), not waited out.

Wake latency is measured from the GPU's own completion time: each kernel ends
by writing ``%globaltimer`` to device memory, converted to host time with the
calibration of ``cuda_device.py`` (bracketing marks before and after each run),
and compared with ``time.perf_counter_ns()`` when the coroutine resumed. So the
figure is absolute (GPU work done -> coroutine running again), not relative to
an observer thread that would itself compete for the GIL. Figures: wake p50, p99
and max (ms), event-loop lag (how late a 1 ms heartbeat wakes: p99 and max),
process CPU seconds from the gate's release to the last wake (all threads),
event queries per wait, and ``early``: waiters that resumed before their
kernel's stamp (should be 0; non-zero means the measurement is broken).

A gated stream holds only so much pending work before the driver blocks the
host in the next launch or record, which would deadlock against a closed gate:
about 1,000 kernels a stream and 8,000 in all, but only about 56 records of
events made with ``cudaEventBlockingSync`` (cai_streams' events; seen on an
H100, driver 580). The run measures that cap at setup
(``cuda_device.pending_record_cap``) and lays waiters out within three quarters
of it and ``MAX_KERNELS``: one kernel per event, and above that many waiters
``group`` consecutive waiters share an event (each still awaits it; its
completion is its kernel's stamp). The row's case says so. The streams get a
hardware queue each (``CUDA_DEVICE_MAX_CONNECTIONS=32``, set by ``cuda_run``),
so no stream waits behind another's kernels.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import anyio
import anyio.to_thread
import numpy as np

if __package__ in (None, ""):  # run as a script (the numba subprocess)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cai_streams as cs  # noqa: E402
from benchmarks.bench_consume import _CountingQuery  # noqa: E402
from benchmarks.cuda_device import Device, drain  # noqa: E402
from benchmarks.report import describe

PIPE_METHOD = "close() host function on the waiter's stream (by hand, no Python)"
STREAMS = 16
MAX_KERNELS = 3000
GATE_TIMEOUT = 10.0  # seconds a gate holds its streams at most (setup of 10,000 waiters: <1 s)
RUN_TIMEOUT = 30.0  # seconds one run may take once the gate opens

T = TypeVar("T")


@dataclass
class Row:
    """One method at one size: the figures of one run, or the medians of several."""

    method: str
    waiters: int
    wake_p50_ms: float
    wake_p99_ms: float
    wake_max_ms: float
    lag_p99_ms: float
    lag_max_ms: float
    cpu_s: float
    queries_per_wait: float
    early: float
    wall_s: float


@dataclass
class Method(Generic[T]):
    """How a method waits: ``prepare`` runs at enqueue time, right after the
    waiter's kernel, on that kernel's stream (record an event, add a callback);
    ``wait`` is what the waiter awaits."""

    prepare: Callable[[cs.Stream], T]
    wait: Callable[[T, cs.Stream], Awaitable[None]]
    policy: cs.PollPolicy | None = None
    blocking: bool = False
    close: Callable[[T], None] | None = None
    make_stream: Callable[[], cs.Stream] = cs.Stream
    keep: object = None  # what must outlive the method's uses (a C callback)
    #: the most waiters it is run with, and why not more (None: every size)
    max_waiters: tuple[int, str] | None = None


def _record(stream: cs.Stream) -> cs.Event:
    return stream.record()


def _close(event: cs.Event) -> None:
    event.close()


async def _shared(event: cs.Event, stream: cs.Stream) -> None:
    await event.wait(timeout=RUN_TIMEOUT)


async def _to_thread(event: cs.Event, stream: cs.Stream) -> None:
    await anyio.to_thread.run_sync(event.synchronize)


async def _poll_1ms(event: cs.Event, stream: cs.Stream) -> None:
    while not event.is_done:  # noqa: ASYNC110 - the per-waiter polling peer, on purpose
        await anyio.sleep(0.001)


class _Pipe:
    """One event's pipe: the driver's host function closes the write end."""

    def __init__(self, rfd: int) -> None:
        self.rfd = rfd
        self.ended: asyncio.Future[None] | None = None  # shared by the event's waiters


def _close_address() -> int:
    address = ctypes.cast(ctypes.CDLL(None).close, ctypes.c_void_p).value
    assert address, "no close() in this process"
    return address


def _pipe_after(stream: cs.Stream) -> _Pipe:
    rfd, wfd = os.pipe()
    try:
        cs.current_backend().launch_host_func(stream.handle, _close_address(), wfd)
    except BaseException:
        os.close(rfd)
        os.close(wfd)
        raise
    return _Pipe(rfd)  # the write end is the driver's to close now


async def _pipe_ended(pipe: _Pipe, stream: cs.Stream) -> None:
    loop = asyncio.get_running_loop()
    if pipe.ended is None:
        ended = pipe.ended = loop.create_future()

        def readable() -> None:  # end-of-file: the host function ran
            loop.remove_reader(pipe.rfd)
            if not ended.done():
                ended.set_result(None)

        loop.add_reader(pipe.rfd, readable)
    await asyncio.wait_for(asyncio.shield(pipe.ended), RUN_TIMEOUT)


def _close_pipe(pipe: _Pipe) -> None:
    os.close(pipe.rfd)  # after the run: its loop, and any reader left on it, are gone


async def _blocking(event: cs.Event, stream: cs.Stream) -> None:
    with warnings.catch_warnings():  # (the peer that stalls the loop, on purpose)
        warnings.simplefilter("ignore", cs.LoopBlockingWarning)
        stream.synchronize()


def thread_limiter_size() -> int:
    """anyio's default thread limiter size (what ``to_thread`` queues behind)."""

    async def tokens() -> int:
        return int(anyio.to_thread.current_default_thread_limiter().total_tokens)

    return anyio.run(tokens)


def methods() -> dict[str, Method[Any]]:
    """The in-process methods, by row name."""
    return {
        "cai_streams": Method(_record, _shared, cs.PollPolicy(), close=_close),
        "cai_streams doorbell": Method(
            _record, _shared, cs.PollPolicy(wake="doorbell"), close=_close
        ),
        "cai_streams poller": Method(_record, _shared, cs.PollPolicy(wake="poll"), close=_close),
        "cai_streams low-latency": Method(
            _record, _shared, cs.PollPolicy.low_latency(), close=_close
        ),
        f"to_thread ({thread_limiter_size()} threads)": Method(_record, _to_thread, close=_close),
        "poll 1 ms": Method(_record, _poll_1ms, close=_close),
        PIPE_METHOD: Method(
            _pipe_after,
            _pipe_ended,
            close=_close_pipe,
            max_waiters=(
                100,
                "held streams block the host after a few dozen pending host functions "
                "(on an H100, a launch blocked with about 62 pending on each of 16 held streams)",
            ),
        ),
        "blocking": Method(_record, _blocking, blocking=True, close=_close),
    }


#: events (each after its own kernel) that may be pending on one gated stream:
#: set from the device's measured limit by :func:`set_events_per_stream`
_events_per_stream = MAX_KERNELS // STREAMS


def set_events_per_stream(cap: int) -> int:
    """Use at most ``cap`` pending events a stream (at least 1); returns the cap."""
    global _events_per_stream
    _events_per_stream = max(1, min(cap, MAX_KERNELS // STREAMS))
    return _events_per_stream


def usable_events_per_stream(measured: int) -> int:
    """Three quarters of the measured cap: a margin for the records the library
    makes on its own (joins, the back-edge of a handoff)."""
    return max(1, measured * 3 // 4)


def layout(n: int, streams: int = STREAMS) -> tuple[int, int, int]:
    """(streams, events, group): how ``n`` waiters are laid out on the device.

    One kernel per event; ``group`` consecutive waiters share an event (and so its
    kernel) when ``n`` is more than the streams can hold pending.
    """
    group = max(1, math.ceil(n / (streams * _events_per_stream)))
    events = math.ceil(n / group)
    return min(events, streams), events, group


async def one_run(
    device: Device, name: str, method: Method[Any], n: int, seed: int, work: float
) -> Row:
    """One run of ``method`` with ``n`` waiters; see the module docstring."""
    if method.policy is not None:
        cs.configure(poll=method.policy)
    rng = random.Random(seed)
    n_streams, kernels, group = layout(n)
    streams = [method.make_stream() for _ in range(n_streams)]
    per_stream = math.ceil(kernels / n_streams)
    mean = work / per_stream
    device.prepare_stamps(kernels)
    device.mark()  # before the gates hold streams (see cuda_device.py)
    gate = device.gate(streams, GATE_TIMEOUT)
    t_gate = time.perf_counter()
    t_released = 0.0
    tokens: list[Any] = []  # one per kernel (event, future), shared by its group
    owner: list[int] = []  # waiter -> kernel
    for k in range(kernels):
        s = streams[k % n_streams]
        device.spin_then_stamp(s, rng.uniform(0, 2 * mean), k)
        tokens.append(method.prepare(s))
        owner += [k] * min(group, n - k * group)
    t_setup = time.perf_counter()
    resumed = np.zeros(n, np.int64)
    lags: list[float] = []
    started = done = 0
    go = anyio.Event()
    all_waiting = anyio.Event()

    async def heartbeat() -> None:
        await (go if method.blocking else all_waiting).wait()
        while done < n:
            due = time.perf_counter() + 0.001
            await anyio.sleep(0.001)
            lags.append(max(0.0, time.perf_counter() - due))

    async def one(i: int) -> None:
        nonlocal started, done
        await go.wait()
        s = streams[owner[i] % n_streams]
        started += 1
        if started == n:
            all_waiting.set()
        await method.wait(tokens[owner[i]], s)
        resumed[i] = time.perf_counter_ns()
        done += 1

    backend = cs.current_backend()
    try:
        with _CountingQuery(backend) as counter:
            with anyio.fail_after(GATE_TIMEOUT + RUN_TIMEOUT):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(heartbeat)
                    for i in range(n):
                        tg.start_soon(one, i)
                    await anyio.sleep(0.01)
                    # A blocking waiter holds the loop from its first call: it
                    # cannot wait beside the others, so its gate opens with it.
                    cpu0, wall0 = time.process_time(), time.perf_counter()
                    if method.blocking:
                        gate.release()
                        t_released = time.perf_counter()
                    go.set()
                    if not method.blocking:
                        await all_waiting.wait()
                        await anyio.sleep(0.001)
                        cpu0, wall0 = time.process_time(), time.perf_counter()
                        gate.release()
                        t_released = time.perf_counter()
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    finally:
        gate.release()
        cs.configure(poll=cs.PollPolicy())
        drain(streams)
        device.mark()
        if method.close is not None:
            for token in tokens:
                method.close(token)
        device.forget(streams)
        for s in streams:
            s.close()
    if gate.expired:
        raise RuntimeError(
            f"the gate opened by its {GATE_TIMEOUT:.0f} s timeout (setup took "
            f"{t_setup - t_gate:.2f} s, the host released it after {t_released - t_gate:.2f} s): "
            "a launch blocked, or the release was not seen, so waiters were not all in place"
        )
    ends = device.completion_ns()[np.asarray(owner)]
    wake = (resumed - ends) / 1e6
    return Row(
        method=name,
        waiters=n,
        wake_p50_ms=float(np.percentile(wake, 50)),
        wake_p99_ms=float(np.percentile(wake, 99)),
        wake_max_ms=float(wake.max()),
        lag_p99_ms=float(np.percentile(lags, 99)) * 1e3 if lags else 0.0,
        lag_max_ms=float(max(lags)) * 1e3 if lags else 0.0,
        cpu_s=cpu,
        queries_per_wait=counter.count / n,
        early=float((wake < -0.005).sum()),
        wall_s=wall,
    )


def median_row(rows: Sequence[Row]) -> tuple[Row, dict[str, float]]:
    """The per-figure median over repeats, and each figure's spread (max - min)."""
    fields = [k for k in asdict(rows[0]) if k not in ("method", "waiters")]
    med = {k: float(np.median([getattr(r, k) for r in rows])) for k in fields}
    spread = {
        k: max(getattr(r, k) for r in rows) - min(getattr(r, k) for r in rows) for k in fields
    }
    return Row(rows[0].method, rows[0].waiters, **med), spread


def case(n: int) -> str:
    """The row's case: the size, and the event sharing when there is any."""
    _, events, group = layout(n)
    if group == 1:
        return f"{n} waiters"
    return f"{n} waiters ({group} share each of {events} events)"


# ------------------------------------------------------------ numba async_done


NUMBA_METHOD = "numba async_done"
CALLBACK_METHOD = "host callback by hand (cuStreamAddCallback, as async_done does)"
CHILD_METHODS = (NUMBA_METHOD, CALLBACK_METHOD)


def numba_method() -> Method[Any]:
    """``await stream.async_done()`` of numba-cuda, on numba-owned streams (``cuda.stream()``,
    as numba users write it), wrapped for the benchmark's kernels and gates."""
    from numba import cuda

    owned: dict[int, Any] = {}

    def make_stream() -> cs.Stream:
        nb = cuda.stream()
        s = cs.Stream.wrap(nb)
        owned[s.handle] = nb
        return s

    def prepare(stream: cs.Stream) -> Any:
        return owned[stream.handle].async_done()

    async def wait(future: Any, stream: cs.Stream) -> None:
        await future

    return Method(prepare, wait, make_stream=make_stream)


def callback_method() -> Method[Any]:
    """What ``async_done`` does, written against cuda.bindings: a driver host callback
    per waiter (a ctypes function, so Python runs on the driver's thread and takes the
    GIL) resolves an asyncio future through ``loop.call_soon_threadsafe``."""
    import ctypes
    import itertools

    from cuda.bindings import driver

    pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = {}
    keys = itertools.count(1)

    def resolve(future: asyncio.Future[None], status: int) -> None:
        if future.done():
            return
        if status == 0:
            future.set_result(None)
        else:
            future.set_exception(RuntimeError(f"stream error {status}"))

    def on_done(stream: object, status: int, key: int | None) -> None:
        entry = pending.pop(int(key or 0), None)
        if entry is not None:
            entry[0].call_soon_threadsafe(resolve, entry[1], int(status))

    c_callback = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p)(on_done)
    callback = driver.CUstreamCallback(ctypes.cast(c_callback, ctypes.c_void_p).value)

    def prepare(stream: cs.Stream) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        key = next(keys)
        pending[key] = (loop, future)
        (err,) = driver.cuStreamAddCallback(driver.CUstream(stream.handle), callback, key, 0)
        if int(err) != 0:
            pending.pop(key, None)
            raise RuntimeError(f"cuStreamAddCallback failed: {err}")
        return future

    async def wait(future: asyncio.Future[None], stream: cs.Stream) -> None:
        await future

    return Method(prepare, wait, keep=c_callback)


def child_methods() -> dict[str, Callable[[], Method[Any]]]:
    """The methods measured in the subprocess, by row name."""
    return {NUMBA_METHOD: numba_method, CALLBACK_METHOD: callback_method}


def numba_child(sizes: Sequence[int], repeats: int, work: float, events_per_stream: int) -> None:
    """The subprocess: one JSON line per method and size, flushed as soon as it is measured."""
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    from benchmarks.cuda_device import CudaDevice

    cs.use_backend("cuda")
    device = CudaDevice()
    set_events_per_stream(events_per_stream)
    made: dict[str, Method[Any] | str] = {}
    for name, make in child_methods().items():
        try:
            made[name] = make()
        except Exception as exc:
            made[name] = describe(exc)
    for n in sizes:
        for name, method in made.items():
            line: dict[str, Any] = {"method": name, "waiters": n}
            if isinstance(method, str):
                line["error"] = method
            else:
                try:
                    rows = [
                        anyio.run(one_run, device, name, method, n, rep, work, backend="asyncio")
                        for rep in range(repeats)
                    ]
                    row, spread = median_row(rows)
                    line.update(row=asdict(row), spread=spread)
                except Exception as exc:
                    line["error"] = describe(exc)
            print(json.dumps(line), flush=True)


@dataclass
class ChildResult:
    """What came back from the subprocess, per (method, size): a row, or why not."""

    rows: dict[tuple[str, int], tuple[Row, dict[str, float]]]
    errors: dict[tuple[str, int], str]


def run_child(
    command: Sequence[str],
    expected: Sequence[tuple[str, int]],
    first_timeout: float,
    next_timeout: float,
    total_timeout: float,
) -> ChildResult:
    """Run ``command``, reading one JSON line per expected (method, size); a line
    that does not come within its timeout marks that one and the rest
    "deadlocked", after asking the child for its threads' stacks (SIGUSR1,
    faulthandler) and killing it."""
    result = ChildResult({}, {})
    lines: list[str] = []
    arrived = threading.Condition()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=err, text=True)

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                with arrived:
                    lines.append(line)
                    arrived.notify()
            with arrived:
                lines.append("")  # end of output
                arrived.notify()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        end = time.monotonic() + total_timeout
        pending = list(expected)
        timeout = first_timeout
        killed = ""
        while pending:
            deadline = min(time.monotonic() + timeout, end)
            with arrived:
                while not lines and time.monotonic() < deadline:
                    arrived.wait(max(0.0, deadline - time.monotonic()))
                got = lines.pop(0) if lines else None
            if got is None:
                over = time.monotonic() >= end
                killed = (
                    f"over its {total_timeout:.0f} s budget"
                    if over
                    else f"no result within {timeout:.0f} s"
                )
                break
            if got == "":
                break
            try:
                data = json.loads(got)
                key = (str(data["method"]), int(data["waiters"]))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                continue  # a stray line on stdout
            if key in pending:
                pending.remove(key)
            if "row" in data:
                result.rows[key] = (Row(**data["row"]), dict(data["spread"]))
            else:
                result.errors[key] = f"failed: {data.get('error', 'no figures')}"
            timeout = next_timeout
        if killed and proc.poll() is None:
            try:
                proc.send_signal(signal.SIGUSR1)  # stacks to stderr
                time.sleep(1.0)
            except (OSError, ValueError):
                pass
        if proc.poll() is None:
            proc.kill()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        reader.join(5)
        if proc.stdout is not None:
            proc.stdout.close()
        err.seek(0)
        tail = _stack_summary(err.read())
        for i, key in enumerate(pending):
            if killed and i == 0:
                result.errors[key] = (
                    f"deadlocked: {killed}, killed (numba-cuda #317: a driver "
                    f"callback thread waits for the GIL){tail}"
                )
            elif killed:
                result.errors[key] = (
                    f"not measured: the subprocess was killed while it measured "
                    f"{pending[0][0]} with {pending[0][1]} waiters"
                )
            else:
                result.errors[key] = f"failed: exit code {proc.returncode}{tail}"
    return result


def _stack_summary(stderr: str, limit: int = 1200) -> str:
    """The child's stderr on one line: from a faulthandler dump, each thread's
    innermost frames (where it is stuck); else the last lines (its error)."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    picked: list[str] = []
    for i, line in enumerate(lines):
        if line.startswith(("Thread 0x", "Current thread 0x")):
            picked += [line.split(" (")[0], *lines[i + 1 : i + 3]]
    text = " | ".join(picked or lines[-8:])
    return f"; stderr: {text[:limit]}" if text else ""


def child_rows(sizes: Sequence[int], repeats: int, work: float, budget: float) -> ChildResult:
    """Run the callback-based methods (numba's async_done, and the same by hand) in a
    subprocess, within ``budget`` seconds."""
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--numba-async-done",
        "--repeats",
        str(repeats),
        "--work",
        str(work),
        "--sizes",
        *map(str, sizes),
    ]
    expected = [(m, n) for n in sizes for m in CHILD_METHODS]
    return run_child(
        command,
        expected,
        first_timeout=min(budget, 40.0),
        next_timeout=min(budget, 10.0 + 4 * repeats * (1 + work)),
        total_timeout=budget,
    )


def run(
    device: Device,
    sizes: Sequence[int],
    repeats: int,
    work: float,
    *,
    on_row: Callable[[Row, dict[str, float]], None],
    on_note: Callable[[str, int, str], None],
    out_of_time: Callable[[], bool] = lambda: False,
) -> None:
    """Every in-process method at every size, ``repeats`` times, interleaved.

    Calls ``on_row(row, spread)`` per method and size, or ``on_note(method,
    size, note)`` for one that failed or was cut short because ``out_of_time()``
    said so.
    """
    table = methods()
    for n in sizes:
        per: dict[str, list[Row]] = {m: [] for m in table}
        failed: dict[str, str] = {}
        for m, method in table.items():
            if method.max_waiters is not None and n > method.max_waiters[0]:
                most, why = method.max_waiters
                failed[m] = f"not measured above {most} waiters: {why}"
        for rep in range(repeats):
            for m in table:
                if m in failed:
                    continue
                if out_of_time():
                    failed[m] = "skipped: the section's time budget was spent"
                    continue
                try:
                    per[m].append(anyio.run(one_run, device, m, table[m], n, rep, work))
                except Exception as exc:
                    failed[m] = f"failed: {describe(exc)}"
        for m in table:
            if per[m]:
                on_row(*median_row(per[m]))
            else:
                on_note(m, n, failed.get(m, "no run"))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 100, 1000, 10000])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--work", type=float, default=0.4, help="seconds of kernels per stream")
    parser.add_argument(
        "--events-per-stream",
        type=int,
        default=MAX_KERNELS // STREAMS,
        help="pending events a gated stream may hold (see set_events_per_stream)",
    )
    parser.add_argument(
        "--numba-async-done",
        action="store_true",
        help="(internal) measure numba's async_done, one JSON line per size",
    )
    args = parser.parse_args(argv)
    if args.numba_async_done:
        numba_child(args.sizes, args.repeats, args.work, args.events_per_stream)
        return
    from benchmarks.cuda_device import CudaDevice

    cs.use_backend("cuda")
    device = CudaDevice()
    set_events_per_stream(usable_events_per_stream(device.pending_record_cap()))
    run(
        device,
        args.sizes,
        args.repeats,
        args.work,
        on_row=lambda row, _: print(row),
        on_note=lambda method, n, note: print(f"{method}, {n} waiters: {note}"),
    )


if __name__ == "__main__":
    main()
