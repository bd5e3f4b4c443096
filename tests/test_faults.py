"""Tier 3: fault injection. A dead member must never hang the trainer or the other members."""

from __future__ import annotations

import asyncio
import signal
import time

import msgspec
import pytest
import torch

import weightsync as ws
from tests.conftest import LOOPS, Procs, loop_policy
from tests.statedicts import digests
from weightsync import _wire

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(180)]


@pytest.fixture(params=LOOPS)
def event_loop_policy(request: pytest.FixtureRequest):
    return loop_policy(request.param)


async def test_kill_9_subscriber_mid_run_others_lose_nothing(procs: Procs) -> None:
    """A member SIGKILLed while version 3 is on the wire (the recorder shows its buckets going
    out): the trainer's next put does not wait, and the survivor reads versions that are
    bit-exact what was put, the interrupted one included."""
    timeout = 4.0
    rec = ws.FlightRecorder(capacity=4000)
    async with ws.Publisher("policy", timeout=timeout, heartbeat_interval=0.25, bucket_bytes=4 << 20,
                            recorder=rec) as pub:
        workers = [procs.spawn("subscriber", channel="policy", address=pub.address, member=f"gen{i}",
                               until_version=9, deadline=120, mode="updates") for i in range(2)]
        await pub.wait_subscribers(2, timeout=60)

        def body(v: int) -> dict[str, torch.Tensor]:
            return {"body": torch.full((16 << 20,), float(v))}

        handles = {}
        for v in range(10):
            t0 = time.monotonic()
            handles[v] = await pub.put(body(v), version=v)
            assert time.monotonic() - t0 < 5.0  # the trainer never waits on the wire (liveness bound)
            if v == 3:
                while not any(e.op == "bucket_send" and e.version == 3 for e in rec.snapshot()):
                    await asyncio.sleep(0.005)  # until the recorder shows version 3 on the wire
                procs.signal(workers[1], signal.SIGKILL)
                continue  # put version 4 at once, while version 3 is being recovered
            for done in range(v - 1 if v == 4 else v, v + 1):
                report = await handles[done].delivered(timeout=timeout * 3 + 30)
                if not report.superseded:
                    assert "gen0" in report.members
                    if done > 3:
                        assert report.members == ("gen0",)
            if v == 8:  # before version 9, after which gen0 leaves on its own
                assert pub.members == ("gen0",)
        assert [m.member_id for m in pub.evicted] == ["gen1"]
        result = await procs.result(workers[0], timeout=60)
    assert result["order"] == sorted(result["order"]) and result["order"][-1] == 9
    for version, seen in result["digests"].items():  # every version read is exactly what was put
        assert seen == digests(body(int(version))), version


async def test_a_member_killed_after_a_spill_ahead_released_the_tensors_costs_the_others_nothing(
        procs: Procs) -> None:
    """``Publisher(spill_ahead=True)``, ``put(copy=False)``: one member is frozen while version 2
    is on the wire, so the transfer stalls; the spill thread copies the whole version and the
    tensors are released, and the trainer zeroes them (its optimizer step). Then the frozen
    member is killed with -9: the version is sent again to the survivor from the spill, and the
    survivor reads exactly what was put, never the zeroes."""
    timeout = 4.0
    rec = ws.FlightRecorder(capacity=4000)
    async with ws.Publisher("ahead", timeout=timeout, heartbeat_interval=0.25, bucket_bytes=4 << 20,
                            recorder=rec, spill_ahead=True) as pub:
        progress = procs.tmp / "gen0-read"
        workers = [procs.spawn("subscriber", channel="ahead", address=pub.address, member=f"gen{i}",
                               until_version=3, deadline=120, mode="updates", progress_file=str(progress))
                   for i in range(2)]
        await pub.wait_subscribers(2, timeout=60)

        def body(v: int) -> dict[str, torch.Tensor]:
            return {"body": torch.full((16 << 20,), float(v))}  # 64 MiB: 16 buckets

        for v in range(4):
            sd = body(v)
            handle = await pub.put(sd, version=v, copy=False)
            if v == 2:
                while not any(e.op == "bucket_send" and e.version == 2 for e in rec.snapshot()):
                    await asyncio.sleep(0.005)  # until the recorder shows version 2 on the wire
                procs.signal(workers[1], signal.SIGSTOP)
                await handle.released(timeout=30)  # the spill thread has all of it: the tensors are the caller's
                assert not handle.done()  # ...while the frozen member still holds the transfer up
                sd["body"].zero_()
                procs.signal(workers[1], signal.SIGKILL)
            report = await handle.delivered(timeout=timeout * 3 + 30)
            assert "gen0" in report.members, (v, report)
            if v >= 2:
                assert report.members == ("gen0",)
            if v == 2:  # latest wins: under load version 3 could be readable before gen0 read 2
                deadline = time.monotonic() + 60
                while "2" not in (progress.read_text().split() if progress.exists() else []):
                    assert time.monotonic() < deadline, "gen0 never read version 2"
                    await asyncio.sleep(0.02)  # polling the worker's progress file, bounded
        assert [m.member_id for m in pub.evicted] == ["gen1"]
        assert pub.statistics().resends >= 1
        result = await procs.result(workers[0], timeout=60)
    assert "2" in result["digests"]  # the version re-sent from the spill was read
    for version, seen in result["digests"].items():  # every version read is exactly what was put
        assert seen == digests(body(int(version))), version


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP])
async def test_a_sliced_member_killed_or_frozen_mid_version_costs_the_others_nothing(procs: Procs,
                                                                                    how: signal.Signals) -> None:
    """Point-to-point delivery (sliced members, ``want=``): one is killed with -9 or frozen while
    version 2 is on the wire; the publisher evicts it, re-sends to the other, and the survivor
    reads every version with exactly the tensors it asked for, bit-exact."""
    timeout = 4.0
    rec = ws.FlightRecorder(capacity=4000)
    want = {"body": [[8 << 20], "float32"]}
    async with ws.Publisher("sliced", timeout=timeout, heartbeat_interval=0.25, bucket_bytes=4 << 20,
                            recorder=rec) as pub:
        workers = [procs.spawn("subscriber", channel="sliced", address=pub.address, member=f"gen{i}",
                               until_version=5, deadline=120, mode="updates", want=want) for i in range(2)]
        await pub.wait_subscribers(2, timeout=60)

        def body(v: int) -> dict[str, torch.Tensor]:
            return {"head": torch.full((1000,), -float(v)), "body": torch.full((8 << 20,), float(v))}

        for v in range(6):
            handle = await pub.put(body(v), version=v)
            if v == 2:
                while not any(e.op == "bucket_send" and e.version == 2 for e in rec.snapshot()):
                    await asyncio.sleep(0.005)  # until the recorder shows version 2 on the wire
                procs.signal(workers[1], how)
            report = await handle.delivered(timeout=timeout * 3 + 30)
            assert "gen0" in report.members
            if v == 4:  # before version 5, after which gen0 leaves on its own
                assert pub.members == ("gen0",)
        assert [m.member_id for m in pub.evicted] == ["gen1"]
        result = await procs.result(workers[0], timeout=60)
    assert result["order"] == sorted(result["order"]) and result["order"][-1] == 5
    for version, seen in result["digests"].items():  # only the wanted tensor, exactly what was put
        assert seen == digests({"body": body(int(version))["body"]}), version


async def test_members_with_lazy_gloo_in_their_environment_do_not_crash_the_publisher(procs: Procs) -> None:
    """``TORCH_GLOO_LAZY_INIT=1`` left in a member's environment (the user's, or set for its own
    world): on torch 2.15 a reconfigurable backend made with it crashed the publisher (SIGSEGV in
    its next in-place re-form). Members join one after the other, so generations re-form."""
    async with ws.Publisher("lazy", timeout=5.0, heartbeat_interval=0.25) as pub:
        expected = {}
        workers = []
        for i in range(2):
            workers.append(procs.spawn("subscriber", channel="lazy", address=pub.address, member=f"gen{i}",
                                       until_version=2, deadline=60, env={"TORCH_GLOO_LAZY_INIT": "1"}))
            await pub.wait_subscribers(i + 1, timeout=60)
            sd = {"w": torch.full((1000,), float(i))}
            expected[str(i)] = digests(sd)
            await (await pub.put(sd, version=i)).delivered(timeout=30)
        sd = {"w": torch.full((1000,), 2.0)}
        expected["2"] = digests(sd)
        report = await (await pub.put(sd, version=2)).delivered(timeout=30)
        assert set(report.members) == {"gen0", "gen1"}
        results = [await procs.result(w, timeout=60) for w in workers]
    for result in results:
        for version, seen in result["digests"].items():
            assert seen == expected[version], version


async def test_wrong_token_is_denied_and_publisher_keeps_serving() -> None:
    async with ws.Publisher("secure", secret="s3cret", timeout=15, heartbeat_interval=0.25) as pub:
        with pytest.raises(ws.AdmissionDenied):
            async with ws.Subscriber("secure", address=pub.address, secret="wrong", timeout=15):
                pass
        async with ws.Subscriber("secure", address=pub.address, secret="s3cret", timeout=15) as sub:
            await pub.wait_subscribers(1, timeout=10)
            await (await pub.put({"x": torch.ones(3)}, version=1)).delivered(timeout=10)
            assert (await sub.get(timeout=5)).version == 1


async def test_duplicate_member_id_is_denied() -> None:
    async with ws.Publisher("dup", timeout=15, heartbeat_interval=0.25) as pub:
        async with ws.Subscriber("dup", address=pub.address, member_id="same", timeout=15):
            await pub.wait_subscribers(1, timeout=10)
            with pytest.raises(ws.AdmissionDenied, match="already"):
                async with ws.Subscriber("dup", address=pub.address, member_id="same", timeout=15):
                    pass


async def test_publisher_killed_subscribers_keep_last_version_and_raise_in_time(procs: Procs, tmp_path) -> None:
    address_file = tmp_path / "address"
    pub_index = procs.spawn("publisher", channel="doomed", address_file=str(address_file), deadline=120)
    deadline = time.monotonic() + 60
    while not address_file.exists():  # polling for the child's address file, with a deadline
        assert time.monotonic() < deadline, procs.log(pub_index)
        await asyncio.sleep(0.05)
    timeout = 4.0
    async with ws.Subscriber("doomed", address=address_file.read_text(), timeout=timeout) as sub:
        before = await sub.get(min_version=2, timeout=30)
        procs.signal(pub_index, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(ws.PublisherGone):
            await sub.get(min_version=before.version + 10_000)  # no timeout given: liveness ends it
        assert time.monotonic() - t0 < timeout + 5  # within its deadline, plus slack for CI
        kept = await sub.get(timeout=5)  # the last complete version stays readable
        assert kept.version >= before.version and torch.all(kept["w"] == float(kept.version))


async def test_fingerprint_mismatch_is_denied_naming_the_difference() -> None:
    from tests.outsider import Outsider
    from weightsync.control import auth

    async with ws.Publisher("fp", timeout=10, heartbeat_interval=0.25) as pub:
        mine = auth.fingerprint(pub.backend, pub.device)
        alien = msgspec.structs.replace(mine, protocol=mine.protocol + 1)
        outsider = Outsider(pub.address)
        reply = await asyncio.get_running_loop().run_in_executor(None, outsider.join, "alien", alien, None)
        assert isinstance(reply, _wire.Deny) and reply.kind == "handshake"
        assert "protocol" in reply.reason and str(alien.protocol) in reply.reason
        Outsider(pub.address).send_raw(b"\x00\x00\x00\x05garbage")  # malformed: recorded, never fatal
        async with ws.Subscriber("fp", address=pub.address, timeout=10) as sub:
            await pub.wait_subscribers(1, timeout=10)  # the publisher kept serving
            await (await pub.put({"x": torch.ones(2)}, version=1)).delivered(timeout=10)
            assert (await sub.get(timeout=5)).version == 1


async def test_a_subscriber_resubscribes_to_a_restarted_publisher(procs: Procs, tmp_path) -> None:
    """fault-tolerance.md's recipe, as written: serve from ``updates()``; on PublisherGone (the
    trainer killed with -9 and started again elsewhere) join the new channel. The loop goes on
    with the restarted publisher's versions, every one exactly what it put."""
    files = [tmp_path / "first", tmp_path / "second"]
    starts = iter(files)
    killed = asyncio.Event()

    async def discover_publisher() -> str:
        path = next(starts)
        procs.spawn("publisher", channel="restart", address_file=str(path), subscribers=1, deadline=60)
        deadline = time.monotonic() + 60
        while not path.exists():
            assert time.monotonic() < deadline, "the publisher never wrote its address"
            await asyncio.sleep(0.05)  # polling for the worker's address file
        return path.read_text()

    served: list[tuple[str, int]] = []
    while len([a for a, _ in served if a == "second"]) < 3:
        address = await discover_publisher()
        which = "first" if not killed.is_set() else "second"
        async with ws.Subscriber("restart", address=address, timeout=4) as sub:
            try:
                async for w in sub.updates(timeout=60):
                    assert torch.equal(w["w"], torch.full((1000,), float(w.version)))
                    served.append((which, w.version))
                    if which == "first" and w.version >= 2:
                        procs.signal(0, signal.SIGKILL)  # the trainer dies mid-run
                        killed.set()
                    if len([a for a, _ in served if a == "second"]) >= 3:
                        break
            except ws.PublisherGone:
                assert which == "first"
                continue  # the trainer restarted: join its new channel
    assert [a for a, _ in served][0] == "first" and killed.is_set()
    second = [v for a, v in served if a == "second"]
    assert second == sorted(second) and len(second) >= 3


@pytest.mark.parametrize("transport", ["group", "shm"])
async def test_a_generator_frozen_past_its_eviction_gets_evicted_rejoins_and_the_readme_loop_goes_on(
        procs: Procs, transport: str) -> None:
    """SIGSTOP a generator past its eviction deadline, then SIGCONT: it found the publisher's notice
    and the closed connection together, and 4 times in 7 its heartbeat saw the close first and
    ended it with PublisherGone ("the publisher closed the connection": the README's loop took the
    trainer for finished and quit while training went on). It must get Evicted, rejoin() and serve
    the next version; PublisherGone only when the trainer really is gone. Twice in a row."""
    def body(v: int) -> dict[str, torch.Tensor]:
        return {"w": torch.full((1024,), float(v))}

    async with ws.Publisher("frozen", timeout=2.0, heartbeat_interval=0.25) as pub:
        worker = procs.spawn("subscriber", channel="frozen", address=pub.address, member="gen0", mode="readme",
                             shapes={"w": [1024]}, deadline=150, timeout=2.0, transport=transport)
        await pub.wait_subscribers(1, timeout=60)
        version = 0
        await (await pub.put(body(version), version=version)).delivered(timeout=30, min_members=1)
        for cycle in range(2):
            procs.signal(worker, signal.SIGSTOP)
            deadline = time.monotonic() + 60
            while len(pub.evicted) <= cycle:
                assert time.monotonic() < deadline, "the frozen member was never evicted"
                await asyncio.sleep(0.05)  # polling the publisher's view, bounded
            version += 1
            await (await pub.put(body(version), version=version)).delivered(timeout=30)  # to nobody
            procs.signal(worker, signal.SIGCONT)
            await pub.wait_subscribers(1, timeout=60)  # it rejoined
            version += 1
            report = await (await pub.put(body(version), version=version)).delivered(timeout=30, min_members=1)
            assert report.members == ("gen0",)
        assert [(m.member_id, m.reason) for m in pub.evicted] == [("gen0", "dead")] * 2
    result = await procs.result(worker, timeout=60)
    assert result["error"] == "Evicted,Evicted,PublisherGone", result["error"]
    assert result["order"][-1] == version and result["order"] == sorted(result["order"])
    for v, seen in result["digests"].items():
        assert seen == digests(body(int(v))), v
