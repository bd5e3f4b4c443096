"""The one-sided plane: members read each bucket out of the publisher's registered staging memory
over torch 2.15's ``torch.distributed._transport`` (NIXL).

Checked the way it fails in production: asked for where it cannot work, it names what is missing
(on either end), and ``"auto"`` never picks it; readers killed with -9 or frozen with SIGSTOP
mid-read never hold the publisher up, and the frozen one, resumed, publishes nothing torn; the
publisher killed with -9 mid-read leaves the member its last version; a read past its deadline
keeps the memory it may still write out of use until it ends (the transport cannot cancel DMA),
between real processes over TCP; reads outside the publisher's registration, or of a forged
one, are refused with nothing of the publisher's other memory read; and a newcomer catches up
from a member that holds the version (no byte from the publisher), a peer that lies, or is
frozen or killed with -9 mid-fetch, costing it reads from the publisher, never a wrong byte. The plane contract suite
(tests/test_plane_contract.py) runs it too. Everything but the first test needs torch 2.15 with
nixl (CI's torch 2.15 pass installs it).
"""

from __future__ import annotations

import asyncio
import gc
import signal
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import torch

import weightsync as ws
from tests.conftest import Procs
from tests.statedicts import digests
from weightsync._errors import LocalFailure, PeerFailure, ProtocolError
from weightsync.planes.onesided import endpoints
from weightsync.planes.onesided.endpoints import Reader, Registration
from weightsync.planes.shm import plane as shm
from weightsync.testing import Faults, inject
from weightsync.transport import planeset

pytestmark = [pytest.mark.timeout(180)]
needs = pytest.mark.skipif(endpoints.problem() is not None, reason=f"one-sided: {endpoints.problem()}")
FAST = {"timeout": 4.0, "heartbeat_interval": 0.25}


def body(v: int) -> dict[str, torch.Tensor]:
    return {"body": torch.full((4 << 20,), float(v)), "step": torch.tensor([v], dtype=torch.int64)}


@pytest.mark.asyncio
async def test_asking_where_it_cannot_work_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process lacks it: the Subscriber refuses at once, naming torch or nixl. It has it, the
    publisher does not: the join is refused with TransportUnavailable naming the publisher's
    reason. ``"auto"`` takes shared memory on the same host, never one-sided."""
    problem = endpoints.problem()
    if problem is not None:
        with pytest.raises(ws.TransportUnavailable, match="torch|nixl") as err:
            ws.Subscriber("c", address="127.0.0.1:1", transport="one-sided")
        assert problem in str(err.value)
        return
    async with ws.Publisher("auto", **FAST) as pub, \
            ws.Subscriber("auto", address=pub.address, timeout=4, transport="auto") as sub:
        assert sub.transport == ("shm" if shm.available() else "group")
    # the publisher's side only (this process's subscriber has it): as a publisher without nixl sees it
    monkeypatch.setattr(planeset, "endpoints", SimpleNamespace(problem=lambda: "nixl is not installed here"))
    async with ws.Publisher("without", **FAST) as pub:
        with pytest.raises(ws.TransportUnavailable, match="not served by this publisher: nixl is not installed here"):
            async with ws.Subscriber("without", address=pub.address, transport="one-sided", timeout=4):
                pass
    with pytest.raises(ws.TransportUnavailable, match="want="):
        ws.Subscriber("c", address="127.0.0.1:1", transport="one-sided", want={"w": torch.zeros(2)})


@needs
@pytest.mark.asyncio
@pytest.mark.parametrize("copy", [True, False], ids=["snapshot", "copy-false-ring"])
async def test_readers_killed_or_frozen_mid_read_never_hold_the_publisher(procs: Procs, copy: bool) -> None:
    """One reader is killed with -9 and one frozen with SIGSTOP while they read version 2 (slow
    readers): the publisher evicts both and the healthy one gets every version bit-exact. The
    frozen one, resumed, reads on from buffers the publisher has reused meanwhile and never makes
    a torn version readable. With copy=False the ring's next slot waits for every reader's word:
    a frozen one holds it for its bucket's deadline only."""
    rec = ws.FlightRecorder(capacity=4000)
    async with ws.Publisher("os", timeout=3, heartbeat_interval=0.25, bucket_bytes=1 << 20, recorder=rec) as pub:
        slow = {"slow": 10.0}
        workers = [procs.spawn("subscriber", channel="os", address=pub.address, member=name, until_version=7,
                               deadline=120, mode="follow", transport="one-sided",
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
        assert pub.members == ("ok",)
        assert sorted(m.member_id for m in pub.evicted) == ["frozen", "killed"]
        procs.signal(workers[2], signal.SIGCONT)
        frozen = await procs.result(workers[2], timeout=60)
    ok = await procs.result(workers[0], timeout=60)
    assert ok["order"][-1] == 7 and ok["transport"] == "one-sided"
    for result in (ok, frozen):
        for version, seen in result["digests"].items():  # nothing torn was ever made readable
            assert seen == digests(body(int(version))), (result["member"], version)
    assert frozen["error"] in ("Evicted", "PublisherGone")


@needs
@pytest.mark.asyncio
async def test_the_publisher_killed_mid_read_leaves_the_last_version(procs: Procs, tmp_path: Path) -> None:
    """The publisher is killed with -9 while it pushes every 50 ms: the reader sees PublisherGone,
    keeps its last complete version readable, and no read of its is left pending."""
    address_file = tmp_path / "address"
    worker = procs.spawn("publisher", channel="pk", address_file=str(address_file), subscribers=1, deadline=60)
    deadline = time.monotonic() + 60
    while not address_file.exists():
        assert time.monotonic() < deadline, procs.log(worker)
        await asyncio.sleep(0.05)  # polling for the worker's address file
    async with ws.Subscriber("pk", address=address_file.read_text(), member_id="m", timeout=4,
                             transport="one-sided") as sub:
        w = await sub.get(min_version=3, timeout=30)
        procs.signal(worker, signal.SIGKILL)
        with pytest.raises(ws.PublisherGone):
            await sub.get(min_version=w.version + 1000, timeout=30)
        last = await sub.get()
        assert torch.equal(last["w"], torch.full((1000,), float(last.version)))


def _exposed(procs: Procs, tmp_path: Path, mib: int, env: dict[str, str]) -> tuple[int, bytes, Registration, int]:
    """An exposer process (tests/workers.py): its index, url, registration and its secret's address."""
    file = tmp_path / "exposed"
    worker = procs.spawn("exposer", env=env, file=str(file), mib=mib)
    deadline = time.monotonic() + 60
    while not file.exists():
        assert time.monotonic() < deadline, procs.log(worker)
        time.sleep(0.05)  # polling for the worker's file
    url, reg, secret = msgspec.msgpack.decode(file.read_bytes(), type=tuple[bytes, Registration, int])
    return worker, url, reg, secret


@needs
def test_a_read_past_its_deadline_keeps_its_memory_out_of_use_until_it_ends(
        procs: Procs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over TCP (as between hosts), the publisher's process frozen with SIGSTOP mid-read: the read
    fails at its deadline (PeerFailure) but its memory is not read into again while the
    transport may still write it (LocalFailure, bounded); resumed, the late read lands, the
    memory is free again, and what landed is the publisher's bytes."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # this process's endpoint is made below, after it
    worker, url, reg, _ = _exposed(procs, tmp_path, 256, {"UCX_TLS": "tcp"})
    reader = Reader()
    try:
        reader.connect(url)
        into = torch.zeros(256 << 20, dtype=torch.uint8)
        procs.signal(worker, signal.SIGSTOP)
        with pytest.raises(PeerFailure, match="did not end in time"):
            reader.read(into, reader.remote(reg, 0, into.numel()), time.monotonic() + 0.5, None, "all")
        assert reader.busy() == 1
        with pytest.raises(LocalFailure, match="may still write"):
            reader.ready_for(into[: 1 << 20], time.monotonic() + 0.3)
        procs.signal(worker, signal.SIGCONT)
        reader.ready_for(into, time.monotonic() + 60)  # returns once the late read ended
        assert reader.busy() == 0 and bool((into == 7).all())
        reader.read(into[:4096], reader.remote(reg, 0, 4096), time.monotonic() + 30, None, "a page")
    finally:
        reader.close()


@needs
def test_reads_outside_the_registration_or_of_a_forged_one_are_refused(procs: Procs, tmp_path: Path) -> None:
    """A reader (an insider: it holds the publisher's url and a real registration) asks for bytes
    outside the registration, at the address of memory the publisher never registered, or through
    a registration naming another agent: each is refused before a byte moves, and nothing of the
    publisher's secret lands."""
    _, url, reg, secret = _exposed(procs, tmp_path, 1, {})
    reader = Reader()
    try:
        reader.connect(url)
        into = torch.zeros(4096, dtype=torch.uint8)
        with pytest.raises(ProtocolError, match="outside the publisher's"):
            reader.remote(reg, reg.length - 100, 4096)
        forged = [msgspec.structs.replace(reg, address=secret, length=4096),  # memory it never registered
                  msgspec.structs.replace(reg, address=reg.address + reg.length - 2048, length=4096),  # straddles
                  msgspec.structs.replace(reg, agent="someone-else")]
        for bad in forged:
            with pytest.raises(PeerFailure, match="refused"):
                reader.read(into, reader.remote(bad, 0, 4096), time.monotonic() + 10, None, "a forged range")
            assert not bool((into == 0x5A).any()) and reader.busy() == 0
        reader.read(into, reader.remote(reg, 0, 4096), time.monotonic() + 10, None, "the registration")
        assert bool((into == 7).all())  # the honest read still works on the same endpoint
    finally:
        reader.close()


@needs
@pytest.mark.asyncio
async def test_registrations_are_made_once_per_buffer_and_released_with_it() -> None:
    """Ten versions through two staging buffers register two buffers, not ten; versions too large
    for them take new buffers and the old ones, dropped by staging, are unregistered with them;
    closing the publisher releases the rest."""
    async with ws.Publisher("reg", **FAST) as pub, \
            ws.Subscriber("reg", address=pub.address, transport="one-sided", timeout=4) as sub:
        for v in range(10):
            await (await pub.put(body(v), version=v)).delivered(timeout=30)
            assert digests(await sub.get(min_version=v, timeout=30)) == digests(body(v))
        part = pub._sender.side.parts["one-sided"]  # noqa: SLF001
        assert 1 <= part.exposure.exposed() <= pub._staging.limit()  # noqa: SLF001
        for v in range(10, 14):
            larger = {"body": torch.full((16 << 20,), float(v))}
            await (await pub.put(larger, version=v)).delivered(timeout=30)
            assert digests(await sub.get(min_version=v, timeout=30)) == digests(larger)
        # registered: exactly the staging segments alive now (every descriptor but the door's)
        assert part.exposure.exposed() == shm.open_segments() - 1
    gc.collect()
    assert part.exposure.exposed() == 0


async def _holder_and_newcomer(pub: ws.Publisher, versions: int) -> tuple[ws.Subscriber, ws.Subscriber]:
    """Member "a" receives ``versions`` versions; then "b" joins (the retained version is sent again)."""
    a = ws.Subscriber(pub.name, address=pub.address, member_id="a", transport="one-sided", timeout=4)
    await a.start()
    await pub.wait_subscribers(1, timeout=30)
    for v in range(versions):
        await (await pub.put(body(v), version=v)).delivered(timeout=30)
    assert digests(await a.get(min_version=versions - 1, timeout=30)) == digests(body(versions - 1))
    b = ws.Subscriber(pub.name, address=pub.address, member_id="b", transport="one-sided", timeout=4)
    await b.start()
    return a, b


def _plane(sub: ws.Subscriber) -> Any:
    return sub._receiver._plane  # noqa: SLF001 - the plane's own count of bytes by source


@needs
@pytest.mark.asyncio
async def test_a_newcomer_catches_up_from_a_peer_and_the_trainer_sends_it_nothing() -> None:
    """A newcomer takes the retained version from the member that holds it, every bucket checked
    against the Seal: no byte of it comes out of the publisher's memory, nor of the holder's own
    copy of the re-send (it copies from itself). The next version comes from the publisher."""
    async with ws.Publisher("cu", **FAST) as pub:
        a, b = await _holder_and_newcomer(pub, 3)
        try:
            from_publisher = dict(_plane(a).took).get("publisher", 0)
            assert digests(await b.get(min_version=2, timeout=30)) == digests(body(2))
            size = sum(t.numel() * t.element_size() for t in body(2).values())
            took = dict(_plane(b).took)
            assert took.get("publisher", 0) == 0 and took["peer"] >= size, took
            assert _plane(a).took.get("publisher", 0) == from_publisher  # the holder copied from itself
            await (await pub.put(body(3), version=3)).delivered(timeout=30)
            assert digests(await b.get(min_version=3, timeout=30)) == digests(body(3))
            assert _plane(b).took["publisher"] >= size  # new versions come from the publisher
        finally:
            await asyncio.gather(a.aclose(), b.aclose())


@needs
@pytest.mark.asyncio
async def test_a_peer_that_lies_costs_the_newcomer_a_read_from_the_publisher_never_a_wrong_byte() -> None:
    """The holder (an insider) corrupts the buffer it offered: the newcomer's first bucket from it
    does not match the Seal, is read from the publisher instead, and the version is bit-exact."""
    rec = ws.FlightRecorder(capacity=2000)
    async with ws.Publisher("liar", **FAST) as pub:
        a = ws.Subscriber("liar", address=pub.address, member_id="a", transport="one-sided", timeout=4)
        await a.start()
        await pub.wait_subscribers(1, timeout=30)
        await (await pub.put(body(0), version=0)).delivered(timeout=30)
        await a.get(min_version=0, timeout=30)
        held = _plane(a)._held.flat  # noqa: SLF001 - what "a" offered
        held[100] = held[100] ^ 0xFF  # a lie in what it relays
        b = ws.Subscriber("liar", address=pub.address, member_id="b", transport="one-sided", timeout=4,
                          recorder=rec)
        try:
            await b.start()
            assert digests(await b.get(min_version=0, timeout=30)) == digests(body(0))
            assert _plane(b).took.get("publisher", 0) > 0
            assert any(e.op == "catch_up" and "does not match the Seal" in e.error for e in rec.snapshot())
        finally:
            await asyncio.gather(a.aclose(), b.aclose())


@needs
@pytest.mark.asyncio
@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL], ids=["sigstop", "kill-9"])
async def test_a_peer_frozen_or_killed_mid_fetch_costs_the_newcomer_reads_from_the_publisher(
        procs: Procs, monkeypatch: pytest.MonkeyPatch, sig: int) -> None:
    """Over TCP, the holder (its own process) is frozen with SIGSTOP, or killed with -9, once the
    newcomer took its first bucket from it (the newcomer is slowed, so it is mid-fetch). Frozen:
    the next read from it outlives half the bucket's deadline and the rest is read from the
    publisher. Killed: the publisher sees it gone, gives the version up and sends it again to the
    newcomer alone, from its own memory. Either way the version is bit-exact, the holder is out
    and the publisher goes on."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # before this process's endpoints are made
    async with ws.Publisher("frz", timeout=3, heartbeat_interval=0.5, bucket_bytes=1 << 20) as pub:
        holder = procs.spawn("subscriber", env={"UCX_TLS": "tcp"}, channel="frz", address=pub.address, member="a",
                             until_version=99, deadline=120, mode="follow", transport="one-sided")
        await pub.wait_subscribers(1, timeout=60)
        await (await pub.put(body(0), version=0)).delivered(timeout=30)
        rec = ws.FlightRecorder(capacity=2000)
        b = ws.Subscriber("frz", address=pub.address, member_id="b", transport="one-sided", timeout=3, recorder=rec)
        inject(b, Faults(slow=3.0))  # 40 ms after each bucket: mid-fetch for long enough
        try:
            async with b:
                while not any(e.op == "bucket_recv" and e.state == "completed" for e in rec.snapshot()):
                    await asyncio.sleep(0.002)  # until the recorder shows its first bucket in
                procs.signal(holder, sig)
                assert digests(await b.get(min_version=0, timeout=60)) == digests(body(0))
                assert _plane(b).took.get("publisher", 0) > 0 and _plane(b).took.get("peer", 0) > 0
                if sig == signal.SIGSTOP:
                    assert any(e.op == "catch_up" and e.peers == ("peer a",) and "did not end in time" in e.error
                               for e in rec.snapshot())
                await (await pub.put(body(1), version=1)).delivered(timeout=60)
                assert digests(await b.get(min_version=1, timeout=30)) == digests(body(1))
                assert "a" not in pub.members
        finally:
            if sig == signal.SIGSTOP:
                procs.signal(holder, signal.SIGCONT)


@needs
@pytest.mark.asyncio
async def test_a_reader_slower_than_the_timeout_is_waited_for_at_the_slowest_rate() -> None:
    """A one-sided member takes about 5 s to read a 16 MiB version (0.28 s after each of its 17
    buckets), past the channel's 2 s timeout: the publisher moved nothing for it and sealed at once,
    so it waits for its Ack the version's bytes at the minimum bandwidth longer (8 s here), and
    the member is not evicted."""
    async with ws.Publisher("slowread", timeout=2, heartbeat_interval=0.25, bucket_bytes=1 << 20,
                            min_bandwidth=2e6) as pub:
        sub = ws.Subscriber("slowread", address=pub.address, member_id="m", transport="one-sided", timeout=4)
        inject(sub, Faults(slow=15.0))
        async with sub:
            await pub.wait_subscribers(1, timeout=30)
            report = await (await pub.put(body(0), version=0)).delivered(timeout=60)
            assert "m" in report.members and not pub.evicted
            assert digests(await sub.get(min_version=0, timeout=30)) == digests(body(0))


@needs
@pytest.mark.asyncio
async def test_a_pipelined_snapshot_is_read_as_it_is_taken_and_bit_exact() -> None:
    """With ``pipeline=True`` a version is announced while its snapshot is still being taken: the
    reader waits on the buffer's ready count (read one-sided from its header) and every version
    arrives bit-exact."""
    async with ws.Publisher("pipe", timeout=4, heartbeat_interval=0.25, bucket_bytes=1 << 20, pipeline=True) as pub, \
            ws.Subscriber("pipe", address=pub.address, transport="one-sided", timeout=4) as sub:
        await pub.wait_subscribers(1, timeout=30)
        for v in range(4):
            sd = {"body": torch.randn(8 << 20), "step": torch.tensor([v])}
            await (await pub.put(sd, version=v)).delivered(timeout=30)
            assert digests(await sub.get(min_version=v, timeout=30)) == digests(sd)
