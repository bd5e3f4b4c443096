"""Replacing members: the ``Orchestrator`` protocol and a local-process implementation.

The publisher calls ``await orchestrator.replace(member)`` on its own replacement thread's event
loop (never the application's, which a synchronous training step may hold) after it evicted a
member that its :class:`~weightsync.StragglerPolicy` says to replace (dead by default; slow by
default too). ``member`` is a :class:`MemberInfo`: id, host, pid, reason (``"dead"``,
``"slow"``, ``"failed"``) and the generation that dropped it. The replacement is an ordinary
subscriber: it joins, enters the next generation and receives the newest version while the
trainer keeps putting. ``replace`` must not block the loop; its errors are recorded in the
flight recorder and logged, never raised into ``put``.

How other launchers implement the protocol is in docs/fault-tolerance.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from weightsync.membership.membership import MemberInfo, StragglerPolicy
from weightsync.planes.group.reaper import TEARDOWN
from weightsync.recorder.recorder import FlightRecorder

log = logging.getLogger("weightsync.orchestrator")

__all__ = ["LocalProcessOrchestrator", "MemberInfo", "Orchestrator", "Replacements"]


@runtime_checkable
class Orchestrator(Protocol):
    """Starts a new member in place of one the publisher dropped."""

    async def replace(self, member: MemberInfo) -> None: ...


class Replacements:
    """The publisher's side: asks the orchestrator for a replacement of each dropped member.

    The Sender reports every dropped member (:meth:`member_dropped`, on its own thread); the
    policy decides whether it is replaced; ``orchestrator.replace`` then runs on a thread of
    this object's (``ws-<channel>-replace``, replacements in turn), each on an event loop of its
    own that closes with it, never on the application's: a training step that holds the application's
    loop for seconds does not delay a replacement. Its failures are recorded and logged, never
    raised into ``put``. ``policy`` and ``orchestrator`` are read when a member is dropped, so a
    publisher may set its orchestrator after construction (once its address is known).
    """

    def __init__(self, channel: str, *, recorder: FlightRecorder, policy: Callable[[], StragglerPolicy],
                 orchestrator: Callable[[], Orchestrator | None], stopped: Callable[[], bool]) -> None:
        self.channel = channel
        self._recorder, self._policy, self._orchestrator, self._stopped = recorder, policy, orchestrator, stopped
        self._rec = recorder.scope(channel, "publisher")
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False
        self.futures: list[concurrent.futures.Future[None]] = []

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Kept for the publisher's start; replacements no longer run on ``loop``."""

    def member_dropped(self, member: MemberInfo) -> None:
        """Any thread: ``member`` was dropped; replace it when the policy says so."""
        policy = self._policy()
        action = {"slow": policy.on_slow, "dead": policy.on_dead, "failed": policy.on_dead}.get(
            member.reason, "evict")  # operator evictions and leaves are not replaced
        orchestrator = self._orchestrator()
        if action != "replace" or orchestrator is None or self._stopped():
            return
        with self._lock:
            if self._closed:
                return
            if self._pool is None:  # one thread, replacements in turn (an orchestrator counts them)
                self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"ws-{self.channel}-replace")
            entry = self._rec.record("replace", peers=(member.member_id,), error=member.reason).start()
            log.info("replacing %s (%s) in channel %r", member.member_id, member.reason, self.channel)
            # each on an event loop of its own, closed with it: nothing of it stays open between two
            self.futures.append(self._pool.submit(asyncio.run, self._run(orchestrator, member, entry)))

    async def _run(self, orchestrator: Orchestrator, member: MemberInfo, entry: Any) -> None:
        try:
            await orchestrator.replace(member)
        except Exception as err:  # noqa: BLE001 - a failed replacement must never reach put()
            entry.fail(f"{type(err).__name__}: {err}")
            log.warning("replacing %s failed: %s", member.member_id, err)
        else:
            entry.complete()

    async def finish(self, timeout: float) -> None:
        """Replacements being started finish (bounded); none start after this."""
        with self._lock:
            self._closed = True
            pool, futures = self._pool, list(self.futures)
        if futures:
            _done, late = await asyncio.wait([asyncio.wrap_future(f) for f in futures], timeout=timeout)
            for task in late:
                task.cancel()  # one not started yet never starts
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


# one pass over each argv item: an id holding "{n}" stays as it is, and so does any other brace
# (str.format took a `python -c` script's dict literals for fields)
_PLACEHOLDER = re.compile(r"\{(member|n|reason)\}")


class LocalProcessOrchestrator:
    """Starts replacements on this host, from a command or a callable.

    Args:
        command: argv of the replacement; in each item ``{member}`` (the dropped member's id),
            ``{n}`` (a counter from 1) and ``{reason}`` are replaced, other braces kept as
            written. The environment gets ``WEIGHTSYNC_REPLACES`` (the dropped id) and
            ``WEIGHTSYNC_REPLACEMENT`` (``{n}``).
        target: instead of a command, ``target(member)``; it may return an awaitable (awaited)
            or a process-like object with ``poll()``/``pid`` (tracked and stopped by ``aclose``).
        env: extra environment for commands.
        stop_old: also SIGKILL the dropped member's process when this orchestrator started it
            (a slow replacement would otherwise keep running beside its own replacement). Only
            processes in its own child list are ever signalled: the pid a member reports is
            never trusted on its own. Default False.
        cwd, stdout, stderr: passed to :class:`subprocess.Popen`.

    Use it as an async context manager, or call :meth:`aclose`, to stop every process it
    started (SIGTERM, then SIGKILL after ``grace`` seconds).
    """

    def __init__(self, command: Sequence[str] | None = None, *, target: Callable[[MemberInfo], Any] | None = None,
                 env: Mapping[str, str] | None = None, stop_old: bool = False, cwd: str | None = None,
                 stdout: Any = None, stderr: Any = None, grace: float = 5.0) -> None:
        if (command is None) == (target is None):
            raise ValueError("pass exactly one of command= (argv) or target= (a callable)")
        if command is not None and (isinstance(command, str) or not command):
            raise ValueError("command must be a non-empty argv list, e.g. [sys.executable, 'gen.py', '{member}']")
        self.command = list(command) if command is not None else None
        self.target = target
        self.env = dict(env or {})
        self.stop_old = stop_old
        self.cwd, self.stdout, self.stderr, self.grace = cwd, stdout, stderr, grace
        self.started: list[tuple[MemberInfo, Any]] = []  # (replaced member, process or target's result)

    async def __aenter__(self) -> LocalProcessOrchestrator:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def replace(self, member: MemberInfo) -> None:
        if self.stop_old:
            self._stop_old(member)
        n = len(self.started) + 1
        if self.command is not None:
            fields = {"member": member.member_id, "n": str(n), "reason": member.reason}
            argv = [_PLACEHOLDER.sub(lambda m: fields[m.group(1)], part) for part in self.command]
            env = dict(os.environ, **self.env, WEIGHTSYNC_REPLACES=member.member_id, WEIGHTSYNC_REPLACEMENT=str(n))
            with TEARDOWN:  # no backend is torn down while this process forks (see reaper.TEARDOWN)
                proc: Any = subprocess.Popen(argv, env=env, cwd=self.cwd, stdout=self.stdout, stderr=self.stderr,
                                             start_new_session=True)
            self.started.append((member, proc))
            log.info("started %s (pid %d) to replace %s (%s)", argv[0], proc.pid, member.member_id,
                     member.reason)
            return
        assert self.target is not None
        result = self.target(member)
        if inspect.isawaitable(result):
            result = await result
        self.started.append((member, result))

    def _stop_old(self, member: MemberInfo) -> None:
        if member.pid <= 0 or member.host not in ("", socket.gethostname()):
            return
        for proc in self.processes():  # only a process we started, and only while it runs
            if proc.pid == member.pid and proc.poll() is None:
                _signal(proc, signal.SIGKILL)

    def processes(self) -> list[Any]:
        return [p for _, p in self.started if p is not None and hasattr(p, "poll")]

    async def aclose(self) -> None:
        """Stop every process this orchestrator started; bounded by ``grace`` seconds."""
        live = [p for p in self.processes() if p.poll() is None]
        for proc in live:
            _signal(proc, signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        while any(p.poll() is None for p in live) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # polling child exit status, bounded by the grace period
        for proc in live:
            if proc.poll() is None:
                _signal(proc, signal.SIGKILL)
                await asyncio.get_running_loop().run_in_executor(None, _reap, proc)


def _signal(proc: Any, sig: int) -> None:
    try:
        if isinstance(proc, subprocess.Popen):
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _reap(proc: Any) -> None:
    try:
        if isinstance(proc, subprocess.Popen):
            proc.wait(timeout=10)
        elif hasattr(proc, "join"):
            proc.join(10)
    except subprocess.TimeoutExpired:
        log.error("process %d survived SIGKILL for 10 s", proc.pid)
