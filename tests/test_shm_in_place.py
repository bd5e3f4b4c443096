"""Same-host reads in place: a member's readable version is the publisher's snapshot itself.

Checked: the kernel's count of this process's private memory does not grow with the versions a
same-host member receives, streams and loads (nothing is copied); a version a member still reads
stays intact while newer ones are put (staging parks its buffer instead of writing it); parking is
bounded, and a holder past the bound is evicted while its late read is refused, never served torn
(end to end: a reader holding a version too long gets its member evicted and its block refused);
the last version stays readable, in private memory, once the publisher is gone.
"""

from __future__ import annotations

import asyncio
import gc
import threading

import pytest
import torch

import weightsync as ws
from tests.statedicts import digests
from weightsync import _wire
from weightsync.engine.staging import Job, Staging
from weightsync.planes.shm import plane as shm
from weightsync.testing import Hooks, inject

pytestmark = [pytest.mark.timeout(120), pytest.mark.skipif(not shm.available(), reason="needs Linux memfds and /proc")]

MIB = 1 << 20


@pytest.fixture(autouse=True)
def _collected() -> None:
    gc.collect()  # earlier tests' closed channels: their last views of segments go now


def private_mib() -> float:
    """This process's resident anonymous memory, as the kernel counts it (shared memory is not in it)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def model(v: int, mib: int = 32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(v)
    return {"a": torch.randn(mib * MIB // 8, generator=g), "b": torch.randn(mib * MIB // 8, generator=g)}


class Hold(Hooks):
    """Holds the receiver thread at the first bucket of ``version`` until ``go`` (bounded)."""

    def __init__(self, version: int) -> None:
        self.version = version
        self.entered, self.go = threading.Event(), threading.Event()

    def after_bucket(self, version: int, index: int, bucket: torch.Tensor, seconds: float) -> None:
        if version == self.version and index == 0:
            self.entered.set()
            self.go.wait(60)


@pytest.mark.asyncio
async def test_receive_stream_and_load_in_place_copy_nothing() -> None:
    """64 MiB versions to a same-host member: its private memory does not grow with them (the
    readable version is the publisher's snapshot), and stream/load hand out views of it."""
    async with ws.Publisher("inplace", timeout=10, bucket_bytes=8 * MIB, encoding="full") as pub, \
            ws.Subscriber("inplace", address=pub.address, member_id="m", timeout=10, transport="shm") as sub:
        await pub.wait_subscribers(1, timeout=20)
        sds = [model(v) for v in range(4)]
        await (await pub.put(sds[0], version=0)).delivered(timeout=30)
        async with sub.stream(min_version=0, timeout=10) as w:
            pass
        gc.collect()
        before = private_mib()
        for v in range(1, 4):
            report = await (await pub.put(sds[v], version=v)).delivered(timeout=30)
            assert report.members == ("m",)
            assert report.wire_bytes == 0  # read in place: nothing moved (once counted as a whole version sent)
            async with sub.stream(min_version=v, timeout=10) as w:
                seen = {name: t for name, t in w}
                assert digests(seen) == digests(sds[v])
            names: list[str] = []

            def into(pairs: object, names: list[str] = names) -> None:
                names.extend(n for n, _t in pairs)  # type: ignore[attr-defined]

            assert await sub.load(into, min_version=v, timeout=10) == v
            assert sorted(names) == ["a", "b"]
            del seen, w
        grown = private_mib() - before
        # three 64 MiB versions received, streamed and loaded: a copy of any would be 64 MiB here
        assert grown < 24, f"private memory grew by {grown:.0f} MiB"
        dest = {name: torch.empty_like(t) for name, t in sds[3].items()}
        assert await sub.get_into(dest, timeout=10) == 3  # the one copy get_into owes: into dest
        assert digests(dest) == digests(sds[3])


@pytest.mark.asyncio
async def test_a_version_read_in_place_stays_intact_while_newer_ones_are_put() -> None:
    """The member holds version 0 (its receiver is held inside version 1); versions 2 and 3 are put
    meanwhile. Staging must not write version 0's buffer: the member reads it bit-exact, and once
    it goes on it gets the latest, within max_snapshots + 2 buffers."""
    hold = Hold(version=1)
    async with ws.Publisher("held", timeout=10, bucket_bytes=4 * MIB, encoding="full") as pub:
        sub = ws.Subscriber("held", address=pub.address, member_id="m", timeout=10, transport="shm")
        inject(sub, hold)
        async with sub:
            await pub.wait_subscribers(1, timeout=20)
            sds = [model(v, mib=8) for v in range(4)]
            await (await pub.put(sds[0], version=0)).delivered(timeout=30)
            one = await pub.put(sds[1], version=1)
            assert await asyncio.to_thread(hold.entered.wait, 30)
            two = await pub.put(sds[2], version=2)  # a new buffer: version 0's is parked
            three = await pub.put(sds[3], version=3)  # supersedes 2 in its buffer
            w = await sub.get(timeout=10)
            assert w.version == 0 and digests(w) == digests(sds[0])
            hold.go.set()
            assert (await one.delivered(timeout=30)).members == ("m",)
            assert (await two.delivered(timeout=30)).superseded
            assert (await three.delivered(timeout=30)).members == ("m",)
            w = await sub.get(min_version=3, timeout=10)
            assert digests(w) == digests(sds[3])
            assert pub.peak_snapshots() <= 3
            assert not pub.evicted


class _Handle:
    pass


def _job(version: int) -> Job:
    return Job(version=version, manifest=_wire.Manifest(tensors=(), total_bytes=64), handle=_Handle())  # type: ignore[arg-type]


def _put_and_send(staging: Staging, version: int) -> Job:
    """Staging's part of one put and its send: a buffer, committed, taken, finished (retained)."""
    buf, _ = staging.acquire(64, torch.device("cpu"), pin=False)
    job = _job(version)
    job.flat = buf
    staging.commit(job)
    assert staging.take() is job
    staging.finish(job)
    return job


def test_parking_is_bounded_and_the_holder_past_the_bound_is_named() -> None:
    """Staging's rule alone: a held version's buffer is parked, never reused while held, reused
    once let go; past max_snapshots + 2 buffers the oldest parked one is taken back and its
    version named to ``overdue``."""
    held: set[int] = set()
    overdue: list[int] = []
    staging = Staging(2)
    staging.held = lambda: frozenset(held)
    staging.overdue = overdue.append
    cpu = torch.device("cpu")

    def put_and_send(version: int) -> Job:
        job = _put_and_send(staging, version)
        held.add(version)  # members read it in place, and (failing the next ones) go on reading it
        return job

    jobs = [put_and_send(v) for v in range(4)]
    assert [j.version for j in staging.parked] == [0, 1, 2]  # 3 is retained
    buffers = {j.flat.data_ptr() for j in jobs if j.flat is not None}
    assert len(buffers) == 4 and not overdue and staging.limit() == 4
    buf, _ = staging.acquire(64, cpu, pin=False)  # a fifth would pass the bound: 0's is taken back
    assert overdue == [0] and buf.data_ptr() in buffers
    assert staging.buffers_in_use() + 1 <= staging.limit()
    held.clear()
    staging.give_back(buf)
    again, _ = staging.acquire(64, cpu, pin=False)  # nobody holds 1 or 2 now: reused, not allocated
    assert again.data_ptr() in buffers and not staging.parked


def test_a_buffer_let_go_by_in_place_readers_stays_spare_instead_of_a_new_segment() -> None:
    """A reader of every other version still holds the one before (``Ack.still_read``) as the
    next put comes: two parked buffers are let go at once, then one is parked again. Every put
    reuses one, none past the first few allocates a new segment (its page faults land in put,
    the trainer's stall: measured 0.16-0.45 s at 496 MiB), and staging stays within its bound."""
    held: set[int] = set()
    allocated: list[int] = []
    staging = Staging(2, allocate=lambda n, d, p: allocated.append(n) or torch.empty(n, dtype=torch.uint8))
    staging.held = lambda: frozenset(held)
    for version in range(12):
        _put_and_send(staging, version)
        held.clear()
        held.update({version, version - 1} if version % 2 else {version})  # read; and the one before
        assert staging.buffers_in_use() <= staging.limit()
    assert len(allocated) <= 4, allocated  # the first puts' buffers, then reused


@pytest.mark.asyncio
async def test_the_last_version_read_in_place_stays_readable_after_the_publisher_is_gone() -> None:
    """The publisher closes: the member copies its readable version into its own memory and keeps
    no view of the publisher's segments."""
    sd = model(7, mib=4)
    sub = None
    async with ws.Publisher("gone", timeout=10, bucket_bytes=4 * MIB, encoding="full") as pub:
        sub = ws.Subscriber("gone", address=pub.address, member_id="m", timeout=10, transport="shm")
        await sub.start()
        await pub.wait_subscribers(1, timeout=20)
        await (await pub.put(sd, version=7)).delivered(timeout=30)
    try:
        with pytest.raises(ws.PublisherGone):
            await sub.get(min_version=8, timeout=30)
        w = await sub.get(timeout=10)
        assert w.version == 7 and digests(w) == digests(sd)
        assert sub._slots.readable.guard is None  # noqa: SLF001 - its own copy, not a view
    finally:
        await sub.aclose()
    del w
    gc.collect()
    assert shm.mapped_segments() == 0


@pytest.mark.asyncio
async def test_a_previous_version_written_again_is_never_compared_with() -> None:
    """``stream(since=0)`` at version 1 holds version 0 in place, which the publisher no longer
    keeps (the member reads 1): a put meanwhile writes 0's buffer. ``changes()`` then raises
    Superseded (load whole) instead of naming what differs from bytes that are no longer 0's;
    ``load(since=0)`` hands over every tensor."""
    sds = [model(v, mib=4) for v in range(3)]
    async with ws.Publisher("since", timeout=10, bucket_bytes=4 * MIB, encoding="full") as pub, \
            ws.Subscriber("since", address=pub.address, member_id="m", timeout=10, transport="shm") as sub:
        await pub.wait_subscribers(1, timeout=20)
        for v in range(2):
            await (await pub.put(sds[v], version=v)).delivered(timeout=30)
            await sub.get(min_version=v, timeout=10)
        async with sub.stream(min_version=1, timeout=10, since=0) as w:
            assert w.since == 0
            assert {c.name for c in w.changes()} == {"a", "b"}  # 0 intact: a true comparison
            two = await pub.put(sds[2], version=2)  # into version 0's buffer: nobody reads 0 in place
            with pytest.raises(ws.Superseded, match="version 0"):
                w.changes()
            with pytest.raises(ws.Superseded):
                w.changed_names()
        await two.delivered(timeout=30)
        w = await sub.get(min_version=2, timeout=10)
        assert digests(w) == digests(sds[2])


@pytest.mark.asyncio
async def test_a_reader_still_on_the_older_version_keeps_it_from_being_written() -> None:
    """A ``stream`` block holds version 0 while 1 becomes readable (the member's Ack says a reader
    still holds 0) and 2 is put: 0's buffer is not written, the block reads 0 to its end and
    exits cleanly, and 2 arrives once the block is done."""
    sds = [model(v, mib=4) for v in range(3)]
    async with ws.Publisher("reader", timeout=10, bucket_bytes=4 * MIB, encoding="full") as pub, \
            ws.Subscriber("reader", address=pub.address, member_id="m", timeout=10, transport="shm") as sub:
        await pub.wait_subscribers(1, timeout=20)
        await (await pub.put(sds[0], version=0)).delivered(timeout=30)
        async with sub.stream(min_version=0, timeout=10) as w:
            assert (await (await pub.put(sds[1], version=1)).delivered(timeout=30)).members == ("m",)
            two = await pub.put(sds[2], version=2)  # its snapshot is taken: not into 0's buffer
            assert digests(dict(w)) == digests(sds[0])
        assert (await two.delivered(timeout=30)).members == ("m",)
        w2 = await sub.get(min_version=2, timeout=10)
        assert digests(w2) == digests(sds[2])


@pytest.mark.asyncio
async def test_a_copy_false_version_between_does_not_let_go_of_the_one_a_reader_holds() -> None:
    """As above, with version 1 put ``copy=False`` (a ring: the member copies it into its own
    memory). Its Ack still names version 0 as read; versions 2 to 4 are snapshotted meanwhile,
    more than staging's max_snapshots, and none is written into 0's buffer; 4 arrives after."""
    sds = [model(v, mib=4) for v in range(5)]
    async with ws.Publisher("ring-between", timeout=10, bucket_bytes=4 * MIB, encoding="full") as pub, \
            ws.Subscriber("ring-between", address=pub.address, member_id="m", timeout=10,
                          transport="shm") as sub:
        await pub.wait_subscribers(1, timeout=20)
        await (await pub.put(sds[0], version=0)).delivered(timeout=30)
        async with sub.stream(min_version=0, timeout=10) as w:
            one = await pub.put(sds[1], version=1, copy=False)
            await one.released(timeout=30)
            assert (await one.delivered(timeout=30)).members == ("m",)
            handles = [await pub.put(sds[v], version=v) for v in (2, 3, 4)]  # their snapshots are taken
            assert digests(dict(w)) == digests(sds[0])
        assert (await handles[-1].delivered(timeout=30)).members == ("m",)
        w4 = await sub.get(min_version=4, timeout=10)
        assert digests(w4) == digests(sds[4])


@pytest.mark.asyncio
async def test_an_insider_on_the_host_cannot_write_a_segment_honest_members_read_in_place() -> None:
    """A member that lies opens the publisher's snapshot through /proc read-write (as any process of
    the same user can) and tries to change it: the seal refuses a writable mapping and write();
    the honest member's version stays what the trainer put."""
    import mmap
    import os

    sd = model(3, mib=4)
    async with ws.Publisher("sealed", timeout=10, bucket_bytes=4 * MIB, encoding="full") as pub, \
            ws.Subscriber("sealed", address=pub.address, member_id="m", timeout=10, transport="shm") as sub:
        await pub.wait_subscribers(1, timeout=20)
        await (await pub.put(sd, version=3)).delivered(timeout=30)
        w = await sub.get(min_version=3, timeout=10)
        assert sub._slots.readable.guard is not None  # noqa: SLF001 - read in place
        pool = pub._planes.segments  # noqa: SLF001
        fds = [entry[0] for entry in pool._segments.values()]  # noqa: SLF001
        assert fds and all(entry[3] for entry in pool._segments.values())  # noqa: SLF001 - every one sealed
        for fd in fds:
            handle = os.open(f"/proc/{os.getpid()}/fd/{fd}", os.O_RDWR)
            try:
                with pytest.raises(PermissionError):
                    mmap.mmap(handle, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                with pytest.raises(PermissionError):
                    os.pwrite(handle, b"\xff" * 64, 4096)
            finally:
                os.close(handle)
        again = await sub.get(timeout=10)
        assert digests(again) == digests(sd) == digests(w)


@pytest.mark.asyncio
async def test_a_reader_holding_a_version_too_long_is_evicted_and_its_block_refused_once_written() -> None:
    """A ``stream`` block holds version 0 while the trainer goes on putting. The member receives 1
    (its Ack says a reader still holds 0, so 0's buffer is parked, not written), but can receive 2
    into neither slot: it fails 2 past its deadline and is evicted, as a frozen reader is, while
    the trainer's puts went on. Nobody holds 0 now: the next puts write its buffer again, and the
    block, still open, ends in Superseded instead of handing out bytes written under it."""
    sds = [model(v, mib=2) for v in range(6)]
    async with ws.Publisher("overdue", timeout=4, bucket_bytes=2 * MIB, encoding="full") as pub:
        sub = ws.Subscriber("overdue", address=pub.address, member_id="m", timeout=4, transport="shm")
        async with sub:
            await pub.wait_subscribers(1, timeout=20)
            await (await pub.put(sds[0], version=0)).delivered(timeout=30)
            with pytest.raises(ws.Superseded, match="written again"):
                async with sub.stream(min_version=0, timeout=10) as w:
                    assert w.version == 0
                    assert (await (await pub.put(sds[1], version=1)).delivered(timeout=30)).members == ("m",)
                    assert digests(dict(w)) == digests(sds[0])  # parked: intact while the member reads on
                    two = await (await pub.put(sds[2], version=2)).delivered(timeout=60)
                    assert two.members == () and [e.member_id for e in pub.evicted] == ["m"]
                    for v in range(3, len(sds)):  # to nobody; staging reuses what nobody holds now
                        await (await pub.put(sds[v], version=v)).delivered(timeout=30)
                    dict(w)  # what the views hold now is not version 0: the block's exit says so
            assert pub.peak_snapshots() <= 2 + 2


@pytest.mark.asyncio
async def test_a_read_in_place_torn_by_the_members_eviction_ends_in_evicted_and_rejoin_reads_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``get_into`` copies a version out of the publisher's shared memory while its member is dropped
    (as a generator frozen with SIGSTOP mid-copy is) and the publisher writes that buffer again: the
    copy is torn. It raised Superseded, which the README's loop does not expect, and the generator
    died (tests/test_faults.py, 2 runs in 3 on a loaded machine); and where the stopping receiver
    had swapped the slot's bytes for a private copy meanwhile, the read was checked against that
    copy (nothing to check) instead of the segment it read. Now the read is checked against what it
    began on, and the call waits for what the publisher did: Evicted, on which the loop rejoins and
    reads on, bit-exact."""
    sds = [model(v, mib=2) for v in range(5)]
    async with ws.Publisher("torn", timeout=4, bucket_bytes=2 * MIB, encoding="full") as pub:
        sub = ws.Subscriber("torn", address=pub.address, member_id="m", timeout=4, transport="shm")
        async with sub:
            await pub.wait_subscribers(1, timeout=20)
            await (await pub.put(sds[0], version=0)).delivered(timeout=30)
            inside, go_on = threading.Event(), threading.Event()
            from weightsync.transport import subscriber as subscriber_mod
            copy = subscriber_mod.copy_into  # held half-way, as a frozen process holds it

            def held(read, dest) -> None:  # noqa: ANN001 - the read began on the segment's view
                inside.set()
                go_on.wait(30)
                copy(read, dest)  # ...and reads it after the publisher wrote it again

            monkeypatch.setattr(subscriber_mod, "copy_into", held)
            dest = {name: torch.zeros_like(t) for name, t in sds[0].items()}
            reading = asyncio.ensure_future(sub.get_into(dest, min_version=0, timeout=30))
            assert await asyncio.to_thread(inside.wait, 10)
            await pub.evict("m")
            for v in (1, 2):  # to nobody: version 0's buffer is written again (nobody reads it in place now)
                assert (await (await pub.put(sds[v], version=v)).delivered(timeout=30)).members == ()
            go_on.set()
            with pytest.raises(ws.Evicted):
                await reading
            monkeypatch.setattr(subscriber_mod, "copy_into", copy)
            await sub.rejoin()
            await pub.wait_subscribers(1, timeout=20)
            assert (await (await pub.put(sds[3], version=3)).delivered(timeout=30)).members == ("m",)
            assert await sub.get_into(dest, min_version=3, timeout=10) == 3
            assert digests(dest) == digests(sds[3])
