"""``weightsync bench``: weightsync against the blocking broadcasts RL loops use today, side by side
in one run, on this host or across the user's own hosts.

    weightsync bench [--sizes 64,256] [--subscribers 1,2] [--reps 3]    # this host: launches torchrun itself
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST0:29400 \\
        -m weightsync.bench.run --sizes 256,1024 --subscribers 1,3,7    # every host runs the same line

Rank 0 is the trainer, every other rank a generator. Modes, each pushing the same LLM-shaped
state dict (seeded: every generator checks it bit for bit):

- ``naive``      a blocking per-tensor ``broadcast`` loop;
- ``packed``     a blocking broadcast of packed buckets in two flat buffers (vLLM's way),
                 packing one while the other is on the wire;
- ``put``        ``await pub.put(sd)``: returns after the snapshot, the transfer runs behind;
- ``put_nocopy`` ``await pub.put(sd, copy=False)`` overlapped with a synthetic training step of
                 ``--step-ms``, then ``await handle.released(spill=True)`` (what is not sent
                 by then is copied, so the optimizer step need not wait for the wire).

Per mode: the trainer's stall, the time until every generator has the version in its own model
tensors (checked bit for bit, for every contender), GB/s, and the
ratios to ``packed``. NCCL on GPUs (each rank takes ``cuda:LOCAL_RANK``), gloo on CPUs. Rank 0
prints a table and a one-line verdict and writes ``bench.json`` and, with matplotlib,
``bench.png`` under ``--out`` (default ``./weightsync-bench``). Exit 1 when a version arrived
altered or a rank failed.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import secrets
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import crc32c
import msgspec
import torch
import torch.distributed as dist

import weightsync as ws
from weightsync.bench.model import make_state_dict, nbytes, packed_chunks
from weightsync.format.checksum import _host_view

MODES = ("naive", "packed", "put", "put_nocopy")
WS_MODES = ("put", "put_nocopy")
SEED = 1234
TIMEOUT = dt.timedelta(seconds=600)
_MAX_HOST = 256  # bytes of a host name or address carried in a tensor


class Row(msgspec.Struct):
    mode: str
    mib: float
    subscribers: int
    stall_ms: float
    to_all_ms: float
    gbps: float
    exact: bool
    stall_vs_packed: float = 0.0
    to_all_vs_packed: float = 0.0


class Report(msgspec.Struct):
    when: str
    torch: str
    weightsync: str
    backend: str
    device: str
    world_size: int
    hosts: list[str]
    cores: int
    reps: int
    step_ms: float
    packed_mib: int
    rows: list[Row]
    verdict: str
    ok: bool


# helpers over the control group (gloo, CPU tensors: no pickle) -----------------------------------
def _text_tensor(text: str) -> torch.Tensor:
    """``text`` (at most 256 bytes of it) in a zero-padded uint8 tensor."""
    buf = torch.zeros(_MAX_HOST, dtype=torch.uint8)
    raw = text.encode()[:_MAX_HOST]
    if raw:
        buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return buf


def _text_of(buf: torch.Tensor) -> str:
    return bytes(buf.tolist()).rstrip(b"\0").decode()


def _bcast_text(text: str, group: Any) -> str:
    buf = _text_tensor(text)
    dist.broadcast(buf, src=0, group=group)
    return _text_of(buf)


def _gather_text(text: str, group: Any, world: int) -> list[str]:
    buf = _text_tensor(text)
    out = [torch.zeros_like(buf) for _ in range(world)]
    dist.all_gather(out, buf, group=group)
    return [_text_of(b) for b in out]


def _digest(sd: dict[str, torch.Tensor]) -> int:
    """CRC32C over every tensor's bytes, in order (on the host: a GPU tensor is copied once)."""
    crc = 0
    for t in sd.values():
        host = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
        crc = crc32c.crc32c(_host_view(host), crc) if host.numel() else crc
    return crc


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# the blocking baselines ------------------------------------------------------------------------------
class Baseline:
    """One rank's side of the two blocking broadcasts, over ``group`` (ranks 0..n)."""

    def __init__(self, group: Any, rank: int, device: torch.device, packed_bytes: int) -> None:
        self.group, self.rank, self.device, self.packed_bytes = group, rank, device, packed_bytes
        self._bufs: list[torch.Tensor] = []

    def _buffers(self, total: int) -> list[torch.Tensor]:
        size = min(self.packed_bytes, total)
        if not self._bufs or self._bufs[0].numel() < size:
            self._bufs = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(2)]
        return self._bufs

    def push(self, sd: dict[str, torch.Tensor], mode: str) -> None:
        """Rank 0: blocking, exactly what users do today. Others: receive into ``sd``."""
        if mode == "naive":
            for t in sd.values():
                dist.broadcast(t, src=0, group=self.group)
            _sync(self.device)
            return
        bufs = self._buffers(nbytes(sd))
        work = None
        for i, chunk in enumerate(packed_chunks(sd, bufs[0].numel())):
            buf = bufs[i % 2][: chunk.nbytes]
            if self.rank == 0:
                chunk.pack(buf)  # packing bucket i overlaps bucket i-1 on the wire
                if work is not None:
                    work.wait()
                work = dist.broadcast(buf, src=0, group=self.group, async_op=True)
            else:
                dist.broadcast(buf, src=0, group=self.group)
                chunk.unpack(buf)
        if work is not None:
            work.wait()
        _sync(self.device)


def run_baselines(rank: int, n: int, sizes: list[int], reps: int, device: torch.device, packed_bytes: int,
                  group: Any, progress: Any) -> list[Row]:
    rows = []
    base = Baseline(group, rank, device, packed_bytes)
    for mib in sizes:
        truth = make_state_dict(mib, seed=SEED)
        expected = _digest(truth)
        sd = {k: (v.to(device) if rank == 0 else torch.empty_like(v, device=device)) for k, v in truth.items()}
        del truth
        for mode in ("naive", "packed"):
            stalls, to_all = [], []
            exact = True
            for rep in range(reps + 1):  # rep 0 warms up
                if rank:
                    for t in sd.values():
                        t.zero_()  # what arrives must be the broadcast, not what was there
                dist.barrier(group=group)
                t0 = time.perf_counter()
                base.push(sd, mode)
                stall = time.perf_counter() - t0
                if rank:
                    exact = exact and _digest(sd) == expected
                dist.barrier(group=group)  # every generator has unpacked it
                if rep:
                    stalls.append(stall)
                    to_all.append(time.perf_counter() - t0)
            flags = torch.tensor([int(exact)], dtype=torch.int64)
            dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
            if rank == 0:
                rows.append(_row(mode, nbytes(sd), n, stalls, to_all, bool(flags.item())))
                progress(rows[-1])
        del sd
    return rows


# weightsync -----------------------------------------------------------------------------------------
async def trainer_weightsync(n: int, sizes: list[int], reps: int, step_ms: float, device: torch.device,
                             ctrl: Any, listen: str, progress: Any, group: Any) -> list[Row]:
    """Rank 0: a Publisher (its address and a fresh secret go to the generators over ``ctrl``).
    A version's time to all ends, as the baselines' does, at the barrier (``group``: this round's
    ranks) every generator enters once the bytes are in its own model tensors and checked."""
    token = secrets.token_hex(16)
    channel = f"bench-{n}"
    rows = []
    async with ws.Publisher(channel, address=listen, secret=token,
                            device=device if device.type == "cuda" else None, timeout=120,
                            bucket_bytes=64 << 20, encoding="full") as pub:  # the transport, not a delta
        _bcast_text(f"{channel} {pub.address} {token}", ctrl)
        await pub.wait_subscribers(n, timeout=300)
        version = 0
        for mib in sizes:
            sd = {k: v.to(device) for k, v in make_state_dict(mib, seed=SEED).items()}
            for mode in WS_MODES:
                stalls, to_all = [], []
                for rep in range(reps + 1):  # rep 0 warms up
                    await asyncio.to_thread(dist.barrier, group=group)  # the generators cleared their models
                    t0 = time.perf_counter()
                    handle = await pub.put(sd, version=version, copy=mode == "put")
                    stall = time.perf_counter() - t0
                    # ends once every generator has it in its model, checked (gloo: beside a NCCL transfer)
                    in_models = asyncio.ensure_future(asyncio.to_thread(_barrier_at, group))
                    if mode == "put_nocopy":
                        await asyncio.sleep(step_ms / 1e3)  # forward + backward, on the accelerator
                        t1 = time.perf_counter()
                        await handle.released(timeout=600, spill=True)  # optimizer.step() may now run
                        stall += time.perf_counter() - t1
                    report = await handle.delivered(timeout=600)
                    if report.superseded or len(report.members) != n:
                        raise RuntimeError(f"version {version} reached {list(report.members)} only")
                    done = await in_models - t0
                    version += 1
                    if rep:
                        stalls.append(stall)
                        to_all.append(done)
                rows.append(_row(mode, nbytes(sd), n, stalls, to_all, True))
                progress(rows[-1])
            del sd
    return rows


async def generator_weightsync(rank: int, member: bool, sizes: list[int], reps: int, device: torch.device,
                               ctrl: Any, transport: str = "auto", group: Any = None) -> list[bool]:
    """Ranks 1..n: a Subscriber writing every version into this generator's own model tensors as it
    arrives (``get_into(as_received=True)``, as the baselines broadcast or unpack into theirs),
    checking it bit for bit, then
    entering ``group``'s barrier: where the trainer's time to all ends."""
    channel, address, token = _bcast_text("", ctrl).split()
    if not member:  # a rank beyond this round's subscriber count
        return []
    exact: list[bool] = []
    async with ws.Subscriber(channel, address=address, secret=token, member_id=f"rank{rank}", timeout=120,
                             device=device if device.type == "cuda" else None, transport=transport) as sub:
        version = 0
        for mib in sizes:
            truth = make_state_dict(mib, seed=SEED)
            expected = _digest(truth)
            model = {k: torch.empty_like(v, device=device) for k, v in truth.items()}  # the generator's own
            del truth
            for _mode in WS_MODES:
                ok = True
                for _rep in range(reps + 1):
                    for t in model.values():
                        t.zero_()  # what is there must be this version, not the last one
                    await asyncio.to_thread(dist.barrier, group=group)  # as the baselines: cleared before the clock
                    got = await sub.get_into(model, min_version=version, timeout=600, as_received=True)
                    ok = ok and got == version and _digest(model) == expected
                    await asyncio.to_thread(dist.barrier, group=group)
                    version += 1
                exact.append(ok)
    return exact


def _barrier_at(group: Any) -> float:
    """When ``group``'s barrier let this rank through."""
    dist.barrier(group=group)
    return time.perf_counter()


def _row(mode: str, size: int, n: int, stalls: list[float], to_all: list[float], exact: bool) -> Row:
    done = statistics.median(to_all)
    return Row(mode=mode, mib=size / 2**20, subscribers=n, stall_ms=statistics.median(stalls) * 1e3,
               to_all_ms=done * 1e3, gbps=size * n / done / 1e9, exact=exact)


# the report --------------------------------------------------------------------------------------
def add_ratios(rows: list[Any]) -> None:
    """``stall_vs_packed`` and ``to_all_vs_packed`` of every row, against ``packed`` at its size and count."""
    packed = {(r.mib, r.subscribers): r for r in rows if r.mode == "packed"}
    for r in rows:
        base = packed.get((r.mib, r.subscribers))
        if base is not None and base.stall_ms > 0 and base.to_all_ms > 0:
            r.stall_vs_packed = r.stall_ms / base.stall_ms
            r.to_all_vs_packed = r.to_all_ms / base.to_all_ms


def table(rows: list[Row]) -> str:
    head = (f"{'MiB':>7} {'gens':>4} {'mode':<11} {'stall ms':>9} {'to-all ms':>10} {'GB/s':>6} "
            f"{'stall/pk':>8} {'all/pk':>7} {'exact':>5}")
    lines = [head, "-" * len(head)]
    for r in sorted(rows, key=lambda r: (r.subscribers, r.mib, MODES.index(r.mode))):
        lines.append(f"{r.mib:7.1f} {r.subscribers:4d} {r.mode:<11} {r.stall_ms:9.1f} {r.to_all_ms:10.1f} "
                     f"{r.gbps:6.2f} {r.stall_vs_packed:8.3f} {r.to_all_vs_packed:7.3f} "
                     f"{'yes' if r.exact else 'NO':>5}")
    return "\n".join(lines)


def verdict(rows: list[Row]) -> tuple[str, bool]:
    """One line: at the largest size and subscriber count, what put saves against packed."""
    exact = all(r.exact for r in rows)
    size, n = max(r.mib for r in rows), max(r.subscribers for r in rows)
    pick = {r.mode: r for r in rows if r.mib == size and r.subscribers == n}
    if not {"packed", "put", "put_nocopy"} <= set(pick):
        return "verdict: incomplete run", False
    put, nocopy = pick["put"], pick["put_nocopy"]
    line = (f"verdict: at {size:.0f} MiB to {n} generator{'s' if n > 1 else ''}, put stalls the trainer "
            f"{put.stall_vs_packed:.3f}x as long as the packed broadcast ({put.stall_ms:.0f} vs "
            f"{pick['packed'].stall_ms:.0f} ms; copy=False {nocopy.stall_vs_packed:.3f}x) and every generator has "
            f"the version in {put.to_all_vs_packed:.2f}x its time; "
            + ("every version arrived bit-exact" if exact else "SOME VERSIONS ARRIVED ALTERED"))
    return line, exact


def plot(report: Report, path: Path) -> bool:
    title = (f"weightsync vs blocking broadcast ({report.backend}, {report.device}, {len(set(report.hosts))} "
             f"node(s), torch {report.torch})")
    return draw(report.rows, MODES, title, path)


def draw(rows: list[Any], modes: tuple[str, ...], title: str, path: Path) -> bool:
    """Stall and time-to-all against size, one row of panels per generator count (any rows with
    ``mode, mib, subscribers, stall_ms, to_all_ms``); False, said, without matplotlib."""
    try:
        import matplotlib  # noqa: PLC0415 - an extra (weightsync[plot])

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'weightsync[plot]')")
        return False
    subs = sorted({r.subscribers for r in rows})
    fig, axes = plt.subplots(len(subs), 2, figsize=(11, 3.2 * len(subs)), squeeze=False)
    for i, n in enumerate(subs):
        for j, (field, label) in enumerate((("stall_ms", "trainer stall per push (ms)"),
                                            ("to_all_ms", "until every generator has it (ms)"))):
            ax = axes[i][j]
            for mode in modes:
                pts = sorted((r.mib, getattr(r, field)) for r in rows if r.mode == mode and r.subscribers == n)
                if pts:
                    ax.plot([p[0] for p in pts], [max(p[1], 1e-3) for p in pts], marker="o", label=mode)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("state dict (MiB)")
            ax.set_ylabel(label)
            ax.set_title(f"{n} generator{'s' if n > 1 else ''}")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# the program -----------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="weightsync bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--sizes", default="64,256", help="state-dict sizes in MiB, comma-separated")
    p.add_argument("--subscribers", default=None,
                   help="generator counts, comma-separated (default: 1 and every other rank; on this host 1,2)")
    p.add_argument("--reps", type=int, default=5, help="measured pushes per point (plus one warm-up)")
    p.add_argument("--step-ms", type=float, default=300.0, help="the synthetic training step put_nocopy overlaps")
    p.add_argument("--packed-mib", type=int, default=1024, help="the packed baseline's buffer size (vLLM: 1 GiB)")
    p.add_argument("--cpu", action="store_true", help="gloo on CPUs even where GPUs are")
    p.add_argument("--transport", default="auto", choices=("auto", "group"),
                   help="the generators' transport (auto: the trainer's shared memory for ranks on its host)")
    p.add_argument("--out", default="weightsync-bench", help="where bench.json and bench.png go")
    return p


def _ints(text: str, what: str, p: argparse.ArgumentParser) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        p.error(f"--{what} takes comma-separated integers, got {text!r}")
    if not values or values[0] < 1:
        p.error(f"--{what} must be integers >= 1")
    return values


def launch_here(argv: list[str], args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    """Not under torchrun: run it on this host, one trainer and max(subscribers) generators."""
    subs = _ints(args.subscribers or "1,2", "subscribers", p)
    nproc = subs[-1] + 1
    if args.subscribers is None:
        argv = [*argv, "--subscribers", ",".join(map(str, subs))]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc-per-node", str(nproc), "-m", "weightsync.bench.run", *argv]
    print(f"launching {nproc} ranks on this host (1 trainer, {subs[-1]} generators): torchrun ... "
          f"-m weightsync.bench.run {' '.join(argv)}", flush=True)
    print("across hosts, run on every host: torchrun --nnodes H --nproc-per-node K --rdzv-backend c10d "
          "--rdzv-endpoint HOST0:29400 -m weightsync.bench.run ...", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.run(cmd, env=env, check=False).returncode


def spmd(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    """One rank of the run (torchrun set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world < 2:
        p.error("needs at least 2 ranks: a trainer and a generator")
    sizes = _ints(args.sizes, "sizes", p)
    subs = _ints(args.subscribers, "subscribers", p) if args.subscribers else sorted({1, world - 1})
    if subs[-1] > world - 1:
        p.error(f"--subscribers {subs[-1]} needs {subs[-1] + 1} ranks; this run has {world}")
    cuda = torch.cuda.is_available() and not args.cpu
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if cuda and torch.cuda.device_count() < local_world:
        p.error(f"NCCL takes one GPU per rank: this host runs {local_world} ranks and has "
                f"{torch.cuda.device_count()} GPU(s); start fewer ranks here, or pass --cpu for gloo")
    device = torch.device(f"cuda:{local_rank}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, timeout=TIMEOUT)
    ctrl: Any = dist.new_group(backend="gloo", timeout=TIMEOUT) if cuda else dist.group.WORLD
    node = os.environ.get("GROUP_RANK", "0")
    hosts = _gather_text(f"{socket.gethostname()} (node {node})", ctrl, world)
    # several nodes (torchrun agents): rank 0 listens where the others reached torchrun's own
    # rendezvous, the address every node already uses for it
    multi_node = local_world != world
    listen = f"{os.environ.get('MASTER_ADDR', '0.0.0.0')}:0" if multi_node else "127.0.0.1:0"
    rows: list[Row] = []
    total = len(sizes) * len(subs) * len(MODES)

    def progress(row: Row) -> None:
        rows.append(row)
        print(f"  [{len(rows):>2}/{total}] {row.mib:7.1f} MiB x {row.subscribers} {row.mode:<11} "
              f"stall {row.stall_ms:9.1f} ms   to all {row.to_all_ms:9.1f} ms", flush=True)

    if rank == 0:
        print(f"bench: {world} ranks on {len(set(hosts))} node(s), {backend} on {device.type}; sizes {sizes} MiB, "
              f"generators {subs}, {args.reps} reps", flush=True)
    failed = ""
    try:
        for n in subs:
            group: Any = dist.new_group(ranks=list(range(n + 1)), timeout=TIMEOUT)  # every rank takes part in making it
            # weightsync's rounds meet on gloo: a barrier waits beside the channel's own (NCCL) transfer
            marks: Any = group if not cuda else dist.new_group(ranks=list(range(n + 1)), backend="gloo",
                                                               timeout=TIMEOUT)
            if rank <= n:
                run_baselines(rank, n, sizes, args.reps, device, args.packed_mib << 20, group, progress)
            dist.barrier(group=ctrl)
            if rank == 0:
                asyncio.run(trainer_weightsync(n, sizes, args.reps, args.step_ms, device, ctrl, listen, progress,
                                               marks))
                exact = [True] * (len(sizes) * len(WS_MODES))
            else:
                exact = asyncio.run(generator_weightsync(rank, rank <= n, sizes, args.reps, device, ctrl,
                                                           args.transport, marks))
            flags = torch.tensor([int(all(exact))], dtype=torch.int64)
            dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=ctrl)
            if rank == 0 and not flags.item():
                for r in rows:
                    if r.subscribers == n and r.mode in WS_MODES:
                        r.exact = False  # some generator saw a version altered (which one: its own log)
    except Exception as err:  # noqa: BLE001 - one rank's failure is the run's: said, and the exit status
        failed = f"rank {rank}: {type(err).__name__}: {err}"
        print(failed, file=sys.stderr, flush=True)
    if rank != 0:
        dist.destroy_process_group()
        return 1 if failed else 0
    if failed or not rows:
        dist.destroy_process_group()
        return 1
    add_ratios(rows)
    line, ok = verdict(rows)
    report = Report(when=time.strftime("%Y-%m-%d %H:%M:%S"), torch=str(torch.__version__),
                    weightsync=ws.__version__, backend=backend, device=device.type, world_size=world, hosts=hosts,
                    cores=os.cpu_count() or 0, reps=args.reps, step_ms=args.step_ms, packed_mib=args.packed_mib,
                    rows=rows, verdict=line, ok=ok)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_bytes(msgspec.json.format(msgspec.json.encode(report)))
    drew = plot(report, out / "bench.png")
    print()
    print(table(rows))
    print()
    print(line)
    print(f"wrote {out / 'bench.json'}" + (f" and {out / 'bench.png'}" if drew else ""))
    dist.destroy_process_group()
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = parser()
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error("--reps must be >= 1")
    _ints(args.sizes, "sizes", p)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return launch_here(argv, args, p)
    return spmd(args, p)


if __name__ == "__main__":
    sys.exit(main())
