"""gloo's own wire between two processes on this host: the ceiling under weightsync's group path.

    python -m benchmarks.gloo_wire [--mib 512] [--buckets 64,16,4] [--streams 1,2] [--reps 3] [--out benchmarks/results]

A sender process broadcasts a ``--mib`` host buffer to one receiver process in buckets, two in
flight as weightsync's group plane keeps them, over a standalone gloo backend made the way
weightsync makes one (``_torch_compat.make_gloo``: lazy pairs, ``streams`` connections per
pair). No snapshot, no digest, no control plane: what the wire alone costs. Each point is
measured on both ends after a warm-up, medians of ``--reps``: the time, and each process's CPU
(``time.process_time``: every thread, gloo's included). Both buffers are as large as the
version, so at the default size each bucket is read and written from memory, not from cache,
as in a real push.

Prints GB/s and CPU milliseconds per GB on each end for every point, and side by side the
time and receiver CPU of each stream count against one stream at the same bucket size. Writes
``gloo_wire.json`` and ``gloo_wire.png``.

``benchmarks.push_vs_broadcast`` measures weightsync's whole path against the naive loop; its
"loopback TCP" ceiling is a raw socket with 4 MiB writes into a buffer that stays in cache. On
a 2-core Intel Xeon (2026-12-04) that ceiling read 3.4-3.9 GB/s, and this program's gloo
2.2-2.5 GB/s over one stream and 2.4-3.7 over two (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist

from benchmarks import report
from weightsync import _torch_compat as compat

DEPTH = 2  # buckets in flight, as weightsync's group plane keeps them (``DedicatedGroup.broadcast``)
DEADLINE = 120.0  # every gloo operation and the whole receiver process are bounded by this


class Point(msgspec.Struct):
    streams: int
    bucket_mib: int
    seconds: float  # the sender's, median of reps
    gb_per_s: float
    sender_cpu_ms_per_gb: float
    receiver_cpu_ms_per_gb: float
    runs_s: list[float]  # every measured rep's time on the sender


class Report(msgspec.Struct):
    cpu: str
    mib: int
    reps: int
    points: list[Point]


def plan(buckets: list[int], streams: list[int]) -> list[tuple[int, int]]:
    """Every (streams, bucket MiB) point in the order both ends run them."""
    return [(s, b) for s in streams for b in buckets]


def push(pg: object, flat: torch.Tensor, bucket: int) -> None:
    """Broadcast ``flat`` from rank 0 in ``bucket``-byte pieces, ``DEPTH`` in flight."""
    works: list = []
    for lo in range(0, flat.numel(), bucket):
        if len(works) >= DEPTH:
            compat.wait_work(works.pop(0), DEADLINE)
        works.append(compat.broadcast(pg, flat[lo:lo + bucket], 0, DEADLINE))
    for work in works:
        compat.wait_work(work, DEADLINE)


def measure(rank: int, store: dist.Store, mib: int, points: list[tuple[int, int]], reps: int) -> list[list[tuple]]:
    """Run every point on this end; per point, per measured rep, (seconds, CPU seconds)."""
    flat = torch.empty(mib << 20, dtype=torch.uint8).fill_(rank + 1)  # written once: no page faults timed
    out: list[list[tuple]] = []
    for streams, bucket_mib in points:
        pg = compat.make_gloo(compat.prefix_store(f"s{streams}-b{bucket_mib}", store), rank, 2, DEADLINE,
                              "127.0.0.1", streams)
        token = torch.zeros(1, dtype=torch.uint8)
        runs = []
        for rep in range(reps + 1):  # the first connects the pairs and warms up
            compat.wait_work(compat.broadcast(pg, token, 0, DEADLINE), DEADLINE)  # both ends start together
            t0, c0 = time.perf_counter(), time.process_time()
            push(pg, flat, bucket_mib << 20)
            if rep:
                runs.append((time.perf_counter() - t0, time.process_time() - c0))
        out.append(runs)
        del pg
    return out


def receiver(port: int, mib: int, points: list[tuple[int, int]], reps: int) -> int:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=dt.timedelta(seconds=DEADLINE))
    runs = measure(1, store, mib, points, reps)
    store.set("receiver", msgspec.json.encode(runs))
    return 0


def run(mib: int, buckets: list[int], streams: list[int], reps: int) -> Report:
    points = plan(buckets, streams)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=dt.timedelta(seconds=DEADLINE))
    argv = [sys.executable, "-m", "benchmarks.gloo_wire", "--role", "receiver", "--port", str(store.port),
            "--mib", str(mib), "--buckets", ",".join(map(str, buckets)), "--streams", ",".join(map(str, streams)),
            "--reps", str(reps)]
    child = subprocess.Popen(argv, cwd=Path(__file__).resolve().parent.parent)
    try:
        mine = measure(0, store, mib, points, reps)
        if child.wait(timeout=DEADLINE) != 0:
            raise RuntimeError(f"the receiver process exited with {child.returncode}")
        theirs = msgspec.json.decode(store.get("receiver"))
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    gb = (mib << 20) / 1e9
    out = []
    for (s, b), sent, got in zip(points, mine, theirs, strict=True):
        seconds = statistics.median(t for t, _ in sent)
        out.append(Point(streams=s, bucket_mib=b, seconds=seconds, gb_per_s=gb / seconds,
                         sender_cpu_ms_per_gb=statistics.median(c for _, c in sent) * 1e3 / gb,
                         receiver_cpu_ms_per_gb=statistics.median(c for _, c in got) * 1e3 / gb,
                         runs_s=[t for t, _ in sent]))
    return Report(cpu=report.cpu_name(), mib=mib, reps=reps, points=out)


def table(rep: Report) -> str:
    lines = [f"{rep.mib} MiB from one process to another over gloo on this host, {DEPTH} buckets in flight, "
             f"median of {rep.reps}; {rep.cpu}",
             f"{'streams':>7} {'bucket MiB':>10} {'ms':>8} {'GB/s':>7} {'sender CPU ms/GB':>17} "
             f"{'receiver CPU ms/GB':>19} {'time / 1 stream':>16} {'recv CPU / 1 stream':>20}"]
    one = {p.bucket_mib: p for p in rep.points if p.streams == 1}
    for p in rep.points:
        base = one.get(p.bucket_mib)
        ratio = f"{p.seconds / base.seconds:16.2f}" if base else f"{'':16}"
        cpu = f"{p.receiver_cpu_ms_per_gb / base.receiver_cpu_ms_per_gb:20.2f}" if base else f"{'':20}"
        lines.append(f"{p.streams:>7} {p.bucket_mib:>10} {p.seconds * 1e3:>8.1f} {p.gb_per_s:>7.2f} "
                     f"{p.sender_cpu_ms_per_gb:>17.0f} {p.receiver_cpu_ms_per_gb:>19.0f} {ratio} {cpu}")
    return "\n".join(lines)


def plot(rep: Report, out: str | Path, json_path: Path) -> None:
    plt = report.pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    for k, s in enumerate(sorted({p.streams for p in rep.points})):
        mine = [p for p in rep.points if p.streams == s]
        x, color = [p.bucket_mib for p in mine], f"C{k}"
        left.plot(x, [p.gb_per_s for p in mine], "o-", color=color, label=f"{s} stream{'s' if s > 1 else ''}")
        right.plot(x, [p.receiver_cpu_ms_per_gb for p in mine], "o-", color=color, label=f"receiver, {s}")
        right.plot(x, [p.sender_cpu_ms_per_gb for p in mine], "s--", color=color, label=f"sender, {s}")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bucket MiB")
        ax.legend(fontsize=8)
    left.set_ylabel("GB/s")
    right.set_ylabel("CPU ms per GB (all threads)")
    fig.suptitle(f"gloo between two processes, {rep.mib} MiB ({rep.cpu})", fontsize=9)
    report.save(fig, out, "gloo_wire", json_path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--buckets", default="64,16,4", help="bucket sizes in MiB, comma-separated")
    parser.add_argument("--streams", default="1,2", help="gloo connections per pair, comma-separated")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--role", choices=("sender", "receiver"), default="sender", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        buckets = [int(b) for b in args.buckets.split(",")]
        streams = [int(s) for s in args.streams.split(",")]
    except ValueError:
        parser.error("--buckets and --streams are comma-separated integers")
    if args.mib < 1 or args.reps < 1 or min(buckets) < 1 or min(streams) < 1:
        parser.error("--mib, --reps, --buckets and --streams must be >= 1")
    if max(buckets) > args.mib:
        parser.error(f"a bucket of {max(buckets)} MiB is larger than --mib {args.mib}")
    if args.role == "receiver":
        return receiver(args.port, args.mib, plan(buckets, streams), args.reps)
    rep = run(args.mib, buckets, streams, args.reps)
    print(table(rep))
    json_path = report.write_json(args.out, "gloo_wire", rep)
    plot(rep, args.out, json_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
