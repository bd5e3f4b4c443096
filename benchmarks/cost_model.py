"""The cost model, fitted and checked on an emulated cluster (benchmarks/netns.py; needs root).

    python -m benchmarks.cost_model [--generators 1,2,4,8] [--rates 100,300,1000,3000]
                                    [--seconds 0.6] [--reps 3] [--out benchmarks/results]

For every number of generators N and link rate r (Mbit/s, every generator's link shaped to r
both ways, the trainer on the bridge), one publisher pushes versions of about ``seconds`` x r
bytes in 4 MiB buckets, checksums on, and the time until every generator has
the version is measured (median of ``reps`` after one warm-up). The model

    T(N, r, S) = a + (S / b + R(N) - 1) * b / (eta * r) + c * N * S

has three terms: a fixed cost ``a`` per version (announce, acknowledgements, rendezvous), the
wire, and a per-byte CPU cost per generator ``c`` (every receiver copies and checksums on the
same two cores here; on a real cluster each has its own host and c drops out). The wire term is
gloo's broadcast: a binomial tree (R(N) = ceil(log2(N + 1)) rounds), store-and-forward per
bucket, the buckets pipelined through the rounds, each hop at the link's rate times an
efficiency ``eta``. ``a``, ``eta`` and ``c`` are fitted by least squares on every configuration
but the held-out ones (``--hold-out``: by default every configuration at 4 generators and every
one at the second-fastest rate), which the fitted model then predicts. Prints both tables,
writes ``cost_model.json`` and ``cost_model.png`` (predicted against measured).
"""

from __future__ import annotations

import argparse
import asyncio
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


def predict(p: Point, a: float, eta: float, k: float) -> float:
    """The model: a fixed cost, then the wire at efficiency ``eta`` or the receivers' CPU work
    (``k`` seconds per byte per receiver, on this machine's shared cores), whichever is longer."""
    wire = wire_seconds(p.generators, p.nbytes, p.bucket_bytes, p.rate_mbit * 1e6) / eta
    return a + max(wire, k * p.generators * p.nbytes)


def fit(train: list[Point]) -> tuple[float, float, float]:
    """(a, eta, k) minimising the squared relative error over ``train`` (a grid over eta and k;
    a in closed form for each)."""
    best: tuple[float, float, float, float] | None = None
    for eta in [0.80 + 0.005 * i for i in range(61)]:
        for k in [0.0] + [1e-11 * 1.1 ** j for j in range(120)]:
            rest = [max(wire_seconds(p.generators, p.nbytes, p.bucket_bytes, p.rate_mbit * 1e6) / eta,
                        k * p.generators * p.nbytes) for p in train]
            # minimise sum(((a + r - t) / t)^2) over a
            w = [1 / p.seconds ** 2 for p in train]
            a = max(0.0, sum(wi * (p.seconds - r) for wi, p, r in zip(w, train, rest, strict=True)) / sum(w))
            err = sum(((a + r - p.seconds) / p.seconds) ** 2 for p, r in zip(train, rest, strict=True))
            if best is None or err < best[0]:
                best = (err, a, eta, k)
    assert best is not None
    return best[1], best[2], best[3]


async def measure(cluster: netns.Cluster, n: int, rates: list[float], seconds: float, reps: int,
                  tmp: Path) -> list[Point]:
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
            nbytes = int(rate * 1e6 / 8 * seconds) // 4096 * 4096
            body = torch.zeros(nbytes // 4)
            samples = []
            for rep in range(reps + 1):
                handle = await pub.put({"w": body + version}, version=version)
                delivered = await handle.delivered(timeout=600)
                assert len(delivered.members) == n, f"only {delivered.members} got version {version}: {pub.evicted}"
                version += 1
                if rep:
                    samples.append(delivered.seconds)
            points.append(Point(n, rate, nbytes, BUCKET, statistics.median(samples), samples))
            print(f"  {n} generators at {rate:6.0f} Mbit/s, {nbytes / 2**20:6.1f} MiB: "
                  f"{points[-1].seconds * 1e3:7.1f} ms", flush=True)
    return points


def collect(generators: list[int], rates: list[float], seconds: float, reps: int) -> list[Point]:
    points: list[Point] = []
    with tempfile.TemporaryDirectory(prefix="ws-cost-") as tmp:
        for n in generators:
            with netns.Cluster([None] * n) as cluster:
                points += asyncio.run(measure(cluster, n, rates, seconds, reps, Path(tmp)))
    return points


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


class Projection(msgspec.Struct):
    model: str
    params: float
    generators: int
    nic_gbit: float
    seconds: float  # one trainer NIC sends the whole version down gloo's tree
    lanes8_seconds: float  # 8 trainer ranks each send 1/8 down their own tree (the sharding issue)


class Result(msgspec.Struct):
    points: list[Point]
    a_seconds: float
    eta: float
    k_seconds_per_byte: float
    predictions: list[Prediction]
    worst_held_out: float
    projections: list[Projection]


def project(eta: float, a: float) -> list[Projection]:
    """The checked wire term on real clusters: bf16 weights, every node's NIC (the trainer's
    included) at ``nic`` Gbit/s, gloo's tree with 64 MiB buckets; no CPU term (each
    receiver has its own host)."""
    out = []
    for name, params in (("7B", 7e9), ("70B", 70e9), ("1T", 1e12)):
        for n in (8, 32, 128):
            for nic in (100.0, 400.0):
                nbytes = int(2 * params)
                wire = wire_seconds(n, nbytes, 64 << 20, nic * 1e9, root_bps=nic * 1e9) / eta
                # 8 lanes: each tree carries an eighth, but every generator's own NIC still takes it all
                lane = wire_seconds(n, nbytes // 8, 64 << 20, nic * 1e9, root_bps=nic * 1e9) / eta
                lanes = max(lane, nbytes * 8 / (nic * 1e9 * eta))
                out.append(Projection(name, params, n, nic, a + wire, a + lanes))
    return out


def analyse(points: list[Point], held_out: set[tuple[int, float]]) -> Result:
    train = [p for p in points if (p.generators, p.rate_mbit) not in held_out]
    a, eta, k = fit(train)
    predictions = [Prediction(p.generators, p.rate_mbit, p.nbytes / 2**20, p.seconds, predict(p, a, eta, k),
                              (p.generators, p.rate_mbit) in held_out) for p in points]
    worst = max((abs(x.error) for x in predictions if x.held_out), default=0.0)
    return Result(points, a, eta, k, predictions, worst, project(eta, a))


def show(result: Result) -> None:
    print(f"\nfitted on {sum(not p.held_out for p in result.predictions)} configurations: "
          f"a = {result.a_seconds * 1e3:.1f} ms, eta = {result.eta:.3f}, "
          f"k = {result.k_seconds_per_byte * 1e9:.3f} s/GB per receiver")
    print(f"{'N':>3} {'Mbit/s':>7} {'MiB':>7} {'measured':>9} {'predicted':>9} {'error':>7}  set")
    for x in result.predictions:
        print(f"{x.generators:3d} {x.rate_mbit:7.0f} {x.mib:7.1f} {x.measured * 1e3:7.0f}ms {x.predicted * 1e3:7.0f}ms "
              f"{x.error:+7.1%}  {'held out' if x.held_out else 'fit'}")
    print(f"worst held-out error: {result.worst_held_out:.1%} (target: within 25%)")
    print("\nprojection (bf16; gloo's tree, 64 MiB buckets, every NIC at the rate given, eta as fitted):")
    print(f"{'model':>6} {'N':>4} {'NIC':>9} {'1 sender':>9} {'8 lanes':>8}")
    for x in result.projections:
        print(f"{x.model:>6} {x.generators:4d} {x.nic_gbit:5.0f} Gb/s {x.seconds:8.2f}s {x.lanes8_seconds:7.2f}s")


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
    parser.add_argument("--seconds", type=float, default=0.6, help="each version's size: this long at the rate")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--hold-out", default="4x*,*x1000",
                        help="configurations the fit never sees: NxRATE, * for any (default: 4x*,*x1000)")
    parser.add_argument("--points", help="refit the points of an earlier run's cost_model.json instead of measuring")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    if args.points:
        points = msgspec.json.decode(Path(args.points).read_bytes(), type=Result).points
    else:
        reason = netns.unavailable()
        if reason is not None:
            print(f"cannot build the emulated cluster here: {reason}")
            return 1
        generators = [int(x) for x in args.generators.split(",")]
        rates = [float(x) for x in args.rates.split(",")]
        points = collect(generators, rates, args.seconds, args.reps)
    held: set[tuple[int, float]] = set()
    for rule in args.hold_out.split(","):
        n, _, rate = rule.partition("x")
        held |= {(p.generators, p.rate_mbit) for p in points
                 if n in ("*", str(p.generators)) and rate in ("*", f"{p.rate_mbit:g}")}
    result = analyse(points, held)
    show(result)
    path = report.write_json(args.out, "cost_model", result)
    plot(result, Path(args.out), path)
    return 0 if result.worst_held_out <= 0.25 else 1


if __name__ == "__main__":
    raise SystemExit(main())
