"""Tier 4: GPU paths. Skipped without CUDA; scripts/gpu_check.sh runs them on a GPU machine.

Only one GPU is ever available and NCCL refuses two ranks on one device, so NCCL is tested
as a one-rank channel, and the CUDA data path through a two-process gloo channel.
"""

from __future__ import annotations

import asyncio
import datetime

import pytest
import torch

import weightsync as ws
from tests.conftest import Procs
from tests.statedicts import digests, mixed_state_dict
from tests.test_delta import _codec_case
from weightsync import _torch_compat as compat
from weightsync.encodings import codec
from weightsync.format import layout
from weightsync.recorder.recorder import process_recorder

pytestmark = [pytest.mark.gpu, pytest.mark.asyncio, pytest.mark.timeout(60),
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
        entries = [e for e in process_recorder().snapshot() if e.channel == "gpu"]
        assert any(e.op == "put" and e.state == "completed" and e.version == 1 for e in entries)


async def test_a_one_rank_nccl_backend_forms_on_the_device_moves_a_bucket_and_aborts() -> None:
    """A publisher alone builds no group, so the NCCL backend is made here the way a generation
    makes it (one communicator, eagerly on the device, bounded CTAs), a bucket broadcast from
    rank 0 and waited on within its deadline, then aborted as a failed generation is."""
    if not compat.nccl_available():
        pytest.skip("torch without NCCL")
    store = torch.distributed.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
    pg = compat.make_nccl(compat.prefix_store("gpu-one-rank/", store), 0, 1, 30.0, torch.device("cuda", 0), 4)
    bucket = torch.arange(1 << 20, device="cuda", dtype=torch.int32)
    compat.wait_work(compat.broadcast(pg, bucket, 0, 30.0), 30.0)
    torch.cuda.synchronize()
    assert torch.equal(bucket.cpu(), torch.arange(1 << 20, dtype=torch.int32))
    compat.abort(pg)


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
    entries = [e for e in process_recorder().snapshot() if e.channel == "gpu-nccl"]
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


# deltas (issue 23) from and to the device ---------------------------------------------------

FAST = {"timeout": 10.0, "heartbeat_interval": 0.25, "bucket_bytes": 1 << 17}


@pytest.mark.parametrize("auto", [True, False])
async def test_the_delta_codec_on_the_device_rebuilds_every_bit_on_either_side(auto: bool) -> None:
    """A CUDA publisher's buckets (NCCL) are encoded by torch ops on the device; what it makes
    must rebuild every bit on a host member, and what a host publisher makes on a CUDA member."""
    manifest, base, cur = _codec_case()
    dev_base, dev_cur = base.cuda(), cur.cuda()
    sent = 0
    for lo, hi in layout.bucket_ranges(manifest.total_bytes, 1 << 16):
        segs = layout.segments(manifest, lo, hi)
        made = codec.encode(dev_cur[lo:hi], dev_base[lo:hi], segs, auto=auto)
        on_host = torch.full((hi - lo,), 0xAB, dtype=torch.uint8)
        codec.decode(made.wire, base[lo:hi], on_host, segs)
        assert torch.equal(on_host, cur[lo:hi])
        on_device = torch.full((hi - lo,), 0xAB, dtype=torch.uint8, device="cuda")
        codec.decode(codec.encode(cur[lo:hi], base[lo:hi], segs, auto=auto).wire.cuda(), dev_base[lo:hi],
                     on_device, segs)
        assert torch.equal(on_device.cpu(), cur[lo:hi])
        sent += made.wire.numel()
    assert sent < manifest.total_bytes


class CudaTrainer:
    """fp32 masters on the GPU, an RL-sized step each version, pushed as bf16."""

    def __init__(self, lr: float = 1e-3) -> None:
        self.gen = torch.Generator(device="cuda").manual_seed(3)
        self.lr = lr
        self.master = {"embed": torch.randn(512, 96, device="cuda", generator=self.gen),
                       "layer0.mlp": torch.randn(96, 384, device="cuda", generator=self.gen),
                       "norm": torch.ones(96, device="cuda"),
                       "steps": torch.zeros((), dtype=torch.int64, device="cuda")}

    def step(self) -> None:
        for value in self.master.values():
            if value.is_floating_point():
                noise = torch.randn(value.shape, device="cuda", generator=self.gen)
                value.add_(noise.sign() * value.abs() * self.lr)
        self.master["steps"] += 1

    def bf16(self) -> dict[str, torch.Tensor]:
        return {k: v.to(torch.bfloat16) if v.is_floating_point() else v.clone() for k, v in self.master.items()}


async def test_deltas_from_a_cuda_trainer_reach_host_and_cuda_members_bit_exact() -> None:
    """The trainer's fp32 masters live on the GPU and are put as bf16 (cast on the device, in the
    stream-ordered snapshot); the trainer steps right after each put. One member returns host
    tensors, one CUDA tensors and writes them into CUDA destinations; every version is bit-exact
    on both, every version after the first goes as a delta smaller than half the version."""
    trainer = CudaTrainer()
    async with ws.Publisher("gpu-delta", backend="gloo", device="cuda", encoding="delta", **FAST) as pub:
        host = ws.Subscriber(pub.name, address=pub.address, member_id="host", timeout=10.0, transport="group")
        dev = ws.Subscriber(pub.name, address=pub.address, member_id="dev", timeout=10.0, transport="group",
                            device="cuda", backend="gloo")
        await asyncio.gather(host.start(), dev.start())
        try:
            await pub.wait_subscribers(2, timeout=30)
            dest = {k: torch.full_like(v, 7) for k, v in trainer.bf16().items()}
            for version in range(5):
                expected = digests(trainer.bf16())
                handle = await pub.put(trainer.master, version=version, dtype=torch.bfloat16)
                trainer.step()  # ordered after the snapshot's cast-and-copy on the device
                report = await handle.delivered(timeout=60)
                assert set(report.members) == {"host", "dev"}
                got = await host.get(min_version=version, timeout=30)
                assert {t.device.type for t in got.values()} == {"cpu"} and digests(got) == expected
                got = await dev.get(min_version=version, timeout=30)
                assert {t.device.type for t in got.values()} == {"cuda"} and digests(got) == expected
                assert await dev.get_into(dest, timeout=30) == version
                assert digests(dest) == expected
                if version:
                    assert set(report.encodings.values()) == {"delta"} and report.base == version - 1
                    assert report.wire_bytes < report.nbytes * len(report.members) / 2
        finally:
            await asyncio.gather(host.aclose(), dev.aclose())


async def test_copy_false_deltas_of_cuda_tensors_against_the_kept_copy() -> None:
    """``put(copy=False)`` of CUDA tensors: each bucket is packed from the device as it goes, and
    the publisher's kept copy (the base of the next delta) is filled from it; the caller gets its
    tensors back at ``released`` and may change them at once."""
    trainer = CudaTrainer()
    async with ws.Publisher("gpu-borrowed", backend="gloo", device="cuda", **FAST) as pub:
        async with ws.Subscriber(pub.name, address=pub.address, member_id="m0", timeout=10.0,
                                 transport="group") as sub:
            await pub.wait_subscribers(1, timeout=30)
            for version in range(4):
                sd = trainer.bf16()
                expected = digests(sd)
                handle = await pub.put(sd, version=version, copy=False, encoding="delta")
                await handle.released(timeout=30)
                for value in sd.values():
                    value.zero_()
                report = await handle
                assert digests(await sub.get(min_version=version, timeout=30)) == expected
                if version:
                    assert set(report.encodings.values()) == {"delta"} and report.base == version - 1
                trainer.step()


# sharded trainers (issue 12): DTensor shards on the device -------------------------------------

@pytest.mark.parametrize("by", ["rank", "group"])
async def test_a_one_rank_fsdp2_trainer_on_the_gpu_pushes_its_cuda_shards_cast_to_bf16(by: str) -> None:
    """FSDP2 on a CUDA mesh (one rank: NCCL takes one GPU per rank) puts its DTensor state dict
    as bf16, naming its rank (``rank=``/``world_size=``) or its process group (``group=``, the
    trainer's NCCL world). Each CUDA local shard is cast and packed on the device into the host
    staging of a gloo channel; the member holds ``full_tensor()`` cast to bf16, bit-exact."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tests.statedicts import fsdp_model

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    try:
        model = fsdp_model(init_device_mesh("cuda", (1,)))
        where = {"group": dist.group.WORLD} if by == "group" else {"rank": 0, "world_size": 1}
        async with ws.Publisher("gpu-fsdp", backend="gloo", device="cuda", **where, **FAST) as pub:
            async with ws.Subscriber(pub.name, address=pub.address, member_id="gen", timeout=10.0,
                                     transport="group") as sub:
                await pub.wait_subscribers(1, timeout=30)
                for version in range(2):
                    with torch.no_grad():
                        for p in model.parameters():
                            p.to_local().add_(1)
                    sd = dict(model.state_dict())
                    assert {v.to_local().device.type for v in sd.values() if hasattr(v, "to_local")} == {"cuda"}
                    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in sd.items()}
                    expected = digests({k: v.to(torch.bfloat16) if v.is_floating_point() else v
                                        for k, v in full.items()})
                    report = await (await pub.put(sd, version=version, dtype=torch.bfloat16))
                    assert report.members == ("gen",)
                    assert digests(await sub.get(min_version=version, timeout=30)) == expected
    finally:
        dist.destroy_process_group()
