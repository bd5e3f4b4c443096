"""Delta versions (issue 23): only what changed goes on the wire, rebuilt bit-exact and proven.

The trainer here is what RL post-training runs: fp32 master weights, an update the size of an
RL step, pushed as bf16 (``put(dtype=torch.bfloat16)``) so most elements keep their bits. Every
version must be bit-exact on every member; members without the base (a newcomer, one whose
delta did not apply) get the version in full in the same version, by themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

import weightsync as ws
from tests.statedicts import digest
from weightsync._errors import ProtocolError
from weightsync.encodings import codec
from weightsync.format import layout
from weightsync.planes.shm import plane as shm

REPO = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.timeout(120)]

FAST = {"timeout": 5.0, "heartbeat_interval": 0.25, "bucket_bytes": 1 << 17}
SMALL_BUCKETS = 1 << 15  # the Trainer's bf16 version in six buckets


class Trainer:
    """fp32 masters; each step moves every element by about ``lr`` of its size (bf16 rounds most
    of those moves away: a few percent of elements change bits at lr 1e-3 here)."""

    def __init__(self, lr: float, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.gen, self.lr = gen, lr
        self.master = {"embed": torch.randn(512, 96, generator=gen), "layer0.q": torch.randn(96, 96, generator=gen),
                       "layer0.mlp": torch.randn(96, 384, generator=gen), "norm": torch.ones(96),
                       "steps": torch.zeros((), dtype=torch.int64)}

    def step(self) -> None:
        for value in self.master.values():
            if value.is_floating_point():
                value.add_(torch.randn(value.shape, generator=self.gen).sign() * value.abs() * self.lr)
        self.master["steps"] += 1

    def bf16(self) -> dict[str, torch.Tensor]:
        return {k: v.to(torch.bfloat16) if v.is_floating_point() else v.clone() for k, v in self.master.items()}


def same(weights: ws.Weights | dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> bool:
    return {k: digest(v) for k, v in weights.items()} == {k: digest(v) for k, v in expected.items()}


async def members(pub: ws.Publisher, transports: list[str]) -> list[ws.Subscriber]:
    subs = [ws.Subscriber(pub.name, address=pub.address, member_id=f"m{i}", timeout=5.0, transport=t)
            for i, t in enumerate(transports)]
    await asyncio.gather(*(s.start() for s in subs))
    return subs


@contextlib.asynccontextmanager
async def one_member(pub: ws.Publisher) -> AsyncIterator[ws.Subscriber]:
    """One group member, "m0", admitted."""
    async with ws.Subscriber(pub.name, address=pub.address, member_id="m0", timeout=5.0, transport="group") as sub:
        await pub.wait_subscribers(1, timeout=20)
        yield sub


# the codec ---------------------------------------------------------------------------------

def _flat(items: list[tuple[str, torch.Tensor]], manifest: Any | None = None) -> torch.Tensor:
    manifest = manifest or layout.build_manifest(items)
    flat = torch.zeros(manifest.total_bytes, dtype=torch.uint8)
    for spec, (_name, t) in zip(manifest.tensors, items, strict=True):
        flat[spec.offset:spec.offset + spec.nbytes].copy_(t.contiguous().reshape(-1).view(torch.uint8))
    return flat


def _codec_case() -> tuple[Any, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    base_items = [("bf16", torch.randn(70_001, generator=gen).to(torch.bfloat16)),
                  ("f32", torch.randn(33, 1000, generator=gen)),
                  ("i64", torch.arange(1003, dtype=torch.int64)),
                  ("odd", torch.randint(0, 255, (77,), dtype=torch.uint8, generator=gen)),
                  ("f64", torch.randn(5000, dtype=torch.float64, generator=gen))]
    manifest = layout.build_manifest(base_items)
    base = _flat(base_items, manifest)
    cur = base.clone()
    # bit flips that float arithmetic would lose: -0.0 for 0.0, NaN payloads, the lowest mantissa bit
    spec = manifest.tensors[0]
    bf = cur[spec.offset:spec.offset + spec.nbytes].view(torch.int16)
    bf[::37] ^= 1
    bf[5] = torch.tensor([0x7FC1], dtype=torch.int16)  # a NaN with a payload
    bf[6] = torch.tensor([-0x8000], dtype=torch.int16)  # -0.0
    f32 = manifest.tensors[1]
    cur[f32.offset:f32.offset + f32.nbytes].view(torch.int32)[::3] ^= 0x10  # a third of them: a dense segment
    cur[-1] ^= 0x80  # the last byte of the layout
    return manifest, base, cur


@pytest.mark.parametrize("auto", [True, False])
@pytest.mark.parametrize("bucket", [1 << 12, 1 << 16, 1 << 22])
def test_the_codec_rebuilds_every_bit(auto: bool, bucket: int) -> None:
    manifest, base, cur = _codec_case()
    sent = 0
    for lo, hi in layout.bucket_ranges(manifest.total_bytes, bucket):
        segs = layout.segments(manifest, lo, hi)
        assert segs[0].lo == 0 and segs[-1].hi == hi - lo  # the segments cover the bucket, gaps included
        enc = codec.encode(cur[lo:hi], base[lo:hi], segs, auto=auto)
        out = torch.full((hi - lo,), 0xAB, dtype=torch.uint8)
        codec.decode(enc.wire, base[lo:hi], out, segs)
        assert torch.equal(out, cur[lo:hi])
        sent += enc.wire.numel()
    assert sent < manifest.total_bytes  # and it was smaller


def test_the_codec_needs_no_numpy() -> None:
    """numpy is not a dependency of weightsync, nor of torch: the codec read tensors through
    ``.numpy()``, so every delta failed where numpy was not installed."""
    code = (
        "import sys; sys.modules['numpy'] = None\n"  # import numpy fails, as where it is not installed
        "import torch\n"
        "from tests.test_delta import _codec_case\n"
        "from weightsync.encodings import codec\nfrom weightsync.format import layout\n"
        "manifest, base, cur = _codec_case()\n"
        "for lo, hi in layout.bucket_ranges(manifest.total_bytes, 1 << 16):\n"
        "    segs = layout.segments(manifest, lo, hi)\n"
        "    for auto in (True, False):\n"
        "        enc = codec.encode(cur[lo:hi], base[lo:hi], segs, auto=auto)\n"
        "        out = torch.zeros(hi - lo, dtype=torch.uint8)\n"
        "        codec.decode(enc.wire, base[lo:hi], out, segs)\n"
        "        assert torch.equal(out, cur[lo:hi])\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_the_codec_refuses_what_is_not_a_delta_of_this_bucket() -> None:
    manifest, base, cur = _codec_case()
    lo, hi = 0, manifest.total_bytes
    segs = layout.segments(manifest, lo, hi)
    wire = codec.encode(cur, base, segs, auto=False).wire
    out = torch.empty_like(cur)
    forged = {
        "truncated": wire[:-3].clone(),
        "too long": torch.cat([wire, torch.zeros(5, dtype=torch.uint8)]),
        "no table": wire[:11].clone(),
        "bad magic": wire.clone().index_fill_(0, torch.tensor([0]), 0),
    }
    head = wire[: 8 * codec.HEAD].clone().view(torch.int64)
    told = int(head[2])
    rows = codec._decompress(memoryview(bytes(wire[8 * codec.HEAD: 8 * codec.HEAD + told])),
                             8 * codec.FIELDS * len(segs)).view(torch.int64)
    for name, edit in {"count past the segment": (1, 10**9), "negative length": (3, -1),
                       "mode unknown": (0, 9)}.items():
        bad, bad_head = rows.clone(), head.clone()
        bad[edit[0]] = edit[1]
        bad_head[2] = bad.numel() * 8  # the table as it is
        forged[name] = torch.cat([bad_head.view(torch.uint8), bad.view(torch.uint8), wire[8 * codec.HEAD + told:]])
    long_head = head.clone()
    long_head[2] = 10**6
    forged["table told longer than it is"] = torch.cat([long_head.view(torch.uint8), wire[8 * codec.HEAD:]])
    for name, bad_wire in forged.items():
        with pytest.raises(codec.DeltaError):
            codec.decode(bad_wire, base, out, segs)
        assert name  # every forgery is refused, none writes past the bucket
    # a delta for another layout does not fit this one
    other = layout.segments(manifest, 0, manifest.total_bytes // 2)
    with pytest.raises(codec.DeltaError):
        codec.decode(wire, base[: manifest.total_bytes // 2], out[: manifest.total_bytes // 2], other)


def test_a_sparse_payload_that_points_past_its_segment_is_refused() -> None:
    items = [("w", torch.zeros(4096, dtype=torch.int16))]
    manifest = layout.build_manifest(items)
    base = _flat(items, manifest)
    cur = base.clone()
    cur.view(torch.int16)[4000] = 1
    segs = layout.segments(manifest, 0, manifest.total_bytes)
    enc = codec.encode(cur, base, segs, auto=False)
    assert enc.modes[0] == codec.SPARSE and enc.changed == 1
    # the same segment with a gap that lands past its end (its 8192 bytes are 1024 words)
    gaps = codec._bytes(codec._compressor().compress(bytes([codec.LONG]) + (5000).to_bytes(4, "little")))
    lanes = codec._bytes(codec._compressor().compress(bytes([0b1000_0000])))
    values = codec._planes(torch.tensor([1], dtype=torch.int16))
    table = [codec.SPARSE, 1, 1, gaps.numel(), lanes.numel(), values.numel()]
    table += [v for s in segs[1:] for v in (codec.SAME, 0, 0, 0, 0, 0)]
    head = [codec.MAGIC, len(segs), 8 * len(table)]
    wire = torch.cat([torch.tensor(head + table, dtype=torch.int64).view(torch.uint8), gaps, lanes, values])
    with pytest.raises(codec.DeltaError, match="past"):
        codec.decode(wire, base, torch.empty_like(cur), segs)


# the channel --------------------------------------------------------------------------------

@pytest.mark.asyncio
@pytest.mark.parametrize(("lr", "encoding"), [(1e-3, "auto"), (1e-2, "delta")])
async def test_many_versions_arrive_as_deltas_bit_exact_on_every_member(lr: float, encoding: str) -> None:
    transports = ["group", "group"] + (["shm"] if shm.available() else [])
    trainer = Trainer(lr)
    async with ws.Publisher("delta", encoding=encoding, **FAST) as pub:  # "auto" is the default
        subs = await members(pub, transports)
        try:
            await pub.wait_subscribers(len(subs), timeout=20)
            ratios = []
            for version in range(8):
                report = await (await pub.put(trainer.master, version=version, dtype=torch.bfloat16))
                expected = trainer.bf16()
                assert set(report.members) == {s.member_id for s in subs}
                for sub in subs:
                    assert same(await sub.get(min_version=version, timeout=10), expected)
                group = [s.member_id for s, t in zip(subs, transports, strict=True) if t == "group"]
                if version == 0:  # nothing to be relative to yet
                    assert set(report.encodings.values()) == {"full"} and report.base == -1
                else:
                    assert {report.encodings[m] for m in group} == {"delta"} and report.base == version - 1
                    ratios.append(report.wire_bytes / (report.nbytes * len(report.members)))
                for sub, t in zip(subs, transports, strict=True):
                    if t == "shm":  # same-host members read the staged segment as it is
                        assert report.encodings[sub.member_id] == "full"
                trainer.step()
            # a few percent of the bf16 elements change per step: far less than the version goes
            assert max(ratios) < (0.5 if lr == 1e-3 else 0.8), ratios
            stats = pub.statistics()
            assert stats.bytes_on_wire < stats.bytes_delivered and stats.delta_fallbacks == 0
            for sub, t in zip(subs, transports, strict=True):  # where each member's receives went
                got = sub.statistics()
                assert got.verify_seconds > 0 and (got.decode_seconds > 0) == (t == "group"), (t, got)
                assert got.decode_seconds + got.verify_seconds <= got.receive.total
        finally:
            await asyncio.gather(*(s.aclose() for s in subs))


@pytest.mark.asyncio
async def test_auto_sends_full_where_everything_changed_and_delta_keeps_its_promise() -> None:
    gen = torch.Generator().manual_seed(3)
    fresh = lambda: {"a": torch.randn(64, 1024, generator=gen), "b": torch.randn(32, 1024, generator=gen)}  # noqa: E731
    for encoding in ("auto", "delta"):
        async with ws.Publisher(f"every-{encoding}", encoding=encoding, **FAST) as pub:
            async with ws.Subscriber(pub.name, address=pub.address, member_id="m0", timeout=5.0,
                                     transport="group") as sub:
                await pub.wait_subscribers(1, timeout=20)
                await (await pub.put(fresh(), version=0))
                sd = fresh()  # every element new: a delta saves nothing
                report = await (await pub.put(sd, version=1))
                assert same(await sub.get(min_version=1, timeout=10), sd)
                if encoding == "auto":
                    assert report.encodings == {"m0": "full"} and report.wire_bytes == report.nbytes
                else:  # asked for a delta: one it is, each segment in its smallest form (never above full)
                    assert report.encodings == {"m0": "delta"} and report.wire_bytes <= report.nbytes * 1.01
                # one tensor unchanged, one new: auto goes delta, the new one as it is, the other not at all
                sd2 = {"a": sd["a"].clone(), "b": torch.randn(32, 1024, generator=gen)}
                report = await (await pub.put(sd2, version=2))
                assert same(await sub.get(min_version=2, timeout=10), sd2)
                assert report.encodings == {"m0": "delta"}
                assert report.wire_bytes < sd2["b"].numel() * 4 * 1.01  # "a" cost nothing


@pytest.mark.asyncio
async def test_a_newcomer_gets_the_version_in_full_then_deltas() -> None:
    trainer = Trainer(1e-3, seed=1)
    rec = ws.FlightRecorder()
    async with ws.Publisher("newcomer", recorder=rec, **FAST) as pub:
        first = ws.Subscriber(pub.name, address=pub.address, member_id="m0", timeout=5.0, transport="group",
                              recorder=rec)
        await first.start()
        late: ws.Subscriber | None = None
        try:
            await pub.wait_subscribers(1, timeout=20)
            for version in range(2):
                report = await (await pub.put(trainer.master, version=version, dtype=torch.bfloat16))
                held = trainer.bf16()
                trainer.step()
            assert report.encodings == {"m0": "delta"}
            late = ws.Subscriber(pub.name, address=pub.address, member_id="m1", timeout=5.0, transport="group",
                                 recorder=rec)
            await late.start()
            await pub.wait_subscribers(2, timeout=20)
            # the newcomer holds no base: the retained version reaches it in full...
            assert same(await late.get(min_version=1, timeout=10), held)
            buckets = [e for e in rec.snapshot() if e.member == "m1" and e.version == 1 and e.bucket >= 0]
            assert buckets and {(e.encoding, e.base) for e in buckets} == {("full", -1)}
            # ...and from then on it is sent deltas with everyone else
            for version in range(2, 5):
                report = await (await pub.put(trainer.master, version=version, dtype=torch.bfloat16))
                expected = trainer.bf16()
                assert report.encodings == {"m0": "delta", "m1": "delta"} and report.base == version - 1
                for sub in (first, late):
                    assert same(await sub.get(min_version=version, timeout=10), expected)
                trainer.step()
            buckets = [e for e in rec.snapshot() if e.member == "m1" and e.version == 4 and e.bucket >= 0]
            assert buckets and {(e.encoding, e.base) for e in buckets} == {("delta", 3)}
        finally:
            await first.aclose()
            if late is not None:
                await late.aclose()


@pytest.mark.asyncio
async def test_a_corrupted_delta_is_refused_and_the_member_gets_it_full() -> None:
    trainer = Trainer(1e-3, seed=2)
    async with ws.Publisher("corrupt-delta", **FAST) as pub:
        honest = ws.Subscriber(pub.name, address=pub.address, member_id="m0", timeout=5.0, transport="group")
        hit = ws.Subscriber(pub.name, address=pub.address, member_id="m1", timeout=5.0, transport="group")
        ws.testing.inject(hit, ws.testing.Faults(corrupt=[2]))  # the first wire byte of version 2's delta
        await asyncio.gather(honest.start(), hit.start())
        try:
            await pub.wait_subscribers(2, timeout=20)
            for version in range(4):
                report = await (await pub.put(trainer.master, version=version, dtype=torch.bfloat16))
                expected = trainer.bf16()
                assert set(report.members) == {"m0", "m1"}  # nobody was dropped for it
                for sub in (honest, hit):
                    assert same(await sub.get(min_version=version, timeout=10), expected)
                if version == 2:  # the delta did not apply at m1: the same version again, in full
                    assert report.encodings == {"m0": "full", "m1": "full"}
                elif version == 3:  # both acknowledged version 2 whole: deltas again
                    assert report.encodings == {"m0": "delta", "m1": "delta"}
                trainer.step()
            assert pub.statistics().delta_fallbacks == 1
            assert hit.statistics().checksum_failures == 1 and honest.statistics().checksum_failures == 0
            assert "m1" in pub.members and "m0" in pub.members
        finally:
            await asyncio.gather(honest.aclose(), hit.aclose())


@pytest.mark.asyncio
async def test_a_delta_moves_its_first_buckets_while_the_later_ones_are_encoded(monkeypatch: Any) -> None:
    """The encoder makes bucket i while the ones before it are on the wire and being decoded: here
    no bucket past the second may be encoded until a member decoded the first one. Were the whole
    version encoded before its Announce (it told every wire bucket's length), nothing would move
    and the encodes would give up waiting."""
    decoded, waited, at = threading.Event(), [], threading.local()
    encode, decode, segments = codec.encode, codec.decode, layout.segments

    def noting_segments(manifest: Any, lo: int, hi: int) -> Any:  # what the encoder asks right before a bucket
        at.lo = lo
        return segments(manifest, lo, hi)

    def gated_encode(*args: Any, **kwargs: Any) -> Any:
        if at.lo >= 2 * SMALL_BUCKETS:  # every bucket after the second (a member has two in flight)
            waited.append(decoded.wait(timeout=20))
        return encode(*args, **kwargs)

    def noting_decode(*args: Any, **kwargs: Any) -> None:
        decode(*args, **kwargs)
        decoded.set()

    trainer = Trainer(1e-3, seed=9)
    async with ws.Publisher("pipelined", encoding="delta", **{**FAST, "bucket_bytes": SMALL_BUCKETS}) as pub:
        async with one_member(pub) as sub:
            await (await pub.put(trainer.master, version=0, dtype=torch.bfloat16))
            trainer.step()
            monkeypatch.setattr(codec, "encode", gated_encode)
            monkeypatch.setattr(codec, "decode", noting_decode)
            monkeypatch.setattr(layout, "segments", noting_segments)
            report = await (await pub.put(trainer.master, version=1, dtype=torch.bfloat16))
            assert report.encodings == {"m0": "delta"}
            assert same(await sub.get(min_version=1, timeout=10), trainer.bf16())
            assert len(waited) >= 3 and all(waited)  # buckets 2.., each made once the first was decoded
            assert 0 < report.wire_bytes < report.nbytes  # the lengths told add up to what went


@pytest.mark.asyncio
async def test_an_encoder_that_fails_mid_version_fails_the_put_and_nobody_else(monkeypatch: Any) -> None:
    """Bucket 2's encode raises (a bug in the encoder, memory): the put fails with it, the members
    waiting for bucket 2's length hear the version was given up on, and the next version arrives."""
    encode, segments, calls, at = codec.encode, layout.segments, [], threading.local()

    def noting_segments(manifest: Any, lo: int, hi: int) -> Any:  # what the encoder asks right before a bucket
        at.lo = lo
        return segments(manifest, lo, hi)

    def failing_encode(*args: Any, **kwargs: Any) -> Any:
        calls.append(at.lo)
        if at.lo == 2 * SMALL_BUCKETS:
            raise MemoryError("the encoder ran out")
        return encode(*args, **kwargs)

    trainer = Trainer(1e-3, seed=10)
    async with ws.Publisher("encoder-bug", encoding="delta", **{**FAST, "bucket_bytes": SMALL_BUCKETS}) as pub:
        subs = await members(pub, ["group", "group"])
        try:
            await pub.wait_subscribers(2, timeout=20)
            await (await pub.put(trainer.master, version=0, dtype=torch.bfloat16))
            trainer.step()
            monkeypatch.setattr(codec, "encode", failing_encode)
            monkeypatch.setattr(layout, "segments", noting_segments)
            with pytest.raises(ws.WeightSyncError, match="the encoder ran out"):
                await (await pub.put(trainer.master, version=1, dtype=torch.bfloat16))
            assert 2 * SMALL_BUCKETS in calls
            monkeypatch.setattr(codec, "encode", encode)
            trainer.step()
            report = await (await pub.put(trainer.master, version=2, dtype=torch.bfloat16))
            assert set(report.members) == {"m0", "m1"} and set(pub.members) == {"m0", "m1"}
            for sub in subs:
                assert same(await sub.get(min_version=2, timeout=10), trainer.bf16())
                assert sub.statistics().checksum_failures == 0
        finally:
            await asyncio.gather(*(s.aclose() for s in subs))


def test_a_member_refuses_a_wire_bucket_told_longer_than_any_delta_of_it() -> None:
    from weightsync import _wire
    from weightsync.encodings.delta import DeltaDecoder

    items = [("w", torch.zeros(1000, dtype=torch.bfloat16))]
    manifest = layout.build_manifest(items)
    flat = _flat(items, manifest)
    announce = _wire.Announce(generation=1, seq=1, version=1, manifest=manifest, bucket_bytes=1 << 20, num_buckets=1,
                              coding=_wire.Coding(name="delta", later=True, base=0, base_digest=b"x"))
    most = codec.longest(layout.segments(manifest, 0, manifest.total_bytes))
    for told, fits in ((most, True), (most + 1, False), (-1, False), (1 << 40, False)):
        plan = DeltaDecoder().plan(announce, [flat], None, lambda _i, n=told: n)
        assert plan.before is not None
        if fits:
            plan.before(0)
            assert plan.wire[0].numel() == most
        else:
            with pytest.raises(ProtocolError, match="at most"):
                plan.before(0)


@pytest.mark.asyncio
async def test_a_base_whose_bytes_changed_on_the_member_is_caught_by_the_digest() -> None:
    """The member's copy of the base is altered (a stray write into its slot, a bit flip in memory):
    the delta rebuilds wrong bytes, the digests over them say so, and the member gets it full."""
    trainer = Trainer(1e-3, seed=4)
    async with ws.Publisher("bad-base", **FAST) as pub:
        async with one_member(pub) as sub:
            await (await pub.put(trainer.master, version=0, dtype=torch.bfloat16))
            await sub.get(min_version=0, timeout=10)
            slot = sub._slots.readable  # noqa: SLF001 - the fault: memory under the readable version
            assert slot.flat is not None
            slot.flat[100] ^= 0x01
            trainer.step()
            report = await (await pub.put(trainer.master, version=1, dtype=torch.bfloat16))
            assert report.encodings == {"m0": "full"}
            assert same(await sub.get(min_version=1, timeout=10), trainer.bf16())
            assert sub.statistics().checksum_failures == 1 and pub.statistics().delta_fallbacks == 1


@pytest.mark.asyncio
async def test_put_can_force_full_and_a_full_publisher_refuses_delta_puts() -> None:
    trainer = Trainer(1e-3, seed=5)
    async with ws.Publisher("per-put", **FAST) as pub:
        async with one_member(pub) as sub:
            await (await pub.put(trainer.master, version=0, dtype=torch.bfloat16))
            trainer.step()
            report = await (await pub.put(trainer.master, version=1, dtype=torch.bfloat16, encoding="full"))
            assert report.encodings == {"m0": "full"}
            trainer.step()
            report = await (await pub.put(trainer.master, version=2, dtype=torch.bfloat16, encoding="delta"))
            assert report.encodings == {"m0": "delta"} and report.base == 1
            assert same(await sub.get(min_version=2, timeout=10), trainer.bf16())
            with pytest.raises(ValueError, match="neither built in"):
                await pub.put(trainer.master, encoding="gzip")
    async with ws.Publisher("full-only", encoding="full", **FAST) as pub:
        with pytest.raises(ValueError, match="keeps no base"):
            await pub.put(trainer.master, encoding="delta")


@pytest.mark.asyncio
async def test_checksums_off_or_copy_false_send_full() -> None:
    trainer = Trainer(1e-3, seed=6)
    async with ws.Publisher("no-proof", checksum=False, **FAST) as pub:
        async with one_member(pub) as sub:
            for version in range(3):  # nothing would prove a reconstruction: every version full
                report = await (await pub.put(trainer.master, version=version, dtype=torch.bfloat16))
                assert report.encodings == {"m0": "full"}
                assert same(await sub.get(min_version=version, timeout=10), trainer.bf16())
                trainer.step()
    async with ws.Publisher("borrowed", **FAST) as pub:
        async with one_member(pub) as sub:
            for version in range(3):  # copy=False under "auto" keeps no copy of what it sent: full
                sd = trainer.bf16()
                handle = await pub.put(sd, version=version, copy=False)
                report = await handle
                assert report.encodings == {"m0": "full"}
                assert same(await sub.get(min_version=version, timeout=10), sd)
                trainer.step()


@pytest.mark.asyncio
async def test_copy_false_deltas_go_against_a_kept_copy_that_also_serves_a_full_resend() -> None:
    """``put(copy=False, encoding="delta")``: the publisher keeps a copy of what it sent as the base.
    A newcomer gets full, then deltas; a delta that does not apply is re-sent in full from that copy
    after the caller took its tensors back and changed them (they cannot be read again). The copy
    lasts until a put with a snapshot."""
    trainer = Trainer(1e-3, seed=9)
    rec = ws.FlightRecorder()
    async with ws.Publisher("borrowed-delta", recorder=rec, **FAST) as pub:
        first = ws.Subscriber(pub.name, address=pub.address, member_id="m0", timeout=5.0, transport="group")
        late = ws.Subscriber(pub.name, address=pub.address, member_id="m1", timeout=5.0, transport="group")
        ws.testing.inject(late, ws.testing.Faults(corrupt=[3]))  # the first wire byte of version 3's delta
        await first.start()
        try:
            await pub.wait_subscribers(1, timeout=20)
            for version in range(6):
                if version == 2:
                    await late.start()
                    await pub.wait_subscribers(2, timeout=20)
                sd = trainer.bf16()
                expected = {k: v.clone() for k, v in sd.items()}
                handle = await pub.put(sd, version=version, copy=False, encoding="delta")
                await handle.released(timeout=10)
                for value in sd.values():  # the caller's again: changed before the version is delivered
                    value.zero_()
                report = await handle
                subs = (first,) if version < 2 else (first, late)
                assert set(report.members) == {s.member_id for s in subs}  # nobody missed a version
                for sub in subs:
                    assert same(await sub.get(min_version=version, timeout=10), expected)
                if version in (0, 2):  # nothing kept yet; then a newcomer without the base: full
                    assert set(report.encodings.values()) == {"full"}
                elif version == 3:  # m1's delta did not apply: the same version in full, from the kept copy
                    assert report.encodings == {"m0": "full", "m1": "full"}
                else:
                    assert set(report.encodings.values()) == {"delta"} and report.base == version - 1
                    assert report.wire_bytes < report.nbytes * len(subs) / 4
                trainer.step()
            assert pub.statistics().delta_fallbacks == 1 and late.statistics().checksum_failures == 1
            assert {e.base for e in rec.snapshot() if e.version == 5 and e.encoding == "delta"} == {4}
            # the copy stays once asked for: a full copy=False put refreshes it, an "auto" one goes as a
            # delta against it; a put with a snapshot drops it, and copy=False under "auto" is full again
            for version, (copy, encoding, got) in enumerate([(False, "full", "full"), (False, None, "delta"),
                                                             (True, None, "full"), (False, None, "full")], start=6):
                sd = trainer.bf16()
                report = await (await pub.put(sd, version=version, copy=copy, encoding=encoding))
                assert set(report.encodings.values()) == {got}, (version, report.encodings)
                for sub in (first, late):
                    assert same(await sub.get(min_version=version, timeout=10), sd)
                trainer.step()
        finally:
            await asyncio.gather(first.aclose(), late.aclose())


def test_auto_takes_whichever_reached_the_group_faster_and_looks_again() -> None:
    from weightsync.encodings.delta import COSTED_FROM, EXPLORE, Chooser

    chooser = Chooser()
    assert not chooser.prefer_full()  # nothing measured: a delta is tried
    chooser.note(False, COSTED_FROM, 1.0)  # a full version: 1 s
    chooser.note(True, COSTED_FROM // 2, 50.0)  # too small to say anything
    assert not chooser.prefer_full()
    chooser.note(True, COSTED_FROM, 30.0)  # the first delta started things up: not counted
    assert not chooser.prefer_full()
    chooser.note(True, COSTED_FROM, 3.0)  # deltas cost three times as much (a fast wire on one host)
    choices = [chooser.prefer_full() for _ in range(2 * EXPLORE)]
    assert choices.count(True) == 2 * EXPLORE - 2  # full, but for one delta in every EXPLORE choices
    for _ in range(6):  # the link got slow: full versions now take ten times as long
        chooser.note(False, COSTED_FROM, 10.0)
    assert not chooser.prefer_full() and chooser.cost[False] > chooser.cost[True]


@pytest.mark.asyncio
async def test_an_engine_can_be_handed_only_what_changed_since_the_version_it_holds() -> None:
    trainer = Trainer(1e-3, seed=8)
    async with ws.Publisher("changes", **FAST) as pub:
        async with one_member(pub) as sub:
            await (await pub.put(trainer.master, version=0, dtype=torch.bfloat16))
            engine = {k: v.clone() for k, v in (await sub.get(min_version=0, timeout=10)).items()}
            trainer.step()
            await (await pub.put(trainer.master, version=1, dtype=torch.bfloat16))
            expected = trainer.bf16()
            async with sub.stream(min_version=1, timeout=10, since=0) as weights:
                assert weights.since == 0
                changes = weights.changes()
                # exactly the elements whose bits moved, with their new values; what did not move is absent
                moved = {k for k in expected if not torch.equal(expected[k].view(-1).view(torch.uint8),
                                                                 engine[k].view(-1).view(torch.uint8))}
                assert {c.name for c in changes} == moved and "steps" in moved
                for change in changes:
                    flat = engine[change.name].view(-1)
                    if change.indices is None:  # the int64 step counter: whole
                        flat.copy_(change.values)
                    else:
                        assert 0 < change.indices.numel() < flat.numel()
                        flat[change.indices] = change.values
            assert same(engine, expected)
            # load(since=) hands the loader only the changed tensors, whole
            trainer.master["norm"].fill_(1.0)  # one tensor that does not move in this step
            expected = trainer.bf16()
            await (await pub.put(trainer.master, version=2, dtype=torch.bfloat16))
            trainer.step()
            trainer.master["norm"].fill_(1.0)
            now = trainer.bf16()
            await (await pub.put(trainer.master, version=3, dtype=torch.bfloat16))
            handed: list[str] = []
            assert await sub.load(lambda pairs: handed.extend(n for n, _ in pairs), min_version=3, since=2) == 3
            moved = {k for k in now if not torch.equal(now[k].view(-1).view(torch.uint8),
                                                       expected[k].view(-1).view(torch.uint8))}
            assert set(handed) == moved and "norm" not in moved and "steps" in moved
            # a version this subscriber no longer holds: every tensor, and changes() says it cannot
            everything: list[str] = []
            await sub.load(lambda pairs: everything.extend(n for n, _ in pairs), min_version=3, since=0)
            assert sorted(everything) == sorted(now)
            async with sub.stream(min_version=3, timeout=10, since=0) as weights:
                assert weights.since is None
                with pytest.raises(RuntimeError, match="since"):
                    weights.changes()
