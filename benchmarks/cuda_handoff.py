"""Host overhead of a handoff on a GPU, beside driver-call floors and the peers' own handoff.

Microseconds per call (the mean of ``n`` calls; the row's figure is the median
of the repeats). Every row of a case is measured in the same run, on the same
producer object, with its work already complete, so a figure is host overhead:

- parse: ``cs.read_interface(obj)`` of a v3 producer (a CuPy array: its CAI
  names its stream), of a v2 producer (a PyTorch tensor) and of a tracked array;
  floor: reading that object's ``__cuda_array_interface__`` alone;
- export with 0, 1, 3 and 8 pending streams (held pending by gate kernels, so
  nothing completes and nothing is elided); floor: a hand-written
  ``cudaEventRecord`` + ``cudaStreamWaitEvent`` per pending stream, through
  cuda.bindings, on pre-made events;
- consume, host mode (``cs.consume_blocking(obj)``: an event recorded on the
  producer's stream, then polled), beside the peers that take the same object:
  ``cupy.asarray(obj)`` and ``numba.cuda.as_cuda_array(obj)`` (both synchronize
  the producer's stream: cudaStreamSynchronize), ``torch.as_tensor(obj,
  device="cuda")`` (a v2 consumer: it ignores the stream, so it waits for
  nothing and is not race-free); floors: ``cudaEventRecord`` + ``cudaEventQuery``,
  ``cudaStreamSynchronize``, and reading the interface;
- consume, enqueue mode (``cs.consume_blocking(obj, stream=s)``: s waits for
  the producer on the GPU), beside cuda.core's
  ``StridedMemoryView.from_cuda_array_interface(obj, stream_ptr=s)`` (the same
  record + wait); floor: ``cudaEventRecord`` + ``cudaStreamWaitEvent``;
- consume of a tracked array whose work is complete; floor: reading the interface.

The object handed over is a minimal CAI v3 producer building a fresh dict on
each access (as CuPy does) over device memory, with ``stream`` set to a stream
of its own. A peer that cannot be imported or fails is a row saying so.
On the simulated stand-in the floors are the backend's own calls and the GPU
peers are absent: those rows exercise the code, not the GPU.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import cai_streams as cs
from benchmarks.cuda_device import drain
from benchmarks.report import describe

#: the peers' own handoff of the same object: method name -> "host" or "enqueue" mode
PEERS = {
    "cupy.asarray(obj) (synchronizes the stream)": "host",
    "numba.cuda.as_cuda_array(obj) (synchronizes the stream)": "host",
    "torch.as_tensor(obj, device='cuda') (ignores the stream)": "host",
    "cuda.core StridedMemoryView.from_cuda_array_interface(obj, stream_ptr=s)": "enqueue",
}


class Producer:
    """CAI v3 with a stream, a fresh dict per access (as CuPy builds one)."""

    def __init__(self, ptr: int, elements: int, stream: int | None, keep: object) -> None:
        self.ptr, self.elements, self.stream, self.keep = ptr, elements, stream, keep

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {
            "shape": (self.elements,),
            "typestr": "<f4",
            "data": (self.ptr, False),
            "strides": None,
            "version": 3,
            "stream": self.stream,
        }


def per_call_us(fn: Callable[[], object], n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


@dataclass
class Rows:
    """(case, method) -> per-repeat figures in µs, or a note when it could not run."""

    figures: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    notes: dict[tuple[str, str], str] = field(default_factory=dict)
    order: list[tuple[str, str]] = field(default_factory=list)

    def add(self, case: str, method: str, figures: list[float] | None, note: str = "") -> None:
        key = (case, method)
        if key not in self.order:
            self.order.append(key)
        if figures is not None:
            self.figures[key] = figures
        else:
            self.notes[key] = note

    def measure(
        self,
        case: str,
        method: str,
        fn: Callable[[], object] | None,
        n: int,
        repeats: int,
        why_not: str = "",
    ) -> None:
        """Time ``fn`` (after one checked warm-up call), or note why it cannot run."""
        if fn is None:
            self.add(case, method, None, why_not or "unavailable")
            return
        try:
            fn()
            self.add(case, method, [per_call_us(fn, n) for _ in range(repeats)])
        except Exception as exc:
            self.add(case, method, None, f"failed: {describe(exc)}")


class _CudaFloors:
    """Hand-written driver calls through cuda.bindings (one pre-made event)."""

    def __init__(self) -> None:
        from cuda.bindings import runtime as rt

        self.rt = rt
        err, self.event = rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming)
        if int(err) != 0:
            raise RuntimeError(f"cudaEventCreateWithFlags: {err}")
        self.names = {
            "record_wait": "floor: cudaEventRecord + cudaStreamWaitEvent",
            "record_query": "floor: cudaEventRecord + cudaEventQuery",
            "sync": "floor: cudaStreamSynchronize",
        }

    def stream(self, handle: int) -> Any:
        return self.rt.cudaStream_t(handle)

    def record_wait(self, producer: Any, consumer: Any) -> Callable[[], object]:
        rt, ev = self.rt, self.event

        def floor() -> None:
            rt.cudaEventRecord(ev, producer)
            rt.cudaStreamWaitEvent(consumer, ev, 0)

        return self._checked(floor, lambda: rt.cudaEventQuery(ev))

    def record_query(self, producer: Any) -> Callable[[], object]:
        rt, ev = self.rt, self.event

        def floor() -> None:
            rt.cudaEventRecord(ev, producer)
            rt.cudaEventQuery(ev)

        return self._checked(floor, lambda: rt.cudaEventQuery(ev))

    def sync(self, producer: Any) -> Callable[[], object]:
        rt = self.rt
        return self._checked(
            lambda: rt.cudaStreamSynchronize(producer), lambda: rt.cudaStreamSynchronize(producer)
        )

    def _checked(self, fn: Callable[[], object], check: Callable[[], Any]) -> Callable[[], object]:
        fn()
        code = int(check()[0])
        if code not in (0, 600):  # success, not ready
            raise RuntimeError(f"a floor's driver call failed with code {code}")
        return fn

    def events(self, k: int) -> list[Any]:
        return [
            self.rt.cudaEventCreateWithFlags(self.rt.cudaEventDisableTiming)[1] for _ in range(k)
        ]

    def record_wait_many(self, pairs: Sequence[tuple[Any, Any]], consumer: Any) -> None:
        rt = self.rt
        for event, producer in pairs:
            rt.cudaEventRecord(event, producer)
            rt.cudaStreamWaitEvent(consumer, event, 0)

    def destroy(self, events: Sequence[Any]) -> None:
        for e in events:
            self.rt.cudaEventDestroy(e)


class _BackendFloors:
    """The stand-in's floors: the backend's own calls (no driver here)."""

    def __init__(self) -> None:
        self.backend = cs.current_backend()
        self.event = self.backend.create_event()
        self.names = {
            "record_wait": "floor: record + stream wait (backend calls)",
            "record_query": "floor: record + query (backend calls)",
            "sync": "floor: stream synchronize (backend call)",
        }

    def stream(self, handle: int) -> int:
        return handle

    def record_wait(self, producer: int, consumer: int) -> Callable[[], object]:
        b, ev = self.backend, self.event
        return lambda: (b.record(ev, producer), b.stream_wait_event(consumer, ev))

    def record_query(self, producer: int) -> Callable[[], object]:
        b, ev = self.backend, self.event
        return lambda: (b.record(ev, producer), b.query(ev))

    def sync(self, producer: int) -> Callable[[], object]:
        return lambda: self.backend.synchronize_stream(producer)

    def events(self, k: int) -> list[Any]:
        return [self.backend.create_event() for _ in range(k)]

    def record_wait_many(self, pairs: Sequence[tuple[Any, Any]], consumer: Any) -> None:
        b = self.backend
        for event, producer in pairs:
            b.record(event, producer)
            b.stream_wait_event(consumer, event)

    def destroy(self, events: Sequence[Any]) -> None:
        for e in events:
            self.backend.destroy_event(e)


def _peers(
    device: Any, prod: Producer, mine: cs.Stream
) -> dict[str, tuple[str, Callable[[], object] | None, str]]:
    """method -> (case kind, call, why not): each peer imported and built on its own."""
    peers: dict[str, tuple[str, Callable[[], object] | None, str]] = {}
    if device.name != "cuda":
        why = f"a GPU peer: not measured on the {device.name}"
        return {name: (kind, None, why) for name, kind in PEERS.items()}

    def build(name: str, kind: str, make: Callable[[], Callable[[], object]]) -> None:
        try:
            peers[name] = (kind, make(), "")
        except Exception as exc:
            peers[name] = (kind, None, f"unavailable: {type(exc).__name__}: {str(exc)[:200]}")

    def cupy_peer() -> Callable[[], object]:
        import cupy

        return lambda: cupy.asarray(prod)

    def numba_peer() -> Callable[[], object]:
        from numba import cuda

        return lambda: cuda.as_cuda_array(prod)

    def torch_peer() -> Callable[[], object]:
        import torch

        return lambda: torch.as_tensor(prod, device="cuda")

    def core_peer() -> Callable[[], object]:
        from cuda.core.utils import StridedMemoryView

        handle = mine.handle
        make = getattr(StridedMemoryView, "from_cuda_array_interface", None)
        if make is not None:
            return lambda: make(prod, stream_ptr=handle)

        def construct() -> object:  # older cuda.core: the constructor
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                return StridedMemoryView(prod, stream_ptr=handle)

        return construct

    cupy_name, numba_name, torch_name, core_name = PEERS
    build(cupy_name, "host", cupy_peer)
    build(numba_name, "host", numba_peer)
    build(torch_name, "host", torch_peer)
    build(core_name, "enqueue", core_peer)
    return peers


def _array(device: Any, elements: int) -> tuple[int, object]:
    """(pointer, owner) of ``elements`` float32 of device memory, work complete."""
    if device.name == "cuda":
        owner = device.cp.zeros(elements, device.cp.float32)
        device.cp.cuda.runtime.deviceSynchronize()
        return int(owner.data.ptr), owner
    from cai_streams import sim

    arr = sim.empty(elements)
    return arr.ptr, arr


def _v2_producer(device: Any, elements: int) -> tuple[object | None, str]:
    """A PyTorch tensor (a v2 CAI producer), or why there is none."""
    if device.name != "cuda":
        return None, f"a GPU peer: not measured on the {device.name}"
    try:
        import torch

        tensor = torch.zeros(elements, device="cuda")
        torch.cuda.synchronize()
        return tensor, ""
    except Exception as exc:
        return None, f"unavailable: {type(exc).__name__}: {str(exc)[:200]}"


def measure(
    device: Any,
    *,
    n: int,
    repeats: int,
    export_iterations: int,
    out_of_time: Callable[[], bool] = lambda: False,
) -> Rows:
    """Every row of the module docstring; cut short (with notes) when out of time."""
    rows = Rows()
    floors: Any = _CudaFloors() if device.name == "cuda" else _BackendFloors()
    producer_stream, mine = cs.Stream(), cs.Stream()
    ptr, owner = _array(device, 1024)
    prod = Producer(ptr, 1024, producer_stream.handle, owner)
    p_handle, m_handle = floors.stream(producer_stream.handle), floors.stream(mine.handle)
    try:
        # parse
        if device.name == "cuda":
            v3: Any = owner
            with device.cp.cuda.Stream.from_external(producer_stream):
                rows.measure(
                    "parse: v3 producer (a CuPy array)",
                    "cai_streams",
                    lambda: cs.read_interface(v3),
                    n,
                    repeats,
                )
                rows.measure(
                    "parse: v3 producer (a CuPy array)",
                    "floor: read the interface",
                    lambda: v3.__cuda_array_interface__,
                    n,
                    repeats,
                )
        else:
            v3 = prod
            rows.measure(
                "parse: v3 producer", "cai_streams", lambda: cs.read_interface(v3), n, repeats
            )
            rows.measure(
                "parse: v3 producer",
                "floor: read the interface",
                lambda: prod.__cuda_array_interface__,
                n,
                repeats,
            )
        v2: Any
        v2, why = _v2_producer(device, 1024)
        case = "parse: v2 producer (a PyTorch tensor)"
        if v2 is None:
            rows.measure(case, "cai_streams", None, n, repeats, why)
        else:
            rows.measure(case, "cai_streams", lambda: cs.read_interface(v2), n, repeats)
            rows.measure(
                case, "floor: read the interface", lambda: v2.__cuda_array_interface__, n, repeats
            )
        tracked = cs.track(Producer(ptr, 1024, None, owner))
        rows.measure(
            "parse: tracked array", "cai_streams", lambda: cs.read_interface(tracked), n, repeats
        )
        rows.measure(
            "parse: tracked array",
            "floor: read the interface",
            lambda: prod.__cuda_array_interface__,
            n,
            repeats,
        )

        # consume, host mode
        peers = _peers(device, prod, mine)
        host = "consume, host mode: v3 producer with a stream, work complete"
        enqueue = "consume, enqueue mode (stream=s): v3 producer with a stream"
        rows.measure(
            host,
            "cai_streams consume_blocking(obj)",
            lambda: cs.consume_blocking(prod, timeout=10),
            n,
            repeats,
        )
        for name, (kind, fn, why_not) in peers.items():
            if kind == "host":
                rows.measure(host, name, fn, n, repeats, why_not)
        rows.measure(host, floors.names["record_query"], floors.record_query(p_handle), n, repeats)
        rows.measure(host, floors.names["sync"], floors.sync(p_handle), n, repeats)
        rows.measure(
            host, "floor: read the interface", lambda: prod.__cuda_array_interface__, n, repeats
        )
        if out_of_time():
            rows.add(enqueue, "all", None, "skipped: the section's time budget was spent")
            return rows
        # consume, enqueue mode
        rows.measure(
            enqueue,
            "cai_streams consume_blocking(obj, stream=s)",
            lambda: cs.consume_blocking(prod, stream=mine, timeout=10),
            n,
            repeats,
        )
        for name, (kind, fn, why_not) in peers.items():
            if kind == "enqueue":
                rows.measure(enqueue, name, fn, n, repeats, why_not)
        rows.measure(
            enqueue, floors.names["record_wait"], floors.record_wait(p_handle, m_handle), n, repeats
        )
        drain([producer_stream, mine])
        # consume, tracked, complete
        done = cs.track(Producer(ptr, 1024, None, owner))
        case = "consume, host mode: tracked array, work complete"
        rows.measure(
            case,
            "cai_streams consume_blocking(t)",
            lambda: cs.consume_blocking(done, timeout=10),
            n,
            repeats,
        )
        rows.measure(
            case, "floor: read the interface", lambda: prod.__cuda_array_interface__, n, repeats
        )
        # export with k pending streams
        for k in (0, 1, 3, 8):
            case = f"export, {k} pending streams"
            if out_of_time():
                rows.add(case, "cai_streams", None, "skipped: the section's time budget was spent")
                continue
            try:
                runs = [
                    _export(device, floors, ptr, owner, k, export_iterations)
                    for _ in range(repeats)
                ]
            except Exception as exc:
                rows.add(case, "cai_streams", None, f"failed: {describe(exc)}")
                continue
            rows.add(case, "cai_streams", [r[0] for r in runs])
            rows.add(case, floors.names["record_wait"] + " per stream", [r[1] for r in runs])
        return rows
    finally:
        drain([producer_stream, mine])
        producer_stream.close()
        mine.close()


CHUNK = 50  # export cycles per gate: keeps the queued records and waits well under the
#             launch queue's depth


def _export(
    device: Any, floors: Any, ptr: int, owner: object, k: int, iterations: int
) -> tuple[float, float]:
    """µs per export of a tracked array with ``k`` streams' writes pending, and
    per hand-written join of the same streams; pending work is held by gates."""
    streams = [cs.Stream() for _ in range(k)]
    x, y = cs.Stream(), cs.Stream()
    t = cs.track(Producer(ptr, 1024, None, owner), stream=x)
    events = floors.events(k)
    pairs = [(e, floors.stream(s.handle)) for e, s in zip(events, streams, strict=True)]
    y_handle = floors.stream(y.handle)
    export_s = floor_s = 0.0
    done = 0
    try:
        while done < iterations:
            gate = device.gate(streams, 20.0)
            try:
                for _ in range(min(CHUNK, iterations - done)):
                    for s in streams:
                        with t.writing(s, disjoint=True):
                            pass
                    start = time.perf_counter()
                    t.export()
                    export_s += time.perf_counter() - start
                    start = time.perf_counter()
                    floors.record_wait_many(pairs, y_handle)
                    floor_s += time.perf_counter() - start
                    done += 1
            finally:
                gate.release()
                drain([*streams, x, y])
            if gate.expired:
                raise RuntimeError("a gate opened by its timeout: the writes did not stay pending")
    finally:
        floors.destroy(events)
        device.forget(streams)
        for s in (*streams, x, y):
            s.close()
    return export_s / iterations * 1e6, floor_s / iterations * 1e6


def summary(rows: Rows) -> list[tuple[str, str, list[float] | None, str]]:
    """(case, method, figures or None, note) in measurement order."""
    return [(c, m, rows.figures.get((c, m)), rows.notes.get((c, m), "")) for c, m in rows.order]
