"""Bucket digests side by side in one run: what protocol 1 used against what protocol 2 uses.

    python -m benchmarks.checksums [--mib 64] [--reps 10] [--out benchmarks/results]

Candidates, each over the same 64 MiB host bucket, one thread:

- ``striped-crc32`` protocol 1's digest (16 stripes of 8-byte word sums with numpy, then CRC32);
- ``zlib-crc32``    CRC32 of the bytes;
- ``xxh64``         xxHash 64;
- ``xxh3-64``       xxHash XXH3-64;
- ``crc32c``        hardware CRC32C (protocols 2 to 10: every bucket's).

Since protocol 11 a publisher uses the faster of ``crc32c`` and ``xxh3`` on its CPU
(``weightsync.format.checksum.choose``, a few milliseconds at start) and names it in each
Announce; this prints which one it picks here. The memory-copy rate of the same bucket is
measured beside them as the ceiling. Prints GB/s and each one's ratio to protocol 1 with the
CPU's name, writes ``checksums.json`` and ``checksums.png``.

Then what a generator waiting in ``get_into(model, as_received=True)`` does with each bucket it
receives, on the same bucket and one thread, side by side: the digest pass and then a ``copy_``
of each tensor into the model (two reads of the bucket from memory, as before 2026-12-03), and
``DestWriter.digest_and_write`` (each 1 MiB piece digested, then copied while in cache).

The rows above read one bucket again and again, so after the first pass it is in cache. A
bucket in a transfer is read once, just after something wrote it. Last, the chosen digest over
a bucket as a transfer hands it over, each rep: written by a copy on this thread just before
(the publisher's snapshot), written by a copy on another thread pinned to another core (a
receive), and cold (a bigger buffer written in between). On a 2-core Intel Xeon (2026-12-04)
the first two came out at 0.63-0.71x the in-cache rate and cold at 0.41-0.46x.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import threading
import time
import zlib

import numpy as np
import torch
import xxhash

from benchmarks import report
from weightsync.engine.into import IntoDest
from weightsync.format import layout
from weightsync.format.checksum import choose
from weightsync.testing import digest as checksum


def striped_crc32(buf: torch.Tensor) -> int:
    grid = 16 * 8
    n = buf.numel() // grid * grid
    host = buf.numpy()
    words = host[:n].view(np.uint64).reshape(16, -1)
    digest = zlib.crc32(words.sum(axis=1).tobytes())
    digest = zlib.crc32(words.sum(axis=0).tobytes(), digest)
    return zlib.crc32(host[n:].tobytes(), digest)


def _host(buf: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host uint8 tensor, in place (valid while ``buf`` lives)."""
    return memoryview(buf.numpy())


def rate(fn, buf: torch.Tensor, reps: int) -> float:
    fn(buf)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(buf)
        best = min(best, time.perf_counter() - t0)
    return buf.numel() / best / 1e9


def into_rows(buf: torch.Tensor, kind: str, reps: int) -> dict[str, float]:
    """GB/s of a received bucket's digest plus its copy into model tensors, two ways (module docstring)."""
    n = buf.numel() // 4 // 4  # four fp32 tensors fill the bucket
    items = [(f"w{i}", torch.empty(n, dtype=torch.float32)) for i in range(4)]
    manifest = layout.build_manifest(items)
    flat = torch.zeros(manifest.total_bytes, dtype=torch.uint8)
    flat[: buf.numel()] = buf
    model = {name: torch.empty_like(t) for name, t in items}
    views = [(model[spec.name], layout.tensor_view(flat, spec)) for spec in manifest.tensors]

    def two_passes(_b: torch.Tensor) -> None:
        checksum(flat, kind)
        for dst, src in views:
            dst.copy_(src)

    def one_read(_b: torch.Tensor) -> None:
        writer = IntoDest(model, None).writer(0, manifest, flat)
        assert writer is not None
        writer.digest_and_write(0, manifest.total_bytes, kind)

    return {"digest, then copy_ (two passes)": rate(two_passes, flat, reps),
            "digest and copy in one read (as_received)": rate(one_read, flat, reps)}


def fresh_rows(buf: torch.Tensor, kind: str, reps: int) -> dict[str, float]:
    """GB/s of ``kind`` over a bucket the way a transfer hands it over (module docstring); best of ``reps``."""
    target = torch.empty_like(buf)
    evict = torch.empty(max(4 * buf.numel(), 256 << 20), dtype=torch.uint8)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []

    def written_by_copy() -> None:
        ctypes.memmove(target.data_ptr(), buf.data_ptr(), buf.numel())

    def written_elsewhere() -> None:
        def copy_there() -> None:
            os.sched_setaffinity(0, {cores[1]})
            written_by_copy()

        worker = threading.Thread(target=copy_there)
        worker.start()
        worker.join()

    def best(prepare) -> float:
        fastest = float("inf")
        for _ in range(reps):
            prepare()
            t0 = time.perf_counter()
            checksum(target, kind)
            fastest = min(fastest, time.perf_counter() - t0)
        return buf.numel() / fastest / 1e9

    rows = {"written just before, this thread": best(written_by_copy)}
    if len(cores) >= 2:  # this thread on one core, the copy on another
        os.sched_setaffinity(0, {cores[0]})
        try:
            rows["written just before, another core"] = best(written_elsewhere)
        finally:
            os.sched_setaffinity(0, set(cores))
    rows["cold (a bigger buffer written since)"] = best(lambda: evict.fill_(1))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.checksums", description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    buf = torch.randint(0, 256, (args.mib << 20,), dtype=torch.uint8)
    dst = torch.empty_like(buf)
    torch.set_num_threads(1)
    rows = {
        "memcpy (ceiling)": rate(lambda b: dst.copy_(b), buf, args.reps),
        "striped-crc32 (protocol 1)": rate(striped_crc32, buf, args.reps),
        "zlib-crc32": rate(lambda b: zlib.crc32(_host(b)), buf, args.reps),
        "xxh64": rate(lambda b: xxhash.xxh64_intdigest(_host(b)), buf, args.reps),
        "xxh3-64": rate(lambda b: checksum(b, "xxh3"), buf, args.reps),
        "crc32c": rate(checksum, buf, args.reps),
    }
    picked = choose()
    into = into_rows(buf, picked, args.reps)
    fresh = fresh_rows(buf, picked, args.reps)
    base = rows["striped-crc32 (protocol 1)"]
    cpu = report.cpu_name()
    print(f"{args.mib} MiB host bucket, one thread, best of {args.reps}, {cpu}")
    print(f"{'digest':<28}{'GB/s':>8}{'x protocol 1':>14}")
    for name, gbs in rows.items():
        print(f"{name:<28}{gbs:>8.2f}{gbs / base:>14.2f}")
    print(f"a publisher here uses: {picked}")
    two, one = into.values()
    print(f"\na generator's bucket into its model ({picked}, one thread):")
    for name, gbs in into.items():
        print(f"{name:<44}{gbs:>8.2f} GB/s")
    print(f"one read / two passes: {two / one:.2f}x the time")
    in_cache = rows["xxh3-64" if picked == "xxh3" else "crc32c"]
    print(f"\n{picked} over a bucket as a transfer hands it over (in cache above: {in_cache:.2f} GB/s):")
    for name, gbs in fresh.items():
        print(f"{name:<44}{gbs:>8.2f} GB/s{gbs / in_cache:>8.2f}x in cache")
    json_path = report.write_json(args.out, "checksums", {"mib": args.mib, "reps": args.reps, "cpu": cpu,
                                                          "chosen": picked, "gb_per_s": rows,
                                                          "into_gb_per_s": into, "fresh_gb_per_s": fresh})
    plt = report.pyplot()
    if plt is None:
        return 0
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.barh(list(rows), list(rows.values()), color=["#999", "#c44", "#c84", "#48c", "#4ac", "#2a2"])
    ax.set_xlabel("GB/s, one thread")
    ax.invert_yaxis()
    report.save(fig, args.out, "checksums", json_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
