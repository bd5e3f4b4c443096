"""Lanes that share relays against lanes that do not, on an emulated cluster (needs root).

    python -m benchmarks.lanes [--lanes 2,4] [--generators 8] [--rate 200] [--mib 32] [--reps 3]

A sharded trainer of W ranks (W Publishers with ``rank=``/``world_size=`` in this process, each
owning 1/W of the version) pushes to N generator processes, each in its own network namespace
behind a link of ``--rate`` Mbit/s each way (benchmarks/netns.py). Every lane is its own gloo
group holding every generator, and gloo broadcasts down a binomial tree whose first ranks relay.
Two orders side by side, each with a fresh cluster, publishers and generators:

- ``same``: every lane's group in one order (``generations.ROTATE_LANES = False``): the same
  generators relay in every lane, and the first one's uplink carries two versions' worth at N=8;
- ``rotated``: what weightsync does (``generations.lane_order``): lane r starts its order r/W of
  the way round, so at W=2 no generator relays in both lanes.

Per point: the median, over ``--reps`` pushes after one warm-up, of the time from the ranks'
common start until every rank's version reached every generator; and the cost model's figure
for it (``benchmarks.cost_model.lane_seconds``: the busiest link's bytes over its rate, a
generator's downlink taking the whole version and its uplink what it relays in every lane, plus
a bucket of store-and-forward per extra hop), with its error. The model's links run at an
efficiency ``eta`` (TCP over htb): first, one generator takes the version through one lane over
one link, and the link's bytes at the rate over that time are this run's ``eta``; the lane term is
divided by it, as the cost model divides its wire term. Prints the table (the lane term at the
rate and at ``eta``), writes ``lanes.json`` and ``lanes.png``.
Targets (issue 28): rotated no slower than same at every W, faster where the model says so, and
the model within 25 % of every point.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import torch

import weightsync as ws
from benchmarks import netns, report
from benchmarks.cost_model import lane_seconds, uplinks
from weightsync.membership import generations

REPO = Path(__file__).resolve().parent.parent
ORDERS = ("same", "rotated")
BUCKET = 4 << 20


class Point(msgspec.Struct):
    lanes: int
    generators: int
    order: str
    rate_mbit: float
    nbytes: int
    seconds: float  # median time until every rank's part reached every generator
    samples: list[float]
    model_seconds: float  # benchmarks.cost_model.lane_seconds: the busiest link, plus a bucket per extra hop
    model_at_eta: float  # the same at the link efficiency measured in this run (Result.eta), as the model divides
    max_uplink_versions: float  # the most any generator forwards, in versions


class Result(msgspec.Struct):
    when: str
    cpu: str
    cores: int
    one_link_seconds: float  # one generator, one lane: the version over one link, measured first
    eta: float  # the link's efficiency that gives: the version's bytes at the rate over one_link_seconds
    points: list[Point]
    targets: dict[str, bool]


async def push(cluster: netns.Cluster, world: int, n: int, nbytes: int, reps: int, tmp: Path) -> list[float]:
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    env.update(PYTHONPATH=str(REPO), TORCH_CPP_LOG_LEVEL="ERROR")
    # the default straggler policy: an honest generator must not be scored slow for its relays
    kw = {"timeout": 120.0, "bucket_bytes": BUCKET, "encoding": "full", "lane_address": f"{cluster.trainer_ip}:0"}
    first = ws.Publisher("lanes", address=f"{cluster.trainer_ip}:0", rank=0, world_size=world, **kw)
    starting = asyncio.create_task(first.start())
    address = None
    while address is None:  # rank 0 listens before its start returns (that waits for the other ranks)
        try:
            address = first.address
        except RuntimeError:
            await asyncio.sleep(0.01)
    pubs = [first] + [ws.Publisher("lanes", address=address, rank=r, world_size=world, **kw) for r in range(1, world)]
    try:
        await asyncio.gather(starting, *(p.start() for p in pubs[1:]))
        for i in range(n):
            spec = {"role": "follower", "channel": "lanes", "address": address, "member": f"gen{i}",
                    "timeout": 120.0, "transport": "group", "result": str(tmp / f"w{world}-g{i}.json")}
            cluster.popen(i, [sys.executable, "-m", "benchmarks.workers", msgspec.json.encode(spec).decode()],
                          env=env, cwd=REPO, stdout=subprocess.DEVNULL)
        await asyncio.gather(*(p.wait_subscribers(n, timeout=120) for p in pubs))
        part = nbytes // world // 4
        # which rank owns each tensor: only a sharded publisher takes it (one rank, in calibrate, owns all)
        owners = {f"w{r}": r for r in range(world)} if world > 1 else None
        samples = []
        for version in range(reps + 1):
            sd = {f"w{r}": torch.full((part,), float(version)) for r in range(world)}
            began = time.monotonic()
            handles = await asyncio.gather(*(p.put(sd, version=version, owners=owners) for p in pubs))
            reports = await asyncio.gather(*(h.delivered(timeout=600) for h in handles))
            took = time.monotonic() - began
            short = [r.members for r in reports if len(r.members) != n]
            assert not short, f"version {version} reached only {short}: {[p.evicted for p in pubs]}"
            if version:
                samples.append(took)
        return samples
    finally:
        await asyncio.gather(*(p.aclose() for p in pubs), return_exceptions=True)


def calibrate(rate: float, nbytes: int, reps: int) -> tuple[float, float]:
    """One generator, one lane, one link: the seconds a version takes, and the link efficiency
    (``eta`` of the cost model) that makes: its bytes at the rate over those seconds, at most 1."""
    with tempfile.TemporaryDirectory(prefix="ws-lanes-") as tmp, netns.Cluster([rate]) as cluster:
        seconds = statistics.median(asyncio.run(push(cluster, 1, 1, nbytes, reps, Path(tmp))))
    eta = min(1.0, nbytes * 8 / (rate * 1e6) / seconds)
    print(f"  one generator, one lane: {seconds:7.2f} s (the link at {eta:.3f} of its rate)", flush=True)
    return seconds, eta


def measure(lanes: list[int], n: int, rate: float, nbytes: int, reps: int, eta: float) -> list[Point]:
    points = []
    with tempfile.TemporaryDirectory(prefix="ws-lanes-") as tmp:
        for world in lanes:
            for order in ORDERS:
                generations.ROTATE_LANES = order == "rotated"
                with netns.Cluster([rate] * n) as cluster:
                    samples = asyncio.run(push(cluster, world, n, nbytes, reps, Path(tmp)))
                up = uplinks(n, world, order == "rotated")
                model = lane_seconds(n, world, nbytes, BUCKET, rate * 1e6, rotate=order == "rotated")
                points.append(Point(world, n, order, rate, nbytes, statistics.median(samples), samples, model,
                                    model / eta, up))
                print(f"  W={world} {order:>8}: {points[-1].seconds:7.2f} s (model {model / eta:5.2f} s, "
                      f"busiest uplink {up:.2f} versions)", flush=True)
    generations.ROTATE_LANES = True
    return points


def plot(result: Result, out: str, json_path: Path) -> None:
    plt = report.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3.2))
    worlds = sorted({p.lanes for p in result.points})
    for k, order in enumerate(ORDERS):
        pts = [next(p for p in result.points if p.lanes == w and p.order == order) for w in worlds]
        xs = [i + (k - 0.5) * 0.35 for i in range(len(worlds))]
        ax.bar(xs, [p.seconds for p in pts], width=0.35, label=f"{order} (measured)")
        ax.plot(xs, [p.model_at_eta for p in pts], "k_", markersize=18)
    ax.set_xticks(range(len(worlds)), [f"W={w}" for w in worlds])
    ax.set(ylabel="seconds to every generator", title=f"{result.points[0].generators} generators, "
           f"{result.points[0].rate_mbit:.0f} Mbit/s links (bars: measured, marks: model at eta {result.eta:.2f})")
    ax.legend(fontsize=8)
    report.save(fig, out, "lanes", json_path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lanes", description=__doc__.splitlines()[0])
    parser.add_argument("--lanes", default="2,4")
    parser.add_argument("--generators", type=int, default=8)
    parser.add_argument("--rate", type=float, default=200.0, help="each generator's link, Mbit/s each way")
    parser.add_argument("--mib", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    reason = netns.unavailable()
    if reason is not None:
        print(f"cannot build the emulated cluster here: {reason}")
        return 1
    lanes = [int(x) for x in args.lanes.split(",")]
    one_link, eta = calibrate(args.rate, args.mib << 20, args.reps)
    points = measure(lanes, args.generators, args.rate, args.mib << 20, args.reps, eta)
    by = {(p.lanes, p.order): p for p in points}
    targets = {}
    for w in lanes:
        same, rotated = by[(w, "same")], by[(w, "rotated")]
        targets[f"W={w}: rotated no slower than same"] = rotated.seconds <= same.seconds * 1.05
        if rotated.model_seconds < 0.8 * same.model_seconds:
            targets[f"W={w}: rotated at most 0.8x same (the model: "
                    f"{rotated.model_seconds / same.model_seconds:.2f}x)"] = rotated.seconds <= 0.8 * same.seconds
    print(f"{'W':>3} {'order':>8} {'seconds':>8} {'at rate':>8} {'at eta':>7} {'error':>7} {'rotated/same':>13}")
    for p in points:
        ratio = p.seconds / by[(p.lanes, "same")].seconds
        error = (p.model_at_eta - p.seconds) / p.seconds
        print(f"{p.lanes:3d} {p.order:>8} {p.seconds:8.2f} {p.model_seconds:8.2f} {p.model_at_eta:7.2f} "
              f"{error:+7.1%} {ratio:13.2f}")
    worst = max(abs(p.model_at_eta - p.seconds) / p.seconds for p in points)
    targets[f"the cost model's lane term (links at eta {eta:.3f}) within 25 % of every point"] = worst <= 0.25
    result = Result(time.strftime("%Y-%m-%d %H:%M"), report.cpu_name(), os.cpu_count() or 0, one_link, eta,
                    points, targets)
    path = report.write_json(args.out, "lanes", result)
    plot(result, args.out, path)
    return report.verdict(targets)


if __name__ == "__main__":
    raise SystemExit(main())
