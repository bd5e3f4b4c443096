"""The Receiver over a fake data plane and a fake control connection: no processes, no sockets.

Each test runs the real receiver thread (``Receiver.main``): the control connection is a pair
of queues (``FakeClient``: commands and seals in, what the member sends recorded), and the data
plane is ``feed``, registered from outside the library, whose ``move`` copies what the test
"sent" this member into the buckets it is given. The test plays the publisher: Admit, Go, an
Announce and a Seal. This reaches, without processes, the Receiver's branches for a whole
version, corrupted bytes, a sliced member (point to point, packed in its own layout), a sharded
lane (its part placed in the full slot), the same-host plane (a real segment) and a decoder.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch

from tests import xor_encoding
from tests.fakes import GrouplessPlane
from weightsync import _wire
from weightsync.engine.receiver import Receiver
from weightsync.engine.slots import SlotPair
from weightsync.extend import register_encoding, unregister_encoding
from weightsync.format import layout, sharding, slicing
from weightsync.format.checksum import checksum
from weightsync.options import ChannelOptions
from weightsync.planes.dataplane import PlaneSpec, Transfer, register_plane, unregister_plane
from weightsync.planes.shm import plane as shm
from weightsync.recorder.recorder import FlightRecorder
from weightsync.testing import Hooks

BUCKET = 1 << 12
SETTINGS = ChannelOptions(timeout=5.0, bucket_bytes=BUCKET, heartbeat_interval=0.2).settings(checksum=True,
                                                                                             in_place=False)
FEED: dict[tuple[int, int], torch.Tensor] = {}  # (seq, bucket) -> the bytes the publisher sent this member


class FakeClient:
    """The member's control connection as the Receiver uses it."""

    def __init__(self, transport: str) -> None:
        self.transport, self.shm_pid, self.local_host = transport, os.getpid(), "127.0.0.1"
        self.commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.seals: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.sent: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.closed = threading.Event()
        self.close_reason = ""
        self.last_heard = self.tick = time.monotonic()

    def connect(self, timeout: float) -> None:
        """Connected at once."""

    def send(self, message: Any) -> None:
        self.sent.put(message)

    def goodbye(self, message: Any, wait: float = 1.0) -> None:
        """The last word (a Leave), as the real client's: sent, then nothing more from this side."""
        self.send(message)

    def close(self, reason: str) -> None:
        self.closed.set()

    def next_sent(self, kind: type, timeout: float = 10.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            message = self.sent.get(timeout=max(deadline - time.monotonic(), 0.01))
            if isinstance(message, kind):
                return message


class FeedPlane(GrouplessPlane):
    """A member plane that copies what the test fed it; it joins no group."""

    moves_alone = False

    def __init__(self, context: Any) -> None:
        self.moves: list[int] = []

    def move(self, transfer: Transfer) -> None:
        self.moves.append(transfer.version)
        for i, bucket in enumerate(transfer.buckets):
            sent = FEED[(transfer.announce.seq, i)]
            assert sent.numel() == bucket.numel(), f"bucket {i}: {sent.numel()} bytes sent, {bucket.numel()} expected"
            bucket.copy_(sent)
            if transfer.after is not None:
                transfer.after(i)


@pytest.fixture(autouse=True)
def feed_plane() -> Iterator[None]:
    register_plane(PlaneSpec("feed", send_part=lambda _c: None, member_plane=FeedPlane))  # type: ignore[arg-type,return-value]
    register_encoding(xor_encoding.XOR)
    FEED.clear()
    yield
    unregister_plane("feed")
    unregister_encoding(xor_encoding.XOR.name)


class Member:
    """A Receiver thread joined to generation 0 by the test, which plays the publisher."""

    def __init__(self, *, transport: str = "feed", lane: int = 0, want: tuple[_wire.Want, ...] | None = None) -> None:
        self.slots = SlotPair(torch.device("cpu"))
        self.published = threading.Event()
        self.receiver = Receiver("unit", "m0", host="127.0.0.1", port=1, backend="gloo", device=torch.device("cpu"),
                                 secret=None, own_timeout=5.0, join_timeout=10.0, recorder=FlightRecorder(capacity=500),
                                 slots=self.slots, on_publish=self.published.set, hooks=Hooks(), transport=transport,
                                 lane=lane, want=want)
        self.client = FakeClient(transport)
        self.receiver._client = self.client  # type: ignore[assignment]
        self.thread = threading.Thread(target=self.receiver.main, daemon=True)
        self.thread.start()
        self.client.commands.put(_wire.Admit(member_id="m0", generation=0, members=("m0",), settings=SETTINGS))
        assert self.client.next_sent(_wire.Ready).generation == 0
        self.client.commands.put(_wire.Go(generation=0, group=()))

    def send(self, announce: _wire.Announce, digests: Sequence[int]) -> _wire.Ack:
        self.client.commands.put(announce)
        self.client.seals.put(_wire.Seal(generation=0, seq=announce.seq, version=announce.version,
                                         checksums=tuple(digests)))
        return self.client.next_sent(_wire.Ack)

    def close(self) -> None:
        self.receiver.aborting.set()
        self.receiver.closing.set()
        self.receiver.wake("test over")
        self.thread.join(10)


@pytest.fixture
def member() -> Iterator[Any]:
    made: list[Member] = []

    def make(**kw: Any) -> Member:
        made.append(Member(**kw))
        return made[-1]

    yield make
    for m in made:
        m.close()


def items(value: float) -> list[tuple[str, torch.Tensor]]:
    return [("w", torch.arange(3000, dtype=torch.float32) + value), ("b", torch.full((7,), value))]


def packed(its: list[tuple[str, torch.Tensor]]) -> tuple[_wire.Manifest, torch.Tensor]:
    manifest = layout.build_manifest(its)
    flat = torch.empty(manifest.total_bytes, dtype=torch.uint8)
    layout.pack_into(flat, manifest, its)
    return manifest, flat


def announce(version: int, manifest: _wire.Manifest, num_buckets: int, seq: int = 0, **kw: Any) -> _wire.Announce:
    return _wire.Announce(generation=0, seq=seq, version=version, manifest=manifest, bucket_bytes=BUCKET,
                          num_buckets=num_buckets, **kw)


def feed(seq: int, pieces: Sequence[torch.Tensor], kind: str = "crc32c") -> list[int]:
    for i, piece in enumerate(pieces):
        FEED[(seq, i)] = piece.clone()
    return [checksum(p, kind) if p.numel() else 0 for p in pieces]


def readable(m: Member) -> dict[str, torch.Tensor]:
    slot = m.slots.readable
    assert slot.flat is not None and slot.manifest is not None
    return layout.views(slot.flat, slot.manifest)


def test_a_whole_version_is_checked_then_published(member: Any) -> None:
    m = member()
    manifest, flat = packed(items(1.0))
    buckets = [flat[lo:hi] for lo, hi in layout.bucket_ranges(manifest.total_bytes, BUCKET)]
    ack = m.send(announce(3, manifest, len(buckets)), feed(0, buckets))
    assert ack.ok and ack.version == 3 and m.slots.version == 3
    got = readable(m)
    assert torch.equal(got["w"], items(1.0)[0][1]) and torch.equal(got["b"], items(1.0)[1][1])


def test_bytes_that_do_not_match_the_seal_are_refused_and_never_readable(member: Any) -> None:
    m = member()
    manifest, flat = packed(items(2.0))
    buckets = [flat[lo:hi] for lo, hi in layout.bucket_ranges(manifest.total_bytes, BUCKET)]
    digests = feed(0, buckets)
    FEED[(0, 1)][5] ^= 0xFF  # bucket 1 corrupted on its way
    ack = m.send(announce(4, manifest, len(buckets)), digests)
    assert not ack.ok and ack.corrupt and m.slots.version is None


def test_the_member_checks_with_the_digest_the_announce_names_and_refuses_one_it_lacks(member: Any) -> None:
    m = member()
    manifest, flat = packed(items(2.5))
    buckets = [flat[lo:hi] for lo, hi in layout.bucket_ranges(manifest.total_bytes, BUCKET)]
    xxh3 = feed(0, buckets, "xxh3")
    assert m.send(announce(1, manifest, len(buckets), digest="xxh3"), xxh3).ok and m.slots.version == 1
    # the same XXH3 digests under the default name (CRC32C) do not match: the name is what is computed
    feed(1, buckets)
    ack = m.send(announce(2, manifest, len(buckets), seq=1), xxh3)
    assert not ack.ok and ack.corrupt and m.slots.version == 1
    # XXH3 catches a corrupted bucket as CRC32C does
    digests = feed(2, buckets, "xxh3")
    FEED[(2, 0)][3] ^= 0x10
    ack = m.send(announce(3, manifest, len(buckets), seq=2, digest="xxh3"), digests)
    assert not ack.ok and ack.corrupt and m.slots.version == 1
    # a digest this member does not have: refused, never readable, the name in the error
    feed(3, buckets)
    ack = m.send(announce(4, manifest, len(buckets), seq=3, digest="sha3-512"), feed(3, buckets))
    assert not ack.ok and "sha3-512" in ack.error and m.slots.version == 1


def test_a_sliced_member_packs_only_its_box_in_its_own_layout(member: Any) -> None:
    want = (_wire.Want("w", (1000,), (500,)),)
    m = member(want=want)
    manifest, flat = packed(items(3.0))
    ranges = layout.bucket_ranges(manifest.total_bytes, BUCKET)
    plan = slicing.cached_routes(manifest, None, manifest, want, tuple(ranges))
    pieces = [slicing.gather(flat[lo:hi], plan[i]) for i, (lo, hi) in enumerate(ranges)]
    ack = m.send(announce(5, manifest, len(ranges), direct=True), feed(0, pieces))
    assert ack.ok and m.slots.version == 5
    got = readable(m)
    assert set(got) == {"w"} and torch.equal(got["w"], items(3.0)[0][1][1000:1500])


def test_a_sharded_lane_places_its_part_in_the_full_slot(member: Any) -> None:
    full = items(4.0)
    part = sharding.split(full, 1, 2, {"w": 1, "b": 0})  # this lane (rank 1 of 2) owns w
    m = member(lane=1)
    flat = torch.empty(part.lane.total_bytes, dtype=torch.uint8)
    layout.pack_into(flat, part.lane, part.items)
    ranges = sharding.bucket_plan(part.lane, BUCKET)
    assembly = _wire.Assembly(1, 2, part.manifest, part.pieces)
    ack = m.send(announce(6, part.lane, len(ranges), assembly=assembly), feed(0, [flat[lo:hi] for lo, hi in ranges]))
    assert ack.ok and m.slots.version is None  # rank 0's part is still missing: nothing readable yet
    slot = m.slots.receiving
    assert slot.flat is not None and slot.manifest == part.manifest
    assert torch.equal(layout.views(slot.flat, slot.manifest)["w"], full[0][1])  # w where the full layout has it


@pytest.mark.skipif(not shm.available(), reason="needs memfd and /proc (Linux)")
def test_a_same_host_member_copies_the_announced_segment(member: Any) -> None:
    pool = shm.SegmentPool("unit")
    pool.open()
    try:
        manifest, flat = packed(items(5.0))
        buf = pool.allocate(manifest.total_bytes, torch.device("cpu"), False)
        buf.copy_(flat)
        pool.marker(buf)(manifest.total_bytes)
        m = member(transport="shm")
        ranges = layout.bucket_ranges(manifest.total_bytes, BUCKET)
        digests = [checksum(flat[lo:hi]) for lo, hi in ranges]
        ref = pool.ref(buf)
        assert ref is not None
        ack = m.send(announce(7, manifest, len(ranges), plane=shm.announced(ref)), digests)
        assert ack.ok and m.slots.version == 7 and torch.equal(readable(m)["w"], items(5.0)[0][1])
        m.close()
    finally:
        pool.close()


def test_a_version_is_decoded_into_the_slot_before_its_digest(member: Any) -> None:
    m = member()
    manifest, flat = packed(items(6.0))
    buckets = [flat[lo:hi] for lo, hi in layout.bucket_ranges(manifest.total_bytes, BUCKET)]
    digests = [checksum(b) for b in buckets]  # the staged bytes', as the publisher seals them
    feed(0, [torch.bitwise_xor(b, xor_encoding.KEY) for b in buckets])  # what the wire carried
    ack = m.send(announce(8, manifest, len(buckets), coding=_wire.Coding(name=xor_encoding.XOR.name)), digests)
    assert ack.ok and torch.equal(readable(m)["w"], items(6.0)[0][1])
    ack = m.send(announce(9, manifest, len(buckets), seq=1, coding=_wire.Coding(name="no-such-encoding")), digests)
    assert not ack.ok and "no-such-encoding" in ack.error and m.slots.version == 8
