"""Fleet-wide activation (``Publisher(activation="all")``): no member exposes a version that another
live member will not.

Members stage a verified version, acknowledge it, and expose it (``get``, ``updates``, ``get_into``,
``stream``, ``load``) only on the publisher's Commit, which goes out once every member of the
generation has staged it. The flight recorder shows when each member staged, exposed and when the
publisher committed (``time.time()``, comparable across processes on one host): the tests hold the
order against it, with one member five times slower, one frozen or killed right after it staged,
and a newcomer joining mid-version.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest
import torch

import weightsync as ws
from tests.conftest import Procs
from tests.statedicts import digests
from weightsync.fr import Entry, load_dump
from weightsync.planes.shm import plane as shm
from weightsync.testing import Faults, inject

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(180)]

FAST = {"timeout": 5.0, "heartbeat_interval": 0.25, "bucket_bytes": 1 << 18}
# the slow member reads the segment on its own (same host): the fast one never waits for it on a wire
TRANSPORT = "shm" if shm.available() else "group"


def body(version: int, mib: float = 2.0) -> dict[str, torch.Tensor]:
    n = int(mib * (1 << 20)) // 4
    return {"w": torch.full((n,), float(version)), "b": torch.arange(64, dtype=torch.float32) + version}


def first(entries: list[Entry], op: str, member: str, version: int) -> Entry:
    found = [e for e in entries if e.op == op and e.member == member and e.version == version and
             e.state == "completed"]
    assert found, f"no completed {op} of version {version} by {member}"
    return min(found, key=lambda e: e.t_ended)


def assert_exposed_only_once_committed(entries: list[Entry]) -> int:
    """Every member's ``publish`` of a version comes after a ``commit`` of it that named the member;
    returns how many publishes were checked."""
    commits = [e for e in entries if e.op == "commit" and e.member == "publisher" and e.t_started]
    checked = 0
    for e in entries:
        if e.op != "publish" or e.member == "publisher":
            continue
        named = [c.t_started for c in commits if c.version == e.version and e.member in c.peers
                 or c.version == e.version and e.member.split("@")[0] in c.peers]
        assert named and min(named) <= e.t_ended, f"{e.member} exposed version {e.version} before any commit of it"
        checked += 1
    return checked


async def test_bad_activation_arguments_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="activation must be one of"):
        ws.Publisher("act", activation="some")
    with pytest.raises(ValueError, match="not supported for sharded trainers"):
        ws.Publisher("act", activation="all", rank=1, world_size=2, address="127.0.0.1:1")


@pytest.mark.parametrize("activation", ["each", "all"])
async def test_no_member_exposes_a_version_before_the_slow_one_staged_it(activation: str) -> None:
    """One member takes five times as long as the wire. With "all" the fast member exposes each
    version only after the slow one staged it; with "each" it exposes it well before."""
    rec = ws.FlightRecorder(capacity=20000)
    async with ws.Publisher("act", recorder=rec, activation=activation, encoding="full", **FAST) as pub:
        fast = ws.Subscriber("act", address=pub.address, member_id="fast", timeout=5.0, recorder=rec,
                             transport=TRANSPORT)
        slow = ws.Subscriber("act", address=pub.address, member_id="slow", timeout=5.0, recorder=rec,
                             transport=TRANSPORT)
        inject(slow, Faults(slow=5.0))
        await asyncio.gather(fast.start(), slow.start())
        try:
            await pub.wait_subscribers(2, timeout=30)
            reports = []
            for version in range(1, 4):
                reports.append(await (await pub.put(body(version), version=version)).delivered(timeout=60))
                for sub in (fast, slow):
                    weights = await sub.get(exact=version, timeout=30)
                    assert digests(weights) == digests(body(version))
        finally:
            await asyncio.gather(fast.aclose(), slow.aclose())
    entries = rec.snapshot()
    gaps = []  # how long before (negative: after) the slow member had the version the fast one exposed it
    for version in range(1, 4):
        exposed = first(entries, "publish", "fast", version).t_ended
        slow_has = first(entries, "stage" if activation == "all" else "publish", "slow", version).t_ended
        gaps.append(slow_has - exposed)
    for report in reports:
        assert set(report.members) == {"fast", "slow"}
        assert (report.committed_at > 0) == (activation == "all")
        assert report.exposure_spread >= 0
    if activation == "all":
        assert all(gap <= 0 for gap in gaps), gaps  # the fast member waited for the slow one every time
        assert assert_exposed_only_once_committed(entries) == 6
        # ... and the stage of the slow member itself precedes the commit
        for version in range(1, 4):
            commit = next(e for e in entries if e.op == "commit" and e.version == version)
            assert first(entries, "stage", "slow", version).t_ended <= commit.t_started
    else:
        assert all(gap > 0 for gap in gaps), gaps  # each member on its own: the fast one did not wait
        assert not any(e.op in ("stage", "commit") for e in entries)


async def test_get_exact_waits_for_that_version_and_says_when_it_was_superseded() -> None:
    async with ws.Publisher("exact", activation="all", **FAST) as pub:
        async with ws.Subscriber("exact", address=pub.address, member_id="m", timeout=5.0) as sub:
            await pub.wait_subscribers(1, timeout=30)
            waiting = asyncio.ensure_future(sub.get(exact=2, timeout=30))
            for version in (1, 2):
                await (await pub.put(body(version, 0.25), version=version)).delivered(timeout=30)
            assert (await waiting).version == 2
            await (await pub.put(body(3, 0.25), version=3)).delivered(timeout=30)
            with pytest.raises(ws.Superseded) as info:
                await sub.get(exact=2, timeout=5)
            assert info.value.version == 2
            with pytest.raises(ValueError, match="min_version or exact"):
                await sub.get(exact=3, min_version=3)


async def test_a_newcomer_joining_mid_version_exposes_nothing_before_its_commit() -> None:
    rec = ws.FlightRecorder(capacity=20000)
    async with ws.Publisher("late", recorder=rec, activation="all", encoding="full", **FAST) as pub:
        slow = ws.Subscriber("late", address=pub.address, member_id="first", timeout=5.0, recorder=rec,
                             transport=TRANSPORT)
        inject(slow, Faults(slow=5.0))
        await slow.start()
        late = ws.Subscriber("late", address=pub.address, member_id="late", timeout=5.0, recorder=rec,
                             transport=TRANSPORT)
        try:
            await pub.wait_subscribers(1, timeout=30)
            handle = await pub.put(body(1, 4.0), version=1)
            while not any(e.op == "bucket_recv" and e.version == 1 for e in rec.snapshot()):
                await asyncio.sleep(0.002)  # until version 1 is on its way to the first member
            await late.start()  # joins while version 1 is in flight
            await handle.delivered(timeout=60)
            weights = await late.get(min_version=1, timeout=60)  # the retained version, staged and committed
            assert weights.version == 1 and digests(weights) == digests(body(1, 4.0))
            report = await (await pub.put(body(2, 4.0), version=2)).delivered(timeout=60)
            assert set(report.members) == {"first", "late"} and report.committed_at > 0
        finally:
            await asyncio.gather(slow.aclose(), late.aclose())
    entries = rec.snapshot()
    assert assert_exposed_only_once_committed(entries) >= 4
    assert first(entries, "publish", "late", 1).t_ended >= first(entries, "publish", "first", 1).t_ended


@pytest.mark.parametrize("how", ["stop", "kill"])
async def test_a_member_frozen_or_killed_after_staging_is_evicted_and_the_rest_commit(
        procs: Procs, tmp_path: Path, how: str) -> None:
    """gen2 stops (SIGSTOP, from its own process) or dies (SIGKILL) right after staging version 2,
    before acknowledging it. The publisher evicts it, the others stage version 2 again in the next
    generation and expose it only on its commit; nobody exposed it before."""
    timeout = 3.0
    rec = ws.FlightRecorder(capacity=20000)
    fr = tmp_path / "fr"
    async with ws.Publisher("frozen", timeout=timeout, heartbeat_interval=0.25, bucket_bytes=1 << 18, recorder=rec,
                            activation="all", encoding="full") as pub:
        workers = [procs.spawn("subscriber", channel="frozen", address=pub.address, member=f"gen{i}",
                               until_version=4, deadline=120, mode="updates", transport="group", timeout=timeout,
                               fr_dir=str(fr), dump_at_end=True,
                               faults={f"{how}_after_stage": 2} if i == 2 else None) for i in range(3)]
        await pub.wait_subscribers(3, timeout=60)
        for version in range(5):
            report = await (await pub.put(body(version, 1.0), version=version)).delivered(timeout=timeout * 6 + 30)
            if version >= 2:
                assert set(report.members) == {"gen0", "gen1"}, report
                assert report.committed_at > 0
        assert [m.member_id for m in pub.evicted] == ["gen2"]
        results = [await procs.result(w, timeout=60) for w in workers[:2]]
        if how == "stop":  # resumed: it finds itself evicted (no Commit of version 2 ever reached it), dumps, exits
            procs.signal(workers[2], signal.SIGCONT)
            victim = procs.procs[workers[2]][0]
            code = await asyncio.get_running_loop().run_in_executor(None, victim.wait, 60)
            # evicted, or its connection already closed by the publisher that evicted it
            assert code != 0 and any(w in procs.log(workers[2]) for w in ("Evicted", "PublisherGone"))
    for result in results:
        assert 2 in result["order"] and result["order"][-1] == 4
        for version, seen in result["digests"].items():
            assert seen == digests(body(int(version), 1.0)), version
    entries = rec.snapshot() + [e for path in sorted(fr.rglob("*.wsfr")) for e in load_dump(path).entries]
    assert assert_exposed_only_once_committed(entries) >= 10
    if how == "stop":
        assert first(entries, "stage", "gen2", 2)  # its own dump: it staged version 2, and never exposed it
        assert not [e for e in entries if e.member == "gen2" and e.op == "publish" and e.version >= 2]


async def test_a_publisher_killed_mid_commit_leaves_no_member_silent_about_the_split(procs: Procs,
                                                                                     tmp_path: Path) -> None:
    """activation="all": the trainer is SIGKILLed inside its commit loop, after the Commit of version
    2 reached member "a" and before it reached "b". "a" served 2 and "b" 1, for good, and neither said
    so. Members cannot converge without the publisher (whether anyone else exposed 2 is exactly what
    they cannot know), so each one reports the split at once, with the version it serves."""
    address_file = tmp_path / "address"
    pub_index = procs.spawn("dies_mid_commit", channel="split", address_file=str(address_file), die_at=2,
                            subscribers=2, timeout=3.0)
    deadline = time.monotonic() + 60
    while not address_file.exists():  # polling for the child's address file, with a deadline
        assert time.monotonic() < deadline, procs.log(pub_index)
        await asyncio.sleep(0.05)
    workers = [procs.spawn("subscriber", channel="split", address=address_file.read_text(), member=name,
                           mode="follow", deadline=120, timeout=3.0, transport="group") for name in ("a", "b")]
    a, b = [await procs.result(w, timeout=90) for w in workers]
    assert (a["order"][-1], b["order"][-1]) == (2, 1), (a["order"], b["order"])  # the split, as it happens
    assert a["error"] == b["error"] == "PublisherGone"
    assert "this member serves version 2 (exposed on its Commit, never told that every member did)" \
        in a["error_message"], a["error_message"]
    assert "this member serves version 1 (it staged 2 and was never told to expose it); other members may " \
           "serve 2" in b["error_message"], b["error_message"]
