"""The pending work of one buffer: its accesses and the blocks open on it.

:class:`PendingWork` is a buffer's state: its pending writes and reads
(:class:`~cai_streams._access.Access`) and the ``writing()``/``reading()``
blocks open on it. It belongs to the buffer, not to a
:class:`~cai_streams.TrackedArray`, so dropping the wrapper forgets nothing;
the scheduler holds it while the buffer lives. The ordering rules live here:

* a write waits for every pending read and write on other streams, except
  that disjoint writes of one round (since the last read or whole write) do
  not wait for each other;
* a read waits for every pending write on other streams;
* every handoff (export, consume onto a stream) adds a consumer read and
  replaces nothing; a host consumer waits for the pending writes.

One lock guards it. It is held for bookkeeping and enqueueing only: never
across a block's body, never while waiting, and never while calling user code
(the buffer's own interface is read before it is taken).
"""

from __future__ import annotations

import enum
import threading
import weakref
from collections.abc import Callable
from typing import Any

from . import _capture, _capture_guard, _observe
from ._access import Access, AccessState, Counters, Kind, owned_stream_of
from ._backend import Backend
from ._blocks import Blocked, OpenBlock, Owner, fault_again
from ._capture_guard import StreamPhase
from ._config import settings
from ._device import OnDevice, view_stream_id
from ._errors import CaptureError, CudaError, DeviceFaultError
from ._identity import Lifetime, StreamId, lifetime_of, order_known, stream_id_now
from ._interface import ArrayView, byte_runs, stream_of
from ._stream import Stream

__all__ = ["MAX_OPEN_READS", "PendingWork"]

#: consumer reads of one buffer held open (lazy) at once that keep their
#: stream alive (another library's; one of the library's handed out by an
#: export) or name a default stream; see ``_consumer_read``
MAX_OPEN_READS = 32


class ViewStream(enum.Enum):
    """Where a buffer that is a view handed to a stream of the library's
    (``consume(arr, stream=s)``, then tracked) stands with that stream, whose
    work its interface names pending at every access."""

    #: the buffer is no such view (or its stream was closing when tracked)
    NONE = "none"
    #: listening for the stream's close, to record its work then
    FOLLOWED = "followed"
    #: the stream closed: its work was recorded as a pending write then, and
    #: nothing more is enqueued there
    RECORDED = "recorded at its close"


class _Locked:
    """``with work._locked():`` (a class: cheaper than a generator context)."""

    __slots__ = ("_work",)

    def __init__(self, work: PendingWork) -> None:
        self._work = work

    def __enter__(self) -> None:
        self._work.lock.acquire()
        if _observe.active:
            _observe.acquired(self._work)

    def __exit__(self, *exc_info: object) -> None:
        try:
            if _observe.active:
                _observe.released(self._work)
        finally:
            self._work.lock.release()


class PendingWork:
    """The pending writes and reads of one buffer (see the module docstring)."""

    __slots__ = (
        "__weakref__",
        "_obj",
        "_ref",
        "_view_lifetime",
        "backend",
        "blocks",
        "counters",
        "device",
        "export_stream",
        "group",
        "key",
        "layout",
        "lock",
        "reads",
        "unfenced",
        "view_stream",
        "wrapper",
        "writes",
    )

    def __init__(
        self,
        obj: object,
        layout: ArrayView,
        export_stream: Stream,
        backend: Backend,
        device: int,
        counters: Counters,
        on_collected: Callable[[PendingWork], None],
    ) -> None:
        me = weakref.ref(self)

        def collected(_: object) -> None:
            work = me()
            if work is not None:
                on_collected(work)

        self._ref: weakref.ref[Any] | None
        try:  # state must not keep the buffer alive: it ends with the buffer
            self._ref = weakref.ref(obj, collected)
            self._obj: object = None
        except TypeError:  # not weakly referenceable: held until settled
            self._ref = None
            self._obj = obj
        self.key = id(obj)  # in the registry; a later object with this id replaces the entry
        self.layout = layout  # the view without an owner
        self.export_stream = export_stream
        self.backend = backend
        self.device = device  # where the buffer lives
        self.counters = counters
        self.lock = threading.Lock()
        self.view_stream = ViewStream.NONE
        self._view_lifetime: Lifetime | None = None
        self.writes: list[Access] = []
        self.reads: list[Access] = []
        self.blocks: list[OpenBlock] = []
        #: blocks that ended inside a graph capture begun on their stream while
        #: they were open: their record went into the capture, and their work
        #: from before the capture began is recorded once the capture is over
        #: (``_fence``); until then the captured record stands for all of it
        self.unfenced: list[OpenBlock] = []
        self.wrapper: weakref.ref[Any] | None = None
        #: disjoint writes since the last read or whole-array write: a group.
        #: They are not ordered among them (each writes its own part); every
        #: other write, and every disjoint write of an earlier group, is.
        self.group = 0

    def _locked(self) -> _Locked:
        """The lock, seen by the sanitizer as the ordering between threads it is."""
        return _Locked(self)

    def obj(self) -> object:
        """The buffer, or None once it was collected."""
        ref = self._ref
        return self._obj if ref is None else ref()

    @property
    def held_strongly(self) -> bool:
        return self._ref is None

    # -- bookkeeping (lock held) -----------------------------------------------

    def _add(self, new: Access) -> None:
        """Add ``new``; the access of the same kind on the same stream that it
        covers in stream order is released (a lazy read covers a recorded one).
        A record made in a graph capture covers only another such record: the
        captured work runs at a launch, in no order with the stream's own."""
        if new.kind is Kind.READ or not new.disjoint:
            self.group += 1
        accesses = self.writes if new.kind is Kind.WRITE else self.reads
        captured = new.captured
        key = new.key
        same = key._hash  # (compared first: a buffer may have hundreds of open reads)
        for i, old in enumerate(accesses):
            if old is new:  # (a block's record at close, added again at its exit)
                return
            if (
                old.key._hash != same
                or old.key != key
                or old.disjoint != new.disjoint
                or old.captured != captured
            ):
                continue
            if (
                not order_known(new.key)
                and not old.stream._records_later()
                and not self._covers_foreign(new, old)
            ):
                continue
            if old.state is AccessState.LAZY and new.state is not AccessState.LAZY:
                new.release()
                return
            if new.state is AccessState.LAZY:  # the newest handoff: the bound takes it last
                accesses[i:] = [*accesses[i + 1 :], new]  # (one step: readers copy unlocked)
            else:
                accesses[i] = new
            old.release()
            return
        accesses.append(new)

    def _drop(self, access: Access) -> None:
        accesses = self.writes if access.kind is Kind.WRITE else self.reads
        for i, a in enumerate(accesses):
            if a is access:
                del accesses[i]
                break
        access.release()

    def _covers_foreign(self, new: Access, old: Access) -> bool:
        """Lock held: make ``new`` cover ``old``, both on one handle of another
        library's stream, whose stream may have been destroyed and the handle
        given to ``new``'s since (stream order then says nothing between
        them). Complete, ``old`` is covered already; else an idle stream of
        the library's (``Scheduler.merging``) waits for both events and ``new``
        takes an event recorded there, so a handle used again and again keeps
        one access of each kind (one query, and maybe two waits and a record).
        Nothing is enqueued on the other library's stream: it may be gone, or
        capturing, by now. Two records made in captures: the newer covers the
        older (one capture is under way on a handle at a time, in capture
        order; an ended capture's record stands for no stream's work). False:
        both are kept (a failed merge, or one whose record a capture begun
        meanwhile may hold)."""
        if new.state is not AccessState.RECORDED or old.state is not AccessState.RECORDED:
            return False
        if new.captured or old.captured:
            return new.captured and old.captured
        if new.pins:
            return False
        try:
            if old.is_complete():
                self.counters.add(elided=1)
                return True
            # asked again after ``new``'s record: a capture another thread began
            # before it has that record, which no stream outside may wait for
            if _capture_guard.capturing(self.backend, new.key) is not False:
                return False
        except CudaError:  # (its failure is raised where it is waited for)
            return False
        from ._scheduler import scheduler_for  # late: it builds on this module

        sched = scheduler_for(self.backend, new.key.device)
        try:
            via = sched.merging()  # (made, if none kept is idle: may fail)
        except (CudaError, ValueError):  # (both kept: nothing is lost)
            return False
        try:
            self.backend.stream_wait_event(via.handle, old.event)
            self.backend.stream_wait_event(via.handle, new.event)
            new.record_again(via._key())
        except (CudaError, ValueError):
            merged = False
        else:
            merged = True
        sched.merged(via)  # (never raises: see _Spares.give)
        if merged:
            self.counters.add(waits=2)
        return merged

    def _drop_complete(self, accesses: list[Access]) -> None:
        for a in list(accesses):
            if a.is_complete():
                self._drop(a)

    def blocker(self, kind: Kind, disjoint: bool, me: Owner) -> Blocked | None:
        for block in self.blocks:
            if block.owner != me and block.conflicts(kind, disjoint):
                return Blocked(block)
        return None

    def _see_own_blocks(self, kind: Kind, disjoint: bool, me: Owner) -> None:
        """The caller's own open blocks count with what they enqueued so far
        (a block whose stream closed: with its record at the close)."""
        for block in self.blocks:
            if block.owner == me and block.conflicts(kind, disjoint):
                snapshot = block.at_close
                if isinstance(snapshot, DeviceFaultError):  # (closed on a faulted device)
                    raise fault_again(snapshot)
                if snapshot is None:  # (a stream gone without it: ValueError)
                    snapshot = self._record_block(block)
                if snapshot.state is not AccessState.RELEASED:  # (else complete, let go)
                    self._add(snapshot)

    def own_stream(self, *, sync: bool | None = None) -> Stream | None:
        """The stream the buffer's own interface names as pending now, if any
        and unless the backend says it is idle; None with ``sync`` False (None:
        the global setting; a consume passes its own). Reads the interface
        (user code): called without the lock."""
        if not (settings.sync if sync is None else sync):
            return None
        obj = self.obj()
        if obj is None:
            return None
        handle = stream_of(obj)
        if handle is None:
            return None
        if type(obj) is ArrayView and obj.stream == handle:  # a view keeps its stream's
            try:  # identity
                key = view_stream_id(self.backend, obj)
            except ValueError:  # its stream closed since: recorded then, if followed
                if self.view_stream is ViewStream.RECORDED:
                    return None
                raise
            with _observe.Scope(self):
                idle = _capture_guard.stream_idle(self.backend, key)
            return None if idle else Stream._borrow_key(key, self.backend)
        # (1 and 2: the default streams of the buffer's device, whichever is current)
        with OnDevice(self.backend, self.device, handle):
            with _observe.Scope(self):  # what it finds complete is this buffer's to know
                idle = _capture_guard.stream_idle(self.backend, stream_id_now(self.backend, handle))
            if idle:
                return None
            return Stream._borrow(handle, self.backend, None)

    def note_stream(self, key: StreamId) -> None:
        """Work enqueued on ``key``'s stream so far may have written the buffer
        (a view of it was handed there, and is handed on now): recorded now, as
        a pending write, so the next consumer and the next writer wait for it;
        nothing when it is idle, or capturing (captured work runs at a launch).
        Only enqueues GPU work (one record at most)."""
        with self._locked():  # recorded under the lock, as every record added to the
            # lists (one made outside and added after a newer one would replace it)
            self._note_stream(key)

    def _note_stream(self, key: StreamId) -> None:
        """:meth:`note_stream`, the lock held."""
        state = _capture_guard.capturing(self.backend, key)  # (the legacy: may raise)
        if state is True:  # captured work runs at a launch, in no order with this
            return
        if state is False:
            with _observe.Scope(self):  # what it finds complete is this buffer's to know
                if _capture_guard.stream_idle(self.backend, key):
                    return  # nothing pending there: nothing to record
        stream = Stream._borrow_key(key, self.backend)
        self._add(Access.recorded(self, Kind.WRITE, stream, key))

    def follow_view_stream(self, view: ArrayView) -> None:
        """The buffer is ``view``, handed to a stream of the library's that is
        open: listen for its close, to record the work its interface names
        pending while the stream still exists (after, a handle that may name
        another stream says nothing). Does not block."""
        key = view._stream_key
        if view.stream is None or key is None or not key.generation:
            return
        lifetime = lifetime_of(self.backend, key.handle)
        if lifetime is None or lifetime.generation != key.generation:
            return  # (closed already: own_stream raises)
        with self._locked():
            if self.view_stream is ViewStream.NONE and lifetime.listen(self):
                self.view_stream = ViewStream.FOLLOWED
                self._view_lifetime = lifetime

    def _note(self, own: Stream | None) -> None:
        """Work the buffer's own interface reported pending, recorded now (a
        bare handle may be gone, or another thread's, by a later record); and
        the work of blocks whose capture has ended since (``_fence``)."""
        if self.unfenced:
            self._fence()
        if own is not None and not own.closed:
            self._add(Access.recorded(self, Kind.WRITE, own, own._key()))

    def _fence(self) -> None:
        """A block whose stream began capturing while it was open, and was still
        capturing when it ended, has only a captured record: its work enqueued
        before the capture began is ordinary, pending on the stream, and no
        record of it could be made. Once that capture is over, an ordinary
        record now covers it (and what followed); until then its captured
        records are ``unfenced`` and nothing waits for them (a host wait, or
        a stream outside the capture, raises CaptureError), even if the capture
        ends between this ask and theirs: one ask decides. A stream closed or
        destroyed since can take no record: nothing more can be waited for
        there (closing a stream of this library records first, in
        :meth:`stream_closing`). A bare handle destroyed and made again for
        another stream cannot be told apart from the first (``docs/capture.md``)."""
        for block in list(self.unfenced):  # (a record that raises leaves the rest)
            stream, phase = block.stream, StreamPhase.GONE
            lifetime = stream._lifetime
            if lifetime is not None and lifetime.ending:  # closing: it records first
                stream = stream._same_stream()  # (its own wrapper may say closed)
            if not stream.closed:
                phase = _capture_guard.stream_phase(self.backend, block.key)
            if phase is StreamPhase.CAPTURING or phase is StreamPhase.UNNAMED:
                continue  # (unnamed: another thread's handle 2; that thread asks)
            if phase is StreamPhase.NOT_CAPTURING:
                new = Access.recorded(self, block.kind, stream, block.key, block.disjoint)
                new.group = block.group
                self._add(new)
                if new.mark is not None and new.mark.captured:
                    continue  # a capture began since the ask: this record is in it
            # recorded; or gone (destroyed or closed): nothing more can wait there
            self.unfenced.remove(block)
            self._forget_unless_used(lifetime)

    def unfenced_on(self, key: StreamId) -> bool:
        """Whether a block on ``key``'s stream is left to fence (its captured
        records then stand for unrecorded work too: ``Access.unfenced``). Read
        without the lock: a host wait asks after pinning."""
        blocks = self.unfenced
        return bool(blocks) and any(b.key == key for b in blocks)

    def stream_closing(self) -> None:
        """The library's stream of an open block, or of a block left to fence,
        or the one a buffer that is a view names (:meth:`follow_view_stream`),
        is about to be destroyed (``try_enter`` and ``leave`` listen): record
        on it now, while it exists (``close()`` refuses a capturing stream; the
        fence asks all the same). An open block's record covers what its body
        enqueued so far, all it can: nothing runs on a closed stream after.
        (A body enqueueing in another thread while this runs races the close
        itself: what lands after this record is not covered.)"""
        errors: list[Exception] = []
        with self._locked():
            lifetime = self._view_lifetime
            if lifetime is not None and lifetime.ending:  # the stream the buffer names
                self._view_lifetime = None
                self.view_stream = ViewStream.RECORDED
                view = self.obj()
                if isinstance(view, ArrayView) and view._stream_key is not None:
                    try:
                        self._note_stream(view._stream_key)
                    except Exception as exc:  # the blocks record all the same
                        errors.append(exc)
            for block in self.blocks:
                lifetime = block.stream._lifetime
                if block.at_close is None and lifetime is not None and lifetime.ending:
                    try:
                        block.at_close = self._record_block(block)
                    except DeviceFaultError as exc:  # (the exit raises it too, adding nothing)
                        block.at_close = exc
                        errors.append(exc)
                    except Exception as exc:  # every other block records first
                        errors.append(exc)
            self._fence()
        if errors:
            raise errors[0]

    def order_after(
        self,
        stream: Stream,
        key: StreamId,
        accesses: list[Access],
        *,
        join: bool,
        what: str,
        capturing: bool | None = None,
    ) -> None:
        """Make ``stream`` wait for each access on another stream; completed
        ones are dropped instead. Only enqueues. A wait that a graph capture
        forbids raises CaptureError before anything is enqueued.
        ``capturing``: whether ``stream`` captures, if the caller just asked."""
        handle = stream.handle
        waited = elided = 0
        if order_known(key):
            accesses = [
                a
                for a in accesses
                if a.state is not AccessState.RELEASED and a.key != key and key not in a.waited_by
            ]
        else:  # another library's handle: maybe destroyed and given to this stream since
            accesses = [a for a in accesses if a.state is not AccessState.RELEASED]
            if accesses and capturing is None:
                capturing = _capture_guard.capturing(self.backend, key) is True
            accesses = [
                a
                for a in accesses
                # the same stream for sure: a capture's own stream (a wait on work
                # outside it is refused anyway, and a launch is ordered after it),
                # or one whose access keeps the object owning the handle alive
                if not (a.key == key and (capturing or a.stream._records_later()))
                and not (capturing and key in a.waited_by)
            ]
        needless: list[Access] = []
        if accesses:  # (the capture check costs a driver call: only when there is work)
            if capturing is None:
                capturing = _capture_guard.capturing(self.backend, key) is True
            needless = [
                a
                for a in accesses
                if not _capture_guard.must_wait(self.backend, key, capturing, a, what)
            ]
        for a in accesses:
            if a in needless:  # a capturing waiter, and work found complete: no edge
                if a.state is AccessState.RECORDED:
                    elided += 1
                    self._drop(a)
                continue
            if a.state is AccessState.LAZY and capturing:
                # A consumer's read on a stream of this capture: the edge is a
                # record of what it enqueued so far, taken by the capture. The
                # read stays lazy: it stands for its ordinary work from before
                # the capture too, which a record now would not name (a launch,
                # or a writer once the capture is over, records and waits then).
                edge = Access.recorded(self, Kind.READ, a.stream, a.key)
                try:
                    self.backend.stream_wait_event(handle, edge.event)
                finally:
                    edge.release()
                waited += 1
                continue
            if a.state is AccessState.LAZY:
                a.materialize()
            elif a.is_complete():
                elided += 1
                self._drop(a)
                continue
            self.backend.stream_wait_event(handle, a.event)
            a.waited_by.add(key)
            waited += 1
        if _observe.active:  # what was found complete orders the stream as a wait would
            _observe.stream_ordered(self.backend, handle)
        if waited or elided:
            if join:
                self.counters.add(joins=waited, elided=elided)
            else:
                self.counters.add(waits=waited, elided=elided)

    def _consumer_read(self, stream: Stream, key: StreamId, *, keep: bool = False) -> None:
        """What ``stream`` enqueues from now on reads the buffer. Reads found
        complete are forgotten. An open read on a stream the library made
        ends with the stream (its close, or its collection once dropped,
        records it), however many there are; beyond :data:`MAX_OPEN_READS`
        open reads that keep their stream alive (another library's; one of
        the library's that an export handed out as a bare handle: ``keep``)
        or name a default stream, the oldest is recorded now, so a buffer
        read on ever-new such streams, and never written, holds neither them
        nor events (a writer is then ordered after what that consumer had
        enqueued by then, not after its later work). On a stream capturing a
        graph this library began, the read is the graph's (each launch is
        then ordered as a ``reading()`` block is)."""
        if _capture.any_under_way() and _capture_guard.capturing(self.backend, key) is True:
            _capture.note_captured(self, False, key)
        self._drop_complete(self.reads)
        same = key._hash  # (compared first: a buffer may have hundreds of open reads)
        reads = self.reads
        for i, a in enumerate(reads):
            if a.key._hash == same and a.key == key and a.state is AccessState.LAZY:
                # already open: it covers this consumer's work as well, and is the
                # newest handoff now (the bound takes it last; one step, as
                # readers copy the list unlocked); an export of it now keeps the
                # stream (the user's own, once it is known)
                reads[i:] = [*reads[i + 1 :], a]
                if not keep:
                    return
                owner = owned_stream_of(stream)
                if a.keeps and (owner is None or a.stream is owner):
                    return
                a.keep_stream(stream)
                break
        else:
            self._add(Access.lazy(self, stream, key, keep=keep))
        if len(self.reads) <= MAX_OPEN_READS:
            return  # (within the bound whatever they are)
        open_reads = [
            a
            for a in self.reads
            if a.state is AccessState.LAZY and (a.keeps or a.stream._lifetime is None)
        ]
        excess = len(open_reads) - MAX_OPEN_READS
        for a in open_reads:  # the oldest first, skipping those whose stream captures
            if excess <= 0:
                break
            if a.key == key:  # this handoff's own: its consumer has enqueued nothing yet
                continue
            try:
                if self._materialize_outside_capture(a):
                    excess -= 1
            except CaptureError:  # (the legacy stream while a blocking one captures)
                continue

    def _materialize_outside_capture(self, a: Access) -> bool:
        """Record the lazy ``a`` now, unless its stream captures (or this
        thread cannot name it): a record then would stand for the captured work
        only, and the consumer's ordinary work before the capture would be
        taken for done once it ended. False: ``a`` is still lazy (a writer that
        must wait for it asks again, and raises CaptureError while it captures)."""
        if _capture_guard.capturing(self.backend, a.key) is not False:
            return False
        a.materialize()
        return True

    def _declare_stream_read(self, stream: Stream, what: str) -> None:
        if _observe.active:
            _observe.stream_access(
                self.backend, stream.handle, reads=byte_runs(self.layout), writes=(), what=what
            )

    # -- writing() / reading() blocks -----------------------------------------

    def try_enter(
        self, kind: Kind, disjoint: bool, stream: Stream, me: Owner
    ) -> OpenBlock | Blocked:
        """Open a block on ``stream``: order it after the conflicting accesses."""
        own = self.own_stream()
        with self._locked():
            blocked = self.blocker(kind, disjoint, me)
            if blocked is not None:
                return blocked
            key = stream._key()
            self._note(own)
            self._see_own_blocks(kind, disjoint, me)
            group = self.group
            if kind is Kind.WRITE:
                conflicting = [
                    *self.reads,
                    *(w for w in self.writes if not (disjoint and w.disjoint and w.group == group)),
                ]
            else:
                conflicting = list(self.writes)
            what = "writing()" if kind is Kind.WRITE else "reading()"
            # asked once, for the ordering and for the block (see leave): one
            # driver call more when there is nothing to order after
            began = _capture_guard.capturing(self.backend, key) is True
            self.order_after(stream, key, conflicting, join=False, what=what, capturing=began)
            covered: list[Access] = []
            if kind is Kind.WRITE and not disjoint:
                covered = [a for a in conflicting if a.state is not AccessState.RELEASED]
            if _observe.active and not disjoint:  # a disjoint block does not say which part
                rng = byte_runs(self.layout)
                _observe.stream_access(
                    self.backend,
                    stream.handle,
                    reads=rng if kind is Kind.READ else (),
                    writes=rng if kind is Kind.WRITE else (),
                    what=f"{'writing' if kind is Kind.WRITE else 'reading'}() block",
                )
            block = OpenBlock(
                kind,
                disjoint,
                stream._kept(),  # (a borrowed wrapper closed in the block only forgets it)
                key,
                me,
                covered,
                group,
                began_capturing=began,
                capture=_capture.under_way(key) if began else None,
                serial=_capture.serial_now(),
            )
            self.blocks.append(block)
            lifetime = stream._lifetime
            if lifetime is not None:  # (False: closing now; its exit records as it can)
                lifetime.listen(self)  # closing it inside the block records the block first
            return block

    @staticmethod
    def _began_in(block: OpenBlock) -> bool:
        """Whether the capture under way at the block's end began inside it:
        its stream did not capture when it opened, or this library began both
        captures and they differ (one ended in the block, another began). A
        capture begun elsewhere, under way at both ends, is taken as one."""
        if not block.began_capturing:
            return True
        now = _capture.under_way(block.key)
        return block.capture is not None and now is not None and now is not block.capture

    def leave(self, block: OpenBlock) -> None:
        """The block's body ended: its work is pending on its stream (recorded
        now, or when the stream closed in the block: ``stream_closing``)."""
        with self._locked():
            self._end_block(block)

    def _end_block(self, block: OpenBlock, *, gone_ok: bool = False) -> None:
        """Lock held: ``block`` ends (see :meth:`leave`). ``gone_ok``: its
        stream may be gone with no record of the block (a ``consuming()`` body,
        whose consumer read its close recorded): nothing is added then."""
        try:
            new = block.at_close
            if isinstance(new, DeviceFaultError):  # (its stream closed on a faulted device)
                raise fault_again(new)
            if new is None:
                if gone_ok and not block.stream._recordable:
                    return
                new = self._record_block(block)
            for a in block.covered:  # (a captured write replaces no ordinary work)
                if a.state is not AccessState.RELEASED and (a.captured or not new.captured):
                    self._drop(a)
            if new.state is not AccessState.RELEASED:  # (its record at close, found done)
                self._add(new)
            if new.mark is None or not new.mark.captured:  # (an ordinary record: a capture
                # of its stream that ended in the block has the block's work in its graph)
                _capture.ended_in(
                    self, block.kind is Kind.WRITE, block.key, block.serial, block.capture
                )
            if new.mark is not None and new.mark.captured and self._began_in(block):
                block.covered = []  # (released: nothing of them is needed any more)
                self.unfenced.append(block)  # a capture began in it (see _fence)
        finally:
            self.blocks.remove(block)
            block.done.set()
            self._forget_unless_used(block.stream._lifetime)

    def _record_block(self, block: OpenBlock) -> Access:
        new = Access.recorded(self, block.kind, block.stream, block.key, block.disjoint)
        new.group = block.group
        return new

    def _forget_unless_used(self, lifetime: Lifetime | None) -> None:
        """Lock held: stop listening to ``lifetime`` unless an open block or a
        block left to fence is on its stream, or it is the stream the buffer
        (a view) names (:meth:`follow_view_stream`)."""
        if (
            lifetime is not None
            and lifetime is not self._view_lifetime
            and all(b.stream._lifetime is not lifetime for b in (*self.blocks, *self.unfenced))
        ):
            lifetime.forget(self)

    # -- handoffs -------------------------------------------------------------

    def try_export(self, x: Stream, me: Owner) -> Blocked | int | None:
        """Join the pending writes onto ``x`` and add the consumer's read on it.

        Returns the handle to export: ``x``'s, or None when no write is
        pending (the data is ready now, on any stream). The read on ``x`` is
        added either way: a consumer that was given ``x`` is protected even
        then. Only enqueues.
        """
        own = self.own_stream()
        with self._locked():
            blocked = self.blocker(Kind.READ, False, me)
            if blocked is not None:
                return blocked
            key = x._key()
            self._note(own)
            self._see_own_blocks(Kind.READ, False, me)
            self.counters.add(exports=1)
            # x waited for these at an earlier export: the join passes them by,
            # so whether they are done is asked here (else they would be named
            # pending for as long as nothing else drops them)
            ordered = [a for a in self.writes if a.key != key and key in a.waited_by]
            self.order_after(x, key, list(self.writes), join=True, what="export()")
            for a in ordered:
                if a.state is not AccessState.RELEASED and a.is_complete():
                    self._drop(a)
            pending = any(a.key != key for a in self.writes) or any(
                a.key == key and not a.is_complete() for a in self.writes
            )
            self._consumer_read(x, key, keep=True)
            if not pending:
                if _observe.active:  # stream None says "ready now, anywhere": checked so,
                    _observe.host_access(  # but not kept as a read; the consumer's own
                        "ready",  # reads are declared where they are enqueued. Its thread
                        byte_runs(self.layout),  # is ordered after what was found done
                        "export() with nothing pending: stream None",
                        waited=[self],
                    )
                return None
            self._declare_stream_read(x, "export(): the consumer's read")
            return x.handle

    def try_read_on(
        self, s: Stream, me: Owner, *, block: bool = False
    ) -> Blocked | OpenBlock | None:
        """``s`` waits for the pending writes; what it enqueues from now on
        reads the buffer (a consumer read). Only enqueues. ``block``: also
        open a read block for ``me`` (a ``consuming()`` body), which another
        owner's write waits for; end it with :meth:`read_done_on`. For a
        consume that synchronizes (its ``sync``, whatever the setting)."""
        own = self.own_stream(sync=True)
        with self._locked():
            blocked = self.blocker(Kind.READ, False, me)
            if blocked is not None:
                return blocked
            key = s._key()
            self._note(own)
            self._see_own_blocks(Kind.READ, False, me)
            self.order_after(s, key, list(self.writes), join=False, what="consume(stream=s)")
            self._consumer_read(s, key)
            self._declare_stream_read(s, "consume(stream=...): the consumer's read")
            if not block:
                return None
            # (asked as for a block: a capture under way at its end began in it or not)
            began = _capture_guard.capturing(self.backend, key) is True
            opened = OpenBlock(
                Kind.READ,
                False,
                s._kept(),
                key,
                me,
                [],
                self.group,
                "consuming()",
                began_capturing=began,
                capture=_capture.under_way(key) if began else None,
                serial=_capture.serial_now(),
            )
            self.blocks.append(opened)
            lifetime = s._lifetime
            if lifetime is not None:  # closing it in the body records the body's work
                lifetime.listen(self)
            return opened

    def read_done_on(self, s: Stream, block: OpenBlock | None = None) -> None:
        """The consumer's work on ``s`` so far reads the buffer (the back-edge);
        ``block``, from :meth:`try_read_on`, ends."""
        with self._locked():
            if block is not None:  # (a capture begun in the body: as a block's, fenced)
                self._end_block(block, gone_ok=True)
            elif s._recordable:  # (else its close recorded the lazy read)
                self._add(Access.recorded(self, Kind.READ, s, s._key()))

    def try_pin_writes(self, me: Owner, own: Stream | None) -> Blocked | list[Access]:
        """The pending writes, pinned, for a host wait (unpin with :meth:`unpin_writes`).
        ``own``: what :meth:`own_stream` gave, read by the caller just before."""
        with self._locked():
            blocks = self.blocks  # (none open, the common case: nothing to look through)
            if blocks and (blocked := self.blocker(Kind.READ, False, me)) is not None:
                return blocked
            self._note(own)
            if blocks:
                self._see_own_blocks(Kind.READ, False, me)
            for a in self.writes:
                a.pin()
            return list(self.writes)

    def idle_for_host(self) -> bool:
        """Whether a host consume has nothing here to wait for or behind: no
        open block, no pending write, no block left to fence (``_fence``).
        Then, if :meth:`own_stream` gave None just before, the consume is
        complete with nothing pinned. Takes the lock without telling the
        sanitizer: for callers that checked it observes nothing."""
        with self.lock:
            return not (self.blocks or self.writes or self.unfenced)

    def unpin_writes(self, accesses: list[Access], *, complete: bool) -> None:
        """Let go of what :meth:`try_pin_writes` gave; complete writes are forgotten."""
        with self._locked():
            for a in accesses:
                a.unpin()
            if complete:
                for a in accesses:
                    if a.state is not AccessState.RELEASED:
                        self._drop(a)

    # -- the end of the buffer or of its wrapper --------------------------------

    def abandon(self) -> None:
        """The buffer was collected: nothing can conflict with its work any more."""
        with self._locked():
            for a in [*self.writes, *self.reads]:
                a.release()
            for block in self.unfenced:
                if (lifetime := block.stream._lifetime) is not None:
                    lifetime.forget(self)
            if (lifetime := self._view_lifetime) is not None:
                self._view_lifetime = None
                lifetime.forget(self)
            self.writes, self.reads, self.unfenced = [], [], []

    def settle(self) -> bool:
        """Record what is lazy and forget what is complete; True once nothing is pending."""
        with self._locked():
            if self.blocks:
                return False
            if self.unfenced:
                self._fence()
            for a in [*self.writes, *self.reads]:
                if a.state is AccessState.LAZY:
                    self._materialize_outside_capture(a)  # (else still lazy: pending)
            self._drop_complete(self.writes)
            self._drop_complete(self.reads)
            return not self.writes and not self.reads and not self.unfenced

    def pending_streams(self) -> dict[str, list[int]]:
        with self._locked():
            return {
                "writes": list(dict.fromkeys(a.key.handle for a in self.writes)),
                "reads": list(dict.fromkeys(a.key.handle for a in self.reads)),
            }
