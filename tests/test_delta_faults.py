"""Deltas the way production fails: a generator killed with -9 or frozen with SIGSTOP while a delta
version is on the wire. The others lose nothing: they read every version bit-exact, and the
versions after the eviction are deltas again (they still hold the base; only the victim is gone)."""

from __future__ import annotations

import asyncio
import signal

import pytest
import torch

import weightsync as ws
from tests.conftest import Procs
from tests.statedicts import digests

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(180)]

N = 8 << 20  # bf16 elements: 16 MiB, four buckets


def body(version: int) -> dict[str, torch.Tensor]:
    """Version ``version``: a fixed random bf16 body with the low bit flipped in one element of every 29,
    a different one each version (each differs from the one before in 2 of 29 elements)."""
    base = torch.randn(N, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    bits = base.view(torch.int16)
    bits[version % 29::29] ^= 1
    return {"body": base, "scale": torch.full((64,), float(version))}


@pytest.mark.parametrize(("how", "copy"), [(signal.SIGKILL, True), (signal.SIGSTOP, True), (signal.SIGSTOP, False)],
                         ids=["kill-9", "sigstop", "sigstop-copy-false"])
async def test_a_generator_killed_or_frozen_mid_delta_costs_the_others_nothing(procs: Procs, how: signal.Signals,
                                                                              copy: bool) -> None:
    """``copy=False``: the deltas are against the publisher's kept copy, which a version abandoned
    half-way leaves holding nothing whole: that version is re-sent in full, then deltas again."""
    timeout = 4.0
    rec = ws.FlightRecorder(capacity=8000)
    async with ws.Publisher("delta-faults", timeout=timeout, heartbeat_interval=0.25, bucket_bytes=4 << 20,
                            recorder=rec, encoding="delta") as pub:
        workers = [procs.spawn("subscriber", channel="delta-faults", address=pub.address, member=f"gen{i}",
                               until_version=7, deadline=150, mode="updates", transport="group") for i in range(3)]
        await pub.wait_subscribers(3, timeout=60)
        for v in range(8):
            handle = await pub.put(body(v), version=v, copy=copy)
            if v == 3:  # version 3's delta on the wire: the victim goes now
                while not any(e.op == "bucket_send" and e.version == 3 and e.encoding == "delta"
                              for e in rec.snapshot()):
                    await asyncio.sleep(0.002)  # until the recorder shows version 3's delta going out
                procs.signal(workers[2], how)
            report = await handle.delivered(timeout=timeout * 3 + 30)
            assert {"gen0", "gen1"} <= set(report.members)
            if v == 0:
                assert set(report.encodings.values()) == {"full"}
            elif v >= 5:  # the survivors hold every version since: deltas, against the one before
                assert set(report.members) == {"gen0", "gen1"}
                assert report.encodings == {"gen0": "delta", "gen1": "delta"} and report.base == v - 1
        assert [m.member_id for m in pub.evicted] == ["gen2"]
        results = [await procs.result(w, timeout=60) for w in workers[:2]]
    for result in results:
        assert result["order"] == sorted(result["order"]) and result["order"][-1] == 7
        for version, seen in result["digests"].items():  # every version read is exactly what was put
            assert seen == digests(body(int(version))), version
