"""The encoding contract: every encoding, the same assertions (as test_plane_contract does for planes).

Each case is a channel whose publisher names one encoding: ``"full"`` (the staged bytes),
``"delta"`` and ``"auto"`` (built in), and ``"xor-test"``, registered from outside the library
against ``weightsync.extend`` alone (tests/xor_encoding.py). Its members: two in the group, whose
wire carries the encoding, and one reading the publisher's shared memory (the staged bytes as they
are) where the host has it. Each version is an RL-like step of the one before (one element in 50
moves), so the deltas have something to be small about. For every encoding:

1. every version arrives bit-exact at every member, in order, and the report names the encoding
   each member was sent (a group member the channel's, once it holds a base where one is needed;
   a same-host member ``"full"``);
2. a wire bucket corrupted at one member is refused (its digest is over what it decoded) and the
   version arrives intact, re-sent;
3. a member that joins late, holding no base, gets the current version bit-exact (a delta's
   channel sends it that version in full).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio
import torch

import weightsync as ws
from tests import xor_encoding
from tests.statedicts import digests
from weightsync.extend import register_encoding, unregister_encoding
from weightsync.planes.shm import plane as shm
from weightsync.testing import Faults, inject

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(180)]

ENCODINGS = ["full", "delta", "auto", "xor-test"]
NEEDS_BASE = {"delta", "auto"}  # a member without the base is sent the version in full
FAST = {"timeout": 5.0, "heartbeat_interval": 0.25, "bucket_bytes": 1 << 16}
VERSIONS = 4


def step(version: int) -> dict[str, torch.Tensor]:
    """Version ``version`` of a small model: a fixed start, then one element in 50 of every tensor
    moved a little per step (what an RL step at a small learning rate leaves)."""
    gen = torch.Generator().manual_seed(7)
    sd = {"embed": torch.randn(512, 64, generator=gen).to(torch.bfloat16),
          "layer.weight": torch.randn(256, 256, generator=gen),
          "layer.bias": torch.randn(256, generator=gen),
          "head": torch.randn(64, 512, generator=gen).to(torch.float16)}
    for v in range(1, version + 1):
        moved = torch.Generator().manual_seed(1000 + v)
        for t in sd.values():
            flat = t.view(-1)
            where = torch.randint(0, flat.numel(), (max(flat.numel() // 50, 1),), generator=moved)
            flat[where] = (flat[where].float() + 0.01 * (v + 1)).to(t.dtype)
    return sd


@pytest.fixture(autouse=True)
def xor() -> Iterator[None]:
    register_encoding(xor_encoding.XOR)
    yield
    unregister_encoding(xor_encoding.XOR.name)


@pytest_asyncio.fixture
async def channel(request: pytest.FixtureRequest) -> AsyncIterator[tuple[ws.Publisher, list[ws.Subscriber]]]:
    """A publisher in the case's encoding, two group members and a same-host one; m0 with the
    test's faults (``@pytest.mark.faults(**Faults arguments)``, made anew for each case) injected
    before it starts."""
    encoding, marker = request.param, request.node.get_closest_marker("faults")
    transports = ["group", "group"] + (["shm"] if shm.available() else [])
    async with ws.Publisher(f"contract-{encoding}", encoding=encoding, **FAST) as pub:
        subs = [ws.Subscriber(pub.name, address=pub.address, member_id=f"m{i}", timeout=5.0, transport=t)
                for i, t in enumerate(transports)]
        if marker is not None:
            inject(subs[0], Faults(**marker.kwargs))
        await asyncio.gather(*(s.start() for s in subs))
        try:
            await pub.wait_subscribers(len(subs), timeout=30)
            yield pub, subs
        finally:
            await asyncio.gather(*(s.aclose() for s in subs))


async def push(pub: ws.Publisher, subs: list[ws.Subscriber], versions: range) -> list[ws.DeliveryReport]:
    """Put ``versions`` one after the other; each must be readable, bit-exact, at every member."""
    reports = []
    for version in versions:
        sd = step(version)
        report = await (await pub.put(sd, version=version))
        reports.append(report)
        assert set(report.members) == {s.member_id for s in subs}, (version, report)
        for sub in subs:
            got = await sub.get(min_version=version, timeout=20)
            assert got.version == version and digests(got) == digests(sd), f"{sub.member_id} at v{version}"
    return reports


@pytest.mark.parametrize("channel", ENCODINGS, indirect=True)
async def test_every_version_arrives_bit_exact_and_the_report_names_each_members_encoding(channel) -> None:
    pub, subs = channel
    encoding = pub.encoding
    reports = await push(pub, subs, range(VERSIONS))
    for report in reports:
        for sub in subs:
            got = report.encodings[sub.member_id]
            if sub.transport == "shm":
                assert got == "full", report  # the same-host member reads the staged bytes as they are
            elif encoding == "auto":
                assert got in ("full", "delta"), report  # "auto" sends a delta, or full where it measured that faster
            elif encoding in NEEDS_BASE and report.version == 0:
                assert got == "full", report  # nobody holds a base yet
            else:
                assert got == encoding, report
    if encoding == "delta":  # a step of the last one: each group member is sent far less than the version
        group = [s for s in subs if s.transport == "group"]
        assert all(r.wire_bytes < r.nbytes * len(group) / 4 for r in reports[1:]), reports


@pytest.mark.parametrize("channel", ENCODINGS, indirect=True)
@pytest.mark.faults(corrupt={2})  # the first wire bucket of version 2, as it arrives at m0
async def test_a_corrupted_wire_bucket_is_refused_and_the_version_arrives_intact(channel) -> None:
    pub, subs = channel
    victim = subs[0]
    await push(pub, subs, range(VERSIONS))
    assert victim.statistics().checksum_failures >= 1  # caught, never exposed
    stats = pub.statistics()
    assert stats.resends + stats.delta_fallbacks >= 1  # and the version sent again


@pytest.mark.parametrize("channel", ENCODINGS, indirect=True)
async def test_a_member_that_joins_late_gets_the_current_version_bit_exact(channel) -> None:
    pub, subs = channel
    await push(pub, subs, range(2))
    async with ws.Subscriber(pub.name, address=pub.address, member_id="late", timeout=5.0,
                             transport="group") as late:
        await pub.wait_subscribers(len(subs) + 1, timeout=30)
        # holding no base, it is sent the current version before anything newer, and in full
        caught_up = await late.get(min_version=1, timeout=20)
        assert caught_up.version == 1 and digests(caught_up) == digests(step(1))
        assert late.statistics().checksum_failures == 0  # nothing was sent it that it could not decode
        await push(pub, [*subs, late], range(2, VERSIONS))  # then it follows, in the channel's encoding
