"""The subscriber's receiver thread: join, follow the publisher's commands, receive, acknowledge.

Runs on its own thread with its own store connection (a torch Store client cannot serve two
blocking waits). In order:

1. ``_join``: push a Join (fingerprint, token) to the publisher's inbox, wait for Admit or Deny;
2. ``_enter`` a generation: say Ready, wait for Go (or a Reconfigure that replaces the plan),
   then build the dedicated group;
3. ``_follow`` this subscriber's queue: Announce -> ``_receive`` (buckets straight into the
   receiving slot, publish atomically, acknowledge); Reconfigure -> the next generation or
   Evicted; Shutdown -> PublisherGone;
4. on close, ``_leave``.

:class:`Subscriber` inherits it; the state it shares is declared below.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

from weightsync import _wire
from weightsync._faults import Faults
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
from weightsync.pg.control import ControlPlane, StoreTimeout, StoreUnreachable
from weightsync.pg.group import DedicatedGroup, Reconfigurable
from weightsync.pg.recorder import FlightRecorder
from weightsync.transport import layout
from weightsync.transport.options import ChannelOptions
from weightsync.transport.slots import SlotPair

DATA_ERRORS = (TimeoutError, RuntimeError, StoreTimeout, ValueError)


class ChecksumMismatch(ValueError):
    """A received bucket does not match the publisher's checksum: the version is dropped."""


class ReceiverLoop:
    """The receiver thread's half of :class:`~weightsync.transport.subscriber.Subscriber`."""

    name: str
    member_id: str
    backend: str
    device: Any
    options: ChannelOptions
    generation: int
    rank: int
    _queue: str
    _slots: SlotPair
    _recorder: FlightRecorder
    _secret: bytes | None
    _closing: threading.Event
    _abort: threading.Event
    _joined: threading.Event
    _join_error: BaseException | None
    _terminal: tuple[type[WeightSyncError], str] | None
    _clean_shutdown: bool
    _faults: Faults | None
    _backend: Reconfigurable | None  # the long-lived backend, when generations re-form in place
    _slot: int  # its rank at creation: unique in the channel, part of its handle

    def _wake(self) -> None:  # provided by Subscriber
        raise NotImplementedError

    def _set_terminal(self, cls: type[WeightSyncError], message: str) -> None:  # provided by Subscriber
        raise NotImplementedError

    def _receiver_main(self, ctl: ControlPlane) -> None:
        try:
            generation, members = self._join(ctl)
            self._joined.set()
            self._follow(ctl, generation, members)
        except WeightSyncError as err:
            if not self._joined.is_set():
                self._join_error = err
                self._joined.set()
            self._set_terminal(type(err), str(err))
        except Exception as err:  # noqa: BLE001 - the thread must end in a state callers can see
            cls = PublisherGone if isinstance(err, (StoreUnreachable, StoreTimeout)) else WeightSyncError
            failure = cls(f"receiver stopped: {type(err).__name__}: {err}", channel=self.name, member=self.member_id)
            self._recorder.record("receiver", channel=self.name, member=self.member_id).fail(failure)
            if not self._joined.is_set():
                self._join_error = failure
                self._joined.set()
            self._set_terminal(cls, str(failure))
        finally:
            if self._closing.is_set() and self._joined.is_set() and self._join_error is None:
                self._leave(ctl)

    def _abandon_rendezvous(self) -> bool:
        return self._abort.is_set() or self._terminal is not None

    def _next_message(self, ctl: ControlPlane, timeout: float, until: Any = None) -> Any:
        """The next message for this subscriber; None when woken to stop (``until()`` says when)."""
        stop = until or self._stopping
        while True:
            raw = ctl.pop(self._queue, timeout)
            try:
                message = _wire.member_decoder.decode(raw)
            except Exception as err:  # noqa: BLE001 - never crash on a malformed message
                self._recorder.record("command", channel=self.name, member=self.member_id).fail(f"malformed: {err}")
                continue
            if isinstance(message, _wire.Wake):
                if stop():
                    return None
                continue
            return message

    def _join(self, ctl: ControlPlane) -> tuple[int, tuple[str, ...]]:
        """Join; on Admit, also create the long-lived backend when the publisher re-forms in place."""
        entry = self._recorder.record("join", channel=self.name, member=self.member_id).start()
        join = _wire.Join(member_id=self.member_id, reply_to=self._queue,
                          fingerprint=handshake.fingerprint(self.backend, self.device),
                          token_mac=handshake.token_mac(self._secret, self.name, self.member_id),
                          pid=os.getpid(), host=socket.gethostname())
        try:
            ctl.push(ctl.inbox, join)
            reply = self._next_message(ctl, 2 * self.options.timeout + self.options.deadline(64 << 20))
        except StoreTimeout as err:
            entry.fail(err)
            raise SyncTimeout("the publisher did not answer the join", channel=self.name,
                              member=self.member_id) from err
        if reply is None:
            entry.fail("closed while joining")
            raise Closed("closed while joining", channel=self.name, member=self.member_id)
        if isinstance(reply, _wire.Deny):
            entry.fail(reply.reason)
            cls: type[WeightSyncError] = HandshakeMismatch if reply.kind == "handshake" else AdmissionDenied
            if reply.kind == "closed":
                cls = PublisherGone
            raise cls(f"join refused: {reply.reason}", channel=self.name, member=self.member_id)
        if not isinstance(reply, _wire.Admit):
            entry.fail(f"unexpected {type(reply).__name__}")
            raise WeightSyncError(f"unexpected reply to join: {type(reply).__name__}", channel=self.name)
        if reply.in_place:
            self._slot = reply.slot
            self._backend = self._new_backend(ctl)
        entry.complete()
        return reply.generation, reply.members

    def _new_backend(self, ctl: ControlPlane) -> Reconfigurable:
        return Reconfigurable(ctl.store, channel=self.name, member=self.member_id, slot=self._slot,
                              timeout=self.options.timeout, recorder=self._recorder)

    def _enter(self, ctl: ControlPlane, generation: int, members: tuple[str, ...]) -> Any:
        """Enter generation ``generation``: a DedicatedGroup, or the message that replaced it.

        The publisher says Go once every member is ready; until then it may abandon the
        generation with a Reconfigure (someone left or died), which is returned instead.
        """
        self.generation, self.rank = generation, members.index(self.member_id) + 1
        handle = self._backend.handle() if self._backend is not None else ""  # changes every reconfigure
        ctl.push(ctl.replies, _wire.Ready(generation=generation, member_id=self.member_id, handle=handle))
        while True:
            # bounded by the publisher's liveness (the heartbeat thread wakes us if it goes),
            # not by a guess at how long the other members take to get ready. Having said Ready,
            # a closing subscriber still goes through with the rendezvous (the publisher may
            # already be in it); only abort() walks away.
            message = self._next_message(ctl, 3600.0, until=self._abandon_rendezvous)
            if message is None or not isinstance(message, _wire.Go):
                return message
            if message.generation == generation and message.handles:
                if self._backend is None:
                    raise WeightSyncError("the publisher re-forms groups in place but admitted us without a slot",
                                          channel=self.name, member=self.member_id)
                return self._backend.enter(generation=generation, uuid=message.uuid, handles=message.handles,
                                           rank=self.rank, peers=members, device=self._slots.device,
                                           timeout=self.options.timeout + self.options.deadline(64 << 20))
            if message.generation == generation:
                return DedicatedGroup.build(
                    ctl.store, channel=self.name, member=self.member_id, generation=generation, rank=self.rank,
                    size=len(members) + 1, backend=self.backend, device=self._slots.device,
                    recorder=self._recorder, peers=members,
                    timeout=self.options.timeout + self.options.deadline(64 << 20))

    def _follow(self, ctl: ControlPlane, generation: int, members: tuple[str, ...]) -> None:
        group: DedicatedGroup | None = None
        pending: Any = None
        try:
            entered = self._enter(ctl, generation, members)
            if isinstance(entered, DedicatedGroup):
                group = entered
            else:
                pending = entered
            while not self._closing.is_set() or pending is not None:
                message = pending if pending is not None else self._next_message(ctl, 3600.0)
                pending = None
                if message is None:
                    return
                if isinstance(message, _wire.Announce):
                    if group is None or message.generation != generation:
                        continue  # for a generation we are not in (stale)
                    self._receive(ctl, group, message)
                elif isinstance(message, _wire.Reconfigure):
                    if message.trouble:
                        self._recorder.dump_on_trouble(f"generation {generation} ended: {message.reason}")
                    if group is not None:
                        group.abort(message.reason)
                        group = None
                    if self.member_id not in message.members:
                        self._recorder.record("evict", channel=self.name, member=self.member_id,
                                              generation=message.next_generation).complete()
                        raise Evicted(f"evicted from the channel ({message.reason})", channel=self.name,
                                      member=self.member_id, generation=generation)
                    if message.fresh and self._backend is not None:  # see Generations.advance
                        self._backend.close()
                        self._backend = self._new_backend(ctl)
                    generation, members = message.next_generation, message.members
                    entered = self._enter(ctl, generation, members)
                    if isinstance(entered, DedicatedGroup):
                        group = entered
                    else:
                        pending = entered
                elif isinstance(message, _wire.Shutdown):
                    self._clean_shutdown = True  # an orderly end, not trouble: no dump
                    raise PublisherGone(f"publisher shut down: {message.reason}", channel=self.name,
                                        member=self.member_id)
        except StoreTimeout as err:
            raise PublisherGone(f"no word from the publisher: {err}", channel=self.name, member=self.member_id) from err
        except DATA_ERRORS as err:
            if not self._closing.is_set():
                raise PublisherGone(f"channel failed: {err}", channel=self.name, member=self.member_id) from err
        finally:
            if group is not None:
                group.abort("subscriber stopped")
            if self._backend is not None:
                self._backend.close()
                self._backend = None

    def _stopping(self) -> bool:
        return self._closing.is_set() or self._terminal is not None

    def _receive(self, ctl: ControlPlane, group: DedicatedGroup, announce: _wire.Announce) -> None:
        manifest = announce.manifest
        t0 = time.monotonic()
        entry = self._recorder.record("receive", channel=self.name, member=self.member_id,
                                      generation=announce.generation, version=announce.version,
                                      nbytes=manifest.total_bytes).start()
        ok, error, waited = False, "", 0.0
        try:
            flat = self._slots.prepare(manifest, self.options.timeout)
            ranges = layout.bucket_ranges(manifest.total_bytes, announce.bucket_bytes)
            if len(ranges) != announce.num_buckets:
                raise ValueError(f"announced {announce.num_buckets} buckets, layout has {len(ranges)}")
            buckets = [flat[lo:hi] for lo, hi in ranges]
            sums: list[int] = []
            last = [time.monotonic()]

            def after(i: int) -> None:  # bucket i is here; bucket i+1 is on the wire meanwhile
                if self._faults is not None:
                    self._faults.after_bucket(announce.version, i, buckets[i], time.monotonic() - last[0])
                if announce.checksum:
                    sums.append(layout.checksum(buckets[i]))
                last[0] = time.monotonic()

            # anything new in our queue mid-transfer means the publisher gave up on this version
            waited = group.broadcast_buckets(buckets, version=announce.version, deadline=self.options.deadline,
                                             op="bucket_recv", after=after,
                                             cancelled=lambda: self._abort.is_set() or ctl.pending(self._queue) > 0)
            if announce.checksum:
                self._verify(ctl, announce, sums)
            if self._slots.version is None or announce.version > self._slots.version:
                self._slots.publish(announce.version)
                self._recorder.record("publish", channel=self.name, member=self.member_id,
                                      generation=announce.generation, version=announce.version,
                                      nbytes=manifest.total_bytes).complete()
                self._wake()
            ok = True
            entry.complete()
        except DATA_ERRORS as err:
            error = str(err)
            entry.fail(err)
            self._recorder.dump_on_trouble(f"version {announce.version} not received: {err}")
        seconds = time.monotonic() - t0
        ack = _wire.Ack(generation=announce.generation, seq=announce.seq, member_id=self.member_id,
                        version=announce.version, ok=ok, seconds=seconds, own_seconds=max(seconds - waited, 0.0),
                        error=error[:300])
        try:
            ctl.push(ctl.replies, ack)
        except StoreTimeout:
            pass

    def _verify(self, ctl: ControlPlane, announce: _wire.Announce, sums: list[int]) -> None:
        """Compare our buckets' digests with the publisher's Seal; raises ChecksumMismatch."""
        deadline = time.monotonic() + self.options.timeout
        while True:
            try:
                raw = ctl.pop(self._queue + "/seal", deadline - time.monotonic())
            except StoreTimeout as err:
                raise TimeoutError(f"no checksums for version {announce.version} within {self.options.timeout}s") \
                    from err
            try:
                seal = _wire.seal_decoder.decode(raw)
            except Exception:  # noqa: BLE001,S112 - a malformed seal is no seal
                continue
            if isinstance(seal, _wire.Seal) and (seal.generation, seal.seq) == (announce.generation, announce.seq):
                break  # older seals belong to versions given up on: skipped
        if seal.abandoned:
            raise RuntimeError(f"the publisher gave up on version {announce.version}")
        bad = [i for i, (mine, theirs) in enumerate(zip(sums, seal.checksums, strict=False)) if mine != theirs]
        if bad or len(sums) != len(seal.checksums):
            self._recorder.record("checksum", channel=self.name, member=self.member_id,
                                  generation=announce.generation, version=announce.version,
                                  bucket=bad[0] if bad else -1).fail(f"buckets {bad} do not match")
            raise ChecksumMismatch(f"version {announce.version}: buckets {bad} arrived corrupted; not made readable")

    def _leave(self, ctl: ControlPlane) -> None:
        try:
            ctl.push(ctl.inbox, _wire.Leave(member_id=self.member_id))
            ctl.delete(self._queue)
        except (StoreTimeout, StoreUnreachable):
            pass
