"""The Receiver: a subscriber's two threads, its receive slots and its data plane.

The *receiver* thread, in order:

1. ``_join``: connect the control connection (:class:`~weightsync.control.client.ControlClient`:
   it answers the publisher's challenge with a Join proving the secret); wait for Admit (which
   carries the channel's settings: every deadline below derives from them) or Deny;
2. ``_enter`` a generation: say Ready (with the data plane's offer), wait for Go (or a
   Reconfigure that replaces the plan), then ``plane.enter``;
3. ``_follow`` this member's queue: Announce -> ``_receive`` (buckets straight into the
   receiving slot, checksums against the Seal, publish atomically, acknowledge); Reconfigure
   -> the next generation or Evicted; Shutdown -> PublisherGone;
4. on close, ``_leave``.

The *heartbeat* thread beats to the publisher and watches the connection: a closed one ends
everything with PublisherGone at once, a silent one (a frozen publisher) once it has been
silent for ``Deadlines.publisher_silence`` while this process itself kept running. It makes no
call that can block on the publisher beyond the send deadline.

States (``Receiver.state``)::

    NEW --start--> JOINING --Admit--> FOLLOWING --close--> CLOSED
                      │                   ├── Reconfigure without us --> EVICTED
                      │                   ├── Shutdown / silence ------> GONE
                      └── Deny ──────────┴── anything unexpected ----> FAILED

The terminal error (Evicted, PublisherGone, Closed, a denial) is kept in one :class:`Latch`,
first error wins; readers raise it. A step that fails because of the wire (a peer, a cancelled
generation, a timeout) is acknowledged as failed and the receiver goes on; anything else is a
bug and ends the receiver (FAILED) instead of being blamed on the wire.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from weightsync import _wire
from weightsync._errors import (
    Cancelled,
    ChecksumMismatch,
    ControlFailure,
    LocalFailure,
    PeerFailure,
    ProtocolError,
    StoreTimeout,
    StoreUnreachable,
)
from weightsync.control import auth
from weightsync.control.client import ControlClient
from weightsync.control.rendezvous import RemoteStore
from weightsync.encodings import registry, seam
from weightsync.engine import activation, heartbeat, joining, seals
from weightsync.engine.landing import Held, Landing, Staged, Targets
from weightsync.engine.lifecycle import Latch
from weightsync.engine.slots import SlotPair
from weightsync.errors import (
    Closed,
    Evicted,
    PublisherGone,
    SyncTimeout,
    WeightSyncError,
)
from weightsync.format import layout, sharding, slicing
from weightsync.format.checksum import KINDS, checksum
from weightsync.options import UNBOUNDED, Deadlines
from weightsync.planes.dataplane import DataPlane, MemberContext, Transfer, plane_spec
from weightsync.recorder.recorder import FlightRecorder
from weightsync.statistics import SubscriberTally
from weightsync.testing import Hooks

#: what a receive may fail with and still be acknowledged (as failed): the wire, not a bug
RECEIVE_FAILURES = (PeerFailure, Cancelled, ProtocolError, ControlFailure, LocalFailure)

log = logging.getLogger("weightsync.subscriber")



@dataclass
class _Spent:
    """Where one receive's time went (monotonic seconds), for the member's own time in its Ack."""

    moving: float = 0.0  # when the plane's move began
    in_move: float = 0.0  # in the plane's move (the collective: mostly waiting on others)
    sealing: float = 0.0  # after it, until the Seal was checked (it comes when the whole broadcast is done)
    checking: float = 0.0  # of the time in move, what this member spent on its own buckets


class ReceiverState(enum.Enum):
    NEW = "new"
    JOINING = "joining"
    FOLLOWING = "following"
    EVICTED = "evicted"
    GONE = "gone"
    FAILED = "failed"
    CLOSED = "closed"


_TERMINAL_STATES = {Evicted: ReceiverState.EVICTED, PublisherGone: ReceiverState.GONE, Closed: ReceiverState.CLOSED}


class Receiver:
    """Owns a subscriber's receiver and heartbeat threads (see the module docstring).

    Args:
        channel, member_id: names.
        host, port: the publisher's control server.
        backend, device: the data plane's backend and the device receive slots live on.
        secret: the admission secret, or None.
        own_timeout: this end's own bound for joining and for the publisher's silence.
        recorder: the flight recorder.
        slots: the two receive slots readers read from.
        on_publish: called (receiver thread) after a version became readable.
        hooks: test hooks (``weightsync.testing``); the default does nothing.
    """

    def __init__(self, channel: str, member_id: str, *, host: str, port: int, backend: str, device: torch.device,
                 secret: bytes | None, own_timeout: float, join_timeout: float, recorder: FlightRecorder,
                 slots: SlotPair, on_publish: Callable[[], None], hooks: Hooks, transport: str = "auto",
                 lane: int = 0, want: tuple[_wire.Want, ...] | None = None, wait_for_publisher: bool = False,
                 tally: SubscriberTally | None = None, accepts: str | None = None) -> None:
        self.channel, self.member_id = channel, member_id
        self.backend, self.device, self._secret = backend, device, secret
        self.own_timeout, self.join_timeout = own_timeout, join_timeout
        self.state = ReceiverState.NEW
        self.terminal = Latch()
        self.joined = threading.Event()
        self.closing = threading.Event()  # finish the version in flight, then leave
        self.aborting = threading.Event()  # walk away now
        self.generation, self.rank = -1, -1
        self.deadlines: Deadlines | None = None
        self._recorder, self._slots, self._on_publish, self._hooks = recorder, slots, on_publish, hooks
        self.lane = lane  # a sharded channel: the trainer rank this receiver's publisher is
        self.lanes: tuple[str, ...] = ()  # from rank 0's Admit: the other trainer ranks' addresses
        self.want = want  # a sliced member: only these boxes arrive (point to point), packed in its slot
        self._rec = recorder.scope(channel, member_id if lane == 0 else f"{member_id}@rank{lane}")
        self._plane: DataPlane | None = None
        self._targets = Targets(slots, lane=lane, want=want, device=device, channel=channel, member_id=member_id)
        self._clean_shutdown = False
        self._held: Held | None = None  # the readable version a delta may be against (a lane: its part of it)
        # activation "all": the verified version waiting in the receiving slot for its Commit
        self._commits = activation.MemberCommit()
        self.tally = tally or SubscriberTally()
        # never admitted yet: a publisher that is not listening may still be starting (any start order)
        self._wait_for_publisher = wait_for_publisher
        self._where = f"{host}:{port}"
        self._client = ControlClient(channel, member_id, host=host, port=port, secret=secret,
                                     fingerprint=auth.fingerprint(backend, device), recorder=self._rec,
                                     send_timeout=own_timeout,
                                     transport=transport, want=want, accepts=accepts)
        self._heartbeat = heartbeat.Heartbeat(self, self._rec)

    # terminal state ------------------------------------------------------------------------
    def in_doubt(self) -> str:
        """With ``activation="all"``: what this member cannot know of the fleet if its publisher is
        gone now (the split it may be in), or "" when nothing is in doubt."""
        return self._commits.in_doubt(self._slots.version)

    def end(self, error: WeightSyncError) -> None:
        """Any thread: the receiver is over for ``error``'s reason (first one wins). A publisher gone
        mid-commit (``activation="all"``) is reported as the split it may leave (:meth:`in_doubt`)."""
        doubt = self.in_doubt() if isinstance(error, PublisherGone) else ""
        if doubt:
            error = PublisherGone(f"{error.message}; {doubt}", channel=self.channel, member=self.member_id,
                                  version=self._slots.version)
        if self.terminal.set(error):
            self.state = _TERMINAL_STATES.get(type(error), ReceiverState.FAILED)
            dumped = None
            if not isinstance(error, Closed) and not self._clean_shutdown:
                dumped = self._recorder.dump_on_trouble(f"{type(error).__name__}: {error}") \
                    or self._recorder.last_dump_path
            if isinstance(error, Closed):
                log.debug("%s: %s", self.member_id, error)
            elif self._clean_shutdown:
                log.info("%s: %s", self.member_id, error)
            else:
                log.warning("%s: %s: %s; flight recorder: %s", self.member_id, type(error).__name__, error,
                            dumped or "no dump")
        self._on_publish()  # wake readers: they raise it

    @property
    def transport(self) -> str:
        """The transport this member joined with: the plane it receives through (decided when it connects)."""
        return self._client.transport

    @property
    def client(self) -> ControlClient:
        """This member's control connection (the heartbeat thread beats on it)."""
        return self._client

    @property
    def over(self) -> bool:
        return self.terminal.error is not None

    # the receiver thread ---------------------------------------------------------------------
    def main(self) -> None:
        try:
            self.state = ReceiverState.JOINING
            generation, members = self._join()
            self.state = ReceiverState.FOLLOWING
            self.joined.set()
            self._follow(generation, members)
        except WeightSyncError as err:
            self.end(err)
        except Exception as err:  # noqa: BLE001 - the thread must end in a state callers can see
            cls = PublisherGone if isinstance(err, ControlFailure) else WeightSyncError
            failure = cls(f"receiver stopped: {type(err).__name__}: {err}", channel=self.channel,
                          member=self.member_id)
            self._rec.record("receiver").fail(failure)
            self.end(failure)
        finally:
            self.joined.set()
            if self.closing.is_set() and self.deadlines is not None:
                self._leave()
            self._slots.keep_own()  # the last version stays readable; no view keeps the publisher's memory
            if self._plane is not None:
                self._plane.close()
            self._client.close("receiver stopped")

    def _next_message(self, timeout: float, until: Callable[[], bool] | None = None) -> Any:
        """The next command for this member; None when woken to stop (``until()`` says when).

        Raises StoreTimeout after ``timeout``, StoreUnreachable once the connection closed.
        """
        stop = until or (lambda: self.closing.is_set() or self.over)
        deadline = time.monotonic() + timeout
        while True:
            try:
                message = self._client.commands.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                raise StoreTimeout(f"no word from the publisher within {timeout:.3g}s") from None
            if isinstance(message, _wire.Wake):
                if stop():
                    return None
                if self._client.closed.is_set():
                    raise StoreUnreachable(self._client.close_reason)
                continue
            return message

    def wake(self, reason: str) -> None:
        """Any thread: end the receiver's current wait (it re-checks why it waits)."""
        self._client.commands.put(_wire.Wake(reason=reason))

    def _join(self) -> tuple[int, tuple[str, ...]]:
        entry = self._rec.record("join").start()
        deadline = time.monotonic() + self.join_timeout
        try:
            joining.connect(self._client, deadline, entry, wait=self._wait_for_publisher, closing=self.closing,
                            where=self._where, within=self.join_timeout, channel=self.channel, member=self.member_id)
        except SyncTimeout:
            self._clean_shutdown = True  # never reached: nothing happened worth a dump
            raise
        try:
            reply = self._next_message(max(deadline - time.monotonic(), 0.0))
        except StoreUnreachable as err:
            entry.fail(err)
            raise PublisherGone(f"the publisher closed the connection while we joined: {err}", channel=self.channel,
                                member=self.member_id) from err
        except StoreTimeout as err:
            entry.fail(err)
            raise SyncTimeout("the publisher did not answer the join", channel=self.channel,
                              member=self.member_id) from err
        reply = joining.admitted(reply, entry, self.channel, self.member_id)
        self.deadlines = Deadlines(reply.settings)
        self.lanes = reply.lanes
        log.info("%s joined channel %r at %s (generation %d, transport %s)", self.member_id, self.channel,
                 self._where, reply.generation, self._client.transport)
        # the plane serving the transport this connection joined with
        timeout, client = self.deadlines.rendezvous(), self._client
        self._plane = plane_spec(client.transport).member_plane(MemberContext(
            self.channel, self.member_id, backend=self.backend, device=self._slots.device, recorder=self._recorder,
            scope=self._rec, client=client, admit=reply, rendezvous_timeout=timeout,
            store=lambda: RemoteStore(client, timeout)))
        entry.complete()
        return reply.generation, reply.members

    def _enter(self, generation: int, members: tuple[str, ...]) -> tuple[bool, Any]:
        """Enter ``generation`` (:func:`.joining.enter`): (entered, the message that replaced the plan or None)."""
        assert self._plane is not None and self.deadlines is not None
        self.generation = generation
        entered, message, rank = joining.enter(
            self._plane, self._client, generation, self.member_id, timeout=self.deadlines.rendezvous(),
            next_message=lambda: self._next_message(UNBOUNDED, until=lambda: self.aborting.is_set() or self.over),
            scope=self._rec, recorder=self._recorder)
        self.rank = rank if rank is not None else self.rank
        return entered, message

    def _follow(self, generation: int, members: tuple[str, ...]) -> None:
        assert self._plane is not None
        try:
            entered, pending = self._enter(generation, members)
            while not self.closing.is_set() or pending is not None:
                message = pending if pending is not None else self._next_message(UNBOUNDED)
                pending = None
                if message is None:
                    return
                if isinstance(message, _wire.Announce):
                    if message.generation != generation:
                        continue  # for a generation we are not in (stale)
                    if entered:
                        self._receive(message)
                    else:  # our rendezvous failed: say so at once rather than stay silent
                        self._acknowledge(message, ok=False, error="not in this generation's group", seconds=0.0)
                elif isinstance(message, _wire.Reconfigure):
                    if message.trouble:
                        self._recorder.dump_on_trouble(f"generation {generation} ended: {message.reason}")
                    self._plane.leave(message.reason, failed=message.fresh)
                    if self.member_id not in message.members:
                        self._rec.record("evict", generation=message.next_generation).complete()
                        raise Evicted(f"evicted from the channel ({message.reason})", channel=self.channel,
                                      member=self.member_id, generation=generation)
                    generation, members = message.next_generation, message.members
                    entered, pending = self._enter(generation, members)
                elif isinstance(message, _wire.Commit):
                    if message.generation == generation and self._hooks.on_commit(message.version):
                        self._commits.on_commit(message, self._expose, lambda: self._slots.version, self._client,
                                                self.member_id, self._rec)
                elif isinstance(message, _wire.Abandon):
                    continue  # for a version given up on; its receive (if any) already ended
                elif isinstance(message, _wire.Shutdown):
                    self._clean_shutdown = True  # an orderly end, not trouble: no dump
                    raise PublisherGone(f"publisher shut down: {message.reason}", channel=self.channel,
                                        member=self.member_id)
        except StoreTimeout as err:
            raise PublisherGone(f"no word from the publisher: {err}", channel=self.channel,
                                member=self.member_id) from err
        except ControlFailure as err:
            if self._client.dropped:  # the publisher's notice came before the close: see transport.heartbeat
                raise heartbeat.dropped(self._client, self.channel, self.member_id) from err
            if not self.closing.is_set():
                raise PublisherGone(f"channel failed: {err}", channel=self.channel, member=self.member_id) from err
        finally:
            self._plane.leave("subscriber stopped")

    def _receive(self, announce: _wire.Announce) -> None:
        """Receive one announced version: land it (:mod:`.landing`), move and decode its buckets,
        check them against the Seal, expose or stage it, and acknowledge (failed, on the wire's
        failures: :data:`RECEIVE_FAILURES`)."""
        manifest = announce.manifest
        t0 = time.monotonic()
        entry = self._rec.record("receive", generation=announce.generation, version=announce.version,
                                 nbytes=manifest.total_bytes).start()
        ok, error, corrupt = False, "", False
        spent = _Spent()
        self._commits.staged = None  # whatever waited for a Commit is overwritten now: it was given up on
        try:
            landing, ranges, wire = self._land(announce)
            sums = self._move(announce, landing, ranges, wire, spent)
            if announce.checksum:  # the Seal comes when the whole broadcast is done: waiting for it is not ours
                assert self.deadlines is not None
                seals.verify(self._client, announce, sums, self.deadlines.seal(), self._rec, self.member_id)
                spent.sealing = time.monotonic() - spent.moving - spent.in_move
            self._settle(announce, landing, sums, t0)
            ok = True
            entry.complete()
        except RECEIVE_FAILURES as err:
            error = str(err)
            entry.fail(err)
            self.tally.count("receive_failures")
            if isinstance(err, ChecksumMismatch):
                self.tally.count("checksum_failures")
                corrupt = True
            self._recorder.dump_on_trouble(f"version {announce.version} not received: {err}")
        seconds = time.monotonic() - t0
        # own time: everything but waiting on others (preparing the slot, checking buckets, a
        # busy host). Not ours: the collective, and the publisher's Seal, which comes when the
        # whole broadcast is done; in gloo's tree a leaf finishes early and waits for it.
        own = max(seconds - spent.in_move - spent.sealing, 0.0) + spent.checking
        if self._plane is not None and self._plane.moves_alone:  # no peer to wait on in move (a copy)
            own = max(seconds - spent.sealing, 0.0)
        self._acknowledge(announce, ok=ok, error=error, seconds=seconds, own=own, corrupt=corrupt)

    def _land(self, announce: _wire.Announce) -> tuple[Landing, list[tuple[int, int]], seam.WirePlan]:
        """Where ``announce``'s buckets land, their staged ranges, and the wire form the plane
        receives (decoded into the landing's buckets before each digest)."""
        assert self._plane is not None and self.deadlines is not None
        manifest, assembly = announce.manifest, announce.assembly
        if assembly is not None and assembly.rank != self.lane:
            raise ProtocolError(f"trainer rank {self.lane}'s lane announced rank {assembly.rank}'s part")
        ranges = (layout.bucket_ranges(manifest.total_bytes, announce.bucket_bytes) if assembly is None
                  else sharding.bucket_plan(manifest, announce.bucket_bytes))
        landing = self._targets.land(announce, ranges, self._plane, self.deadlines.readers(),
                                     ahead=self.deadlines.settings.activation != "all")
        if len(ranges) != announce.num_buckets:
            raise ProtocolError(f"announced {announce.num_buckets} buckets, layout has {len(ranges)}")
        if announce.checksum and announce.digest not in KINDS:
            raise ProtocolError(f"version {announce.version} is sealed with digest {announce.digest[:32]!r}, "
                                f"which this member does not have (it has {sorted(KINDS)})")
        told = seals.told_sizes(self._client, announce, ranges, self.deadlines.bucket, self.aborting)
        base, placer = self._targets.base(self._held, landing.placer), landing.placer
        try:
            decoder = registry.decoder(announce.coding.name)
            if isinstance(placer, slicing.SlicePlacer) and placer.segments:
                # a sliced member's share is cut into its own segments (only built-in deltas go to one)
                wire = decoder.plan(announce, landing.buckets, base, told, segments=placer.segments.__getitem__)
            else:
                wire = (decoder.plan(announce, landing.buckets, base) if told is None
                        else decoder.plan(announce, landing.buckets, base, told))
        except KeyError:
            raise ProtocolError(f"version {announce.version} is in encoding {announce.coding.name[:32]!r}, "
                                "which this member does not have") from None
        told_wire = announce.coding.wire
        if told_wire and tuple(b.numel() for b in wire.wire) != told_wire:
            raise ProtocolError(f"version {announce.version}: wire buckets of {list(told_wire)[:4]} bytes, "
                                f"the decoder planned {[b.numel() for b in wire.wire][:4]}")
        return landing, ranges, wire

    def _move(self, announce: _wire.Announce, landing: Landing, ranges: list[tuple[int, int]],
              wire: seam.WirePlan, spent: _Spent) -> list[int]:
        """Move the version's buckets through the plane, each decoded, digested and placed as it
        comes; returns their digests (none unchecked). A version the decoder could not rebuild is
        refused as corrupt."""
        assert self._plane is not None and self.deadlines is not None
        sums: list[int] = []
        last = [time.monotonic()]
        verify, kind, decode, buckets = announce.checksum, announce.digest, wire.hook, landing.buckets
        placer, ahead = landing.placer, landing.ahead
        # test faults hit the wire; read in place there is none (the publisher's memory is
        # read-only here): they get a copy of the bucket's head, and what they change goes nowhere
        faulty = type(self._hooks) is not Hooks and landing.in_place is not None

        def after(i: int) -> None:  # bucket i is here; bucket i+1 is on the wire meanwhile
            began = time.monotonic()
            bucket = wire.wire[i][:64].clone() if faulty else wire.wire[i]
            self._hooks.after_bucket(announce.version, i, bucket, began - last[0])
            decoding = time.monotonic()  # the fault hooks' time is not the decode's
            if decode is not None:
                decode(i)
            decoded = time.monotonic()
            if verify and ahead is not None:  # one read: each piece digested, then written while in cache
                sums.append(ahead.digest_and_write(*ranges[i], kind) if buckets[i].numel() else 0)
            elif verify:
                sums.append(checksum(buckets[i], kind) if buckets[i].numel() else 0)
            self.tally.spent(decoded - decoding if decode is not None else 0.0, time.monotonic() - decoded)
            if placer is not None:
                placer.place(i)
            if ahead is not None:
                ahead.upto(ranges[i][1])
            last[0] = time.monotonic()
            spent.checking += last[0] - began

        # anything new in our queue mid-transfer means the publisher gave up on this version
        spent.moving = time.monotonic()
        try:
            self._plane.move(Transfer(announce.version, wire.wire, self.deadlines.bucket, before=wire.before,
                                      after=after,
                                      cancelled=lambda: self.aborting.is_set() or not self._client.commands.empty(),
                                      announce=announce, encoding=announce.coding.name, base=announce.coding.base))
        finally:
            spent.in_move = time.monotonic() - spent.moving
        if wire.check is not None:
            try:
                wire.check()
            except ChecksumMismatch as err:
                self._rec.record("checksum", generation=announce.generation, version=announce.version).fail(err)
                log.warning("%s: version %d: its delta against version %d did not apply (%s); not made readable "
                            "(the publisher re-sends it in full)", self.member_id, announce.version,
                            announce.coding.base, err)
                raise
        return sums

    def _settle(self, announce: _wire.Announce, landing: Landing, sums: list[int], t0: float) -> None:
        """The verified version: a lane's part is done (readable once every lane's is); a whole
        version or a sliced share is exposed, or staged for the Commit (``activation="all"``)."""
        assert self.deadlines is not None
        manifest, assembly, verify = announce.manifest, announce.assembly, announce.checksum
        # what a delta against this version must name: only what was verified is a base
        digest = seam.base_digest(announce.version, sums) if verify else b""
        if assembly is not None:
            # this lane's part, verified: a base for the next one once the whole version is readable
            self._held = Held(announce.version, digest, manifest, assembly, sliced=self.want is not None) \
                if verify else None
            if self._slots.part_done(self.lane, assembly.world, announce.version, landing.epoch):
                self._rec.record("publish", generation=announce.generation, version=announce.version,
                                 nbytes=assembly.manifest.total_bytes).complete()
                self.tally.received(assembly.manifest.total_bytes, time.monotonic() - t0)
                self._on_publish()
            return
        if self._slots.version is not None and announce.version <= self._slots.version:
            return
        # only a whole slot, proven by its digests, is a base
        held = Held(announce.version, digest, manifest if self.want is not None else None,
                    sliced=self.want is not None) if verify else None
        staged = Staged(announce.generation, announce.seq, announce.version, manifest.total_bytes, t0, held)
        if self.deadlines.settings.activation == "all":
            self._commits.staged = staged  # readable only on the publisher's Commit
            self._rec.record("stage", generation=announce.generation, version=announce.version,
                             nbytes=manifest.total_bytes).complete()
            self._hooks.after_stage(announce.version)
            return
        if landing.ahead is not None:
            landing.ahead.finish()  # before it is readable: the waiting get_into finds it written
        self._expose(staged)

    def _expose(self, staged: Staged) -> None:
        """The verified version in the receiving slot becomes readable, atomically."""
        self._slots.publish(staged.version)
        self._held = staged.held
        self._rec.record("publish", generation=staged.generation, version=staged.version,
                         nbytes=staged.nbytes).complete()
        log.debug("%s: version %d readable (%d bytes)", self.member_id, staged.version, staged.nbytes)
        self.tally.received(staged.nbytes, time.monotonic() - staged.began)
        self._on_publish()

    def _acknowledge(self, announce: _wire.Announce, *, ok: bool, error: str, seconds: float, own: float = 0.0,
                     corrupt: bool = False) -> None:
        ack = _wire.Ack(generation=announce.generation, seq=announce.seq, member_id=self.member_id,
                        version=announce.version, ok=ok, seconds=seconds, own_seconds=own, error=error[:300],
                        corrupt=corrupt, still_read=self._slots.still_read() if ok else -1,
                        leaving=not ok and self.aborting.is_set())
        try:
            self._client.send(ack)
        except ControlFailure:
            pass

    def _leave(self) -> None:
        try:
            self._client.goodbye(_wire.Leave(member_id=self.member_id))
        except ControlFailure:
            pass

    # the heartbeat thread --------------------------------------------------------------------
    def heartbeat_main(self) -> None:
        self._heartbeat.main()
