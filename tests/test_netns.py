"""Generators on other "hosts": network namespaces behind shaped links (benchmarks/netns.py).

The publisher runs in this process, in the root namespace, on the cluster's bridge address;
each subscriber is a ``tests.workers`` process inside its own namespace, with its own address
and link rate. Skipped, with the reason, where namespaces cannot be made (not root, no
iproute2). Every test closes its cluster, and the last one checks that a cluster whose owner
is killed with -9 leaves nothing behind either.
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch

import weightsync as ws
from benchmarks import netns
from tests.conftest import REPO
from tests.statedicts import digests, mixed_state_dict

REASON = netns.unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.netns, pytest.mark.timeout(240),
              pytest.mark.skipif(REASON is not None, reason=f"no emulated cluster here: {REASON}")]


class Hosts:
    """Worker processes inside the cluster's hosts: results as msgspec JSON files."""

    def __init__(self, cluster: netns.Cluster, tmp: Path) -> None:
        self.cluster, self.tmp = cluster, tmp
        self.procs: dict[int, tuple[subprocess.Popen[bytes], Path, Path]] = {}

    def spawn(self, host: int, **spec: object) -> None:
        out, log = self.tmp / f"host{host}.json", self.tmp / f"host{host}.log"
        env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
        env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        # an emulated other host receives through the group, as a real one would (it shares our kernel)
        body = msgspec.json.encode({"role": "subscriber", "result": str(out), "transport": "group", **spec}).decode()
        with open(log, "wb") as fh:
            proc = self.cluster.popen(host, [sys.executable, "-m", "tests.workers", body], env=env, cwd=REPO,
                                      stdout=fh, stderr=subprocess.STDOUT)
        self.procs[host] = (proc, out, log)

    async def result(self, host: int, timeout: float) -> dict:
        proc, out, log = self.procs[host]
        code = await asyncio.to_thread(wait, proc, timeout)
        assert code == 0 and out.exists(), f"host {host} exited {code}; log:\n{log.read_text()[-3000:]}"
        return msgspec.json.decode(out.read_bytes())


def wait(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


@pytest.fixture
def cluster_of(tmp_path: Path) -> Iterator:
    made: list[netns.Cluster] = []

    def make(*rates: float | None) -> tuple[netns.Cluster, Hosts]:
        cluster = netns.Cluster(rates)
        made.append(cluster)
        return cluster, Hosts(cluster, tmp_path)

    yield make
    for cluster in made:
        cluster.close()
    assert not [ns for ns in netns.namespaces() if ns.startswith(f"ws-{os.getpid()}-")]


@pytest.mark.asyncio
async def test_subscribers_on_other_hosts_join_by_the_advertised_address(cluster_of) -> None:
    """Nobody sets GLOO_SOCKET_IFNAME: each end's gloo binds the address its control
    connection uses (the bridge for the publisher, eth0 in each namespace)."""
    cluster, hosts = cluster_of(None, 1000)
    versions = [mixed_state_dict(7 + v, mib=2) for v in range(3)]
    async with ws.Publisher("remote", address=f"{cluster.trainer_ip}:0", timeout=15) as pub:
        assert pub.address.startswith(cluster.trainer_ip)
        for h in range(2):
            hosts.spawn(h, channel="remote", address=pub.address, member=f"gen{h}", until_version=2, deadline=90)
        await pub.wait_subscribers(2, timeout=90)
        for v, sd in enumerate(versions):
            await (await pub.put(sd, version=v)).delivered(timeout=60)
        results = [await hosts.result(h, 90) for h in range(2)]
    for result in results:
        assert result["order"][-1] == 2
        for version, seen in result["digests"].items():
            assert seen == digests(versions[int(version)])


def test_a_hosts_acknowledgements_leave_in_their_own_class_ahead_of_its_bulk(cluster_of) -> None:
    """A host that receives 4 MiB sends back only acknowledgements: they leave through the
    link's acknowledgement class (IP packets under 64 bytes), and its bulk class carries none."""
    cluster, _ = cluster_of(200)
    server = socket.create_server((cluster.trainer_ip, 0))
    server.settimeout(60)
    reader = cluster.popen(0, [sys.executable, "-c", "import socket, sys\n"
                               "s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)\n"
                               "n = 0\n"
                               "while piece := s.recv(1 << 16):\n    n += len(piece)\n"
                               "print(n)", cluster.trainer_ip, str(server.getsockname()[1])],
                           stdout=subprocess.PIPE)
    with server:
        conn = server.accept()[0]
    with conn:
        conn.settimeout(60)
        conn.sendall(bytes(4 << 20))
    stdout, _ = reader.communicate(timeout=60)
    assert int(stdout) == 4 << 20
    sent = cluster.sent_by_class(0)
    acks_bytes, acks = sent["1:5"]
    assert acks > 20 and acks_bytes / acks < 64 + 14, sent  # an Ethernet header on each
    assert sent["1:10"][0] < 4 << 10, sent  # nothing of size went the bulk way (ARP, perhaps)


@pytest.mark.asyncio
@pytest.mark.usefixtures("cpu_hog")
async def test_a_generator_behind_a_20x_slower_link_is_evicted_as_slow_the_rest_keep_pace(cluster_of) -> None:
    """One link at a twentieth of the others' rate. gloo's broadcast is a binomial tree: a relay
    waits as long as its slow child, so per-member receive times cannot say whose link it is.
    The publisher's probes (a padded message straight to each member, timed) can: the slow
    one is evicted as slow, nobody else, no version is held past its deadline, and then the
    rest go at their links' pace. With a busy loop beside it: one healthy member's late probe
    once broke the slow one's streak for 12 versions (1 run in 3); links are judged on their
    best of the last three probes now (a loaded machine only ever delays a probe). Three healthy
    members, not two: a link is judged against the upper median of the others' links, which of
    two is the worse one, and one healthy member's jittery probes (128 KiB, scaled 32 times) then
    hid the slow link for 12 versions, 1 run in 5, before and after issue 53's changes; the
    median of three is what the rule is for. And 20x, not 10x: a probe's least time for the slow
    link came out near 0.4 s (the shaper's burst), against healthy ones' most near 0.09-0.18 s
    under load (their round trips scaled 32 times), at the rule's 3x plus 0.05 s: 10x failed the
    CI run after the xdist pass (3 of 3) while passing here alone (9 of 9)."""
    cluster, hosts = cluster_of(400, 400, 400, 20)
    timeout = 20.0
    body = torch.zeros(1 << 20)  # 4 MiB: 0.08 s at 400 Mbit/s, 1.7 s at 20
    async with ws.Publisher("slowlink", address=f"{cluster.trainer_ip}:0", timeout=timeout,
                            policy=ws.StragglerPolicy(on_slow="evict")) as pub:
        for h in range(4):
            hosts.spawn(h, channel="slowlink", address=pub.address, member=f"gen{h}", until_version=10_000,
                        deadline=150, mode="follow", timeout=timeout)
        await pub.wait_subscribers(4, timeout=90)
        slow, version = [], 0
        while not pub.evicted:
            assert version < 12, "the member behind the slow link was never evicted"
            report = await (await pub.put({"w": body + version}, version=version)).delivered(timeout=90)
            if "gen3" in report.members:
                slow.append(report.seconds)
            version += 1
        assert [(m.member_id, m.reason) for m in pub.evicted] == [("gen3", "slow")]
        assert all(s < timeout + 4 for s in slow)  # held up by the slow link, never past the deadline
        fast = []
        for _ in range(4):
            report = await (await pub.put({"w": body + version}, version=version)).delivered(timeout=90)
            assert sorted(report.members) == ["gen0", "gen1", "gen2"]
            fast.append(report.seconds)
            version += 1
        assert [m.member_id for m in pub.evicted] == ["gen3"]
    # 20 Mbit/s against 400: with the slow link gone a version goes several times faster
    assert max(fast) * 3 < min(slow), (fast, slow)


@pytest.mark.asyncio
async def test_eight_generators_on_equal_links_nobody_is_scored_slow(cluster_of) -> None:
    """Found on this harness: in gloo's tree some members finish their buckets early and then
    wait for the publisher's Seal, which comes when the whole broadcast is done. That wait was
    counted as their own time, and with 8 generators on equal 300 Mbit/s links the default
    policy evicted two healthy ones as slow within six versions."""
    cluster, hosts = cluster_of(*[300] * 8)
    body = torch.zeros(5 << 20)  # 20 MiB in 4 MiB buckets: about 0.6 s a hop
    async with ws.Publisher("equal", address=f"{cluster.trainer_ip}:0", timeout=60,
                            bucket_bytes=4 << 20) as pub:  # the default policy: evict and replace the slow
        for h in range(8):
            hosts.spawn(h, channel="equal", address=pub.address, member=f"gen{h}", until_version=10_000,
                        deadline=150, mode="follow", timeout=60)
        await pub.wait_subscribers(8, timeout=120)
        for version in range(8):
            report = await (await pub.put({"w": body + version}, version=version)).delivered(timeout=120)
            assert len(report.members) == 8, (version, report.members, pub.evicted)
        assert pub.evicted == []


@pytest.mark.asyncio
async def test_a_link_taken_down_mid_transfer_is_a_dead_member_survivors_recover(cluster_of) -> None:
    cluster, hosts = cluster_of(200, 200, 200)
    rec = ws.FlightRecorder(capacity=4000)
    timeout = 4.0
    body = torch.zeros(4 << 20)  # 16 MiB: about 0.7 s on the wire at 200 Mbit/s
    async with ws.Publisher("cable", address=f"{cluster.trainer_ip}:0", timeout=timeout, heartbeat_interval=0.25,
                            bucket_bytes=4 << 20, recorder=rec, policy=ws.StragglerPolicy(on_dead="evict")) as pub:
        for h in range(3):
            hosts.spawn(h, channel="cable", address=pub.address, member=f"gen{h}", until_version=10_000,
                        deadline=150, mode="follow", timeout=timeout)
        await pub.wait_subscribers(3, timeout=90)
        await (await pub.put({"w": body}, version=0)).delivered(timeout=60)
        await pub.put({"w": body + 1}, version=1)
        while not any(e.op == "bucket_send" and e.version == 1 for e in rec.snapshot()):
            await asyncio.sleep(0.005)  # until the recorder shows version 1 on the wire
        cluster.link(2, up=False)
        pulled = time.monotonic()
        report = await (await pub.put({"w": body + 2}, version=2)).delivered(timeout=60)
        recovered = time.monotonic() - pulled
        assert sorted(report.members) == ["gen0", "gen1"]
        assert [(m.member_id, m.reason) for m in pub.evicted] == [("gen2", "dead")]
    # the bound of docs/fault-tolerance.md for a silent member: its silence bound, one bucket's
    # deadline and the re-send, with slack for a loaded machine
    assert recovered < 3 * timeout + 10


def test_weightsync_bench_runs_across_two_hosts_under_torchrun(cluster_of, tmp_path: Path) -> None:
    """`weightsync bench` as a user runs it on two hosts: one torchrun per host (the trainer's in
    the root namespace, a generator's in another host's), the rendezvous at the trainer's address.
    The table, JSON and verdict come back from rank 0, every version bit-exact, and the run knows
    it spanned two nodes."""
    cluster, _hosts = cluster_of(None)
    with socket_free() as port:
        pass
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--master-addr", cluster.trainer_ip, "--master-port", str(port), "-m", "weightsync.bench.run",
            "--sizes", "4", "--subscribers", "1", "--reps", "1", "--step-ms", "20", "--transport", "group",
            "--out", str(tmp_path)]
    base = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "PYTHONPATH")}
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    with open(logs[0], "wb") as out0, open(logs[1], "wb") as out1:
        node0 = subprocess.Popen([*argv[:3], "--node-rank", "0", *argv[3:]], cwd=tmp_path, stdout=out0,
                                 stderr=subprocess.STDOUT, start_new_session=True,
                                 env=dict(base, GLOO_SOCKET_IFNAME=cluster.bridge))
        try:
            node1 = cluster.popen(0, [*argv[:3], "--node-rank", "1", *argv[3:]], cwd=tmp_path, stdout=out1,
                                  stderr=subprocess.STDOUT, env=dict(base, GLOO_SOCKET_IFNAME="eth0"))
            codes = [wait(node0, 200), wait(node1, 30)]
        finally:
            if node0.poll() is None:
                os.killpg(node0.pid, signal.SIGKILL)
                node0.wait(10)
    text = logs[0].read_text()
    assert codes == [0, 0], f"exit codes {codes}:\n{text[-3000:]}\n{logs[1].read_text()[-3000:]}"
    assert "on 2 node(s)" in text and "verdict: at 4 MiB to 1 generator" in text and "bit-exact" in text, text
    report = msgspec.json.decode((tmp_path / "bench.json").read_bytes())
    assert report["ok"] and report["world_size"] == 2 and len(set(report["hosts"])) == 2
    assert sorted(r["mode"] for r in report["rows"]) == ["naive", "packed", "put", "put_nocopy"]
    assert all(r["exact"] for r in report["rows"])


class socket_free:
    """A free TCP port on this host (closed again before use: torchrun binds it itself)."""

    def __enter__(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def __exit__(self, *exc: object) -> None:
        return None


def test_the_harness_leaves_nothing_when_its_owner_is_killed_9(tmp_path: Path) -> None:
    code = ("import sys; from benchmarks.netns import Cluster; c = Cluster([100, None]); "
            "print(c.owner, flush=True); sys.stdin.read()")
    owner = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        pid = int(owner.stdout.readline())
        mine = sorted(ns for ns in netns.namespaces() if ns.startswith(f"ws-{pid}-"))
        assert mine == [f"ws-{pid}-g0", f"ws-{pid}-g1"]
        watchdogs = subprocess.run(["pgrep", "-f", f"benchmarks.netns watch {pid}"], capture_output=True,
                                   text=True).stdout.split()
        assert len(watchdogs) == 1
        fd = os.pidfd_open(int(watchdogs[0]))
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        assert select.select([fd], [], [], 30)[0], "the watchdog did not finish within 30 s"
        os.close(fd)
    finally:
        owner.kill()
    assert [ns for ns in netns.namespaces() if ns.startswith(f"ws-{pid}-")] == []
    assert [link for link in netns.links() if link.startswith((f"wsb{pid}", f"wsv{pid}x"))] == []
