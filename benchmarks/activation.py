"""How far apart the members of a channel expose a version: ``activation="each"`` against ``"all"``.

    python -m benchmarks.activation [--mib 64] [--versions 8] [--slow 5] [--out DIR]

One publisher and two subscribers on this host, one of them ``--slow`` times slower than the
wire (``weightsync.testing.Faults``, as a member on a busy host). Each mode puts the same
versions, one at a time, and reads the DeliveryReport: ``exposure_spread`` (seconds between the
first and the last member's word that the version is readable there, as it reached the
publisher) and ``seconds`` (until every member has it). The flight recorder gives the same spread
from the members' own ``publish`` entries (``time.time()`` on one host), printed beside it.
With ``"each"`` the fast member serves a version while the slow one still serves the one before;
with ``"all"`` both switch within a control round trip, and the fast one waits for the slow one.

Prints a table, writes ``activation.json`` and ``activation.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

import msgspec
import torch

import weightsync as ws
from benchmarks import report
from weightsync.testing import Faults, inject

MODES = ("each", "all")


class ModeResult(msgspec.Struct):
    activation: str
    spread_ms: list[float]  # DeliveryReport.exposure_spread, per version
    recorded_spread_ms: list[float]  # the members' own publish entries, last minus first, per version
    delivered_ms: list[float]  # DeliveryReport.seconds, per version


async def run_mode(activation: str, mib: int, versions: int, slow: float) -> ModeResult:
    rec = ws.FlightRecorder(capacity=50000)
    weights = {"w": torch.zeros(mib << 18)}  # mib MiB of float32
    spread, recorded, delivered = [], [], []
    async with ws.Publisher("activation-bench", activation=activation, encoding="full", recorder=rec,
                            timeout=30) as pub:
        subs = [ws.Subscriber("activation-bench", address=pub.address, member_id=name, recorder=rec, timeout=30)
                for name in ("fast", "slow")]
        inject(subs[1], Faults(slow=slow))
        await asyncio.gather(*(s.start() for s in subs))
        try:
            await pub.wait_subscribers(2, timeout=60)
            for version in range(versions + 1):  # the first one warms the slots and is not counted
                weights["w"].fill_(float(version))
                report_ = await (await pub.put(weights, version=version)).delivered(timeout=120)
                if version == 0:
                    continue
                spread.append(report_.exposure_spread * 1e3)
                delivered.append(report_.seconds * 1e3)
                times = [e.t_ended for e in rec.snapshot()
                         if e.op == "publish" and e.version == version and e.member in ("fast", "slow")]
                recorded.append((max(times) - min(times)) * 1e3 if len(times) == 2 else float("nan"))
        finally:
            await asyncio.gather(*(s.aclose() for s in subs))
    return ModeResult(activation, spread, recorded, delivered)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.activation", description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--versions", type=int, default=8)
    parser.add_argument("--slow", type=float, default=5.0)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    results = [asyncio.run(run_mode(mode, args.mib, args.versions, args.slow)) for mode in MODES]
    med = statistics.median
    print(f"\n{args.mib} MiB, 2 members on this host, one {args.slow:g}x slower; medians over {args.versions} versions")
    print(f"{'activation':>10} | {'exposure spread (report)':>24} | {'(members own records)':>22} | {'delivered':>10}")
    for r in results:
        print(f"{r.activation:>10} | {med(r.spread_ms):21.1f} ms | {med(r.recorded_spread_ms):19.1f} ms | "
              f"{med(r.delivered_ms):7.1f} ms")
    each, all_ = results
    print(f"spread all / each: {med(all_.recorded_spread_ms) / med(each.recorded_spread_ms):.3f}x (members' records); "
          f"delivered all / each: {med(all_.delivered_ms) / med(each.delivered_ms):.2f}x")
    path = report.write_json(args.out, "activation", results)
    plt = report.pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for r in results:
        left.plot(range(1, len(r.recorded_spread_ms) + 1), r.recorded_spread_ms, marker="o", label=r.activation)
        right.plot(range(1, len(r.delivered_ms) + 1), r.delivered_ms, marker="o", label=r.activation)
    left.set(xlabel="version", ylabel="ms", yscale="log", title="how far apart the two members exposed it")
    right.set(xlabel="version", ylabel="ms", title="until both have it")
    left.legend()
    right.legend()
    report.save(fig, args.out, "activation", path)


if __name__ == "__main__":
    main()
