"""One stream identity: the key of every piece of per-stream state.

A bare handle does not name a stream. CUDA hands a destroyed stream's handle to
the next stream created, handle 2 (the per-thread default stream) is a
different stream in each host thread, and a handle means nothing without its
backend and device. :class:`StreamId` carries all of it, and the scheduler, the
event marks, the poller's queues, the sanitizer and the tracer all key their
state by it:

* ``backend``: the backend object (compared by identity);
* ``device``: the device ordinal, from the backend's ``current_device()``;
* ``handle``: the integer that goes in a CAI ``stream`` entry;
* ``generation``: which stream of that handle. A stream made by
  :class:`~cai_streams.Stream` gets a fresh generation and gives it up when it
  is closed, so a later stream with the same handle is another stream; a handle
  this library never made has generation 0; a negative one keys a record whose
  place among its stream's others is not known (``_events.lone``);
* ``thread``: for handle 2, the host thread (a serial number, never reused as
  thread idents are); 0 otherwise.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Iterable
from typing import Protocol

from ._backend import LEGACY_DEFAULT_STREAM, PER_THREAD_DEFAULT_STREAM, Backend

__all__ = [
    "LEGACY_DEFAULT_STREAM",
    "PER_THREAD_DEFAULT_STREAM",
    "Lifetime",
    "StreamId",
    "backend_serial",
    "is_open",
    "name_stream",
    "stream_id_now",
    "thread_name",
    "thread_serial",
]


class StreamId:
    """The identity of one stream (see the module docstring). Immutable, hashable."""

    __slots__ = ("_hash", "backend", "device", "generation", "handle", "thread")

    backend: Backend
    device: int
    handle: int
    generation: int
    thread: int
    _hash: int

    def __init__(
        self, backend: Backend, device: int, handle: int, generation: int, thread: int
    ) -> None:
        object.__setattr__(self, "backend", backend)
        object.__setattr__(self, "device", device)
        object.__setattr__(self, "handle", handle)
        object.__setattr__(self, "generation", generation)
        object.__setattr__(self, "thread", thread)
        object.__setattr__(self, "_hash", hash((id(backend), device, handle, generation, thread)))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("StreamId is immutable")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StreamId):
            return NotImplemented
        return (
            self._hash == other._hash
            and self.backend is other.backend
            and self.handle == other.handle
            and self.device == other.device
            and self.generation == other.generation
            and self.thread == other.thread
        )

    def __hash__(self) -> int:
        return self._hash

    def describe(self) -> str:
        """How messages and traces name this stream."""
        if self.handle == LEGACY_DEFAULT_STREAM:
            return "stream 0x1 (legacy default)"
        if self.handle == PER_THREAD_DEFAULT_STREAM:
            return f"stream 0x2 (per-thread default of thread {thread_name(self.thread)})"
        return f"{_roles.get(self.generation, 'stream')} {self.handle:#x}"  # (only open ones)

    def __repr__(self) -> str:
        return (
            f"StreamId({self.backend.name}#{backend_serial(self.backend)}, device {self.device}, "
            f"{self.handle:#x}, generation {self.generation}, thread {self.thread})"
        )


# -- host threads ---------------------------------------------------------------

_local = threading.local()
_serials = itertools.count(1)
_names: dict[int, str] = {}


def thread_serial() -> int:
    """This host thread's serial number (unlike ``threading.get_ident()``, never
    given to another thread after this one ends)."""
    serial: int | None = getattr(_local, "serial", None)
    if serial is None:
        serial = _local.serial = next(_serials)
        if len(_names) > 4096:  # names are only for messages: keep the newest
            for old in list(_names)[:1024]:
                _names.pop(old, None)
        _names[serial] = threading.current_thread().name
    return serial


def thread_name(serial: int) -> str:
    return _names.get(serial, f"#{serial}")


# -- backends -------------------------------------------------------------------

_backend_serials: weakref.WeakKeyDictionary[Backend, int] = weakref.WeakKeyDictionary()
_backend_counter = itertools.count(1)
_lock = threading.Lock()


#: the backend asked for last and its serial: every handoff asks, for one backend
_recent: tuple[weakref.ref[Backend], int] | None = None


def backend_serial(backend: Backend) -> int:
    """A number that tells backend instances apart in messages."""
    global _recent
    recent = _recent  # one read: another thread may replace it
    if recent is not None and recent[0]() is backend:
        return recent[1]
    found = _backend_serials.get(backend)
    if found is None:
        with _lock:
            found = _backend_serials.get(backend)
            if found is None:
                found = _backend_serials[backend] = next(_backend_counter)
    _recent = (weakref.ref(backend), found)
    return found


# -- owned streams: generations and what must happen before they close ------------


class ClosingListener(Protocol):
    def stream_closing(self) -> None:
        """The stream is about to be destroyed: record what must be recorded on it now."""


_generations = itertools.count(1)


class Lifetime:
    """One stream made by this library, from its creation to its close.

    Work that is still to be recorded on the stream (a consumer's read whose
    end is not known yet) registers here, and is recorded just before the
    stream is destroyed, so closing a consumer's stream never loses it.
    """

    __slots__ = (
        "_claimed",
        "_closing",
        "_listeners",
        "_lock",
        "closed",
        "device",
        "generation",
        "ident",
        "key",
    )

    def __init__(self, key: tuple[int, int], device: int) -> None:
        self.key = key
        self.device = device
        self.generation = next(_generations)
        #: its StreamId, made once (a handoff asks for it every time)
        self.ident: StreamId | None = None
        self.closed = False
        self._closing = False
        #: a close has begun (in some thread): it alone tells the listeners and
        #: destroys the stream
        self._claimed = False
        self._lock = threading.Lock()
        self._listeners: set[ClosingListener] = set()

    def listen(self, listener: ClosingListener) -> bool:
        """Call ``listener`` before the stream closes; False if it already has."""
        with self._lock:
            if self._closing:
                return False
            self._listeners.add(listener)
            return True

    def forget(self, listener: ClosingListener) -> None:
        with self._lock:
            self._listeners.discard(listener)

    def claim_close(self) -> bool:
        """Whether the caller is the one to close the stream: the first to ask
        (two threads closing one stream at once: the second returns at once,
        and must not destroy it, nor its handle's next stream, while the first
        records what listens). Bookkeeping only."""
        with self._lock:
            if self._claimed:
                return False
            self._claimed = True
            return True

    def closing(self) -> Iterable[ClosingListener]:
        """The stream is about to close: no new listener; hand over the ones
        there are (each called once, while the stream still exists)."""
        fresh: set[ClosingListener] = set()  # (made first: nothing allocates under the lock,
        with self._lock:  # so no garbage collection, whose finalizers may close this stream)
            self._closing = True
            listeners, self._listeners = self._listeners, fresh
        return listeners

    @property
    def ending(self) -> bool:
        """Its close has begun (the listeners were handed over) and the stream
        still exists: they record on it now."""
        return self._closing and not self.closed

    def close(self) -> None:
        """The stream is closed: its handle no longer names it."""
        self._closing = True
        self.closed = True
        with _lock:
            _open_generations.discard(self.generation)
            _roles.pop(self.generation, None)
            if _owned.get(self.key) is self:
                del _owned[self.key]


# A live stream's handle is unique in the process (CUDA's are addresses), so
# owned streams are keyed by backend and handle; each knows its device.
_owned: dict[tuple[int, int], Lifetime] = {}
#: the generations of the streams in ``_owned``: whether a StreamId still
#: names an open stream is one set lookup (every capture check asks)
_open_generations: set[int] = set()


def new_lifetime(backend: Backend, device: int, handle: int) -> Lifetime:
    """A stream was just created with ``handle`` on ``device``: it is a new
    stream, whatever stream had that handle before."""
    key = (backend_serial(backend), handle)
    lifetime = Lifetime(key, device)
    with _lock:
        _owned[key] = lifetime
        _open_generations.add(lifetime.generation)
    return lifetime


#: what the library's own streams are, by generation (while open): messages
#: name them so ("cai_streams' export stream 0x..."), not by a handle alone
_roles: dict[int, str] = {}


def name_stream(key: StreamId, role: str) -> None:
    """Name, in messages, a stream this library made (and still has open) by
    ``role``, a noun phrase ending in "stream". Does not block."""
    with _lock:
        if key.generation in _open_generations:
            _roles[key.generation] = role


def is_open(key: StreamId) -> bool:
    """Whether the stream this library made that ``key`` names (its
    generation is not 0) is still open: False once it was closed, whatever
    stream its handle names now. Does not block."""
    return key.generation in _open_generations


def order_known(key: StreamId) -> bool:
    """Whether records on ``key``'s stream complete in the order the library
    made them: a stream this library made (its generation tells it from a
    later stream given its handle), or a default stream (1, 2). Another
    library's handle may be destroyed and handed to a new stream behind the
    library's back: then two streams share one key, and a record found
    complete says nothing of an earlier one. Does not block."""
    return key.generation != 0 or key.handle <= PER_THREAD_DEFAULT_STREAM


def lifetime_of(backend: Backend, handle: int) -> Lifetime | None:
    """The open stream this library made with ``handle``, if there is one."""
    return _owned.get((backend_serial(backend), handle))


def stream_id_now(backend: Backend, handle: int) -> StreamId:
    """The identity ``handle`` has for work the calling thread enqueues now."""
    if handle == PER_THREAD_DEFAULT_STREAM:
        return StreamId(backend, backend.current_device(), handle, 0, thread_serial())
    if handle == LEGACY_DEFAULT_STREAM:
        return StreamId(backend, backend.current_device(), handle, 0, 0)
    lifetime = _owned.get((backend_serial(backend), handle))
    if lifetime is None:
        return StreamId(backend, backend.stream_device(handle), handle, 0, 0)
    ident = lifetime.ident
    if ident is None:
        ident = lifetime.ident = StreamId(backend, lifetime.device, handle, lifetime.generation, 0)
    return ident
