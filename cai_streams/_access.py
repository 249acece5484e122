"""One access: the pending work of one stream on one buffer, in explicit states.

An :class:`Access` is a read or a write, in one of three states:

* ``LAZY``: a consumer's read whose end is not known yet (work it will enqueue
  after the handoff). No event yet; one is recorded when something must wait
  for it: the next conflicting access, or the consumer's stream closing. Only
  streams whose life the library sees are lazy (see ``Stream._records_later``);
  on any other an access is recorded at the handoff.
* ``RECORDED``: an event marks its end. Waiters on the host pin the event.
* ``RELEASED``: forgotten. Its event returns to the pool once the last pin
  is gone, never before, so a waiter never reads an event reused elsewhere.

Transitions go only forward (``LAZY -> RECORDED -> RELEASED`` or ``LAZY ->
RELEASED``); a transition from the wrong state raises, and releasing twice is
a no-op.
"""

from __future__ import annotations

import enum
import threading
from contextlib import AbstractContextManager
from typing import Protocol

from . import _capture, _capture_guard
from ._backend import LEGACY_DEFAULT_STREAM, PER_THREAD_DEFAULT_STREAM, Backend
from ._device import OnDevice
from ._errors import CaptureError, DeviceFaultError
from ._events import EventPool, Mark, pool_for, record
from ._identity import StreamId, thread_serial
from ._stream import Stream, _KeptStream

__all__ = ["Access", "AccessState", "Counters", "Kind", "owned_stream_of"]


class Kind(enum.Enum):
    READ = "read"
    WRITE = "write"


class AccessState(enum.Enum):
    LAZY = "lazy"
    RECORDED = "recorded"
    RELEASED = "released"


class Counters:
    """Process-wide scheduler counters (read through ``cs.stats()``)."""

    __slots__ = ("_lock", "elided", "exports", "joins", "pinned", "waits")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.joins = self.waits = self.elided = self.exports = self.pinned = 0

    def add(
        self, *, joins: int = 0, waits: int = 0, elided: int = 0, exports: int = 0, pinned: int = 0
    ) -> None:
        with self._lock:
            self.joins += joins
            self.waits += waits
            self.elided += elided
            self.exports += exports
            self.pinned += pinned


class Buffer(Protocol):
    """What an access needs of the buffer state that holds it (``PendingWork``)."""

    backend: Backend
    counters: Counters
    group: int

    def _locked(self) -> AbstractContextManager[None]: ...

    def unfenced_on(self, key: StreamId) -> bool: ...

    def _drop(self, access: Access) -> None: ...


def owned_stream_of(stream: Stream) -> Stream | None:
    """The :class:`Stream` the user owns that ``stream`` is, or that a chain
    of borrowed wrappers of it keeps (``Stream.wrap(s)``); None for a bare
    handle and for another library's object."""
    held: object = stream
    while isinstance(held, Stream):
        if held._owned:
            return held
        held = held._keepalive
    return None


class Access:
    """The work of one stream on one buffer (see the module docstring).

    Every method is called with the owning :class:`PendingWork`'s lock held,
    except :meth:`stream_closing`, which takes it.
    """

    __slots__ = (
        "__weakref__",
        "disjoint",
        "event",
        "group",
        "keeps",
        "key",
        "kind",
        "mark",
        "pins",
        "pool",
        "serial",
        "state",
        "stream",
        "waited_by",
        "work",
    )

    def __init__(
        self, work: Buffer, kind: Kind, stream: Stream, key: StreamId, disjoint: bool
    ) -> None:
        self.work = work
        self.kind = kind
        # kept alive: a lazy access records on it, an event's keepalive (a
        # borrowed wrapper's copy: the user's close of it only forgets it)
        self.stream = stream._kept()
        self.key = key
        self.disjoint = disjoint
        self.group = work.group  # disjoint writes of one group are not ordered among them
        self.state = AccessState.LAZY
        self.event = 0
        self.mark: Mark | None = None
        self.pins = 0
        self.pool: EventPool | None = None  # the pool of the event's device, once recorded
        self.waited_by: set[StreamId] = set()
        #: a lazy read's: the newest capture's serial when it was made (``_capture``)
        self.serial = 0
        #: a lazy read that keeps its stream alive while open (see :meth:`lazy`)
        self.keeps = False

    @property
    def captured(self) -> bool:
        """Recorded in a graph capture: it stands for work that runs when the
        graph is launched, not in its stream's order (``Mark.captured``)."""
        mark = self.mark
        return mark is not None and mark.captured

    @property
    def unfenced(self) -> bool:
        """A record made in a capture, on a stream where a block of this buffer
        left ordinary work unrecorded when that stream last captured
        (``PendingWork._fence``): it stands for that work too, and nothing can
        wait for it (``_capture_guard``) until the work is recorded. Any such
        record counts, also one that replaced the block's own in the list."""
        mark = self.mark
        return mark is not None and mark.captured and self.work.unfenced_on(self.key)

    @classmethod
    def recorded(
        cls, work: Buffer, kind: Kind, stream: Stream, key: StreamId, disjoint: bool = False
    ) -> Access:
        """The work enqueued on ``stream`` so far (an event recorded now)."""
        access = cls(work, kind, stream, key, disjoint)
        access._record()
        return access

    @classmethod
    def lazy(cls, work: Buffer, stream: Stream, key: StreamId, *, keep: bool = False) -> Access:
        """A consumer's read on ``stream``: recorded when something must wait for
        it, if the stream allows that; else recorded now. ``keep``: keep an
        owned ``stream`` alive while the read is open (an export's, whose
        consumer was handed only the handle)."""
        access = cls(work, Kind.READ, stream, key, False)
        if keep:
            access.keep_stream(stream)
        elif stream._owned:
            # Not the user's stream itself: dropped, it is collected and its
            # close records this read (a buffer read on ever-new streams,
            # never written, would keep every one of them alive otherwise).
            access.stream = stream._same_stream(None, _KeptStream)
        access.serial = _capture.serial_now()
        lifetime = stream._lifetime
        if not stream._records_later() or (lifetime is not None and not lifetime.listen(access)):
            access._record()
        return access

    def keep_stream(self, stream: Stream) -> None:
        """Keep ``stream`` alive while this read is open: the library's own
        stream it stands for (:func:`owned_stream_of`), else what a borrowed
        wrapper keeps (another library's object, which may hold it). A bare
        handle keeps nothing, and the read is not marked as keeping."""
        owner = owned_stream_of(stream)
        if owner is not None:
            self.stream = owner
        elif stream._lifetime is not None and not isinstance(stream._keepalive, (int, type(None))):
            self.stream = stream._same_stream(stream._keepalive, _KeptStream)
        else:
            return
        self.keeps = True

    def _record(self, on: StreamId | None = None) -> None:
        self.stream._open_for_records()  # a closed stream refuses
        key = self.key if on is None else on
        pool = pool_for(self.work.backend, key.device)  # an event of the stream's device
        event = pool.acquire()
        try:  # (handles 1 and 2 name the current device's streams: key's, inside)
            with OnDevice(self.work.backend, key.device, key.handle):
                self.mark = mark = record(self.work.backend, event, key)
        except BaseException:
            pool.release(event)
            raise
        self.event = event
        self.pool = pool
        self.state = AccessState.RECORDED
        if mark.captured:
            _capture.note_captured(self.work, self.kind is Kind.WRITE, mark.key)

    def materialize(self) -> None:
        """LAZY -> RECORDED: the consumer's work enqueued so far is what it covers."""
        if self.state is not AccessState.LAZY:
            raise RuntimeError(f"materialize() of a {self.state.value} access")
        key = self.key
        if key.handle == PER_THREAD_DEFAULT_STREAM and key.thread != thread_serial():
            # Another thread's per-thread stream cannot be named from here, but
            # it is a blocking stream: work on the legacy stream waits for all
            # work enqueued on it so far. An event there covers the read.
            try:
                self._record(StreamId(key.backend, key.device, LEGACY_DEFAULT_STREAM, 0, 0))
            except CaptureError as exc:  # (a blocking stream captures: say whose read)
                raise CaptureError(
                    f"a consumer's read of this array, open on the per-thread default "
                    f"stream (2) of another thread ({key.describe()}), can be waited for "
                    f"only through the legacy default stream (1), which cannot be used "
                    f"while a blocking stream captures a graph: wait until that capture "
                    "ends, or let the consumer use a cs.Stream()"
                ) from exc
        else:
            self._record()
        if not self.captured:  # (a capture of its stream that ended since it was made
            # has the consumer's captured reads in its graph: see _capture.ended_in)
            _capture.ended_in(self.work, False, self.key, self.serial)
        # Only now: while it listens, the stream's owner closing it in another
        # thread waits for this buffer's lock (held here) before destroying it.
        self._forget_lifetime()

    def is_complete(self) -> bool:
        """Whether a recorded access's work is done (raises if it failed); never
        invalidates a graph capture (see ``_capture_guard.event_complete``)."""
        return self.state is AccessState.RECORDED and _capture_guard.event_complete(
            self.work.backend, self.event, self.mark
        )

    def pin(self) -> None:
        if self.state is not AccessState.RECORDED:
            raise RuntimeError(f"pin() of a {self.state.value} access")
        self.pins += 1
        self.work.counters.add(pinned=1)

    def unpin(self) -> None:
        self.pins -= 1
        self.work.counters.add(pinned=-1)
        if self.pins == 0 and self.state is AccessState.RELEASED:
            self._give_back()

    def release(self) -> None:
        """-> RELEASED. Safe twice. A pinned event goes back at the last unpin."""
        state = self.state
        self.state = AccessState.RELEASED
        if state is AccessState.LAZY:
            self._forget_lifetime()
        elif state is AccessState.RECORDED and self.pins == 0:
            self._give_back()

    def record_again(self, on: StreamId) -> None:
        """A recorded, unpinned access takes an event recorded now on the
        stream ``on`` (a stream of the library's, which the caller made wait
        for what the access and others cover: ``PendingWork._covers_foreign``)
        in place of its own, which goes back to its pool. Only enqueues."""
        event, pool, mark = self.event, self.pool, self.mark
        self._record(on)
        if event and pool is not None:
            pool.release(event, self.stream, mark)

    def _give_back(self) -> None:
        event, self.event = self.event, 0
        if event and self.pool is not None:
            self.pool.release(event, self.stream, self.mark)

    def _forget_lifetime(self) -> None:
        lifetime = self.stream._lifetime
        if lifetime is not None:
            lifetime.forget(self)

    def stream_closing(self) -> None:
        """The consumer's stream is closing: record its work now, while it exists."""
        with self.work._locked():
            if self.state is AccessState.LAZY:
                try:
                    self.materialize()
                except DeviceFaultError:
                    # The device faulted: nothing the consumer enqueued runs
                    # any more (on the simulator, not even after a reset), and
                    # the stream is going. Kept lazy, the read would name a
                    # destroyed stream to every later writer of the buffer.
                    self.work._drop(self)
                    raise

    def __repr__(self) -> str:
        return f"<{self.state.value} {self.kind.value} on {self.key.describe()}>"
