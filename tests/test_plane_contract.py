"""The data-plane contract: every plane, the same assertions.

Each case is a channel whose members receive through one plane: the group's broadcast, the
publisher's shared memory, point to point (members that name what they want, here every tensor
whole), sharded lanes (two FSDP2 trainer ranks in their own processes, each its own lane), and
``mailbox``, a plane registered from outside the library (tests/mailbox_plane.py) that the
Sender and Receiver serve unchanged. For each: every version arrives bit-exact at every member,
in order; a bucket corrupted on its way is refused and the version re-sent intact (shared
memory: corrupted on its way through the ring, ``copy=False``, which leaves nothing to re-send
from, so the member goes on with the next version; a sealed snapshot has no way on which
anything could corrupt it, and is not digested); closing leaves no segment mapped or open.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import gc
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
import torch.distributed as dist

import weightsync as ws
from tests import mailbox_plane
from tests.conftest import Procs
from tests.statedicts import digest, mixed_state_dict
from weightsync.extend import register_plane, unregister_plane
from weightsync.planes.onesided import endpoints
from weightsync.planes.shm import plane as shm
from weightsync.testing import Faults, inject

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(180)]

FAST = {"timeout": 10.0, "heartbeat_interval": 0.25, "bucket_bytes": 1 << 16}
PLANES = ["group", "shm", "point-to-point", "lanes", "mailbox", "one-sided"]
VERSIONS = 3


@dataclass
class Case:
    """A channel of one plane: ``push`` puts every version and returns each one's digests."""

    plane: str
    subs: list[ws.Subscriber] = field(default_factory=list)
    pub: ws.Publisher | None = None
    expected: dict[int, dict[str, str]] = field(default_factory=dict)
    trainers: list[int] = field(default_factory=list)
    procs: Procs | None = None

    async def push(self, copy: bool = True) -> dict[int, dict[str, str]]:
        if self.pub is None:  # the lanes: the trainer ranks push on their own once the members joined
            assert self.procs is not None
            results = [await self.procs.result(i, 150) for i in self.trainers]
            assert all(not r["error"] for r in results), [r["error"] for r in results]
            return {int(v): d for v, d in results[0]["expected"].items()}
        for version in range(VERSIONS):
            sd = mixed_state_dict(version, mib=0.5)
            self.expected[version] = {k: digest(v) for k, v in sd.items()}
            report = await (await self.pub.put(sd, version=version, copy=copy))  # sd is left as it is
            everyone = {s.member_id for s in self.subs}
            # copy=False: a version that failed somewhere has nothing left to re-send from
            assert set(report.members) == everyone if copy else set(report.members) <= everyone
        return self.expected


def _kwargs(plane: str) -> dict[str, Any]:
    if plane == "point-to-point":  # plain tensors are wanted whole: every member is sent point to point
        return {"transport": "group", "want": {k: torch.empty_like(v) for k, v in mixed_state_dict(0, 0.5).items()}}
    return {"transport": {"mailbox": mailbox_plane.NAME, "shm": "shm", "one-sided": "one-sided"}.get(plane, "group")}


@pytest.fixture
def mailbox() -> Iterator[None]:
    register_plane(mailbox_plane.SPEC)  # before the publisher is made: it serves what is registered then
    yield
    unregister_plane(mailbox_plane.NAME)


@pytest_asyncio.fixture
async def open_case(procs: Procs, tmp_path: Path, mailbox: None) -> AsyncIterator[Any]:
    made: list[Case] = []
    stores: list[Any] = []

    async def make(plane: str, n: int = 2, faults: dict[int, Faults] | None = None) -> Case:
        if plane == "shm" and not shm.available():
            pytest.skip("needs memfd and /proc (Linux)")
        if plane == "one-sided" and endpoints.problem():
            pytest.skip(f"one-sided: {endpoints.problem()}")
        case = Case(plane)
        made.append(case)
        if plane == "lanes":
            store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                  timeout=dt.timedelta(seconds=60))
            stores.append(store)
            address_file = tmp_path / "rank0.addr"
            case.procs, case.trainers = procs, [
                procs.spawn("sharded_trainer", rank=r, world=2, store_port=store.port, channel="contract",
                            address_file=str(address_file), versions=VERSIONS, subscribers=n) for r in range(2)]
            deadline = asyncio.get_running_loop().time() + 60
            while not address_file.exists():
                assert asyncio.get_running_loop().time() < deadline, "rank 0 never wrote its address"
                await asyncio.sleep(0.05)  # polling for a file another process writes
            address = address_file.read_text()
        else:
            case.pub = ws.Publisher("contract", **FAST)
            await case.pub.start()
            address = case.pub.address
        case.subs = [ws.Subscriber("contract", address=address, member_id=f"m{i}", timeout=FAST["timeout"],
                                   **_kwargs(plane)) for i in range(n)]
        for i, plan in (faults or {}).items():
            inject(case.subs[i], plan)
        await asyncio.gather(*(s.start() for s in case.subs))
        if case.pub is not None:
            await case.pub.wait_subscribers(n, timeout=20)
        return case

    yield make
    for case in made:
        await asyncio.gather(*(s.aclose() for s in case.subs), return_exceptions=True)
        if case.pub is not None:
            await case.pub.aclose()
    stores.clear()  # the lanes' rendezvous store goes last


async def _received(sub: ws.Subscriber, version: int) -> dict[str, str]:
    weights = await sub.get(min_version=version, timeout=60)
    assert weights.version == version
    return {k: digest(v) for k, v in weights.items()}


async def _follow(sub: ws.Subscriber) -> dict[int, dict[str, str]]:
    """Every version as it becomes readable (latest wins: a version may be skipped, never reordered)."""
    got: dict[int, dict[str, str]] = {}
    async for weights in sub.updates(timeout=60):
        got[weights.version] = {k: digest(v) for k, v in weights.items()}
        if weights.version == VERSIONS - 1:
            return got
    return got


@pytest.mark.parametrize("plane", PLANES)
async def test_every_version_arrives_bit_exact_and_in_order(open_case: Any, plane: str) -> None:
    case = await open_case(plane)
    follows = [asyncio.ensure_future(_follow(s)) for s in case.subs]
    expected = await case.push()
    for sub, follow in zip(case.subs, follows, strict=True):
        got = await asyncio.wait_for(follow, 60)
        assert got and sorted(got) == list(got) and max(got) == VERSIONS - 1  # in order, the newest last
        assert all(got[v] == expected[v] for v in got), f"{plane}: {sub.member_id} holds other bytes"
        assert await _received(sub, VERSIONS - 1) == expected[VERSIONS - 1]
    if plane in ("group", "shm", "mailbox", "one-sided"):
        assert {s.transport for s in case.subs} == {_kwargs(plane)["transport"]}


@pytest.mark.parametrize("plane", PLANES)
async def test_a_corrupted_bucket_is_refused_and_the_version_arrives_intact(open_case: Any, plane: str) -> None:
    case = await open_case(plane, faults={0: Faults(corrupt={1})})
    follows = [asyncio.ensure_future(_follow(s)) for s in case.subs]
    expected = await case.push(copy=plane != "shm")
    for sub, follow in zip(case.subs, follows, strict=True):
        got = await asyncio.wait_for(follow, 60)
        assert all(got[v] == expected[v] for v in got), f"{plane}: {sub.member_id} exposed corrupted bytes"
        assert max(got) == VERSIONS - 1
    assert case.subs[0].statistics().checksum_failures >= 1  # caught, not missed
    if case.pub is not None:
        assert case.pub.statistics().resends >= 1


@pytest.mark.parametrize("plane", ["group", "shm", "point-to-point", "mailbox", "one-sided"])
async def test_closing_leaves_nothing_mapped_or_open(open_case: Any, plane: str) -> None:
    gc.collect()  # what earlier tests in this process still held
    before = shm.mapped_segments(), shm.open_segments()
    case = await open_case(plane, n=1)
    await case.push()
    await case.subs[0].aclose()
    assert case.pub is not None
    await case.pub.aclose()
    gc.collect()
    assert (shm.mapped_segments(), shm.open_segments()) == before
    if plane == "mailbox":
        assert mailbox_plane.BOX.taken >= VERSIONS and mailbox_plane.BOX.posted >= VERSIONS
