"""GPU: the delta codec on the device against the same codec on the host, one version side by side.

    python -m benchmarks.gpu_delta [--mib 1024] [--changed 0.03] [--reps 3] [--out DIR]
    python -m benchmarks.gpu_delta --plot-from DIR/gpu_delta.json   # the figure, where matplotlib is

A bf16 version of ``--mib`` MiB in 64 MiB buckets (the default bucket size), ``--changed`` of its
elements differing from the base in their lowest mantissa bit (what an RL step leaves in bf16).
Each bucket is encoded and decoded by :mod:`weightsync.encodings.codec` twice: with the buckets on
the GPU (what a CUDA publisher's NCCL buckets take: torch's ops on the device, zstd on the host
for the few bytes that changed) and with the same bytes in host memory, on this machine's CPU
threads. Prints both, their ratio and the wire's share of the version; writes JSON, and a figure
when matplotlib is installed. Exits 0 without CUDA (nothing to measure).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import msgspec
import torch

from benchmarks.report import cpu_name, pyplot, replot, save, write_json
from weightsync.encodings import codec
from weightsync.format import layout

BUCKET = 64 << 20


class Side(msgspec.Struct):
    encode_ms: list[float]
    decode_ms: list[float]
    encode_gbps: float  # version bytes per second
    wire_bytes: int


class GpuDelta(msgspec.Struct):
    device: str
    cpu: str
    cpu_threads: int
    mib: int
    changed: float
    cuda: Side
    host: Side
    encode_host_over_cuda: float  # > 1: the device is faster
    decode_host_over_cuda: float
    torch: str
    when: str


def version_pair(mib: int, changed: float, device: str) -> tuple[layout.Manifest, torch.Tensor, torch.Tensor]:
    """A manifest of bf16 tensors of 64 MiB or less, a base and the version after one step."""
    gen = torch.Generator(device=device).manual_seed(0)
    per = 32 << 20  # elements: 64 MiB in bf16
    sizes = [per] * (mib // 64) + ([(mib % 64) << 19] if mib % 64 else [])
    items = [(f"layers.{i}.weight", torch.empty(n, dtype=torch.bfloat16, device="meta")) for i, n in enumerate(sizes)]
    manifest = layout.build_manifest(items)
    base = torch.empty(manifest.total_bytes, dtype=torch.uint8, device=device)
    base.view(torch.bfloat16).normal_(generator=gen)
    cur = base.clone()
    words = cur.view(torch.int16)
    flips = torch.rand(words.numel(), device=device, generator=gen) < changed
    words[flips] ^= 1
    return manifest, base, cur


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def side(manifest: layout.Manifest, base: torch.Tensor, cur: torch.Tensor, reps: int) -> Side:
    device = base.device.type
    ranges = layout.bucket_ranges(manifest.total_bytes, BUCKET)
    segs = [layout.segments(manifest, lo, hi) for lo, hi in ranges]
    out = torch.empty_like(cur)
    enc_ms, dec_ms, wire = [], [], 0
    for rep in range(reps + 1):  # the first warms up (allocator, zstd contexts, kernels)
        _sync(device)
        t0 = time.perf_counter()
        made = [codec.encode(cur[lo:hi], base[lo:hi], s, auto=True).wire for (lo, hi), s in zip(ranges, segs,
                                                                                                 strict=True)]
        _sync(device)
        t1 = time.perf_counter()
        for (lo, hi), s, w in zip(ranges, segs, made, strict=True):
            codec.decode(w, base[lo:hi], out[lo:hi], s)
        _sync(device)
        t2 = time.perf_counter()
        if rep:
            enc_ms.append((t1 - t0) * 1e3)
            dec_ms.append((t2 - t1) * 1e3)
        wire = sum(w.numel() for w in made)
    if not torch.equal(out, cur):
        raise SystemExit(f"gpu_delta: the {device} round trip did not rebuild the version")
    return Side(encode_ms=enc_ms, decode_ms=dec_ms, wire_bytes=wire,
                encode_gbps=manifest.total_bytes / (statistics.median(enc_ms) / 1e3) / 1e9)


def plot(result: GpuDelta, out: str | Path, json_path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = ["encode", "decode"]
    xs = range(len(labels))
    for k, (name, s) in enumerate((("GPU (" + result.device + ")", result.cuda), ("host (" + result.cpu + ")",
                                                                                   result.host))):
        vals = [statistics.median(s.encode_ms), statistics.median(s.decode_ms)]
        ax.bar([x + 0.4 * k for x in xs], vals, width=0.4, label=name)
    ax.set_xticks([x + 0.2 for x in xs], labels)
    ax.set_ylabel("ms (median)")
    ax.set_title(f"delta of {result.mib} MiB bf16, {result.changed:.0%} of elements changed")
    ax.legend(fontsize=7)
    save(fig, out, "gpu_delta", json_path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--changed", type=float, default=0.03)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--plot-from", default=None, help="draw the figure of an earlier run's JSON")
    args = parser.parse_args(argv)
    if args.plot_from:
        return replot(args.plot_from, args.out, GpuDelta, plot)
    if not 0 < args.changed < 1 or args.mib < 1:
        parser.error("--changed must be in (0, 1) and --mib at least 1")
    if not torch.cuda.is_available():
        print("gpu_delta: no CUDA device here; nothing to measure")
        return 0
    manifest, base, cur = version_pair(args.mib, args.changed, "cuda")
    on_gpu = side(manifest, base, cur, args.reps)
    on_host = side(manifest, base.cpu(), cur.cpu(), args.reps)
    result = GpuDelta(device=torch.cuda.get_device_name(), cpu=cpu_name(), cpu_threads=torch.get_num_threads(),
                      mib=args.mib, changed=args.changed, cuda=on_gpu, host=on_host,
                      encode_host_over_cuda=statistics.median(on_host.encode_ms) / statistics.median(on_gpu.encode_ms),
                      decode_host_over_cuda=statistics.median(on_host.decode_ms) / statistics.median(on_gpu.decode_ms),
                      torch=str(torch.__version__), when=time.strftime("%Y-%m-%d %H:%M:%S"))
    path = write_json(args.out, "gpu_delta", result)
    total = manifest.total_bytes
    for name, s in (("GPU ", on_gpu), ("host", on_host)):
        print(f"{name}: encode {statistics.median(s.encode_ms):8.1f} ms ({s.encode_gbps:.1f} GB/s), "
              f"decode {statistics.median(s.decode_ms):8.1f} ms, wire {s.wire_bytes / total:.2%} of the version")
    print(f"host / GPU: encode {result.encode_host_over_cuda:.2f}x, decode {result.decode_host_over_cuda:.2f}x "
          f"({result.device}; host {result.cpu}, {result.cpu_threads} threads)")
    plot(result, args.out, path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
