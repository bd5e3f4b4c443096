"""weightsync against blocking broadcasts, side by side in one run (``make bench``).

    python -m benchmarks.push_vs_broadcast [--sizes 64,256,512] [--subscribers 1,2,4] [--reps 3] [--step-ms 300]
    python -m benchmarks.push_vs_broadcast --link-mbit 8000 [--pipeline on] [--bucket-mib 64]   # remote generators

With ``--link-mbit R`` (root; benchmarks/netns.py) every generator, the baselines' included, runs on an
emulated host of its own behind a link shaped to R Mbit/s each way, over the group, as a generator
on another machine receives.

Modes, each pushing the same LLM-shaped state dict from a trainer to N generator processes:

- ``naive``     a blocking per-tensor ``broadcast`` loop (what most RL loops do today);
- ``packed``    a blocking packed-bucket broadcast with two flat buffers (vLLM's way; 1 GiB
                buffers by default), packing one while the other is on the wire;
- ``ws_copy``   ``await pub.put(sd)``: returns after the snapshot, the transfer runs behind;
                the generators wait in ``get_into(model, as_received=True)``, so each tensor is
                written into their model as its buckets arrive;
- ``ws_after``  ``ws_copy`` with the generators copying each version into their model once it
                is readable (a plain ``get_into``; every weightsync mode did so before 2026-12-03);
- ``ws_assign`` ``ws_copy`` with each generator's model a torch module served from its
                subscriber's slot: ``load_state_dict(assign=True)`` makes its parameters the
                version's views, inside a ``stream()`` block held until the next version
                (docs/examples.md): the bytes land in the model's tensors with no copy;
- ``ws_nocrc``  ``ws_copy`` with per-bucket checksums off (``Publisher(checksum=False)``): what
                the default-on corruption check costs, measured beside it;
- ``ws_nocopy`` ``await pub.put(sd, copy=False)`` overlapped with a synthetic training step of
                ``--step-ms`` (slept: it stands for accelerator time), then
                ``await released(spill=True)``: what is not sent by then is copied, and the
                tensors are let go (the optimizer step need not wait for the wire).
- ``ws_ahead``  ``ws_nocopy`` with ``Publisher(spill_ahead=True)``: the version is copied from its
                end down while the step runs and the wire takes it from the start; the tensors
                are let go once it is all copied, so the spill at the step's end has little left.

Side by side: the baselines' receivers and weightsync's subscribers run at once, and each round
pushes once in every mode (shuffled, the same order in every run), after a warm-up round
at each size. Before 2026-12-04 each mode ran all its pushes in a block, minutes after the
others, and ``ws_copy``, the first weightsync mode at each size, paid the allocation of every
buffer of that size alone.

Per mode: the trainer-visible stall, the time until every generator has the version in its own
model tensors, GB/s, event-loop lag p99 on the trainer and on the generators, and the physical
ceiling measured in the same run (memcpy and loopback TCP bandwidth). Ratios are against
``packed``, and the to-all figures against ``naive`` too.

Like with like: every to-all figure ends with the bytes in the generator's model tensors. The
baselines broadcast (``naive``) or unpack (``packed``) into them; a weightsync generator has
each version written into them (``get_into``) and counts it on a store the trainer waits on, as
the baselines' receivers do. ``acked ms`` is weightsync's earlier
point, every generator's acknowledgement (verified bytes in its subscriber's slot).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import os
import random
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed as dist

import weightsync as ws
from benchmarks import netns
from benchmarks.baseline import BlockingBroadcast
from benchmarks.lag import LagMeter
from benchmarks.procs import Launch, Workers
from benchmarks.report import cpu_name, verdict, write_json
from weightsync.bench.model import make_state_dict, nbytes
from weightsync.bench.run import add_ratios, draw

MODES = ("naive", "packed", "ws_copy", "ws_after", "ws_assign", "ws_nocrc", "ws_nocopy", "ws_ahead")
BASELINES = ("naive", "packed")
WS_MODES = ("ws_copy", "ws_after", "ws_assign", "ws_nocrc", "ws_nocopy", "ws_ahead")
NOCOPY = ("ws_nocopy", "ws_ahead")  # put(copy=False), a step, then released(spill=True)


class Row(msgspec.Struct):
    mode: str
    mib: float
    subscribers: int
    stall_ms: float
    to_all_ms: float
    gbps: float
    lag_p99_trainer_ms: float
    lag_p99_generators_ms: float
    stall_vs_packed: float = 0.0
    to_all_vs_packed: float = 0.0
    acked_ms: float = 0.0  # weightsync: until every generator acknowledged (before its copy into its model)
    to_all_vs_naive: float = 0.0
    to_all_runs_ms: list[float] = []  # every measured push's, in round order (the median is to_all_ms)
    stall_runs_ms: list[float] = []  # the same for the stall (the median is stall_ms)


class Ceiling(msgspec.Struct):
    memcpy_gbps: float
    loopback_gbps: float


class Report(msgspec.Struct):
    when: str
    torch: str
    cores: int
    step_ms: float
    packed_bytes: int
    reps: int
    ceiling: Ceiling
    rows: list[Row]
    targets: dict[str, bool]
    transport: str = "auto"
    streams: int = 2  # the publisher's gloo connections per pair (Publisher(streams=))
    link_mbit: float | None = None  # generators on emulated hosts behind links of this rate (--link-mbit)
    pipeline: bool | None = None  # Publisher(pipeline=): None, its default (on from 4 CPUs)
    bucket_mib: int = 64  # Publisher(bucket_bytes=) in MiB
    cpu: str = ""  # the CPU's model name: the copies' and digests' speed depends on it
    glibc_tunables: str = ""  # $GLIBC_TUNABLES of every process here (docs/benchmarks.md, "Copies past the cache")


# ceilings --------------------------------------------------------------------------------------
def memcpy_gbps(mib: int = 512) -> float:
    src = torch.empty(mib << 20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(3))
    return src.numel() / best / 1e9


def loopback_gbps(mib: int = 512) -> float:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    payload = memoryview(bytearray(4 << 20))
    total = mib << 20

    def sink() -> None:
        conn, _ = server.accept()
        buf = bytearray(4 << 20)
        got = 0
        while got < total:
            n = conn.recv_into(buf)
            if not n:
                break
            got += n
        conn.close()

    thread = threading.Thread(target=sink)
    thread.start()
    client = socket.create_connection(server.getsockname(), timeout=60)
    t0 = time.perf_counter()
    for _ in range(total // len(payload)):
        client.sendall(payload)
    client.close()
    thread.join(timeout=60)
    server.close()
    return total / (time.perf_counter() - t0) / 1e9


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def rounds(reps: int) -> list[list[str]]:
    """The order of the pushes at one point: a warm-up round, then ``reps`` measured rounds, each
    with every mode once, shuffled (a fixed seed per round: the same order in every run). Every
    contender is timed in the same seconds as the others, so a machine that slows down for a
    while (this project's 2-core machine took 2.5x as long to copy the same GiB in one run as in
    the next, 2026-12-04) slows them all; and no mode always follows the same one (a put after
    ``copy=False`` ones paid 0.4 s of page faults until staging kept both its buffers)."""
    order = []
    for r in range(reps + 1):
        modes = list(MODES)
        random.Random(r).shuffle(modes)
        order.append(modes)
    return order


class Samples:
    """One point's measured pushes, by mode."""

    def __init__(self) -> None:
        self.stalls: dict[str, list[float]] = {m: [] for m in MODES}
        self.to_all: dict[str, list[float]] = {m: [] for m in MODES}
        self.acked: dict[str, list[float]] = {m: [] for m in MODES}
        self.lags: dict[str, list[float]] = {m: [] for m in MODES}

    def add(self, mode: str, stall: float, to_all: float, lag: float, acked: float | None = None) -> None:
        self.stalls[mode].append(stall)
        self.to_all[mode].append(to_all)
        self.lags[mode].append(lag)
        if acked is not None:
            self.acked[mode].append(acked)

    def rows(self, size: int, n: int) -> list[Row]:
        rows = []
        for mode in MODES:
            rows.append(_row(mode, size, n, self.stalls[mode], self.to_all[mode], self.lags[mode], 0.0))
            if self.acked[mode]:
                rows[-1].acked_ms = statistics.median(self.acked[mode]) * 1e3
        return rows


async def run_point_set(sizes: list[int], n: int, reps: int, step_ms: float, packed_bytes: int, tmp: Path,
                        progress, transport: str = "auto",  # type: ignore[no-untyped-def]
                        streams: int = 2, cluster: netns.Cluster | None = None,
                        pipeline: bool | None = None, bucket_mib: int = 64) -> list[Row]:
    """Every mode at every size to ``n`` generators, side by side: the baselines' receivers and
    weightsync's subscribers run at once, and each round pushes once in every mode (:func:`rounds`)."""
    order = [rounds(reps) for _ in sizes]
    # the baselines' receivers and weightsync's subscribers follow the same order, each their own modes
    plan = [(mode, mib, 1) for mib, by_round in zip(sizes, order, strict=True)
            for modes in by_round for mode in modes if mode in BASELINES]
    versions = [(mib, mode) for mib, by_round in zip(sizes, order, strict=True)
                for modes in by_round for mode in modes if mode in WS_MODES]
    host = "127.0.0.1" if cluster is None else cluster.trainer_ip
    # gated: every receiver builds a size's model when that size begins and exits when all is
    # timed, never while another contender's push is being timed (workers.gate)
    sender = (BlockingBroadcast(n, plan, packed_bytes, tmp, gate=True) if cluster is None else
              BlockingBroadcast(n, plan, packed_bytes, tmp, host=host, gate=True,
                                hosts=[h.ip for h in cluster.hosts], launch=_launcher(cluster)))
    workers = Workers(tmp, None if cluster is None else _launcher(cluster))
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=300))
    rows: list[Row] = []
    try:
        async with ws.Publisher("bench", address=f"{host}:0", timeout=120, bucket_bytes=bucket_mib << 20,
                                encoding="full", streams=streams, pipeline=pipeline) as pub:
            for i in range(n):
                workers.spawn(role="subscriber", address=pub.address, member=f"gen{i}",
                              last_version=len(versions) - 1, transport=transport, versions=versions, host=host,
                              port=store.port, gate=True)
            await sender.connect()
            await pub.wait_subscribers(n, timeout=300)
            version = 0
            began: dict[int, float] = {}
            for mib, by_round in zip(sizes, order, strict=True):
                sd = make_state_dict(mib)
                began[mib] = time.time()
                store.set(f"begin/{mib}", b"1")
                sender.begin(str(mib))
                samples = Samples()
                for r, modes in enumerate(by_round):
                    for mode in modes:
                        if mode in BASELINES:
                            stall, done, lag = await _baseline_push(sender, sd, mode, mib, r)
                            acked = None
                        else:
                            stall, done, acked, lag = await _ws_push(pub, store, sd, mode, version, n, step_ms)
                            version += 1
                        if r:  # round 0 warms up: every buffer and slot of this size allocated once
                            samples.add(mode, stall, done, lag, acked)
                for row in samples.rows(nbytes(sd), n):
                    progress(row)
                    rows.append(row)
            store.set("begin/end", b"1")
            sender.begin("end")
            results = workers.results(timeout=600)
            gen_lags = [r["lag_p99_ms"] for r in results]
            results += sender.close()
            check_gated(results, began)
    finally:
        try:
            sender.close()
        finally:
            workers.kill()
            del store
    for row in rows:
        if row.mode in WS_MODES:
            row.lag_p99_generators_ms = max(gen_lags)
    return rows


def check_gated(results: list[dict], began: dict[int, float]) -> None:
    """Every receiver began each size's model after the trainer began that size (``workers.gate``)."""
    early = [(mib, began.get(mib, float("inf")) - at) for r in results for mib, at in r.get("built", [])
             if at < began.get(mib, float("inf"))]
    if early or any(len(r.get("built", [])) != len(began) for r in results):
        raise RuntimeError(f"a receiver built a model before its size began (MiB, seconds early): {early}, "
                           f"or not at every size: {[r.get('built') for r in results]}")


async def _baseline_push(sender: BlockingBroadcast, sd: dict[str, torch.Tensor], mode: str, mib: int,
                         rep: int) -> tuple[float, float, float]:
    meter = LagMeter()
    meter.start()
    await asyncio.sleep(0)
    t0 = time.perf_counter()
    sender.push(sd, mode)
    stall = time.perf_counter() - t0
    await sender.wait_unpacked(mode, mib, rep)
    done = time.perf_counter() - t0
    return stall, done, await meter.stop()


async def _ws_push(pub: ws.Publisher, store: Any, sd: dict[str, torch.Tensor], mode: str, version: int, n: int,
                   step_ms: float) -> tuple[float, float, float, float]:
    pub.checksum = mode != "ws_nocrc"
    pub.spill_ahead = mode == "ws_ahead"
    meter = LagMeter()
    meter.start()
    await asyncio.sleep(0)
    t0 = time.perf_counter()
    t0_wall = time.time()
    handle = await pub.put(sd, version=version, copy=mode not in NOCOPY)
    put_time = time.perf_counter() - t0
    delivery = asyncio.ensure_future(handle.delivered(timeout=600))
    in_models = asyncio.ensure_future(_all_set(store, [f"done/ws/{version}/gen{i}" for i in range(n)]))
    if mode not in NOCOPY:
        stall = put_time
    else:
        await asyncio.sleep(step_ms / 1e3)  # forward + backward on the accelerator
        t1 = time.perf_counter()
        await handle.released(timeout=600, spill=True)  # optimizer.step() may now run
        stall = put_time + (time.perf_counter() - t1)
    report = await delivery
    # both ends stamped off the event loop: the sender thread's decision, the store wait's return
    acked = report.delivered_at - t0_wall
    done = await in_models - t0_wall  # every generator's model holds it
    lag = await meter.stop()
    if report.superseded or len(report.members) != n:
        raise RuntimeError(f"version {version} reached {report.members} only")
    return stall, done, acked, lag


def _launcher(cluster: netns.Cluster) -> Launch:
    """The k-th worker runs on emulated host k."""
    def launch(k: int, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        return cluster.popen(k, argv, env=env, cwd=netns.REPO)

    return launch


async def _all_set(store: Any, keys: list[str]) -> float:
    """When every generator had set its key: the store's own wait, on a thread (no polling while
    the transfer runs behind put, which would take the cores it runs on)."""
    def wait() -> float:
        store.wait(keys, dt.timedelta(seconds=600))
        return time.time()

    return await asyncio.to_thread(wait)


def _row(mode: str, size: int, n: int, stalls: list[float], to_all: list[float], lags: list[float],
         gen_lag: float) -> Row:
    done = statistics.median(to_all)
    return Row(mode=mode, mib=size / 2**20, subscribers=n, stall_ms=statistics.median(stalls) * 1e3,
               to_all_ms=done * 1e3, gbps=size * n / done / 1e9, lag_p99_trainer_ms=max(lags),
               lag_p99_generators_ms=gen_lag, to_all_runs_ms=[round(t * 1e3, 1) for t in to_all],
               stall_runs_ms=[round(t * 1e3, 1) for t in stalls])


# report --------------------------------------------------------------------------------------------
def check_targets(rows: list[Row], transport: str = "auto") -> dict[str, bool]:
    """The issue's targets at 512 MiB (or the largest size run) and 2 subscribers (or the nearest);
    with ``transport="group"`` (the generators' path is the wire) also the naive loop's (issue 28)."""
    ws_rows = [r for r in rows if r.mode.startswith("ws")]
    if not ws_rows:
        return {}
    n = min({r.subscribers for r in rows}, key=lambda k: abs(k - 2))
    size = min({r.mib for r in rows}, key=lambda m: abs(m - 496))
    pick = {r.mode: r for r in rows if r.subscribers == n and r.mib == size}
    copy, nocopy, ahead = pick["ws_copy"], pick["ws_nocopy"], pick["ws_ahead"]
    naive: dict[str, bool] = {}
    if transport == "group":  # like with like: every to-all ends with the bytes in the generators' models
        # a generator with its own model tensors (get_into), and one serving from its slot (ws_assign)
        for r in sorted((r for r in rows if r.mode in ("ws_copy", "ws_assign")),
                        key=lambda r: (r.mode != "ws_copy", r.subscribers, r.mib)):
            naive[f"{r.mode} time to all <= 1.0 x naive, {r.mib:.0f} MiB x {r.subscribers} "
                  f"({r.to_all_vs_naive:.3f})"] = r.to_all_vs_naive <= 1.0
    return naive | {
        f"stall with snapshot <= 0.15 x packed ({copy.stall_vs_packed:.3f})": copy.stall_vs_packed <= 0.15,
        f"stall copy=False overlapped <= 0.05 x packed ({nocopy.stall_vs_packed:.3f})": nocopy.stall_vs_packed <= 0.05,
        f"stall copy=False spilled ahead <= 0.05 x packed ({ahead.stall_vs_packed:.3f})": ahead.stall_vs_packed <= 0.05,
        f"time to all <= 1.1 x packed ({copy.to_all_vs_packed:.3f})": copy.to_all_vs_packed <= 1.1,
        f"event-loop lag p99 <= 20 ms (trainer {max(copy.lag_p99_trainer_ms, nocopy.lag_p99_trainer_ms):.1f}, "
        f"generators {copy.lag_p99_generators_ms:.1f})":
            max(copy.lag_p99_trainer_ms, nocopy.lag_p99_trainer_ms, copy.lag_p99_generators_ms) <= 20,
    }


def table(rows: list[Row], ceiling: Ceiling, link_mbit: float | None = None) -> str:
    head = (f"{'MiB':>6} {'subs':>4} {'mode':<10} {'stall ms':>9} {'to-all ms':>10} {'acked ms':>9} {'GB/s':>6} "
            f"{'of ceil':>7} {'lag99 trn':>9} {'lag99 gen':>9} {'stall/pk':>8} {'all/pk':>7} {'all/nv':>7}")
    lines = [head, "-" * len(head)]
    for r in sorted(rows, key=lambda r: (r.subscribers, r.mib, MODES.index(r.mode))):
        # one sender's loopback is the shared bottleneck for every copy; behind shaped links, each
        # generator's link carries every byte once
        ceil = ceiling.loopback_gbps if link_mbit is None else r.subscribers * link_mbit / 8e3
        acked = f"{r.acked_ms:9.1f}" if r.acked_ms else f"{'':9}"
        lines.append(f"{r.mib:6.0f} {r.subscribers:4d} {r.mode:<10} {r.stall_ms:9.1f} {r.to_all_ms:10.1f} {acked} "
                     f"{r.gbps:6.2f} {r.gbps / ceil:7.2f} {r.lag_p99_trainer_ms:9.1f} {r.lag_p99_generators_ms:9.1f} "
                     f"{r.stall_vs_packed:8.3f} {r.to_all_vs_packed:7.3f} {r.to_all_vs_naive:7.3f}")
    return "\n".join(lines)


def plot(report: Report, path: Path) -> None:
    title = f"weightsync vs blocking broadcast (gloo, CPU, {report.cores} cores, torch {report.torch})"
    draw(report.rows, MODES, title, path)


async def bench(sizes: list[int], subscribers: list[int], reps: int, step_ms: float, packed_bytes: int,
                transport: str = "auto", streams: int = 2, link_mbit: float | None = None,
                pipeline: bool | None = None, bucket_mib: int = 64) -> Report:
    print("ceilings: memcpy and loopback TCP, measured now ...", flush=True)
    ceiling = Ceiling(memcpy_gbps=memcpy_gbps(), loopback_gbps=loopback_gbps())
    print(f"  memcpy {ceiling.memcpy_gbps:.1f} GB/s, loopback TCP {ceiling.loopback_gbps:.2f} GB/s", flush=True)
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    print(f"  {cpu_name()}; GLIBC_TUNABLES {tunables or 'unset (glibc defaults)'}", flush=True)
    rows: list[Row] = []
    total = len(sizes) * len(subscribers) * len(MODES)

    def progress(row: Row) -> None:
        print(f"  [{len(rows) + 1:>2}/{total}] {row.mib:6.0f} MiB x {row.subscribers} {row.mode:<10} "
              f"stall {row.stall_ms:8.1f} ms   to all {row.to_all_ms:8.1f} ms", flush=True)
        rows.append(row)

    with tempfile.TemporaryDirectory(prefix="ws-bench-") as tmp, contextlib.ExitStack() as stack:
        # --link-mbit: every generator on an emulated host of its own behind a link of that rate
        cluster = None if link_mbit is None else stack.enter_context(netns.Cluster([link_mbit] * max(subscribers)))
        for n in subscribers:
            await run_point_set(sizes, n, reps, step_ms, packed_bytes, Path(tmp), progress, transport, streams,
                                cluster, pipeline, bucket_mib)
    add_ratios(rows)
    naive = {(r.mib, r.subscribers): r for r in rows if r.mode == "naive"}
    for r in rows:
        if (r.mib, r.subscribers) in naive and naive[r.mib, r.subscribers].to_all_ms > 0:
            r.to_all_vs_naive = r.to_all_ms / naive[r.mib, r.subscribers].to_all_ms
    return Report(when=time.strftime("%Y-%m-%d %H:%M:%S"), torch=str(torch.__version__), cores=os.cpu_count() or 0,
                  step_ms=step_ms, packed_bytes=packed_bytes, reps=reps, ceiling=ceiling, rows=rows,
                  targets=check_targets(rows, transport), transport=transport, streams=streams,
                  link_mbit=link_mbit, pipeline=pipeline, bucket_mib=bucket_mib, cpu=cpu_name(),
                  glibc_tunables=tunables)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.push_vs_broadcast", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,256,512", help="MiB, comma-separated (CPU: up to 2048)")
    parser.add_argument("--subscribers", default="1,2,4", help="generator processes, comma-separated")
    parser.add_argument("--reps", type=int, default=3, help="measured pushes per point (plus one warm-up)")
    parser.add_argument("--step-ms", type=float, default=300.0, help="synthetic training step for ws_nocopy")
    parser.add_argument("--packed-mib", type=int, default=1024, help="the packed baseline's buffer size")
    parser.add_argument("--transport", default="auto", choices=("auto", "group", "shm"),
                        help="the generators' transport (auto: shared memory, they run on this host)")
    parser.add_argument("--streams", type=int, default=2,
                        help="the publisher's gloo connections per pair (Publisher(streams=); 1 before 2026-12-03)")
    parser.add_argument("--link-mbit", type=float, default=None,
                        help="run every generator on an emulated host of its own (network namespace, needs root) "
                             "behind a link shaped to this many Mbit/s; implies --transport group")
    parser.add_argument("--pipeline", choices=("auto", "on", "off"), default="auto",
                        help="send the snapshot while it is taken (Publisher(pipeline=); auto: on from 4 CPUs)")
    parser.add_argument("--bucket-mib", type=int, default=64,
                        help="weightsync's bucket size (Publisher(bucket_bytes=))")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
        subscribers = [int(s) for s in args.subscribers.split(",")]
    except ValueError:
        parser.error("--sizes and --subscribers take comma-separated integers")
    if min(sizes) < 1 or min(subscribers) < 1 or args.reps < 1 or args.bucket_mib < 1:
        parser.error("sizes, subscribers, reps and --bucket-mib must be >= 1")
    # both sets of receivers live at once: per process about 4 copies of the state dict (the model,
    # two slots or snapshots, a spill) and the packed baseline's two buffers
    size_gib, packed_gib = max(sizes) / 1024, min(max(sizes), args.packed_mib) / 1024
    need = (4 * size_gib + 2 * packed_gib) * (1 + max(subscribers))
    print(f"bench: sizes {sizes} MiB x subscribers {subscribers}, {args.reps} reps "
          f"(peak memory about {need:.1f} GiB)", flush=True)
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    if need > available:
        print(f"  warning: {available:.1f} GiB of memory is free; fewer --subscribers or smaller --sizes "
              "(or a smaller --packed-mib) would fit", flush=True)
    import uvloop

    if args.link_mbit is not None:
        if args.link_mbit <= 0:
            parser.error("--link-mbit must be > 0")
        reason = netns.unavailable()
        if reason is not None:
            parser.error(f"--link-mbit needs network namespaces: {reason}")
        args.transport = "group"  # namespaces share the kernel: shared memory would bypass the links
    report = uvloop.run(bench(sizes, subscribers, args.reps, args.step_ms, args.packed_mib << 20, args.transport,
                              args.streams, args.link_mbit,
                              None if args.pipeline == "auto" else args.pipeline == "on", args.bucket_mib))
    json_path = write_json(args.out, "bench", report)
    plot(report, Path(args.out) / "bench.png")
    print()
    print(table(report.rows, report.ceiling, report.link_mbit))
    print()
    status = verdict(report.targets)
    print(f"\nwrote {json_path} and {Path(args.out) / 'bench.png'}")
    return status

if __name__ == "__main__":
    raise SystemExit(main())
