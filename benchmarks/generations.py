"""What a membership change costs: in-place reconfigure against a rebuilt group, side by side.

    python -m benchmarks.generations [--cycles 10] [--members 3] [--out benchmarks/results]

One publisher and ``--members`` subscribers, all in this process (gloo). Each cycle one more
subscriber joins and then leaves; a 4 KiB version is delivered after each change. For both
paths (torch 2.14+ only offers ``in_place``; ``WEIGHTSYNC_RECONFIGURE=0`` forces ``rebuild``)
it reports, as medians over the cycles:

- ``join_ms``: from ``Subscriber.start()`` to a version delivered to everyone, newcomer included;
- ``leave_ms``: from ``aclose()`` of the newcomer to a version delivered to the rest;
- ``form_ms``: the publisher's own share, the ``reconfigure`` or ``rebuild`` step.

Writes JSON and a PNG; prints the ratio in-place / rebuild.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path

import msgspec
import torch

import weightsync as ws
from weightsync.fr import FlightRecorder


class PathResult(msgspec.Struct):
    path: str
    join_ms: float
    leave_ms: float
    form_ms: float
    joins: list[float]
    leaves: list[float]


class Report(msgspec.Struct):
    torch: str
    when: str
    cycles: int
    members: int
    results: list[PathResult]
    in_place_vs_rebuild_join: float = 0.0


async def measure(path: str, cycles: int, members: int, tmp: Path) -> PathResult:
    os.environ["WEIGHTSYNC_RECONFIGURE"] = "1" if path == "in_place" else "0"
    rec = FlightRecorder(directory=tmp, label=f"publisher-{path}")
    version = 0
    joins: list[float] = []
    leaves: list[float] = []

    async def deliver(pub: ws.Publisher, n: int) -> None:
        nonlocal version
        report = await (await pub.put({"w": torch.full((1024,), float(version))}, version=version)).delivered(
            timeout=60)
        version += 1
        if len(report.members) != n:
            raise RuntimeError(f"version {version - 1} reached {report.members}, expected {n} members")

    async with ws.Publisher(f"gens-{path}", timeout=10, heartbeat_interval=0.25, recorder=rec) as pub:
        base = [ws.Subscriber(pub.name, address=pub.address, member_id=f"m{i}", timeout=10,
                              recorder=FlightRecorder(capacity=0), transport="group") for i in range(members)]
        for sub in base:
            await sub.start()
        await pub.wait_subscribers(members, timeout=60)
        await deliver(pub, members)
        for cycle in range(cycles):
            newcomer = ws.Subscriber(pub.name, address=pub.address, member_id=f"new{cycle}", timeout=10,
                                     recorder=FlightRecorder(capacity=0), transport="group")
            t0 = time.perf_counter()
            await newcomer.start()
            await pub.wait_subscribers(members + 1, timeout=60)
            await deliver(pub, members + 1)
            joins.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await newcomer.aclose()
            await deliver(pub, members)
            leaves.append(time.perf_counter() - t0)
            print(f"  {path:<8} cycle {cycle + 1:>2}/{cycles}: join {joins[-1] * 1e3:7.1f} ms, "
                  f"leave {leaves[-1] * 1e3:7.1f} ms", flush=True)
        for sub in base:
            await sub.aclose()
    op = "reconfigure" if path == "in_place" else "rebuild"
    forms = [e.duration for e in rec.snapshot() if e.op == op and e.state == "completed"]
    return PathResult(path=path, join_ms=statistics.median(joins) * 1e3, leave_ms=statistics.median(leaves) * 1e3,
                      form_ms=statistics.median(forms) * 1e3 if forms else 0.0, joins=joins, leaves=leaves)


def plot(report: Report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    fields = ("join_ms", "leave_ms", "form_ms")
    width = 0.8 / len(report.results)
    for i, result in enumerate(report.results):
        ax.bar([f + i * width for f in range(len(fields))], [getattr(result, f) for f in fields], width,
               label=result.path)
    ax.set_xticks([f + width * (len(report.results) - 1) / 2 for f in range(len(fields))],
                  ["join -> delivered", "leave -> delivered", "publisher's form step"])
    ax.set_ylabel("ms (median)")
    ax.set_title(f"membership change, {report.members}+1 members, gloo, torch {report.torch}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=10)
    parser.add_argument("--members", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    if args.cycles < 1 or args.members < 1:
        parser.error("--cycles and --members must be >= 1")
    in_place = ws.Publisher("probe", backend="gloo").settings.in_place  # this torch re-forms gloo in place
    paths = ["in_place", "rebuild"] if in_place else ["rebuild"]
    if len(paths) == 1:
        print(f"torch {torch.__version__} cannot reconfigure gloo in place: measuring the rebuild path only")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    saved = os.environ.get("WEIGHTSYNC_RECONFIGURE")
    try:
        results = [asyncio.run(measure(p, args.cycles, args.members, out)) for p in paths]
    finally:
        if saved is None:
            os.environ.pop("WEIGHTSYNC_RECONFIGURE", None)
        else:
            os.environ["WEIGHTSYNC_RECONFIGURE"] = saved
    report = Report(torch=str(torch.__version__), when=time.strftime("%Y-%m-%d %H:%M:%S"), cycles=args.cycles,
                    members=args.members, results=results)
    if len(results) == 2:
        report.in_place_vs_rebuild_join = results[0].join_ms / results[1].join_ms
    print(f"\n{'path':<9} {'join ms':>8} {'leave ms':>9} {'form ms':>8}")
    for r in results:
        print(f"{r.path:<9} {r.join_ms:8.1f} {r.leave_ms:9.1f} {r.form_ms:8.1f}")
    if len(results) == 2:
        print(f"in-place / rebuild: join {report.in_place_vs_rebuild_join:.2f}x, "
              f"leave {results[0].leave_ms / results[1].leave_ms:.2f}x, "
              f"form {results[0].form_ms / max(results[1].form_ms, 1e-9):.2f}x")
    (out / "generations.json").write_bytes(msgspec.json.format(msgspec.json.encode(report)))
    plot(report, out / "generations.png")
    print(f"wrote {out / 'generations.json'} and {out / 'generations.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
