"""Pushing fp32 master weights as the engine's bf16: ``put(dtype=)`` against the alternatives, in one run.

    python -m benchmarks.cast [--mib 512] [--subscribers 2] [--reps 5] [--transport auto|group]

A trainer holds fp32 parameters (a master copy, FSDP2's sharded storage); the engine serves bf16.
Four ways to push one version to N generator processes on this host:

- ``fp32``          ``put(sd)``: twice the bytes, every element in fp32;
- ``caller_bf16``   ``put({k: v.to(torch.bfloat16)})``: the caller casts into a temporary, then the
                    snapshot copies it again (two passes, one whole-model temporary);
- ``dtype``         ``put(sd, dtype=torch.bfloat16)``: the snapshot's copy casts (one pass);
- ``dtype_nocopy``  ``put(sd, dtype=torch.bfloat16, copy=False)``: no snapshot; each bucket is cast
                    as it is packed for sending, then ``released()``.

Per mode: the trainer's stall (until ``put`` returned; for ``dtype_nocopy`` until ``released()``),
the time until every generator has the version, and the version's bytes (``report.nbytes``). That
the members hold exactly ``v.to(torch.bfloat16)`` is the tests' business (tests/test_inprocess.py,
tests/test_sharding.py). JSON and a plot under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import msgspec
import torch

import weightsync as ws
from benchmarks.procs import Workers
from benchmarks.report import pyplot, save, write_json
from weightsync.bench.model import make_state_dict, nbytes

MODES = ("fp32", "caller_bf16", "dtype", "dtype_nocopy")


class Row(msgspec.Struct):
    mode: str
    fp32_mib: float
    subscribers: int
    stall_ms: float
    to_all_ms: float
    wire_mib: float
    stall_vs_caller: float = 0.0
    to_all_vs_fp32: float = 0.0


class Report(msgspec.Struct):
    when: str
    torch: str
    cores: int
    reps: int
    transport: str
    rows: list[Row]


async def run(mib: int, n: int, reps: int, transport: str, tmp: Path) -> list[Row]:
    master = {k: v.float() for k, v in make_state_dict(mib, seed=0).items()}  # fp32 master weights
    rows = []
    workers = Workers(tmp)
    last_version = len(MODES) * (reps + 1) - 1
    async with ws.Publisher("cast", timeout=120, bucket_bytes=64 << 20, encoding="full") as pub:
        for i in range(n):
            workers.spawn(role="subscriber", channel="cast", address=pub.address, member=f"gen{i}",
                          last_version=last_version, transport=transport)
        try:
            await pub.wait_subscribers(n, timeout=300)
            version = 0
            for mode in MODES:
                stalls, to_all, wire = [], [], 0
                for rep in range(reps + 1):
                    with torch.no_grad():  # a step: every weight moves a little
                        for t in master.values():
                            t.add_(1e-3)
                    began, t0 = time.time(), time.perf_counter()
                    if mode == "fp32":
                        handle = await pub.put(master, version=version)
                    elif mode == "caller_bf16":
                        handle = await pub.put({k: v.to(torch.bfloat16) for k, v in master.items()}, version=version)
                    else:
                        handle = await pub.put(master, version=version, dtype=torch.bfloat16,
                                               copy=mode == "dtype")
                    if mode == "dtype_nocopy":
                        await handle.released(timeout=600)
                    stall = time.perf_counter() - t0
                    report = await handle.delivered(timeout=600)
                    if len(report.members) != n:
                        raise RuntimeError(f"version {version} reached {list(report.members)} only")
                    version += 1
                    wire = report.nbytes
                    if rep:
                        stalls.append(stall)
                        to_all.append(report.delivered_at - began)  # stamped by the sender as it decided
                rows.append(Row(mode=mode, fp32_mib=nbytes(master) / 2**20, subscribers=n,
                                stall_ms=statistics.median(stalls) * 1e3, to_all_ms=statistics.median(to_all) * 1e3,
                                wire_mib=wire / 2**20))
                print(f"  {mode:<13} stall {rows[-1].stall_ms:8.1f} ms   to all {rows[-1].to_all_ms:8.1f} ms   "
                      f"wire {rows[-1].wire_mib:7.1f} MiB", flush=True)
            workers.results(timeout=600)
        finally:
            workers.kill()
    by = {r.mode: r for r in rows}
    for r in rows:
        r.stall_vs_caller = r.stall_ms / by["caller_bf16"].stall_ms
        r.to_all_vs_fp32 = r.to_all_ms / by["fp32"].to_all_ms
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cast", description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="the bf16 model's size; its fp32 master is twice")
    parser.add_argument("--subscribers", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--transport", default="auto", choices=("auto", "group"))
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    if args.mib < 1 or args.subscribers < 1 or args.reps < 1:
        parser.error("--mib, --subscribers and --reps must be >= 1")
    print(f"cast: a {args.mib} MiB bf16 model from fp32 master weights to {args.subscribers} generators "
          f"({args.transport}), {args.reps} reps", flush=True)
    with tempfile.TemporaryDirectory(prefix="ws-cast-") as tmp:
        rows = asyncio.run(run(args.mib, args.subscribers, args.reps, args.transport, Path(tmp)))
    report = Report(when=time.strftime("%Y-%m-%d %H:%M:%S"), torch=str(torch.__version__), cores=os.cpu_count() or 0,
                    reps=args.reps, transport=args.transport, rows=rows)
    print(f"\n{'mode':<13} {'stall ms':>9} {'to-all ms':>10} {'wire MiB':>9} {'stall/caller':>12} {'all/fp32':>9}")
    for r in rows:
        print(f"{r.mode:<13} {r.stall_ms:9.1f} {r.to_all_ms:10.1f} {r.wire_mib:9.1f} {r.stall_vs_caller:12.3f} "
              f"{r.to_all_vs_fp32:9.3f}")
    json_path = write_json(args.out, "cast", report)
    plt = pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
        panels = ((axes[0], "stall_ms", "trainer stall (ms)"), (axes[1], "to_all_ms", "to every generator (ms)"))
        for ax, field, label in panels:
            ax.bar([r.mode for r in rows], [getattr(r, field) for r in rows], color=["#888", "#c84", "#48c", "#4a4"])
            ax.set_ylabel(label)
            ax.tick_params(axis="x", labelrotation=20)
        fig.suptitle(f"fp32 master -> bf16 engine: {rows[0].fp32_mib:.0f} MiB fp32 to {args.subscribers} generators "
                     f"({args.transport}, {report.cores} cores)")
        save(fig, args.out, "cast", json_path)
    else:
        print(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
