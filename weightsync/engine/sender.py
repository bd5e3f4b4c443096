"""The Sender: the publisher's thread that owns staging, membership, generations and the data plane.

It keeps a version's order and nothing else: take a version, ask the bases what each member can
decode, announce, move, seal, collect, report. Everything that reaches it arrives as an event
on its one queue (:mod:`~weightsync.engine.events`); only this thread applies membership
requests, so one place decides who is in. While it waits for replies (Ready, Ack) it keeps
applying events (``_pump``), and producers push a ``Wake`` into the replies queue so such a wait
notices at once. What each version's outcome costs whom lives elsewhere:

- the send side (:mod:`~weightsync.planes.sendside`): one part per plane, each member served by its own;
- the delta bases (:class:`~weightsync.encodings.delta.SendBases`): who holds which version, ``"auto"``'s
  measures, ``copy=False``'s kept copy;
- same-host readers' leases (:class:`~weightsync.planes.shm.send.InPlaceLeases`);
- slow members and corrupting relays (:class:`~weightsync.membership.scoring.Scoring`);
- the Commit of ``activation="all"`` (:mod:`~weightsync.engine.activation`);
- the retry policy, what failed and what next (:mod:`~weightsync.engine.retry`).

States (``Sender.state``), and who moves them::

    NEW --start--> RUNNING --Drain--> DRAINING --nothing pending--> STOPPED
                      └──────────── Abort / end ──────────────────────┘
    any --unexpected error in the thread--> FAILED   (Sender.fatal holds it; first error wins)

A peer's failure rebuilds the generation without the culprits and re-sends; a failure of our own
(a ``copy=False`` tensor that cannot be packed) fails that put and blames nobody.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from weightsync import _wire
from weightsync._errors import Cancelled, ControlFailure, LocalFailure, PeerFailure
from weightsync.encodings.delta import KeptBase, SendBases
from weightsync.engine import activation, reports, retry
from weightsync.engine.events import Abort, Drain, Event, Evict, Join, Leave, PutCommitted
from weightsync.engine.lifecycle import Latch
from weightsync.engine.staging import BucketBuffers, Job, Staging, bucket_slices
from weightsync.errors import WeightSyncError
from weightsync.format import layout, sharding
from weightsync.format.checksum import checksum
from weightsync.membership.generations import Control, Generations, Rendezvous
from weightsync.membership.membership import MemberInfo, Membership, StragglerPolicy
from weightsync.membership.scoring import Scoring
from weightsync.options import Deadlines, usable_cpus
from weightsync.planes.dataplane import DataPlane, Outgoing, Prepared, PublisherContext, SendPart
from weightsync.planes.sendside import SendSide
from weightsync.planes.shm.send import InPlaceLeases
from weightsync.recorder.recorder import FlightRecorder
from weightsync.statistics import PublisherTally

#: before a version moves, the last probes may take this long to be answered: a probe that shares
#: a link with a version's buckets times the buckets (a relay receiving first was scored 8x slow)
PROBE_SETTLE = 0.2

log = logging.getLogger("weightsync.publisher")
PUBLISHER = "publisher"


class SenderState(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


class _PutFailed(Exception):
    """The version could not be sent because of our own side (its put fails, nobody is blamed)."""


class Sender:
    """Owns the sender thread; see the module docstring for its events and states.

    Args:
        channel: the channel name.
        settings: what members are told at admission (bucket size, deadlines, checksums).
        staging: latest-wins snapshot buffers (``put`` writes them from the event loop).
        membership: the member set; this thread is its only writer of requests.
        recorder: the flight recorder.
        policy: what to do about slow members.
        control: the control server (replies, sending to members, closing their connections).
        table: the data plane's rendezvous table.
        make_plane: builds this end's group plane (called on the sender thread).
        slot_device: where bucket buffers for ``copy=False`` puts live.
        on_change: called after every generation change (wakes ``wait_subscribers``).
        on_evicted: called for every member dropped (the orchestrator may replace it).
        planes: the transports served (each a plane's publisher part, :mod:`~weightsync.planes.sendside`).
        plane_objects: what those parts are built with beyond the Sender's own (the shared-memory
            segments).
        buckets: the two ``copy=False`` bucket buffers (default: plain memory on ``slot_device``;
            a CPU publisher's live in a shared-memory segment, ``PlaneSet.buckets``).
    """

    def __init__(self, channel: str, *, settings: _wire.ChannelSettings, staging: Staging, membership: Membership,
                 recorder: FlightRecorder, policy: StragglerPolicy, control: Control, table: Rendezvous,
                 make_plane: Callable[[], DataPlane],
                 slot_device: torch.device, on_change: Callable[[], None],
                 on_evicted: Callable[[MemberInfo], None], planes: tuple[str, ...] = ("group",),
                 plane_objects: dict[str, Any] | None = None, buckets: BucketBuffers | None = None,
                 tally: PublisherTally | None = None, encoding: str = "full", digest: str = "crc32c",
                 lane: tuple[int, int] = (0, 1)) -> None:
        self.channel = channel
        self.settings = settings
        self.checksum = settings.checksum  # per version: the publisher may turn it off and on
        self.digest = digest  # which function (format.checksum.KINDS), named in every Announce
        self.encoding = encoding  # how versions go on the wire where a plane carries it (transport.encoding)
        self.lanes: tuple[str, ...] = ()  # a sharded publisher's rank 0: the other ranks' addresses
        self.lane = lane  # (rank, world size) of a sharded publisher's rank; (0, 1) unsharded
        self.deadlines = Deadlines(settings)
        self.staging = staging
        self.membership = membership
        self.policy = policy
        self.state = SenderState.NEW
        self.fatal = Latch()
        self.aborting = threading.Event()
        self._recorder = recorder
        self._rec = recorder.scope(channel, PUBLISHER)
        self._make_plane = make_plane
        self.control, self._table = control, table
        self._on_change = on_change
        self._on_evicted_cb = on_evicted
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._planes, self._plane_objects = planes, dict(plane_objects or {})
        self._buckets = buckets or BucketBuffers(slot_device)
        self.side: SendSide | None = None  # built on the sender thread
        self._evicted_lock = threading.Lock()
        self._evicted: list[MemberInfo] = []
        self._gens: Generations | None = None
        self.tally = tally or PublisherTally(channel)
        self.bases = SendBases(self._buckets.device)  # who holds what a delta can go against
        #: the encoders' threads (Outgoing.workers), made as work comes, stopped with this sender
        self.workers = ThreadPoolExecutor(min(8, usable_cpus()), thread_name_prefix=f"ws-{channel}-encode")
        # the versions same-host members read in place (staging asks it, from any thread)
        self.leases = InPlaceLeases(lambda: self.membership.members, lambda m: self.submit(Evict(m, "slow")), self._rec)
        self.scoring = Scoring(channel, membership, policy, control, self._rec, sharded=lane[1] != 1)
        self.outcomes = reports.Outcomes(channel, staging, membership, self.tally)  # each put resolved

    # any thread ---------------------------------------------------------------------------
    def submit(self, event: Event) -> None:
        """Hand ``event`` to the sender thread (see the module docstring)."""
        if isinstance(event, Abort):
            self.aborting.set()
        self._events.put(event)
        if not isinstance(event, PutCommitted):  # a wait for replies must apply membership changes now
            self.control.replies.put(_wire.Wake(reason=type(event).__name__))

    @property
    def evicted(self) -> list[MemberInfo]:
        """Every member dropped so far, with why (a copy)."""
        with self._evicted_lock:
            return list(self._evicted)

    def set_lanes(self, lanes: tuple[str, ...]) -> None:
        """Rank 0 of a sharded publisher: the other ranks' addresses, told to every member admitted from now."""
        self.lanes = lanes
        if self._gens is not None:
            self._gens.lanes = lanes

    # the sender thread --------------------------------------------------------------------
    def main(self) -> None:
        self.state = SenderState.RUNNING
        self.side = side = SendSide(self._planes, PublisherContext(
            self.channel, control=self.control, recorder=self._recorder, scope=self._rec, deadlines=self.deadlines,
            buckets=self._buckets, make_plane=self._make_plane, extra=self._plane_objects))
        self._gens = Generations(self.channel, control=self.control, table=self._table, membership=self.membership,
                                 recorder=self._recorder, plane=side.plane, settings=self.settings,
                                 stopped=self.aborting.is_set, on_change=self._generation_formed,
                                 on_evicted=self._record_evicted, pump=self._pump, in_group=side.in_group)
        self._gens.lanes = self.lanes  # set_lanes may come later (rank 0 of a sharded publisher)
        self._gens.lane = self.lane
        try:
            self._run(self._gens)
            self.state = SenderState.STOPPED
        except Exception as err:  # noqa: BLE001 - recorded and surfaced by put() (Closed from it)
            fatal = err if isinstance(err, WeightSyncError) else WeightSyncError(
                f"sender stopped: {type(err).__name__}: {err}", channel=self.channel)
            self.fatal.set(fatal)
            self._rec.record("sender").fail(fatal)
            self.state = SenderState.FAILED
            in_flight = self.staging.in_flight
            for job in [*self.staging.drain(), *([in_flight] if in_flight is not None else [])]:
                job.handle.resolve_threadsafe(error=fatal)
        finally:
            self._gens.shutdown()
            side.close()
            self.workers.shutdown(wait=False, cancel_futures=True)

    def _run(self, gens: Generations) -> None:
        st = self.staging
        while True:
            self._next_events(self.settings.heartbeat_interval)
            if self.aborting.is_set() or (self.state is SenderState.DRAINING and st.pending is None):
                return
            if self.membership.has_requests() or self.membership.has_dead_members():
                gens.advance(reason="membership change")
                retained = st.retained
                if retained is not None and st.pending is None and self.membership.lacking(retained.version):
                    self._send(gens, retained)
            job = st.take()
            if job is not None:
                self._send(gens, job)

    def _next_events(self, timeout: float) -> None:
        """Wait (at most ``timeout``) for an event unless work is already pending; apply all."""
        if self.staging.pending is None and not self.membership.has_requests():
            try:
                self._apply(self._events.get(timeout=timeout))
            except queue.Empty:
                pass
        self._pump()

    def _pump(self) -> None:
        """Apply every queued event now (also called while waiting for replies)."""
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return
            self._apply(event)

    def _apply(self, event: Event) -> None:
        assert self._gens is not None
        if isinstance(event, Join):
            assert self.side is not None
            refused = self.side.refusal(event.transport, event.want, self.staging.published)
            if refused is not None:  # its boxes do not fit what this channel publishes
                self.control.send(event.incarnation, _wire.Deny(reason=refused, kind="want"))
                self._rec.record("admit", peers=(event.member_id,)).fail(refused)
                return
            if not self.membership.request_join(event.member_id):
                self.control.send(event.incarnation, _wire.Deny(
                    reason=f"member id {event.member_id!r} is already in the channel", kind="duplicate"))
                self._rec.record("admit", peers=(event.member_id,)).fail("duplicate member id")
                return
            # from now on the control server speaks for this member through this connection;
            # one that hung up meanwhile is found dead by the next plan
            self.control.bind(event.incarnation)
            # the part serving its transport; ids no longer in the channel are forgotten here, so
            # the parts hold at most the current members
            assert self.side is not None
            self.side.retain(self.membership.is_member_or_joining)
            self.side.admit(event.member_id, event.transport, event.want)
            self.bases.forget(event.member_id)  # a newcomer, a replacement, a rejoin: no base known
            self.leases.forget(event.member_id)
            self._gens.register(event.member_id, event.incarnation, host=event.host, pid=event.pid,
                                transport=event.transport)
        elif isinstance(event, Leave):
            self.membership.request_leave(event.member_id)
            self._rec.record("leave", peers=(event.member_id,)).complete()  # fr analyze: not a culprit
        elif isinstance(event, Evict):
            self.membership.request_evict(event.member_id, event.reason)
        elif isinstance(event, Drain) and self.state is SenderState.RUNNING:
            self.state = SenderState.DRAINING

    def _generation_formed(self) -> None:
        self.tally.count("generations")
        self._on_change()

    def transport_of(self, member: str) -> str:
        """The transport ``member`` joined with (the plane serving it); any thread."""
        return "group" if self._gens is None else self._gens.transport_of(member)

    def _record_evicted(self, member: MemberInfo) -> None:
        with self._evicted_lock:
            self._evicted.append(member)
        self.tally.evicted(member.reason)
        self._on_evicted_cb(member)

    def _reads_in_place(self, member: str) -> bool:
        assert self.side is not None
        return self.side.part_of(member).reads_in_place

    # one version --------------------------------------------------------------------------
    def _send(self, gens: Generations, job: Job) -> None:
        """Send ``job`` until an attempt succeeds or no rule allows another (:func:`.retry.verdict`)."""
        error: BaseException | None = None
        attempt = retry.Attempt()
        while attempt.tries < attempt.budget:
            attempt.tries += 1
            try:
                failed = self._send_once(gens, job, direct=attempt.direct, full=attempt.full)
            except _PutFailed as err:
                # our side failed mid-version: the generation is in an unknown state, so it is
                # rebuilt, with nobody to blame; the put fails with what went wrong
                gens.advance(reason=f"version {job.version} abandoned", failed=())
                error = err.__cause__
                break
            step = retry.verdict(attempt, job, failed, gens, bases=self.bases, scoring=self.scoring,
                                 members=self.membership.members, leavers=self._leavers)
            if step == "done":
                retry.done(attempt, job, gens)
                return
            if step == "stop" or not retry.prepare_next(step, attempt, job, gens, bases=self.bases, tally=self.tally,
                                                        rec=self._rec, channel=self.channel):
                break  # nothing to re-send from: a delta that did not apply, or copy=False tensors let go
        self.outcomes.finish(job, time.monotonic(), error)

    def _send_once(self, gens: Generations, job: Job, direct: bool = False, full: bool = False) -> set[str] | None:
        """Announce and move ``job`` once; None on success, else the members to blame.

        Every member is served by its plane's part of the send side (``direct``: asked to send each
        member its bytes straight, finding a corrupting relay; ``full``: no delta); every member
        checks the Seal.
        """
        job.wait_ready(self._buckets.device)
        kept = self.bases.keep_for(job, job.encoding or self.encoding)
        if kept is not None and job.released.is_set() and kept.version == job.version and not job.whole_spill():
            # its tensors were let go: sent again from the kept copy
            job.spill, job.spill_base, job.spill_at = kept.flat, 0, 0
        # in the generation's group order first: point-to-point sends address members by their rank
        # there (position + 1), and a sharded publisher's lanes order their groups (lane_order)
        group = gens.group_of(self.membership.members)
        members = group + tuple(m for m in self.membership.members if m not in group)
        gen, seq = self.membership.generation, gens.next_seq()
        t0 = time.monotonic()
        out, by, fields = self._prepare(gens, job, members, gen, seq, direct=direct, full=full, kept=kept)
        unchecked = {part for part, got in fields.items() if not got.checked}
        if out.checksum and by and not set(by) - unchecked:
            out.checksum = False  # digests only where a part's members check them (a sealed snapshot is not checked)
        try:
            sums = self._transfer(gens, job, out, by, fields, members, gen, seq, unchecked)
            # members of a part that moves nothing read on their own, after it: their bytes' time too
            alone = self.deadlines.read_alone(job.manifest.total_bytes) if any(not p.drives for p in by) else 0.0
            acked, failed = gens.collect_acks(gen, seq, members, job.version, self.deadlines.acknowledgements() + alone)
        except LocalFailure as err:
            self._abandon(gens, job, gen, seq, members, err)
            raise _PutFailed(str(err)) from err
        except (PeerFailure, Cancelled, ControlFailure) as err:
            return self._abandon(gens, job, gen, seq, members, err)
        finally:
            out.close()
            job.encode_seconds += out.encode_seconds
        return self._acknowledged(gens, job, out, by, fields, members, (gen, seq, t0), sums, acked, failed)

    def _prepare(self, gens: Generations, job: Job, members: tuple[str, ...], gen: int, seq: int, *,
                 direct: bool, full: bool, kept: KeptBase | None
                 ) -> tuple[Outgoing, dict[SendPart, tuple[str, ...]], dict[SendPart, Prepared]]:
        """The attempt's Outgoing, its members split by part, and each part's Announce fields."""
        assert self.side is not None
        ranges = (layout.bucket_ranges(job.manifest.total_bytes, self.settings.bucket_bytes) if job.assembly is None
                  else sharding.bucket_plan(job.manifest, self.settings.bucket_bytes))
        slices, before = (bucket_slices(job, ranges, self._buckets, self.settings.bucket_bytes, self.deadlines.bucket)
                          if members else ([], None))
        out = Outgoing(job.version, gen, seq, slices, ranges, job.manifest, job.assembly, job.flat, job.progress,
                       self.settings.bucket_bytes, self.checksum, self.deadlines.bucket, self._generation_broken,
                       before=before, point_to_point=direct, encoding="full" if full else job.encoding or self.encoding,
                       base=None if full else self.bases.base(job, self.staging.base, kept),
                       prefer_full=self.bases.chooser.prefer_full(), digest=self.digest, keeps_base=kept is not None,
                       workers=self.workers,
                       sealed=job.digests if job.assembly is None and len(job.digests or ()) == len(ranges) else None)
        by = self.side.split(members)
        # an encoder that sizes its wire buckets as it makes them tells the members each one's length
        out.tell_sizes = lambda first, sizes, to=None: gens.tell(out.receivers if to is None else to, _wire.WireSizes(
            generation=gen, seq=seq, version=job.version, first=first, sizes=sizes))
        try:
            fields = self.side.prepare(out, by)
        except LocalFailure as err:
            out.close()
            self._rec.record("send", generation=gen, version=job.version).fail(err)
            raise _PutFailed(str(err)) from err
        if out.full_reason:
            log.debug("channel %r: version %d goes full, not %r: %s", self.channel, job.version, out.encoding,
                      out.full_reason)
        self.bases.sent(fields)
        if kept is not None and members and job.spill is not kept.flat:
            kept.refill(out, job.version)  # each bucket into the kept copy once packed and encoded
        return out, by, fields

    def _transfer(self, gens: Generations, job: Job, out: Outgoing, by: dict[SendPart, tuple[str, ...]],
                  fields: dict[SendPart, Prepared], members: tuple[str, ...], gen: int, seq: int,
                  unchecked: set[SendPart]) -> list[int]:
        """Announce (one per part: each names what its members read), move, Seal; returns the staged
        buckets' digests (the Seal's, and what names this version as a base)."""
        assert self.side is not None
        verify, nbuckets = out.checksum, len(out.ranges)
        announce = _wire.Announce(generation=gen, seq=seq, version=job.version, manifest=job.manifest,
                                  bucket_bytes=self.settings.bucket_bytes, num_buckets=nbuckets,
                                  resend=job.resends > 0, checksum=verify, assembly=job.assembly, digest=out.digest)
        job.resends += 1
        self.control.settle_probes(PROBE_SETTLE)
        self.control.begin_transfer()
        job.started = job.started or time.monotonic()
        delta = self.bases.sent_delta
        entry = self._rec.record("announce", generation=gen, version=job.version, nbytes=job.manifest.total_bytes,
                                 peers=members, encoding="delta" if delta else "full",
                                 digest=out.digest if verify else "",
                                 base=out.base.version if delta and out.base else -1).start()
        sums: list[int] = []
        self.side.announce(gens.tell, announce, by, fields)
        entry.complete()
        if members:
            # each bucket's digest is taken once it is on the wire, while the next one transfers;
            # a member known dead (its connection closed, or silent past its bound) ends the wait
            # for it now: the transfer is abandoned and re-sent to the rest, not left to time out
            if verify:
                staged, slices = out.staged_digests, out.buckets  # an encoder that read every staged bucket took them
                out.afters.append(lambda i: sums.append(staged[i] if staged else checksum(slices[i], out.digest)))
            self.side.move(out, by)
            if verify:
                self.side.seal(gens.tell, _wire.Seal(generation=gen, seq=seq, version=job.version, checksums=()),
                               by, unchecked, sums)
        if job.flat is None:
            job.release()
        return sums

    def _acknowledged(self, gens: Generations, job: Job, out: Outgoing, by: dict[SendPart, tuple[str, ...]],
                      fields: dict[SendPart, Prepared], members: tuple[str, ...],
                      at: tuple[int, int, float], sums: list[int], acked: set[str],
                      failed: set[str]) -> set[str] | None:
        """What the acknowledgements say: who holds what, who was slow, the Commit; None on success."""
        gen, seq, t0 = at
        commits = self.settings.activation == "all"  # acked means staged: held only once committed
        self.leases.acknowledged(job, members, acked, gens.last_still_read, self._reads_in_place, staged=commits)
        assert self.side is not None
        forms = reports.forms(job, by, fields, out.wire_bytes(), self.side.wire_of(by))
        job.members_done |= acked
        digests = tuple(sums) if out.checksum and len(sums) == len(out.ranges) else None
        if digests is not None and job.flat is not None:
            job.digests = digests  # what names this version (a lane: this rank's part) as the next one's base
        self.bases.acknowledged(job, out, acked, self.side.digests(by), digests, verify=out.checksum, staged=commits)
        for member in acked:
            job.forms[member] = forms[member]
        if acked and not failed:
            self.bases.chooser.note(self.bases.sent_delta, job.manifest.total_bytes, time.monotonic() - t0)
        self.scoring.score(gens.last_timings, acked, job.version, job.manifest.total_bytes, self.side.part_of)
        if failed:
            if not self._leavers(failed):
                self._recorder.dump_on_trouble(f"version {job.version}: no acknowledgement from {sorted(failed)}")
            return failed
        arrivals = gens.last_arrivals
        if commits:
            exposers = tuple(sorted(acked))
            arrivals = activation.commit(gens, job, gen, seq, exposers, deadline=self.deadlines.acknowledgements(),
                                         membership=self.membership, scope=self._rec, channel=self.channel)
            self.leases.committed(job.version, exposers)
            job.members_done -= acked - set(arrivals)  # the report names only those that exposed it
            self.bases.committed(arrivals)
        job.exposure_spread = max(arrivals.values()) - min(arrivals.values()) if arrivals else 0.0
        self.outcomes.finish(job, t0)
        return None

    def _generation_broken(self) -> bool:
        return self.aborting.is_set() or self.membership.has_dead_members()

    def _abandon(self, gens: Generations, job: Job, gen: int, seq: int,
                 members: tuple[str, ...], err: BaseException) -> set[str]:
        """Tell members the version is given up; returns whom to blame (the silent, else the failed)."""
        self._rec.record("send", generation=gen, version=job.version).fail(err)
        # receivers still waiting on this version give up now (their queue is no longer
        # empty) and acknowledge the failure, so live members answer and silent ones stand out
        # a receiver still in its buckets notices any new command (Abandon) within a wait slice;
        # one past them waits for the Seal
        gens.tell(members, _wire.Abandon(generation=gen, seq=seq, version=job.version))
        gens.tell(members, _wire.Seal(generation=gen, seq=seq, version=job.version, checksums=(), abandoned=True))
        acked, failed = gens.collect_acks(gen, seq, members, job.version, self.deadlines.acknowledgements())
        job.members_done |= acked
        self.leases.acknowledged(job, members, acked, gens.last_still_read, self._reads_in_place,
                                 staged=self.settings.activation == "all")
        blamed = failed or set(members) - acked
        if not self._leavers(blamed):
            self._recorder.dump_on_trouble(f"version {job.version} failed: {err}")
        return blamed

    def _leavers(self, members: set[str]) -> set[str]:
        """Those of ``members`` that are leaving (queued events applied first): a member that aborts
        mid-version breaks the group, says so in its acknowledgement, and sends its Leave next."""
        self._pump()
        return {m for m in members if self.membership.is_leaving(m)}


