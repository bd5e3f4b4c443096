"""The Sender over a fake data plane and an in-memory control server: no processes, no sockets.

Each test runs the real Sender thread; members are threads that answer what a Receiver would
(Ready to Admit/Reconfigure, an Ack once a version's Seal, or its Announce without checksums,
came), and the plane (``tests.fakes.FakePlane``) records what the Sender asked of it. This
reaches the branches that otherwise only processes reach: same-host members (a real segment
pool: the Announce names where to read), a same-host-only generation (no plane call, digests
still taken), ``copy=False`` through the ring, sliced members (point to point, their own digests)
and a sharded lane (the Announce's assembly).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from tests.fakes import FakeControl, FakePlane, FakeTable
from weightsync import _wire
from weightsync.engine.events import Abort, Join, Leave, PutCommitted
from weightsync.engine.handles import DeliveryReport, PutHandle
from weightsync.engine.sender import Sender
from weightsync.engine.staging import BucketBuffers, Job, Staging
from weightsync.format import layout, sharding
from weightsync.format.checksum import KINDS, checksum
from weightsync.membership.membership import Membership, StragglerPolicy
from weightsync.options import ChannelOptions
from weightsync.planes.dataplane import Transfer
from weightsync.planes.shm import plane as shm
from weightsync.recorder.recorder import FlightRecorder

SETTINGS = ChannelOptions(timeout=5.0, bucket_bytes=1 << 12, heartbeat_interval=0.2).settings(checksum=True,
                                                                                              in_place=False)


@dataclass
class Member:
    """What a Receiver answers, on a thread: the messages it was sent, in order."""

    name: str
    control: FakeControl
    seen: list[object] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    seconds: float = 0.01  # the receive time its Acks report
    on_reconfigure: Callable[[], None] | None = None  # instead of answering Ready: it is leaving

    def run(self) -> None:
        outbox = self.control.outbox[f"inc-{self.name}"]
        announced: dict[int, _wire.Announce] = {}
        while not self.stop.is_set():
            try:
                message = outbox.get(timeout=0.1)
            except queue.Empty:
                continue
            self.seen.append(message)
            if isinstance(message, _wire.Reconfigure) and self.on_reconfigure is not None:
                self.on_reconfigure()
            elif isinstance(message, (_wire.Admit, _wire.Reconfigure)):
                generation = message.generation if isinstance(message, _wire.Admit) else message.next_generation
                self.control.replies.put(_wire.Ready(generation=generation, member_id=self.name))
            elif isinstance(message, _wire.Announce):
                announced[message.seq] = message
                if not message.checksum:
                    self._ack(message)
            elif isinstance(message, _wire.Seal) and not message.abandoned and message.seq in announced:
                self._ack(announced.pop(message.seq))

    def _ack(self, announce: _wire.Announce) -> None:
        self.control.replies.put(_wire.Ack(generation=announce.generation, seq=announce.seq, member_id=self.name,
                                           version=announce.version, ok=True, seconds=self.seconds,
                                           own_seconds=0.005))

    def of(self, kind: type) -> list:
        return [m for m in self.seen if isinstance(m, kind)]


class Rig:
    """A Sender thread with its fakes; members join with :meth:`join`, versions go with :meth:`put`."""

    def __init__(self, *, segments: bool = False, digest: str = "crc32c", lane: tuple[int, int] = (0, 1),
                 heard: Callable[[str], tuple[float | None, bool]] = lambda _m: (time.monotonic(), True)) -> None:
        self.control, self.plane = FakeControl(), FakePlane()
        self.recorder = FlightRecorder(capacity=2000)
        self.segments = shm.SegmentPool("unit") if segments else None
        if self.segments is not None:
            self.segments.open()
            self.staging = Staging(2, allocate=self.segments.allocate, drop=self.segments.drop,
                                   reuse=self.segments.reuse)
        else:
            self.staging = Staging(2)
        self.membership = Membership("unit", self.recorder, SETTINGS.heartbeat_interval, dead_after=30.0,
                                     heard=heard)
        self.sender = Sender("unit", settings=SETTINGS, staging=self.staging, membership=self.membership,
                             recorder=self.recorder, policy=StragglerPolicy(), control=self.control, table=FakeTable(),
                             make_plane=lambda: self.plane, slot_device=torch.device("cpu"),
                             on_change=lambda: None, on_evicted=lambda _m: None,
                             planes=("group", "shm"), plane_objects={"segments": self.segments},
                             buckets=BucketBuffers(torch.device("cpu"), allocate=self.segments.allocate,
                                                   drop=self.segments.drop) if self.segments is not None else None,
                             digest=digest, lane=lane)
        self.loop = asyncio.new_event_loop()
        self.members: dict[str, Member] = {}
        self.thread = threading.Thread(target=self.sender.main, name="unit-sender", daemon=True)
        self.thread.start()

    def join(self, name: str, *, transport: str = "group", want: tuple[_wire.Want, ...] | None = None) -> Member:
        member = Member(name, self.control)
        threading.Thread(target=member.run, daemon=True).start()
        self.members[name] = member
        self.sender.submit(Join(name, f"inc-{name}", transport=transport, want=want))
        deadline = time.monotonic() + 10
        while name not in self.membership.members:
            assert time.monotonic() < deadline, f"{name} was never admitted"
            time.sleep(0.01)  # polling the sender thread's state, bounded
        return member

    def put(self, version: int, items: list[tuple[str, torch.Tensor]], *, copy: bool = True,
            assembly: _wire.Assembly | None = None, manifest: _wire.Manifest | None = None) -> DeliveryReport:
        manifest = manifest or layout.build_manifest(items)
        job = Job(version=version, manifest=manifest, handle=PutHandle("unit", version, self.loop), assembly=assembly)
        if copy:
            buf, _ = self.staging.acquire(manifest.total_bytes, torch.device("cpu"), pin=False)
            job.flat = buf[: manifest.total_bytes]
            layout.pack_into(job.flat, manifest, items)
        else:
            job.items = items
        self.staging.commit(job)
        self.sender.submit(PutCommitted(version))
        return self.loop.run_until_complete(asyncio.wait_for(job.handle.delivered(), 20))

    def close(self) -> None:
        self.sender.submit(Abort())
        self.thread.join(10)
        for member in self.members.values():
            member.stop.set()
        if self.segments is not None:
            self.segments.close()
        self.loop.close()


@pytest.fixture
def rig() -> Iterator[Rig]:
    made: list[Rig] = []

    def make(**kw: Any) -> Rig:
        made.append(Rig(**kw))
        return made[-1]

    yield make  # type: ignore[misc]
    for r in made:
        r.close()


def tensors(numel: int, value: float) -> list[tuple[str, torch.Tensor]]:
    return [("w", torch.arange(numel, dtype=torch.float32) + value), ("b", torch.full((7,), value))]


def digests_of(flat: torch.Tensor, bucket_bytes: int, kind: str = "crc32c") -> list[int]:
    return [checksum(flat[lo:hi], kind) for lo, hi in layout.bucket_ranges(flat.numel(), bucket_bytes)]


def staged(r: Rig, version: int) -> torch.Tensor:
    """The snapshot the sender sent (padding between tensors included: the digests cover it)."""
    job = r.staging.retained
    assert job is not None and job.version == version and job.flat is not None
    return job.flat


def moves(plane: FakePlane) -> list[int]:
    return [v for op, v in plane.calls if op == "move"]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_group_members_get_the_buckets_through_the_plane_and_digests_of_what_was_staged(rig, kind: str) -> None:
    r = rig(digest=kind)
    a = r.join("a")
    items = tensors(3000, 1.0)
    report = r.put(0, items)
    assert report.members == ("a",) and moves(r.plane) == [0]
    announce, seal = a.of(_wire.Announce)[-1], a.of(_wire.Seal)[-1]
    assert announce.plane == b"" and not announce.direct and announce.num_buckets == 3  # 12 KiB in 4 KiB
    assert announce.digest == kind  # the Seal's function is named, and is what was used
    assert list(seal.checksums) == digests_of(staged(r, 0), SETTINGS.bucket_bytes, kind)


@pytest.mark.skipif(not shm.available(), reason="needs memfd and /proc (Linux)")
def test_same_host_members_read_the_announced_segment_beside_the_group(rig) -> None:
    r = rig(segments=True)
    near, far = r.join("near", transport="shm"), r.join("far")
    report = r.put(0, tensors(3000, 2.0))
    assert set(report.members) == {"near", "far"}
    assert [s.members for s in r.plane.entered][-1] == ("far",)  # the same-host member is in no group
    announce = near.of(_wire.Announce)[-1]
    segment = shm.segment_of(announce)
    assert segment.ring == 0 and segment.nbytes > 0
    # each member is told what its own plane reads: a group member never learns the segment's token
    assert far.of(_wire.Announce)[-1].plane == b"" and far.of(_wire.Announce)[-1].version == announce.version
    # one pass, for the group member: the same-host member reads the sealed snapshot, told no digest
    assert segment.sealed and announce.checksum is False and not near.of(_wire.Seal)
    assert far.of(_wire.Announce)[-1].checksum is True
    assert list(far.of(_wire.Seal)[-1].checksums) == digests_of(staged(r, 0), SETTINGS.bucket_bytes)


@pytest.mark.skipif(not shm.available(), reason="needs memfd and /proc (Linux)")
def test_a_same_host_only_generation_moves_nothing_through_the_plane_and_digests_nothing(rig) -> None:
    r = rig(segments=True)
    near = r.join("near", transport="shm")
    items = tensors(3000, 3.0)
    assert r.put(0, items).members == ("near",)
    assert moves(r.plane) == []  # nobody in the group: the plane is not asked to move anything
    # a sealed snapshot: no Seal, no digest named (the seal, token and epoch prove it)
    announce = near.of(_wire.Announce)[-1]
    assert shm.segment_of(announce).sealed
    assert announce.checksum is False and not near.of(_wire.Seal)


@pytest.mark.skipif(not shm.available(), reason="needs memfd and /proc (Linux)")
def test_copy_false_to_a_same_host_member_goes_through_the_two_bucket_ring(rig) -> None:
    r = rig(segments=True)
    near = r.join("near", transport="shm")
    items = tensors(3000, 4.0)
    assert r.put(0, items, copy=False).members == ("near",)
    announce = near.of(_wire.Announce)[-1]
    assert shm.segment_of(announce).ring == SETTINGS.bucket_bytes  # two slots
    assert announce.num_buckets == 3 and len(near.of(_wire.Seal)[-1].checksums) == 3


def test_a_sliced_member_is_sent_only_its_box_point_to_point_with_its_own_digests(rig) -> None:
    r = rig()
    full = r.join("full")
    want = (_wire.Want("w", (1000,), (500,)),)
    sliced = r.join("sliced", want=want)
    items = tensors(3000, 5.0)
    sent: dict[int, list[tuple[int, int]]] = {}

    def send_each(transfer: Transfer, sends: Any) -> None:  # what rank 0 sends each member, bucket by bucket
        r.plane.calls.append(("send_each", transfer.version))
        for i in range(len(transfer.buckets)):
            if transfer.before is not None:
                transfer.before(i)
            sent[i] = [(rank, piece.numel()) for rank, piece in sends(i)]
            if transfer.after is not None:
                transfer.after(i)

    r.plane.send_each = send_each  # type: ignore[method-assign]
    assert set(r.put(0, items).members) == {"full", "sliced"}
    assert all(a.direct for a in sliced.of(_wire.Announce))
    ranks = {m: i + 1 for i, m in enumerate(r.plane.entered[-1].members)}
    whole = sum(n for rank, n in (p for i in sent for p in sent[i]) if rank == ranks["full"])
    box = sum(n for rank, n in (p for i in sent for p in sent[i]) if rank == ranks["sliced"])
    assert whole == full.of(_wire.Announce)[-1].manifest.total_bytes and box == 500 * 4  # its floats only
    assert full.of(_wire.Seal)[-1].checksums != sliced.of(_wire.Seal)[-1].checksums  # each its own bytes


def test_a_sharded_lane_announces_its_assembly_and_buckets_by_its_plan(rig) -> None:
    r = rig()
    a = r.join("a")
    items = [("w", torch.arange(4000, dtype=torch.float32)), ("b", torch.ones(16))]
    part = sharding.split(items, 1, 2, {"w": 1, "b": 0})  # rank 1 of 2 owns w
    assembly = _wire.Assembly(1, 2, part.manifest, part.pieces)
    report = r.put(0, part.items, manifest=part.lane, assembly=assembly)
    assert report.members == ("a",)
    announce = a.of(_wire.Announce)[-1]
    assert announce.assembly == assembly
    assert announce.num_buckets == len(sharding.bucket_plan(part.lane, SETTINGS.bucket_bytes))


def test_each_round_of_link_probes_gives_one_verdict(rig) -> None:
    """A member's link is judged on its answer to the newest round of probes, once: one slow
    answer was carried into three versions' verdicts (the largest of the last three answers), and
    a healthy generator of 8 on equal links was evicted as 3.3x slow (CI, tests/test_netns.py)."""
    r = rig()
    members = {name: r.join(name) for name in "abc"}
    members["a"].seconds = 2.0  # the tree held it up (and its relay), its own time is like the others'
    items = tensors(100_000, 1.0)
    nbytes = layout.build_manifest(items).total_bytes

    def slow_verdicts() -> int:
        return sum(1 for e in r.recorder.snapshot() if e.op == "slow" and e.peers == ("a",))

    def answer(round_: int) -> None:  # a's probe took as long as a version, the others' next to nothing
        r.control.links = {"a": (1.0, 1.0, nbytes, round_), "b": (0.001, 0.002, nbytes, round_),
                           "c": (0.001, 0.002, nbytes, round_)}

    answer(1)
    for version in range(4):  # one round answered, four versions: one verdict, never three in a row
        r.put(version, items)
    assert slow_verdicts() == 0 and "a" in r.membership.members
    for version, round_ in zip(range(4, 7), (2, 2, 3), strict=True):  # a late round (2, again) counts once
        answer(round_)
        r.put(version, items)
    assert slow_verdicts() == 0 and "a" in r.membership.members
    # a link that is slow round after round is found: the third fresh round in a row flags it
    for version, round_ in zip(range(7, 9), (4, 5), strict=True):
        answer(round_)
        r.put(version, items)
    assert slow_verdicts() == 1


@pytest.mark.parametrize("lane", [(0, 1), (1, 2)], ids=["unsharded", "a-lane"])
def test_links_are_probed_after_a_version_only_where_no_other_lane_shares_them(rig, lane: tuple[int, int]) -> None:
    """A sharded publisher's lanes move their parts over the same links at once: a probe written by
    one lane times another lane's buckets (on the emulated cluster, 2-3 healthy generators of 8
    were evicted as 4-8x slow). Lanes do not probe, and score their members on their own time."""
    r = rig(lane=lane)
    r.join("a")
    r.put(0, tensors(100_000, 1.0))  # 400 KB: worth timing links for
    assert len(r.control.probes) == (1 if lane[1] == 1 else 0)  # one round after the version, or none


@pytest.mark.parametrize("when", ["planned", "at the rendezvous"])
def test_members_that_say_goodbye_and_hang_up_are_not_found_dead(rig, when: str) -> None:
    """A member sends Leave, then closes its connection; the control server queues the Leave
    before it sees the close. The sender judged liveness between the two (Leave queued, not
    applied; connection closed): a generator that left cleanly right after another one was
    evicted as dead, with a flight-recorder dump (``benchmarks.push_vs_broadcast``'s last
    version at 2 generators, one run in three)."""
    closed: set[str] = set()
    armed: set[str] = set()  # members that say goodbye when next looked at

    def heard(member: str) -> tuple[float | None, bool]:
        if member in armed:  # as the control server: the Leave is queued, then the close is seen
            armed.discard(member)
            r.sender.submit(Leave(member))
            closed.add(member)
        return time.monotonic(), member not in closed

    r = rig(heard=heard)
    r.join("a")
    b = r.join("b")
    r.put(0, tensors(1000, 1.0))
    if when == "planned":  # b is leaving too, just as the next generation is planned
        armed.add("b")
    else:  # b is leaving too, asked to the next generation
        def leaving() -> None:
            armed.add("b")
            # b's goodbye reaching the control server wakes a sender waiting for replies, as a real
            # one's does (Sender.submit); without it a sender that looked at b just before this
            # waited out the rendezvous deadline twice, 10 s on a loaded CI machine
            r.control.replies.put(_wire.Wake(reason="b says goodbye"))

        b.on_reconfigure = leaving
    r.sender.submit(Leave("a"))
    closed.add("a")
    deadline = time.monotonic() + 10
    while r.membership.members:
        assert time.monotonic() < deadline, f"still members: {r.membership.members}"
        time.sleep(0.01)  # polling the sender thread's state, bounded
    assert when == "planned" or b.of(_wire.Reconfigure), "b was never asked to the next generation"
    assert r.sender.evicted == []  # both left; nobody died
    # nor was anyone missing from the rendezvous ("late but alive" judges nobody: under load the
    # sender may look at b once before b reads its Reconfigure, and wait once more, as it should)
    assert not [e for e in r.recorder.snapshot()
                if e.op == "rendezvous" and e.error and not e.error.startswith("late but alive")]


def test_members_that_acknowledged_and_left_before_the_attempt_ended_are_in_the_report() -> None:
    """Two subscribers read their last version in place, acknowledged it and hung up while the
    attempt was still open; the attempt was given up on (a member found dead), re-sent to the
    generation left (nobody), and the report said "delivered to nobody" (a CI failure of
    test_multiprocess's n-subscriber test). Who acknowledged a version has it, gone or not."""
    from types import SimpleNamespace

    from weightsync.engine.reports import Outcomes

    loop = asyncio.new_event_loop()
    try:
        job = Job(version=3, manifest=layout.build_manifest(tensors(16, 1.0)), handle=PutHandle("unit", 3, loop))
        job.members_done = {"gone", "here"}
        counted: list[int] = []
        tally = SimpleNamespace(count=lambda _what: None,
                                delivered=lambda _nbytes, n, _seconds, _wire: counted.append(n))
        outcomes = Outcomes("unit", SimpleNamespace(finish=lambda _job, retain: None),
                            SimpleNamespace(members=["here", "never"]), tally)
        outcomes.finish(job, time.monotonic())
        report = loop.run_until_complete(asyncio.wait_for(job.handle.delivered(), 5))
        assert report.members == ("here", "gone") and counted == [2]
    finally:
        loop.close()
