"""The same-host path: members on the publisher's host copy versions out of its shared memory.

What is checked here, each the way it fails in production: the path is chosen (and refused)
as documented; group and same-host members take the same versions bit-exact from one channel;
a corrupted copy is caught by the checksums and re-sent; ``kill -9`` of either side and a
member frozen with SIGSTOP leave no shared memory behind and never hold the publisher up.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import weightsync as ws
from tests.conftest import Procs
from tests.statedicts import digests, mixed_state_dict
from weightsync import _wire
from weightsync.control.framing import HEADER
from weightsync.planes.shm import plane as shm

pytestmark = [pytest.mark.timeout(180), pytest.mark.skipif(not shm.available(), reason="needs Linux memfds and /proc")]


@pytest.fixture(autouse=True)
def _collected() -> None:
    gc.collect()  # earlier tests' closed channels: their last views of segments go now


def dev_shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def body(v: int) -> dict[str, torch.Tensor]:
    return {"body": torch.full((4 << 20,), float(v)), "step": torch.tensor([v], dtype=torch.int64)}


@pytest.mark.asyncio
async def test_auto_picks_shared_memory_beside_group_members(procs: Procs) -> None:
    """Two members on the publisher's host take shared memory, one forced onto the group; all
    three get the same versions, bit-exact, copy=True and copy=False alike, and the publisher
    never holds more segments than staging's limit (plus the door)."""
    before = dev_shm()
    rec = ws.FlightRecorder(capacity=4000)
    async with ws.Publisher("same", timeout=10, heartbeat_interval=0.25, bucket_bytes=4 << 20,
                            recorder=rec) as pub:
        workers = [procs.spawn("subscriber", channel="same", address=pub.address, member=f"gen{i}",
                               until_version=5, deadline=90, transport=t)
                   for i, t in enumerate(["auto", "shm", "group"])]
        await pub.wait_subscribers(3, timeout=60)
        sds = {v: mixed_state_dict(v, mib=3.0, seed=v) for v in range(6)}
        for v, sd in sds.items():
            handle = await pub.put(sd, version=v, copy=v % 2 == 0)
            if v % 2:
                await handle.released(timeout=30)
            report = await handle.delivered(timeout=60)
            assert sorted(report.members) == ["gen0", "gen1", "gen2"]
            # the door and staging's buffers, a parked one a same-host reader still copies included
            assert shm.open_segments() <= 1 + pub._staging.limit()  # noqa: SLF001
        results = [await procs.result(w, timeout=60) for w in workers]
        assert pub.peak_snapshots() <= 2
    assert [r["transport"] for r in results] == ["shm", "shm", "group"]
    for result in results:
        assert result["order"][-1] == 5
        for version, seen in result["digests"].items():
            assert seen == digests(sds[int(version)]), (result["member"], version)
    # the group was formed by the publisher and gen2 only: same-host members never entered it
    formed = [e for e in rec.snapshot() if e.op in ("rebuild", "reconfigure") and e.member == "publisher"
              and e.state == "completed"]
    assert ("gen2",) in [e.peers for e in formed]
    assert not any({"gen0", "gen1"} & set(e.peers) for e in formed)
    assert shm.open_segments() == 0 and dev_shm() == before


@pytest.mark.asyncio
async def test_shared_memory_only_channel_newcomer_and_corruption() -> None:
    """No group member at all. A sealed snapshot is digested by nobody (the publisher takes no
    pass over it); a copy through the ring (``copy=False``) still is: a corrupted one is caught,
    never made readable, and the member goes on with the next version (a released copy=False
    version has nothing to re-send from). A newcomer gets the retained version without a put."""
    from weightsync.testing import Faults, inject

    rec = ws.FlightRecorder(capacity=4000)
    async with ws.Publisher("only", timeout=10, heartbeat_interval=0.25, bucket_bytes=1 << 20,
                            recorder=rec) as pub:
        bad = ws.Subscriber("only", address=pub.address, member_id="bad", timeout=10, transport="auto")
        inject(bad, Faults(corrupt={0, 1}))  # 0: a snapshot, read in place (the fault acts on a copy)
        async with bad, ws.Subscriber("only", address=pub.address, member_id="good", timeout=10,
                                      transport="auto") as good:
            await pub.wait_subscribers(2, timeout=20)
            assert (bad.transport, good.transport) == ("shm", "shm")
            for v in range(4):
                report = await (await pub.put(body(v), version=v, copy=v != 1)).delivered(timeout=30)
                assert sorted(report.members) == (["good"] if v == 1 else ["bad", "good"])
                for sub in ((good,) if v == 1 else (bad, good)):
                    w = await sub.get(min_version=v, timeout=10)
                    assert w.version == v and digests(w) == digests(body(v))
            assert bad.statistics().checksum_failures == 1 and good.statistics().checksum_failures == 0
            announced = {e.version: e.digest for e in rec.snapshot() if e.op == "announce" and e.member == "publisher"}
            assert announced[1] and not announced[0] and not announced[2]  # digested: the ring only
            assert not pub.evicted  # the corrupted copy was a failed attempt, not a strike out
            async with ws.Subscriber("only", address=pub.address, member_id="late", timeout=10,
                                     transport="auto") as late:
                w = await late.get(min_version=3, timeout=20)  # no new put: the retained version
                assert w.version == 3 and digests(w) == digests(body(3))
            # each member maps at most three segments (its readable and receiving views, and the
            # one it maps next); the publisher its door and staging's buffers
            assert shm.mapped_segments() <= 1 + pub._staging.limit() + 2 * 3  # noqa: SLF001


@pytest.mark.asyncio
async def test_transport_choices_fail_clearly() -> None:
    with pytest.raises(ValueError, match="transport must be"):
        ws.Subscriber("c", address="127.0.0.1:1", transport="carrier-pigeon")
    with pytest.raises(ws.TransportUnavailable, match="cuda_ipc"):
        ws.Subscriber("c", address="127.0.0.1:1", transport="cuda_ipc")
    # a "publisher" on another host: its door names a boot id that is not ours
    for offer, why in ((_wire.ShmOffer(pid=os.getpid(), fd=999, token=b"x" * 16, boot_id="another-boot"),
                        "another host"),
                       (None, "offers no shared memory"),
                       (_wire.ShmOffer(pid=os.getpid(), fd=999, token=b"x" * 16, boot_id=shm.boot_id()),
                        "out of reach")):
        server = socket.create_server(("127.0.0.1", 0))
        port = server.getsockname()[1]

        def serve(srv: socket.socket = server, o: _wire.ShmOffer | None = offer) -> None:
            conn, _ = srv.accept()
            body_ = _wire.encode(_wire.Challenge(_wire.PROTOCOL_VERSION, "c", b"n" * 16, shm=o))
            frame = _wire.encode(_wire.Frame(seq=1, mac=b"", body=body_))
            conn.sendall(HEADER.pack(len(frame)) + frame)
            conn.recv(1 << 16)  # whatever comes back (nothing: the subscriber gives up first)
            conn.close()

        task = asyncio.get_running_loop().run_in_executor(None, serve)
        with pytest.raises(ws.TransportUnavailable, match=why):
            async with ws.Subscriber("c", address=f"127.0.0.1:{port}", transport="shm", timeout=5):
                pass
        await asyncio.wait_for(task, 10)
        server.close()


@pytest.mark.asyncio
async def test_group_request_is_honoured_on_the_same_host() -> None:
    async with ws.Publisher("g", timeout=10, heartbeat_interval=0.25) as pub:
        async with ws.Subscriber("g", address=pub.address, transport="group", timeout=10) as sub:
            await pub.wait_subscribers(1, timeout=20)
            await (await pub.put(body(0), version=0)).delivered(timeout=30)
            assert sub.transport == "group" and digests(await sub.get(timeout=10)) == digests(body(0))


@pytest.mark.asyncio
async def test_kill_9_publisher_leaves_no_shared_memory(procs: Procs, tmp_path: Path) -> None:
    """The publisher is killed with -9 while it pushes every 50 ms: the member sees
    PublisherGone, unmaps everything, and nothing is left in /dev/shm or in its mappings."""
    before = dev_shm()
    address_file = tmp_path / "address"
    worker = procs.spawn("publisher", channel="pk", address_file=str(address_file), subscribers=1, deadline=60)
    deadline = time.monotonic() + 60
    while not address_file.exists():
        assert time.monotonic() < deadline, procs.log(worker)
        await asyncio.sleep(0.05)  # polling for the worker's address file
    async with ws.Subscriber("pk", address=address_file.read_text(), member_id="m", timeout=4,
                             transport="auto") as sub:
        assert sub.transport == "shm"
        w = await sub.get(min_version=3, timeout=30)
        assert shm.mapped_segments() >= 1
        procs.signal(worker, signal.SIGKILL)
        with pytest.raises(ws.PublisherGone):
            await sub.get(min_version=w.version + 1000, timeout=30)
        # the receiver thread unmaps as it stops, right after it reported the publisher gone
        deadline = time.monotonic() + 10
        while shm.mapped_segments() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # polling the process's own mappings, bounded
        assert shm.mapped_segments() == 0 and shm.open_segments() == 0
        last = await sub.get()  # the last complete version stays readable
        assert torch.equal(last["w"], torch.full((1000,), float(last.version)))
    assert dev_shm() == before


@pytest.mark.asyncio
@pytest.mark.parametrize("check", [True, False], ids=["checksums", "no-checksums"])
@pytest.mark.parametrize("copy", [True, False], ids=["snapshot", "copy-false-ring"])
async def test_kill_9_and_sigstop_members_never_hold_the_publisher(procs: Procs, check: bool, copy: bool) -> None:
    """One same-host member is killed with -9 and one frozen with SIGSTOP while they read
    (slow readers, so version 2 is in their hands): the publisher evicts both, keeps its
    segments within staging's bound (two once they are gone), and the healthy member gets every
    version bit-exact. The frozen one,
    resumed, copies on from buffers the publisher has reused meanwhile: it finds itself evicted
    and never published a torn version, with checksums (the Seal) or without (the epoch). With
    copy=False the version goes through the two-bucket ring, whose next slot waits for every
    member's word: a frozen member holds it only for its bucket's deadline, then it is dropped."""
    before = dev_shm()
    rec = ws.FlightRecorder(capacity=4000)
    async with ws.Publisher("fz", timeout=3, heartbeat_interval=0.25, bucket_bytes=1 << 20, recorder=rec,
                            checksum=check) as pub:
        slow = {"slow": 10.0}
        workers = [procs.spawn("subscriber", channel="fz", address=pub.address, member=name, until_version=7,
                               deadline=120, mode="follow", transport="shm",
                               **({"faults": slow} if name != "ok" else {}))
                   for name in ("ok", "killed", "frozen")]
        await pub.wait_subscribers(3, timeout=60)
        for v in range(8):
            handle = await pub.put(body(v), version=v, copy=copy)
            if v == 2:
                while not any(e.op == "announce" and e.version == 2 for e in rec.snapshot()):
                    await asyncio.sleep(0.005)  # until the recorder shows version 2 announced
                procs.signal(workers[1], signal.SIGKILL)
                procs.signal(workers[2], signal.SIGSTOP)
            report = await handle.delivered(timeout=60)
            assert "ok" in report.members
            # the door and staging's buffers: while the two have not acknowledged, the versions they
            # may read in place are parked, within staging's bound
            assert shm.open_segments() <= 1 + pub._staging.limit()  # noqa: SLF001
        # both evicted: what staging keeps parked is at most what the healthy member reads (7, and 6
        # if a reader of its still held it when it acknowledged 7)
        assert pub._sender.leases.held() <= frozenset({6, 7})  # noqa: SLF001
        assert pub.members == ("ok",)
        assert sorted(m.member_id for m in pub.evicted) == ["frozen", "killed"]
        procs.signal(workers[2], signal.SIGCONT)
        frozen = await procs.result(workers[2], timeout=60)
    ok = await procs.result(workers[0], timeout=60)  # follows until the publisher shut down
    assert ok["order"][-1] == 7
    for result in (ok, frozen):
        for version, seen in result["digests"].items():  # nothing torn was ever made readable
            assert seen == digests(body(int(version))), (result["member"], version)
    assert frozen["error"] in ("Evicted", "PublisherGone")
    assert shm.open_segments() == 0 and dev_shm() == before


def test_a_reused_segment_is_never_read_as_the_announced_version() -> None:
    """The publisher writes a buffer again while a member copies it (a member frozen mid-copy
    that resumed): the member's copy stops with Cancelled, however the checksums are set; so
    does one whose snapshot failed. A segment whose token is not the announced one, or a range
    past its end, is refused."""
    from weightsync._errors import Cancelled, ProtocolError
    from weightsync.planes.dataplane import Transfer

    def at(ref: shm.ShmRef) -> SimpleNamespace:  # the Announce's fields the plane reads
        return SimpleNamespace(plane=shm.announced(ref), generation=0, seq=0, version=0)

    pool = shm.SegmentPool("unit")
    pool.open()
    plane = shm.ShmPlane(os.getpid())
    try:
        buf = pool.allocate(4 << 20, torch.device("cpu"), False)
        buf.fill_(7)
        mark = pool.marker(buf)
        mark(buf.numel())  # the snapshot is complete
        ref = pool.ref(buf)
        assert ref is not None and ref.epoch == 0
        dest = torch.zeros(4 << 20, dtype=torch.uint8)
        buckets = [dest[i << 20:(i + 1) << 20] for i in range(4)]
        plane.move(Transfer(1, buckets, lambda n: 10.0, announce=at(ref)))
        assert torch.equal(dest, buf)  # an undisturbed copy is exact

        def overwrite(i: int) -> None:
            if i == 1:  # the publisher takes the buffer for a newer snapshot
                pool.reuse(buf)
                buf.fill_(9)

        with pytest.raises(Cancelled, match="reused"):
            plane.move(Transfer(2, buckets, lambda n: 10.0, after=overwrite, announce=at(ref)))
        ref = pool.ref(buf)
        assert ref is not None
        mark(-1)  # the publisher's snapshot failed: nobody reads it
        with pytest.raises(Cancelled, match="failed"):
            plane.move(Transfer(3, buckets, lambda n: 10.0, announce=at(ref)))
        with pytest.raises(ProtocolError, match="not the announced segment"):
            plane.move(Transfer(3, buckets, lambda n: 10.0, announce=at(shm.ShmRef(
                fd=ref.fd, token=b"y" * 16, offset=0, nbytes=ref.nbytes, epoch=1))))
        with pytest.raises(ProtocolError, match="overrun"):
            plane.move(Transfer(4, buckets, lambda n: 10.0, announce=at(shm.ShmRef(
                fd=ref.fd, token=ref.token, offset=ref.nbytes - 10, nbytes=ref.nbytes, epoch=1))))
        pool.drop(buf)
        assert pool.ref(buf) is None
    finally:
        plane.close()
        pool.close()
    assert shm.open_segments() == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", ["auto", "group"])
async def test_pipelined_snapshot_is_bit_exact_and_a_cancelled_one_is_never_read(
        transport: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """pipeline=True: the version is announced before its snapshot is taken, and bucket i goes
    out once copied. Members get it bit-exact; a put cancelled mid-snapshot (its copy fails
    half-way) is never made readable by anyone, and the channel goes on.

    Each snapshot starts only once its version was announced (bounded): an 8 MiB copy takes
    about 7 ms, and on a loaded 2-core CI machine the sender thread was once not scheduled that
    soon, so "announced while the snapshot was taken" failed by 1.7 ms. The gate proves the same
    thing without the race: the announce does not wait for the snapshot."""
    from weightsync.engine import snapshots

    rec = ws.FlightRecorder(capacity=4000)
    packing = snapshots.pack_progressively

    def announced_first(*args: object) -> None:
        version = max(e.version for e in rec.snapshot() if e.op == "put")
        deadline = time.monotonic() + 10
        while not any(e.op == "announce" and e.version == version for e in rec.snapshot()):
            assert time.monotonic() < deadline, f"version {version} was not announced before its snapshot"
            time.sleep(0.001)  # the snapshot thread waits for the sender thread's announce, bounded
        packing(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(snapshots, "pack_progressively", announced_first)
    # encoding="full": a delta is made from the whole snapshot, before its Announce (docs/deltas.md)
    async with ws.Publisher("pipe", timeout=10, heartbeat_interval=0.25, bucket_bytes=1 << 20, recorder=rec,
                            pipeline=True, encoding="full") as pub:
        async with ws.Subscriber("pipe", address=pub.address, member_id="a", timeout=10, transport=transport,
                                 recorder=rec) as a:
            await pub.wait_subscribers(1, timeout=20)
            assert a.transport == ("shm" if transport == "auto" else "group")
            for v in range(3):
                sd = mixed_state_dict(v, mib=8.0, seed=v)
                await (await pub.put(sd, version=v)).delivered(timeout=30)
                assert digests(await a.get(min_version=v, timeout=10)) == digests(sd)
            announced = [e for e in rec.snapshot() if e.op == "announce" and e.version == 2]
            puts = [e for e in rec.snapshot() if e.op == "put" and e.version == 2]
            assert announced[0].t_started < puts[0].t_ended  # announced while the snapshot was taken
            # and each read on the first try: nobody read bytes before they were copied
            assert [e.version for e in rec.snapshot() if e.op == "announce"] == [0, 1, 2]
            assert not [e for e in rec.snapshot() if e.op in ("checksum", "nack") or e.state == "failed"]
            big = {f"t{i}": torch.full((1 << 20,), float(i)) for i in range(64)}  # 256 MiB, 64 tensors
            task = asyncio.ensure_future(pub.put(big, version=3))
            while not any(e.op == "announce" and e.version == 3 for e in rec.snapshot()):
                await asyncio.sleep(0.001)  # until version 3 is on its way, snapshot unfinished
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            sd = mixed_state_dict(4, mib=1.0, seed=4)
            await (await pub.put(sd, version=4)).delivered(timeout=30)
            w = await a.get(min_version=4, timeout=10)
            assert digests(w) == digests(sd)
            published = [e.version for e in rec.snapshot() if e.op == "publish" and e.member == "a"]
            assert 3 not in published and published[-1] == 4
