"""The Sender: the publisher's thread that owns staging, membership, generations and the data plane.

Everything that reaches it arrives as an event on its one queue (:meth:`Sender.submit`):

    PutCommitted   a snapshot is pending in staging            (Publisher.put, event loop)
    Join / Leave   a member passed the door / asked to leave    (control thread)
    Evict          the operator or the policy drops a member    (Publisher.evict, scoring)
    MemberDied     a member's connection closed, or it went silent (control thread)
    Drain          send what is pending, then stop              (Publisher.aclose)
    Abort          stop now (also sets ``aborting``, seen mid-transfer)  (Publisher.abort)

Only this thread applies membership requests, so one place decides who is in. While it
waits for replies (Ready, Ack) it keeps applying events (``_pump``), and producers push a
``Wake`` into the replies queue so such a wait notices at once.

States (``Sender.state``), and who moves them::

    NEW --start--> RUNNING --Drain--> DRAINING --nothing pending--> STOPPED
                      └──────────── Abort / end ──────────────────────┘
    any --unexpected error in the thread--> FAILED   (Sender.fatal holds it; first error wins)

Per version (``_send``): announce, move the buckets through the data plane (checksumming each
while the next is on the wire), Seal, collect acknowledgements, score receive times, resolve
the PutHandle. A peer's failure rebuilds the generation without the culprits and re-sends; a
failure of our own (a ``copy=False`` tensor that cannot be packed) fails that put and blames
nobody.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from weightsync import _wire
from weightsync._errors import Cancelled, ControlFailure, LocalFailure, PeerFailure
from weightsync.errors import WeightSyncError
from weightsync.format import layout, sharding
from weightsync.format.checksum import checksum
from weightsync.membership.blame import RelayBlame
from weightsync.membership.generations import Control, Generations, Rendezvous
from weightsync.membership.membership import MemberInfo, Membership, StragglerPolicy
from weightsync.options import Deadlines
from weightsync.planes.dataplane import DataPlane, Outgoing, PublisherContext
from weightsync.planes.delta import Chooser, KeptBase
from weightsync.planes.encoding import DELTA, Base, base_digest
from weightsync.planes.sendside import SendSide
from weightsync.recorder.recorder import FlightRecorder
from weightsync.statistics import PublisherTally
from weightsync.transport.handles import DeliveryReport
from weightsync.transport.lifecycle import Latch
from weightsync.transport.staging import BucketBuffers, Job, Staging, bucket_slices

PROBE_FROM = 256 << 10  # versions smaller than this are not worth timing links for
PROBE_MAX = 128 << 10
#: before a version moves, the last probes may take this long to be answered: a probe that shares
#: a link with a version's buckets times the buckets (a relay receiving first was scored 8x slow)
PROBE_SETTLE = 0.2

IN_PLACE_KEPT = 3  # versions a same-host member that stopped acknowledging may still read in place

log = logging.getLogger("weightsync.publisher")
PUBLISHER = "publisher"


class SenderState(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


@dataclass(frozen=True)
class PutCommitted:
    version: int


@dataclass(frozen=True)
class Join:
    member_id: str
    incarnation: str  # the member's control connection
    host: str = ""
    pid: int = 0
    transport: str = "group"
    want: tuple[_wire.Want, ...] | None = None  # a sliced member: only these boxes, point to point


@dataclass(frozen=True)
class Leave:
    member_id: str


@dataclass(frozen=True)
class Evict:
    member_id: str
    reason: str


@dataclass(frozen=True)
class MemberDied:
    members: tuple[str, ...]


@dataclass(frozen=True)
class Drain:
    pass


@dataclass(frozen=True)
class Abort:
    pass


Event = PutCommitted | Join | Leave | Evict | MemberDied | Drain | Abort


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
        self._nobody_streak = False  # the last version reached nobody (its warning was logged)
        self._probe_round = 0  # the newest round of link probes a verdict was given on
        self._blame = RelayBlame()  # who corrupted bytes in the broadcast tree, on evidence
        # member -> the version it acknowledged whole last (a delta goes only to members holding its
        # base); forgotten when a member joins again, and when a delta it was sent did not apply
        self._holds: dict[str, int] = {}
        self._shares: dict[str, bytes] = {}  # a sliced member in _holds: the digest of its share of that version
        # same-host members reading snapshots in place: the versions each may read now (the one it
        # acknowledged last, and one it was sent but did not acknowledge); staging parks their buffers
        self._in_place: dict[str, frozenset[int]] = {}
        self._sent_delta = False  # the last attempt sent some member a delta
        self._chooser = Chooser()  # "auto": full or delta, by what each cost this channel lately
        self._kept: KeptBase | None = None  # copy=False with encoding "delta": the copy its deltas are against

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
            self._holds.pop(event.member_id, None)  # a newcomer, a replacement, a rejoin: no base known
            self._shares.pop(event.member_id, None)
            self._in_place.pop(event.member_id, None)
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

    def held(self) -> frozenset[int]:
        """Any thread (staging, under its lock): the versions channel members read in place now."""
        members = set(self.membership.members)
        return frozenset(v for m, versions in list(self._in_place.items()) if m in members for v in versions)

    def overdue(self, version: int) -> None:
        """Any thread (staging, over its bound): evict the members that read ``version`` in place; its
        buffer is written again now (their reads of it fail on its epoch)."""
        members = set(self.membership.members)
        for member, versions in list(self._in_place.items()):
            if version in versions and member in members:
                self._rec.record("evict", version=version, peers=(member,)).fail(
                    "read a same-host snapshot past staging's bound")
                self.submit(Evict(member, "slow"))

    def _note_in_place(self, job: Job, members: tuple[str, ...], acked: set[str], still_read: dict[str, int],
                       *, staged: bool = False) -> None:
        """After a version's acknowledgements: which versions its in-place readers may read now.

        Acknowledged: this version, and the older one a reader of theirs still holds (``Ack.still_read``:
        such a reader keeps that slot, so nothing newer is received into it before the next Ack
        says again). Not acknowledged, or only staged (activation "all"): any version they may
        read, this one included (the most recent :data:`IN_PLACE_KEPT`; staging bounds the rest)."""
        if job.flat is None or job.assembly is not None or self.side is None:
            for member in members:  # a copy into the member's own slot (a ring, a lane's part)
                if member in acked and not staged:
                    # its reader may still copy an older in-place version: that one stays still
                    older = still_read.get(member, -1)
                    kept = self._in_place.pop(member, frozenset()) & {older}
                    if kept:
                        self._in_place[member] = kept
            return
        for member in members:
            if not getattr(self.side.part_of(member), "reads_in_place", False):
                continue
            if member in acked and not staged:
                older = still_read.get(member, -1)
                self._in_place[member] = frozenset((job.version, older) if older >= 0 else (job.version,))
            else:
                known = self._in_place.get(member, frozenset()) | {job.version}
                self._in_place[member] = frozenset(sorted(known)[-IN_PLACE_KEPT:])

    def _committed_in_place(self, job: Job, members: tuple[str, ...]) -> None:
        """Activation "all", after the Commit: a member reads this version, and its readers may still
        hold the one it exposed before."""
        for member in members:
            known = self._in_place.get(member)
            if known is not None and job.version in known:
                older = [v for v in known if v < job.version]
                self._in_place[member] = frozenset([job.version, *older[-1:]])

    # one version --------------------------------------------------------------------------
    def _send(self, gens: Generations, job: Job) -> None:
        error: BaseException | None = None
        direct = False  # this attempt point to point: finding who corrupted the last one's bytes
        full = False  # this attempt in full: the last one's delta did not apply for some members
        tree: tuple[tuple[str, ...], set[str]] | None = None  # the broadcast attempt's group and its corrupt
        attempts, _attempt = 3, 0
        while _attempt < attempts:
            _attempt += 1
            try:
                failed = self._send_once(gens, job, direct=direct, full=full)
            except _PutFailed as err:
                # our side failed mid-version: the generation is in an unknown state, so it is
                # rebuilt, with nobody to blame; the put fails with what went wrong
                gens.advance(reason=f"version {job.version} abandoned", failed=())
                error = err.__cause__
                break
            corrupt = set(gens.last_corrupt)
            if failed and not full and self._sent_delta and failed <= corrupt:
                # every failure is a member whose delta did not apply (no such base, a corrupted or
                # forged delta, a wrong reconstruction): the same version again in full, in this same
                # generation, costing nobody a strike; they hold no base until they acknowledge it
                for member in failed:
                    self._holds.pop(member, None)
                    self._shares.pop(member, None)
                if not self._resendable(job):
                    break
                full, attempts = True, attempts + 1
                self.tally.count("delta_fallbacks")
                self._rec.record("delta", version=job.version, peers=tuple(sorted(failed))).fail(
                    "the delta did not apply: re-sent in full")
                log.warning("channel %r: version %d's delta did not apply at %s; re-sending it in full",
                            self.channel, job.version, sorted(failed))
                continue
            relays: set[str] = set()
            if tree is not None:  # the point-to-point attempt tells a corrupting relay from a bad member
                relays, reorder = self._judge_relays(job, tree, corrupt, gens.plane.broadcast_parent)
                tree, direct = None, False
            else:
                reorder = False
            if failed is None:
                if relays or reorder:  # a new tree: the struck relay's children, or an accuser moved
                    gens.advance(reason=f"version {job.version}: corrupted in the broadcast tree", failed=relays)
                return
            group = gens.group_of(tuple(self.membership.members))
            if corrupt and corrupt == failed and not relays and len(group) > 2 and \
                    self._resendable(job):
                # only corrupt bytes, through the broadcast tree: the same version again, point to point,
                # in this same generation; only then is it known whose fault they were
                tree, direct = (group, corrupt), True
                self.tally.count("resends")
                log.warning("channel %r: version %d arrived corrupted at %s; re-sending it point to point",
                            self.channel, job.version, sorted(corrupt))
                continue
            failed = failed | relays
            left = self._leavers(failed) if failed else set()
            if left:
                # a member left while the version was on the wire (its abort()): the group is broken,
                # and the others failed waiting on it (its victims, as a dead member's are), but
                # nobody failed: no strike, no dump, no WARNING, and the attempt is not counted
                self.tally.count("resends")
                log.info("channel %r: %s left while version %d was on the wire; re-sending it to the others",
                         self.channel, sorted(left), job.version)
                gens.advance(reason=f"version {job.version}: {sorted(left)} left mid-version", failed=())
                attempts += 1
                if not self._resendable(job):
                    break
                continue
            # the group is broken: rebuild with the live members and re-send this version
            self.tally.count("resends")
            log.warning("channel %r: version %d failed for %s; re-sending it to the others (attempt %d); "
                        "flight recorder: %s", self.channel, job.version, sorted(failed), _attempt + 2,
                        self._recorder.last_dump_path or "no dump")
            gens.advance(reason=f"version {job.version} failed", failed=failed)
            if not self._resendable(job):
                break  # copy=False tensors were released and no copy of them kept: nothing to re-send from
        self._finish(job, time.monotonic(), error)

    def _send_once(self, gens: Generations, job: Job, direct: bool = False, full: bool = False) -> set[str] | None:
        """Announce and move ``job`` once; None on success, else the members to blame.

        Every member is served by its plane's part of the send side (``direct``: asked to send each
        member its bytes straight, finding a corrupting relay; ``full``: no delta); every member
        checks the Seal.
        """
        self._wait_snapshot(job)
        kept = self._keep_for(job)
        if kept is not None and job.released.is_set() and kept.version == job.version and not job.whole_spill():
            # its tensors were let go: sent again from the kept copy
            job.spill, job.spill_base, job.spill_at = kept.flat, 0, 0
        assert self.side is not None
        side = self.side
        # in the generation's group order first: point-to-point sends address members by their rank
        # there (position + 1), and a sharded publisher's lanes order their groups (lane_order)
        group = gens.group_of(self.membership.members)
        members = group + tuple(m for m in self.membership.members if m not in group)
        gen, seq = self.membership.generation, gens.next_seq()
        ranges = (layout.bucket_ranges(job.manifest.total_bytes, self.settings.bucket_bytes) if job.assembly is None
                  else sharding.bucket_plan(job.manifest, self.settings.bucket_bytes))
        verify = self.checksum
        t0 = time.monotonic()
        slices, before = (bucket_slices(job, ranges, self._buckets, self.settings.bucket_bytes, self.deadlines.bucket)
                          if members else ([], None))
        out = Outgoing(job.version, gen, seq, slices, ranges, job.manifest, job.assembly, job.flat, job.progress,
                       self.settings.bucket_bytes, verify, self.deadlines.bucket, self._generation_broken,
                       before=before, point_to_point=direct, encoding="full" if full else job.encoding or self.encoding,
                       base=None if full else self._base(job, kept), prefer_full=self._chooser.prefer_full(),
                       digest=self.digest, keeps_base=kept is not None)
        by = side.split(members)
        # an encoder that sizes its wire buckets as it makes them tells the members each one's length
        out.tell_sizes = lambda first, sizes, to=None: gens.tell(out.receivers if to is None else to, _wire.WireSizes(
            generation=gen, seq=seq, version=job.version, first=first, sizes=sizes))
        try:
            fields = side.prepare(out, by)
        except LocalFailure as err:
            out.close()
            self._rec.record("send", generation=gen, version=job.version).fail(err)
            raise _PutFailed(str(err)) from err
        if out.full_reason:
            log.debug("channel %r: version %d goes full, not %r: %s", self.channel, job.version, out.encoding,
                      out.full_reason)
        self._sent_delta = any(f.get("encoding", "full") != "full" for part in fields.values()
                               for f in (part, *part.get("each", {}).values()))
        if kept is not None and members and job.spill is not kept.flat:
            kept.refill(out, job.version)  # each bucket into the kept copy once packed and encoded
        # digests only where a part's members check them (a sealed same-host snapshot is not checked)
        unchecked = {part for part, f in fields.items() if f.get("checksum", verify) is False}
        if verify and by and not set(by) - unchecked:
            verify = out.checksum = False
        # one Announce per part: each names what its members read (a segment, point to point, the encoding)
        announce = _wire.Announce(generation=gen, seq=seq, version=job.version, manifest=job.manifest,
                                  bucket_bytes=self.settings.bucket_bytes, num_buckets=len(ranges),
                                  resend=job.resends > 0, checksum=verify, assembly=job.assembly, digest=out.digest)
        job.resends += 1
        self.control.settle_probes(PROBE_SETTLE)
        self.control.begin_transfer()
        job.started = job.started or time.monotonic()
        entry = self._rec.record("announce", generation=gen, version=job.version, nbytes=job.manifest.total_bytes,
                                 peers=members, encoding="delta" if self._sent_delta else "full",
                                 digest=out.digest if verify else "",
                                 base=out.base.version if self._sent_delta and out.base else -1).start()
        sums: list[int] = []  # the staged buckets' digests (the Seal's, and what names this version as a base)
        try:
            for part, to in by.items():
                own = dict(fields[part])
                each = own.pop("each", {})  # members with fields of their own (a sliced member's delta)
                rest = tuple(m for m in to if m not in each)
                if rest:
                    gens.tell(rest, msgspec.structs.replace(announce, **own) if own else announce)
                for member, extra in each.items():
                    gens.tell((member,), msgspec.structs.replace(announce, **own, **extra))
            entry.complete()
            if members:
                # each bucket's digest is taken once it is on the wire, while the next one transfers;
                # a member known dead (its connection closed, or silent past its bound) ends the wait
                # for it now: the transfer is abandoned and re-sent to the rest, not left to time out
                if verify:
                    staged = out.staged_digests  # an encoder that read every staged bucket took them already
                    out.afters.append(lambda i: sums.append(staged[i] if staged else checksum(slices[i], out.digest)))
                side.move(out, by)
                if verify:  # a sliced member checks exactly what it was sent; everyone else the buckets
                    own = side.digests(by)
                    whole = tuple(m for part, ms in by.items() if part not in unchecked for m in ms if m not in own)
                    for to, digests in ([(whole, sums)] if whole else []) + [((m,), d) for m, d in own.items()]:
                        gens.tell(to, _wire.Seal(generation=gen, seq=seq, version=job.version,
                                                 checksums=tuple(digests)))
            if job.flat is None:
                job.release()
            acked, failed = gens.collect_acks(gen, seq, members, job.version, self.deadlines.acknowledgements())
        except LocalFailure as err:
            self._abandon(gens, job, gen, seq, members, err)
            raise _PutFailed(str(err)) from err
        except (PeerFailure, Cancelled, ControlFailure) as err:
            return self._abandon(gens, job, gen, seq, members, err)
        finally:
            out.close()
            job.encode_seconds += out.encode_seconds
        self._note_in_place(job, members, acked, gens.last_still_read,
                            staged=self.settings.activation == "all")
        forms = self._forms(job, by, fields, out.wire_bytes(), side.wire_of(by))
        job.members_done |= acked
        if verify and job.flat is not None and len(sums) == len(ranges):
            job.digests = tuple(sums)  # what names this version (a lane: this rank's part) as the next one's base
        if kept is not None and verify and kept.version == job.version and len(sums) == len(ranges):
            kept.digests = tuple(sums)
        sliced = side.digests(by)  # keyed by every sliced member in the version
        commits = self.settings.activation == "all"  # acked means staged: held only once committed
        # a sliced member holds its share, named by its digests (none without checksums: no base)
        holders = dict.fromkeys((m for m in acked if m not in sliced or verify), job.version)
        shares = {m: base_digest(job.version, sliced[m]) for m in acked if m in sliced and verify}
        for member in acked:
            job.forms[member] = forms[member]
        if not commits:
            self._hold(holders, shares)
        if self._sent_delta and out.base is not None:
            job.base = out.base.version
        if acked and not failed:
            self._chooser.note(self._sent_delta, job.manifest.total_bytes, time.monotonic() - t0)
        self._score(gens, acked, job.version, job.manifest.total_bytes)
        if failed:
            if not self._leavers(failed):
                self._recorder.dump_on_trouble(f"version {job.version}: no acknowledgement from {sorted(failed)}")
            return failed
        arrivals = gens.last_arrivals
        if commits:
            arrivals = self._commit(gens, job, gen, seq, tuple(sorted(acked)))
            self._committed_in_place(job, tuple(sorted(acked)))
            job.members_done -= acked - set(arrivals)  # the report names only those that exposed it
            self._hold({m: v for m, v in holders.items() if m in arrivals},
                       {m: d for m, d in shares.items() if m in arrivals})
        job.exposure_spread = max(arrivals.values()) - min(arrivals.values()) if arrivals else 0.0
        self._finish(job, t0)
        return None

    def _commit(self, gens: Generations, job: Job, gen: int, seq: int, members: tuple[str, ...]) -> dict[str, float]:
        """Activation "all": every member staged ``job``; tell them to expose it, and when each said
        it did. The version is committed either way; a member that is alive (it beats) but did not
        answer within the acknowledgement deadline is evicted: it would hold every later version's
        delivery up for the whole deadline (a dead or frozen one is its heartbeats' business)."""
        entry = self._rec.record("commit", generation=gen, version=job.version, peers=members).start()
        job.committed_at = time.time()
        gens.tell(members, _wire.Commit(generation=gen, seq=seq, version=job.version))
        exposed = gens.collect_exposed(gen, seq, members, self.deadlines.acknowledgements())
        # those that exposed it hear that the others did too (a quiet one is evicted below): until
        # then, a member whose publisher dies reports the split it may be in
        gens.tell(sorted(exposed), _wire.Commit(generation=gen, seq=seq, version=job.version, settled=True))
        quiet = sorted(set(members) - set(exposed))
        if quiet:
            entry.fail(f"committed; no word of it exposed from {quiet}")
            for member in quiet:
                if self.membership.is_alive(member):
                    log.warning("channel %r: %s did not answer version %d's Commit within %.3gs: evicting it",
                                self.channel, member, job.version, self.deadlines.acknowledgements())
                    self.membership.request_evict(member, "commit unanswered")
        else:
            entry.complete()
        return exposed

    def _judge_relays(self, job: Job, tree: tuple[tuple[str, ...], set[str]], corrupt: set[str],
                      parent: Any) -> tuple[set[str], bool]:
        """What a version corrupted in the broadcast tree says, its point-to-point re-send in
        (``membership.blame``): the members struck (evicted at MAX_STRIKES), and whether the
        group's order changes (an accuser moved right under the publisher)."""
        self._blame.forget_all_but(self.membership.members)
        verdict = self._blame.judge(tree[0], tree[1], corrupt, parent)
        for member, why in sorted(verdict.struck.items()):
            self._rec.record("corrupt", version=job.version, peers=(member,)).fail(why)
            log.warning("channel %r: %s struck for version %d's corrupted bytes: %s", self.channel, member,
                        job.version, why)
        for relay, accusers in sorted(verdict.accused.items()):
            if relay not in verdict.struck:
                self._rec.record("accused", version=job.version, peers=(relay, *accusers)).complete()
        for member in verdict.evict:
            self.membership.request_evict(member, "failed")
        for accuser, other in verdict.swaps:
            self.membership.swap(accuser, other)
        return set(verdict.struck), bool(verdict.swaps)

    def _keep_for(self, job: Job) -> KeptBase | None:
        """The copy a ``copy=False`` version's delta is against: made by the first copy=False put that
        asks for ``encoding="delta"`` (it costs a version's bytes), then refreshed by every copy=False
        put, whatever its encoding (a full one is the next base too); a snapshot's put drops it."""
        if job.flat is not None:
            self._kept = None  # a snapshot is its own next base
            return None
        if self._kept is None and (job.encoding or self.encoding) != DELTA:
            return None  # copy=False that never asked for a delta keeps its two buckets' memory
        device = self._buckets.device
        if self._kept is None or not self._kept.fits(job.manifest, job.assembly, device):
            self._kept = None  # the old layout's copy goes before the new one is made: never two at once
            self._kept = KeptBase(job.manifest, job.assembly, device)
        return self._kept

    def _resendable(self, job: Job) -> bool:
        """A copy=False version whose tensors were let go can be sent again only from a copy of it:
        a whole spill (``Job.spill_ahead``), or the copy kept as deltas' base."""
        kept = self._kept
        return (job.flat is not None or not job.released.is_set() or job.whole_spill()
                or (kept is not None and kept.version == job.version))

    def _base(self, job: Job, kept: KeptBase | None = None) -> Base | None:
        """What ``job`` may go as a delta against: the retained version, kept while ``job`` is in
        flight, named by its digests (copy=False: the ``kept`` copy); with the members known to hold it."""
        if job.flat is None:
            return None if kept is None else kept.base(self._holding)
        base = self.staging.base
        if base is None or base.flat is None or not base.digests or job is base:
            return None
        holders, shares = self._holding(base.version)
        return Base(base.version, base.flat, base.manifest, base_digest(base.version, base.digests), holders,
                    assembly=base.assembly, shares=shares)

    def _holding(self, version: int) -> tuple[frozenset[str], dict[str, bytes]]:
        """The members known to hold ``version`` whole, and the sliced ones' digests of their shares of it."""
        shares = {m: d for m, d in self._shares.items() if self._holds.get(m) == version}
        return frozenset(m for m, v in self._holds.items() if v == version and m not in self._shares), shares

    def _hold(self, holders: dict[str, int], shares: dict[str, bytes]) -> None:
        """``holders`` hold their versions now (a sliced member: its share, named by ``shares``)."""
        self._holds.update(holders)
        for member in holders:
            self._shares.pop(member, None)
        self._shares.update(shares)

    def _forms(self, job: Job, by: dict[Any, tuple[str, ...]], fields: dict[Any, dict[str, Any]],
               encoded: int | None, own: Mapping[str, int]) -> dict[str, tuple[str, int]]:
        """Per member in this attempt: the encoding it was sent in, and the bytes that put on the wire
        (``encoded``: an encoded version's, once moved; ``own``: members sent their own bytes, a
        sliced member's share or its delta)."""
        forms: dict[str, tuple[str, int]] = {}
        whole_snapshot = job.flat is not None and job.assembly is None
        for part, to in by.items():
            got = fields[part]
            each = got.get("each", {})
            # a same-host member reading the snapshot in place: nothing moved for it
            in_place = whole_snapshot and getattr(part, "reads_in_place", False)
            for member in to:
                name = each.get(member, got).get("encoding", "full")
                size = encoded if name != "full" and encoded is not None else job.manifest.total_bytes
                forms[member] = (name, 0 if in_place else own.get(member, size))
        return forms

    def _generation_broken(self) -> bool:
        return self.aborting.is_set() or self.membership.has_dead_members()

    def _wait_snapshot(self, job: Job) -> None:
        if job.ready is None:
            return
        device = self._buckets.device
        torch.cuda.current_stream(device if device.type == "cuda" else None).wait_event(job.ready)
        if device.type != "cuda":
            job.ready.synchronize()  # gloo reads host memory: the device->host copy must be done

    def _abandon(self, gens: Generations, job: Job, gen: int, seq: int,
                 members: tuple[str, ...], err: BaseException) -> set[str]:
        """Tell members the version is given up; returns whom to blame (the silent, else the failed)."""
        self._rec.record("send", generation=gen,
                              version=job.version).fail(err)
        # receivers still waiting on this version give up now (their queue is no longer
        # empty) and acknowledge the failure, so live members answer and silent ones stand out
        # a receiver still in its buckets notices any new command (Abandon) within a wait slice;
        # one past them waits for the Seal
        gens.tell(members, _wire.Abandon(generation=gen, seq=seq, version=job.version))
        gens.tell(members, _wire.Seal(generation=gen, seq=seq, version=job.version, checksums=(), abandoned=True))
        acked, failed = gens.collect_acks(gen, seq, members, job.version, self.deadlines.acknowledgements())
        job.members_done |= acked
        self._note_in_place(job, members, acked, gens.last_still_read, staged=self.settings.activation == "all")
        blamed = failed or set(members) - acked
        if not self._leavers(blamed):
            self._recorder.dump_on_trouble(f"version {job.version} failed: {err}")
        return blamed

    def _leavers(self, members: set[str]) -> set[str]:
        """Those of ``members`` that are leaving (queued events applied first): a member that aborts
        mid-version breaks the group, says so in its acknowledgement, and sends its Leave next."""
        self._pump()
        return {m for m in members if self.membership.is_leaving(m)}

    def _finish(self, job: Job, t0: float, error: BaseException | None = None) -> None:
        self.staging.finish(job, retain=error is None)  # a failed version is never re-sent
        if error is not None:
            self.tally.count("versions_failed")
            job.handle.resolve_threadsafe(error=WeightSyncError(
                f"version {job.version} could not be sent: {error}", channel=self.channel, version=job.version))
            return
        members = tuple(m for m in self.membership.members if m in job.members_done)
        forms = {m: job.forms.get(m, ("full", job.manifest.total_bytes)) for m in members}
        wire = sum(size for _name, size in forms.values())
        report = DeliveryReport(version=job.version, members=members, nbytes=job.manifest.total_bytes,
                                seconds=time.monotonic() - (job.started or t0), delivered_at=time.time(),
                                wire_bytes=wire, encodings={m: name for m, (name, _size) in forms.items()},
                                base=job.base if any(name != "full" for name, _s in forms.values()) else -1,
                                encode_seconds=job.encode_seconds, committed_at=job.committed_at,
                                exposure_spread=job.exposure_spread)
        if not members:  # once per streak: a trainer that starts first puts to nobody for a while
            (log.debug if self._nobody_streak else log.warning)(
                "version %d delivered to nobody: channel %r has no members", job.version, self.channel)
        self._nobody_streak = not members
        self.tally.delivered(job.manifest.total_bytes, len(members), report.seconds, wire)
        log.debug("channel %r: version %d delivered to %d members in %.3fs", self.channel, job.version,
                  len(members), report.seconds)
        job.handle.resolve_threadsafe(report)

    def _score(self, gens: Generations, acked: set[str], version: int, nbytes: int) -> None:
        """Record receive times and act on members the policy finds slow.

        A member is slow on its own time (what it spent outside the collective) against the
        others', or on its link's time for a version this size: extrapolated from what its
        probe of the newest round took at least, capped at its whole receive time, against what
        the others' took at most (the shortest of their last round trips). The broadcast is a tree, so a slow
        link's wait lands on other members' collective time too: only the probe, which goes
        straight to each member, says whose link it is. Links are compared once per round, and
        only when every member answered it: each verdict stands on a measure of its own. The
        next round goes out now, sized at 1/32 of the version (at most 128 KiB; none below
        256 KiB, where links do not matter).
        """
        timings = gens.last_timings
        own = {m: timings[m][1] for m in acked if m in timings}
        self.membership.note_delivered(acked, version, {m: timings[m][0] for m in own}, own)
        links: dict[str, tuple[float, float]] = {}
        assert self.side is not None
        part_of = self.side.part_of
        # a sharded publisher's lanes share every link: one lane's probe would time the others'
        # buckets, so its members are scored on their own time alone
        linked = [m for m in own if not part_of(m).moves_alone] if self.lane[1] == 1 else []
        probed = {m: self.control.link_seconds(m) for m in linked}
        newest = max((p[3] for p in probed.values() if p is not None), default=0)
        for member, times in probed.items():
            if times is not None and times[2] > 0 and times[3] == newest > self._probe_round:
                low, high, probe_bytes, _round = times
                # never more than its whole receive took: on fast links the extrapolation is
                # mostly latency and scheduling noise, which this bounds. A member is judged on
                # what its link took at least against what the others' took at most: a probe whose
                # segments came at once (a shaper's burst) never makes another member's honest
                # measure look slow
                scale, whole = nbytes / probe_bytes, timings[member][0]
                links[member] = (min(low * scale, whole), min(high * scale, whole))
        if links and len(links) == len(linked):
            self._probe_round = newest  # this round has had its verdict
        if log.isEnabledFor(logging.DEBUG):  # what each verdict below stood on
            log.debug("version %d: own seconds %s, link seconds (least, most) %s", version,
                      {m: round(t, 4) for m, t in own.items()},
                      {m: (round(a, 4), round(b, 4)) for m, (a, b) in links.items()})
        if nbytes >= PROBE_FROM and self.lane[1] == 1:
            self.control.probe(min(PROBE_MAX, nbytes // 32))
        # a member is compared with members of its own plane only: copies out of shared memory
        # are an order of magnitude faster than any socket
        flagged: dict[str, float] = {}
        for part in {part_of(m) for m in own}:
            mine = {m: t for m, t in own.items() if part_of(m) is part}
            # links are compared only when every member's was timed (none is judged on a probe
            # against others judged on their own time alone)
            timed = {m: links[m] for m in mine if m in links} if all(m in links for m in mine) else None
            flagged.update(self.membership.slow_members(self.policy, mine, timed))
        for member, ratio in flagged.items():
            self._rec.record("slow", version=version,
                                  peers=(member,)).fail(f"{ratio:.1f}x the others' receive time")
            if self.policy.on_slow != "keep":
                log.warning("%s is %.1fx slower than the others: evicting (%s)", member, ratio,
                            self.policy.on_slow)
                self.membership.request_evict(member, "slow")
