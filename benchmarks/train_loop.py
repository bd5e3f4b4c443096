"""Steps per second of a training loop that pushes its weights after every step.

    python -m benchmarks.train_loop [--mib 256] [--subscribers 2] [--steps 8] [--step-ms 300]

Each step is a synthetic forward+backward of ``--step-ms`` (slept: it stands for accelerator
time) followed by an optimizer step that changes the weights, then a push:

- ``packed``    blocking packed broadcast (vLLM style) after the optimizer step;
- ``ws_copy``   ``await pub.put(sd)`` after the optimizer step (a snapshot, then on with training);
- ``ws_nocopy`` ``put(copy=False)`` right after the optimizer step, the next forward+backward
                overlapping the transfer, and ``await handle.released()`` before the next
                optimizer step.

Prints steps/s per method and the ratio to ``packed``; writes JSON and a PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import msgspec
import torch

import weightsync as ws
from benchmarks.baseline import BlockingBroadcast
from benchmarks.procs import Workers
from weightsync.bench.model import make_state_dict


class LoopResult(msgspec.Struct):
    method: str
    steps_per_s: float
    vs_packed: float = 0.0


class Report(msgspec.Struct):
    when: str
    torch: str
    mib: int
    subscribers: int
    steps: int
    step_ms: float
    compute_only_steps_per_s: float
    results: list[LoopResult]


def optimizer_step(sd: dict[str, torch.Tensor]) -> None:
    for t in sd.values():
        if t.dtype == torch.bfloat16:
            t.add_(1e-3)


async def packed_loop(mib: int, n: int, steps: int, step_s: float, tmp: Path, packed_bytes: int) -> float:
    sd = make_state_dict(mib)
    sender = BlockingBroadcast(n, [("packed", mib, steps + 1)], packed_bytes, tmp)
    try:
        await sender.connect()
        t0 = 0.0
        for step in range(steps + 1):
            if step == 1:
                t0 = time.perf_counter()  # step 0 warms up
            await asyncio.sleep(step_s)
            optimizer_step(sd)
            sender.push(sd, "packed")
        elapsed = time.perf_counter() - t0
        await sender.wait_unpacked("packed", mib, steps)
    finally:
        sender.close()
    return steps / elapsed


async def ws_loop(sd: dict[str, torch.Tensor], n: int, steps: int, step_s: float, tmp: Path, copy: bool,
                  name: str) -> float:
    workers = Workers(tmp)
    async with ws.Publisher(name, timeout=120) as pub:
        for i in range(n):
            workers.spawn(role="subscriber", channel=name, address=pub.address, member=f"gen{i}",
                          last_version=steps)
        try:
            await pub.wait_subscribers(n, timeout=300)
            handle = None
            t0 = 0.0
            for step in range(steps + 1):
                if step == 1:
                    t0 = time.perf_counter()
                if copy:
                    await asyncio.sleep(step_s)
                    optimizer_step(sd)
                    handle = await pub.put(sd, version=step)
                else:
                    if handle is not None:
                        await asyncio.sleep(step_s)  # forward + backward overlap the transfer
                        await handle.released(timeout=600)  # the optimizer may change the weights now
                    else:
                        await asyncio.sleep(step_s)
                    optimizer_step(sd)
                    handle = await pub.put(sd, version=step, copy=False)
            elapsed = time.perf_counter() - t0
            assert handle is not None
            await handle.delivered(timeout=600)
            workers.results(timeout=600)
        finally:
            workers.kill()
    return steps / elapsed


async def run(mib: int, n: int, steps: int, step_ms: float, packed_bytes: int) -> Report:
    sd = make_state_dict(mib)
    step_s = step_ms / 1e3
    results = []
    with tempfile.TemporaryDirectory(prefix="ws-loop-") as tmp:
        for method in ("packed", "ws_copy", "ws_nocopy"):
            print(f"  {method} ...", flush=True)
            if method == "packed":
                rate = await packed_loop(mib, n, steps, step_s, Path(tmp), packed_bytes)
            else:
                rate = await ws_loop(sd, n, steps, step_s, Path(tmp), copy=method == "ws_copy", name=method)
            results.append(LoopResult(method, rate))
            print(f"  {method:<10} {rate:6.2f} steps/s", flush=True)
    base = results[0].steps_per_s
    for r in results:
        r.vs_packed = r.steps_per_s / base
    return Report(when=time.strftime("%Y-%m-%d %H:%M:%S"), torch=str(torch.__version__), mib=mib, subscribers=n,
                  steps=steps, step_ms=step_ms, compute_only_steps_per_s=1 / step_s, results=results)


def plot(report: Report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = [r.method for r in report.results]
    ax.bar(names, [r.steps_per_s for r in report.results], color=["#999999", "#4C72B0", "#55A868"])
    ax.axhline(report.compute_only_steps_per_s, color="black", linestyle="--", label="compute only (no push)")
    ax.set_ylabel("training steps per second")
    ax.set_title(f"push every step: {report.mib} MiB to {report.subscribers} generators, {report.step_ms:.0f} ms steps",
                 fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--subscribers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--step-ms", type=float, default=300.0)
    parser.add_argument("--packed-mib", type=int, default=1024)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    if min(args.mib, args.subscribers, args.steps) < 1 or args.step_ms <= 0:
        parser.error("--mib, --subscribers, --steps must be >= 1 and --step-ms > 0")
    print(f"training loop, push every step: {args.mib} MiB to {args.subscribers} generators, "
          f"{args.steps} steps of {args.step_ms:.0f} ms", flush=True)
    import uvloop

    report = uvloop.run(run(args.mib, args.subscribers, args.steps, args.step_ms, args.packed_mib << 20))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_loop.json").write_bytes(msgspec.json.format(msgspec.json.encode(report)))
    plot(report, out / "train_loop.png")
    print(f"\n{'method':<10} {'steps/s':>8} {'vs packed':>9}   (compute alone: {report.compute_only_steps_per_s:.2f})")
    for r in report.results:
        print(f"{r.method:<10} {r.steps_per_s:8.2f} {r.vs_packed:9.2f}x")
    print(f"\nwrote {out / 'train_loop.json'} and {out / 'train_loop.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
