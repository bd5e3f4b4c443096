"""A generator freezes mid-transfer; the flight recorder says who, where and when.

    python -m rl_examples.frozen_member [--fr-dir DIR]

One trainer pushes 64 MiB versions to three generator processes. While version 1 is on the
wire, generator gen2 is frozen (SIGSTOP). The trainer's deadline fires, gen2 is evicted, the
other two get version 1 anyway; every live process leaves a flight-recorder dump. Then the
analyzer (``weightsync fr analyze DIR``) names gen2, version 1 and the bucket, and a timeline
is drawn. The frozen process is killed at the end.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import weightsync as ws
from weightsync.fr import analyze, draw, load_dir, render


async def generator(address: str, member: str, last: int) -> None:
    """A generator process: follow every version until ``last`` (dumps go to $WEIGHTSYNC_FR_DIR)."""
    async with ws.Subscriber("policy", address=address, member_id=member, timeout=30) as sub:
        async for weights in sub.updates(timeout=120):
            if weights.version >= last:
                return


async def trainer(fr_dir: Path) -> int:
    recorder = ws.FlightRecorder(directory=fr_dir, label="publisher")
    env = dict(os.environ, WEIGHTSYNC_FR_DIR=str(fr_dir), TORCH_CPP_LOG_LEVEL="ERROR")
    async with ws.Publisher("policy", timeout=3.0, heartbeat_interval=0.25, bucket_bytes=1 << 20,
                            recorder=recorder) as pub:
        assert pub.address is not None
        gens = [subprocess.Popen([sys.executable, "-m", "rl_examples.frozen_member", "--generator", pub.address,
                                  f"gen{i}", "2"], env=env) for i in range(3)]
        try:
            await pub.wait_subscribers(3, timeout=60)
            body = torch.randn(16 << 20)  # 64 MiB, sent in 1 MiB buckets
            await (await pub.put({"body": body}, version=0)).delivered(timeout=60)
            print("[trainer] version 0 delivered to gen0, gen1, gen2")
            handle = await pub.put({"body": body + 1}, version=1)
            os.kill(gens[2].pid, signal.SIGSTOP)
            print("[trainer] version 1 on the wire; gen2 frozen (SIGSTOP)")
            t0 = time.monotonic()
            report = await handle.delivered(timeout=120)
            print(f"[trainer] version 1 delivered to {', '.join(report.members)} {time.monotonic() - t0:.1f} s later "
                  f"(deadline {pub.options.timeout:.0f} s); gen2 evicted")
            await (await pub.put({"body": body + 2}, version=2)).delivered(timeout=60)
            print("[trainer] version 2 delivered to", ", ".join(pub.members))
            for g in gens[:2]:
                g.wait(timeout=60)
        finally:
            for g in gens:
                if g.poll() is None:
                    g.kill()
                    g.wait(timeout=10)
    recorder.dump(reason="example finished")
    dumps = load_dir(fr_dir)
    analysis = analyze(dumps, names=[f"{d.label}-{d.pid}" for d in dumps])
    print(f"\n$ weightsync fr analyze {fr_dir}")
    print(render(analysis))
    png = draw(dumps, analysis, fr_dir / "timeline.png")
    print(f"\ntimeline: {png}")
    named = [(c.member, c.version) for c in analysis.culprits] == [("gen2", 1)]
    return 0 if named else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fr-dir", type=Path, default=None, help="where the dumps go (default: a new temp dir)")
    parser.add_argument("--generator", nargs=3, metavar=("ADDRESS", "MEMBER", "LAST"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.generator:
        import uvloop

        address, member, last = args.generator
        uvloop.run(generator(address, member, int(last)))
        return 0
    fr_dir = args.fr_dir or Path(tempfile.mkdtemp(prefix="weightsync-frozen-"))
    fr_dir.mkdir(parents=True, exist_ok=True)
    import uvloop

    return uvloop.run(trainer(fr_dir))


if __name__ == "__main__":
    raise SystemExit(main())
