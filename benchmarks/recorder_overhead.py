"""What the flight recorder costs: 256 MiB pushes with it on and off, side by side in one run.

    python -m benchmarks.recorder_overhead [--mib 256] [--reps 6] [--out benchmarks/results]

Two channels run in one process pair at a time: the publisher here, the subscriber in a
child process, the recorder on (2,000 entries) for one and off (capacity 0) for the other,
alternating so drift hits both. Prints the median push time of each and their ratio, writes
JSON and a PNG.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import torch

import weightsync as ws


class Result(msgspec.Struct):
    mib: int
    reps: int
    on_seconds: list[float]
    off_seconds: list[float]
    median_on: float
    median_off: float
    overhead: float  # median_on / median_off - 1 (side by side; noisy on a shared 2-core machine)
    entries_per_push: float  # publisher side; subscribers record about as many each
    seconds_per_entry: float  # record + start + complete, measured directly
    direct_overhead: float  # 2 * entries_per_push * seconds_per_entry / median_off
    torch: str
    when: str


async def subscriber(address: str, channel: str, capacity: int, last: int) -> None:
    rec = ws.FlightRecorder(capacity=capacity)
    async with ws.Subscriber(channel, address=address, timeout=60, recorder=rec) as sub:
        async for w in sub.updates(timeout=300):
            if w.version >= last:
                return


async def run(mib: int, reps: int) -> Result:
    body = torch.randn(mib << 18)  # mib MiB of float32
    times: dict[str, list[float]] = {"on": [], "off": []}
    entries = 0
    recs = {"on": ws.FlightRecorder(capacity=2000), "off": ws.FlightRecorder(capacity=0)}
    pubs = {m: ws.Publisher(f"fr-{m}", timeout=60, recorder=recs[m], encoding="full") for m in recs}
    procs = []
    for mode, pub in pubs.items():
        await pub.start()
        procs.append(subprocess.Popen([sys.executable, "-m", "benchmarks.recorder_overhead", "--subscriber",
                                       pub.address or "", pub.name, str(recs[mode].capacity), str(reps)]))
    try:
        for pub in pubs.values():
            await pub.wait_subscribers(1, timeout=120)
        for rep in range(reps + 1):  # rep 0 warms up both paths
            for mode in (("on", "off") if rep % 2 else ("off", "on")):
                before = len(recs[mode].snapshot())
                t0 = time.perf_counter()
                await (await pubs[mode].put({"body": body}, version=rep)).delivered(timeout=300)
                elapsed = time.perf_counter() - t0
                if rep:
                    times[mode].append(elapsed)
                    if mode == "on":
                        entries += len(recs[mode].snapshot()) - before
                print(f"  rep {rep} recorder {mode:>3}: {elapsed * 1e3:7.1f} ms", flush=True)
    finally:
        for pub in pubs.values():
            await pub.aclose()
        for p in procs:
            p.wait(timeout=120)
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    per_entry = cost_per_entry()
    per_push = entries / reps
    return Result(mib=mib, reps=reps, on_seconds=times["on"], off_seconds=times["off"], median_on=on,
                  median_off=off, overhead=on / off - 1, entries_per_push=per_push, seconds_per_entry=per_entry,
                  direct_overhead=2 * per_push * per_entry / off, torch=str(torch.__version__),
                  when=time.strftime("%Y-%m-%d %H:%M:%S"))


def cost_per_entry(n: int = 200_000) -> float:
    """Seconds for one recorded operation (record, start, complete) into a full 2,000-entry ring."""
    rec = ws.FlightRecorder(capacity=2000)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for i in range(n):
            rec.record("bucket_send", channel="c", member="publisher", generation=1, version=i, bucket=i,
                       nbytes=1 << 20).start().complete()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def plot(result: Result, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.boxplot([[s * 1e3 for s in result.off_seconds], [s * 1e3 for s in result.on_seconds]])
    ax.set_xticks([1, 2], ["recorder off", "recorder on (2,000 entries)"])
    ax.set_ylabel(f"{result.mib} MiB push to 1 subscriber (ms)")
    ax.set_title(f"recorder: {result.overhead * 100:+.1f}% side by side (noise), "
                 f"{result.direct_overhead * 100:.3f}% measured directly", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--subscriber", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    import uvloop

    if args.subscriber:
        address, channel, capacity, last = args.subscriber
        uvloop.run(subscriber(address, channel, int(capacity), int(last)))
        return 0
    if args.mib < 1 or args.reps < 1:
        parser.error("--mib and --reps must be >= 1")
    print(f"flight recorder overhead: {args.reps} pushes of {args.mib} MiB each way, alternating")
    result = uvloop.run(run(args.mib, args.reps))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "recorder_overhead.json").write_bytes(msgspec.json.format(msgspec.json.encode(result)))
    plot(result, out / "recorder_overhead.png")
    print(f"side by side, median push: recorder off {result.median_off * 1e3:.1f} ms, on "
          f"{result.median_on * 1e3:.1f} ms ({result.overhead * 100:+.1f}%, within this machine's noise)")
    print(f"direct: {result.seconds_per_entry * 1e6:.2f} us per recorded operation x "
          f"{result.entries_per_push:.0f} per push on each side = {result.direct_overhead * 100:.4f}% of a "
          f"{result.mib} MiB push (target <= 2%)")
    print(f"wrote {out / 'recorder_overhead.json'} and {out / 'recorder_overhead.png'}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    raise SystemExit(main())
