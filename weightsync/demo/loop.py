"""What the demo and the repository's RL examples share: the rollout queue back to the trainer, generator processes,
progress lines, the run directory with its plot, JSON and flight-recorder dumps.

Weights go trainer -> generators over weightsync. Rollouts are small and go the other way as
msgspec messages on a queue of a torch ``TCPStore`` the trainer hosts for them (generators
connect with ``ws.connect_store``); nothing crosses a process boundary as pickle.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import datetime
import os
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import torch
import torch.distributed as dist

import weightsync as ws
from weightsync.recorder.recorder import process_recorder

# torch's typed store errors: an empty queue (a subclass of DistStoreError, the store's timeout)
_QUEUE_EMPTY: Any = getattr(dist, "QueueEmptyError", ())


class RolloutQueue:
    """A msgspec queue on the rollout store; one connection per process side.

    The trainer hosts the store (:meth:`host`); generators connect to its address. Every wait is
    a bounded blocking pop; a pop that wakes on an empty queue (seen on torch 2.13 under churn)
    is retried as a spurious wake-up.
    """

    def __init__(self, address: str, key: str, timeout: float = 30.0, store: object | None = None) -> None:
        self.address, self.key = address, key
        self.stop_key = f"{key}/stop"
        self.credit_key = f"{key}/credits"
        self.store: Any = store if store is not None else ws.connect_store(address, timeout)

    @classmethod
    def host(cls, key: str, timeout: float = 30.0) -> RolloutQueue:
        """The trainer's side: a store of its own on a free loopback port."""
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout))
        return cls(f"127.0.0.1:{store.port}", key, timeout, store=store)

    def push(self, batch: msgspec.Struct) -> None:
        self.store.queue_push(self.key, msgspec.msgpack.encode(batch))

    def pop(self, timeout: float) -> bytes:
        """The next batch; TimeoutError when none comes within ``timeout`` seconds."""
        return self._pop(self.key, timeout)

    def _pop(self, key: str, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"nothing on {key} within {timeout:.3g}s")
            self.store.set_timeout(datetime.timedelta(seconds=left))
            try:
                return bytes(self.store.queue_pop(key, True))
            except _QUEUE_EMPTY:
                continue  # a spurious wake-up
            except dist.DistStoreError as err:  # the store's own timeout type
                raise TimeoutError(str(err)) from None

    # credits bound the backlog: a generator samples a batch only with a credit, and the trainer
    # grants one per batch it consumed, so batches are never more than a few versions stale
    def grant(self, n: int = 1) -> None:
        for _ in range(n):
            self.store.queue_push(self.credit_key, b"1")

    def take_credit(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for a credit; False when none came."""
        try:
            self._pop(self.credit_key, timeout)
        except TimeoutError:
            return False
        return True

    def request_stop(self) -> None:
        self.store.set(self.stop_key, b"1")

    def stopping(self) -> bool:
        return bool(self.store.check([self.stop_key]))


T = TypeVar("T")


def member_rng(member: str) -> torch.Generator:
    """A generator's random stream: reproducible per member name."""
    return torch.Generator().manual_seed(zlib.crc32(member.encode()))


async def generate(args: argparse.Namespace, channel: str, queue_key: str,
                   load: Callable[[ws.Subscriber], Awaitable[int]], sample: Callable[[int], msgspec.Struct]) -> int:
    """A generator process: join, then sample with the newest policy it has, one batch per credit.

    ``load(sub)`` loads the newest version into the generator's model and returns it;
    ``sample(version)`` makes a batch tagged with that version.
    """
    torch.set_num_threads(1)
    queue = RolloutQueue(args.rollouts, queue_key)
    loop = asyncio.get_running_loop()
    async with ws.Subscriber(channel, address=args.address, member_id=args.member, timeout=30) as sub:
        version = await load(sub)  # the first policy (waits for it)
        print(f"[{args.member}] joined with policy version {version}", flush=True)
        sampled = 0
        while not queue.stopping():
            if not await loop.run_in_executor(None, queue.take_credit, 1.0):
                continue  # no credit yet: the trainer is behind; check the stop flag and wait again
            if sub.evicted:  # dropped (too slow, say): join again and carry on with the newest version
                print(f"[{args.member}] evicted; rejoining", flush=True)
                await sub.rejoin(timeout=120)
                version = await load(sub)
            elif sub.version is not None and sub.version > version:  # the newest we have: never wait
                version = await load(sub)
            queue.push(sample(version))
            sampled += 1
            await asyncio.sleep(0)  # let the subscriber's completions run between batches
        print(f"[{args.member}] sampled {sampled} batches, last policy version {version}", flush=True)
    dump_recorder(Path(args.out), reason="generator finished")
    return 0


async def next_batch(queue: RolloutQueue, kind: type[T], timeout: float = 60.0) -> T:
    """The trainer's next batch (whichever generator sent it); grants one more credit."""
    raw = await asyncio.get_running_loop().run_in_executor(None, queue.pop, timeout)
    queue.grant()  # one batch consumed: one more may be sampled
    return msgspec.msgpack.decode(raw, type=kind)


def example_parser(prog: str, doc: str, steps: int, log_every: int) -> argparse.ArgumentParser:
    """The options both RL examples share; the generator role is internal."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0])
    parser.add_argument("role", nargs="?", default="trainer", choices=("trainer", "generator"))
    parser.add_argument("--steps", type=int, default=steps, help="optimizer steps (one batch each)")
    parser.add_argument("--generators", type=int, default=3)
    parser.add_argument("--log-every", type=int, default=log_every)
    parser.add_argument("--no-check", action="store_true", help="exit 0 even if the policy did not improve")
    parser.add_argument("--out", default=None, help="run directory (default runs/<example>-<time>)")
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--member", help=argparse.SUPPRESS)
    parser.add_argument("--rollouts", help=argparse.SUPPRESS)
    return parser


class Generators:
    """Generator processes the trainer started (``python -m MODULE generator ...``)."""

    def __init__(self, module: str, out: Path, rollouts: str) -> None:
        self.module, self.out, self.rollouts = module, out, rollouts
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def argv(self, address: str, member: str, extra: Sequence[str] = ()) -> list[str]:
        return [sys.executable, "-m", self.module, "generator", "--address", address, "--member", member,
                "--rollouts", self.rollouts, "--out", str(self.out), *extra]

    def env(self) -> dict[str, str]:
        return dict(os.environ, WEIGHTSYNC_FR_DIR=str(self.out / "flight-recorder"))

    def start(self, address: str, member: str, extra: Sequence[str] = ()) -> subprocess.Popen[bytes]:
        log = open(self.out / f"{member}.log", "ab")  # noqa: SIM115 - the child owns it
        proc = subprocess.Popen(self.argv(address, member, extra), env=self.env(), cwd=os.getcwd(), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.procs[member] = proc
        return proc

    def kill(self, member: str) -> None:
        proc = self.procs[member]
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    async def finish(self, timeout: float) -> list[str]:
        """Wait for every generator to exit (they stop on the stop flag); kill stragglers."""
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in self.procs.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)  # polling child exit status, bounded by the deadline
        killed = []
        for member, proc in self.procs.items():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
                killed.append(member)
        return killed


def run_dir(name: str, out: str | None) -> Path:
    path = Path(out) if out else Path.cwd() / "runs" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    (path / "flight-recorder").mkdir(parents=True, exist_ok=True)
    return path


def dump_recorder(out: Path, reason: str) -> Path:
    """This process's flight recorder, dumped into the run directory."""
    recorder = process_recorder()
    recorder.configure(directory=out / "flight-recorder")
    return recorder.dump(reason=reason)


def analyze_summary(fr_dir: Path) -> str:
    """One line from ``weightsync fr analyze`` over the run's dumps."""
    from weightsync.recorder.analyze import analyze, load_dir

    try:
        dumps = load_dir(fr_dir)
    except (ValueError, OSError) as err:
        return f"flight recorder: {err}"
    analysis = analyze(dumps, names=[f"{d.label}-{d.pid}" for d in dumps])
    deaths = f", {len(analysis.deaths)} death(s) seen" if analysis.deaths else ""
    verdict = "no stall or failure found" if analysis.ok else f"{len(analysis.culprits)} culprit(s) named{deaths}"
    return f"flight recorder: {len(dumps)} dumps, {verdict} (weightsync fr analyze {fr_dir})"


def final_delivery(report: ws.DeliveryReport, generators: int) -> str:
    """One line on the last version put. A run stops its generators only once that version has
    reached them: a generator that left while it was on the wire failed it, so it was re-sent to
    the others and the flight recorder named the leaver as the culprit of a healthy run."""
    reached = ", ".join(sorted(report.members)) or "none"
    return (f"final policy: version {report.version} reached {len(report.members)} of {generators} generators "
            f"({reached})")


def can_plot() -> bool:
    """matplotlib is an extra (``pip install weightsync[plot]``); without it, say so and go on."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        print("matplotlib is not installed: no plot this time (pip install 'weightsync[plot]')")
        return False
    return True


def tensor_bytes(t: torch.Tensor) -> bytes:
    """A tensor's bytes without numpy (not a dependency of weightsync, nor of torch)."""
    flat = t.detach().contiguous().cpu()
    return ctypes.string_at(flat.data_ptr(), flat.numel() * flat.element_size()) if flat.numel() else b""


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0
