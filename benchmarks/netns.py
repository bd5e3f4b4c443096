"""An emulated cluster on one machine: generator "hosts" in network namespaces behind shaped links.

    python -m benchmarks.netns check          # can this machine do it? (root, ip, tc, netns)
    python -m benchmarks.netns sweep          # remove what a killed run left behind
    python -m benchmarks.netns duplex 100     # one 100 Mbit/s link, both ways at once

The trainer stays in the root namespace on a Linux bridge (``10.213.X.1``). Each generator
host is a namespace with its own address (``10.213.X.(10+i)``) on a veth pair into the bridge;
its link is shaped with an ``htb`` class on both ends (each direction), so the trainer's bytes
reach host ``i`` at most at its rate. Pure TCP acknowledgements go ahead of the bulk within
that rate (a class of their own), as a host's fair-queueing qdisc serves a sparse flow: without
that, a relay that forwards at its link's rate delays the acknowledgements of what it receives
(``duplex``: 88-92 Mbit/s down of 100 with both ways busy, 99-100 with the class).
Processes run inside with :meth:`Cluster.popen`.

Nothing outlives the run: :meth:`Cluster.close` (or leaving the ``with`` block) kills every
process in the namespaces, deletes them and the links. If the owning process dies without
closing (``kill -9``), a watchdog started with the cluster does the same: it waits on the
owner's pidfd in its own session. A new cluster also sweeps what any dead owner left behind.
Every name carries the owner's pid: namespaces ``ws-<pid>-g<i>``, links ``wsb<pid>`` and
``wsv<pid>x<i>``.

Used by tests/test_netns.py and benchmarks/cost_model.py; not part of the wheel.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NS_RE = re.compile(r"^ws-(\d+)-g\d+$")
LINK_RE = re.compile(r"^ws[bv](\d+)(x\d+)?(@.*)?$")


class Unavailable(RuntimeError):
    """This machine cannot host namespaces here; the message says why."""


def sh(*argv: str, check: bool = True, timeout: float = 20.0) -> str:
    out = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {out.returncode}: {out.stderr.strip()}")
    return out.stdout


def unavailable() -> str | None:
    """Why namespaces cannot be used here, or None when they can."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"ws-{os.getpid()}-g999"
    try:
        sh("ip", "netns", "add", probe)
        sh("ip", "netns", "del", probe)
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        return f"`ip netns add` failed here: {err}"
    return None


@dataclass
class Host:
    index: int
    ns: str
    ip: str
    veth: str  # the root-side end, on the bridge
    rate_mbit: float | None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def namespaces() -> list[str]:
    return [line.split()[0] for line in sh("ip", "netns", "list", check=False).splitlines() if line.strip()]


def links() -> list[str]:
    names = []
    for line in sh("ip", "-o", "link", "show", check=False).splitlines():
        parts = line.split(":")
        if len(parts) > 1:
            names.append(parts[1].strip().split("@")[0])
    return names


def remove(owner: int) -> None:
    """Kill every process in ``owner``'s namespaces, delete the namespaces and the links."""
    for ns in namespaces():
        match = NS_RE.match(ns)
        if not match or int(match.group(1)) != owner:
            continue
        for pid in sh("ip", "netns", "pids", ns, check=False).split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        sh("ip", "netns", "del", ns, check=False)
    for link in links():
        match = LINK_RE.match(link)
        if match and int(match.group(1)) == owner:
            sh("ip", "link", "del", link, check=False)


def sweep() -> list[int]:
    """Remove what dead owners left behind; the owners cleaned up."""
    owners = {int(m.group(1)) for ns in namespaces() if (m := NS_RE.match(ns))}
    owners |= {int(m.group(1)) for link in links() if (m := LINK_RE.match(link))}
    dead = sorted(pid for pid in owners if not _alive(pid))
    for pid in dead:
        remove(pid)
    return dead


def watch(owner: int) -> None:
    """The watchdog: block until ``owner`` exits (its pidfd turns readable), then remove its hosts."""
    try:
        fd = os.pidfd_open(owner)
    except ProcessLookupError:
        remove(owner)
        return
    select.select([fd], [], [])  # no timeout on purpose: it lives exactly as long as its owner
    remove(owner)


class Cluster:
    """``n`` generator hosts behind links of ``rates_mbit`` (None: unshaped) to the trainer."""

    def __init__(self, rates_mbit: Sequence[float | None]) -> None:
        reason = unavailable()
        if reason is not None:
            raise Unavailable(reason)
        self.owner = os.getpid()
        self.subnet = f"10.213.{self.owner % 250}"
        self.bridge = f"wsb{self.owner}"
        self.trainer_ip = f"{self.subnet}.1"
        self.hosts = [Host(i, f"ws-{self.owner}-g{i}", f"{self.subnet}.{10 + i}", f"wsv{self.owner}x{i}", rate)
                      for i, rate in enumerate(rates_mbit)]
        self._procs: list[subprocess.Popen[bytes]] = []
        self._watchdog: subprocess.Popen[bytes] | None = None
        sweep()
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def _create(self) -> None:
        self._watchdog = subprocess.Popen([sys.executable, "-m", "benchmarks.netns", "watch", str(self.owner)],
                                          cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                                          start_new_session=True, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL)
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{self.trainer_ip}/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        for host in self.hosts:
            sh("ip", "netns", "add", host.ns)
            sh("ip", "link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.ns)
            sh("ip", "link", "set", host.veth, "master", self.bridge)
            sh("ip", "link", "set", host.veth, "up")
            inside = ("ip", "netns", "exec", host.ns)
            sh(*inside, "ip", "addr", "add", f"{host.ip}/24", "dev", "eth0")
            sh(*inside, "ip", "link", "set", "eth0", "up")
            sh(*inside, "ip", "link", "set", "lo", "up")
            if host.rate_mbit is not None:
                self.set_rate(host.index, host.rate_mbit)

    # links --------------------------------------------------------------------------------
    def set_rate(self, index: int, mbit: float) -> None:
        """Shape host ``index``'s link to ``mbit`` Mbit/s in each direction."""
        host = self.hosts[index]
        host.rate_mbit = mbit
        for prefix, dev in (((), host.veth), (("ip", "netns", "exec", host.ns), "eth0")):
            sh(*prefix, "tc", "qdisc", "del", "dev", dev, "root", check=False)  # htb cannot be changed in place
            sh(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10")
            # burst: a few milliseconds' worth, at least 64 KiB, so htb can keep a fast link busy
            burst = max(64 * 1024, int(mbit * 1e6 / 8 * 0.004))
            shaped = ("burst", str(burst), "cburst", str(burst))
            sh(*prefix, "tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb",
               "rate", f"{mbit}mbit", "ceil", f"{mbit}mbit", *shaped)
            sh(*prefix, "tc", "class", "add", "dev", dev, "parent", "1:1", "classid", "1:10", "htb",
               "rate", f"{mbit}mbit", "ceil", f"{mbit}mbit", "prio", "1", *shaped)
            # pure TCP acknowledgements (IP packets under 64 bytes) first, within the same rate, as
            # a host's fair-queueing qdisc serves a sparse flow: a relay forwarding at its link's
            # rate would otherwise hold back the acknowledgements of what it receives
            sh(*prefix, "tc", "class", "add", "dev", dev, "parent", "1:1", "classid", "1:5", "htb",
               "rate", f"{max(mbit / 100, 1)}mbit", "ceil", f"{mbit}mbit", "prio", "0", *shaped)
            sh(*prefix, "tc", "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
               "match", "ip", "protocol", "6", "0xff", "match", "u16", "0x0000", "0xffc0", "at", "2",
               "flowid", "1:5")

    def sent_by_class(self, index: int) -> dict[str, tuple[int, int]]:
        """What host ``index`` sent out of its link, per shaping class: ``{"1:5": (bytes,
        packets), ...}`` (1:5 the acknowledgements, 1:10 everything else)."""
        out = sh("ip", "netns", "exec", self.hosts[index].ns, "tc", "-s", "class", "show", "dev", "eth0")
        return {m.group(1): (int(m.group(2)), int(m.group(3)))
                for m in re.finditer(r"class htb (\S+) .*?\n\s*Sent (\d+) bytes (\d+) pkt", out)}

    def link(self, index: int, up: bool) -> None:
        """Take host ``index``'s link down (as a pulled cable) or bring it back."""
        sh("ip", "link", "set", self.hosts[index].veth, "up" if up else "down")

    # processes ----------------------------------------------------------------------------
    def popen(self, index: int, argv: Sequence[str], env: dict[str, str] | None = None,
              **kwargs: object) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside host ``index``; it is killed when the cluster closes.

        Namespaces share one kernel, so a subscriber in one would find the publisher's shared
        memory: a process in an emulated other host asks for ``transport="group"`` itself, to
        receive as a real one would.
        """
        env = dict(env if env is not None else os.environ)
        proc = subprocess.Popen(["ip", "netns", "exec", self.hosts[index].ns, *argv], env=env,  # type: ignore[call-overload]
                                start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        remove(self.owner)
        if self._watchdog is not None and self._watchdog.poll() is None:
            self._watchdog.kill()
            self._watchdog.wait(10)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_DUPLEX_PEER = """
import socket, sys, threading, time
host, up_port, down_port, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
def up():
    s = socket.create_connection((host, up_port), timeout=60)
    piece, end = bytes(1 << 16), time.monotonic() + seconds
    while time.monotonic() < end:
        s.sendall(piece)
    s.close()
sender = threading.Thread(target=up)
sender.start()
s, n = socket.create_connection((host, down_port), timeout=60), 0
while piece := s.recv(1 << 16):
    n += len(piece)
sender.join()
print(n)
"""


def duplex(mbit: float, seconds: float = 3.0) -> tuple[float, float]:
    """Mbit/s one host's link carried each way (up to the trainer, down from it) while both
    directions send at once for ``seconds``: each direction's acknowledgements share the
    other's queue, which is what a relay's link does (it receives and forwards at once)."""
    with Cluster([mbit]) as cluster:
        up_srv, down_srv = (socket.create_server((cluster.trainer_ip, 0)) for _ in range(2))
        peer = cluster.popen(0, [sys.executable, "-c", _DUPLEX_PEER, cluster.trainer_ip,
                                 str(up_srv.getsockname()[1]), str(down_srv.getsockname()[1]), str(seconds)],
                             stdout=subprocess.PIPE)
        for srv in (up_srv, down_srv):
            srv.settimeout(60)
        with up_srv, down_srv:
            up_conn, down_conn = up_srv.accept()[0], down_srv.accept()[0]
        for conn in (up_conn, down_conn):
            conn.settimeout(60)  # every wait has its deadline: a peer that stops answering ends it
        got = [0]

        def receive() -> None:
            while piece := up_conn.recv(1 << 16):
                got[0] += len(piece)

        receiver = threading.Thread(target=receive)
        receiver.start()
        piece, end = bytes(1 << 16), time.monotonic() + seconds
        while time.monotonic() < end:
            down_conn.sendall(piece)
        down_conn.close()
        receiver.join(60)
        up_conn.close()
        stdout, _ = peer.communicate(timeout=60)
        return got[0] * 8 / seconds / 1e6, int(stdout.split()[0]) * 8 / seconds / 1e6


def main(argv: Sequence[str]) -> int:
    command = argv[0] if argv else "check"
    if command == "check":
        reason = unavailable()
        print(reason or "network namespaces, veth, bridges and htb work here")
        return 0 if reason is None else 1
    if command == "sweep":
        print(f"removed what these dead owners left: {sweep()}")
        return 0
    if command == "duplex":  # python -m benchmarks.netns duplex [MBIT]
        mbit = float(argv[1]) if len(argv) > 1 else 100.0
        up, down = duplex(mbit)
        print(f"one {mbit:g} Mbit/s link, both ways at once: up {up:.0f} Mbit/s, down {down:.0f} Mbit/s")
        return 0
    if command == "watch":
        watch(int(argv[1]))
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
