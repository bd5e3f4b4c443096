"""The cost model, fitted and checked on an emulated cluster (benchmarks/netns.py; needs root).

    python -m benchmarks.cost_model [--generators 1,2,4,8] [--rates 100,300,1000,3000]
                                    [--sizes 8,64] [--reps 3] [--out benchmarks/results]

For every number of generators N, link rate r (Mbit/s, every generator's link shaped to r
both ways, the trainer on the bridge) and version size S (``--sizes``, each at every rate: size
and rate varied independently; ``--sizes ''`` gives versions of ``--seconds`` of link time
instead), one publisher pushes versions in 4 MiB buckets, checksums on, and the time until
every generator has the version is measured (median of ``reps`` after one warm-up). The model

    T(N, r, S) = a + max(W(N, S, b, r) / eta, N * (c0 + k * S))

has three terms: a fixed cost ``a`` per version (announce, acknowledgements, rendezvous), the
wire, and the receivers' CPU, ``c0`` per version and ``k`` per byte each (every receiver copies
and checksums on the same two cores here; on a real cluster each has its own host, and its own
``c0 + k * S`` overlaps the wire). The wire term W is gloo's broadcast: a binomial tree,
store-and-forward per bucket of ``b`` bytes, the buckets pipelined through the rounds, each hop
at the link's rate times an efficiency ``eta`` (:func:`wire_seconds`). ``a``, ``eta``, ``c0``
and ``k`` are fitted by least squares on every configuration
but the held-out ones (``--hold-out``: by default every configuration at 4 generators and every
one at the second-fastest rate, each at both sizes), which the fitted model then predicts. (A
fit on one size cannot tell a receiver's fixed cost from its cost per byte: holding out every
64 MiB version, the 8 MiB ones put it all per byte and missed 4 and 8 generators at 3000
Mbit/s by 71-73 %.) Prints both tables, writes ``cost_model.json`` and ``cost_model.png`` (predicted
against measured).

Then it projects to real clusters (:func:`project`): one TCP stream's rate on this CPU,
measured in the same run, times the connections weightsync opens per pair (``Publisher``'s
``streams``, 2 by default) bounds what a hop carries; each generator's CPU term is ``c`` per
byte on its own host; sharded trainers send in W lanes (:func:`lane_seconds`: the busiest
link, with relays rotated across lanes as weightsync does, or in one order as before); and
deltas carry 2.2 % of the bytes at the CPU cost measured by ``make bench-delta``.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec
import torch

import weightsync as ws
from benchmarks import netns, report
from benchmarks.push_vs_broadcast import loopback_gbps
from weightsync.membership import generations

REPO = Path(__file__).resolve().parent.parent
BUCKET = 4 << 20


class Point(msgspec.Struct):
    generators: int
    rate_mbit: float
    nbytes: int
    bucket_bytes: int
    seconds: float  # median delivery time
    samples: list[float]


def tree(n: int) -> dict[int, int]:
    """gloo's broadcast to ``n`` others: a binomial tree; virtual rank -> its parent (root 0).

    In round i a rank that has the data sends to the rank whose bit i differs; the root's sends
    do not wait for each other, a relay forwards only what it has fully received.
    """
    # a rank receives in the round of its highest set bit, from itself without that bit
    return {v: v ^ (1 << (v.bit_length() - 1)) for v in range(1, n + 1)}


def wire_seconds(n: int, nbytes: int, bucket: int, rate_bps: float, root_bps: float | None = None) -> float:
    """Seconds until the last of ``n`` receivers has ``nbytes`` over gloo's tree, in buckets.

    Every link carries ``rate_bps`` each way; a relay's sends share its outgoing link, and so do
    the root's unless ``root_bps`` is None (its link not the limit: the emulation's bridge).
    Along a path, buckets are stored and forwarded, pipelined: the slowest hop carries the
    whole version, every other hop adds one bucket.
    """
    parent = tree(n)
    children: dict[int, int] = {}
    for p in parent.values():
        children[p] = children.get(p, 0) + 1
    hop: dict[int, float] = {}
    for v, p in parent.items():
        out = (root_bps if p == 0 else rate_bps)
        hop[v] = rate_bps if out is None else min(rate_bps, out / children[p])
    bucket = min(bucket, nbytes)
    worst = 0.0
    for v in parent:
        rates, x = [], v
        while x != 0:
            rates.append(hop[x])
            x = parent[x]
        slow = min(rates)
        worst = max(worst, nbytes * 8 / slow + sum(bucket * 8 / r for r in rates) - bucket * 8 / slow)
    return worst


def uplinks(n: int, world: int, rotate: bool = True) -> float:
    """The most versions' worth of bytes any of ``n`` generators forwards when ``world`` lanes
    each broadcast 1/world of a version down gloo's tree, in weightsync's lane orders
    (``rotate``) or all in one order."""
    names = tuple(f"gen{i:04d}" for i in range(n))
    sent = dict.fromkeys(names, 0.0)
    for rank in range(world):
        order = generations.lane_order(names, rank, world) if rotate and world > 1 else names
        for pos, member in enumerate(order):
            r, step = pos + 1, 1 << (pos + 1).bit_length()
            while r + step <= n:  # rank r forwards to r + 2^k for every 2^k > r
                sent[member] += 1 / world
                step *= 2
    return max(sent.values(), default=0.0)


def lane_seconds(n: int, world: int, nbytes: int, bucket: int, rate_bps: float, rotate: bool = True,
                 trainer_bps: float | None = None, stream_bps: float | None = None) -> float:
    """Wire seconds until ``n`` generators have a version that ``world`` trainer ranks send in
    lanes (each 1/world down its own tree), every generator's link at ``rate_bps`` each way.

    The busiest link sets the pace: a generator's downlink takes the whole version, its uplink
    what it relays in every lane (:func:`uplinks`), a trainer rank's link (``trainer_bps``, its
    own NIC; None: not the limit) its children's share. Each lane's hop is its own TCP stream,
    at most ``stream_bps`` (None: no limit), so a link carrying several lanes can go faster than
    one stream. The deepest path adds one bucket per extra hop (store and forward)."""
    share = nbytes / world
    children = sum(1 for p in tree(n).values() if p == 0)
    busiest = max(nbytes, uplinks(n, world, rotate) * nbytes) * 8 / rate_bps
    if trainer_bps is not None:
        busiest = max(busiest, children * share * 8 / trainer_bps)
    hop = rate_bps if stream_bps is None else min(rate_bps, stream_bps)
    busiest = max(busiest, share * 8 / hop)
    extra_hops = max(bin(v).count("1") for v in range(1, n + 1)) - 1  # the deepest path's hops past the first
    return busiest + extra_hops * min(bucket, share) * 8 / hop


def predict(p: Point, a: float, eta: float, k: float, c0: float = 0.0) -> float:
    """The model: a fixed cost, then the wire at efficiency ``eta`` or the receivers' CPU work
    (per receiver ``c0`` per version and ``k`` per byte, on this machine's shared cores),
    whichever is longer."""
    wire = wire_seconds(p.generators, p.nbytes, p.bucket_bytes, p.rate_mbit * 1e6) / eta
    return a + max(wire, p.generators * (c0 + k * p.nbytes))


def fit(train: list[Point]) -> tuple[float, float, float, float]:
    """(a, eta, k, c0) minimising the squared relative error over ``train`` (a grid over eta, k
    and c0; a in closed form for each)."""
    best: tuple[float, float, float, float, float] | None = None
    wires = [wire_seconds(p.generators, p.nbytes, p.bucket_bytes, p.rate_mbit * 1e6) for p in train]
    w = [1 / p.seconds ** 2 for p in train]
    for eta in [0.80 + 0.005 * i for i in range(61)]:
        for k in [0.0] + [1e-11 * 1.1 ** j for j in range(120)]:
            for c0 in [0.0] + [1e-4 * 1.25 ** j for j in range(25)]:
                rest = [max(wire / eta, p.generators * (c0 + k * p.nbytes))
                        for wire, p in zip(wires, train, strict=True)]
                # minimise sum(((a + r - t) / t)^2) over a
                a = max(0.0, sum(wi * (p.seconds - r) for wi, p, r in zip(w, train, rest, strict=True)) / sum(w))
                err = sum(((a + r - p.seconds) / p.seconds) ** 2 for p, r in zip(train, rest, strict=True))
                if best is None or err < best[0]:
                    best = (err, a, eta, k, c0)
    assert best is not None
    return best[1], best[2], best[3], best[4]


async def measure(cluster: netns.Cluster, n: int, rates: list[float], sizes: list[int | None], seconds: float,
                  reps: int, tmp: Path) -> list[Point]:
    points = []
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    env.update(PYTHONPATH=str(REPO), TORCH_CPP_LOG_LEVEL="ERROR")
    async with ws.Publisher("model", address=f"{cluster.trainer_ip}:0", timeout=120, bucket_bytes=BUCKET,
                            encoding="full") as pub:
        for i in range(n):
            spec = {"role": "follower", "channel": "model", "address": pub.address, "member": f"gen{i}",
                    "timeout": 120.0, "transport": "group", "result": str(tmp / f"n{n}-g{i}.json")}
            cluster.popen(i, [sys.executable, "-m", "benchmarks.workers", msgspec.json.encode(spec).decode()],
                          env=env, cwd=REPO, stdout=subprocess.DEVNULL)
        await pub.wait_subscribers(n, timeout=120)
        version = 0
        for rate in rates:
            for i in range(n):
                cluster.set_rate(i, rate)
            for size in sizes:  # None: ``seconds`` of link time at this rate
                nbytes = (size if size is not None else int(rate * 1e6 / 8 * seconds)) // 4096 * 4096
                body = torch.zeros(nbytes // 4)
                samples = []
                for rep in range(reps + 1):
                    handle = await pub.put({"w": body + version}, version=version)
                    delivered = await handle.delivered(timeout=600)
                    assert len(delivered.members) == n, f"only {delivered.members} got {version}: {pub.evicted}"
                    version += 1
                    if rep:
                        samples.append(delivered.seconds)
                points.append(Point(n, rate, nbytes, BUCKET, statistics.median(samples), samples))
                print(f"  {n} generators at {rate:6.0f} Mbit/s, {nbytes / 2**20:6.1f} MiB: "
                      f"{points[-1].seconds * 1e3:7.1f} ms", flush=True)
    return points


def collect(generators: list[int], rates: list[float], sizes: list[int | None], seconds: float,
            reps: int) -> list[Point]:
    points: list[Point] = []
    with tempfile.TemporaryDirectory(prefix="ws-cost-") as tmp:
        for n in generators:
            with netns.Cluster([None] * n) as cluster:
                points += asyncio.run(measure(cluster, n, rates, sizes, seconds, reps, Path(tmp)))
    return points


class Measured(msgspec.Struct):
    """What ``--points`` reads of an earlier run's JSON (its fit and projections are made again)."""

    points: list[Point]


class Prediction(msgspec.Struct):
    generators: int
    rate_mbit: float
    mib: float
    measured: float
    predicted: float
    held_out: bool

    @property
    def error(self) -> float:
        return (self.predicted - self.measured) / self.measured


#: deltas at RL learning rates, from `make bench-delta` (docs/benchmarks.md "Deltas against full
#: versions", 1.01 GiB bf16 Llama, lr 1e-6, 2-core Intel Xeon): the share of the version on the
#: wire, and the CPU seconds per byte of the version to make a delta (a trainer rank, its share)
#: and to apply one and check it (a generator, the whole version)
DELTA_SHARE = 0.022
ENCODE_S_PER_BYTE = 1.3 / 1.01 / 2**30
DECODE_S_PER_BYTE = 1.3 / 1.01 / 2**30
LANES = (8, 256)


class Projection(msgspec.Struct):
    """Seconds until every generator has a version; the wire's (``a`` plus the tree), and
    separately what a CPU receiver's own work costs at this machine's rate per byte."""

    model: str
    params: float
    generators: int
    nic_gbit: float
    seconds: float  # one trainer rank sends the whole version down gloo's tree
    lanes_same_order: float  # 8 ranks, each lane's tree in one order (before lanes took turns)
    lanes: dict[str, float]  # W ranks (LANES), lanes rotated: "8", "256"
    lanes_delta: dict[str, float]  # the same, each version a delta: DELTA_SHARE of the bytes on the wire
    hop_gbit: float  # what one hop carries: the NIC at eta, at most `streams` TCP streams
    receiver_cpu: float  # a generator receiving into host memory: k per byte of the version, this CPU
    delta_cpu: float  # a generator applying a delta on this CPU (a trainer rank's share to make it is less)


class Result(msgspec.Struct):
    points: list[Point]
    a_seconds: float
    eta: float
    k_seconds_per_byte: float
    predictions: list[Prediction]
    worst_held_out: float
    projections: list[Projection]
    stream_gbit: float = 0.0  # one TCP stream on this CPU (loopback), measured in the same run
    cpu: str = ""
    c0_seconds: float = 0.0  # per receiver per version, on the shared cores
    streams: int = 1  # connections per pair the projections count (Publisher's default)


def project(eta: float, a: float, k: float, stream_bps: float, streams: int) -> list[Projection]:
    """The checked model on real clusters: bf16 weights, every node's NIC (each trainer rank's
    included) at ``nic`` Gbit/s, gloo's tree with 64 MiB buckets. A hop carries the NIC's rate at
    ``eta``, and each lane's hop at most ``streams`` TCP streams of ``stream_bps`` each (measured:
    one gloo connection is one stream; weightsync opens ``streams`` per pair and consecutive
    buckets take turns on them): one sender cannot fill a NIC faster than that, W lanes can.

    The wire's figures assume the receivers keep up (a GPU receiving into its own memory). A
    generator receiving into host memory has its own host, and its CPU work overlaps the wire,
    so the longer of the two counts: ``receiver_cpu`` is that work at ``k`` per byte (fitted on
    the emulated cluster, where N of them share two cores of this CPU)."""
    out = []
    for name, params in (("7B", 7e9), ("70B", 70e9), ("1T", 1e12)):
        nbytes = int(2 * params)
        for n in (8, 32, 128):
            for nic in (100.0, 400.0):
                link = nic * 1e9 * eta
                hop = min(link, streams * stream_bps)  # one sender: its connections per hop
                one = a + wire_seconds(n, nbytes, 64 << 20, hop, root_bps=hop)
                kw = {"trainer_bps": link, "stream_bps": streams * stream_bps}
                same = a + lane_seconds(n, 8, nbytes, 64 << 20, link, rotate=False, **kw)
                lanes = {str(w): a + lane_seconds(n, w, nbytes, 64 << 20, link, **kw) for w in LANES}
                deltas = {str(w): a + lane_seconds(n, w, int(nbytes * DELTA_SHARE), 64 << 20, link, **kw)
                          for w in LANES}
                out.append(Projection(name, params, n, nic, one, same, lanes, deltas, hop / 1e9, k * nbytes,
                                      DECODE_S_PER_BYTE * nbytes))
    return out


def held(p: Point, rules: set[tuple[str, str, str]]) -> bool:
    """Whether ``p`` matches a hold-out rule (generators, rate, MiB; "*" for any)."""
    mib = f"{p.nbytes / 2**20:g}"
    return any(n in ("*", str(p.generators)) and r in ("*", f"{p.rate_mbit:g}") and s in ("*", mib)
               for n, r, s in rules)


def analyse(points: list[Point], rules: set[tuple[str, str, str]], stream_bps: float) -> Result:
    train = [p for p in points if not held(p, rules)]
    a, eta, k, c0 = fit(train)
    predictions = [Prediction(p.generators, p.rate_mbit, p.nbytes / 2**20, p.seconds, predict(p, a, eta, k, c0),
                              held(p, rules)) for p in points]
    worst = max((abs(x.error) for x in predictions if x.held_out), default=0.0)
    streams = inspect.signature(ws.Publisher).parameters["streams"].default
    return Result(points, a, eta, k, predictions, worst, project(eta, a, k, stream_bps, streams), stream_bps / 1e9,
                  report.cpu_name(), c0, streams)


def show(result: Result) -> None:
    print(f"\nfitted on {sum(not p.held_out for p in result.predictions)} configurations: "
          f"a = {result.a_seconds * 1e3:.1f} ms, eta = {result.eta:.3f}, "
          f"k = {result.k_seconds_per_byte * 1e9:.3f} s/GB and c0 = {result.c0_seconds * 1e3:.1f} ms per receiver")
    print(f"{'N':>3} {'Mbit/s':>7} {'MiB':>7} {'measured':>9} {'predicted':>9} {'error':>7}  set")
    for x in result.predictions:
        print(f"{x.generators:3d} {x.rate_mbit:7.0f} {x.mib:7.1f} {x.measured * 1e3:7.0f}ms {x.predicted * 1e3:7.0f}ms "
              f"{x.error:+7.1%}  {'held out' if x.held_out else 'fit'}")
    print(f"worst held-out error: {result.worst_held_out:.1%} (target: within 25%)")
    print(f"\nprojection (bf16; gloo's tree, 64 MiB buckets, every NIC at the rate given at eta, a hop at most "
          f"{result.streams} TCP streams of {result.stream_gbit:.1f} Gb/s on {result.cpu}). "
          "Wire columns: receivers that keep up; CPU columns: what a generator receiving into host memory "
          "(or applying a delta) spends on this CPU, "
          "overlapping the wire (the longer counts):")
    print(f"{'model':>6} {'N':>4} {'NIC':>9} {'1 sender':>9} {'8 same':>8} {'8 lanes':>8} {'256 lanes':>9} "
          f"{'+delta':>8} {'CPU recv':>9} {'CPU delta':>9}")
    for x in result.projections:
        print(f"{x.model:>6} {x.generators:4d} {x.nic_gbit:5.0f} Gb/s {x.seconds:8.2f}s {x.lanes_same_order:7.2f}s "
              f"{x.lanes['8']:7.2f}s {x.lanes['256']:8.2f}s {x.lanes_delta['256']:7.2f}s {x.receiver_cpu:8.1f}s "
              f"{x.delta_cpu:8.1f}s")
    print("published: Perplexity, 1T from 256 trainer GPUs to 128 inference GPUs in 1.3 s (RDMA, each GPU "
          "receiving only its own shard); above, every generator receives the whole version over TCP")


def plot(result: Result, out: Path, json_path: Path) -> None:
    plt = report.pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for held, marker, label in ((False, "o", "fitted"), (True, "s", "held out")):
        xs = [x for x in result.predictions if x.held_out == held]
        left.scatter([x.measured for x in xs], [x.predicted for x in xs], marker=marker, label=label)
    top = max(max(x.measured, x.predicted) for x in result.predictions) * 1.1
    left.plot([0, top], [0, top], "k-", lw=0.8)
    left.fill_between([0, top], [0, top * 0.75], [0, top * 1.25], color="grey", alpha=0.15, label="within 25%")
    left.set(xlabel="measured (s)", ylabel="predicted (s)", title="delivery to every generator")
    left.legend(fontsize=8)
    rates = sorted({x.rate_mbit for x in result.predictions})
    for rate in rates:
        xs = sorted((x for x in result.predictions if x.rate_mbit == rate), key=lambda x: x.generators)
        line = right.plot([x.generators for x in xs], [x.measured for x in xs], "o", label=f"{rate:.0f} Mbit/s")[0]
        right.plot([x.generators for x in xs], [x.predicted for x in xs], "-", color=line.get_color())
    right.set_xscale("log", base=2)
    right.minorticks_off()
    right.set(xticks=[1, 2, 4, 8], xlabel="generators", ylabel="seconds", title="measured (dots) and the model (lines)")
    right.set_xticklabels(["1", "2", "4", "8"])
    right.legend(fontsize=8)
    report.save(fig, out, "cost_model", json_path)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cost_model", description=__doc__.splitlines()[0])
    parser.add_argument("--generators", default="1,2,4,8")
    parser.add_argument("--rates", default="100,300,1000,3000")
    parser.add_argument("--sizes", default="8,64",
                        help="version sizes in MiB, each at every rate ('' for --seconds of link time instead)")
    parser.add_argument("--seconds", type=float, default=0.6,
                        help="with --sizes '': each version this long at the rate")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--hold-out", default="4x*,*x1000",
                        help="configurations the fit never sees: NxRATE or NxRATExMIB, * for any "
                             "(default: 4x*,*x1000: every one at 4 generators and every one at 1000 Mbit/s)")
    parser.add_argument("--points", help="refit the points of an earlier run's cost_model.json instead of measuring")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    if args.points:
        points = msgspec.json.decode(Path(args.points).read_bytes(), type=Measured).points
    else:
        reason = netns.unavailable()
        if reason is not None:
            print(f"cannot build the emulated cluster here: {reason}")
            return 1
        generators = [int(x) for x in args.generators.split(",")]
        rates = [float(x) for x in args.rates.split(",")]
        sizes: list[int | None] = [int(x) << 20 for x in args.sizes.split(",") if x] or [None]
        points = collect(generators, rates, sizes, args.seconds, args.reps)
    rules = set()
    for rule in args.hold_out.split(","):
        n, rate, mib = (rule.split("x") + ["*", "*"])[:3]
        rules.add((n, rate, mib))
    stream = loopback_gbps() * 8e9  # one TCP stream on this CPU: what one gloo pair can carry at most
    result = analyse(points, rules, stream)
    show(result)
    path = report.write_json(args.out, "cost_model", result)
    plot(result, Path(args.out), path)
    return 0 if result.worst_held_out <= 0.25 else 1


if __name__ == "__main__":
    raise SystemExit(main())
