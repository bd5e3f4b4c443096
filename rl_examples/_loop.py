"""What both RL examples share: the rollout queue back to the trainer, generator processes,
progress lines, the run directory with its plot, JSON and flight-recorder dumps.

Weights go trainer -> generators over weightsync. Rollouts are small and go the other way as
msgspec messages on a queue of the publisher's own store (``ws.connect_store``): no second
server to start, and nothing crosses a process boundary as pickle.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import weightsync as ws
from weightsync.pg.recorder import process_recorder

REPO = Path(__file__).resolve().parent.parent


class RolloutQueue:
    """A msgspec-encoded queue on the publisher's store; one connection per process side."""

    def __init__(self, address: str, key: str, timeout: float = 30.0) -> None:
        self.key = key
        self.stop_key = f"{key}/stop"
        self.credit_key = f"{key}/credits"
        self._store: Any = ws.connect_store(address, timeout)

    def push(self, payload: bytes) -> None:
        self._store.queue_push(self.key, payload)

    def pop(self, timeout: float) -> bytes:
        """The next rollout; TimeoutError when none comes within ``timeout`` seconds."""
        import datetime as dt

        self._store.set_timeout(dt.timedelta(seconds=timeout))
        try:
            return bytes(self._store.queue_pop(self.key, True))
        except Exception as err:  # noqa: BLE001 - the store raises its own error types
            if "timeout" in str(err).lower() or "timed out" in str(err).lower():
                raise TimeoutError(f"no rollout within {timeout:.0f}s") from err
            raise

    # credits bound the backlog: a generator samples a batch only with a credit, and the trainer
    # grants one per batch it consumed, so batches are never more than a few versions stale
    def grant(self, n: int = 1) -> None:
        for _ in range(n):
            self._store.queue_push(self.credit_key, b"1")

    def take_credit(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for a credit; False when none came."""
        import datetime as dt

        self._store.set_timeout(dt.timedelta(seconds=timeout))
        try:
            self._store.queue_pop(self.credit_key, True)
            return True
        except Exception as err:  # noqa: BLE001 - the store raises its own error types
            if "timeout" in str(err).lower() or "timed out" in str(err).lower() or "empty" in str(err).lower():
                return False
            raise

    def request_stop(self) -> None:
        self._store.set(self.stop_key, b"1")

    def stopping(self) -> bool:
        return bool(self._store.check([self.stop_key]))


class Generators:
    """Generator processes the trainer started (``python -m MODULE generator ...``)."""

    def __init__(self, module: str, out: Path) -> None:
        self.module, self.out = module, out
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def argv(self, address: str, member: str, extra: Sequence[str] = ()) -> list[str]:
        return [sys.executable, "-m", self.module, "generator", "--address", address, "--member", member,
                "--out", str(self.out), *extra]

    def env(self) -> dict[str, str]:
        pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))
        return dict(os.environ, PYTHONPATH=pythonpath, WEIGHTSYNC_FR_DIR=str(self.out / "flight-recorder"))

    def start(self, address: str, member: str, extra: Sequence[str] = ()) -> subprocess.Popen[bytes]:
        log = open(self.out / f"{member}.log", "ab")  # noqa: SIM115 - the child owns it
        proc = subprocess.Popen(self.argv(address, member, extra), env=self.env(), cwd=REPO, stdout=log,
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
    path = Path(out) if out else REPO / "runs" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    (path / "flight-recorder").mkdir(parents=True, exist_ok=True)
    return path


def dump_recorder(out: Path, reason: str) -> Path:
    """This process's flight recorder, dumped into the run directory."""
    recorder = process_recorder()
    recorder.configure(directory=out / "flight-recorder")
    return recorder.dump(reason=reason)


def analyze_summary(fr_dir: Path) -> str:
    """One line from ``weightsync fr analyze`` over the run's dumps."""
    from weightsync.pg.analyze import analyze, load_dir

    try:
        dumps = load_dir(fr_dir)
    except (ValueError, OSError) as err:
        return f"flight recorder: {err}"
    analysis = analyze(dumps, names=[f"{d.label}-{d.pid}" for d in dumps])
    verdict = "no stall or failure found" if analysis.ok else f"{len(analysis.culprits)} culprit(s) named"
    return f"flight recorder: {len(dumps)} dumps, {verdict} (weightsync fr analyze {fr_dir})"


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0
