"""The floor of the group path to one remote generator: what its design must do, and nothing else.

    python -m benchmarks.floor [--mib 512] [--generators 1] [--streams 2] [--bucket-mib 64] [--reps 5]
                               [--out benchmarks/results]

Issue 28 asks for weightsync's time to remote generators no later than the naive per-tensor
broadcast loop's. This program measures, between processes on this host (a trainer and
``--generators`` receivers) and with no weightsync code on the path, the operations that path
has to do at the least, stripped of its control plane, recorder, slots and threads:

- ``naive``: the baseline itself, a blocking ``broadcast`` per tensor of the bench's LLM-shaped
  state dict over one gloo connection per pair, into each receiver's own tensors;
- ``wire``: the same bytes already in one flat buffer, broadcast in buckets, two in flight, over
  ``--streams`` connections per pair (what weightsync's group plane sends);
- ``wire+digest``: each end digests every bucket once it has arrived (weightsync's checksums on,
  with the digest it picks on this CPU), the sender while the next bucket is on the wire;
- ``snapshot+wire``: the sender first copies the state dict into the flat buffer on the threads
  and with the ``memmove`` a weightsync snapshot uses (``put(copy=True)``'s stall), then sends;
- ``snapshot+wire+digest``: both, the least a checksummed ``put`` to a generator served from its
  slot (the bench's ``ws_assign``) can take.

The time to all runs from the sender's start to the last receiver's last byte (and digest), on
the host's one monotonic clock. Every round runs every mode once, in the same shuffled order on both
ends, after a warm-up round; medians of ``--reps``. CPU is each whole process's (every thread).

Where ``snapshot+wire+digest`` is not shorter than ``naive``, no implementation of that design
meets the target on this CPU; the difference between it and the bench's ``ws_assign`` is what
weightsync's own machinery costs. Prints a table, writes ``floor.json`` and ``floor.png``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist

from benchmarks import report
from benchmarks.gloo_wire import DEADLINE, DEPTH
from weightsync import _torch_compat as compat
from weightsync.bench.model import make_state_dict, nbytes
from weightsync.engine.snapshots import Copier, _copy_threads
from weightsync.format import checksum

MODES = ("naive", "wire", "wire+digest", "snapshot+wire", "snapshot+wire+digest")


class Mode(msgspec.Struct):
    mode: str
    to_all_ms: float  # median of reps: sender's start to the last receiver's last byte (and digest)
    ratio_to_naive: float
    sender_cpu_ms: float  # medians of reps, every thread of each process
    receiver_cpu_ms: float  # per receiver (their mean)
    runs_ms: list[float]


class Floor(msgspec.Struct):
    cpu: str
    glibc_tunables: str
    mib: float
    tensors: int
    generators: int
    streams: int
    bucket_mib: int
    digest: str
    snapshot_threads: int
    reps: int
    modes: list[Mode]


def order(reps: int, seed: int = 28) -> list[list[str]]:
    """Every round's modes, a warm-up round first; both ends compute the same."""
    rng = random.Random(seed)
    rounds = []
    for _ in range(reps + 1):
        modes = list(MODES)
        rng.shuffle(modes)
        rounds.append(modes)
    return rounds


def _bucketed(pg: object, flat: torch.Tensor, bucket: int, digest: str | None) -> None:
    """Broadcast ``flat`` from rank 0 in ``bucket``-byte pieces, ``DEPTH`` in flight; with ``digest``
    each finished piece is digested before the next is issued past the depth (both ends)."""
    works: list[tuple[object, torch.Tensor]] = []

    def finish() -> None:
        work, piece = works.pop(0)
        compat.wait_work(work, DEADLINE)
        if digest:
            checksum.checksum(piece, digest)

    for lo in range(0, flat.numel(), bucket):
        if len(works) >= DEPTH:
            finish()
        piece = flat[lo:lo + bucket]
        works.append((compat.broadcast(pg, piece, 0, DEADLINE), piece))
    while works:
        finish()


def measure(rank: int, world: int, store: dist.Store, sd: dict[str, torch.Tensor], streams: int, bucket_mib: int,
            reps: int, digest: str) -> dict[str, list[tuple[float, float, float]]]:
    """Run every round on this end with ``sd`` (the trainer's state dict, or this receiver's model
    tensors); per mode, per measured rep, (start, end, CPU seconds)."""
    tensors = list(sd.values())
    total = nbytes(sd)
    flat = torch.empty(total, dtype=torch.uint8).fill_(rank + 1)  # written once: no page faults timed
    ranges, at = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        ranges.append((flat.data_ptr() + at, t.data_ptr(), n))
        at += n
    copier = Copier(_copy_threads(), "floor-copy") if rank == 0 else None
    one = compat.make_gloo(compat.prefix_store("one", store), rank, world, DEADLINE, "127.0.0.1", 1)
    many = compat.make_gloo(compat.prefix_store("many", store), rank, world, DEADLINE, "127.0.0.1", streams)
    token = torch.zeros(1, dtype=torch.uint8)
    out: dict[str, list[tuple[float, float, float]]] = {m: [] for m in MODES}
    try:
        for r, modes in enumerate(order(reps)):
            for mode in modes:
                compat.wait_work(compat.broadcast(one, token, 0, DEADLINE), DEADLINE)  # both ends start together
                t0, c0 = time.monotonic(), time.process_time()
                if mode == "naive":
                    for t in tensors:
                        compat.wait_work(compat.broadcast(one, t, 0, DEADLINE), DEADLINE)
                else:
                    if mode.startswith("snapshot") and copier is not None:
                        copier.copy(ranges)
                    _bucketed(many, flat, bucket_mib << 20, digest if mode.endswith("digest") else None)
                if r:
                    out[mode].append((t0, time.monotonic(), time.process_time() - c0))
    finally:
        if copier is not None:
            copier.close()
        del one, many
    return out


def receiver(port: int, args: argparse.Namespace) -> int:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=dt.timedelta(seconds=DEADLINE))
    digest = store.get("digest").decode()
    runs = measure(args.rank, args.generators + 1, store, make_state_dict(args.mib, seed=args.rank), args.streams,
                   args.bucket_mib, args.reps, digest)
    store.set(f"receiver-{args.rank}", msgspec.json.encode(runs))
    return 0


def run(mib: int, generators: int, streams: int, bucket_mib: int, reps: int) -> Floor:
    digest = checksum.choose()  # what a publisher on this CPU names in its Announce
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=dt.timedelta(seconds=DEADLINE))
    store.set("digest", digest)
    argv = [sys.executable, "-m", "benchmarks.floor", "--role", "receiver", "--port", str(store.port),
            "--mib", str(mib), "--generators", str(generators), "--streams", str(streams),
            "--bucket-mib", str(bucket_mib), "--reps", str(reps)]
    root = Path(__file__).resolve().parent.parent
    children = [subprocess.Popen([*argv, "--rank", str(r)], cwd=root) for r in range(1, generators + 1)]
    try:
        sd = make_state_dict(mib, seed=0)
        mine = measure(0, generators + 1, store, sd, streams, bucket_mib, reps, digest)
        for child in children:
            if child.wait(timeout=DEADLINE * 4) != 0:
                raise RuntimeError(f"a receiver process exited with {child.returncode}")
        theirs = [msgspec.json.decode(store.get(f"receiver-{r}")) for r in range(1, generators + 1)]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    modes = []
    for mode in MODES:
        to_all = [(max(got[mode][k][1] for got in theirs) - sent[0]) * 1e3 for k, sent in enumerate(mine[mode])]
        receivers = [statistics.median(c for _, _, c in got[mode]) * 1e3 for got in theirs]
        modes.append(Mode(mode=mode, to_all_ms=statistics.median(to_all), ratio_to_naive=0.0,
                          sender_cpu_ms=statistics.median(c for _, _, c in mine[mode]) * 1e3,
                          receiver_cpu_ms=statistics.fmean(receivers), runs_ms=to_all))
    naive = modes[0].to_all_ms
    for m in modes:
        m.ratio_to_naive = m.to_all_ms / naive
    return Floor(cpu=report.cpu_name(), glibc_tunables=os.environ.get("GLIBC_TUNABLES", ""),
                 mib=nbytes(sd) / 2**20, tensors=len(sd), generators=generators, streams=streams,
                 bucket_mib=bucket_mib, digest=digest, snapshot_threads=_copy_threads(), reps=reps, modes=modes)


def table(rep: Floor) -> str:
    lines = [f"{rep.mib:.0f} MiB ({rep.tensors} tensors) to {rep.generators} generator process"
             f"{'es' if rep.generators > 1 else ''} on this host; "
             f"{rep.streams} streams, {rep.bucket_mib} MiB buckets, digest {rep.digest}, snapshot on "
             f"{rep.snapshot_threads} threads; median of {rep.reps}; {rep.cpu}"
             + (f"; GLIBC_TUNABLES={rep.glibc_tunables}" if rep.glibc_tunables else ""),
             f"{'mode':<22} {'to-all ms':>10} {'/ naive':>8} {'sender CPU ms':>14} {'receiver CPU ms':>16} "
             f"{'cores busy':>11}"]
    for m in rep.modes:
        busy = (m.sender_cpu_ms + m.receiver_cpu_ms * rep.generators) / m.to_all_ms
        lines.append(f"{m.mode:<22} {m.to_all_ms:>10.1f} {m.ratio_to_naive:>8.3f} {m.sender_cpu_ms:>14.1f} "
                     f"{m.receiver_cpu_ms:>16.1f} {busy:>11.2f}")
    return "\n".join(lines)


def plot(rep: Floor, out: str | Path, json_path: Path) -> None:
    plt = report.pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    names = [m.mode for m in rep.modes]
    left.barh(names, [m.to_all_ms for m in rep.modes], color=["C3"] + ["C0"] * (len(names) - 1))
    left.axvline(rep.modes[0].to_all_ms, color="C3", linestyle="--", linewidth=1)
    left.set_xlabel("time to all, ms (the naive loop dashed)")
    left.invert_yaxis()
    right.barh(names, [m.sender_cpu_ms for m in rep.modes], label="sender")
    right.barh(names, [m.receiver_cpu_ms for m in rep.modes], left=[m.sender_cpu_ms for m in rep.modes],
               label="each receiver")
    right.set_xlabel("CPU ms per version (all threads)")
    right.invert_yaxis()
    right.legend(fontsize=8)
    fig.suptitle(f"the group path's floor, {rep.mib:.0f} MiB to {rep.generators} generator(s) ({rep.cpu})",
                 fontsize=9)
    report.save(fig, out, "floor", json_path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--generators", type=int, default=1, help="receiver processes")
    parser.add_argument("--streams", type=int, default=2, help="gloo connections per pair for the bucketed modes")
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--role", choices=("sender", "receiver"), default="sender", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.mib, args.reps, args.streams, args.bucket_mib, args.generators) < 1:
        parser.error("--mib, --generators, --streams, --bucket-mib and --reps must be >= 1")
    if args.role == "receiver":
        return receiver(args.port, args)
    rep = run(args.mib, args.generators, args.streams, args.bucket_mib, args.reps)
    print(table(rep))
    json_path = report.write_json(args.out, "floor", rep)
    plot(rep, args.out, json_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
