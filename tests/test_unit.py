"""Tier 1: pure unit tests, no processes, no groups."""

from __future__ import annotations

import asyncio
import functools
import socket
import subprocess
import sys
import threading
import time

import msgspec
import pytest
import torch
import torch.distributed as dist

import weightsync as ws
from tests.statedicts import digests, mixed_state_dict
from weightsync import _wire
from weightsync.engine.staging import Job, Staging
from weightsync.format import checksum as checksums
from weightsync.format import layout
from weightsync.format.checksum import KINDS, STRIPES
from weightsync.options import ChannelOptions, parse_address


def test_public_names_are_pinned() -> None:
    assert sorted(ws.__all__) == sorted([
        "AdmissionDenied", "Closed", "DeliveryReport", "EngineMismatch", "Evicted", "FlightRecorder",
        "HandshakeMismatch",
        "LocalProcessOrchestrator", "ManifestMismatch", "MemberInfo", "Orchestrator", "Publisher", "PublisherGone",
        "PutHandle", "RankMismatch", "StragglerPolicy", "Subscriber", "SyncTimeout", "TransportUnavailable",
        "BlockingPublisher", "BlockingSubscriber", "MemberStatistics", "NotDelivered", "PublisherStatistics",
        "SubscriberStatistics", "Superseded",
        "WeightStream", "Weights", "WeightSyncError", "__version__", "connect_store", "quantization_config",
        "quantize", "Adapter", "AdapterPublisher", "AdapterSubscriber", "AdapterVersion", "BlockingAdapterPublisher",
        "from_peft", "merge_adapter"])
    for name in ws.__all__:
        assert hasattr(ws, name)


def test_exception_tree() -> None:
    for cls in (ws.SyncTimeout, ws.ManifestMismatch, ws.Closed, ws.PublisherGone, ws.Evicted,
                ws.AdmissionDenied, ws.HandshakeMismatch):
        assert issubclass(cls, ws.WeightSyncError)
    assert issubclass(ws.SyncTimeout, TimeoutError)
    err = ws.Evicted("gone", channel="policy", generation=3, member="g1", version=7)
    assert (err.channel, err.generation, err.member, err.version) == ("policy", 3, "g1", 7)
    assert "generation=3" in str(err)


def test_import_has_no_side_effects() -> None:
    code = ("import os, asyncio; env = dict(os.environ); import weightsync, torch; "
            "assert dict(os.environ) == env, 'environment changed'; "
            "assert type(asyncio.get_event_loop_policy()).__module__.startswith('asyncio'); "
            "assert not torch.cuda.is_initialized(); "
            "import sys; assert 'cupy' not in sys.modules; "
            "assert not any(m.startswith(('vllm', 'weightsync.integrations')) for m in sys.modules); "
            # the vLLM plug-in's entry module imports without vLLM; only its engines need it
            "import weightsync.integrations.vllm; assert 'vllm' not in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_loop_thread_bounds_every_call_and_stops() -> None:
    from weightsync.transport.loopthread import LoopThread

    bridge = LoopThread("test-bridge")
    assert bridge.run(asyncio.sleep(0, result=7), 5.0, "a quick call") == 7
    cancelled = threading.Event()

    async def forever() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()

    with pytest.raises(ws.SyncTimeout, match="waiting forever did not finish within 0.2s"):
        bridge.run(forever(), 0.2, "waiting forever")
    assert cancelled.wait(5.0), "the timed-out coroutine was left running"
    with pytest.raises(ZeroDivisionError):  # the coroutine's own error reaches the caller
        bridge.run(asyncio.to_thread(lambda: 1 / 0), 5.0, "dividing")
    bridge.close()
    assert not bridge.alive
    with pytest.raises(RuntimeError, match="loop thread has stopped"):
        bridge.run(asyncio.sleep(0), 1.0, "after close")


def test_layout_round_trips_every_dtype_bit_exact() -> None:
    sd = mixed_state_dict(3, mib=0.5)
    items = layout.as_items(sd)
    manifest = layout.build_manifest(items)
    assert all(spec.offset % layout.ALIGN == 0 for spec in manifest.tensors)
    flat = torch.empty(manifest.total_bytes, dtype=torch.uint8)
    layout.pack_into(flat, manifest, items)
    assert digests(layout.views(flat, manifest)) == digests(sd)
    # the bucket-at-a-time path (copy=False) produces the same bytes
    out = torch.empty_like(flat)
    buf = torch.empty(4096, dtype=torch.uint8)
    for lo, hi in layout.bucket_ranges(manifest.total_bytes, 4096):
        layout.pack_range(buf, lo, hi, manifest, items)
        out[lo:hi] = buf[: hi - lo]
    assert digests(layout.views(out, manifest)) == digests(sd)


def test_bucket_ranges_cover_exactly() -> None:
    ranges = layout.bucket_ranges(10_000, 4096)
    assert ranges == [(0, 4096), (4096, 8192), (8192, 10_000)]
    assert layout.bucket_ranges(0, 4096) == []
    with pytest.raises(ValueError, match="bucket_bytes"):
        layout.bucket_ranges(10, 0)


def test_as_items_rejects_bad_input() -> None:
    with pytest.raises(TypeError, match="not a torch.Tensor"):
        layout.as_items({"a": [1, 2]})
    with pytest.raises(TypeError, match="names must be str"):
        layout.as_items([(1, torch.zeros(1))])
    with pytest.raises(ValueError, match="duplicate"):
        layout.as_items([("a", torch.zeros(1)), ("a", torch.zeros(1))])
    assert [n for n, _ in layout.as_items(iter([("b", torch.zeros(1)), ("a", torch.zeros(2))]))] == ["b", "a"]


def test_check_destination_names_every_problem() -> None:
    sd = {"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16)}
    manifest = layout.build_manifest(layout.as_items(sd))
    layout.check_destination(manifest, {"a": torch.ones(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)})
    with pytest.raises(ws.ManifestMismatch, match="shape"):
        layout.check_destination(manifest, {"a": torch.ones(3, 2), "b": torch.ones(4, dtype=torch.bfloat16)})
    with pytest.raises(ws.ManifestMismatch, match="dtype"):
        layout.check_destination(manifest, {"a": torch.ones(2, 3), "b": torch.ones(4)})
    with pytest.raises(ws.ManifestMismatch, match="missing"):
        layout.check_destination(manifest, {"a": torch.ones(2, 3)})


def test_staging_latest_wins_in_two_buffers() -> None:
    staging = Staging(2)

    class FakeHandle:
        pass

    def job(v: int, buf: torch.Tensor) -> Job:
        return Job(version=v, manifest=_wire.Manifest(tensors=(), total_bytes=64), handle=FakeHandle(), flat=buf)  # type: ignore[arg-type]

    superseded = []
    cpu = torch.device("cpu")
    for v in range(20):
        buf, displaced = staging.acquire(64, cpu, pin=False)
        if displaced is not None:
            superseded.append(displaced.version)
        staging.commit(job(v, buf))
        if v % 5 == 0:  # the sender occasionally takes one and later finishes it
            taken = staging.take()
            assert taken is not None and taken.version == v
            staging.finish(taken)
        assert staging.buffers_in_use() <= 2
    assert staging.peak_buffers <= 2
    assert superseded and superseded == sorted(superseded)
    assert staging.pending is not None and staging.pending.version == 19


def test_a_snapshot_after_copy_false_puts_finds_both_buffers_again() -> None:
    """copy=False versions pin no snapshot buffer. Staging kept one spare only, so once such a
    version was sent the second buffer was gone and a put after the next one made a fresh one:
    400 ms of page faults in that put at 496 MiB (benchmarks.push_vs_broadcast, modes
    interleaved, 2026-12-04). Both stay, and never more than ``max_snapshots`` exist."""
    allocated: list[int] = []
    staging = Staging(2, allocate=lambda n, d, p: allocated.append(n) or torch.empty(n, dtype=torch.uint8))

    class FakeHandle:
        pass

    def job(v: int, buf: torch.Tensor | None) -> Job:
        return Job(version=v, manifest=_wire.Manifest(tensors=(), total_bytes=64), handle=FakeHandle(), flat=buf)  # type: ignore[arg-type]

    def send(v: int, copy: bool) -> torch.Tensor | None:
        buf = staging.acquire(64, torch.device("cpu"), pin=False)[0] if copy else None
        staging.commit(job(v, buf))
        taken = staging.take()
        assert taken is not None and taken.version == v
        staging.finish(taken)
        assert staging.buffers_in_use() <= 2
        return buf

    first, second = send(0, True), send(1, True)
    assert len(allocated) == 2
    send(2, False)
    send(3, False)
    assert {id(b) for b in (send(4, True), send(5, True), send(6, True))} <= {id(first), id(second)}
    assert len(allocated) == 2  # no put after the copy=False ones made a buffer
    staging.acquire(128, torch.device("cpu"), pin=False)  # a larger version: the small ones go
    assert len(allocated) == 3 and staging.buffers_in_use() <= 2
    assert staging.peak_buffers <= 2


def test_options_are_validated() -> None:
    with pytest.raises(ValueError, match="timeout"):
        ChannelOptions(timeout=0)
    with pytest.raises(ValueError, match="bucket_bytes"):
        ChannelOptions(bucket_bytes=10)
    with pytest.raises(ValueError, match="host:port"):
        parse_address("localhost")
    with pytest.raises(ValueError, match="port"):
        parse_address("localhost:99999")
    assert parse_address("[::1]:0") == ("::1", 0)
    with pytest.raises(ValueError, match="backend"):
        ws.Publisher("p", backend="mpi")
    for bad in ("a/b", "", "gen0\nevicted", "x\x1b[2J", "a b", "-a", "x" * 257, 7):
        with pytest.raises(ValueError, match="letters, digits"):
            ws.Publisher(bad)  # type: ignore[arg-type]
        if bad != "":  # a Subscriber without a member id makes one
            with pytest.raises(ValueError, match="letters, digits"):
                ws.Subscriber("p", address="127.0.0.1:1", member_id=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="port 0"):
        ws.Subscriber("p", address="127.0.0.1:0")


def test_wire_messages_decode_strictly() -> None:
    manifest = _wire.Manifest(tensors=(), total_bytes=0)
    ann = _wire.Announce(generation=1, seq=0, version=3, manifest=manifest, bucket_bytes=4096, num_buckets=0)
    assert _wire.server_decoder.decode(_wire.encode(ann)) == ann
    with pytest.raises(msgspec.DecodeError):
        _wire.server_decoder.decode(b"\x80\x03cos\nsystem\n")  # a pickle is just garbage here
    with pytest.raises(msgspec.ValidationError):
        _wire.client_decoder.decode(_wire.encode({"type": "join", "member_id": 5}))
    with pytest.raises(msgspec.ValidationError):  # a server-only command is not something a client may send
        _wire.client_decoder.decode(_wire.encode(ann))


def test_fingerprint_comparison_on_nccl_names_every_field() -> None:
    from weightsync._wire import Fingerprint
    from weightsync.control.auth import compare

    a = Fingerprint(protocol=1, torch="2.15.0", nccl="2.28.9", backend="nccl", device_kind="H200",
                    nccl_env={"NCCL_PROTO": "Simple"})
    b = msgspec.structs.replace(a, torch="2.13.0", nccl_env={})
    diffs = compare(a, b)
    assert any("torch" in d for d in diffs) and any("nccl_env" in d for d in diffs)
    gloo = msgspec.structs.replace(a, backend="gloo")
    assert compare(gloo, msgspec.structs.replace(gloo, torch="2.13.0")) == []  # gloo talks across versions


def test_admission_names_each_reason_to_refuse() -> None:
    from weightsync._wire import Join, Want
    from weightsync.control.auth import admission_problem, fingerprint, join_proof, new_nonce

    mine = fingerprint("gloo", torch.device("cpu"))
    server, client = new_nonce(), new_nonce()
    proof = join_proof(b"s", channel="c", server_nonce=server, client_nonce=client, member_id="g0", fp=mine)
    good = Join(member_id="g0", fingerprint=mine, nonce=client, proof=proof)

    def problem(join: Join, **kw: object):
        args = {"channel": "c", "server_nonce": server, "secret": b"s", "mine": mine, "closing": False, **kw}
        return admission_problem(join, **args)  # type: ignore[arg-type]

    assert problem(good) is None
    assert problem(good, closing=True).kind == "closed"
    assert problem(good, server_nonce=new_nonce()).kind == "token"  # a replayed Join: another challenge
    assert problem(msgspec.structs.replace(good, member_id="g1")).kind == "token"  # the proof binds the id
    assert problem(msgspec.structs.replace(good, proof=b"0" * 32)).kind == "token"
    assert problem(msgspec.structs.replace(good, proof=b""), secret=None) is None  # an open channel
    assert problem(msgspec.structs.replace(good, member_id="a/b"), secret=None).kind == "token"
    alien = msgspec.structs.replace(mine, backend="nccl")
    assert problem(Join(member_id="g0", fingerprint=alien, nonce=client, proof=join_proof(
        b"s", channel="c", server_nonce=server, client_nonce=client, member_id="g0", fp=alien))).kind == "handshake"

    def joined(**kw: object) -> Join:  # a Join whose proof covers everything it asks for
        fields: dict = {"member_id": "g0", "fingerprint": mine, "nonce": client, **kw}
        return Join(proof=join_proof(b"s", channel="c", server_nonce=server, client_nonce=client, member_id="g0",
                                     fp=mine, transport=fields.get("transport", "group"), want=fields.get("want")),
                    **fields)

    same_host = joined(transport="shm")
    assert problem(same_host).kind == "handshake"  # a publisher that offered no shared memory
    assert problem(same_host, transports=("group", "shm")) is None
    assert problem(msgspec.structs.replace(good, transport="shm"), transports=("group", "shm")).kind == "token"
    assert "telepathy" in problem(joined(transport="telepathy"), transports=("group", "shm")).reason
    sliced = joined(want=(Want("w", (0,), (2,)),))
    assert problem(sliced) is None
    # the proof covers a sliced member's boxes: nobody on the path can widen or change them
    assert problem(msgspec.structs.replace(sliced, want=(Want("w", (0,), (4,)),))).kind == "token"
    assert problem(msgspec.structs.replace(sliced, want=None)).kind == "token"


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_checksum_catches_flips_and_swaps_and_ignores_alignment(kind: str) -> None:
    data = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8)
    checksum = functools.partial(checksums.checksum, kind=kind)
    base = checksum(data)
    flipped = data.clone()
    flipped[4097] ^= 1
    words = data.clone().view(torch.int64)
    stripe = words.numel() // STRIPES
    for i, j in ((0, 1), (0, stripe), (5, 5 + 3 * stripe + 1)):  # adjacent, across stripes, far apart
        swapped = words.clone()
        swapped[i], swapped[j] = words[j].item(), words[i].item()
        assert words[i] != words[j] and checksum(swapped.view(torch.uint8)) != base
    assert checksum(flipped) != base
    assert checksum(data[:-3]) != checksum(data[:-4])  # the tail counts
    assert checksum(data[3:1003]) == checksum(data[3:1003].clone())  # unaligned slices agree
    assert checksum(data[:0]) == checksum(torch.empty(0, dtype=torch.uint8))
    with pytest.raises(ValueError, match="flat contiguous uint8"):
        checksum(data.view(torch.int64))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_running_digest_over_pieces_is_the_bucket_digest(kind: str) -> None:
    data = torch.randint(0, 256, (3 * 4096 + 17,), dtype=torch.uint8)
    for cut in (1, 7, 4096, 5000):
        running = checksums.Running(kind)
        for lo in range(0, data.numel(), cut):
            running.update(data[lo:lo + cut])
        assert running.value() == checksums.checksum(data, kind)
    empty = checksums.Running(kind)
    empty.update(data[:0])
    assert empty.value() == checksums.checksum(data[:0], kind)
    with pytest.raises(ValueError, match="uint8 host bytes"):
        checksums.Running(kind).update(data.view(torch.int8))
    with pytest.raises(ValueError, match="unknown digest"):
        checksums.Running("md5")


def test_get_into_as_received_digests_and_writes_each_piece_in_one_read(monkeypatch: pytest.MonkeyPatch) -> None:
    from weightsync.engine import into

    monkeypatch.setattr(into, "PIECE", 1000)  # pieces smaller than a bucket, buckets smaller than a tensor
    src = {"a": torch.arange(3000, dtype=torch.float32), "b": torch.arange(600, dtype=torch.bfloat16).view(20, 30),
           "c": torch.arange(1500, dtype=torch.float32).view(30, 50), "d": torch.ones(3, dtype=torch.float64)}
    manifest = layout.build_manifest(layout.as_items(src))
    flat = torch.empty(manifest.total_bytes, dtype=torch.uint8)
    layout.pack_into(flat, manifest, layout.as_items(src))
    dest = {"a": torch.nn.Parameter(torch.zeros(3000)), "b": torch.zeros(20, 30, dtype=torch.bfloat16),
            "c": torch.zeros(50, 30).t(), "d": torch.zeros(3, dtype=torch.float64)}  # c: not contiguous
    versions = {name: t._version for name, t in dest.items()}
    target = into.IntoDest(dest, None)
    writer = target.writer(7, manifest, flat)
    assert writer is not None
    spec = layout.spec_map(manifest)
    for lo, hi in layout.bucket_ranges(manifest.total_bytes, 5000):
        assert writer.digest_and_write(lo, hi, "xxh3") == checksums.checksum(flat[lo:hi], "xxh3")
        # a plain tensor has every byte below hi; one that is not, only once it lies wholly below
        for name in ("a", "b"):
            got = spec[name].offset
            n = max(0, min(hi - got, spec[name].nbytes))
            assert torch.equal(dest[name].detach().reshape(-1).view(torch.uint8)[:n],
                               flat[got:got + n]), (name, lo, hi)
        whole = spec["c"].offset + spec["c"].nbytes <= hi
        assert torch.equal(dest["c"], src["c"]) is whole
    assert writer.finish() and target.done == 7
    assert all(torch.equal(dest[name].detach(), t) for name, t in src.items())
    # torch's in-place counter moved once per tensor, as the copy_ each write stands for moves it
    assert {name: t._version - versions[name] for name, t in dest.items()} == dict.fromkeys(dest, 1)


def test_the_digest_is_chosen_by_measurement_named_pinned_or_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    data = torch.randint(0, 256, (1 << 12,), dtype=torch.uint8)
    assert checksums.checksum(data, "crc32c") != checksums.checksum(data, "xxh3")  # the name decides
    measured = checksums.rates(1 << 20, reps=1)
    assert set(measured) == set(KINDS) and all(rate > 0 for rate in measured.values())
    try:
        checksums.choose.cache_clear()
        monkeypatch.delenv(checksums.ENV, raising=False)
        assert checksums.resolve("auto") in KINDS
        for kind in KINDS:  # pinned by the environment, or by name
            checksums.choose.cache_clear()
            monkeypatch.setenv(checksums.ENV, kind)
            assert checksums.resolve("auto") == kind and checksums.resolve(kind) == kind
        checksums.choose.cache_clear()
        monkeypatch.setenv(checksums.ENV, "md5")
        with pytest.raises(ValueError, match="WEIGHTSYNC_DIGEST='md5'"):
            checksums.choose()
    finally:
        checksums.choose.cache_clear()
    with pytest.raises(ValueError, match="digest must be 'auto' or one of"):
        checksums.resolve("sha1")
    with pytest.raises(ValueError, match="unknown digest 'sha1'"):
        checksums.checksum(data, "sha1")


def test_connect_store_reaches_an_applications_store_and_gives_up_on_a_silent_listener() -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = ws.connect_store(f"127.0.0.1:{server.port}", timeout=5.0)
    client.set("flag", b"stop")
    assert server.get("flag") == b"stop" and client.check(["flag"])
    client.queue_push("rollouts", b"r1")
    assert server.queue_pop("rollouts") == b"r1"
    with pytest.raises(ValueError, match="port 0"):
        ws.connect_store("127.0.0.1:0")
    silent = socket.socket()  # accepts connections (the kernel's backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    try:
        t0 = time.monotonic()
        with pytest.raises((RuntimeError, dist.DistError)):
            ws.connect_store(f"127.0.0.1:{silent.getsockname()[1]}", timeout=0.5)
        assert time.monotonic() - t0 < 30  # a few probes of about a second each, not forever
    finally:
        silent.close()  # the constructors given up on wake up (connection reset) and end
    stuck = [t for t in threading.enumerate() if t.name == "ws-store-connect"]
    for thread in stuck:
        thread.join(10)
    assert not any(t.is_alive() for t in stuck)


def test_bench_verdict_and_its_refusals() -> None:
    """`weightsync bench`'s one-line verdict reads the rows it was given (an altered version turns
    it into a failure), and bad options are refused before any rank starts."""
    from weightsync.bench.model import make_state_dict, nbytes
    from weightsync.bench.run import Row, add_ratios, main, verdict

    def row(mode: str, stall: float, to_all: float, exact: bool = True) -> Row:
        return Row(mode=mode, mib=240.0, subscribers=2, stall_ms=stall, to_all_ms=to_all, gbps=1.0, exact=exact)

    rows = [row("naive", 900, 950), row("packed", 800, 1000), row("put", 80, 1100), row("put_nocopy", 4, 1050)]
    add_ratios(rows)
    line, ok = verdict(rows)
    assert ok and "put stalls the trainer 0.100x" in line and "copy=False 0.005x" in line and "1.10x" in line
    rows[2].exact = False
    line, ok = verdict(rows)
    assert not ok and "ALTERED" in line
    assert verdict(rows[:1]) == ("verdict: incomplete run", False)
    for bad in (["--sizes", "a,b"], ["--subscribers", "0"], ["--reps", "0"]):
        with pytest.raises(SystemExit) as exc:
            main(bad)
        assert exc.value.code == 2
    # seeded: every rank builds the same bytes; sizes below 64 MiB come out near what was asked
    a, b = make_state_dict(8, seed=3), make_state_dict(8, seed=3)
    assert all(torch.equal(a[k], b[k]) for k in a) and 7.5 < nbytes(a) / 2**20 < 8.5


def test_a_teardown_that_never_ends_is_left_behind_and_the_teardowns_after_it_go_on() -> None:
    """On torch 2.13 a retired gloo backend whose receive waits on a pair its peer never connected
    never finishes its destructor (seen in tests/test_inprocess.py's packing-error test: its close
    took 30 s, the drains' bounds, one run in three). One such teardown must not hold back the
    next, a close's drain, or a fork (``TEARDOWN``)."""
    from weightsync.planes.group.reaper import TEARDOWN, Reaper

    release = threading.Event()
    torn: list[str] = []

    class Backend:
        def __init__(self, name: str, hangs: bool) -> None:
            self.name, self.hangs = name, hangs

        def abort(self) -> None:
            torn.append(self.name)

        def __del__(self) -> None:  # the destructor that waits on the receive
            if self.hangs:
                release.wait(60)

    reaper = Reaper()
    reaper.STUCK = 0.5
    rec = ws.FlightRecorder(capacity=100)
    hung = rec.record("abort", channel="c", member="m", generation=1).start()
    after = rec.record("abort", channel="c", member="m", generation=2).start()
    reaper.retire([Backend("hung", True), None, []], hung)  # the handoff holds the only reference
    reaper.retire([Backend("after", False), None, []], after)
    try:
        assert reaper.drain(30)
        assert torn == ["hung", "after"] and reaper.stuck == 1
        assert after.state == "completed"
        assert hung.state == "failed" and "left on its own thread" in hung.error
        assert TEARDOWN.acquire(timeout=5)
        TEARDOWN.release()
    finally:
        release.set()


def test_a_teardown_is_done_only_once_the_hung_works_it_was_handed_are_gone() -> None:
    """A group hands the reaper ``[backend, store, hung works]``; a hung work's destructor waits on
    its frozen peer. A close's drain must wait for it: an interpreter that exits while it runs
    ends the process ("terminate called without an active exception", seen in CI on 2.13 when
    the teardown's loop variable held the works past its ``done``)."""
    from weightsync.planes.group.reaper import Reaper

    release, gone = threading.Event(), threading.Event()

    class Backend:
        def abort(self) -> None:
            pass

    class HungWork:
        def __del__(self) -> None:  # the destructor that waits on the frozen peer
            release.wait(60)
            gone.set()

    reaper = Reaper()
    reaper.STUCK = 60.0
    entry = ws.FlightRecorder(capacity=100).record("abort", channel="c", member="m", generation=1).start()
    reaper.retire([Backend(), None, [HungWork()]], entry)  # the handoff holds the only references
    try:
        assert not reaper.drain(0.5) and entry.state != "completed"  # still tearing down
    finally:
        release.set()
    assert reaper.drain(30) and gone.is_set() and entry.state == "completed"


def test_a_snapshot_on_several_threads_writes_the_bytes_torch_writes() -> None:
    """The publisher's host snapshot hands plain copies to threads that memmove byte-equal runs
    (a tensor may be cut between two); strided, cast and empty sources stay with torch."""
    from weightsync.engine.snapshots import Copier

    gen = torch.Generator().manual_seed(7)
    items = [("a", torch.randn(300, 257, generator=gen)),                       # plain, cut between runs
             ("b", torch.randn(64, 96, generator=gen).t()),                     # strided: torch's copy
             ("c", torch.randn(1000, generator=gen).to(torch.bfloat16)),       # plain, another dtype
             ("d", torch.empty(0)),                                             # nothing to copy
             ("e", torch.randn(513, 7, generator=gen)),                         # cast by put(dtype=)
             ("f", torch.arange(77_777, dtype=torch.int64))]
    untied, manifest = layout.untied_manifest(items, {"e": torch.float16})
    expected = torch.zeros(manifest.total_bytes, dtype=torch.uint8)
    layout.pack_into(expected, manifest, untied)
    handed: list[list[tuple[int, int, int]]] = []
    for threads in (1, 2, 3):
        copier = Copier(threads, "ws-test-copy")
        try:
            flat = torch.zeros(manifest.total_bytes, dtype=torch.uint8)
            layout.pack_into(flat, manifest, untied,
                             lambda ranges, c=copier: (handed.append(ranges), c.copy(ranges))[1])
        finally:
            copier.close()
        for spec in manifest.tensors:  # padding between tensors is nobody's: compare the tensors' bytes
            lo, hi = spec.offset, spec.offset + spec.nbytes
            assert torch.equal(flat[lo:hi], expected[lo:hi]), (threads, spec.name)
    assert sorted(n for _, _, n in handed[0]) == sorted(
        s.nbytes for s in manifest.tensors if s.name in ("a", "c", "f"))  # only the plain ones
    closed = Copier(2, "ws-test-copy")
    closed.close()  # a publisher closing while a put is taken: the snapshot is still whole
    flat = torch.zeros(manifest.total_bytes, dtype=torch.uint8)
    layout.pack_into(flat, manifest, untied, closed.copy)
    assert all(torch.equal(flat[s.offset:s.offset + s.nbytes], expected[s.offset:s.offset + s.nbytes])
               for s in manifest.tensors)
    runs = layout.split_ranges(handed[0], 3)
    sizes = [sum(n for _, _, n in run) for run in runs]
    assert len(runs) == 3 and max(sizes) - min(sizes) <= 2 and sum(sizes) == sum(n for _, _, n in handed[0])
    assert [(d, s) for run in runs for d, s, _ in run][0] == handed[0][0][:2]


def test_a_snapshot_still_refuses_a_tensor_freed_since_put_before_copying_anything() -> None:
    items = [("a", torch.ones(1024)), ("b", torch.ones(1024))]
    untied, manifest = layout.untied_manifest(items)
    copied: list[object] = []
    items[1][1].untyped_storage().resize_(0)  # a copy=False tensor the caller freed
    with pytest.raises(ValueError, match="'b' changed since it was put"):
        layout.pack_into(torch.empty(manifest.total_bytes, dtype=torch.uint8), manifest, untied, copied.append)
    assert copied == []  # no range of a tensor checked before it was handed to the threads either


def test_a_pipelined_snapshot_of_nothing_is_complete_at_once() -> None:
    """A sharded rank with nothing of its own to send (an HSDP replica) puts an empty version; the
    pipelined snapshot (the default on 4 CPUs or more) failed it ("zip() argument 3 is longer")."""
    from weightsync.engine.staging import Progress, pack_progressively

    marks: list[int] = []
    manifest = layout.build_manifest([])
    progress = Progress(manifest.total_bytes, marks.append)
    pack_progressively(torch.empty(0, dtype=torch.uint8), manifest, [], progress)
    progress.wait(manifest.total_bytes, 1.0)  # raises where the snapshot failed or never got there
    assert progress.error is None and marks == [0]
    items = [("a", torch.arange(6, dtype=torch.float32)), ("b", torch.ones(3, dtype=torch.bfloat16))]
    manifest = layout.build_manifest(items)
    flat = torch.empty(manifest.total_bytes, dtype=torch.uint8)
    marks.clear()
    pack_progressively(flat, manifest, items, Progress(manifest.total_bytes, marks.append))
    assert marks == [manifest.tensors[1].offset, manifest.total_bytes]  # after each tensor, in order


def test_an_engine_refuses_a_version_in_another_format_before_loading() -> None:
    """The vLLM worker's own check, for a version that reached it in a format its engine does not
    load (a member that did not say what it loads: ``accepts=None``), naming the first such weight;
    and the format it tells the publisher when it joins (``Subscriber(accepts=)``)."""
    from types import SimpleNamespace

    from weightsync.integrations.vllm import checks

    def config(method: str | None, quant: dict | None = None) -> SimpleNamespace:
        return SimpleNamespace(quantization=method, hf_config=SimpleNamespace(quantization_config=quant))

    int8 = config("compressed-tensors", {"config_groups": {"g": {"weights": {"num_bits": 8, "type": "int",
                                                                              "strategy": "channel"}}}})
    fp8 = config("fp8", {"quant_method": "fp8", "weight_block_size": [128, 128]})
    assert [checks.engine_format(c) for c in (config(None), int8, fp8, config("awq", {}))] == \
        ["", "int8-channel", "fp8-block", None]
    bf16 = [("model.norm.weight", torch.ones(8)), ("model.layers.0.mlp.up_proj.weight", torch.ones(8, 8))]
    problem = checks.format_problem(int8, bf16)
    assert problem is not None and "'model.layers.0.mlp.up_proj.weight' is torch.float32" in problem
    assert "quantize='int8-channel'" in problem
    quantized = [("model.norm.weight", torch.ones(8)), ("model.layers.0.mlp.up_proj.weight",
                                                          torch.ones(8, 8, dtype=torch.int8))]
    assert checks.format_problem(int8, quantized) is None
    assert "unquantized" in (checks.format_problem(config(None), quantized) or "")
    assert checks.format_problem(config("awq", {}), bf16) is None  # a format weightsync does not write: not checked


def test_a_vllm_worker_that_is_not_the_last_rank_answers_its_error_and_the_driver_raises_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.32's executor reads the workers' replies in rank order and raises at the first error,
    leaving the later ranks' replies for the next call (vllm#58242): a weightsync call that fails
    raises on the last rank only; another rank keeps its error and answers it, and the driver's
    helpers raise it as its own type (a worker's failed check as EngineMismatch)."""
    from types import SimpleNamespace

    from weightsync import integrations
    from weightsync.integrations.vllm import replica

    def fails() -> None:
        raise ws.PublisherGone("channel failed: the publisher closed the connection")

    worker = SimpleNamespace(error=None, _member="w0")
    monkeypatch.setattr(replica, "last_rank", lambda: False)
    assert replica.replied(worker, fails) == {replica.ERROR: worker.error}
    assert worker.error == "PublisherGone: channel failed: the publisher closed the connection"
    assert replica.replied(worker, lambda x: x + 1, 1) == 2
    monkeypatch.setattr(replica, "last_rank", lambda: True)
    with pytest.raises(ws.PublisherGone):
        replica.replied(worker, fails)

    raise_errors = integrations.vllm._raise_workers_errors
    with pytest.raises(ws.PublisherGone, match="closed the connection"):
        raise_errors([{"error": None}, {"error": worker.error}], RuntimeError("Worker failed with error ..."))
    with pytest.raises(ws.EngineMismatch, match="w1: version 3 did not write"):
        raise_errors([{"member": "w1", "failed": "version 3 did not write 2 engine parameters", "error": "x"}], None)
    with pytest.raises(ValueError, match="rank 64 above"):
        raise_errors([{"error": "ValueError: rank 64 above max_lora_rank"}], None)
    with pytest.raises(RuntimeError, match="a worker failed: KeyError"):
        raise_errors([{"error": "KeyError: 'x'"}], None)
    raise_errors([{"error": None}], None)  # nobody failed: nothing raised
    calls = []

    class LLM:  # collective_rpc as vLLM hands it over: one answer per worker
        def collective_rpc(self, name: str, args: tuple = ()) -> list:
            calls.append(args)
            if args == ("zero",):
                return [3, {replica.ERROR: "SyncTimeout: no version"}]
            return [{"error": None}, {"error": "SyncTimeout: no version >= 4 within 1s"}]

    with pytest.raises(ws.SyncTimeout, match="no version >= 4"):
        integrations.vllm._replies(LLM(), "zero")
    assert calls == [("zero",), ()]  # the answers, then engine_info for the error


def test_a_load_recorder_names_the_box_each_loader_reads_from_views_of_one_slot() -> None:
    """issue 58: what a vLLM worker's loaders read of each checkpoint tensor, recorded as they run
    (integrations/vllm/plan.py, torch only): a column-parallel narrow, a row-parallel narrow, a
    conversion, a read through a reshape across rows (the whole tensor), a tensor never read (no
    box); the tensors are views of one receive slot, sliced while the recorder runs, and the slot
    itself is no read of its first tensor."""
    from weightsync.integrations.vllm.plan import LoadRecorder

    slot = torch.arange(24 + 24 + 5 + 12 + 3, dtype=torch.float32)
    spans = {"col": (0, (4, 6)), "row": (24, (4, 6)), "norm": (48, (5,)), "reshaped": (53, (3, 4)),
             "unread": (65, (3,))}
    rows, cols, norm = torch.empty(2, 6), torch.empty(4, 3), torch.empty(5, dtype=torch.bfloat16)
    with LoadRecorder() as rec:
        pairs = ((n, slot[a:a + int(torch.tensor(sh).prod())].view(sh)) for n, (a, sh) in spans.items())
        for name, t in rec.watch(pairs):
            if name == "col":
                rows.copy_(t.narrow(0, 2, 2))  # rank 1 of 2: the second half of the rows
            elif name == "row":
                cols.copy_(t.narrow(1, 3, 3))  # rank 1 of 2: the second half of the columns
            elif name == "norm":
                norm.copy_(t.to(torch.bfloat16))
            elif name == "reshaped":
                t.view(2, 6).sum()
            assert t.shape == spans[name][1]  # metadata reads are no reads
    plan = rec.plan()
    boxes = {name: spec["boxes"] for name, spec in plan["tensors"].items()}
    assert boxes == {"col": [[[2, 0], [2, 6]]], "row": [[[0, 3], [4, 3]]], "norm": [[[0], [5]]],
                     "reshaped": [[[0, 0], [3, 4]]], "unread": None}
    assert plan["version_bytes"] == 68 * 4 and plan["needed_bytes"] == (12 + 12 + 5 + 12) * 4
    assert torch.equal(rows, slot[12:24].view(2, 6)) and torch.equal(cols, slot[24:48].view(4, 6)[:, 3:])


def test_a_fused_weight_read_in_two_halves_per_expert_is_two_boxes_received_and_expanded_as_one_tensor() -> None:
    """issue 58: a TP rank's loader reads its share of a fused gate_up weight [E, 2I, H] expert by
    expert, its gate rows and its up rows: the recorder merges the 2E reads into two boxes (not
    the one box around them, 3/4 of the tensor at TP=2), the plan wants both, and the two pieces a
    sliced member receives (``w[0]``, ``w[1]``) reach the loader as one tensor of the checkpoint's
    shape holding both, zeros elsewhere."""
    from weightsync.format import sharding, slicing
    from weightsync.integrations.vllm.plan import LoadRecorder, boxes, expanded

    experts, inter, hidden, rank = 3, 4, 2, 1
    fused = torch.arange(experts * 2 * inter * hidden, dtype=torch.float32).reshape(experts, 2 * inter, hidden)
    mine = torch.empty(experts, inter, hidden)
    with LoadRecorder() as rec:
        for _name, t in rec.watch([("gate_up", fused)]):
            for e in range(experts):
                half = inter // 2
                mine[e, :half].copy_(t[e].narrow(0, rank * half, half))  # gate rows of this rank
                mine[e, half:].copy_(t[e].narrow(0, inter + rank * half, half))  # up rows of this rank
    plan = rec.plan()
    assert plan["tensors"]["gate_up"]["boxes"] == [[[0, 2, 0], [3, 2, 2]], [[0, 6, 0], [3, 2, 2]]]
    assert plan["needed_bytes"] * 2 == plan["version_bytes"]
    want = boxes(plan)
    full = sharding.global_manifest([("gate_up", torch.float32, tuple(fused.shape))])
    pieces = [(spec.name, fused[tuple(slice(o, o + n) for o, n in zip(w.offset, w.shape, strict=True))].clone())
              for spec, w in zip(slicing.sliced_manifest(full, slicing.wants_of(want)).tensors,
                                 sorted(slicing.wants_of(want), key=lambda w: w.offset), strict=True)]
    assert [name for name, _ in pieces] == ["gate_up[0]", "gate_up[1]"]
    ((name, whole),) = list(expanded(iter(pieces), plan))
    keep = torch.zeros_like(fused, dtype=torch.bool)
    keep[:, 2:4], keep[:, 6:8] = True, True
    assert name == "gate_up" and torch.equal(whole, torch.where(keep, fused, torch.zeros_like(fused)))


def test_a_load_recorder_on_meta_tensors_names_each_box_and_proves_each_parameter_written_once() -> None:
    """issue 58, the bake before any version: meta checkpoint tensors (no bytes, no addresses) into
    meta parameters through each parameter's loader (``writing``): the boxes read are those of the
    real load, and coverage tells a parameter written exactly once from one written twice over a
    part, one written in part, and one never written; a non-box read says why it is whole."""
    from weightsync.integrations.vllm.plan import LoadRecorder

    meta = torch.device("meta")
    params = {"qkv": torch.empty(6, 4, device=meta), "o": torch.empty(4, 2, device=meta),
              "twice": torch.empty(4, device=meta), "half": torch.empty(4, device=meta),
              "never": torch.empty(2, device=meta)}
    checkpoint = [("q", torch.empty(4, 4, device=meta)), ("k", torch.empty(8, 4, device=meta)),
                  ("o", torch.empty(4, 4, device=meta)), ("n", torch.empty(4, device=meta)),
                  ("r", torch.empty(2, 6, device=meta)), ("unread", torch.empty(3, device=meta))]

    def qkv(param: torch.Tensor, loaded: torch.Tensor, shard: str) -> None:  # rank 1 of 2, stacked q then k
        at, rows = (0, 2) if shard == "q" else (2, 4)
        param.data.narrow(0, at, rows).copy_(loaded.narrow(0, rows, rows))

    rec = LoadRecorder()
    loaders = {name: rec.writing(name, param, fn) for name, param, fn in (
        ("qkv", params["qkv"], qkv),
        ("o", params["o"], lambda p, w: p.data.copy_(w.narrow(1, 2, 2))),
        ("twice", params["twice"], lambda p, w: (p.data.copy_(w), p.data[1:3].mul_(2))),
        ("half", params["half"], lambda p, w: p.data[:2].copy_(w.reshape(3, 4)[1:, 0])))}
    with rec:
        for name, t in rec.watch(checkpoint):
            if name in ("q", "k"):
                loaders["qkv"](params["qkv"], t, name)
            elif name == "o":
                loaders["o"](params["o"], t)
            elif name == "n":
                loaders["twice"](params["twice"], t)
            elif name == "r":
                loaders["half"](params["half"], t)
    plan = rec.plan(params, source="meta")
    tensors = plan["tensors"]
    assert {n: spec["boxes"] for n, spec in tensors.items()} == {
        "q": [[[2, 0], [2, 4]]], "k": [[[4, 0], [4, 4]]], "o": [[[0, 2], [4, 2]]], "n": [[[0], [4]]],
        "r": [[[0, 0], [2, 6]]], "unread": None}
    assert "whole_because" in tensors["r"] and "whole_because" not in tensors["q"]
    assert plan["source"] == "meta" and plan["needed_bytes"] == (8 + 16 + 8 + 4 + 12) * 4
    assert plan["coverage"] == {"parameters": 5, "exact": 2, "uncovered": ["never"], "overlapping": ["twice"],
                                "partly_written": ["half"]}
