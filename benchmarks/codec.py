"""The delta codec alone, against its ceilings measured in the same run (issue 57).

    python -m benchmarks.codec [--mib 64] [--changed 0.03] [--reps 5] [--out benchmarks/results]

A bucket of ``--mib`` MiB of bf16 in 4 MiB tensors, its base and a new version in which about
``--changed`` of the elements differ, as an RL step at a small learning rate makes them (fp32
masters nudged by ``lr * sign``, both cast to bf16: the changes land in the lowest mantissa bits,
at positions the rounding picks). On one thread, best of ``--reps``:

- the ceilings: a ``copy_`` of the bucket (what a decode must at least do: write the version
  once) and the compare pass (one XOR over both versions, a cache-sized slice at a time, nothing
  else: what an encode must at least do);
- encode and decode with numpy's implementation and with torch's (where numpy is missing, or
  on a device), bit-exact checked, and the wire's bytes per changed element;
- encode with every CPU of this machine, one bucket per thread (the publisher's encoder pool).

Targets (issue 57): encode and decode each at least 3 GB/s and at least half the same run's
copy, one thread. Writes ``codec.json`` and ``codec.png``; exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import torch

from benchmarks.report import cpu_name, pyplot, save, verdict, write_json
from weightsync.encodings import codec
from weightsync.format.layout import Segment


class Rate(msgspec.Struct):
    what: str
    gbps: float  # GB/s of version bytes
    ms: float


class Report(msgspec.Struct):
    when: str
    cpu: str
    torch: str
    numpy: str
    mib: int
    changed: float  # share of bf16 elements that differ
    wire_bytes_per_changed: float
    wire_of_full: float
    rates: list[Rate]
    threads: int


def versions(nbytes: int, changed: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Base and new bf16 bytes: fp32 masters around 0.02, nudged by ``lr * sign`` with ``lr`` set so
    about ``changed`` of the bf16 elements round differently."""
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(nbytes // 2, generator=gen) * 0.02
    lr = changed * 2.4e-5  # about linear in this range: 3 % at 7.2e-7 (measured here)
    new = master + lr * torch.sign(torch.randn(nbytes // 2, generator=gen))
    return new.to(torch.bfloat16).view(torch.uint8), master.to(torch.bfloat16).view(torch.uint8)


def best(fn: Callable[[], Any], reps: int) -> float:
    out = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t0)
    return out


def compare_pass(cur: torch.Tensor, base: torch.Tensor) -> Callable[[], None]:
    import numpy as np

    c, b = cur.numpy().view(np.int64), base.numpy().view(np.int64)
    scratch = np.empty(codec.CHUNK, np.int64)

    def run() -> None:
        for lo in range(0, c.size, codec.CHUNK):
            hi = min(lo + codec.CHUNK, c.size)
            np.bitwise_xor(c[lo:hi], b[lo:hi], out=scratch[: hi - lo])
    return run


def use(which: str) -> None:
    """The codec's implementation: ``numpy`` or ``torch`` (as where numpy is not installed)."""
    import numpy

    codec._numpy[:] = [numpy if which == "numpy" else None]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--changed", type=float, default=0.03)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    import numpy

    torch.set_num_threads(1)
    nbytes = args.mib << 20
    cur, base = versions(nbytes, args.changed)
    tensor = 4 << 20
    segs = [Segment(lo, min(lo + tensor, nbytes), 2) for lo in range(0, nbytes, tensor)]
    changed = float((cur.view(torch.int16) != base.view(torch.int16)).float().mean())
    rates: list[Rate] = []

    def rate(what: str, seconds: float) -> None:
        rates.append(Rate(what, nbytes / seconds / 1e9, seconds * 1e3))
        print(f"{what:34s} {nbytes / seconds / 1e9:6.2f} GB/s  ({seconds * 1e3:6.1f} ms)")

    out = torch.empty_like(cur)
    rate("copy (ceiling of a decode)", best(lambda: out.copy_(cur), args.reps))
    rate("compare pass (ceiling of an encode)", best(compare_pass(cur, base), args.reps))
    wire = None
    for which in ("numpy", "torch"):
        use(which)
        made = codec.encode(cur, base, segs, auto=True)
        wire = wire or made
        rate(f"encode, {which}", best(lambda: codec.encode(cur, base, segs, auto=True), args.reps))
        out.fill_(0)
        codec.decode(made.wire, base, out, segs)
        if not torch.equal(out, cur):
            raise SystemExit(f"{which}: the decoded bucket differs from the version")
        rate(f"decode, {which}", best(lambda w=made.wire: codec.decode(w, base, out, segs), args.reps))
    use("numpy")
    threads = os.cpu_count() or 1
    buckets = [(cur[i * nbytes // threads: (i + 1) * nbytes // threads],
                base[i * nbytes // threads: (i + 1) * nbytes // threads]) for i in range(threads)]
    with ThreadPoolExecutor(threads) as pool:
        def every() -> None:
            list(pool.map(lambda cb: codec.encode(cb[0], cb[1], [Segment(0, cb[0].numel(), 2)], auto=True), buckets))
        rate(f"encode, numpy, {threads} threads", best(every, args.reps))
    assert wire is not None
    per_changed = wire.wire.numel() / max(wire.changed, 1)
    print(f"changed {changed:.2%} of the elements; wire {per_changed:.3f} B per changed element, "
          f"{wire.wire.numel() / nbytes:.4f} of the version; {cpu_name()}")
    report = Report(when=time.strftime("%Y-%m-%d %H:%M"), cpu=cpu_name(), torch=str(torch.__version__),
                    numpy=numpy.__version__, mib=args.mib, changed=changed, wire_bytes_per_changed=per_changed,
                    wire_of_full=wire.wire.numel() / nbytes, rates=rates, threads=threads)
    path = write_json(args.out, "codec", report)
    plot(report, args.out, path)
    by = {r.what: r.gbps for r in rates}
    copy = by["copy (ceiling of a decode)"]
    return verdict({
        "encode >= 3 GB/s and >= 0.5x copy, one thread": by["encode, numpy"] >= max(3.0, copy / 2),
        "decode >= 3 GB/s and >= 0.5x copy, one thread": by["decode, numpy"] >= max(3.0, copy / 2),
    })


def plot(report: Report, out: str | Path, json_path: Path) -> None:
    plt = pyplot()
    if plt is None:
        print(f"wrote {json_path}")
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    names = [r.what for r in report.rates]
    colors = ["#999999" if "ceiling" in n else "#1f77b4" if "numpy" in n else "#ff7f0e" for n in names]
    ax.barh(names, [r.gbps for r in report.rates], color=colors)
    ax.axvline(3.0, color="red", linestyle="--", linewidth=1, label="target 3 GB/s")
    ax.invert_yaxis()
    ax.set_xlabel("GB/s of version bytes")
    ax.set_title(f"delta codec, {report.mib} MiB bf16, {report.changed:.1%} changed, {report.cpu[:40]}", fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    save(fig, out, "codec", json_path)


if __name__ == "__main__":
    raise SystemExit(main())
