"""Tier 2b: a publisher in the test process, subscribers in spawned processes (gloo, CPU).

Port-0 stores, a hard deadline per test (pytest-timeout plus each wait's own), every spawned
process killed at teardown by the ``procs`` fixture, worker logs attached to failures.
"""

from __future__ import annotations

import socket

import pytest
import torch

import weightsync as ws
from tests.conftest import LOOPS, Procs, loop_policy
from tests.statedicts import digests, mixed_state_dict

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(240)]
OPTS = {"timeout": 10.0, "heartbeat_interval": 0.25}


@pytest.fixture(params=LOOPS)
def event_loop_policy(request: pytest.FixtureRequest):
    return loop_policy(request.param)


@pytest.fixture
def loop_name(event_loop_policy) -> str:
    return "uvloop" if "uvloop" in type(event_loop_policy).__module__ else "asyncio"


def spawn_subscribers(procs: Procs, pub: ws.Publisher, n: int, until: int, loop: str, **kw) -> list[int]:
    return [procs.spawn("subscriber", channel=pub.name, address=pub.address, member=f"gen{i}",
                        until_version=until, loop=loop, deadline=120, **kw) for i in range(n)]


@pytest.mark.parametrize("n", [1, 2, 4])
async def test_one_publisher_n_subscribers(procs: Procs, n: int, loop_name: str) -> None:
    async with ws.Publisher("policy", bucket_bytes=1 << 20, **OPTS) as pub:
        workers = spawn_subscribers(procs, pub, n, until=2, loop=loop_name)
        await pub.wait_subscribers(n, timeout=60)
        expected = {}
        for v in range(3):
            sd = mixed_state_dict(v, mib=2)
            expected[str(v)] = digests(sd)
            report = await (await pub.put(sd, version=v)).delivered(timeout=60)
            assert set(report.members) == {f"gen{i}" for i in range(n)}
        results = [await procs.result(w, timeout=60) for w in workers]
    for result in results:
        assert result["order"] == sorted(result["order"]) and result["order"][-1] == 2
        for version, got in result["digests"].items():
            assert got == expected[version], f"{result['member']} version {version} differs"


async def test_three_subscribers_64_mib_mixed_dtypes_bit_exact(procs: Procs, loop_name: str) -> None:
    """The issue's acceptance run: 3 versions of a 64 MiB mixed-dtype state dict to 3 processes."""
    if loop_name == "uvloop":
        pytest.skip("the 64 MiB acceptance run is loop-independent; the n-subscriber test covers uvloop")
    async with ws.Publisher("policy", **OPTS) as pub:
        workers = spawn_subscribers(procs, pub, 3, until=2, loop=loop_name, mode="updates")
        await pub.wait_subscribers(3, timeout=60)
        expected = {}
        for v in range(3):
            sd = mixed_state_dict(v, mib=64)
            expected[str(v)] = digests(sd)
            report = await (await pub.put(sd, version=v)).delivered(timeout=120)
            assert len(report.members) == 3 and report.nbytes >= 64 << 20
        results = [await procs.result(w, timeout=120) for w in workers]
    for result in results:
        assert result["order"][-1] == 2
        for version, got in result["digests"].items():
            assert got == expected[version]


async def test_fast_publisher_sleeping_subscriber_holds_two_snapshots(procs: Procs, loop_name: str) -> None:
    async with ws.Publisher("policy", bucket_bytes=4 << 20, **OPTS) as pub:
        # its receive is slow too (at least 20 ms a bucket): over shared memory a version's copy
        # once kept pace with the puts on 2.15 and nothing was superseded
        workers = spawn_subscribers(procs, pub, 1, until=19, loop=loop_name, mode="updates", sleep=0.5,
                                    faults={"slow": 2.0})
        await pub.wait_subscribers(1, timeout=60)
        body = torch.empty(16 << 20)  # 64 MiB: snapshotting is much faster than sending it
        handles = []
        for v in range(20):
            body.fill_(v)
            handles.append(await pub.put({"body": body}, version=v))
        reports = [await h.delivered(timeout=120) for h in handles]
        assert any(r.superseded for r in reports) and not reports[-1].superseded
        result = await procs.result(workers[0], timeout=120)
    # two snapshots (in flight, pending) and the base the next delta is made against (deltas are the
    # default: seen at 3 with a second suite beside this one); a same-host member reads its version
    # in place: staging parks that buffer, one more at most
    assert pub.peak_snapshots() <= 2 + 1 + (0 if result["transport"] == "group" else 1)
    assert result["order"] == sorted(set(result["order"])) and result["order"][-1] == 19
    assert len(result["order"]) < 20  # a sleeping consumer skips versions, it never queues them
    # the subscriber's bound measured by the kernel, not by the library, over what it held when
    # it joined: two 64 MiB slots, the reader's copy of one version and the digest's bytes of it;
    # over shared memory also the two publisher segments it maps (its RSS counts those pages).
    # Twenty versions kept would be 1280 MiB more.
    grew = result["rss_peak_mib"] - result["rss_baseline_mib"]
    allowed = (4 if result["transport"] == "group" else 6) * 64 + 48
    assert 0 < grew < allowed, (grew, allowed, result["transport"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_coexists_with_users_own_process_group(procs: Procs, loop_name: str) -> None:
    """Two processes run their own init_process_group world; weightsync beside it leaves it intact."""
    async with ws.Publisher("policy", **OPTS) as pub:
        port = _free_port()  # the user's world, rendezvous by init_method URL as users do it
        workers = [procs.spawn("coexist", channel=pub.name, address=pub.address, member=f"gen{r}", rank=r,
                               world_port=port, until_version=1, loop=loop_name, deadline=120) for r in range(2)]
        await pub.wait_subscribers(2, timeout=60)
        for v in range(2):
            await (await pub.put({"w": mixed_state_dict(v)["layer0.float32"]}, version=v)).delivered(timeout=60)
        results = [await procs.result(w, timeout=120) for w in workers]
    for result in results:
        assert result["before"] == [3.0] * 4 and result["after"] == [3.0] * 4
        assert result["order"][-1] == 1


async def test_subscribers_in_separate_processes_see_publisher_close(procs: Procs, loop_name: str) -> None:
    async with ws.Publisher("policy", **OPTS) as pub:
        workers = spawn_subscribers(procs, pub, 2, until=99, loop=loop_name, mode="updates")
        await pub.wait_subscribers(2, timeout=60)
        await (await pub.put({"x": mixed_state_dict(0)["scalar"]}, version=0)).delivered(timeout=30)
    for w in workers:  # PublisherGone ends the worker with a non-zero status: it must not hang
        with pytest.raises(AssertionError, match="exited 1"):
            await procs.result(w, timeout=60)
        assert "PublisherGone" in procs.log(w)


