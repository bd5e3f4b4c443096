"""Documented lifecycle behaviour that had no test (issue 15): closing, aborting, newcomers,
admission by environment, operator evictions. Publisher and subscribers in one process."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
from pathlib import Path

import pytest
import torch

import weightsync as ws
from tests.statedicts import digests, mixed_state_dict
from weightsync.testing import Faults, inject

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]

FAST = {"timeout": 5.0, "heartbeat_interval": 0.25}


async def test_aclose_sends_what_is_pending_before_it_stops() -> None:
    pub = ws.Publisher("drain", **FAST)
    await pub.start()
    sub = ws.Subscriber("drain", address=pub.address, timeout=FAST["timeout"])
    inject(sub, Faults(slow=4))  # every bucket takes a while: the version is still on the wire
    await sub.start()
    await pub.wait_subscribers(1, timeout=10)
    sd = mixed_state_dict(3, mib=4)
    handle = await pub.put(sd, version=1)
    waiting = asyncio.create_task(sub.get(min_version=2, timeout=None))  # for a version that never comes
    await pub.aclose()  # right away: the version is pending, and aclose must send it
    report = await handle.delivered(timeout=1)  # resolved by the time aclose returned
    assert report.members == (sub.member_id,) and not report.superseded
    with pytest.raises(ws.PublisherGone):  # the Shutdown ends a wait that has no timeout
        await asyncio.wait_for(waiting, 20)
    with pytest.raises(ws.PublisherGone):  # and every new one
        await sub.get(min_version=2, timeout=5)
    w = await sub.get(min_version=1, timeout=5)  # kept after the publisher is gone
    assert w.version == 1 and digests(w) == digests(sd)
    await sub.aclose()


async def test_a_subscriber_that_aborts_mid_version_left_and_nobody_failed(tmp_path: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    """``abort()`` while a version is on the wire breaks the generation's group for everyone, but it
    is a goodbye: the publisher re-sends to the others without a WARNING, a strike or a dump, and
    the flight recorder's analysis names no culprit."""
    from weightsync.recorder.analyze import analyze, load_dir

    caplog.set_level("INFO", logger="weightsync")
    rec = ws.FlightRecorder(capacity=4000)  # every end's entries, as one process's dump
    async with ws.Publisher("goodbye", **FAST, recorder=rec, bucket_bytes=1 << 20) as pub:
        a = ws.Subscriber("goodbye", address=pub.address, member_id="a", timeout=FAST["timeout"], recorder=rec,
                          transport="group")
        b = ws.Subscriber("goodbye", address=pub.address, member_id="b", timeout=FAST["timeout"], recorder=rec,
                          transport="group")
        inject(b, Faults(slow=2))  # at least 20 ms a bucket: b is mid-version when it aborts
        await a.start()
        await b.start()
        await pub.wait_subscribers(2, timeout=10)
        sd = mixed_state_dict(7, mib=32)
        handle = await pub.put(sd, version=1)
        while not any(e.op == "bucket_recv" and e.member == "b" and e.version == 1 for e in rec.snapshot()):
            await asyncio.sleep(0.002)  # until the recorder shows b receiving version 1
        await b.abort()
        report = await handle.delivered(timeout=60)
        assert report.members == ("a",) and pub.evicted == []
        w = await a.get(min_version=1, timeout=10)
        assert digests(w) == digests(sd)
        await a.aclose()
    said = [(r.name, r.levelname, r.getMessage()) for r in caplog.records]
    assert ("weightsync.publisher", "INFO",
            "channel 'goodbye': ['b'] left while version 1 was on the wire; re-sending it to the others") in said
    assert not [s for s in said if s[0] in ("weightsync.publisher", "weightsync.membership") and s[1] == "WARNING"]
    assert any(e.op == "leave" and e.peers == ("b",) for e in rec.snapshot())
    # b's acknowledgement said it was leaving, ahead of its Leave (Ack.leaving)
    assert [e.error.endswith("(leaving)") for e in rec.snapshot() if e.op == "nack" and e.peers == ("b",)] == [True]
    rec.dump(reason="the test", path=tmp_path / "run.wsfr")
    analysis = analyze(load_dir(tmp_path))
    assert analysis.culprits == [] and analysis.deaths == []
    assert [d.split(" (")[0] for d in analysis.departures] == ["b at goodbye v1"]


async def test_abort_fails_unsent_puts_with_closed() -> None:
    rec = ws.FlightRecorder(capacity=1000)
    pub = ws.Publisher("abort", **FAST, max_snapshots=2, recorder=rec)
    await pub.start()
    sub = ws.Subscriber("abort", address=pub.address, timeout=FAST["timeout"])
    inject(sub, Faults(slow=50))  # version 1 occupies the wire; version 2 waits its turn
    await sub.start()
    await pub.wait_subscribers(1, timeout=10)
    first = await pub.put({"w": torch.zeros(1 << 20)}, version=1)
    while not any(e.op == "announce" and e.version == 1 for e in rec.snapshot()):
        await asyncio.sleep(0.005)  # until the recorder shows version 1 on its way (else 2 supersedes it)
    second = await pub.put({"w": torch.ones(1 << 20)}, version=2)
    await pub.abort()
    await pub.abort()  # idempotent
    with pytest.raises(ws.Closed):
        await second.delivered(timeout=5)
    try:  # the one on the wire either made it or was cut off: either way it resolves
        await first.delivered(timeout=5)
    except ws.WeightSyncError:
        pass
    with pytest.raises(ws.Closed):
        await pub.put({"w": torch.zeros(1)}, version=3)
    await sub.abort()


async def test_updates_ends_quietly_when_the_subscriber_closes() -> None:
    async with ws.Publisher("upd", **FAST) as pub:
        sub = ws.Subscriber("upd", address=pub.address, timeout=FAST["timeout"])
        await sub.start()
        await pub.wait_subscribers(1, timeout=10)
        await (await pub.put({"w": torch.zeros(4)}, version=1)).delivered(timeout=10)
        seen: list[int] = []

        async def consume() -> None:
            async for w in sub.updates():  # no timeout: only closing ends it
                seen.append(w.version)

        task = asyncio.create_task(consume())
        while not seen:
            await asyncio.sleep(0.01)  # until the first version was yielded
        await sub.aclose()
        await asyncio.wait_for(task, 10)  # ended, without raising
    assert seen == [1]


async def test_a_newcomer_gets_the_retained_version_without_a_new_put() -> None:
    async with ws.Publisher("late", **FAST) as pub:
        sd = mixed_state_dict(5, mib=1)
        await pub.put(sd, version=7)  # nobody is listening yet
        async with ws.Subscriber("late", address=pub.address, timeout=FAST["timeout"]) as sub:
            w = await sub.get(timeout=10)
            assert w.version == 7 and digests(w) == digests(sd)
        assert pub.version == 7


async def test_admission_by_environment_token_and_refusal_without_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEIGHTSYNC_TOKEN", "from-the-env")
    async with ws.Publisher("env", **FAST) as pub:  # secret from $WEIGHTSYNC_TOKEN
        async with ws.Subscriber("env", address=pub.address, timeout=FAST["timeout"]) as sub:
            await pub.wait_subscribers(1, timeout=10)
            await (await pub.put({"w": torch.ones(3)}, version=1)).delivered(timeout=10)
            assert (await sub.get(timeout=5)).version == 1
        monkeypatch.delenv("WEIGHTSYNC_TOKEN")
        with pytest.raises(ws.AdmissionDenied, match="the publisher requires a secret, this subscriber has none"):
            async with ws.Subscriber("env", address=pub.address, timeout=FAST["timeout"]):
                pass


class Recording:
    """An orchestrator that records what it was asked to replace (the Orchestrator protocol)."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str]] = []

    async def replace(self, member: ws.MemberInfo) -> None:
        self.asked.append((member.member_id, member.reason))


async def test_neither_an_operator_eviction_nor_a_leave_is_replaced() -> None:
    orchestrator = Recording()
    async with ws.Publisher("ops", **FAST, orchestrator=orchestrator) as pub:
        subs = [ws.Subscriber("ops", address=pub.address, member_id=f"g{i}", timeout=FAST["timeout"])
                for i in range(2)]
        await asyncio.gather(*(s.start() for s in subs))
        await pub.wait_subscribers(2, timeout=10)
        await pub.evict("g0")  # applied when the next generation forms
        for _ in range(20):
            await (await pub.put({"w": torch.zeros(4)})).delivered(timeout=10)
            if pub.evicted:
                break
        assert [(m.member_id, m.reason) for m in pub.evicted] == [("g0", "operator")]
        with pytest.raises(ws.Evicted):
            await subs[0].get(min_version=10_000, timeout=10)
        await subs[1].aclose()  # leaves with a Leave: dropped without blame, not replaced either
        for _ in range(40):
            await (await pub.put({"w": torch.zeros(4)})).delivered(timeout=20)
            if not pub.members:
                break
        assert pub.members == ()
        await asyncio.gather(*pub.replacements)
        await subs[0].aclose()
    assert [(m.member_id, m.reason) for m in pub.evicted] == [("g0", "operator")]
    # replacements are for the dead, the failed and the slow (test_stragglers.py checks those)
    assert orchestrator.asked == []


# a replacement for LocalProcessOrchestrator: writes what it was given, then waits to be stopped;
# one replacing a "slow" member ignores SIGTERM, so only the SIGKILL after the grace ends it
REPLACEMENT = """
import json, os, signal, sys, time
member, n, reason, out = sys.argv[1:5]
if reason == "slow":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
env = {k: os.environ.get(k) for k in ("WEIGHTSYNC_REPLACES", "WEIGHTSYNC_REPLACEMENT", "EXTRA")}
with open(os.path.join(out, f"started-{n}.json.tmp"), "w") as fh:
    json.dump({"argv": [member, n, reason], "env": env, "cwd": os.getcwd(), "pid": os.getpid()}, fh)
os.rename(os.path.join(out, f"started-{n}.json.tmp"), os.path.join(out, f"started-{n}.json"))
time.sleep(600)
"""


async def started(path: Path, timeout: float = 30.0) -> dict:
    """The record a replacement wrote once it ran (polled with a deadline)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never written"
        await asyncio.sleep(0.02)  # polling for a child's file, bounded
    return json.loads(path.read_text())


async def test_local_process_orchestrator_formats_commands_and_stops_only_what_it_started(tmp_path: Path) -> None:
    host = socket.gethostname()
    orch = ws.LocalProcessOrchestrator([sys.executable, "-c", REPLACEMENT, "{member}", "{n}", "{reason}",
                                        str(tmp_path)], env={"EXTRA": "yes"}, cwd=str(tmp_path), stop_old=True,
                                       grace=1.0)
    await orch.replace(ws.MemberInfo("gen0", host=host, pid=0, reason="dead", generation=3))
    first = await started(tmp_path / "started-1.json")
    assert first["argv"] == ["gen0", "1", "dead"]
    assert first["env"] == {"WEIGHTSYNC_REPLACES": "gen0", "WEIGHTSYNC_REPLACEMENT": "1", "EXTRA": "yes"}
    assert first["cwd"] == str(tmp_path)
    # the replacement itself turns out slow: stop_old kills it (it is this orchestrator's child)
    # before starting the next one
    await orch.replace(ws.MemberInfo("repl-1", host=host, pid=first["pid"], reason="slow", generation=4))
    second = await started(tmp_path / "started-2.json")
    assert second["argv"] == ["repl-1", "2", "slow"] and second["env"]["WEIGHTSYNC_REPLACEMENT"] == "2"
    old = orch.processes()[0]
    assert old.wait(timeout=10) == -9
    # a member on another host with the same pid is never signalled
    survivor = orch.processes()[1]
    await orch.replace(ws.MemberInfo("far", host=host + "-elsewhere", pid=survivor.pid, reason="dead"))
    await started(tmp_path / "started-3.json")
    assert survivor.poll() is None
    # aclose: SIGTERM to each, SIGKILL after the grace to the one that ignores it
    t0 = asyncio.get_running_loop().time()
    await orch.aclose()
    assert asyncio.get_running_loop().time() - t0 < orch.grace + 10  # liveness bound
    assert [p.returncode for p in orch.processes()] == [-9, -9, -15]
    assert [m.member_id for m, _ in orch.started] == ["gen0", "repl-1", "far"]


async def test_local_process_orchestrator_target_and_bad_arguments() -> None:
    calls: list[str] = []

    async def later(member: ws.MemberInfo) -> str:
        calls.append(member.member_id)
        return f"started for {member.member_id}"

    async with ws.LocalProcessOrchestrator(target=later) as orch:
        await orch.replace(ws.MemberInfo("g", reason="failed"))
        assert calls == ["g"] and orch.started[0][1] == "started for g"
        assert orch.processes() == []  # a result without poll() is not a process to stop
    for bad in ({}, {"command": ["x"], "target": later}, {"command": "python gen.py"}, {"command": []}):
        with pytest.raises(ValueError):
            ws.LocalProcessOrchestrator(**bad)


async def test_a_member_that_left_and_joins_again_under_its_id_gets_the_retained_version() -> None:
    """A vLLM worker re-initializing its weight-transfer engine leaves and joins again under the same
    member id, with empty slots: it must get the version the channel retains without a new put
    (found when it waited for version 1 until its deadline: the publisher still had it down as held)."""
    sd = mixed_state_dict(1, mib=1)
    async with ws.Publisher("again", **FAST) as pub:
        async with ws.Subscriber("again", address=pub.address, member_id="worker", timeout=5.0) as sub:
            await pub.wait_subscribers(1, timeout=30)
            await (await pub.put(sd, version=1)).delivered(timeout=30)
            assert (await sub.get(min_version=1, timeout=10)).version == 1
        deadline = time.monotonic() + 30
        while "worker" in pub.members:  # its Leave is applied at the next generation
            assert time.monotonic() < deadline, "the member that left is still listed"
            await asyncio.sleep(0.01)
        async with ws.Subscriber("again", address=pub.address, member_id="worker", timeout=5.0) as again:
            weights = await again.get(min_version=1, timeout=30)
            assert weights.version == 1 and digests(weights) == digests(sd)
