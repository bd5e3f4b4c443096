"""GPU: the stall of a stream-ordered snapshot against a plain device copy of the same bytes.

    python -m benchmarks.gpu_snapshot [--gb 14] [--reps 3] [--out DIR]
    python -m benchmarks.gpu_snapshot --plot-from DIR/gpu_snapshot.json   # the figure, where matplotlib is

A one-rank NCCL channel (the only NCCL shape a single-GPU machine allows) puts a bf16 state
dict of ``--gb`` GB living on the GPU. ``put`` enqueues the snapshot on a side stream and
returns without synchronising the host; the device copy of the same bytes, synchronised, is the
physical reference. Prints both and their ratio; writes JSON, and a figure when matplotlib is
installed. Exits 0 without CUDA (nothing to measure), so scripts/gpu_check.sh can run it anywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import msgspec
import torch

import weightsync as ws
from benchmarks.report import pyplot, replot, save


class GpuResult(msgspec.Struct):
    device: str
    gb: float
    backend: str
    put_stall_ms: list[float]
    snapshot_done_ms: list[float]
    device_copy_ms: list[float]
    stall_vs_device_copy: float
    device_copy_gbps: float
    pinned_h2d_gbps: float
    pageable_h2d_gbps: float
    torch: str
    when: str


def make_state_dict(gb: float) -> dict[str, torch.Tensor]:
    per = 256 << 20  # 512 MiB tensors in bf16
    n = max(1, int(gb * 1e9 // (per * 2)))
    return {f"layers.{i}.weight": torch.empty(per, dtype=torch.bfloat16, device="cuda").normal_() for i in range(n)}


def h2d_gbps(pin: bool, mib: int = 1024) -> float:
    """Host-to-device bandwidth, the ceiling for a gloo channel carrying CUDA tensors."""
    host = torch.empty(mib << 20, dtype=torch.uint8, pin_memory=pin)
    dev = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=pin)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return host.numel() / best / 1e9


async def run(gb: float, reps: int) -> GpuResult:
    sd = make_state_dict(gb)
    size = sum(t.numel() * t.element_size() for t in sd.values())
    flat = torch.empty(size, dtype=torch.uint8, device="cuda")
    copies = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        offset = 0
        for t in sd.values():
            n = t.numel() * t.element_size()
            flat[offset : offset + n].copy_(t.view(-1).view(torch.uint8))
            offset += n
        torch.cuda.synchronize()
        copies.append((time.perf_counter() - t0) * 1e3)
    del flat
    stalls, done = [], []
    backend = "nccl" if torch.distributed.is_available() and torch.distributed.is_nccl_available() else "gloo"
    async with ws.Publisher("gpu-bench", backend=backend, device="cuda", timeout=120, encoding="full") as pub:
        for version in range(reps + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            handle = await pub.put(sd, version=version)
            stalls.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()  # the snapshot copies are done once the device is idle
            done.append((time.perf_counter() - t0) * 1e3)
            await handle.delivered(timeout=600)
    stalls, done, copies = stalls[1:], done[1:], copies[1:]  # the first of each warms up
    pinned, pageable = h2d_gbps(pin=True), h2d_gbps(pin=False)
    return GpuResult(device=torch.cuda.get_device_name(), gb=size / 1e9, backend=backend, put_stall_ms=stalls,
                     snapshot_done_ms=done, device_copy_ms=copies,
                     stall_vs_device_copy=statistics.median(stalls) / statistics.median(copies),
                     device_copy_gbps=size / (statistics.median(copies) / 1e3) / 1e9, pinned_h2d_gbps=pinned,
                     pageable_h2d_gbps=pageable, torch=str(torch.__version__),
                     when=time.strftime("%Y-%m-%d %H:%M:%S"))


def plot(result: GpuResult, out: str | Path, json_path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3.2))
    bars = [("put() returns", statistics.median(result.put_stall_ms)),
            ("snapshot complete", statistics.median(result.snapshot_done_ms)),
            ("device copy, synced", statistics.median(result.device_copy_ms))]
    ax.barh([b[0] for b in bars], [b[1] for b in bars], color=["#2CA02C", "#4C72B0", "#999999"])
    for y, (_name, ms) in enumerate(bars):
        ax.text(ms, y, f" {ms:.2f} ms", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms (median)")
    ax.set_title(f"{result.gb:.1f} GB bf16 on the GPU ({result.device}, {result.backend})", fontsize=10)
    ax.set_xlim(0, max(b[1] for b in bars) * 1.3)
    save(fig, out, "gpu_snapshot", json_path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=14.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--plot-from", default=None, help="draw the figure of an earlier run's JSON")
    args = parser.parse_args(argv)
    if args.plot_from:
        return replot(args.plot_from, args.out, GpuResult, plot)
    if not torch.cuda.is_available():
        print("gpu_snapshot: no CUDA device here; nothing to measure")
        return 0
    result = asyncio.run(run(args.gb, args.reps))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_snapshot.json").write_bytes(msgspec.json.format(msgspec.json.encode(result)))
    print(f"{result.device}: {result.gb:.1f} GB bf16 on {result.backend}")
    print(f"  put() returned after   {statistics.median(result.put_stall_ms):8.2f} ms (median; host not synchronised)")
    print(f"  snapshot complete after {statistics.median(result.snapshot_done_ms):8.2f} ms")
    print(f"  device copy, synced     {statistics.median(result.device_copy_ms):8.2f} ms "
          f"({result.device_copy_gbps:.0f} GB/s)")
    print(f"  stall / device copy     {result.stall_vs_device_copy:8.4f}")
    print(f"  host->device: pinned {result.pinned_h2d_gbps:.1f} GB/s, pageable {result.pageable_h2d_gbps:.1f} GB/s")
    plot(result, out, out / "gpu_snapshot.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
