"""Same-host delivery (shared memory) against the group path, and against memcpy, in one run.

    python -m benchmarks.same_host [--sizes 64,256,512,1024] [--subscribers 1,2,4] [--reps 3]

For each generator count, one publisher pushes the same LLM-shaped state dict
(``weightsync.bench.model``) to N generator processes on this host, first with ``transport="shm"``
and then with ``transport="group"`` (gloo over loopback), checksums on (the default) and off.
Each point is the median time from ``put`` until every generator acknowledged, over ``--reps``
pushes after one warm-up. The memcpy ceiling (one thread, ``ctypes.memmove``: what one
generator's copy can reach) is measured in the same run.

``--pipeline both`` runs every point also with ``Publisher(pipeline=True)`` (the snapshot sent
while it is taken) and adds the trainer's stall (``put``) to the table.

Since protocol 13 same-host generators read the publisher's sealed snapshot in place, and
nobody digests it (docs/architecture.md, "No digest of a sealed snapshot"): "checksums on"
then digests only the group path's versions.

Targets (issue 28), at 512 MiB (the nearest size run) and 2 generators: shared memory at most
0.25x the group path's time, and its delivered GB/s (bytes x generators / time) at least 0.6x
the memcpy ceiling. Exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import tempfile
import time
from pathlib import Path

import msgspec
import torch

import weightsync as ws
from benchmarks.procs import Workers
from benchmarks.report import pyplot, verdict, write_json
from weightsync.bench.model import make_state_dict, nbytes

TRANSPORTS = ("shm", "group")


class Point(msgspec.Struct):
    transport: str
    checksum: bool
    mib: float
    subscribers: int
    to_all_ms: float
    gbps: float
    put_ms: float = 0.0  # the trainer's stall: put() until it returned
    pipeline: bool = False
    cpu_ms: float = 0.0  # the trainer process's CPU time (every thread) from put() until delivered


class Report(msgspec.Struct):
    when: str
    torch: str
    cores: int
    reps: int
    memcpy_gbps: float
    points: list[Point]
    targets: dict[str, bool]


def memmove_gbps(mib: int = 512) -> float:
    """One thread copying, as a generator's receive does (best of 3; the pages touched first)."""
    src = torch.ones(mib << 20, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel())
        best = min(best, time.perf_counter() - t0)
    return src.numel() / best / 1e9


async def run(transport: str, sizes: list[int], n: int, reps: int, tmp: Path, progress,  # type: ignore[no-untyped-def]
              pipeline: bool = False, checks: tuple[bool, ...] = (True, False)) -> list[Point]:
    points = []
    workers = Workers(tmp)
    last_version = len(sizes) * len(checks) * (reps + 1) - 1
    async with ws.Publisher(f"same-{transport}", timeout=120, bucket_bytes=64 << 20, pipeline=pipeline,
                            encoding="full") as pub:
        for i in range(n):
            workers.spawn(role="subscriber", channel=f"same-{transport}", address=pub.address, member=f"gen{i}",
                          last_version=last_version, transport=transport)
        try:
            await pub.wait_subscribers(n, timeout=300)
            version = 0
            for mib in sizes:
                sd = make_state_dict(mib)
                for check in checks:
                    pub.checksum = check
                    times, puts, cpus = [], [], []
                    for rep in range(reps + 1):
                        t0, c0 = time.perf_counter(), time.process_time()
                        handle = await pub.put(sd, version=version)
                        stall = time.perf_counter() - t0
                        report = await handle.delivered(timeout=600)
                        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
                        if len(report.members) != n:
                            raise RuntimeError(f"version {version} reached {report.members} only")
                        version += 1
                        if rep:
                            times.append(elapsed)
                            puts.append(stall)
                            cpus.append(cpu)
                    done = statistics.median(times)
                    points.append(Point(transport=transport, checksum=check, mib=nbytes(sd) / 2**20, subscribers=n,
                                        to_all_ms=done * 1e3, gbps=nbytes(sd) * n / done / 1e9,
                                        put_ms=statistics.median(puts) * 1e3, pipeline=pipeline,
                                        cpu_ms=statistics.median(cpus) * 1e3))
                    progress(points[-1])
                del sd
            workers.results(timeout=600)
        finally:
            workers.kill()
    return points


def check_targets(points: list[Point], memcpy: float) -> dict[str, bool]:
    n = min({p.subscribers for p in points}, key=lambda k: abs(k - 2))
    size = min({p.mib for p in points}, key=lambda m: abs(m - 496))
    targets = {}
    pipe = all(p.pipeline for p in points)  # the targets read the default (not pipelined) where it ran
    for check in (True, False):
        pick = {p.transport: p for p in points
                if p.subscribers == n and p.mib == size and p.checksum == check and p.pipeline == pipe}
        ratio = pick["shm"].to_all_ms / pick["group"].to_all_ms
        share = pick["shm"].gbps / memcpy
        crc = "checksums on" if check else "checksums off"
        targets[f"{crc}: shm <= 0.25 x group at {size:.0f} MiB x {n} ({ratio:.3f})"] = ratio <= 0.25
        targets[f"{crc}: shm >= 0.6 x memcpy ({pick['shm'].gbps:.2f} GB/s = {share:.2f} x)"] = share >= 0.6  # issue 28
    return targets


def table(points: list[Point], memcpy: float) -> str:
    lines = [f"{'MiB':>6} {'gens':>4} {'crc':>4} {'pipe':>4} {'shm ms':>9} {'group ms':>9} {'shm/grp':>8} "
             f"{'shm GB/s':>9} {'of memcpy':>9} {'put shm':>8} {'put grp':>8}", "-" * 92]
    keyed = {(p.transport, p.checksum, p.mib, p.subscribers, p.pipeline): p for p in points}
    for (transport, check, mib, n, pipe), p in sorted(keyed.items(),
                                                      key=lambda kv: (kv[0][3], kv[0][2], not kv[0][1], kv[0][4])):
        g = keyed.get(("group", check, mib, n, pipe))
        if transport != "shm" or g is None:
            continue
        lines.append(f"{mib:6.0f} {n:4d} {'on' if check else 'off':>4} {'on' if pipe else 'off':>4} "
                     f"{p.to_all_ms:9.1f} {g.to_all_ms:9.1f} {p.to_all_ms / g.to_all_ms:8.3f} {p.gbps:9.2f} "
                     f"{p.gbps / memcpy:9.2f} {p.put_ms:8.1f} {g.put_ms:8.1f}")
    return "\n".join(lines)


def plot(report: Report, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    subs = sorted({p.subscribers for p in report.points})
    fig, axes = plt.subplots(1, len(subs), figsize=(4.2 * len(subs), 3.6), squeeze=False)
    for ax, n in zip(axes[0], subs, strict=True):
        for transport in TRANSPORTS:
            for check in (True, False):
                pts = sorted((p.mib, p.gbps) for p in report.points
                             if p.transport == transport and p.checksum == check and p.subscribers == n
                             and p.pipeline == all(q.pipeline for q in report.points))
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", linestyle="-" if check else "--",
                        label=f"{transport}{'' if check else ', no checksum'}")
        ax.axhline(report.memcpy_gbps, color="grey", linestyle=":", label="memcpy (one thread)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("state dict (MiB)")
        ax.set_ylabel("delivered GB/s (bytes x generators / time)")
        ax.set_title(f"{n} generator{'s' if n > 1 else ''}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"same host: shared memory vs gloo group (CPU, {report.cores} cores, torch {report.torch})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def bench(sizes: list[int], subscribers: list[int], reps: int, pipelines: tuple[bool, ...] = (False,)) -> Report:
    memcpy = memmove_gbps()
    print(f"memcpy ceiling (one thread): {memcpy:.1f} GB/s", flush=True)
    points: list[Point] = []

    def progress(p: Point) -> None:
        print(f"  {p.mib:6.0f} MiB x {p.subscribers} {p.transport:<5} checksum {'on ' if p.checksum else 'off'} "
              f"pipeline {'on ' if p.pipeline else 'off'} {p.to_all_ms:8.1f} ms  {p.gbps:6.2f} GB/s  "
              f"put {p.put_ms:6.1f} ms", flush=True)

    with tempfile.TemporaryDirectory(prefix="ws-same-host-") as tmp:
        for n in subscribers:
            for pipeline in pipelines:
                for transport in TRANSPORTS:
                    points += await run(transport, sizes, n, reps, Path(tmp), progress, pipeline)
    return Report(when=time.strftime("%Y-%m-%d %H:%M:%S"), torch=str(torch.__version__), cores=os.cpu_count() or 0,
                  reps=reps, memcpy_gbps=memcpy, points=points, targets=check_targets(points, memcpy))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.same_host", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,256,512,1024", help="MiB, comma-separated")
    parser.add_argument("--subscribers", default="1,2,4", help="generator processes, comma-separated")
    parser.add_argument("--reps", type=int, default=3, help="measured pushes per point (plus one warm-up)")
    parser.add_argument("--pipeline", choices=("off", "on", "both"), default="off",
                        help="Publisher(pipeline=...): off (the default on < 4 CPUs), on, or both side by side")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
        subscribers = [int(s) for s in args.subscribers.split(",")]
    except ValueError:
        parser.error("--sizes and --subscribers take comma-separated integers")
    if min(sizes) < 1 or min(subscribers) < 1 or args.reps < 1:
        parser.error("sizes, subscribers and reps must be >= 1")
    import uvloop

    pipelines = {"off": (False,), "on": (True,), "both": (False, True)}[args.pipeline]
    report = uvloop.run(bench(sizes, subscribers, args.reps, pipelines))
    json_path = write_json(args.out, "same_host", report)
    plot(report, Path(args.out) / "same_host.png")
    print()
    print(table(report.points, report.memcpy_gbps))
    print()
    status = verdict(report.targets)
    print(f"\nwrote {json_path} and {Path(args.out) / 'same_host.png'}")
    return status

if __name__ == "__main__":
    raise SystemExit(main())
