"""How fast survivors get new versions after a member is killed or frozen, idle and on busy cores.

    python -m benchmarks.recovery [--trials 3] [--mib 32] [--out benchmarks/results]

One publisher (``timeout=5``, defaults otherwise) and 4 follower processes; versions of ``mib``
MiB are put back to back. A member is then SIGKILLed or SIGSTOPped right after a put returns
(its transfer is on the wire). Measured: from the signal to the moment a version put *after*
it is delivered to all three survivors, and the trainer's put stall meanwhile (the longest
``put`` from the signal until then, beside the median stall of the warm-up puts before it: a
put must never wait for the recovery). Each case runs with the machine idle and with one
busy-loop process per core beside it, side by side in one run. Prints a table, writes
``recovery.json`` and ``recovery.png``.

The targets (issue 11): after ``kill -9`` of one of 4, survivors have a new version within 3 s
on busy cores; after SIGSTOP, within the bucket deadline plus one heartbeat bound.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import weightsync as ws
from benchmarks import report
from benchmarks.procs import Workers

HOG = "while True: pass"


async def trial(sig: int, mib: float, tmp: Path) -> tuple[float, float, float]:
    """Seconds from ``sig`` to the first version put after it reaching every survivor; the longest
    put stall meanwhile; the median stall of the warm puts before the signal."""
    workers = Workers(tmp)
    rec = ws.FlightRecorder(capacity=0)
    async with ws.Publisher("recovery", timeout=5.0, recorder=rec) as pub:
        for i in range(4):
            workers.spawn(role="follower", channel="recovery", address=pub.address, member=f"gen{i}", timeout=5.0)
        try:
            await pub.wait_subscribers(4, timeout=120)
            body = torch.zeros(int(mib * (1 << 18)))
            warm = []
            for v in range(3):  # warm: every member has formed its pairs
                t = time.perf_counter()
                handle = await pub.put({"w": body + v}, version=v)
                warm.append(time.perf_counter() - t)
                await handle.delivered(timeout=60)
            victim = workers.procs[1][0]
            await pub.put({"w": body + 3}, version=3)  # its transfer is on the wire...
            os.kill(victim.pid, sig)  # ...when the member dies or freezes
            t0 = time.monotonic()
            survivors = {"gen0", "gen2", "gen3"}
            version, stall = 4, 0.0
            while True:
                t = time.perf_counter()
                handle = await pub.put({"w": body + version}, version=version)
                stall = max(stall, time.perf_counter() - t)
                report = await handle.delivered(timeout=120)
                if survivors <= set(report.members):
                    return time.monotonic() - t0, stall, statistics.median(warm)
                version += 1
                if time.monotonic() - t0 > 120:
                    raise RuntimeError("survivors got no new version within 120 s")
        finally:
            if sig == signal.SIGSTOP:
                os.kill(workers.procs[1][0].pid, signal.SIGKILL)
            await pub.aclose()
            workers.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.recovery", description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--mib", type=float, default=32)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    import uvloop

    rows: dict[str, list[float]] = {}
    stalls: dict[str, list[float]] = {}
    warm: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="ws-recovery-") as tmp:
        for load in ("idle", "busy"):
            hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(os.cpu_count() or 1)] \
                if load == "busy" else []
            try:
                for name, sig in (("kill -9", signal.SIGKILL), ("SIGSTOP", signal.SIGSTOP)):
                    key = f"{name}, {load}"
                    results = [uvloop.run(trial(sig, args.mib, Path(tmp))) for _ in range(args.trials)]
                    rows[key] = [r[0] for r in results]
                    stalls[key] = [r[1] for r in results]
                    warm[key] = [r[2] for r in results]
                    print(f"{key:<20} " + "  ".join(f"{s:6.2f}" for s in rows[key]) + " s; put stall at most "
                          + "  ".join(f"{s * 1e3:.0f}" for s in stalls[key]) + " ms", flush=True)
            finally:
                for hog in hogs:
                    hog.kill()
                    hog.wait()
    print(f"\n{'case':<20}{'median s':>10}{'max s':>8}{'max put stall ms':>18}{'warm put ms':>13}{'ratio':>7}")
    for key, values in rows.items():
        base = statistics.median(warm[key])
        print(f"{key:<20}{statistics.median(values):>10.2f}{max(values):>8.2f}{max(stalls[key]) * 1e3:>18.0f}"
              f"{base * 1e3:>13.0f}{max(stalls[key]) / max(base, 1e-9):>7.1f}")
    json_path = report.write_json(args.out, "recovery", {"mib": args.mib, "trials": args.trials, "seconds": rows,
                                                         "max_put_stall_seconds": stalls,
                                                         "warm_put_stall_seconds": warm})
    plt = report.pyplot()
    if plt is None:
        return 0
    fig, ax = plt.subplots(figsize=(7, 3))
    try:
        ax.boxplot(list(rows.values()), orientation="horizontal")
    except TypeError:  # matplotlib before 3.10
        ax.boxplot(list(rows.values()), vert=False)
    ax.set_yticks(range(1, len(rows) + 1), list(rows))
    ax.axvline(3.0, color="#c44", linestyle="--", label="3 s target (kill -9)")
    ax.set_xlabel("seconds until survivors have a version put after the signal")
    ax.legend()
    report.save(fig, args.out, "recovery", json_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
