"""Operable in production: any start order, clear handshake errors, logs, statistics and a
Prometheus scrape, the blocking API, replacements that never wait on the user's loop, and the
small things (get_into that skips what it holds, puts delivered to nobody, tied weights)."""

from __future__ import annotations

import ast
import asyncio
import logging
import math
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

import weightsync as ws
from tests.conftest import REPO, Procs
from weightsync import _wire
from weightsync.control.framing import HEADER
from weightsync.testing import Faults, Hooks, inject

pytestmark = [pytest.mark.timeout(120)]
FAST = {"timeout": 5.0, "heartbeat_interval": 0.25}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout}s")
        await asyncio.sleep(0.01)  # polling a condition with a deadline, not synchronisation


# -- start order ---------------------------------------------------------------------------------

@pytest.mark.asyncio
async def test_a_subscriber_started_before_its_publisher_joins_once_it_is_up(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="weightsync")
    port = free_port()
    sub = ws.Subscriber("order", address=f"127.0.0.1:{port}", timeout=10.0, flight_recorder_dir=tmp_path / "fr",
                        recorder=ws.FlightRecorder())  # its own: the process's may hold earlier tests' trouble
    joining = asyncio.create_task(sub.start())
    await until(lambda: any("no publisher at" in r.getMessage() for r in caplog.records), 10, "a first try")
    assert not joining.done()  # still trying, not failed with "connection refused"
    async with ws.Publisher("order", address=f"127.0.0.1:{port}", recorder=ws.FlightRecorder(), **FAST) as pub:
        await asyncio.wait_for(joining, 30)
        await pub.wait_subscribers(1, timeout=10)
        await (await pub.put({"w": torch.arange(4.0)}, version=1)).delivered(timeout=10)
        assert torch.equal((await sub.get(min_version=1, timeout=10))["w"], torch.arange(4.0))
        await sub.aclose()
    assert not (tmp_path / "fr").exists()  # no dump for the tries before the publisher was up


@pytest.mark.asyncio
async def test_a_publisher_that_never_comes_is_a_timeout_naming_the_address(tmp_path: Path) -> None:
    port = free_port()
    sub = ws.Subscriber("never", address=f"127.0.0.1:{port}", timeout=0.75, flight_recorder_dir=tmp_path / "fr",
                        recorder=ws.FlightRecorder())
    t0 = time.monotonic()
    with pytest.raises(ws.SyncTimeout, match=f"never answered at 127.0.0.1:{port}") as info:
        await sub.start()
    assert 1.0 <= time.monotonic() - t0 < 15  # its join deadline (twice its timeout), then it gave up
    assert "tries" in str(info.value)
    assert not (tmp_path / "fr").exists()  # one refusal after another is nothing to dump


@pytest.mark.asyncio
async def test_a_publisher_that_was_up_and_went_away_is_gone_at_once() -> None:
    """Only a subscriber that never reached its publisher waits for it: a rejoin after the
    publisher left raises PublisherGone at once, not after the join deadline (60 s here)."""
    async with ws.Publisher("away", **FAST) as pub:
        sub = ws.Subscriber("away", address=pub.address, member_id="g0", timeout=30.0)
        await sub.start()
        await pub.wait_subscribers(1, timeout=10)
        await pub.evict("g0")
        await (await pub.put({"w": torch.zeros(2)})).delivered(timeout=10)
        await until(lambda: sub.evicted, 20, "the eviction")
    t0 = time.monotonic()
    with pytest.raises(ws.PublisherGone, match="cannot reach the publisher"):
        await sub.rejoin()
    assert time.monotonic() - t0 < 10


# -- handshake errors ----------------------------------------------------------------------------

@pytest.mark.asyncio
async def test_handshake_errors_name_both_sides_in_one_line() -> None:
    async with ws.Publisher("policy", **FAST) as pub:
        with pytest.raises(ws.HandshakeMismatch) as info:
            await ws.Subscriber("value", address=pub.address, timeout=2.0).start()
        text = str(info.value)
        assert "'policy'" in text and "'value'" in text and pub.address in text
        assert "nonce" not in text and "Challenge(" not in text and "\n" not in text
        with pytest.raises(ws.AdmissionDenied, match="no secret .an open channel., this subscriber has one"):
            await ws.Subscriber("policy", address=pub.address, timeout=2.0, secret="s3cret").start()
    async with ws.Publisher("policy", secret="right", **FAST) as pub:
        with pytest.raises(ws.AdmissionDenied, match="requires a secret, this subscriber has none"):
            await ws.Subscriber("policy", address=pub.address, timeout=2.0).start()
        with pytest.raises(ws.AdmissionDenied, match="not the publisher's") as info:
            await ws.Subscriber("policy", address=pub.address, timeout=2.0, secret="wrong").start()
        assert "right" not in str(info.value) and "wrong" not in str(info.value).replace("wrong token", "")


@pytest.mark.asyncio
async def test_a_publisher_of_another_protocol_is_named_as_such() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def serve() -> None:
        conn, _ = server.accept()
        body = _wire.encode(_wire.Challenge(_wire.PROTOCOL_VERSION - 1, "c", b"n" * 16))
        frame = _wire.encode(_wire.Frame(seq=1, mac=b"", body=body))
        conn.sendall(HEADER.pack(len(frame)) + frame)
        conn.recv(1 << 16)
        conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with pytest.raises(ws.HandshakeMismatch, match=f"protocol {_wire.PROTOCOL_VERSION - 1}, this subscriber "
                                                       f"{_wire.PROTOCOL_VERSION}"):
            await ws.Subscriber("c", address=f"127.0.0.1:{port}", timeout=2.0).start()
    finally:
        server.close()
        thread.join(5)


# -- logs --------------------------------------------------------------------------------------

@pytest.mark.asyncio
async def test_joins_generations_evictions_and_checksum_failures_are_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="weightsync")
    async with ws.Publisher("logs", **FAST) as pub:
        subs = [ws.Subscriber("logs", address=pub.address, member_id=f"g{i}", timeout=FAST["timeout"])
                for i in range(2)]
        inject(subs[1], Faults(corrupt={2}))
        await asyncio.gather(*(s.start() for s in subs))
        await pub.wait_subscribers(2, timeout=10)
        for v in range(1, 4):
            await (await pub.put({"w": torch.full((1024,), float(v))}, version=v)).delivered(timeout=20)
        await pub.evict("g0")
        await (await pub.put({"w": torch.zeros(1024)}, version=4)).delivered(timeout=20)
        await until(lambda: pub.evicted, 20, "the eviction")
        await asyncio.gather(*(s.aclose() for s in subs))

    def records(logger: str, level: int, pattern: str) -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == logger and r.levelno == level
                and re.search(pattern, r.getMessage())]

    assert records("weightsync.membership", logging.INFO, r"g0 joined .*host .*pid")
    assert records("weightsync.membership", logging.INFO, r"generation \d+ formed with 2 members")
    assert records("weightsync.membership", logging.WARNING, r"g0 evicted \(operator\).*flight recorder")
    assert records("weightsync.subscriber", logging.INFO, r"g1 joined channel 'logs'")
    # version 2 went as a delta (one value throughout: it compresses to nothing), and its corrupted
    # wire was refused as such; a full version's corrupted bucket is named by its digest
    assert records("weightsync.subscriber", logging.WARNING,
                   r"version 2: (buckets \[0\] arrived corrupted|its delta against version 1 did not apply)")
    assert records("weightsync.publisher", logging.DEBUG, r"version 3 delivered to 2 members")
    assert all(not r.getMessage().startswith("weightsync:") for r in caplog.records if r.name.startswith("weightsync"))
    assert logging.getLogger("weightsync").handlers == []  # the application configures logging


def test_the_library_never_prints() -> None:
    """Only the command-line programs print (the CLI, `weightsync bench`, `weightsync demo`); none of
    the library's modules does, nor imports them."""
    package = REPO / "weightsync"
    programs = {package / "cli.py", *(package / "bench").rglob("*.py"), *(package / "demo").rglob("*.py")}
    library = [p for p in package.rglob("*.py") if p not in programs]
    offenders = [f"{p.relative_to(REPO)}:{node.lineno}" for p in library for node in ast.walk(ast.parse(p.read_text()))
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"]
    assert offenders == []  # docstring examples may print; the code never does
    importers = [f"{p.relative_to(REPO)}" for p in library
                 if re.search(r"^\s*(from|import) weightsync\.(bench|demo|cli)\b", p.read_text(), re.M)]
    assert importers == []


# -- statistics and Prometheus -------------------------------------------------------------------

@pytest.mark.asyncio
async def test_statistics_count_what_happened_and_prometheus_serves_them() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from weightsync.prometheus import register

    registry = prometheus_client.CollectorRegistry()
    async with ws.Publisher("stats", **FAST) as pub:
        assert pub.statistics().versions_put == 0
        handle = await pub.put({"w": torch.ones(256)}, version=0)  # nobody yet
        assert (await handle.delivered(timeout=10)).nobody
        async with ws.Subscriber("stats", address=pub.address, member_id="g0", timeout=5.0) as sub:
            await pub.wait_subscribers(1, timeout=10)
            for v in range(1, 4):
                await (await pub.put({"w": torch.full((256,), float(v))}, version=v)).delivered(timeout=10)
            await sub.get(min_version=3, timeout=10)
            stats = pub.statistics()
            # version 0, retained, is sent again to the newcomer when it joins: a second delivery
            sends = stats.versions_delivered + stats.versions_to_nobody
            assert (stats.versions_put, stats.versions_to_nobody) == (4, 1) and stats.versions_delivered in (3, 4)
            assert stats.bytes_delivered == stats.versions_delivered * 1024 and stats.bytes_put == sends * 1024
            assert stats.put_stall.count == 4 and 0 < stats.put_stall.p50 <= stats.put_stall.max
            assert stats.delivery.count == sends and stats.generations >= 1
            (member,) = stats.members
            assert (member.member_id, member.last_version, member.lag) == ("g0", 3, 0)
            assert member.last_receive_seconds is not None and member.last_receive_seconds > 0
            mine = sub.statistics()
            assert (mine.version, mine.reads, mine.checksum_failures) == (3, 1, 0)
            assert mine.versions_received == stats.versions_delivered and mine.receive.count == mine.versions_received
            assert mine.bytes_received == 1024 * mine.versions_received

            register(pub, registry=registry)
            register(sub, registry=registry)
            server, thread = prometheus_client.start_http_server(0, addr="127.0.0.1", registry=registry)
            try:
                url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
                text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read().decode())
            finally:
                server.shutdown()
                thread.join(10)
    assert 'weightsync_versions_put_total{channel="stats"} 4.0' in text
    assert re.search(r'weightsync_versions_delivered_total\{channel="stats"\} [34]\.0', text)
    assert 'weightsync_member_lag_versions{channel="stats",member="g0"} 0.0' in text
    assert re.search(r'weightsync_put_stall_seconds\{channel="stats",quantile="0.5"\} [0-9.e-]+', text)
    assert 'weightsync_put_stall_seconds_count{channel="stats"} 4.0' in text
    assert re.search(r'weightsync_subscriber_versions_received_total\{channel="stats",member="g0"\} [34]\.0', text)
    assert "# TYPE weightsync_versions_put_total counter" in text


@pytest.mark.asyncio
async def test_evictions_are_counted_by_reason() -> None:
    async with ws.Publisher("evs", **FAST) as pub:
        async with ws.Subscriber("evs", address=pub.address, member_id="g0", timeout=5.0):
            await pub.wait_subscribers(1, timeout=10)
            await pub.evict("g0")
            await (await pub.put({"w": torch.zeros(4)})).delivered(timeout=10)
            await until(lambda: pub.evicted, 20, "the eviction")
            assert pub.statistics().evictions == {"operator": 1}


# -- the blocking API --------------------------------------------------------------------------

def test_the_blocking_api_pushes_and_reads_without_an_event_loop() -> None:
    with ws.BlockingPublisher("sync", **FAST) as pub:
        port = pub.address
        with ws.BlockingSubscriber("sync", address=port, member_id="g0", timeout=5.0) as sub:
            assert pub.wait_subscribers(1, timeout=10) == ("g0",)
            handles = [pub.put({"w": torch.full((8,), float(v)), "step": torch.tensor(v)}, version=v)
                       for v in range(3)]
            report = handles[-1].delivered(timeout=10, min_members=1)
            assert report.members == ("g0",)
            assert sub.get(min_version=2, timeout=10)["step"].item() == 2
            dest = {"w": torch.zeros(8), "step": torch.tensor(0)}
            assert sub.get_into(dest, timeout=10) == 2 and dest["w"][0].item() == 2.0
            seen: list[tuple[str, float]] = []
            assert sub.load(lambda pairs: seen.extend((n, t.float().sum().item()) for n, t in pairs)) == 2
            assert seen == [("w", 16.0), ("step", 2.0)]
            with sub.stream(min_version=2, timeout=10) as weights:
                assert [name for name, _ in weights] == ["w", "step"]
            updates = sub.updates(timeout=10)
            assert next(updates).version == 2
            pub.put({"w": torch.ones(8), "step": torch.tensor(3)}, version=3)
            assert next(updates).version == 3
            borrowed = {"w": torch.full((8,), 4.0), "step": torch.tensor(4)}
            handle = pub.put(borrowed, version=4, copy=False)
            handle.released(timeout=10, spill=True)  # copy=False, let go early: the same as the async one
            borrowed["w"].zero_()
            handle.delivered(timeout=10)
            assert sub.get(min_version=4, timeout=10)["w"][0].item() == 4.0
            assert sub.get_into(dest, min_version=4, timeout=10, as_received=True) == 4 and dest["w"][0].item() == 4.0
            with pytest.raises(ws.SyncTimeout):  # the same errors as the asynchronous API
                sub.get(min_version=99, timeout=0.2)
            for end in (sub, pub):  # a second start is the caller's mistake: refused, the end keeps running
                with pytest.raises(ws.Closed, match="starts once"):
                    end.start()
            with pytest.raises(ValueError, match="2\\*\\*63"):
                sub.get(min_version=2**70, timeout=1)
            with pytest.raises(ValueError, match="strictly increase"):
                pub.put({"w": torch.ones(8), "step": torch.tensor(0)}, version=1)
            assert pub.statistics().versions_put == 5
            pub.put({"w": torch.full((8,), 5.0), "step": torch.tensor(5)}, version=5).delivered(timeout=10)
            assert sub.get(min_version=5, timeout=10)["w"][0].item() == 5.0
    with pytest.raises(ws.Closed):  # closed: like the asynchronous publisher
        pub.put({"w": torch.ones(8)})


def test_a_blocking_subscriber_may_start_before_its_publisher() -> None:
    port = free_port()
    box: dict[str, object] = {}

    def generator() -> None:
        try:
            with ws.BlockingSubscriber("early", address=f"127.0.0.1:{port}", timeout=10.0) as sub:
                box["version"] = sub.get(min_version=1, timeout=30).version
        except BaseException as err:  # reported by the assertion below
            box["error"] = err

    thread = threading.Thread(target=generator)
    thread.start()
    with ws.BlockingPublisher("early", address=f"127.0.0.1:{port}", **FAST) as pub:
        pub.wait_subscribers(1, timeout=30)
        pub.put({"w": torch.ones(3)}, version=1).delivered(timeout=10)
        thread.join(30)
    assert box == {"version": 1}


# -- replacement and delivery never wait on the user's loop ----------------------------------------

class Timed:
    """An orchestrator that notes when it was asked (the Orchestrator protocol)."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, float]] = []

    async def replace(self, member: ws.MemberInfo) -> None:
        self.asked.append((member.member_id, time.monotonic()))


@pytest.mark.asyncio
@pytest.mark.slow
async def test_a_replacement_starts_while_the_users_loop_is_blocked(procs: Procs) -> None:
    """A synchronous 5 s training step holds the trainer's loop while a generator is killed: the
    orchestrator is asked on weightsync's own thread within a bound of the death, not after the
    step, and the version being sent is timed by the sender, not by when the loop got to it."""
    orchestrator = Timed()
    async with ws.Publisher("blocked", timeout=4.0, heartbeat_interval=0.25, orchestrator=orchestrator) as pub:
        victim = procs.spawn("subscriber", channel="blocked", address=pub.address, member="gen0",
                             mode="follow", deadline=60, timeout=4.0)
        await pub.wait_subscribers(1, timeout=60)
        await (await pub.put({"w": torch.zeros(1 << 16)}, version=0)).delivered(timeout=20)
        handle = await pub.put({"w": torch.ones(1 << 16)}, version=1)
        procs.signal(victim, signal.SIGKILL)
        killed = time.monotonic()
        time.sleep(5.0)  # noqa: ASYNC251 - the user's synchronous training step, holding the loop on purpose
        unblocked = time.monotonic()
        assert orchestrator.asked, "not asked while the loop was blocked"
        (member, asked), = orchestrator.asked
        assert member == "gen0" and asked - killed < 4.0 and asked < unblocked
        report = await handle.delivered(timeout=20)
        assert report.delivered_at > 0 and report.delivered_at < time.time() - (time.monotonic() - unblocked) + 0.5


# -- the smaller things ------------------------------------------------------------------------

@pytest.mark.asyncio
async def test_get_into_only_newer_copies_nothing_the_destination_already_holds() -> None:
    async with ws.Publisher("newer", **FAST) as pub:
        async with ws.Subscriber("newer", address=pub.address, timeout=5.0) as sub:
            await pub.wait_subscribers(1, timeout=10)
            await (await pub.put({"w": torch.full((64,), 1.0)}, version=1)).delivered(timeout=10)
            dest = {"w": torch.zeros(64)}
            assert await sub.get_into(dest, min_version=1, timeout=10, only_newer=True) == 1
            assert await sub.get_into(dest, only_newer=True) == 1
            assert sub.statistics().reads_skipped == 1
            dest["w"].zero_()  # somebody wrote the destination: it is copied again
            assert await sub.get_into(dest, only_newer=True) == 1 and dest["w"][0].item() == 1.0
            other = {"w": torch.zeros(64)}  # another destination holds nothing yet
            assert await sub.get_into(other, only_newer=True) == 1 and other["w"][0].item() == 1.0
            await (await pub.put({"w": torch.full((64,), 2.0)}, version=2)).delivered(timeout=10)
            assert await sub.get_into(other, min_version=2, timeout=10, only_newer=True) == 2
            assert other["w"][0].item() == 2.0 and sub.statistics().reads_skipped == 1


class _Watch(Hooks):
    """At the last bucket of each version (before it is verified and readable): what the waiting
    ``get_into``'s destination and the subscriber's readable version were."""

    def __init__(self, dest: dict[str, torch.Tensor], name: str, last_bucket: int, corrupt: int | None = None) -> None:
        self.dest, self.name, self.last_bucket = dest, name, last_bucket
        self.sub: ws.Subscriber | None = None
        self.corrupt = corrupt
        self.seen: list[tuple[int, int | None, float]] = []

    def after_bucket(self, version: int, index: int, bucket: torch.Tensor, seconds: float) -> None:
        if index == 0 and version == self.corrupt:
            self.corrupt = None
            bucket[0] ^= 0xFF  # the first tensor's first byte, as a bad link would flip it
        if index == self.last_bucket:
            assert self.sub is not None
            self.seen.append((version, self.sub.version, self.dest[self.name].flatten()[0].item()))


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", ["group", "shm"])
async def test_get_into_as_received_writes_a_version_into_the_destination_while_it_arrives(transport: str) -> None:
    # 16 tensors of 64 KiB in buckets of 128 KiB: the first tensor is written long before the last bucket
    sd = {f"w{i:02d}": torch.full((16384,), float(i)) for i in range(16)}
    dest = {name: torch.zeros_like(t) for name, t in sd.items()}
    watch = _Watch(dest, "w00", last_bucket=7)
    async with ws.Publisher("ahead", bucket_bytes=1 << 17, **FAST) as pub:
        sub = ws.Subscriber("ahead", address=pub.address, timeout=5.0, transport=transport)
        inject(sub, watch)
        watch.sub = sub
        async with sub:
            await pub.wait_subscribers(1, timeout=10)
            for version in (1, 2):
                waiting = asyncio.create_task(sub.get_into(dest, min_version=version, timeout=10, as_received=True))
                await until(lambda: sub._slots.into is not None, 10, "the call waiting")  # noqa: B023
                # copy=False over shared memory: a private copy out of the ring, written ahead too
                handle = await pub.put({n: t + 100 * version for n, t in sd.items()}, version=version,
                                       copy=transport == "group")
                assert await waiting == version
                await handle.delivered(timeout=10)
                assert all(torch.equal(dest[n], t + 100 * version) for n, t in sd.items())
            # the first tensor was already the new version's while the subscriber still read the old one
            assert watch.seen == [(1, None, 100.0), (2, 1, 200.0)]
            assert sub.statistics().reads_as_received == 2 and sub._slots.into is None
            # a version already readable is copied as a plain get_into copies it
            fresh = {name: torch.zeros_like(t) for name, t in sd.items()}
            assert await sub.get_into(fresh, as_received=True) == 2 and sub.statistics().reads_as_received == 2
            assert all(torch.equal(fresh[n], t + 200) for n, t in sd.items())


@pytest.mark.asyncio
async def test_get_into_as_received_never_returns_a_version_that_failed_its_checks() -> None:
    sd = {f"w{i:02d}": torch.full((16384,), float(i)) for i in range(16)}
    dest = {name: torch.zeros_like(t) for name, t in sd.items()}
    watch = _Watch(dest, "w00", last_bucket=7, corrupt=1)
    async with ws.Publisher("ahead-bad", bucket_bytes=1 << 17, **FAST) as pub:
        sub = ws.Subscriber("ahead-bad", address=pub.address, timeout=5.0, transport="group")
        inject(sub, watch)
        watch.sub = sub
        async with sub:
            await pub.wait_subscribers(1, timeout=10)
            waiting = asyncio.create_task(sub.get_into(dest, min_version=1, timeout=10, as_received=True))
            await until(lambda: sub._slots.into is not None, 10, "the call waiting")
            report = await (await pub.put({n: t + 100 for n, t in sd.items()}, version=1)).delivered(timeout=10)
            assert await waiting == 1 and sub.member_id in report.members
            assert all(torch.equal(dest[n], t + 100) for n, t in sd.items())
            # the flipped byte reached the destination before the checks caught it; the re-send wrote it again
            flipped = torch.tensor([100.0]).view(torch.uint8)
            flipped[0] ^= 0xFF
            assert watch.seen[0] == (1, None, flipped.view(torch.float32).item()) and len(watch.seen) == 2
            assert sub.statistics().checksum_failures == 1
            # a call that gives up waiting takes its destination back: nothing more is written there
            with pytest.raises(ws.SyncTimeout):
                await sub.get_into(dest, min_version=2, timeout=0.2, as_received=True)
            assert sub._slots.into is None
            await (await pub.put({n: t + 200 for n, t in sd.items()}, version=2)).delivered(timeout=10)
            assert all(torch.equal(dest[n], t + 100) for n, t in sd.items())


@pytest.mark.asyncio
async def test_a_put_delivered_to_nobody_is_visible(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="weightsync")
    async with ws.Publisher("nobody", **FAST) as pub:
        first = await (await pub.put({"w": torch.ones(4)}, version=1)).delivered(timeout=10)
        assert first.nobody and first.members == ()
        with pytest.raises(ws.NotDelivered, match="reached 0 of the 1 members") as info:
            await (await pub.put({"w": torch.ones(4)}, version=2)).delivered(timeout=10, min_members=1)
        assert info.value.report.version == 2
    warnings = [r for r in caplog.records if "delivered to nobody" in r.getMessage()]
    assert len(warnings) == 1  # once per streak, not once per put


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(128, 16)
        self.body = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 128, bias=False)
        self.head.weight = self.embed.weight  # tied, as most small LLMs are


@pytest.mark.asyncio
async def test_tied_weights_are_sent_once_and_tied_again_on_the_member() -> None:
    trainer, generator = Tied(), Tied()
    with torch.no_grad():
        trainer.embed.weight.normal_()
    sd = trainer.state_dict()
    assert sd["embed.weight"].data_ptr() == sd["head.weight"].data_ptr()
    untied = sum(t.numel() * t.element_size() for t in sd.values())
    async with ws.Publisher("tied", **FAST) as pub:
        async with ws.Subscriber("tied", address=pub.address, timeout=5.0) as sub:
            await pub.wait_subscribers(1, timeout=10)
            report = await (await pub.put(sd, version=1)).delivered(timeout=10)
            assert report.nbytes < untied - 128 * 16 * 4 + 64 * 4  # the tied tensor went once
            weights = await sub.get(min_version=1, timeout=10)
            assert set(weights) == set(sd)
            assert weights["head.weight"].data_ptr() == weights["embed.weight"].data_ptr()
            assert torch.equal(weights["head.weight"], sd["embed.weight"])
            await sub.get_into(generator.state_dict(), timeout=10)
            assert generator.head.weight is generator.embed.weight
            assert torch.equal(generator.head.weight, trainer.embed.weight)
            separate = {k: torch.zeros_like(v) for k, v in sd.items()}  # untied destination: both written
            await sub.get_into(separate, timeout=10)
            assert torch.equal(separate["head.weight"], sd["embed.weight"])
            async with sub.stream() as pairs:
                assert sorted(name for name, _ in pairs) == sorted(sd) and len(pairs) == len(sd)


@pytest.mark.asyncio
async def test_bad_arguments_are_clear_errors_and_nan_never_hangs() -> None:
    async with ws.Publisher("bad", **FAST) as pub:
        with pytest.raises(TypeError, match="tensors must be a Mapping"):
            await pub.put(5)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="timeout must be a finite"):
            await pub.wait_subscribers(1, timeout=math.nan)
        async with ws.Subscriber("bad", address=pub.address, timeout=5.0) as sub:
            await pub.wait_subscribers(1, timeout=10)
            await (await pub.put({"w": torch.ones(2)})).delivered(timeout=10)
            for call in (sub.get(timeout=math.nan), sub.get_into({"w": torch.ones(2)}, timeout=math.nan)):
                with pytest.raises(ValueError, match="timeout must be a finite"):
                    await asyncio.wait_for(call, 5)
            with pytest.raises(TypeError, match="min_version must be an int"):
                await sub.get(min_version="x")  # type: ignore[arg-type]
            with pytest.raises(TypeError, match="dest must be a Mapping"):
                await sub.get_into([torch.ones(2)])  # type: ignore[arg-type]
            import numpy as np
            with pytest.raises(TypeError, match=r"dest\['w'\] must be a torch.Tensor"):
                await sub.get_into({"w": np.ones(2)})  # type: ignore[dict-item]


def test_the_address_is_a_str_once_started_and_an_error_before() -> None:
    pub = ws.Publisher("addr")
    with pytest.raises(RuntimeError, match="known once it has started"):
        _ = pub.address


def test_the_documented_errors_are_the_exported_ones() -> None:
    api = (REPO / "docs" / "api.md").read_text()
    tree = api[api.index("## Errors"):]
    tree = tree[tree.index("```") + 3:]
    documented = set(re.findall(r"[├└]── (\w+)", tree[:tree.index("```")]))
    exported = {n for n in ws.__all__ if isinstance(getattr(ws, n), type)
                and issubclass(getattr(ws, n), ws.WeightSyncError) and n != "WeightSyncError"}
    assert documented == exported
    from weightsync import errors
    assert set(re.findall(r"[├└]── (\w+)", errors.__doc__ or "")) == exported


def test_the_cli_answers_help_without_importing_torch() -> None:
    code = ("import sys\nfrom weightsync.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit as e:\n"
            "    assert e.code == 0\nassert 'torch' not in sys.modules, 'torch was imported'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "fr" in out.stdout and "doctor" in out.stdout


def test_closing_the_rendezvous_table_ends_every_wait() -> None:
    """The publisher's close ends a retired group's rendezvous wait for a member that died while
    it formed (it held aclose for the rendezvous deadline, 60 s with the defaults)."""
    from weightsync.control.rendezvous import KeyValue

    table, results, called = KeyValue(), [], []
    waiter = threading.Thread(target=lambda: results.append(table.wait(("never",), 60.0)))
    waiter.start()
    table.when_set(("never",), 60.0, called.append)
    table.close()
    waiter.join(10)
    assert results == [False] and called == [False] and not waiter.is_alive()
    table.when_set(("late",), 60.0, called.append)
    assert called == [False, False]


def test_a_socket_connected_to_itself_is_not_a_publisher() -> None:
    """A subscriber that dials a local port nobody listens on yet can be handed that very port as
    its own: TCP's simultaneous open connects the socket to itself, and it waited for its own
    Challenge until its join deadline (seen once in 20 runs of the docs test: the generator never
    joined a trainer that started a moment later). Such a connection counts as nobody listening."""
    from weightsync.control.client import self_connected

    port = free_port()
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", port))
        sock.connect(("127.0.0.1", port))  # nothing listens: Linux connects the socket to itself
        assert self_connected(sock)
    finally:
        sock.close()
    with socket.create_server(("127.0.0.1", 0)) as server, \
            socket.create_connection(server.getsockname()) as client:
        assert not self_connected(client)


@pytest.mark.asyncio
async def test_a_self_connected_try_is_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first try of a subscriber started before its publisher connects to itself: it tries
    again, and joins once the publisher is up."""
    from weightsync.control import client as control_client

    port = free_port()
    real, tries = socket.create_connection, []

    def first_to_itself(address: tuple[str, int], timeout: float | None = None) -> socket.socket:
        tries.append(address)
        if len(tries) == 1:
            sock = socket.socket()
            sock.bind(address)
            sock.connect(address)
            return sock
        return real(address, timeout=timeout)

    monkeypatch.setattr(control_client.socket, "create_connection", first_to_itself)
    sub = ws.Subscriber("self", address=f"127.0.0.1:{port}", timeout=10.0, recorder=ws.FlightRecorder())
    joining = asyncio.create_task(sub.start())
    await until(lambda: len(tries) >= 2, 10, "a second try")
    async with ws.Publisher("self", address=f"127.0.0.1:{port}", recorder=ws.FlightRecorder(), **FAST) as pub:
        await asyncio.wait_for(joining, 30)
        await pub.wait_subscribers(1, timeout=10)
        await sub.aclose()


@pytest.mark.asyncio
async def test_every_bad_input_is_one_clear_error_at_the_call_and_the_end_keeps_running() -> None:
    """An audit's bad inputs: internal errors, a sender thread dead at the first eviction
    (`policy=5`), an empty version that reached generators as every parameter missing, a version
    number that poisoned the recorder, a frame the publisher could not decode (it dropped the
    member), a collector registered twice (every series twice). Each is refused where it is made,
    with the argument named, and nothing of the end it was made on breaks."""
    bad_constructors = [
        (TypeError, "policy", {"policy": 5}), (TypeError, "max_snapshots", {"max_snapshots": 2.5}),
        (ValueError, "max_snapshots", {"max_snapshots": 1}), (TypeError, "max_snapshots", {"max_snapshots": math.nan}),
        (TypeError, "timeout", {"timeout": "5"}), (ValueError, "timeout", {"timeout": math.nan}),
        (ValueError, "min_bandwidth", {"min_bandwidth": math.inf}), (TypeError, "bucket_bytes", {"bucket_bytes": 1e6}),
    ]
    if not torch.cuda.is_available():
        bad_constructors.append((ValueError, "no usable CUDA", {"device": "cuda"}))
    for error, words, kwargs in bad_constructors:
        with pytest.raises(error, match=words):
            ws.Publisher("bad", **kwargs)
    for error, words, kwargs in [(TypeError, "timeout", {"timeout": "5"}),
                                 (ValueError, "timeout", {"timeout": math.nan})]:
        with pytest.raises(error, match=words):
            ws.Subscriber("bad", address="127.0.0.1:1", **kwargs)
    for capacity in (math.nan, 2.5, "9"):
        with pytest.raises(TypeError, match="capacity"):
            ws.FlightRecorder(capacity=capacity)  # type: ignore[arg-type]

    rec = ws.FlightRecorder(capacity=500)
    async with ws.Publisher("bad", recorder=rec, **FAST) as pub, \
            ws.Subscriber("bad", address=pub.address, member_id="g0", recorder=rec, timeout=5.0) as sub:
        await pub.wait_subscribers(1, timeout=10)
        await (await pub.put({"w": torch.ones(8)}, version=0)).delivered(timeout=10)
        for empty in ({}, {"w": torch.empty(0)}, [("a", torch.zeros(0, 3))]):
            with pytest.raises(ValueError, match="empty|no tensors"):
                await pub.put(empty)
        for kwargs in ({"min_version": 2**70}, {"exact": -1}, {"min_version": 2**63}):
            with pytest.raises(ValueError, match="2\\*\\*63"):
                await sub.get(timeout=1, **kwargs)
        for args in ((0, 7, "d"), (0, "layout", b"d"), (2**70, "layout", "d"), ("0", "layout", "d")):
            with pytest.raises((TypeError, ValueError)):
                await sub.compare_engine(*args)  # type: ignore[arg-type]
        assert rec.dump_on_trouble("after the bad calls", force=True) is not None  # the recorder still dumps
        await (await pub.put({"w": torch.full((8,), 2.0)}, version=1)).delivered(timeout=10)
        assert (await sub.get(min_version=1, timeout=10))["w"][0] == 2.0
        assert pub.members == ("g0",) and pub.evicted == [] and not sub.evicted
        assert await sub.compare_engine(1, "layout", "d") == {"d": 1}  # the connection still speaks

        prometheus_client = pytest.importorskip("prometheus_client")
        from weightsync.prometheus import register, unregister

        registry = prometheus_client.CollectorRegistry()
        collector = register(pub, registry=registry)
        with pytest.raises(ValueError, match="already registered"):
            register(pub, registry=registry)
        text = prometheus_client.generate_latest(registry).decode()
        assert text.count("weightsync_versions_put_total{") == 1
        unregister(collector, registry=registry)
        register(pub, registry=registry)  # again, once removed
