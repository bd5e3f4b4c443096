"""Tier 3: an outsider on the publisher's network, speaking the wire format by hand.

Each test is one attack from docs/security.md. With the secret configured every one fails, the
channel keeps serving its real members bit-exact, and the attempt lands in the flight recorder.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys

import pytest
import torch

import weightsync as ws
from tests.outsider import Outsider
from weightsync import _wire
from weightsync.control import auth
from weightsync.control.framing import TO_CLIENT, TO_SERVER, BadFrame, Session

# with a busy-loop process beside each test, as the insiders' (tests/test_insiders.py)
pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120), pytest.mark.usefixtures("cpu_hog")]
SECRET = "s3cret"


async def secured(rec: ws.FlightRecorder, n: int = 1) -> tuple[ws.Publisher, list[ws.Subscriber]]:
    pub = ws.Publisher("sec", secret=SECRET, timeout=5, heartbeat_interval=0.25, recorder=rec)
    await pub.start()
    subs = [ws.Subscriber("sec", address=pub.address, secret=SECRET, member_id=f"gen{i}", timeout=5)
            for i in range(n)]
    await asyncio.gather(*(s.start() for s in subs))
    await pub.wait_subscribers(n, timeout=10)
    return pub, subs


async def still_serves(pub: ws.Publisher, subs: list[ws.Subscriber], version: int) -> None:
    sd = {"w": torch.full((1000,), float(version))}
    report = await (await pub.put(sd, version=version)).delivered(timeout=20)
    assert set(report.members) == {s.member_id for s in subs}
    for sub in subs:
        assert torch.equal((await sub.get(min_version=version, timeout=10))["w"], sd["w"])


def in_thread(fn, *args):
    return asyncio.get_running_loop().run_in_executor(None, fn, *args)


def fingerprint(pub: ws.Publisher) -> _wire.Fingerprint:
    return auth.fingerprint(pub.backend, pub.device)


async def test_a_replayed_join_is_refused_on_another_connection() -> None:
    """The old HMAC covered channel and member id only: a Join popped and re-pushed got in.
    Now the proof binds the server's fresh nonce: the captured Join is worthless elsewhere."""
    rec = ws.FlightRecorder(capacity=500)
    pub, subs = await secured(rec)
    try:
        insider = Outsider(pub.address)  # a legitimate join, captured on the wire
        reply = await in_thread(insider.join, "copycat", fingerprint(pub), SECRET.encode())
        assert isinstance(reply, _wire.Admit)
        captured = insider.last_join
        thief = Outsider(pub.address)
        await in_thread(thief.read)  # its own challenge, with a different nonce
        thief.send(captured)
        reply = await in_thread(thief.read)
        assert isinstance(reply, _wire.Deny) and reply.kind == "token"
        assert await in_thread(thief.closed_within, 5.0)
        assert any(e.op == "admit" and "wrong token" in e.error for e in rec.snapshot())
        insider.close()
        await still_serves(pub, subs, 1)
    finally:
        await asyncio.gather(*(s.aclose() for s in subs))
        await pub.aclose()


async def test_without_the_secret_nothing_but_a_join_is_heard() -> None:
    """Forged Leave, Ack, Ready and rendezvous writes from a connection that was never admitted:
    the server wants a Join first and closes the connection on anything else."""
    rec = ws.FlightRecorder(capacity=500)
    pub, subs = await secured(rec)
    try:
        for forged in (_wire.Leave(member_id="gen0"),
                       _wire.Ack(generation=1, seq=0, member_id="gen0", version=9, ok=False, error="x"),
                       _wire.Ready(generation=2, member_id="gen0"),
                       _wire.StoreOp(rid=1, op="set", keys=("ws/sec/gen/2/x/pg/0",), value=b"evil")):
            outsider = Outsider(pub.address)
            await in_thread(outsider.read)
            outsider.send(forged)
            assert await in_thread(outsider.closed_within, 5.0), forged
        wrong = Outsider(pub.address)
        reply = await in_thread(wrong.join, "mallory", fingerprint(pub), b"not-the-secret")
        assert isinstance(reply, _wire.Deny) and reply.kind == "token"
        odd = Outsider(pub.address)  # the right secret, a transport nobody serves
        reply = await in_thread(odd.join, "odd", fingerprint(pub), SECRET.encode(), None, "telepathy")
        assert isinstance(reply, _wire.Deny) and reply.kind == "handshake" and "telepathy" in reply.reason
        assert pub.members == ("gen0",) and pub.evicted == []
        failures = [e.error for e in rec.snapshot() if e.op == "admit" and e.state == "failed"]
        # every kind of attempt recorded (the same source and reason again is counted, not listed)
        assert any("handshake failed" in f for f in failures) and any("wrong token" in f for f in failures)
        assert any("telepathy" in f for f in failures)
        await still_serves(pub, subs, 1)
    finally:
        await asyncio.gather(*(s.aclose() for s in subs))
        await pub.aclose()


async def test_an_admitted_member_cannot_speak_for_another() -> None:
    """An insider with the secret still speaks only for itself: its forged Ack for gen0 and a
    replayed frame are dropped and recorded; gen0 stays and gets every version."""
    rec = ws.FlightRecorder(capacity=500)
    pub, subs = await secured(rec)
    try:
        mallory = Outsider(pub.address)
        assert isinstance(await in_thread(mallory.join, "mallory", fingerprint(pub), SECRET.encode()),
                          _wire.Admit)
        mallory.send(_wire.Ack(generation=pub.generation, seq=0, member_id="gen0", version=1, ok=False))
        frame = mallory.session.seal(_wire.Beat())
        mallory.send_raw(frame)
        mallory.send_raw(frame)  # the same frame again: a replay
        for _ in range(100):
            if sum(e.op == "reject" for e in rec.snapshot()) >= 2:
                break
            await asyncio.sleep(0.05)  # polling the recorder with a bound, not synchronisation
        rejects = [e.error for e in rec.snapshot() if e.op == "reject"]
        assert any("gen0" in r for r in rejects) and any("out of sequence" in r for r in rejects)
        mallory.close()
        await still_serves(pub, subs, 1)
        assert "gen0" in pub.members
    finally:
        await asyncio.gather(*(s.aclose() for s in subs))
        await pub.aclose()


async def test_an_insider_cannot_forge_log_lines_with_its_member_id(caplog: pytest.LogCaptureFixture) -> None:
    """A member id may not carry newlines or terminal escapes: with them an admitted member wrote
    lines such as "gen0 evicted (dead)" into the publisher's log and drove the operator's terminal.
    Such a Join is denied (with the secret: an insider), and nothing of it reaches a log line raw."""
    rec = ws.FlightRecorder(capacity=500)
    pub, subs = await secured(rec)
    try:
        for evil in ("mallory\nWARNING gen0 evicted (dead)", "m\x1b[2J\x1b]0;pwned\x07", "a b", "\u202egen0"):
            mallory = Outsider(pub.address)
            reply = await in_thread(mallory.join, evil, fingerprint(pub), SECRET.encode())
            assert isinstance(reply, _wire.Deny) and "letters, digits" in reply.reason, reply
            mallory.close()
        assert all("\x1b" not in r.getMessage() and "\nWARNING" not in r.getMessage() for r in caplog.records)
        assert pub.members == ("gen0",) and pub.evicted == []
        await still_serves(pub, subs, 1)
    finally:
        await asyncio.gather(*(s.aclose() for s in subs))
        await pub.aclose()


async def test_forged_and_replayed_frames_to_a_subscriber_are_dropped() -> None:
    """The subscriber's side of the same rule: a forged Announce (version 10**15, empty
    manifest) or a replayed command never reaches the receiver."""
    key = b"k" * 32
    publisher = Session(outgoing=TO_CLIENT, incoming=TO_SERVER, key=key)
    subscriber = Session(outgoing=TO_SERVER, incoming=TO_CLIENT, key=key)
    forger = Session(outgoing=TO_CLIENT, incoming=TO_SERVER, key=b"x" * 32)
    evil = _wire.Announce(generation=1, seq=0, version=10**15, manifest=_wire.Manifest((), 0), bucket_bytes=4096,
                          num_buckets=0)
    with pytest.raises(BadFrame, match="MAC"):
        subscriber.open(forger.seal(evil)[4:], _wire.server_decoder)
    real = publisher.seal(_wire.Beat())
    assert subscriber.open(real[4:], _wire.server_decoder) == _wire.Beat()
    with pytest.raises(BadFrame, match="out of sequence"):
        subscriber.open(real[4:], _wire.server_decoder)
    unsigned = Session(outgoing=TO_CLIENT, incoming=TO_SERVER)  # no key: no MAC at all
    unsigned.sent = subscriber.received
    with pytest.raises(BadFrame, match="MAC"):
        subscriber.open(unsigned.seal(evil)[4:], _wire.server_decoder)
    assert subscriber.open(publisher.seal(_wire.Beat())[4:], _wire.server_decoder) == _wire.Beat()


async def test_junk_connections_are_bounded_and_the_publisher_keeps_serving() -> None:
    """A flood of half-open connections and oversized frames: each is closed, nothing is
    allocated for a length the bound refuses, and members are served meanwhile."""
    rec = ws.FlightRecorder(capacity=2000)
    pub, subs = await secured(rec)
    try:
        for _ in range(20):
            huge = Outsider(pub.address)
            await in_thread(huge.read)
            huge.send_raw((1 << 30).to_bytes(4, "big") + b"x" * 16)  # "a 1 GiB Join follows"
            assert await in_thread(huge.closed_within, 5.0)
        idle = [Outsider(pub.address) for _ in range(30)]  # connect, never answer the challenge
        await still_serves(pub, subs, 1)
        for o in idle:
            o.close()
        # one source, one reason: the first in full, the other 19 as one count (at the latest at close)
        assert sum(e.op == "admit" and "exceeds" in e.error for e in rec.snapshot()) == 1
    finally:
        await asyncio.gather(*(s.aclose() for s in subs))
        await pub.aclose()
    assert any(e.op == "admit" and "19 more connections refused" in e.error and "exceeds" not in e.error
               for e in rec.snapshot())


async def test_listening_beyond_loopback_without_a_secret_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="weightsync"):
        async with ws.Publisher("open", address="0.0.0.0:0", timeout=5) as pub:
            assert pub.address is not None
        async with ws.Publisher("closed", address="0.0.0.0:0", secret=SECRET, timeout=5):
            pass
    warnings = [r.getMessage() for r in caplog.records if "without a secret" in r.getMessage()]
    assert len(warnings) == 1 and "'open'" in warnings[0]


async def test_the_orchestrator_never_signals_a_process_it_did_not_start() -> None:
    """A Join used to name any pid, and ``stop_old`` SIGKILLed it on eviction."""
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        orch = ws.LocalProcessOrchestrator([sys.executable, "-c", "pass"], stop_old=True)
        await orch.replace(ws.MemberInfo("victim", host="", pid=bystander.pid, reason="dead"))
        await asyncio.sleep(0.2)  # give a (wrongly) sent signal time to land before checking
        assert bystander.poll() is None
        own = orch.processes()[0]
        await orch.replace(ws.MemberInfo("r1", host="", pid=own.pid, reason="slow"))
        assert own.wait(timeout=10) is not None  # its own child may be stopped
        await orch.aclose()
    finally:
        os.kill(bystander.pid, signal.SIGKILL)
        bystander.wait(timeout=10)
