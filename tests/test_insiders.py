"""Tier 3: insiders. An admitted member (it knows the secret, it joined like any other) that
lies, writes what it should not, floods what it may use, or corrupts what it relays; and a
flood at the door. Each test is one row of docs/security.md's insider table: the honest
members' outcome is asserted (every version delivered bit-exact, nobody honest evicted), and
each failed on the code before that table was made true.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import weightsync as ws
from tests.conftest import Procs
from tests.statedicts import digests
from weightsync import _wire
from weightsync.control import rendezvous
from weightsync.planes.group.plane import reconfigure_enabled
from weightsync.testing import Faults, inject

# a busy-loop process beside every test: who is slow, dead or to blame is decided on a loaded machine
pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(180), pytest.mark.usefixtures("cpu_hog")]
FAST = {"timeout": 5.0, "heartbeat_interval": 0.25}


class Insider:
    """A real Subscriber that joins and follows like any member, with a hand on its own control
    connection: it sees its Go messages (the generation's rendezvous token and uuid) and sends
    what the test says, as a member whose process was taken over would."""

    def __init__(self, channel: str, address: str, member_id: str = "insider", **kwargs: Any) -> None:
        self.sub = ws.Subscriber(channel, address=address, member_id=member_id, timeout=5.0, **kwargs)
        self.channel, self.member_id = channel, member_id
        self.gos: list[_wire.Go] = []
        self.client: Any = None
        self.receiver: Any = None
        launch = self.sub._start_receiver

        def start_receiver(*args: Any, **kw: Any) -> Any:
            receiver = launch(*args, **kw)
            client = receiver._client
            dispatch = client._dispatch

            def spy(message: Any, arriving: float = 0.0) -> None:
                if isinstance(message, _wire.Go):
                    self.gos.append(message)
                dispatch(message, arriving)

            client._dispatch = spy
            self.client, self.receiver = client, receiver
            return receiver

        self.sub._start_receiver = start_receiver  # type: ignore[method-assign]

    def store(self, op: str, key: str, value: bytes = b"", timeout: float = 2.0) -> _wire.StoreResult | None:
        """One rendezvous call in this member's name; None once its connection is gone."""
        try:
            return self.client.call_store(_wire.StoreOp(rid=int.from_bytes(os.urandom(4), "big"), op=op,
                                                        keys=(key,), value=value, timeout=timeout), timeout + 2)
        except Exception:  # noqa: BLE001 - its connection closed: the attack is over
            return None

    def keys_of_others(self, go: _wire.Go) -> list[str]:
        """Every other rank's address key of ``go``'s generation (the publisher's too), both layouts."""
        mine = go.group.index(self.member_id) + 1 if self.member_id in go.group else -1
        ranks = [r for r in range(len(go.group) + 1) if r != mine]
        return ([f"ws/{self.channel}/gen/{go.generation}/{go.rendezvous}/pg/0/{r}" for r in ranks]
                + [f"ws/{self.channel}/rc/reconfigure/{go.uuid}/0/{r}" for r in ranks])


def in_thread(fn: Any, *args: Any) -> Any:
    return asyncio.get_running_loop().run_in_executor(None, fn, *args)


async def until(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout}s")
        await asyncio.sleep(0.01)  # polling a condition with a deadline


def body(version: int) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(1 << 18, dtype=torch.float32) + version, "step": torch.tensor(version)}


async def honest_followers(procs: Procs, address: str, channel: str, names: list[str]) -> list[int]:
    return [procs.spawn("subscriber", channel=channel, address=address, member=name, mode="follow",
                        deadline=120, timeout=5.0) for name in names]


def check_followers(results: list[dict], first: int, last: int) -> None:
    """Each honest follower saw a bit-exact copy of every version it read, up to ``last``."""
    for result in results:
        assert result["order"] and result["order"][-1] == last, result
        for version, seen in result["digests"].items():
            if int(version) >= first:
                assert seen == digests(body(int(version))), f"{result['member']}: version {version} differs"


# -- rows 1 and 2: the rendezvous table ------------------------------------------------------------

async def test_a_member_cannot_write_or_delete_the_other_ranks_rendezvous_keys(procs: Procs) -> None:
    """It overwrote the other ranks' gloo keys of its generation with garbage (every honest receiver
    stopped: gloo raised ValueError or MemoryError, which killed the receiver thread) or with its own
    address, or deleted them (honest members evicted as failed). Now only a member's own key is
    writable: each write is refused, the insider is disconnected after enough of them, and the
    honest members get every version."""
    rec = ws.FlightRecorder(capacity=4000)
    async with ws.Publisher("rdv", recorder=rec, **FAST) as pub:
        insider = Insider("rdv", pub.address)
        await insider.sub.start()
        await pub.wait_subscribers(1, timeout=30)
        stop = threading.Event()
        refused: list[str] = []

        def attack() -> None:  # every generation it is told of, every other rank's key, over and over
            seen = 0
            while not stop.is_set():
                for go in insider.gos[seen:]:
                    seen += 1
                    for key in insider.keys_of_others(go):
                        for op, value in (("set", b"\xff" * 64), ("set", b"127.0.0.1:1"), ("delete", b"")):
                            result = insider.store(op, key, value)
                            if result is None:
                                return
                            if not result.ok:
                                refused.append(result.error)
                stop.wait(0.001)

        attacker = threading.Thread(target=attack, daemon=True)
        attacker.start()
        workers = await honest_followers(procs, pub.address, "rdv", ["honest0", "honest1"])
        await pub.wait_subscribers(3, timeout=60)
        for v in range(6):
            report = await (await pub.put(body(v), version=v)).delivered(timeout=60)
            assert {"honest0", "honest1"} <= set(report.members), report
        stop.set()
        attacker.join(10)
        assert refused and all("may not write" in e or "not of this member" in e for e in refused), refused[:3]
        assert not [m for m in pub.evicted if m.member_id.startswith("honest")], pub.evicted
        await insider.sub.abort()
    results = [await procs.result(w, timeout=60) for w in workers]
    check_followers(results, 0, 5)


# -- row 5: key length ----------------------------------------------------------------------------

async def test_long_rendezvous_keys_are_refused_and_nothing_is_kept() -> None:
    """8 keys with 128 MiB names held 1.07 GiB in the trainer. Now a name is at most 512 bytes."""
    async with ws.Publisher("long", **FAST) as pub:
        honest = ws.Subscriber("long", address=pub.address, member_id="honest", timeout=5.0)
        insider = Insider("long", pub.address)
        await asyncio.gather(honest.start(), insider.sub.start())
        await pub.wait_subscribers(2, timeout=30)
        await until(lambda: insider.gos and insider.gos[-1].generation == pub.generation, 10, "its Go")
        go = insider.gos[-1]
        prefix = f"ws/long/gen/{go.generation}/{go.rendezvous}/pg/"
        results = [await in_thread(insider.store, "set", prefix + "x" * (16 << 20) + str(i), b"v") for i in range(8)]
        assert all(r is not None and not r.ok and "at most 512" in r.error for r in results), results
        longest = max((len(k) for k in pub._table._data), default=0)
        assert longest <= rendezvous.MAX_KEY
        await (await pub.put(body(1), version=1)).delivered(timeout=30)
        assert torch.equal((await honest.get(min_version=1, timeout=10))["w"], body(1)["w"])
        await asyncio.gather(honest.aclose(), insider.sub.abort())


# -- row 6: waits ---------------------------------------------------------------------------------

async def test_a_flood_of_waits_is_bounded_and_goes_with_its_connection() -> None:
    """300,000 waits on absent keys starved the control loop (an honest member raised PublisherGone)
    and 245 MiB stayed after the insider was evicted. Now a connection holds at most 64 waits, a
    member refused again and again is disconnected, and its waits go with its connection."""
    async with ws.Publisher("waits", **FAST) as pub:
        honest = ws.Subscriber("waits", address=pub.address, member_id="honest", timeout=5.0)
        insider = Insider("waits", pub.address)
        await asyncio.gather(honest.start(), insider.sub.start())
        await pub.wait_subscribers(2, timeout=30)
        await until(lambda: insider.gos and insider.gos[-1].generation == pub.generation, 10, "its Go")
        go = insider.gos[-1]
        prefix = f"ws/waits/gen/{go.generation}/{go.rendezvous}/pg/absent/"
        sent = 0
        for i in range(5000):  # sent without waiting for answers, as fast as its socket takes them
            try:
                insider.client.send(_wire.StoreOp(rid=10_000 + i, op="wait", keys=(prefix + str(i),), timeout=3600))
            except Exception:  # noqa: BLE001 - disconnected: the flood is over
                break
            sent += 1
        assert pub._table.waiting() <= rendezvous.MAX_MEMBER_WAITS
        await until(lambda: "insider" not in pub.members, 30, "the insider disconnected and dropped")
        await until(lambda: pub._table.waiting() == 0, 10, "its waits gone with its connection")
        for v in range(1, 4):
            await (await pub.put(body(v), version=v)).delivered(timeout=30)
        assert torch.equal((await honest.get(min_version=3, timeout=10))["w"], body(3)["w"])
        assert not honest.evicted and "honest" in pub.members and sent > rendezvous.MAX_MEMBER_WAITS
        await asyncio.gather(honest.aclose(), insider.sub.abort())


# -- row 9: hanging up in the middle of a re-form -------------------------------------------------

@pytest.mark.skipif(not reconfigure_enabled("gloo"), reason="gloo re-forms in place from torch 2.14 on")
@pytest.mark.parametrize("op, key", [("wait", "/1/0"), ("get", "/1/2")])
async def test_a_member_that_hangs_up_mid_re_form_costs_the_others_nothing(monkeypatch: pytest.MonkeyPatch,
                                                                            op: str, key: str) -> None:
    """The insider's connection closes when its re-form (gloo's, in place) has published its
    address and not yet heard everyone's: at its ``op`` on the key ending ``key`` (rank of the
    second round). Before, the end it had not reached waited about 45 s inside gloo against a
    bound of 11 s: the honest member missed two generations and was evicted as failed (seen in
    CI when a flood closed an insider at that moment), or the publisher held every version that
    long. Which end gloo leaves waiting varies from run to run; each case failed every time before."""
    armed: list[Insider] = []
    call = rendezvous.RemoteStore._call

    def hang_up(store: Any, what: str, keys: tuple[str, ...], **kw: Any) -> Any:
        if armed and store._client is armed[0].client and what == op and "/rc/" in keys[0] \
                and keys[0].endswith(key):
            armed.pop().client._close("the insider hung up mid re-form")
        return call(store, what, keys, **kw)

    monkeypatch.setattr(rendezvous.RemoteStore, "_call", hang_up)
    async with ws.Publisher("hangup", **FAST) as pub:
        honest = ws.Subscriber("hangup", address=pub.address, member_id="honest", timeout=5.0)
        await honest.start()
        await pub.wait_subscribers(1, timeout=30)
        insider = Insider("hangup", pub.address)
        armed.append(insider)
        await insider.sub.start()
        await until(lambda: not armed and any(m.member_id == "insider" for m in pub.evicted), 40,
                    "the insider hung up and was dropped")
        for v in range(1, 3):
            await (await pub.put(body(v), version=v)).delivered(timeout=30)
        assert torch.equal((await honest.get(min_version=2, timeout=10))["w"], body(2)["w"])
        assert not honest.evicted and list(pub.members) == ["honest"]
        await asyncio.gather(honest.aclose(), insider.sub.abort())


# -- row 7: a flood at the door -------------------------------------------------------------------

async def test_a_connection_flood_leaves_the_recorders_real_entries_and_joins_possible() -> None:
    """About 1,900 junk connections left only refusals in a 2,000-entry recorder; 64 half-open
    connections from one host turned every join away. Now refusals are counted per source, one
    source holds at most 16 of the 64 places, and a join turned away is told to come back."""
    rec = ws.FlightRecorder(capacity=2000)
    async with ws.Publisher("flood", recorder=rec, **FAST) as pub:
        host, _, port = pub.address.rpartition(":")
        await (await pub.put(body(0), version=0)).delivered(timeout=10)  # a real entry, before the flood

        def junk(n: int) -> None:
            for _ in range(n):
                with socket.create_connection((host, int(port)), timeout=5, source_address=("127.0.0.2", 0)) as s:
                    s.sendall(b"\x00\x00\x00\x08junkjunk")

        await in_thread(junk, 2100)  # more than the recorder holds
        held = [socket.create_connection((host, int(port)), timeout=5, source_address=("127.0.0.2", 0))
                for _ in range(64)]  # half open: they never answer the challenge
        try:
            async with ws.Subscriber("flood", address=pub.address, member_id="honest", timeout=5.0) as sub:
                await pub.wait_subscribers(1, timeout=30)
                await (await pub.put(body(1), version=1)).delivered(timeout=30)
                assert torch.equal((await sub.get(min_version=1, timeout=10))["w"], body(1)["w"])
        finally:
            for s in held:
                s.close()
        entries = rec.snapshot()
        assert any(e.op == "put" and e.version == 0 for e in entries), "the flood pushed real entries out"
        refusals = [e for e in entries if e.op == "admit" and e.state == "failed"]
        assert len(refusals) < 50, len(refusals)


async def test_a_join_turned_away_at_a_full_door_says_so() -> None:
    """A join refused because the handshake places were taken was PublisherGone ("cannot reach the
    publisher"). Now the door answers busy, the subscriber tries again, and only at its deadline
    does it give up, with a SyncTimeout saying the publisher was too busy."""
    async with ws.Publisher("door", timeout=10.0, heartbeat_interval=0.25) as pub:
        host, _, port = pub.address.rpartition(":")
        held = [socket.create_connection((host, int(port)), timeout=5) for _ in range(16)]  # the source's places
        try:
            await until(lambda: pub._control._pending_from.get("127.0.0.1", 0) >= 16, 10, "the places taken")
            with pytest.raises(ws.SyncTimeout, match="too busy to admit us"):
                await ws.Subscriber("door", address=pub.address, timeout=1.0).start()
        finally:
            for s in held:
                s.close()
        async with ws.Subscriber("door", address=pub.address, member_id="later", timeout=5.0):
            await pub.wait_subscribers(1, timeout=30)  # once the places are free, a join gets in


# -- row 8: a frame lost on the path ----------------------------------------------------------------

async def test_a_frame_out_of_sequence_closes_the_connection_at_once() -> None:
    """One dropped Ack made every later frame of that member out of sequence: it stayed mute for its
    silence bound while everyone's version stalled. Now the next frame closes its connection: it is
    known dead at once (the reason says why), and the others' versions go on."""
    rec = ws.FlightRecorder(capacity=4000)
    async with ws.Publisher("seq", recorder=rec, **FAST) as pub:
        honest = ws.Subscriber("seq", address=pub.address, member_id="honest", timeout=5.0)
        insider = Insider("seq", pub.address, member_id="lossy")
        await asyncio.gather(honest.start(), insider.sub.start())
        await pub.wait_subscribers(2, timeout=30)
        await (await pub.put(body(1), version=1)).delivered(timeout=30)
        insider.client._session.sent += 1  # as if its next frame had been lost on the way
        await until(lambda: any(m.member_id == "lossy" for m in pub.evicted), 30, "the member dropped")
        assert any(e.op == "reject" and "out of sequence" in e.error and "connection closed" in e.error
                   for e in rec.snapshot())
        assert [m.reason for m in pub.evicted if m.member_id == "lossy"] == ["dead"]
        report = await (await pub.put(body(2), version=2)).delivered(timeout=30)
        assert report.members == ("honest",)
        assert torch.equal((await honest.get(min_version=2, timeout=10))["w"], body(2)["w"])
        await asyncio.gather(honest.aclose(), insider.sub.abort())


# -- row 3: a member that lies about its own time ----------------------------------------------------

async def test_a_member_reporting_no_own_time_gets_nobody_evicted_as_slow() -> None:
    """An insider acknowledging 0 s of its own time and 0 s probe arrivals made the median of the
    others 0: an honest member a little slower than it (well within the policy's factor) was
    evicted as slow again and again. Now one member's reports cannot be the reference for another."""
    async with ws.Publisher("liar", policy=ws.StragglerPolicy(on_slow="evict"), bucket_bytes=1 << 20,
                            **FAST) as pub:
        honest = ws.Subscriber("liar", address=pub.address, member_id="honest", timeout=5.0)
        inject(honest, Faults(slow=2.0))  # honestly a bit slower: 20 ms more per bucket
        insider = Insider("liar", pub.address)
        await asyncio.gather(honest.start(), insider.sub.start())
        acknowledge = insider.receiver._acknowledge
        insider.receiver._acknowledge = lambda announce, **kw: acknowledge(
            announce, **{**kw, "seconds": 0.0, "own": 0.0})
        dispatch = insider.client._dispatch
        insider.client._dispatch = lambda message, arriving=0.0: dispatch(message, 0.0)  # probes: "instant"
        await pub.wait_subscribers(2, timeout=30)
        for v in range(8):
            await (await pub.put({"w": torch.full((1 << 20,), float(v))}, version=v)).delivered(timeout=30)
        assert pub.evicted == [], pub.evicted
        assert torch.equal((await honest.get(min_version=7, timeout=10))["w"], torch.full((1 << 20,), 7.0))
        await asyncio.gather(honest.aclose(), insider.sub.abort())


# -- row 4: a relay that corrupts what it forwards ----------------------------------------------------

SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <string.h>
#include <sys/uio.h>
/* A bad NIC on the way out: every large gloo write leaves with its first byte flipped. The
   process's own memory is untouched (a copy goes out), so its own bytes check out. */
static ssize_t (*real)(int, const struct iovec *, int);
ssize_t writev(int fd, const struct iovec *iov, int n) {
    if (!real) real = (ssize_t (*)(int, const struct iovec *, int))dlsym(RTLD_NEXT, "writev");
    for (int i = 0; i < n; i++) {
        if (iov[i].iov_len >= 65536) {
            struct iovec out[n + 1];
            unsigned char first;
            memcpy(out, iov, sizeof(struct iovec) * i);
            first = ((unsigned char *)iov[i].iov_base)[0] ^ 0xFF;
            out[i].iov_base = &first; out[i].iov_len = 1;
            out[i + 1].iov_base = (char *)iov[i].iov_base + 1; out[i + 1].iov_len = iov[i].iov_len - 1;
            memcpy(out + i + 2, iov + i + 1, sizeof(struct iovec) * (n - i - 1));
            ssize_t sent = real(fd, out, n + 1);
            return sent;
        }
    }
    return real(fd, iov, n);
}
"""


@pytest.mark.slow
async def test_a_relay_that_corrupts_what_it_forwards_is_blamed_not_its_child(procs: Procs,
                                                                              tmp_path: Path) -> None:
    """gloo's broadcast is a binomial tree: with three members, member 1 relays to member 3. A relay
    whose outgoing bytes are corrupted (here a shim on its writes) checked out itself while its
    healthy child failed every version and was evicted as failed, again and again. Now a version
    that arrives corrupted through the tree is sent again point to point in the same generation:
    the child gets it intact, and the relay above it is the one blamed."""
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler to build the corrupting shim")
    (tmp_path / "shim.c").write_text(SHIM)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(tmp_path / "shim.so"), str(tmp_path / "shim.c"),
                    "-ldl"], check=True, timeout=60)
    async with ws.Publisher("relay", bucket_bytes=256 << 10, **FAST) as pub:
        relay = procs.spawn("subscriber", channel="relay", address=pub.address, member="relay", mode="follow",
                            deadline=120, timeout=5.0, env={"LD_PRELOAD": str(tmp_path / "shim.so")})
        await pub.wait_subscribers(1, timeout=60)  # the relay first: member 1 of every generation
        workers = []
        for i in range(2):
            workers += await honest_followers(procs, pub.address, "relay", [f"honest{i}"])
            await pub.wait_subscribers(i + 2, timeout=60)
        assert pub.members[0] == "relay", pub.members
        for v in range(8):
            report = await (await pub.put(body(v), version=v)).delivered(timeout=60)
            assert "honest0" in report.members or "honest1" in report.members, report
        assert [(m.member_id, m.reason) for m in pub.evicted] == [("relay", "failed")], pub.evicted
        assert set(pub.members) == {"honest0", "honest1"}
    results = [await procs.result(w, timeout=60) for w in workers]
    check_followers(results, 0, 7)
    del relay


async def test_a_member_that_frames_its_relay_pays_and_no_honest_member_is_evicted(procs: Procs) -> None:
    """An insider at rank 3 of gloo's tree (its parent: honest rank 1) calls every tree copy
    corrupt and every point-to-point re-send intact (here its own bytes are flipped on the first
    arrival of each version, so its word is even true of what it holds). Its honest parent was
    blamed and evicted "failed" after two versions, and the liar was never struck. Its word alone
    is not evidence now: it is moved under the publisher, where bytes it calls corrupt are its own,
    and it is the one evicted; every honest member keeps every version, bit-exact."""
    async with ws.Publisher("framed", bucket_bytes=256 << 10, **FAST) as pub:
        workers = []
        for i in range(2):
            workers += await honest_followers(procs, pub.address, "framed", [f"honest{i}"])
            await pub.wait_subscribers(i + 1, timeout=60)
        procs.spawn("subscriber", channel="framed", address=pub.address, member="framer", mode="follow",
                    deadline=120, timeout=5.0, faults={"corrupt": list(range(10))})
        await pub.wait_subscribers(3, timeout=60)
        assert pub.members == ("honest0", "honest1", "framer"), pub.members  # the framer under honest0
        for v in range(8):
            report = await (await pub.put(body(v), version=v)).delivered(timeout=60)
            assert {"honest0", "honest1"} <= set(report.members), report
        assert [(m.member_id, m.reason) for m in pub.evicted] == [("framer", "failed")], pub.evicted
    results = [await procs.result(w, timeout=60) for w in workers]
    check_followers(results, 0, 7)


async def test_an_insider_cannot_outvote_honest_engines_or_grow_the_engine_table() -> None:
    """Engine digests are compared through the publisher (weightsync.integrations.vllm): an admitted
    member that reports thousands of versions, layouts and digests counts once per version, under its
    own name, and the table keeps a few versions whatever it sends; two honest engines that agree
    still see each other as the majority of their layout."""
    async with ws.Publisher("engines", **FAST) as pub:
        honest = [ws.Subscriber("engines", address=pub.address, member_id=f"h{i}", timeout=5.0) for i in range(2)]
        insider = Insider("engines", pub.address)
        await asyncio.gather(*(s.start() for s in honest), insider.sub.start())
        try:
            await pub.wait_subscribers(3, timeout=30)
            layout = "Llama|bf16|rank 0 of 1|cuda"
            assert await honest[0].compare_engine(7, layout, "good") == {"good": 1}
            for n in range(2000):  # every version, layout and digest it likes, in its own name
                report = _wire.EngineReport(rid=-(10**6 + n), version=7 + n % 50, layout=layout if n % 2 else f"l{n}",
                                            digest=f"bad{n}")
                tally = await in_thread(insider.client.call, report, 5.0)
                assert sum(tally.counts.values()) <= 3  # never more than the members that reported
            counts = await honest[1].compare_engine(7, layout, "good")
            assert counts.get("good") == 2 and sum(n for d, n in counts.items() if d != "good") <= 1
            table = pub._control.engines._entries
            assert set(table) <= {"h0", "h1", "insider"} and all(len(versions) <= 4 for versions in table.values())
            with pytest.raises(ws.PublisherGone):  # a field past its bound is refused by name
                await honest[0].compare_engine(7, "x" * 10_000, "good", timeout=5)
        finally:
            await asyncio.gather(*(s.aclose() for s in honest), insider.sub.aclose())


async def test_a_member_that_never_answers_a_commit_is_evicted_and_the_others_stop_paying() -> None:
    """activation="all": an insider stages every version and keeps beating, but never answers a
    Commit. Every version's delivery waited the full deadline for it and it was never evicted.
    Now it is the one evicted (after one version), and the report names only those that exposed
    the version: the honest member's every version, bit-exact."""
    timeout = 3.0
    async with ws.Publisher("commit", activation="all", encoding="full", timeout=timeout,
                            heartbeat_interval=0.25) as pub:
        honest = ws.Subscriber("commit", address=pub.address, member_id="honest", timeout=timeout)
        liar = ws.Subscriber("commit", address=pub.address, member_id="liar", timeout=timeout)
        inject(liar, Faults(ignore_commits=True))
        async with honest, liar:
            await pub.wait_subscribers(2, timeout=30)
            reports = []
            for v in range(4):
                sd = {"w": torch.full((4096,), float(v))}
                reports.append(await (await pub.put(sd, version=v)).delivered(timeout=timeout * 4 + 30))
                got = await honest.get(min_version=v, timeout=30)
                assert digests(got) == digests(sd)
            assert all(r.members == ("honest",) for r in reports), reports  # never the one that exposed nothing
            assert [(m.member_id, m.reason) for m in pub.evicted] == [("liar", "commit unanswered")]
            assert liar.version is None  # it never exposed anything
            with pytest.raises(ws.Evicted):
                await liar.get(timeout=30)
