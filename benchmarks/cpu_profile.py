"""Where the CPU goes: every thread's CPU time per version, the naive loop and weightsync side by side.

    python -m benchmarks.cpu_profile [--mib 512] [--subscribers 2] [--versions 4] [--out benchmarks/results]
    python -m benchmarks.cpu_profile --modes ws_assign --bucket-mib 16   # weightsync's buckets of 16 MiB

On a machine where the trainer and its generators share a few cores (this project's 2-core
development machine), time to all is bounded by the CPU every process spends, not by the
wire. This pushes the same LLM-shaped state dict to ``--subscribers`` generator processes over
the group (gloo, loopback), three ways:

- ``naive``     a blocking per-tensor ``broadcast`` loop into the generators' model tensors;
- ``ws_copy``   ``await pub.put(sd)``, generators waiting in ``get_into(model, as_received=True)``;
- ``ws_assign`` ``ws_copy`` with each generator's model a torch module whose parameters become
                the version's views in the subscriber's slot (``load_state_dict(assign=True)``
                inside a held ``stream()`` block): no copy into the model;
- ``ws_nocrc``  the same as ``ws_copy`` with checksums off.

For each, after two warm-up pushes, it reads every thread's CPU time (``/proc/<pid>/task``,
user + system) of the trainer and of each generator around ``--versions`` pushes, and prints
CPU milliseconds per version by process and thread, the time to all (median, ending in the
generators' model tensors, as in ``benchmarks.push_vs_broadcast``), and how many cores that
CPU kept busy. Python threads are given their names at the OS level here, so a weightsync
thread (``ws-p-snapshot_0``, ``ws-p-receiver``...) is told apart from gloo's
(``gloo_tcp_loop``); OpenMP workers a thread starts inherit its name, so a parallel copy counts
for the thread that asked for it. Writes ``cpu_profile.json`` and ``cpu_profile.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import datetime as dt
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist

from benchmarks import report

MODES = ("naive", "ws_copy", "ws_assign", "ws_nocrc")
WARMUP = 2
CHANNEL = "p"  # short: the OS keeps 15 characters of a thread's name


def name_os_threads() -> None:
    """Give every Python thread started from now on its name at the OS level (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return
    start = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]

    def named(self: threading.Thread) -> None:
        libc.prctl(15, self.name[:15].encode(), 0, 0, 0)  # PR_SET_NAME
        start(self)

    threading.Thread._bootstrap_inner = named  # type: ignore[attr-defined]


def thread_cpu(pid: int) -> dict[int, tuple[str, int]]:
    """Thread id -> (name, user + system CPU in clock ticks) for every thread of ``pid``."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        out[int(task.name)] = (name, int(fields[11]) + int(fields[12]))
    return out


def spent(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]]) -> dict[str, float]:
    """CPU seconds per thread name between two readings (threads started in between count whole;
    every thread alive at the second reading is named, idle ones with 0)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid, (name, ticks) in after.items():
        name = name.rstrip("_0123456789") or name  # pool threads: one entry per pool
        out[name] = out.get(name, 0.0) + (ticks - before.get(tid, (name, 0))[1]) / tick
    return out


class Spec(msgspec.Struct):
    mode: str
    rank: int
    world: int
    mib: int
    pushes: int
    host: str
    port: int
    address: str = ""


class Profile(msgspec.Struct):
    mode: str
    mib: float
    subscribers: int
    versions: int
    to_all_ms: float
    wall_ms: float  # per version, between the two readings
    cpu_ms: dict[str, dict[str, float]]  # process -> thread name -> CPU ms per version
    total_cpu_ms: float
    cores_busy: float
    bucket_mib: int = 64  # weightsync's Publisher(bucket_bytes=)


class Report(msgspec.Struct):
    when: str
    cpu: str
    cores: int
    torch: str
    profiles: list[Profile]


# generators -----------------------------------------------------------------------------------
def generator(spec: Spec) -> None:
    """One generator: receive ``spec.pushes`` versions into its model tensors, set a key per version,
    then wait until the trainer read this process's threads and says to go."""
    from weightsync.bench.model import make_state_dict

    store = dist.TCPStore(spec.host, spec.port, is_master=False, timeout=dt.timedelta(seconds=300))
    model = make_state_dict(spec.mib)
    if spec.mode == "naive":
        from benchmarks.baseline import group

        pg = group(store, spec.rank, spec.world, None)
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        for version in range(spec.pushes):
            for t in model.values():
                pg.broadcast([t], opts).wait()
            store.set(f"done/{version}/{spec.rank}", b"1")
    else:
        import weightsync as ws
        from benchmarks.workers import SlotServed
        from weightsync.bench.model import make_module

        async def follow() -> None:
            async with ws.Subscriber(CHANNEL, address=spec.address, member_id=f"gen{spec.rank}", timeout=120,
                                     transport="group") as sub:
                served = SlotServed(make_module(model))
                for version in range(spec.pushes):
                    if spec.mode == "ws_assign":
                        await served.next(sub, version)
                    else:
                        await sub.get_into(model, min_version=version, timeout=600, as_received=True)
                    store.set(f"done/{version}/{spec.rank}", b"1")
                await served.release(own=model)
                await asyncio.to_thread(store.wait, ["quit"], dt.timedelta(seconds=600))

        asyncio.run(follow())
    store.wait(["quit"], dt.timedelta(seconds=600))


# trainer --------------------------------------------------------------------------------------
async def profile(mode: str, mib: int, n: int, versions: int, bucket_mib: int = 64) -> Profile:
    import weightsync as ws
    from benchmarks.baseline import group
    from weightsync.bench.model import make_state_dict, nbytes

    sd = make_state_dict(mib)
    pushes = WARMUP + versions
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=300))
    procs: list[subprocess.Popen[bytes]] = []
    pub: ws.Publisher | None = None
    try:
        if mode != "naive":
            pub = ws.Publisher(CHANNEL, address="127.0.0.1:0", timeout=120, encoding="full",
                               checksum=mode != "ws_nocrc", bucket_bytes=bucket_mib << 20)
            await pub.start()
        for rank in range(1, n + 1):
            spec = Spec(mode=mode, rank=rank, world=n + 1, mib=mib, pushes=pushes, host="127.0.0.1", port=store.port,
                        address=pub.address if pub is not None else "")
            procs.append(subprocess.Popen([sys.executable, "-m", "benchmarks.cpu_profile", "--generator",
                                           msgspec.json.encode(spec).decode()],
                                          env=dict(os.environ, TORCH_CPP_LOG_LEVEL="ERROR")))
        pg = None
        if pub is not None:
            await pub.wait_subscribers(n, timeout=300)
        else:
            pg = await asyncio.to_thread(group, store, 0, n + 1, None)
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor = 0, 0
        pids = {"trainer": os.getpid(), **{f"generator {rank}": p.pid for rank, p in enumerate(procs, 1)}}
        to_all: list[float] = []
        before: dict[str, dict[int, tuple[str, int]]] = {}
        t_measured = 0.0
        for version in range(pushes):
            if version == WARMUP:
                before = {who: thread_cpu(pid) for who, pid in pids.items()}
                t_measured = time.perf_counter()
            t0 = time.perf_counter()
            handle = None
            if pub is not None:
                handle = await pub.put(sd, version=version)
            else:
                for t in sd.values():
                    pg.broadcast([t], opts).wait()
            keys = [f"done/{version}/{rank}" for rank in range(1, n + 1)]
            await asyncio.to_thread(store.wait, keys, dt.timedelta(seconds=600))
            to_all.append(time.perf_counter() - t0)
            if handle is not None:
                await handle.delivered(timeout=600)
        wall = time.perf_counter() - t_measured
        after = {who: thread_cpu(pid) for who, pid in pids.items()}
        store.set("quit", b"1")
        for proc in procs:
            proc.wait(timeout=120)
            if proc.returncode:
                raise RuntimeError(f"a generator exited {proc.returncode}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        if pub is not None:
            await pub.aclose()
    cpu = {who: {name: s * 1e3 / versions for name, s in sorted(spent(before[who], after[who]).items(),
                                                                    key=lambda kv: -kv[1])} for who in pids}
    total = sum(sum(v.values()) for v in cpu.values())
    return Profile(mode=mode, mib=nbytes(sd) / 2**20, subscribers=n, versions=versions,
                   to_all_ms=statistics.median(to_all[WARMUP:]) * 1e3, wall_ms=wall / versions * 1e3,
                   cpu_ms=cpu, total_cpu_ms=total, cores_busy=total / (wall / versions * 1e3), bucket_mib=bucket_mib)


def show(profiles: list[Profile]) -> None:
    naive = next((p for p in profiles if p.mode == "naive"), None)
    for p in profiles:
        # a toy run's naive loop can read 0 ms: the kernel counts CPU time in ticks (10 ms here)
        ratio = f"  ({p.total_cpu_ms / naive.total_cpu_ms:.2f}x naive's CPU)" \
            if naive and p is not naive and naive.total_cpu_ms > 0 else ""
        print(f"{p.mode}: to all {p.to_all_ms:.0f} ms; CPU {p.total_cpu_ms:.0f} ms per version over "
              f"{p.wall_ms:.0f} ms ({p.cores_busy:.2f} cores busy){ratio}")
        for who, threads in p.cpu_ms.items():
            parts = ", ".join(f"{name} {ms:.0f}" for name, ms in threads.items() if ms >= 0.5)
            print(f"    {who:<12} {sum(threads.values()):6.0f} ms: {parts}")


def draw(out: str, profiles: list[Profile], json_path: Path) -> None:
    plt = report.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(9, 3.8))
    names = sorted({(who, name) for p in profiles for who, t in p.cpu_ms.items() for name in t})
    labels = [f"{p.mode}\n{p.to_all_ms:.0f} ms to all" for p in profiles]
    left = [0.0] * len(profiles)
    colors = plt.get_cmap("tab20")
    for k, (who, name) in enumerate(names):
        widths = [p.cpu_ms.get(who, {}).get(name, 0.0) for p in profiles]
        if not any(w >= 1 for w in widths):
            continue
        ax.barh(labels, widths, left=left, color=colors(k % 20), label=f"{who}: {name}")
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.set_xlabel("CPU ms per version (every thread of every process)")
    ax.invert_yaxis()
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    p0 = profiles[0]
    ax.set_title(f"{p0.mib:.0f} MiB to {p0.subscribers} generators over gloo, {os.cpu_count()} cores")
    report.save(fig, out, "cpu_profile", json_path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cpu_profile", description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="nominal state-dict size")
    parser.add_argument("--subscribers", type=int, default=2, help="generator processes")
    parser.add_argument("--versions", type=int, default=4, help="pushes read (after two warm-ups)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {','.join(MODES)}")
    parser.add_argument("--bucket-mib", type=int, default=64, help="weightsync's Publisher(bucket_bytes=) in MiB")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--generator", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    name_os_threads()
    if args.generator:
        generator(msgspec.json.decode(args.generator, type=Spec))
        return 0
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown or min(args.versions, args.subscribers, args.mib, args.bucket_mib) < 1:
        parser.error(f"unknown modes {unknown}" if unknown
                     else "--mib, --subscribers, --versions and --bucket-mib must be >= 1")
    profiles = []
    for mode in modes:
        print(f"  {mode}: {args.mib} MiB x {args.subscribers}, {WARMUP} warm-up + {args.versions} versions ...",
              flush=True)
        profiles.append(asyncio.run(profile(mode, args.mib, args.subscribers, args.versions, args.bucket_mib)))
    cpu = report.cpu_name()
    print(f"\n{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, weightsync's buckets {args.bucket_mib} MiB; "
          "CPU ms per version:")
    show(profiles)
    data = Report(when=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), cpu=cpu,
                  cores=os.cpu_count() or 1, torch=str(torch.__version__), profiles=profiles)
    json_path = report.write_json(args.out, "cpu_profile", msgspec.to_builtins(data))
    draw(args.out, profiles, json_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
