"""Why the control plane left the shared TCPStore: two measurements, side by side in one run.

    python -m benchmarks.control_plane [--rounds 2000] [--out benchmarks/results]

1. **A frozen server and the GIL.** A thread blocks in a call to a server that stopped
   answering (SIGSTOP), while another thread counts how often it gets to run. With a torch
   ``TCPStore`` client the call is ``queue_len`` (what the old control plane polled); with
   weightsync's own connection it is ``socket.recv`` (what the control client's reader does).
   Reported: the counting thread's rate during the blocked call, as a fraction of its rate idle.
   A fraction near 0 means the blocked call held the GIL and froze the whole process.
2. **Round trip.** A message to a peer and its answer, ``rounds`` times: TCPStore
   ``queue_push`` + blocking ``queue_pop`` through a store server in another process, against
   one frame each way on a weightsync control connection (msgpack, sequence number, HMAC).

Prints a table, writes ``control_plane.json`` and ``control_plane.png``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import signal
import socket
import subprocess
import sys
import time

import torch.distributed as dist

from benchmarks import report
from weightsync import _wire
from weightsync.control.framing import HEADER, TO_SERVER, Session

SERVER = r"""
import sys, socket, time, datetime as dt
import torch.distributed as dist
kind = sys.argv[1]
if kind == "store":
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=60))
    print(store.port, flush=True)
    while True:  # echo: pop from "ping", push to "pong"
        store.queue_push("pong", store.queue_pop("ping", True))
else:
    srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
    print(srv.getsockname()[1], flush=True)
    conn, _ = srv.accept(); conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:  # echo frames back as they are
        data = conn.recv(1 << 16)
        if not data:
            break
        conn.sendall(data)
"""


def start(kind: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, "-c", SERVER, kind], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


PROBE = r"""
import os, signal, socket, subprocess, sys, threading, time, datetime as dt
import torch.distributed as dist
kind, port, server_pid, block = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])

def rate(seconds):
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        count += 1
    return count / seconds

if kind == "store":
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=dt.timedelta(seconds=block))
    def call():
        try:
            client.queue_len("ping")
        except Exception:
            pass
else:
    conn = socket.create_connection(("127.0.0.1", port)); conn.settimeout(block)
    def call():
        try:
            conn.recv(1)
        except OSError:
            pass
idle = rate(0.5)
os.kill(server_pid, signal.SIGSTOP)
threading.Thread(target=call, daemon=True).start()
time.sleep(0.2)
print(rate(max(block - 0.5, 0.3)) / idle, flush=True)
os._exit(0)
"""


def gil_fraction(kind: str, block_seconds: float) -> float:
    """The probe's counting rate while one of its threads waits on a frozen server, as a fraction
    of its idle rate; 0 when the probe made no progress at all before its deadline (killed)."""
    proc, port = start(kind)
    try:
        probe = subprocess.run([sys.executable, "-c", PROBE, kind, str(port), str(proc.pid), str(block_seconds)],
                               capture_output=True, text=True, timeout=block_seconds + 20)
        return float(probe.stdout.strip() or 0.0)
    except subprocess.TimeoutExpired:
        return 0.0
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


def round_trip_store(rounds: int) -> float:
    proc, port = start("store")
    try:
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=dt.timedelta(seconds=30))
        body = _wire.encode(_wire.Beat())
        t0 = time.perf_counter()
        for _ in range(rounds):
            client.queue_push("ping", body)
            client.queue_pop("pong", True)
        return (time.perf_counter() - t0) / rounds
    finally:
        proc.kill()
        proc.wait()


def round_trip_control(rounds: int) -> float:
    proc, port = start("socket")
    try:
        conn = socket.create_connection(("127.0.0.1", port))
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        me = Session(outgoing=TO_SERVER, incoming=TO_SERVER, key=b"k" * 32)  # the echo sends our own frames back
        t0 = time.perf_counter()
        for _ in range(rounds):
            conn.sendall(me.seal(_wire.Beat()))
            header = conn.recv(HEADER.size, socket.MSG_WAITALL)
            data = conn.recv(HEADER.unpack(header)[0], socket.MSG_WAITALL)
            me.open(data, _wire.server_decoder)
        return (time.perf_counter() - t0) / rounds
    finally:
        proc.kill()
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.control_plane", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--block", type=float, default=3.0, help="seconds a call waits on the frozen server")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    rows = {
        "gil_free_fraction_tcpstore": gil_fraction("store", args.block),
        "gil_free_fraction_control": gil_fraction("socket", args.block),
        "round_trip_us_tcpstore": round_trip_store(args.rounds) * 1e6,
        "round_trip_us_control": round_trip_control(args.rounds) * 1e6,
    }
    print(f"{'':<44}{'TCPStore':>12}{'control':>12}")
    print(f"{'other threads run while a call blocks (x idle)':<44}"
          f"{rows['gil_free_fraction_tcpstore']:>12.2f}{rows['gil_free_fraction_control']:>12.2f}")
    print(f"{'round trip, microseconds':<44}"
          f"{rows['round_trip_us_tcpstore']:>12.0f}{rows['round_trip_us_control']:>12.0f}")
    json_path = report.write_json(args.out, "control_plane", rows)
    plt = report.pyplot()
    if plt is None:
        return 0
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3))
    a.bar(["TCPStore", "control"], [rows["gil_free_fraction_tcpstore"], rows["gil_free_fraction_control"]],
          color=["#c44", "#2a2"])
    a.set_title("other threads while a call\nwaits on a frozen server (x idle)")
    b.bar(["TCPStore", "control"], [rows["round_trip_us_tcpstore"], rows["round_trip_us_control"]],
          color=["#c44", "#2a2"])
    b.set_title("round trip (us)")
    report.save(fig, args.out, "control_plane", json_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
