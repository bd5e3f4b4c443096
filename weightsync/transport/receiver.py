"""The Receiver: a subscriber's two threads, its receive slots and its data plane.

The *receiver* thread, with its own store connection, in order:

1. ``_join``: push a Join (fingerprint, token) to the publisher's inbox; wait for Admit (which
   carries the channel's settings: every deadline below derives from them) or Deny;
2. ``_enter`` a generation: say Ready (with the data plane's offer), wait for Go (or a
   Reconfigure that replaces the plan), then ``plane.enter``;
3. ``_follow`` this member's queue: Announce -> ``_receive`` (buckets straight into the
   receiving slot, checksums against the Seal, publish atomically, acknowledge); Reconfigure
   -> the next generation or Evicted; Shutdown -> PublisherGone;
4. on close, ``_leave``.

The *heartbeat* thread beats this member's counter and watches the publisher's; a silent
publisher ends everything with PublisherGone.

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
import os
import socket
import threading
import time
from collections.abc import Callable
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
)
from weightsync.errors import (
    AdmissionDenied,
    Closed,
    Evicted,
    HandshakeMismatch,
    PublisherGone,
    SyncTimeout,
    WeightSyncError,
)
from weightsync.pg import handshake
from weightsync.pg.control import ControlPlane
from weightsync.pg.group import GroupPlane
from weightsync.pg.recorder import FlightRecorder
from weightsync.testing import Hooks
from weightsync.transport import layout
from weightsync.transport.checksum import checksum
from weightsync.transport.dataplane import GenerationSpec, Transfer
from weightsync.transport.lifecycle import Latch
from weightsync.transport.options import Deadlines
from weightsync.transport.slots import SlotPair

#: what a receive may fail with and still be acknowledged (as failed): the wire, not a bug
RECEIVE_FAILURES = (PeerFailure, Cancelled, ProtocolError, ControlFailure, LocalFailure)
PRE_ADMISSION_BEAT = 0.25  # seconds between beats until the publisher's interval is known


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
        queue: this incarnation's own command queue on the store.
        backend, device: the data plane's backend and the device receive slots live on.
        secret: the admission secret, or None.
        own_timeout: this end's own bound for joining and for the publisher's silence.
        recorder: the flight recorder.
        slots: the two receive slots readers read from.
        on_publish: called (receiver thread) after a version became readable.
        hooks: test hooks (``weightsync.testing``); the default does nothing.
    """

    def __init__(self, channel: str, member_id: str, *, queue: str, backend: str, device: torch.device,
                 secret: bytes | None, own_timeout: float, join_timeout: float, recorder: FlightRecorder,
                 slots: SlotPair, on_publish: Callable[[], None], hooks: Hooks) -> None:
        self.channel, self.member_id, self.queue = channel, member_id, queue
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
        self._rec = recorder.scope(channel, member_id)
        self._plane: GroupPlane | None = None
        self._clean_shutdown = False

    # terminal state ------------------------------------------------------------------------
    def end(self, error: WeightSyncError) -> None:
        """Any thread: the receiver is over for ``error``'s reason (first one wins)."""
        if self.terminal.set(error):
            self.state = _TERMINAL_STATES.get(type(error), ReceiverState.FAILED)
            if not isinstance(error, Closed) and not self._clean_shutdown:
                self._recorder.dump_on_trouble(f"{type(error).__name__}: {error}")
        self._on_publish()  # wake readers: they raise it

    @property
    def over(self) -> bool:
        return self.terminal.error is not None

    # the receiver thread ---------------------------------------------------------------------
    def main(self, ctl: ControlPlane) -> None:
        try:
            self.state = ReceiverState.JOINING
            generation, members = self._join(ctl)
            self.state = ReceiverState.FOLLOWING
            self.joined.set()
            self._follow(ctl, generation, members)
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
                self._leave(ctl)
            if self._plane is not None:
                self._plane.close()

    def _next_message(self, ctl: ControlPlane, timeout: float, until: Callable[[], bool] | None = None) -> Any:
        """The next message for this member; None when woken to stop (``until()`` says when)."""
        stop = until or (lambda: self.closing.is_set() or self.over)
        while True:
            raw = ctl.pop(self.queue, timeout)
            try:
                message = _wire.member_decoder.decode(raw)
            except Exception as err:  # noqa: BLE001 - never crash on a malformed message
                self._rec.record("command").fail(f"malformed: {err}")
                continue
            if isinstance(message, _wire.Wake):
                if stop():
                    return None
                continue
            return message

    def _join(self, ctl: ControlPlane) -> tuple[int, tuple[str, ...]]:
        entry = self._rec.record("join").start()
        join = _wire.Join(member_id=self.member_id, reply_to=self.queue,
                          fingerprint=handshake.fingerprint(self.backend, self.device),
                          token_mac=handshake.token_mac(self._secret, self.channel, self.member_id),
                          pid=os.getpid(), host=socket.gethostname())
        try:
            ctl.push(ctl.inbox, join)
            reply = self._next_message(ctl, self.join_timeout)
        except StoreTimeout as err:
            entry.fail(err)
            raise SyncTimeout("the publisher did not answer the join", channel=self.channel,
                              member=self.member_id) from err
        if reply is None:
            entry.fail("closed while joining")
            raise Closed("closed while joining", channel=self.channel, member=self.member_id)
        if isinstance(reply, _wire.Deny):
            entry.fail(reply.reason)
            kinds: dict[str, type[WeightSyncError]] = {"handshake": HandshakeMismatch, "closed": PublisherGone}
            raise kinds.get(reply.kind, AdmissionDenied)(f"join refused: {reply.reason}", channel=self.channel,
                                                         member=self.member_id)
        if not isinstance(reply, _wire.Admit):
            entry.fail(f"unexpected {type(reply).__name__}")
            raise WeightSyncError(f"unexpected reply to join: {type(reply).__name__}", channel=self.channel)
        self.deadlines = Deadlines(reply.settings)
        self._plane = GroupPlane(ctl.store, channel=self.channel, member=self.member_id, backend=self.backend,
                                 device=self._slots.device, recorder=self._recorder,
                                 in_place=reply.settings.in_place, slot=reply.slot,
                                 timeout=self.deadlines.rendezvous())
        entry.complete()
        return reply.generation, reply.members

    def _enter(self, ctl: ControlPlane, generation: int, members: tuple[str, ...]) -> Any:
        """Enter ``generation``: None once entered, or the message that replaced the plan.

        The publisher says Go once every member is ready; until then it may abandon the
        generation with a Reconfigure (someone left or died), which is returned instead.
        """
        assert self._plane is not None and self.deadlines is not None
        self.generation, self.rank = generation, members.index(self.member_id) + 1
        ctl.push(ctl.replies, _wire.Ready(generation=generation, member_id=self.member_id,
                                          handle=self._plane.offer()))
        while True:
            # bounded by the publisher's liveness (the heartbeat thread wakes us if it goes),
            # not by a guess at how long the other members take to get ready. Having said Ready,
            # a closing subscriber still goes through with the rendezvous (the publisher may
            # already be in it); only abort() walks away.
            message = self._next_message(ctl, 3600.0, until=lambda: self.aborting.is_set() or self.over)
            if message is None or not isinstance(message, _wire.Go):
                return message
            if message.generation == generation:
                self._plane.enter(GenerationSpec(generation, members, rank=self.rank,
                                                 timeout=self.deadlines.rendezvous(), uuid=message.uuid,
                                                 offers=message.handles))
                return None

    def _follow(self, ctl: ControlPlane, generation: int, members: tuple[str, ...]) -> None:
        assert self._plane is not None
        entered = False
        try:
            pending = self._enter(ctl, generation, members)
            entered = pending is None
            while not self.closing.is_set() or pending is not None:
                message = pending if pending is not None else self._next_message(ctl, 3600.0)
                pending = None
                if message is None:
                    return
                if isinstance(message, _wire.Announce):
                    if entered and message.generation == generation:
                        self._receive(ctl, message)
                elif isinstance(message, _wire.Reconfigure):
                    if message.trouble:
                        self._recorder.dump_on_trouble(f"generation {generation} ended: {message.reason}")
                    self._plane.leave(message.reason, failed=message.fresh)
                    entered = False
                    if self.member_id not in message.members:
                        self._rec.record("evict",
                                         generation=message.next_generation).complete()
                        raise Evicted(f"evicted from the channel ({message.reason})", channel=self.channel,
                                      member=self.member_id, generation=generation)
                    generation, members = message.next_generation, message.members
                    pending = self._enter(ctl, generation, members)
                    entered = pending is None
                elif isinstance(message, _wire.Shutdown):
                    self._clean_shutdown = True  # an orderly end, not trouble: no dump
                    raise PublisherGone(f"publisher shut down: {message.reason}", channel=self.channel,
                                        member=self.member_id)
        except StoreTimeout as err:
            raise PublisherGone(f"no word from the publisher: {err}", channel=self.channel,
                                member=self.member_id) from err
        except (PeerFailure, ControlFailure) as err:
            if not self.closing.is_set():
                raise PublisherGone(f"channel failed: {err}", channel=self.channel, member=self.member_id) from err
        finally:
            self._plane.leave("subscriber stopped")

    def _receive(self, ctl: ControlPlane, announce: _wire.Announce) -> None:
        assert self._plane is not None and self.deadlines is not None
        manifest = announce.manifest
        t0 = time.monotonic()
        entry = self._rec.record("receive",
                                 generation=announce.generation, version=announce.version,
                                      nbytes=manifest.total_bytes).start()
        ok, error, waited = False, "", 0.0
        try:
            flat = self._slots.prepare(manifest, self.deadlines.readers())
            ranges = layout.bucket_ranges(manifest.total_bytes, announce.bucket_bytes)
            if len(ranges) != announce.num_buckets:
                raise ProtocolError(f"announced {announce.num_buckets} buckets, layout has {len(ranges)}")
            buckets = [flat[lo:hi] for lo, hi in ranges]
            sums: list[int] = []
            last = [time.monotonic()]
            verify = self.deadlines.settings.checksum

            def after(i: int) -> None:  # bucket i is here; bucket i+1 is on the wire meanwhile
                self._hooks.after_bucket(announce.version, i, buckets[i], time.monotonic() - last[0])
                if verify:
                    sums.append(checksum(buckets[i]))
                last[0] = time.monotonic()

            # anything new in our queue mid-transfer means the publisher gave up on this version
            waited = self._plane.move(Transfer(announce.version, buckets, self.deadlines.bucket, after=after,
                                               cancelled=lambda: self.aborting.is_set() or ctl.pending(self.queue) > 0))
            if verify:
                self._verify(ctl, announce, sums)
            if self._slots.version is None or announce.version > self._slots.version:
                self._slots.publish(announce.version)
                self._rec.record("publish",
                                 generation=announce.generation, version=announce.version,
                                      nbytes=manifest.total_bytes).complete()
                self._on_publish()
            ok = True
            entry.complete()
        except RECEIVE_FAILURES as err:
            error = str(err)
            entry.fail(err)
            self._recorder.dump_on_trouble(f"version {announce.version} not received: {err}")
        seconds = time.monotonic() - t0
        ack = _wire.Ack(generation=announce.generation, seq=announce.seq, member_id=self.member_id,
                        version=announce.version, ok=ok, seconds=seconds, own_seconds=max(seconds - waited, 0.0),
                        error=error[:300])
        try:
            ctl.push(ctl.replies, ack)
        except ControlFailure:
            pass

    def _verify(self, ctl: ControlPlane, announce: _wire.Announce, sums: list[int]) -> None:
        """Compare our buckets' digests with the publisher's Seal; raises ChecksumMismatch."""
        assert self.deadlines is not None
        deadline = time.monotonic() + self.deadlines.seal()
        while True:
            try:
                raw = ctl.pop(self.queue + "/seal", deadline - time.monotonic())
            except StoreTimeout as err:
                raise PeerFailure(f"no checksums for version {announce.version} within {self.deadlines.seal()}s") \
                    from err
            try:
                seal = _wire.seal_decoder.decode(raw)
            except Exception:  # noqa: BLE001,S112 - a malformed seal is no seal
                continue
            if isinstance(seal, _wire.Seal) and (seal.generation, seal.seq) == (announce.generation, announce.seq):
                break  # older seals belong to versions given up on: skipped
        if seal.abandoned:
            raise ProtocolError(f"the publisher gave up on version {announce.version}")
        bad = [i for i, (mine, theirs) in enumerate(zip(sums, seal.checksums, strict=False)) if mine != theirs]
        if bad or len(sums) != len(seal.checksums):
            self._rec.record("checksum",
                             generation=announce.generation, version=announce.version,
                                  bucket=bad[0] if bad else -1).fail(f"buckets {bad} do not match")
            raise ChecksumMismatch(f"version {announce.version}: buckets {bad} arrived corrupted; not made readable")

    def _leave(self, ctl: ControlPlane) -> None:
        try:
            ctl.push(ctl.inbox, _wire.Leave(member_id=self.member_id))
            ctl.delete(self.queue)
        except ControlFailure:
            pass

    # the heartbeat thread --------------------------------------------------------------------
    def heartbeat_main(self, ctl: ControlPlane) -> None:
        last_seen, since = -1, time.monotonic()
        last_beat = since
        while not self.closing.is_set() and not self.over:
            # a member whose receiver stopped (evicted, failed) stops beating, so the
            # publisher drops it in a few beats instead of waiting for it
            interval = PRE_ADMISSION_BEAT if self.deadlines is None else self.deadlines.settings.heartbeat_interval
            t0 = time.monotonic()
            try:
                ctl.add(ctl.heartbeat_key(self.member_id), 1)
                publisher_beats = ctl.add(ctl.heartbeat_key("publisher"), 0)
            except ControlFailure as err:
                self._publisher_gone(ctl, f"publisher's store stopped answering: {err}")
                return
            # a store that answered late stalled for everyone: the publisher could not beat
            # either (see Membership.sample_heartbeats), so the silence restarts from now
            stalled = time.monotonic() - t0 > interval or t0 - last_beat > 2 * interval + 0.1
            last_beat = time.monotonic()
            silence = (self.own_timeout / 2 if self.deadlines is None
                       else self.deadlines.publisher_silence(self.own_timeout))
            if publisher_beats != last_seen or stalled:
                last_seen, since = publisher_beats, time.monotonic()
            elif time.monotonic() - since > silence:
                self._publisher_gone(ctl, f"publisher silent for {time.monotonic() - since:.1f}s")
                return
            self.closing.wait(interval)
        self._wake(ctl, "closing")

    def _publisher_gone(self, ctl: ControlPlane, reason: str) -> None:
        self.end(PublisherGone(reason, channel=self.channel, member=self.member_id))
        self._wake(ctl, reason)

    def _wake(self, ctl: ControlPlane, reason: str) -> None:
        try:
            ctl.push(self.queue, _wire.Wake(reason=reason))
        except ControlFailure:
            pass  # the receiver's own pop fails the same way and ends

