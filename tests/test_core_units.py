"""Tier 1: membership, generations, acknowledgement blame, the released flag and the analyzer,
against an in-memory control store and a fake data plane: no processes, no sockets."""

from __future__ import annotations

import asyncio
import queue
import socket
import threading
import time

import pytest
import torch

from tests.fakes import FakeControl, FakePlane, FakeTable
from weightsync import _wire
from weightsync._errors import LocalFailure, PeerFailure
from weightsync.control import client as client_mod
from weightsync.control.framing import HEADER, MAX_FRAME
from weightsync.engine.handles import PutHandle
from weightsync.engine.staging import Job, Spills
from weightsync.format import layout
from weightsync.membership.generations import Generations, lane_order
from weightsync.membership.membership import Membership
from weightsync.options import ChannelOptions, Deadlines
from weightsync.recorder.analyze import analyze, render
from weightsync.recorder.recorder import Dump, Entry, FlightRecorder

pytestmark = pytest.mark.timeout(60)
SETTINGS = ChannelOptions(timeout=2.0, heartbeat_interval=1.0).settings(checksum=True, in_place=False)


class Liveness:
    """When each member last spoke, and whether its connection is open (the control server's view)."""

    def __init__(self) -> None:
        self.seen: dict[str, tuple[float, bool]] = {}

    def heard(self, member: str) -> tuple[float | None, bool]:
        last, connected = self.seen.get(member, (time.monotonic(), True))
        return last, connected


def setup(dead_after: float = 5.0) -> tuple[FakeControl, Membership, FakePlane, Generations, FlightRecorder, Liveness]:
    control = FakeControl()
    rec = FlightRecorder(capacity=500)
    live = Liveness()
    membership = Membership("ch", rec, heartbeat_interval=1.0, dead_after=dead_after, heard=live.heard)
    plane = FakePlane()
    gens = Generations("ch", control=control, table=FakeTable(), membership=membership, recorder=rec, plane=plane,
                       settings=SETTINGS, stopped=lambda: False, on_change=lambda: None)
    return control, membership, plane, gens, rec, live


def play_member(control: FakeControl, member: str, seen: dict[str, list], ready: bool = True,
                until: type = _wire.Go, count: int = 1) -> threading.Thread:
    """A member on another thread: answers Admit/Reconfigure with Ready; ends after ``count`` ``until``s."""
    count_left = [count]
    outbox = control.outbox[f"inc-{member}"]

    def run() -> None:
        while True:
            try:
                message = outbox.get(timeout=3.0)
            except queue.Empty:
                return
            seen.setdefault(member, []).append(message)
            if isinstance(message, until):
                count_left[0] -= 1
                if not count_left[0]:
                    return
            if isinstance(message, (_wire.Admit, _wire.Reconfigure)) and ready:
                generation = message.generation if isinstance(message, _wire.Admit) else message.next_generation
                control.replies.put(_wire.Ready(generation=generation, member_id=member))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def join(gens: Generations, membership: Membership, *members: str) -> None:
    for member in members:
        assert membership.request_join(member)
        gens.register(member, f"inc-{member}")


def test_joiners_get_the_publishers_settings_and_enter_together() -> None:
    control, membership, plane, gens, _, _ = setup()
    seen: dict[str, list] = {}
    threads = [play_member(control, m, seen) for m in ("a", "b")]
    join(gens, membership, "a", "b")
    gens.advance(reason="membership change")
    for t in threads:
        t.join(5)
    assert membership.members == ["a", "b"] and membership.generation == 1
    assert [(s.generation, s.members, s.rank) for s in plane.entered] == [(1, ("a", "b"), 0)]
    for member in ("a", "b"):
        admit, go = seen[member][0], seen[member][1]
        assert isinstance(admit, _wire.Admit) and admit.settings == SETTINGS  # settings agreed at admission
        assert isinstance(go, _wire.Go) and go.generation == 1 and len(go.rendezvous) == 16  # a fresh token
    assert seen["a"][1].rendezvous == seen["b"][1].rendezvous == plane.entered[0].rendezvous
    assert not membership.request_join("a")  # a member's id is taken


def test_a_member_that_leaves_is_dropped_without_blame_and_told_nothing_more() -> None:
    control, membership, plane, gens, rec, _ = setup()
    seen: dict[str, list] = {}
    threads = [play_member(control, "a", seen, count=2), play_member(control, "b", seen, until=_wire.Reconfigure)]
    join(gens, membership, "a", "b")
    gens.advance(reason="membership change")
    membership.request_leave("b")
    gens.advance(reason="membership change")
    for t in threads:
        t.join(5)
    assert membership.members == ["a"] and membership.generation == 2
    reconfigure = next(m for m in seen["b"] if isinstance(m, _wire.Reconfigure))
    assert reconfigure.members == ("a",) and not reconfigure.fresh
    assert not [e for e in rec.snapshot() if e.op == "evict"]  # a leave is not an eviction
    assert plane.entered[-1].members == ("a",)
    assert control.released == [("b", "left")]  # its connection is closed after the goodbye


def test_a_failed_rendezvous_blames_only_the_unresponsive() -> None:
    control, membership, plane, gens, _, _ = setup()
    seen: dict[str, list] = {}
    threads = [play_member(control, "a", seen, until=_wire.Shutdown)]
    join(gens, membership, "a")
    plane.fail_enter = PeerFailure("rendezvous timed out")
    with pytest.raises(Exception, match="4 attempts"):
        gens.advance(reason="membership change")
    assert [c for c in plane.calls if c[0] == "enter"] == [("enter", g) for g in (1, 2, 3, 4)]
    gens.shutdown()
    for t in threads:
        t.join(5)


def test_acknowledgements_blame_the_silent_not_their_victims() -> None:
    control, membership, _plane, gens, rec, live = setup(dead_after=0.2)
    membership.members = ["a", "b", "c"]
    live.seen["c"] = (time.monotonic() - 1.0, True)  # silent for a second: longer than dead_after
    assert not membership.is_alive("c") and membership.is_alive("a")
    control.replies.put(_wire.Ack(generation=0, seq=0, member_id="a", version=7, ok=True))
    control.replies.put(_wire.Ack(generation=0, seq=0, member_id="b", version=7, ok=False, error="cancelled"))
    acked, blamed = gens.collect_acks(0, 0, ("a", "b", "c"), 7, timeout=2.0)
    assert acked == {"a"} and blamed == {"c"}  # b failed waiting on c: a victim, not a culprit
    assert {e.peers for e in rec.snapshot() if e.op == "ack_missing"} == {("c",)}


def test_acknowledgements_blame_the_failed_when_nobody_is_silent() -> None:
    control, membership, _plane, gens, rec, _ = setup()
    membership.members = ["a", "b"]
    control.replies.put(_wire.Ack(generation=0, seq=3, member_id="a", version=1, ok=True))
    control.replies.put(_wire.Ack(generation=0, seq=2, member_id="b", version=0, ok=True))  # stale: ignored
    control.replies.put(_wire.Ack(generation=0, seq=3, member_id="b", version=1, ok=False, error="corrupt"))
    acked, blamed = gens.collect_acks(0, 3, ("a", "b"), 1, timeout=2.0)
    assert acked == {"a"} and blamed == {"b"}
    assert [e.error for e in rec.snapshot() if e.op == "nack"] == ["corrupt"]


def test_a_member_that_says_it_is_leaving_in_its_acknowledgement_is_taken_at_its_word() -> None:
    """A subscriber's abort() mid-version fails its receive, acknowledges the failure with
    ``leaving`` and sends its Leave after: the publisher must know it is leaving before that Leave
    arrives, so that the others who failed with it are not blamed; and a member that claims to leave
    to dodge a strike leaves."""
    control, membership, _plane, gens, rec, _ = setup()
    membership.members = ["a", "b"]
    control.replies.put(_wire.Ack(generation=0, seq=1, member_id="a", version=1, ok=False, error="peer closed"))
    control.replies.put(_wire.Ack(generation=0, seq=1, member_id="b", version=1, ok=False, error="cancelled",
                                  leaving=True))
    _acked, blamed = gens.collect_acks(0, 1, ("a", "b"), 1, timeout=2.0)
    assert blamed == {"a", "b"}  # the sender decides: one of them is leaving (Sender._leavers)
    assert membership.is_leaving("b") and not membership.is_leaving("a")
    assert membership.plan_next(blamed).members == ("a",)
    assert [e.error for e in rec.snapshot() if e.op == "nack"] == ["peer closed", "cancelled (leaving)"]


def test_a_joiner_that_dies_before_it_is_planned_frees_its_id() -> None:
    control, membership, _plane, gens, _, live = setup(dead_after=0.2)
    join(gens, membership, "ghost")
    live.seen["ghost"] = (time.monotonic(), False)  # its connection closed: dead at once
    gens.advance(reason="membership change")  # nobody left to plan: an empty generation
    assert membership.members == [] and membership.joining() == []
    assert ("ghost", "died while joining") in control.released
    assert membership.request_join("ghost")  # a new incarnation may use the id again


def quick_setup() -> tuple[FakeControl, Membership, FakePlane, Generations, FlightRecorder, Liveness]:
    """As setup(), with a rendezvous bound of about a second."""
    control, membership, plane, _, rec, live = setup()
    settings = ChannelOptions(timeout=0.5, heartbeat_interval=0.25, bucket_bytes=1 << 16).settings(
        checksum=True, in_place=False)
    gens = Generations("ch", control=control, table=FakeTable(), membership=membership, recorder=rec, plane=plane,
                       settings=settings, stopped=lambda: False, on_change=lambda: None)
    return control, membership, plane, gens, rec, live


def form_first(control: FakeControl, membership: Membership, gens: Generations, seen: dict[str, list],
               *members: str) -> None:
    """Generation 1 with ``members``, each answering its Admit."""
    threads = [play_member(control, m, seen) for m in members]
    join(gens, membership, *members)
    gens.advance(reason="membership change")
    for t in threads:
        t.join(5)
    assert membership.members == list(members)


def evictions(rec: FlightRecorder) -> list[tuple[tuple[str, ...], str]]:
    return [(e.peers, e.error) for e in rec.snapshot() if e.op == "evict"]


def test_a_member_that_dies_while_a_generation_forms_is_dropped_and_the_rest_form_the_next() -> None:
    control, membership, plane, gens, rec, live = quick_setup()
    seen: dict[str, list] = {}
    form_first(control, membership, gens, seen, "a", "b", "c")
    outbox = control.outbox["inc-c"]

    def dies_on_reconfigure() -> None:  # c's process dies as the next generation forms
        while not isinstance(outbox.get(timeout=5), _wire.Reconfigure):
            pass
        live.seen["c"] = (time.monotonic(), False)  # its connection closed

    threads = [play_member(control, m, seen, until=_wire.Go) for m in ("a", "b", "d")]
    threads.append(threading.Thread(target=dies_on_reconfigure, daemon=True))
    threads[-1].start()
    join(gens, membership, "d")  # a newcomer: the next generation forms
    gens.advance(reason="membership change")
    for t in threads:
        t.join(5)
    assert membership.members == ["a", "b", "d"]
    assert plane.entered[-1].members == ("a", "b", "d")
    assert evictions(rec) == [(("c",), "dead")]  # only the dead; a and b, who waited on it, stay
    failed = [e for e in rec.snapshot() if e.op == "rendezvous" and e.state == "failed"]
    assert failed and all("c" in e.error for e in failed)


def test_a_member_late_for_the_rendezvous_gets_a_second_bound() -> None:
    control, membership, plane, gens, rec, _ = quick_setup()
    seen: dict[str, list] = {}
    form_first(control, membership, gens, seen, "a", "b")
    outbox = control.outbox["inc-b"]

    def late() -> None:  # alive, but answers only once the first bound has passed
        message = outbox.get(timeout=5)
        assert isinstance(message, _wire.Reconfigure)
        deadline = time.monotonic() + 10
        while not any("waiting once more" in e.error for e in rec.snapshot()):
            assert time.monotonic() < deadline
            time.sleep(0.01)  # polling the recorder with a deadline
        control.replies.put(_wire.Ready(generation=message.next_generation, member_id="b"))

    threads = [play_member(control, m, seen) for m in ("a", "d")]
    threads.append(threading.Thread(target=late, daemon=True))
    threads[-1].start()
    join(gens, membership, "d")
    gens.advance(reason="membership change")
    for t in threads:
        t.join(5)
    assert membership.members == ["a", "b", "d"] and membership.generation == 2  # the first attempt held
    assert evictions(rec) == []
    late_entries = [e for e in rec.snapshot() if "waiting once more" in e.error]
    assert [e.peers for e in late_entries] == [("b",)]


def test_a_member_alive_but_never_at_the_rendezvous_is_evicted_as_failed_after_two_attempts() -> None:
    control, membership, plane, gens, rec, _ = quick_setup()
    seen: dict[str, list] = {}
    form_first(control, membership, gens, seen, "a", "b")
    threads = [play_member(control, "a", seen), play_member(control, "b", seen, ready=False, until=_wire.Shutdown)]
    join(gens, membership, "d")
    threads.append(play_member(control, "d", seen))
    gens.advance(reason="membership change")
    assert membership.members == ["a", "d"]
    assert evictions(rec) == [(("b",), "failed")]
    attempts = [e for e in rec.snapshot() if e.op == "rendezvous" and e.state == "failed" and "not ready" in e.error]
    assert len(attempts) == 2  # two attempts, each with its second bound, before b counts as failed
    gens.shutdown()
    for t in threads:
        t.join(5)


def test_deadlines_come_from_the_publishers_settings() -> None:
    big = ChannelOptions(timeout=7.0, min_bandwidth=1e6, bucket_bytes=1 << 30).settings(checksum=True, in_place=False)
    d = Deadlines(big)
    assert d.bucket(1 << 20) == pytest.approx(7.0 + (1 << 20) / 1e6)
    assert d.rendezvous() == pytest.approx(7.0 + 7.0 + (1 << 30) / 1e6)  # a 1 GiB bucket, not 64 MiB
    assert d.member_silence() == 5.0 * big.heartbeat_interval


def test_released_is_known_to_the_sender_before_the_loop_runs() -> None:
    """The sender decides whether it may re-send from ``job.released``: set at once on its thread,
    while the handle's asyncio future is resolved only when the loop gets to it."""
    loop = asyncio.new_event_loop()
    try:
        items = [("w", torch.ones(4))]
        job = Job(version=1, manifest=layout.build_manifest(items), handle=PutHandle("ch", 1, loop), items=items)
        sender = threading.Thread(target=job.release)
        sender.start()
        sender.join(5)
        assert job.released.is_set()
        assert not job.handle._released.done()  # the loop has not run: the old check saw "not released"
        loop.run_until_complete(asyncio.wait_for(job.handle.released(), 5))
    finally:
        loop.close()


def test_a_spilled_version_never_packs_the_released_tensors_again() -> None:
    """``released(spill=True)`` copies what is not packed yet and lets the tensors go; a re-send
    racing it (an attempt that failed, retried from bucket 0) must not read the tensors the caller
    may already be changing: it fails, and the bytes past the spill still come from the copy."""
    loop = asyncio.new_event_loop()
    try:
        items = [("w", torch.arange(64, dtype=torch.float32))]
        manifest = layout.build_manifest(items)
        job = Job(version=1, manifest=manifest, handle=PutHandle("ch", 1, loop), items=items,
                  device=torch.device("cpu"))
        out = torch.empty(128, dtype=torch.uint8)
        job.pack(out, 0, 128)  # the first bucket went
        job.spill_rest()  # the caller wants its tensors back
        assert job.released.is_set() and job.spill_at == 128
        items[0][1].zero_()  # ...and changes them
        job.pack(out, 128, 256)  # the rest comes from the copy
        assert torch.equal(out.view(torch.float32), torch.arange(32, 64, dtype=torch.float32))
        with pytest.raises(LocalFailure, match="released"):
            job.pack(out, 0, 128)  # a re-send from the start: refused, never the zeroed tensors
    finally:
        loop.close()


def test_spills_reuse_one_buffer_but_never_one_still_read() -> None:
    """Each step's ``released(spill=True)`` copies into the buffer the last finished spill used
    (fresh memory page-faults, which was most of the stall), but a version whose spill is still
    being sent keeps its own: the next version's spill never writes the bytes it still sends."""
    loop = asyncio.new_event_loop()
    spills = Spills()

    def job(version: int) -> tuple[Job, torch.Tensor]:
        items = [("w", torch.arange(64, dtype=torch.float32) + version)]
        j = Job(version=version, manifest=layout.build_manifest(items), handle=PutHandle("ch", version, loop),
                items=items, device=torch.device("cpu"), spills=spills)
        return j, items[0][1]

    def spilled(j: Job, t: torch.Tensor) -> int:
        j.spill_rest()
        t.zero_()  # the caller's next optimizer step
        assert j.spill is not None
        return j.spill.data_ptr()

    def rest(j: Job, version: int) -> None:
        out = torch.empty(256, dtype=torch.uint8)
        j.pack(out[:128], 0, 128)
        j.pack(out[128:], 128, 256)
        assert torch.equal(out.view(torch.float32), torch.arange(64, dtype=torch.float32) + version)
        j.drop_spill()  # Staging.finish: the version is done with

    try:
        a, b, c = job(1), job(2), job(3)
        first = spilled(*a)
        second = spilled(*b)  # while a's spill is still to be sent
        assert second != first
        rest(a[0], 1)  # a is done with: its buffer is free again
        assert spilled(*c) == first  # ...and c reuses it, with b's untouched
        f = job(6)
        assert spilled(*f) not in (first, second)  # c's and b's are both still to be sent
        rest(b[0], 2)
        rest(c[0], 3)
        rest(f[0], 6)
        kept = torch.arange(128, dtype=torch.float32).view(torch.uint8).clone()  # larger than any spill
        d, _ = job(4)
        d.release()
        d.spill, d.spill_at = kept, 0  # re-sent from a delta's kept copy: not the pool's
        d.pack(torch.empty(256, dtype=torch.uint8), 0, 256)
        d.drop_spill()
        e, t = job(5)
        assert spilled(e, t) != kept.data_ptr()
    finally:
        loop.close()


def test_a_spill_ahead_meets_the_sender_and_releases_the_tensors() -> None:
    """``Publisher(spill_ahead=True)``: the version is copied from its end down while the sender
    packs it from the start, then the tensors are released with no one asking, and the version
    can still be sent again from the copy; a ``released(spill=True)`` before that copies only the
    gap. Every byte sent is the version's, though the caller changes its tensors at once; packing
    from both sides at once, too."""
    loop = asyncio.new_event_loop()

    def job(n: int = 64) -> tuple[Job, torch.Tensor, torch.Tensor]:
        items = [("w", torch.arange(n, dtype=torch.float32)), ("b", torch.arange(n, dtype=torch.float32) * -1)]
        want = torch.cat([t.view(torch.uint8) for _, t in items]).clone()
        j = Job(version=1, manifest=layout.build_manifest(items), handle=PutHandle("ch", 1, loop), items=items,
                device=torch.device("cpu"), spills=Spills())
        return j, torch.cat([t for _, t in items]), want

    def sent(j: Job, lo: int, hi: int) -> torch.Tensor:
        out = torch.empty(hi - lo, dtype=torch.uint8)
        j.pack(out, lo, hi)
        return out

    try:
        j, _, want = job()
        first = sent(j, 0, 128)  # the first bucket went
        j.spill_ahead(chunk=48)  # ...then the spiller ran past the sender's frontier, to the start
        assert j.released.is_set() and j.whole_spill()
        for _, t in j.items or []:
            t.zero_()  # the optimizer step
        assert torch.equal(torch.cat([first, sent(j, 128, 384), sent(j, 384, 512)]), want)
        assert torch.equal(sent(j, 0, 512), want)  # a member failed: sent again, from the spill
        j.drop_spill()
        assert not j.whole_spill()

        j, _, want = job()
        with j.pack_lock:  # a spill ahead that copied [384, 512) so far
            assert j._open_spill()
            j._spill_down_to(384)
        first = sent(j, 0, 128)
        j.spill_rest()  # released(spill=True): only [128, 384) is left to copy
        assert j.released.is_set() and j.spill_at == 128 and not j.whole_spill()
        for _, t in j.items or []:
            t.zero_()
        assert torch.equal(torch.cat([first, sent(j, 128, 512)]), want)
        with pytest.raises(LocalFailure, match="released"):
            sent(j, 0, 128)  # the first bucket is in no copy: never from the zeroed tensors

        j, _, want = job(1 << 16)  # released(spill=True) while a spill ahead runs: it finishes the job
        first = sent(j, 0, 8192)
        entered, go, real = threading.Event(), threading.Event(), j._spill_down_to

        def held(lo: int) -> None:  # the spill thread's first chunk, held (pack_lock with it)
            entered.set()
            assert go.wait(10)
            real(lo)

        j._spill_down_to = held  # type: ignore[method-assign]
        spiller = threading.Thread(target=j.spill_ahead, args=(4096,))
        spiller.start()
        assert entered.wait(10)
        j.spill_rest()  # returns at once, lock or not: the spill thread is told to finish the job
        assert not j.released.is_set()
        j._spill_down_to = real  # type: ignore[method-assign]
        go.set()
        assert j.released.wait(10)
        spiller.join(10)
        assert not spiller.is_alive() and j.spill_at <= j.packed and not j.whole_spill()
        for _, t in j.items or []:
            t.zero_()
        assert torch.equal(torch.cat([first, sent(j, 8192, want.numel())]), want)

        j, _, want = job(1 << 16)  # 512 KiB: both sides at once, on two threads
        spiller = threading.Thread(target=j.spill_ahead, args=(4096,))
        parts, lo = [], 0
        spiller.start()
        while lo < want.numel():
            parts.append(sent(j, lo, min(lo + 8192, want.numel())))
            lo += 8192
        spiller.join(10)
        assert not spiller.is_alive() and j.released.is_set()
        assert torch.equal(torch.cat(parts), want)
    finally:
        loop.close()


def entry(seq: int, op: str, member: str, **kw: object) -> Entry:
    e = Entry(seq=seq, op=op, channel="ch", member=member, t_scheduled=float(seq), **kw)
    return e.start().complete() if kw.pop("ok", True) else e


def dump(label: str, entries: list[Entry]) -> Dump:
    return Dump(label=label, pid=1, host="h", time=0.0, reason="test", torch_version="x", capacity=100,
                entries=entries)


def test_analyzer_names_a_nacking_member_and_the_bucket_after_its_last() -> None:
    pub = [entry(0, "announce", "publisher", version=3, generation=1, peers=("a", "b")),
           entry(1, "bucket_send", "publisher", version=3, generation=1, bucket=0),
           Entry(seq=2, op="ack", channel="ch", member="publisher", version=3, generation=1, peers=("a", "b"),
                 t_scheduled=2.0).start().fail("failed: ['b']"),
           Entry(seq=3, op="nack", channel="ch", member="publisher", version=3, generation=1, peers=("b",),
                 t_scheduled=3.0).start().fail("buckets [1] arrived corrupted")]
    a = [entry(0, "bucket_recv", "a", version=3, generation=1, bucket=0),
         entry(1, "bucket_recv", "a", version=3, generation=1, bucket=1), entry(2, "publish", "a", version=3)]
    b = [entry(0, "bucket_recv", "b", version=3, generation=1, bucket=0)]
    result = analyze([dump("publisher", pub), dump("a", a), dump("b", b)])
    assert not result.ok
    assert [(c.member, c.version, c.bucket) for c in result.culprits] == [("b", 3, 1)]
    assert result.first_divergence is not None and result.first_divergence.bucket == 1
    assert result.first_divergence.not_finished == ["b"]


def test_analyzer_blames_a_member_without_a_dump_at_the_stalled_bucket() -> None:
    pub = [entry(0, "announce", "publisher", version=5, generation=2, peers=("a", "killed")),
           entry(1, "bucket_send", "publisher", version=5, generation=2, bucket=0),
           Entry(seq=2, op="bucket_send", channel="ch", member="publisher", version=5, generation=2, bucket=1,
                 t_scheduled=2.0).start().fail("Connection reset by peer"),
           Entry(seq=3, op="ack_missing", channel="ch", member="publisher", version=5, generation=2,
                 peers=("killed",), t_scheduled=3.0).start().fail("no acknowledgement")]
    a = [entry(0, "bucket_recv", "a", version=5, generation=2, bucket=0)]
    result = analyze([dump("publisher", pub), dump("a", a)])
    assert result.missing_dumps == ["killed"]
    assert [(c.member, c.bucket) for c in result.culprits] == [("killed", 1)]
    assert "dump is missing" in result.culprits[0].reason


def failed(seq: int, op: str, member: str, error: str, **kw: object) -> Entry:
    return Entry(seq=seq, op=op, channel="ch", member=member, t_scheduled=float(seq), **kw).start().fail(error)


def started(seq: int, op: str, member: str, **kw: object) -> Entry:
    return Entry(seq=seq, op=op, channel="ch", member=member, t_scheduled=float(seq), **kw).start()


def test_analyzer_blames_a_frozen_member_whose_dump_is_there_by_its_heartbeats() -> None:
    """Heartbeats stopped, dump present (SIGSTOP, then dumped on SIGCONT): the silent member is
    the culprit at the bucket the publisher's send stalled in; the member waiting beside it is
    a victim, and the text says so for people."""
    pub = [entry(0, "announce", "publisher", version=1, generation=1, peers=("a", "frozen")),
           entry(1, "bucket_send", "publisher", version=1, generation=1, bucket=0),
           started(2, "bucket_send", "publisher", version=1, generation=1, bucket=1),
           failed(3, "heartbeat", "publisher", "silent for 2.0s", peers=("frozen",)),
           failed(4, "ack", "publisher", "silent: ['frozen']", version=1, generation=1, peers=("a", "frozen"))]
    a = [entry(0, "bucket_recv", "a", version=1, generation=1, bucket=0),
         failed(1, "bucket_recv", "a", "a bucket missed its deadline", version=1, generation=1, bucket=1)]
    frozen = [entry(0, "bucket_recv", "frozen", version=1, generation=1, bucket=0),
              started(1, "bucket_recv", "frozen", version=1, generation=1, bucket=1)]
    result = analyze([dump("publisher", pub), dump("a", a), dump("frozen", frozen)])
    assert not result.ok and result.missing_dumps == []
    assert [(c.member, c.version, c.bucket) for c in result.culprits] == [("frozen", 1, 1)]
    assert "heartbeats stopped" in result.culprits[0].reason and "dump is missing" not in result.culprits[0].reason
    assert result.versions[0].members["frozen"] == "waiting in bucket 1"
    text = render(result)
    assert "LIKELY CULPRIT: frozen at ch v1 bucket 1" in text and text.endswith("stall or failure found")


def test_analyzer_a_member_silent_after_its_last_bucket_and_a_clean_run() -> None:
    """Every bucket went out and arrived, but one member never published nor acknowledged: the
    divergence is after the last bucket and the culprit is named there. A run where everyone
    acknowledged is found clean; without the publisher's dump, that is what is missing. Same-host
    members record their copies without a generation (-1): they count the same."""
    pub = [entry(0, "announce", "publisher", version=2, generation=3, peers=("a", "late")),
           entry(1, "bucket_send", "publisher", version=2, generation=3, bucket=0),
           entry(2, "bucket_send", "publisher", version=2, generation=3, bucket=1),
           failed(3, "ack_missing", "publisher", "no acknowledgement", version=2, generation=3, peers=("late",))]
    a = [entry(0, "bucket_recv", "a", version=2, bucket=0), entry(1, "bucket_recv", "a", version=2, bucket=1),
         entry(2, "publish", "a", version=2, generation=3)]
    late = [entry(0, "bucket_recv", "late", version=2, generation=3, bucket=0),
            entry(1, "bucket_recv", "late", version=2, generation=3, bucket=1)]
    result = analyze([dump("publisher", pub), dump("a", a), dump("late", late)])
    assert [(c.member, c.bucket) for c in result.culprits] == [("late", None)]  # no sentinel: not a bucket
    d = result.first_divergence
    assert d is not None and (d.bucket, d.finished, d.not_finished) == (2, ["a"], ["late"])
    assert "LIKELY CULPRIT: late at ch v2 after its last bucket" in render(result)

    clean = [entry(0, "announce", "publisher", version=4, generation=1, peers=("a",)),
             entry(1, "bucket_send", "publisher", version=4, generation=1, bucket=0),
             entry(2, "ack", "publisher", version=4, generation=1, peers=("a",))]
    got = [entry(0, "bucket_recv", "a", version=4, bucket=0), entry(1, "publish", "a", version=4)]
    result = analyze([dump("publisher", clean), dump("a", got)])
    assert result.ok and not result.culprits and result.versions[0].members == {"a": "published"}
    assert render(result).endswith("nothing wrong found")
    result = analyze([dump("a", got)])
    assert not result.ok and result.missing_dumps == ["publisher"]


def dump_of(label: str, pid: int, entries: list[Entry]) -> Dump:
    return Dump(label=label, pid=pid, host="h", time=0.0, reason="test", torch_version="x", capacity=100,
                entries=entries)


def test_analyzer_reads_a_kill_and_replace_run_as_it_happened() -> None:
    """gen0 is killed at v2 (its connection closes; a killed process writes no dump) and replaced by a
    process given the same id, which never had trouble (no dump of its own either); repl-1 joins with
    a new id and had trouble later (a dump). The analyzer names gen0 once, with the cause the
    publisher saw, reads the healthy members' acknowledgements as what they are, counts the reused
    id's processes, and a healthy stretch takes one line."""
    pub: list[Entry] = []
    seq = iter(range(10_000))

    def version(v: int, gen: int, peers: tuple[str, ...], *, missing: tuple[str, ...] = ()) -> None:
        pub.append(entry(next(seq), "announce", "publisher", version=v, generation=gen, peers=peers))
        pub.append(entry(next(seq), "bucket_send", "publisher", version=v, generation=gen, bucket=0))
        if missing:
            pub.append(failed(next(seq), "ack_missing", "publisher", "no acknowledgement", version=v, generation=gen,
                              peers=missing))
            pub.append(failed(next(seq), "ack", "publisher", f"silent: {list(missing)}", version=v, generation=gen,
                              peers=peers))
        else:
            pub.append(entry(next(seq), "ack", "publisher", version=v, generation=gen, peers=peers))

    for v in range(2):
        version(v, 1, ("gen0", "gen1"))
    pub.append(failed(next(seq), "heartbeat", "publisher", "connection closed", peers=("gen0",)))
    version(2, 1, ("gen0", "gen1"), missing=("gen0",))
    version(2, 2, ("gen1",))
    for v in range(3, 40):
        version(v, 3, ("gen0", "gen1", "repl-1"))
    gen1 = [entry(next(seq), "bucket_recv", "gen1", version=v, generation=g, bucket=0) for v, g in
            [(0, 1), (1, 1), (2, 1), (2, 2)] + [(v, 3) for v in range(3, 40)]]
    gen1 += [entry(next(seq), "publish", "gen1", version=v) for v in range(40)]
    repl = [entry(next(seq), "bucket_recv", "repl-1", version=v, generation=3, bucket=0) for v in range(3, 40)]
    repl += [entry(next(seq), "publish", "repl-1", version=v) for v in range(3, 40)]
    result = analyze([dump_of("publisher", 1, pub), dump_of("gen1", 2, gen1), dump_of("repl", 3, repl)])
    assert [(c.member, c.version, c.bucket) for c in result.culprits] == [("gen0", 2, None)]
    assert "its connection closed" in result.culprits[0].reason and "heartbeats" not in result.culprits[0].reason
    assert [(d.member, d.cause) for d in result.deaths] == [("gen0", "its connection closed (it exited or was killed)")]
    later = {v.version: v.members for v in result.versions if v.generation == 3}
    assert later[3]["gen0"] == "acknowledged (no dump of its own)" and later[39]["repl-1"] == "published"
    assert result.missing_dumps == ["gen0"]  # the killed incarnation, not the healthy one after it
    text = render(result)
    assert "versions 0-39: 40 sent (1 re-sent), 40 delivered to every member, not at first: v2 (generation 1)" in text
    assert len(text.splitlines()) < 12 and "no dump\n" not in text.split("v2 (generation 1)")[0]
    assert len(render(result, details=True).splitlines()) > 100  # every version, member by member

    # now each gen0 process left a dump (the first one on an earlier trouble, before it was killed)
    first_gen0 = [entry(next(seq), "bucket_recv", "gen0", version=0, generation=1, bucket=0)]
    gen0_again = [entry(next(seq), "bucket_recv", "gen0", version=v, generation=3, bucket=0) for v in range(3, 40)]
    result = analyze([dump_of("publisher", 1, pub), dump_of("gen1", 2, gen1), dump_of("repl", 3, repl),
                      dump_of("gen0", 4, first_gen0), dump_of("gen0", 5, gen0_again)])
    assert result.incarnations == {"gen0": 2} and "gen0 (2)" in render(result)
    again = {v.version: v.members for v in result.versions if v.generation == 3}
    assert again[3]["gen0"] == "received through bucket 0, never readable"  # from its own dump
    assert [v.members["gen0"] for v in result.versions if v.version == 0] == [
        "received through bucket 0, never readable"]  # the first process's


def _members(*names: str) -> Membership:
    membership = Membership("ch", FlightRecorder(capacity=100))
    for name in names:
        assert membership.request_join(name)
    membership.commit(membership.plan_next(), ok=True)
    assert membership.members == list(names)
    return membership


def test_two_failed_versions_in_a_row_evict_as_failed_and_a_delivered_one_forgives() -> None:
    """fault-tolerance.md: a member that fails a version is kept; after two in a row it is evicted
    ("failed"); a version it delivers in between starts the count again."""
    membership = _members("a", "b")
    plan = membership.plan_next(failed={"a"})  # one failure: kept
    assert plan.evicted == () and "a" in plan.members
    membership.commit(plan, ok=True)
    membership.note_delivered({"a", "b"}, 1, {}, {})  # it delivered the next one: forgiven
    membership.commit(membership.plan_next(failed={"a"}), ok=True)
    assert "a" in membership.members
    plan = membership.plan_next(failed={"a"})  # the second in a row
    assert plan.evicted == ("a",) and plan.reasons == {"a": "failed"} and plan.members == ("b",)


def test_slow_needs_window_versions_in_a_row_and_a_uniformly_slow_network_flags_nobody() -> None:
    from weightsync.membership.membership import StragglerPolicy

    policy = StragglerPolicy(slow_factor=3.0, slow_floor=0.05, window=3, on_slow="keep")
    membership = _members("a", "b", "c")
    slow = {"a": 1.0, "b": 0.1, "c": 0.1}
    assert membership.slow_members(policy, slow) == {}
    assert membership.slow_members(policy, slow) == {}
    assert membership.slow_members(policy, {"a": 0.1, "b": 0.1, "c": 0.1}) == {}  # the streak breaks
    for _ in range(2):
        assert membership.slow_members(policy, slow) == {}
    assert set(membership.slow_members(policy, slow)) == {"a"}  # three in a row
    everyone = {"a": 5.0, "b": 5.0, "c": 5.0}  # everyone equally slow: a slow network, nobody's fault
    assert all(membership.slow_members(policy, everyone) == {} for _ in range(5))


def test_a_member_that_reports_zero_own_time_cannot_make_an_honest_one_slow() -> None:
    """An insider acknowledging every version with 0 s of its own time: the median of the others
    was its 0 (two members) or half an honest one's time (three), and an honest member within the
    policy's factor was evicted as slow. The upper median of at least two others is an honest
    report; with one other member nobody is scored at all."""
    from weightsync.membership.membership import StragglerPolicy

    policy = StragglerPolicy(slow_factor=3.0, slow_floor=0.05, window=3, on_slow="evict")
    pair = _members("honest", "liar")
    assert all(pair.slow_members(policy, {"honest": 0.2, "liar": 0.0}) == {} for _ in range(6))
    trio = _members("a", "b", "liar")
    assert all(trio.slow_members(policy, {"a": 0.25, "b": 0.1, "liar": 0.0}) == {} for _ in range(6))
    slow = _members("a", "b", "slow")  # a member really slower than the policy allows is still found
    for _ in range(2):
        assert slow.slow_members(policy, {"a": 0.1, "b": 0.1, "slow": 1.0}) == {}
    assert set(slow.slow_members(policy, {"a": 0.1, "b": 0.1, "slow": 1.0})) == {"slow"}


def test_a_member_is_judged_on_what_its_link_took_at_least_against_what_the_others_took_at_most() -> None:
    """On fast links a probe's bytes are often all buffered before a member's reader wakes, so its
    own measure comes out near 0: four equal links measured 0.6 s, 0.01 s, 0.01 s, 0.01 s at
    least (the publisher's round trips: about 0.6 s each), and the honest 0.6 was scored 17x
    slow and evicted on the emulated cluster. The others count at most what they took."""
    from weightsync.membership.membership import StragglerPolicy

    policy = StragglerPolicy(slow_factor=3.0, slow_floor=0.05, window=3, on_slow="evict")
    four = _members("a", "b", "c", "d")
    own = dict.fromkeys("abcd", 0.005)

    def bounds(low: dict[str, float], high: dict[str, float]) -> dict[str, tuple[float, float]]:
        return {m: (low[m], high[m]) for m in low}

    low = {"a": 0.6, "b": 0.01, "c": 0.01, "d": 0.01}
    high = {"a": 0.62, "b": 0.6, "c": 0.61, "d": 0.6}
    assert all(four.slow_members(policy, own, bounds(low, high)) == {} for _ in range(6))
    alone = _members("a", "b", "c", "d")  # against the others' lower bounds, the honest one looked slow
    assert [set(alone.slow_members(policy, low)) for _ in range(3)] == [set(), set(), {"a"}]
    slow = _members("a", "b", "c", "d")  # a link really slower than the policy allows is still found
    low, high = {"a": 6.0, "b": 0.01, "c": 0.01, "d": 0.01}, {"a": 6.1, "b": 0.6, "c": 0.6, "d": 0.6}
    for _ in range(2):
        assert slow.slow_members(policy, own, bounds(low, high)) == {}
    assert set(slow.slow_members(policy, own, bounds(low, high))) == {"a"}
    # the others' loose upper bounds on their links never hide a member slow on its own time
    busy = _members("a", "b", "c", "d")
    slow_own = {"a": 1.0, "b": 0.1, "c": 0.1, "d": 0.1}
    loose = bounds(dict.fromkeys("abcd", 0.01), dict.fromkeys("abcd", 2.0))
    assert [set(busy.slow_members(policy, slow_own, loose)) for _ in range(3)] == [set(), set(), {"a"}]


@pytest.mark.skipif(client_mod.SO_TIMESTAMPNS is None, reason="kernel receive stamps are read on Linux x86-64/arm64")
def test_a_probe_is_timed_by_when_its_bytes_arrived_not_by_when_the_reader_read_them() -> None:
    """On 2 cores with 9 processes a member's reader thread waited its turn mid-probe, its measure
    came out several milliseconds long, x160 for a 20 MiB version, and a healthy generator of 8 on
    equal links was evicted as 3.3x slow (CI, tests/test_netns.py). The kernel stamps each segment
    as it arrives: a reader that comes late measures the gap in the arrivals, and nothing else."""
    listener = socket.create_server(("127.0.0.1", 0))
    writer = socket.create_connection(listener.getsockname())
    reader, _ = listener.accept()
    try:
        assert client_mod._stamp_arrivals(reader)
        writer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        body = bytes(range(256)) * 64
        half, gap = len(body) // 2, 0.3

        def waited() -> tuple[bytes, float | None]:
            """A reader waiting for the frame: the second half comes ``gap`` after the first."""
            got: list[tuple[bytes, float | None]] = []
            entered = threading.Event()

            def read() -> None:
                entered.set()
                got.append(client_mod._read_stamped_frame(reader, MAX_FRAME))

            waiting = threading.Thread(target=read)
            waiting.start()
            assert entered.wait(10)
            writer.sendall(HEADER.pack(len(body)) + body[:half])
            time.sleep(gap)
            writer.sendall(body[half:])
            waiting.join(10)
            assert got and got[0][0] == body
            return got[0]

        # the kernel may hand a read no stamp: it turns arrival stamps on for the whole host when
        # the first socket asks, from a work item that a loaded machine runs late (this test failed
        # so under two pytest workers). A probe then has no measure, never a wrong one. One of
        # three frames must come stamped, and measure the gap
        measures = [seconds for _data, seconds in (waited() for _ in range(3))]
        stamped = [s for s in measures if s is not None]
        assert stamped, measures
        assert all(gap * 0.8 <= s <= gap + 0.2 for s in stamped), measures
        # the same arrivals, and the reader is held up after the header (the GIL, the scheduler):
        # the hold-up is not counted
        writer.sendall(HEADER.pack(len(body)) + body[:half])
        header, first = client_mod._recv_stamped(reader, HEADER.size)
        time.sleep(gap)
        writer.sendall(body[half:])
        time.sleep(gap)  # the reader comes back long after the last bytes came
        rest, last = client_mod._recv_stamped(reader, client_mod.frame_length(header, MAX_FRAME))
        assert rest == body and first is not None and last is not None
        assert gap * 0.8 <= last - first <= gap + 0.2, last - first  # the reader's own wait: 2 * gap
        # a frame that came at once measures next to nothing, however late it is read
        writer.sendall(HEADER.pack(len(body)) + body)
        time.sleep(gap)
        data, seconds = client_mod._read_stamped_frame(reader, MAX_FRAME)
        assert data == body and seconds is not None and seconds < 0.1, seconds
    finally:
        for sock in (writer, reader, listener):
            sock.close()


def test_relay_blame_strikes_a_relay_on_two_members_word_and_never_on_one() -> None:
    """gloo's binomial tree over the publisher (0) and members 1..n: 3 and 5 hear from 1, 6 from 2.
    A relay is struck on two members' word; one member's word moves it under the publisher, where
    bytes it calls corrupt are its own; an accuser of two relays nobody else accused pays."""
    from weightsync.membership.blame import RelayBlame

    def parent(r: int) -> int | None:
        return r - (1 << (r.bit_length() - 1)) if r > 0 else None

    group = ("r1", "r2", "r3", "r4", "r5", "r6")
    # r1 forwards corrupted bytes: its children 3 and 5 were corrupt through the tree, intact directly
    assert set(RelayBlame().judge(group, {"r3", "r5"}, set(), parent).struck) == {"r1"}
    # r3 is corrupt itself (again when sent directly): nobody else is suspected
    assert RelayBlame().judge(group, {"r3"}, {"r3"}, parent).struck == {}
    # a bad receiving NIC on r2 corrupts what it forwards to r6 as well: r2 is corrupt again directly,
    # r6 is not, and above r6 the first intact copy is the publisher's: nobody but r2 itself
    assert RelayBlame().judge(group, {"r2", "r6"}, {"r2"}, parent).struck == {}
    # straight from the publisher: no relay to blame, the member's own word (or link)
    assert set(RelayBlame().judge(group, {"r1"}, set(), parent).struck) == {"r1"}
    assert RelayBlame().judge(group, {"r3"}, set(), lambda r: None).struck == {}  # an unknown tree (NCCL)

    # one accuser: no strike; it is swapped right under the publisher, and the next child of r1 decides
    blame = RelayBlame()
    first = blame.judge(group, {"r3"}, set(), parent)
    assert first.struck == {} and first.accused == {"r1": ("r3",)} and first.swaps == (("r3", "r2"),)
    moved = ("r1", "r3", "r2", "r4", "r5", "r6")
    second = blame.judge(moved, {"r2"}, set(), parent)  # r1 corrupts its new child too: evidence
    assert set(second.struck) == {"r1"} and second.evict == ()
    assert blame.judge(moved, {"r5"}, set(), parent).evict == ("r1",)
    # a liar at r3 framing r1: moved under the publisher, its next complaint strikes itself, twice evicts it
    liar = RelayBlame()
    liar.judge(group, {"r3"}, set(), parent)
    assert set(liar.judge(moved, {"r3"}, set(), parent).struck) == {"r3"}
    assert liar.judge(moved, {"r3"}, set(), parent).evict == ("r3",) and liar.strikes("r1") == 0
    # a liar that accuses one relay, then another nobody else accused: it pays
    framer = RelayBlame()
    framer.judge(group, {"r3"}, set(), parent)  # r3 accuses r1
    assert set(framer.judge(("r1", "r2", "r4", "r5", "r6", "r3"), {"r3"}, set(), parent).struck) == {"r3"}  # r2


def test_a_failed_works_error_leaves_no_frame_holding_the_work() -> None:
    """A gloo work keeps its error, and when our store raised it inside the backend it is the very
    Python object re-raised by ``wait``. Were it re-raised as is, its traceback would hold the
    waiting frame and that frame the work: a cycle through C++ the collector never sees, which kept
    a whole gloo context (thread, epoll, pipe, sockets) alive per failure (the soak test's
    descriptor count)."""
    import gc

    from weightsync import _torch_compat as compat

    class Work:  # what a failed gloo work does: raise the same stored exception on every wait
        def __init__(self, error: BaseException) -> None:
            self.error = error

        def wait(self, _timeout: object) -> bool:
            raise self.error

    for stored, raised in ((RuntimeError("wait timeout for rendezvous keys ['k']"), TimeoutError),
                           (ValueError("Connection closed by peer"), ValueError)):
        work = Work(stored)
        with pytest.raises(raised) as info:
            compat.wait_work(work, 1.0)
        assert info.value is not stored and str(stored) in str(info.value)
        assert stored.__traceback__ is None  # nothing of the waiting frames hangs off the work's error
        del info
        gc.collect()
        assert not [r for r in gc.get_referrers(work) if type(r).__name__ == "frame"
                    and r.f_code.co_name == "wait_work"]


def test_trainer_ranks_tell_a_key_timeout_from_a_lost_store_by_type_never_by_message() -> None:
    """A wait slice without the key is looked at again until the deadline (SyncTimeout); any
    other store failure is rank 0 gone at once, whatever its message says."""
    from weightsync._errors import KeyTimeout, StoreError
    from weightsync.errors import PublisherGone, SyncTimeout
    from weightsync.membership.ranks import Ranks
    from weightsync.recorder.recorder import FlightRecorder

    class Store:
        def __init__(self, error: BaseException) -> None:
            self.error, self.waits = error, 0

        def set(self, key: str, value: bytes) -> None: ...

        def check(self, keys: list[str]) -> bool:
            return False

        def wait(self, keys: list[str], timeout: object) -> None:
            self.waits += 1
            raise self.error

    rec = FlightRecorder(capacity=16).scope("c", "rank-0")
    timing_out = Store(KeyTimeout("wait timeout for rendezvous keys"))
    with pytest.raises(SyncTimeout, match=r"trainer ranks \[1\] did not answer"):
        Ranks("c", 0, 2, timing_out, rec, 1.0).lanes(0.3)
    assert timing_out.waits >= 1
    for error in (StoreError("rendezvous store unreachable: closed"), RuntimeError("a timeout, it says")):
        lost = Store(error)
        with pytest.raises(PublisherGone, match="trainer rank 0 cannot be reached"):
            Ranks("c", 0, 2, lost, rec, 1.0).lanes(30.0)
        assert lost.waits == 1


def test_the_engine_table_counts_each_member_once_per_version_and_keeps_a_few_versions() -> None:
    from weightsync.control.engines import KEEP_VERSIONS, EngineTable, disagrees

    table = EngineTable()
    assert table.report("a", 1, "L", "x") == {"x": 1}
    assert table.report("b", 1, "L", "x") == {"x": 2}
    assert table.report("c", 1, "L", "y") == {"x": 2, "y": 1}
    assert table.report("c", 1, "L", "x") == {"x": 3}  # a member replaces its own report
    assert table.report("c", 1, "M", "z") == {"z": 1}  # ... under any layout: one entry per member
    assert table.report("a", 1, "L", "x") == {"x": 2}
    for version in range(2, 2 + 3 * KEEP_VERSIONS):  # "c" claims far-ahead versions: only its own go
        table.report("c", version, "L", "x")
    assert len(table._entries["c"]) == KEEP_VERSIONS
    assert table.report("b", 1, "L", "x") == {"x": 2}  # "a" and "b" still count for version 1
    with pytest.raises(ValueError, match="at most"):
        table.report("a", 99, "L" * 1000, "x")
    table.forget("a")
    assert "a" not in table._entries and table.report("b", 1, "L", "x") == {"x": 1}
    # who loads again: the minority, and on a tie the later reporter (checked against nothing before)
    assert disagrees({"x": 2, "y": 1}, "y") and not disagrees({"x": 2, "y": 1}, "x")
    assert disagrees({"x": 1, "y": 1}, "y") and not disagrees({"x": 1}, "x")


def _uplinks(orders: list[tuple[str, ...]]) -> dict[str, float]:
    """Versions' worth of bytes each member forwards when every lane (1/len(orders) of a version)
    is broadcast down gloo's binomial tree in its order (rank r forwards to r + 2^k for every
    2^k > r, while that is a rank: the tree of GroupPlane.broadcast_parent)."""
    out: dict[str, float] = {}
    for order in orders:
        n = len(order)
        for pos, member in enumerate(order):
            rank, children = pos + 1, 0
            step = 1 << rank.bit_length()
            while rank + step <= n:
                children, step = children + 1, step * 2
            out[member] = out.get(member, 0.0) + children / len(orders)
    return out


@pytest.mark.parametrize("world", [2, 4, 8])
def test_lanes_put_different_generators_first_so_no_one_relays_in_every_lane(world: int) -> None:
    for n in (3, 4, 5, 8, 12, 16, 32, 128):
        joined = tuple(f"gen{i}" for i in reversed(range(n)))  # any join order
        orders = [lane_order(joined, rank, world) for rank in range(world)]
        assert all(sorted(o) == sorted(joined) for o in orders)  # each lane's group: every member once
        assert orders == [lane_order(tuple(sorted(joined)), rank, world) for rank in range(world)]  # order-free
        relaying = {m: sum(1 for o in orders if _uplinks([o])[m] > 0) for m in joined}
        assert max(relaying.values()) < world, (n, relaying)
        if world == 2:
            assert max(relaying.values()) == 1
        same = _uplinks([tuple(sorted(joined))] * world)  # every lane in one order: the same relays
        assert max(_uplinks(orders).values()) <= max(same.values()) / 2, (n, world)
    assert lane_order(("b", "a", "c"), 0, 1) == ("b", "a", "c")  # one lane keeps its join order


def test_a_links_least_is_never_above_the_fastest_of_its_last_round_trips() -> None:
    """On the emulated cluster (8 equal 300 Mbit/s links) a shaper whose tokens the version had
    just used paced one member's next probe to 7.5 ms while rested links passed theirs in 2 ms:
    scaled to the version its least (1.2 s) was above its own most (0.31 s) and past 3x the
    others' most, a healthy member flagged slow for that version (3 in a row evict it)."""
    from weightsync.control.server import link_bounds
    from weightsync.membership.membership import StragglerPolicy

    assert link_bounds(0.0075, [0.0020, 0.0031, 0.0080]) == (0.0020, 0.0020)
    assert link_bounds(0.0004, [0.0020, 0.0031]) == (0.0004, 0.0020)  # a burst: below, kept
    policy = StragglerPolicy(slow_factor=3.0, slow_floor=0.05, window=3, on_slow="evict")
    scale = 160  # a 20 MiB version against 128 KiB probes
    newest = {"g2": 0.0075, **{f"g{i}": 0.00003 for i in (0, 1, 3, 4, 5, 6, 7)}}  # the others: bursts
    trips = {"g2": [0.00196, 0.0031, 0.0080], **{f"g{i}": [0.0019, 0.0021, 0.0023] for i in (0, 1, 3, 4, 5, 6, 7)}}
    own = dict.fromkeys(newest, 0.003)

    def links(clamped: bool) -> dict[str, tuple[float, float]]:
        out = {}
        for m in newest:
            least, most = link_bounds(newest[m], trips[m]) if clamped else (newest[m], min(trips[m]))
            out[m] = (least * scale, most * scale)
        return out

    unclamped = _members(*newest)
    assert [set(unclamped.slow_members(policy, own, links(False))) for _ in range(3)] == [set(), set(), {"g2"}]
    honest = _members(*newest)
    assert all(honest.slow_members(policy, own, links(True)) == {} for _ in range(6))
    # a link slower than the policy allows is slow in every round trip: still found
    trips["g2"], newest["g2"] = [0.026, 0.027, 0.030], 0.028
    slow = _members(*newest)
    assert [set(slow.slow_members(policy, own, links(True))) for _ in range(3)] == [set(), set(), {"g2"}]
