"""The publisher's side of generations: who is told what, the gated rendezvous, acknowledgements.

A generation ends when membership changes (a join, a leave, a death) or a version fails. The
sender thread then calls :meth:`Generations.advance`:

1. plan the next generation from membership (live members and joiners; the dead, the departed
   and members that failed twice are dropped);
2. tell current members ``Reconfigure`` and joiners ``Admit``; retire the old group;
3. wait until every planned member says ``Ready`` (a member that leaves or dies meanwhile
   makes a new plan: gloo's rendezvous cannot be interrupted, so nobody enters it until
   everyone is known to be coming); then ``Go``, and build the group under a fresh prefix.

After each version the sender calls :meth:`collect_acks`, which tells the silent (the ones
to blame) from members that failed while waiting on them (victims).
"""

from __future__ import annotations

import itertools
import logging
import queue
import secrets
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from weightsync import _wire
from weightsync._errors import PeerFailure
from weightsync.control.rendezvous import Scope
from weightsync.errors import WeightSyncError
from weightsync.membership.membership import MemberInfo, Membership, Plan
from weightsync.options import Deadlines
from weightsync.planes.dataplane import DataPlane, GenerationSpec
from weightsync.recorder.recorder import FlightRecorder

log = logging.getLogger("weightsync.membership")

PUBLISHER = "publisher"


class Control(Protocol):
    """What Generations needs of the control plane (the publisher's ControlServer)."""

    replies: queue.SimpleQueue[Any]  # Ready | Ack | Wake, from every member

    def send(self, incarnation: str, message: Any) -> bool: ...

    def bind(self, incarnation: str) -> bool: ...

    def release(self, member_id: str, reason: str) -> None: ...

    def probe(self, nbytes: int) -> None: ...

    def settle_probes(self, timeout: float) -> bool: ...

    def begin_transfer(self) -> None: ...

    def link_seconds(self, member_id: str) -> tuple[float, float, int, int] | None: ...

    def grant(self, member_id: str, scope: Scope | None) -> None: ...

    def wait_copied(self, members: tuple[str, ...], generation: int, seq: int, bucket: int, timeout: float,
                    cancelled: Callable[[], bool]) -> set[str]: ...


class Rendezvous(Protocol):
    def begin_generation(self, generation: int) -> None: ...


#: a sharded publisher's lanes put different members first in their groups (:func:`lane_order`);
#: benchmarks/lanes.py turns it off to measure what it buys
ROTATE_LANES = True


def lane_order(group: tuple[str, ...], rank: int, world: int) -> tuple[str, ...]:
    """The order of lane ``rank``'s group (of ``world`` lanes): position i is rank i + 1.

    gloo broadcasts down a binomial tree, where the first ranks relay (of 8, ranks 1-3 forward
    to 3, 1 and 1 others). Every lane's group holds the same generators, so in the same order
    the same ones would relay in every lane, and their uplinks would carry two versions' worth
    of bytes while the rest send nothing. Each lane starts its sorted order ``rank / world`` of
    the way round instead: at 2 lanes no generator relays in both, at 4 none in more than two.
    One lane (an unsharded publisher) keeps the join order.
    """
    if world <= 1 or len(group) < 2 or not ROTATE_LANES:
        return group
    ordered = sorted(group)
    k = rank * len(ordered) // world
    return tuple(ordered[k:] + ordered[:k])


class Generations:
    """Owned and called by the publisher's sender thread only.

    Args:
        plane: the publisher's data plane (rank 0 of every generation).
        settings: what every member is told at admission.
        pump: applies membership requests that arrived meanwhile; called while waiting for
            replies, so a leave or a death ends a wait on the member that went away.
        stopped: True once the publisher aborts.
        on_change: the member set changed (wakes ``wait_subscribers``).
        on_evicted: a member was dropped (the orchestrator may replace it).
    """

    def __init__(self, channel: str, *, control: Control, table: Rendezvous, membership: Membership,
                 recorder: FlightRecorder, plane: DataPlane,
                 settings: _wire.ChannelSettings, stopped: Callable[[], bool], on_change: Callable[[], None],
                 on_evicted: Callable[[MemberInfo], None] = lambda _m: None,
                 pump: Callable[[], None] = lambda: None,
                 in_group: Callable[[str], bool] = lambda _m: True) -> None:
        self.channel = channel
        self.control, self.table = control, table
        self.membership = membership
        self.plane = plane
        self.settings = settings
        self.lanes: tuple[str, ...] = ()  # a sharded publisher's other ranks, told to each newcomer
        self.lane = (0, 1)  # this publisher's (rank, world size): whose turn it is to relay (lane_order)
        self.deadlines = Deadlines(settings)
        self._recorder = recorder
        self._rec = recorder.scope(channel, PUBLISHER)
        self._stopped = stopped
        self._on_change = on_change
        self._on_evicted = on_evicted
        self._pump = pump
        self._incarnation: dict[str, str] = {}  # member -> its connection (a rejoin is a new one)
        self._info: dict[str, MemberInfo] = {}
        self._slots: dict[str, int] = {}
        self._transport: dict[str, str] = {}  # member -> the transport it joined with (for the log)
        self._in_group = in_group  # whether a member's plane is the group's (the others join none)
        self._next_slot = itertools.count(1)  # 0 is the publisher's
        self._seq = itertools.count()
        self.last_timings: dict[str, tuple[float, float]] = {}  # member -> (seconds, own seconds)
        self.last_arrivals: dict[str, float] = {}  # member -> when its ok ack arrived (monotonic)
        self.last_still_read: dict[str, int] = {}  # member -> the older version it said it still reads in place
        self.last_corrupt: set[str] = set()  # members whose bytes arrived corrupted (last collect_acks)

    def register(self, member_id: str, incarnation: str, host: str = "", pid: int = 0,
                 transport: str = "group") -> None:
        """A joiner's own connection, where everything for it goes, and how it receives."""
        self._incarnation[member_id] = incarnation
        self._transport[member_id] = transport
        self._info[member_id] = MemberInfo(member_id, host=host, pid=pid)
        self._slots[member_id] = next(self._next_slot)  # a rejoin is a new incarnation: a new slot

    def transport_of(self, member: str) -> str:
        return self._transport.get(member, "group")

    def group_of(self, members: Iterable[str]) -> tuple[str, ...]:
        """The members (in order: :func:`lane_order`) that form the data plane's group; the others'
        planes join none."""
        return lane_order(tuple(m for m in members if self._in_group(m)), *self.lane)

    def next_seq(self) -> int:
        """The sequence number of the next command in the current generation."""
        return next(self._seq)

    def tell(self, members: Iterable[str], message: Any) -> None:
        for member in members:
            incarnation = self._incarnation.get(member)
            if incarnation is not None:
                self.control.send(incarnation, message)

    def advance(self, reason: str, failed: Iterable[str] = ()) -> None:
        """End the current generation and build the next with the live members and joiners.

        ``failed``: members to blame for what ended it. A ``reason`` other than "membership
        change" means an operation failed mid-flight: every end re-forms from fresh resources.
        """
        for _attempt in range(4):
            # who is down is seen before the queued Leaves are applied: a member that said goodbye
            # and hung up since is then leaving, not dead (Membership.plan_next)
            down = self.membership.down()
            self._pump()
            plan = self.membership.plan_next(failed, down)
            for member in plan.dropped_joiners:
                self.forget(member, "died while joining")
            fresh = reason != "membership change"
            self.tell(self.membership.members, _wire.Reconfigure(
                next_generation=plan.generation, members=plan.members, reason=reason,
                trouble=fresh or bool(plan.evicted), fresh=fresh))
            for member_id in plan.admitted:
                self.tell([member_id], _wire.Admit(member_id=member_id, generation=plan.generation,
                                                         members=plan.members, settings=self.settings,
                                                         slot=self._slots[member_id], lanes=self.lanes))
            self.plane.leave(reason, failed=fresh)
            self._seq = itertools.count()
            rendezvous = self._rec.record("rendezvous", generation=plan.generation, peers=plan.members).start()
            offers: dict[str, str] = {}
            missing = self._await_ready(plan, offers)
            if missing:
                if all(self.membership.is_leaving(m) for m in missing):
                    rendezvous.complete()  # members left meanwhile: an ordinary replan, not a failure
                else:
                    rendezvous.fail(f"not ready: {sorted(missing)}")
                self.membership.commit(plan, ok=False)
                failed, reason = missing, f"members did not come to the rendezvous: {sorted(missing)}"
                continue
            rendezvous.complete()
            try:
                self._form(plan, offers)
            except PeerFailure as err:
                self.membership.commit(plan, ok=False)
                failed, reason = self.membership.unresponsive(), f"rendezvous failed: {err}"
                continue
            self.membership.commit(plan, ok=True)
            for member in plan.admitted:
                known = self._info.get(member)
                log.info("channel %r: %s joined (host %s, pid %s, %s) in generation %d", self.channel, member,
                         known.host if known else "?", known.pid if known else "?", self.transport_of(member),
                         plan.generation)
            for member in plan.left:
                self.forget(member, "left")
                log.info("channel %r: %s left", self.channel, member)
            for member in plan.evicted:
                info = self.forget(member, plan.reasons.get(member, "evicted")) or MemberInfo(member)
                info.reason, info.generation = plan.reasons.get(member, "evicted"), plan.generation
                dumped = self._recorder.dump_on_trouble(f"{member} evicted ({info.reason})") \
                    or self._recorder.last_dump_path
                log.warning("channel %r: %s evicted (%s) in generation %d; flight recorder: %s", self.channel,
                            member, info.reason, plan.generation, dumped or "no dump")
                self._on_evicted(info)
            log.info("channel %r: generation %d formed with %d members %s (%s)", self.channel, plan.generation,
                     len(plan.members), list(plan.members)[:8], reason)
            self._on_change()
            return
        raise WeightSyncError("could not form a generation after 4 attempts", channel=self.channel)

    def forget(self, member: str, reason: str) -> MemberInfo | None:
        """Drop what is known of ``member`` (it left, was evicted, or died joining); close its connection."""
        self._incarnation.pop(member, None)
        self.control.release(member, reason)
        self._slots.pop(member, None)
        self._transport.pop(member, None)
        return self._info.pop(member, None)

    def _form(self, plan: Plan, offers: dict[str, str]) -> None:
        """Say Go and enter the generation: re-form in place with everyone's offers, or build anew.

        The generation's rendezvous keys live under a fresh random token (and, in place, a fresh
        uuid), told to members only in their authenticated Go: nobody can pre-write them.
        """
        timeout = self.deadlines.rendezvous()
        self.table.begin_generation(plan.generation)
        token = secrets.token_hex(8)
        group = self.group_of(plan.members)  # same-host members read shared memory: not in the group
        spec = GenerationSpec(plan.generation, group, rank=0, timeout=timeout, rendezvous=token)
        if self.settings.in_place and group:
            ordered = (self.plane.offer(), *(offers[m] for m in group))
            spec = GenerationSpec(plan.generation, group, rank=0, timeout=timeout, uuid=secrets.randbits(62),
                                  offers=ordered, rendezvous=token)
        # each member may touch only this generation's rendezvous keys, and write only its own
        prefixes = self.plane.rendezvous_prefixes(spec)
        for member in plan.members:
            self.control.grant(member, Scope(prefixes, group.index(member) + 1) if member in group else None)
        self.tell(plan.members, _wire.Go(generation=plan.generation, uuid=spec.uuid, handles=spec.offers,
                                         rendezvous=token, group=group))
        self.plane.enter(spec)

    def _await_ready(self, plan: Plan, offers: dict[str, str]) -> set[str]:
        """Wait until every planned member is on its way into the rendezvous.

        Returns the members that left, died or never came: gloo's own rendezvous cannot be
        interrupted, so nobody enters it until everyone is known to be coming.
        """
        deadline = time.monotonic() + self.deadlines.rendezvous()
        extended = False
        waiting = set(plan.members)
        while waiting:
            down = {m for m in waiting if not self.membership.is_alive(m)}  # before the pump: see advance()
            self._pump()
            gone = {m for m in waiting if self.membership.is_leaving(m)} | down
            if gone or self._stopped():
                return gone or waiting
            message = self._next_reply(deadline)
            if message is None:
                if extended:
                    return waiting
                # late but alive (a busy host, or still stuck in a rendezvous a dead peer spoiled):
                # once more, with the same bound again, before it counts as missing
                self._rec.record("rendezvous", generation=plan.generation,
                                 peers=tuple(sorted(waiting))).fail("late but alive: waiting once more")
                extended, deadline = True, time.monotonic() + self.deadlines.rendezvous()
                continue
            if isinstance(message, _wire.Ready) and message.generation == plan.generation:
                in_group = self._in_group(message.member_id)  # members of other planes bring none
                if self.settings.in_place and in_group and not message.handle:
                    self._rec.record("rendezvous",
                                     peers=(message.member_id,)).fail("Ready without a reconfigure handle")
                    continue  # it will not come: it is counted missing when the deadline passes
                offers[message.member_id] = message.handle
                waiting.discard(message.member_id)
        return set()

    def _next_reply(self, deadline: float) -> Any:
        """The next Ready, Ack or Wake from any member; None once ``deadline`` passed."""
        try:
            return self.control.replies.get(timeout=max(deadline - time.monotonic(), 0.0))
        except queue.Empty:
            return None

    def collect_acks(self, gen: int, seq: int, members: tuple[str, ...], version: int,
                     timeout: float) -> tuple[set[str], set[str]]:
        """Members that acknowledged ``version`` ok, and the ones to blame for what went wrong.

        Stops early once every member has answered or every silent one is known dead. Silent
        members and failed acknowledgements are recorded apart. When someone went silent, only
        the silent are blamed: members that failed while waiting on them are its victims.
        """
        acked: set[str] = set()
        nacked: dict[str, str] = {}
        self.last_timings = {}
        self.last_arrivals = {}
        self.last_still_read = {}
        self.last_corrupt = set()
        entry = self._rec.record("ack", generation=gen,
                                      version=version, peers=members).start()
        silent = set(members)
        for message in self._answers(gen, seq, silent, time.monotonic() + timeout, exposed=False):
            if message.ok and message.version == version:
                acked.add(message.member_id)
                self.last_timings[message.member_id] = (message.seconds, message.own_seconds)
                self.last_arrivals[message.member_id] = time.monotonic()
                if message.still_read >= 0:
                    self.last_still_read[message.member_id] = message.still_read
            else:
                nacked[message.member_id] = message.error or f"acked version {message.version}"
                if message.leaving:  # its Leave may still be on its way: taken at its word now
                    self.membership.request_leave(message.member_id)
                    nacked[message.member_id] += " (leaving)"
                if message.corrupt:
                    self.last_corrupt.add(message.member_id)
        if silent or nacked:
            entry.fail(f"silent: {sorted(silent)}; failed: {sorted(nacked)}")
            for member in sorted(silent):  # per member, so the analyzer can tell culprits from victims
                self._rec.record("ack_missing", generation=gen,
                                      version=version, peers=(member,)).fail("no acknowledgement")
            for member, error in sorted(nacked.items()):
                self._rec.record("nack", generation=gen,
                                      version=version, peers=(member,)).fail(error)
        else:
            entry.complete()
        if silent:
            # someone went silent: the members that failed were waiting on it (victims, no strike)
            return acked, silent
        return acked, set(nacked)

    def collect_exposed(self, gen: int, seq: int, members: Iterable[str], timeout: float) -> dict[str, float]:
        """After a Commit (activation "all"): when each of ``members`` said it exposed the version
        (monotonic arrival times). Stops early once every silent one is known dead; a member that
        never answers is not blamed here (its heartbeats decide whether it is alive)."""
        arrived: dict[str, float] = {}
        for message in self._answers(gen, seq, set(members), time.monotonic() + timeout, exposed=True):
            arrived[message.member_id] = time.monotonic()
        return arrived

    def _answers(self, gen: int, seq: int, silent: set[str], deadline: float, *, exposed: bool) -> Iterator[_wire.Ack]:
        """Each first Ack of (``gen``, ``seq``) from a member in ``silent`` (removed from it as it
        answers): acknowledgements of a version, or with ``exposed`` answers to its Commit. Ends when
        all answered, at ``deadline``, or once every silent one is known dead."""
        while silent:
            self._pump()
            # what already arrived counts first: a member may ack and then leave at once
            message = self._next_reply(time.monotonic())
            if message is None:
                if all(not self.membership.is_alive(m) for m in silent):
                    return  # nobody left to wait for
                message = self._next_reply(deadline)
                if message is None:
                    return
            if not isinstance(message, _wire.Ack) or (message.generation, message.seq) != (gen, seq) \
                    or message.exposed != exposed or message.member_id not in silent:
                continue  # a stale ack, the other kind of answer, or a wake-up
            silent.discard(message.member_id)
            yield message

    def shutdown(self) -> None:
        self.tell(self.membership.members, _wire.Shutdown(reason="publisher closed"))
        self.tell(self.membership.joining(), _wire.Deny(reason="publisher closed", kind="closed"))
        self.plane.close()
        self._on_change()
