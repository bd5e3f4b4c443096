"""One-sided reads (torch 2.15's ``torch.distributed._transport``, NIXL) against the group path and
a blocking per-tensor broadcast loop, in one run.

    python -m benchmarks.one_sided [--sizes 64,256] [--subscribers 1,2] [--reps 3] [--tcp]
    python -m benchmarks.one_sided --catch-up [--sizes 256] [--reps 3] [--tcp]

For each generator count: the naive loop (``broadcast`` of every tensor over gloo, blocking the
trainer, as most RL loops do), then one publisher per transport pushing the same LLM-shaped state
dict (``weightsync.bench.model``) to N generator processes: ``"one-sided"`` (each generator reads
every bucket out of the publisher's registered snapshot), ``"group"`` (gloo broadcast over
loopback) and ``"shm"`` (same-host shared memory, for reference). Per point, the median over
``--reps`` pushes after one warm-up: the time until every generator has it (acknowledged, or for
the naive loop unpacked into its tensors), and the trainer process's CPU time over that span,
every thread counted (the sender, gloo's, NIXL's progress threads), per version.

``--catch-up``: a newcomer joins a channel whose version is retained, alone (it reads the
publisher's memory) or beside a one-sided member that holds it (it reads that member's). Per
point, the median over ``--reps`` newcomers: the time from its ``start()`` until it holds the
version, and the bytes it took from the publisher's memory (the trainer's egress for it) and
from peers (``OneSidedPlane.took``).

``--tcp`` sets ``UCX_TLS=tcp`` for every process, as between hosts without RDMA; without it, NIXL's
UCX picks its same-host paths (shared memory, cross-memory attach) for these generators, which
read the trainer's memory without its CPU.

Needs torch 2.15 with nixl (``pip install 'weightsync[nixl]'``); exits 2 without them. Targets:
none (issue 59 asks for the figures); the run prints each ratio and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import msgspec
import torch

import weightsync as ws
from benchmarks.baseline import BlockingBroadcast
from benchmarks.procs import Workers
from benchmarks.report import cpu_name, pyplot, write_json
from benchmarks.same_host import Point, run
from weightsync.bench.model import make_state_dict, nbytes

TRANSPORTS = ("one-sided", "group", "shm")


class CatchUp(msgspec.Struct):
    mib: float
    peer: bool  # a one-sided member holding the version was there
    seconds: float  # median, start() until the newcomer held the version
    from_publisher: int  # bytes the newcomer read out of the publisher's memory (median)
    from_peers: int


class Report(msgspec.Struct):
    when: str
    torch: str
    cpu: str
    cores: int
    reps: int
    ucx_tls: str
    points: list[Point]  # transport "naive" for the broadcast loop
    catch_up: list[CatchUp] = []


async def naive(sizes: list[int], n: int, reps: int, tmp: Path, progress) -> list[Point]:  # type: ignore[no-untyped-def]
    """The blocking per-tensor broadcast loop to ``n`` receivers, each size ``reps + 1`` times."""
    sender = BlockingBroadcast(n, [("naive", mib, reps + 1) for mib in sizes], 1 << 20, tmp)
    points = []
    try:
        await sender.connect()
        for mib in sizes:
            sd = make_state_dict(mib)
            times, cpus = [], []
            for rep in range(reps + 1):
                t0, c0 = time.perf_counter(), time.process_time()
                sender.push(sd, "naive")
                await sender.wait_unpacked("naive", mib, rep)
                if rep:
                    times.append(time.perf_counter() - t0)
                    cpus.append(time.process_time() - c0)
            done = statistics.median(times)
            points.append(Point(transport="naive", checksum=False, mib=nbytes(sd) / 2**20, subscribers=n,
                                to_all_ms=done * 1e3, gbps=nbytes(sd) * n / done / 1e9, put_ms=done * 1e3,
                                cpu_ms=statistics.median(cpus) * 1e3))
            progress(points[-1])
    finally:
        sender.close()
    return points


async def catch_up(sizes: list[int], reps: int, tmp: Path) -> list[CatchUp]:
    """Newcomers joining a retained version, alone and beside a one-sided holder (module docstring)."""
    rows = []
    for mib in sizes:
        sd = make_state_dict(mib)
        for peer in (False, True):
            async with ws.Publisher("catchup", timeout=120, bucket_bytes=64 << 20, encoding="full") as pub:
                holders = Workers(tmp)
                try:
                    if peer:
                        holders.spawn(role="follower", channel="catchup", address=pub.address, member="holder",
                                      transport="one-sided")
                        await pub.wait_subscribers(1, timeout=300)
                    await (await pub.put(sd, version=0)).delivered(timeout=600)
                    runs = []
                    for rep in range(reps):
                        newcomers = Workers(tmp)
                        newcomers.spawn(role="newcomer", channel="catchup", address=pub.address,
                                        member=f"new{rep}", version=0)
                        runs.append(await asyncio.to_thread(newcomers.results, 600))
                    got = [r[0] for r in runs]
                    rows.append(CatchUp(mib=nbytes(sd) / 2**20, peer=peer,
                                        seconds=statistics.median(r["seconds"] for r in got),
                                        from_publisher=int(statistics.median(r["took"].get("publisher", 0)
                                                                             for r in got)),
                                        from_peers=int(statistics.median(r["took"].get("peer", 0) for r in got))))
                    print(f"  catch-up {rows[-1].mib:6.0f} MiB {'beside a holder' if peer else 'alone':<15} "
                          f"{rows[-1].seconds * 1e3:8.1f} ms  from the publisher {rows[-1].from_publisher:>11} B  "
                          f"from peers {rows[-1].from_peers:>11} B", flush=True)
                finally:
                    holders.kill()
        del sd
    return rows


def table(points: list[Point]) -> str:
    lines = [f"{'MiB':>6} {'gens':>4} {'mode':<10} {'to-all ms':>10} {'GB/s':>6} {'trainer CPU ms':>14} "
             f"{'all/group':>9} {'all/naive':>9} {'cpu/group':>9}", "-" * 86]
    keyed = {(p.transport, p.mib, p.subscribers): p for p in points}
    for p in sorted(points, key=lambda p: (p.subscribers, p.mib, ("naive", *TRANSPORTS).index(p.transport))):
        g, nv = keyed.get(("group", p.mib, p.subscribers)), keyed.get(("naive", p.mib, p.subscribers))
        lines.append(f"{p.mib:6.0f} {p.subscribers:4d} {p.transport:<10} {p.to_all_ms:10.1f} {p.gbps:6.2f} "
                     f"{p.cpu_ms:14.1f} {p.to_all_ms / g.to_all_ms if g else 0:9.3f} "
                     f"{p.to_all_ms / nv.to_all_ms if nv else 0:9.3f} {p.cpu_ms / g.cpu_ms if g else 0:9.3f}")
    return "\n".join(lines)


def plot(report: Report, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    modes = ("naive", *TRANSPORTS)
    keys = sorted({(p.subscribers, p.mib) for p in report.points})
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    width = 0.8 / len(modes)
    for j, mode in enumerate(modes):
        by = {(p.subscribers, p.mib): p for p in report.points if p.transport == mode}
        xs = [i + j * width for i in range(len(keys))]
        axes[0].bar(xs, [by[k].to_all_ms if k in by else 0 for k in keys], width, label=mode)
        axes[1].bar(xs, [by[k].cpu_ms if k in by else 0 for k in keys], width, label=mode)
    for ax, ylabel in zip(axes, ("time until every generator has it (ms)", "trainer CPU per version (ms)"),
                          strict=True):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(keys))], [f"{m:.0f} MiB x {n}" for n, m in keys])
        ax.set_ylabel(ylabel)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"one-sided reads vs the group and a broadcast loop ({report.cpu}, {report.cores} cores, "
                 f"torch {report.torch}, UCX_TLS={report.ucx_tls or 'default'})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def bench(sizes: list[int], subscribers: list[int], reps: int, catching_up: bool = False) -> Report:
    points: list[Point] = []
    rows: list[CatchUp] = []

    def progress(p: Point) -> None:
        print(f"  {p.mib:6.0f} MiB x {p.subscribers} {p.transport:<9} {p.to_all_ms:8.1f} ms  {p.gbps:6.2f} GB/s  "
              f"trainer CPU {p.cpu_ms:7.1f} ms", flush=True)
        points.append(p)

    with tempfile.TemporaryDirectory(prefix="ws-one-sided-") as tmp:
        if catching_up:
            rows = await catch_up(sizes, reps, Path(tmp))
        for n in subscribers if not catching_up else []:
            await naive(sizes, n, reps, Path(tmp), progress)
            for transport in TRANSPORTS:
                await run(transport, sizes, n, reps, Path(tmp), progress, checks=(True,))
    return Report(when=time.strftime("%Y-%m-%d %H:%M:%S"), torch=str(torch.__version__), cpu=cpu_name(),
                  cores=os.cpu_count() or 0, reps=reps, ucx_tls=os.environ.get("UCX_TLS", ""), points=points,
                  catch_up=rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.one_sided", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,256", help="MiB, comma-separated")
    parser.add_argument("--subscribers", default="1,2", help="generator processes, comma-separated")
    parser.add_argument("--reps", type=int, default=3, help="measured pushes per point (plus one warm-up)")
    parser.add_argument("--tcp", action="store_true", help="UCX_TLS=tcp everywhere (as between hosts)")
    parser.add_argument("--catch-up", action="store_true",
                        help="newcomers catching up, alone and beside a one-sided holder, instead")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
        subscribers = [int(s) for s in args.subscribers.split(",")]
    except ValueError:
        parser.error("--sizes and --subscribers take comma-separated integers")
    if min(sizes) < 1 or min(subscribers) < 1 or args.reps < 1:
        parser.error("sizes, subscribers and reps must be >= 1")
    try:  # a member asking for it says what is missing, before anything starts
        ws.Subscriber("probe", address="127.0.0.1:1", transport="one-sided", recorder=ws.FlightRecorder())
    except ws.TransportUnavailable as err:
        print(f"one-sided reads cannot run here: {err}")
        return 2
    if args.tcp:
        os.environ["UCX_TLS"] = "tcp"  # before any endpoint is made; the generators inherit it
    import uvloop

    report = uvloop.run(bench(sizes, subscribers, args.reps, args.catch_up))
    json_path = write_json(args.out, "one_sided", report)
    if report.points:
        plot(report, Path(args.out) / "one_sided.png")
        print()
        print(table(report.points))
    print(f"\nwrote {json_path}" + ("" if not report.points else f" and {Path(args.out) / 'one_sided.png'}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
