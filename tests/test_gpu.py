"""Tier 4: GPU paths. Skipped without CUDA; scripts/gpu_check.sh runs them on a GPU machine.

Only one GPU is ever available and NCCL refuses two ranks on one device, so NCCL is tested
as a one-rank channel, and the CUDA data path through a two-process gloo channel.
"""

from __future__ import annotations

import pytest
import torch

import weightsync as ws
from tests.conftest import Procs
from tests.statedicts import digests, mixed_state_dict
from weightsync import _torch_compat as compat

pytestmark = [pytest.mark.gpu, pytest.mark.asyncio, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


async def test_one_rank_nccl_channel() -> None:
    if not compat.nccl_available():
        pytest.skip("torch without NCCL")
    async with ws.Publisher("gpu", backend="nccl", device="cuda", timeout=30) as pub:
        assert pub.backend == "nccl"
        sd = {"w": torch.randn(1 << 20, device="cuda"), "b": torch.ones(7, device="cuda", dtype=torch.bfloat16)}
        handle = await pub.put(sd, version=1)
        sd["w"].zero_()  # the stream-ordered snapshot already captured the old values
        report = await handle.delivered(timeout=60)
        assert report.version == 1 and report.members == ()
        entries = [e for e in ws.pg.process_recorder().snapshot() if e.channel == "gpu"]
        assert any(e.op == "rebuild" and e.state == "completed" for e in entries)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL refuses two ranks on one GPU: needs two GPUs")
async def test_nccl_broadcast_from_one_gpu_to_another(procs: Procs) -> None:
    """A real NCCL broadcast: the publisher on cuda:0, a subscriber process on cuda:1, two
    versions of mixed dtypes bit-exact, the second with the caller writing right after put."""
    if not compat.nccl_available():
        pytest.skip("torch without NCCL")
    async with ws.Publisher("gpu-nccl", backend="nccl", device="cuda:0", timeout=30) as pub:
        w = procs.spawn("subscriber", channel=pub.name, address=pub.address, member="gpu1", backend="nccl",
                        device="cuda:1", until_version=1, deadline=180)
        await pub.wait_subscribers(1, timeout=120)
        expected = {}
        for v in range(2):
            sd = {k: t.to("cuda:0") for k, t in mixed_state_dict(v, mib=8).items()}
            expected[str(v)] = digests(sd)
            handle = await pub.put(sd, version=v)
            next(iter(sd.values())).zero_()  # ordered after the snapshot on the device
            report = await handle.delivered(timeout=120)
            assert report.members == ("gpu1",)
        result = await procs.result(w, timeout=120)
    assert "1" in result["digests"]  # the last one always; version 0 unless 1 superseded it unread
    for version, got in result["digests"].items():
        assert got == expected[version]
    entries = [e for e in ws.pg.process_recorder().snapshot() if e.channel == "gpu-nccl"]
    assert any(e.op == "bucket_send" and e.state == "completed" for e in entries)


@pytest.mark.parametrize("transport", ["group", "auto"])
async def test_cuda_snapshot_is_ordered_before_the_callers_next_write(transport: str) -> None:
    """put() enqueues the device copy on a side stream and returns without waiting for it; a
    write the caller makes right after is ordered after the copy on the device, so the
    subscriber gets the values that were put, over gloo and over the same-host segment (whose
    ready count is set only once the copy's event completed)."""
    async with ws.Publisher("gpu-snap", backend="gloo", device="cuda", timeout=30) as pub:
        async with ws.Subscriber("gpu-snap", address=pub.address, backend="gloo", timeout=30,
                                 transport=transport) as sub:
            await pub.wait_subscribers(1, timeout=60)
            assert sub.transport == ("group" if transport == "group" else "shm")
            big = torch.randn(64 << 20, device="cuda")  # 256 MiB
            expected = digests({"big": big})
            torch.cuda.synchronize()
            handle = await pub.put({"big": big}, version=1)
            big.fill_(3.0)  # ordered after the snapshot copy on the device
            await handle.delivered(timeout=60)
            assert digests(await sub.get(min_version=1, timeout=30)) == expected


async def test_two_process_gloo_channel_with_cuda_tensors(procs: Procs) -> None:
    async with ws.Publisher("gpu-gloo", backend="gloo", device="cuda", timeout=30) as pub:
        w = procs.spawn("subscriber", channel=pub.name, address=pub.address, member="cuda-gen", until_version=1,
                        deadline=120)
        await pub.wait_subscribers(1, timeout=120)
        expected = {}
        for v in range(2):
            sd = {k: t.cuda() for k, t in mixed_state_dict(v, mib=8).items()}
            expected[str(v)] = digests(sd)
            await (await pub.put(sd, version=v)).delivered(timeout=120)
        result = await procs.result(w, timeout=120)
    for version, got in result["digests"].items():
        assert got == expected[version]
