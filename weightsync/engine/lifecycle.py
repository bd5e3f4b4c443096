"""What a Publisher and a Subscriber share about their lifecycle: states, threads, close.

Both are async context managers over background threads. Their lifecycle::

    NEW --start()--> RUNNING --aclose()/abort()--> CLOSING --threads joined--> CLOSED
     └──────────────── aclose()/abort() before start ──────────────────────────┘

``aclose()`` and ``abort()`` are idempotent and safe from error paths: a second call, or one
on a NEW or CLOSED end, returns at once. A background thread that fails sets the end's
:class:`Latch` (first error wins); public calls then raise from it.
"""

from __future__ import annotations

import asyncio
import enum
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any

from weightsync._wire import name_problem
from weightsync.errors import WeightSyncError
from weightsync.planes.group.reaper import drain_retired
from weightsync.recorder.recorder import FlightRecorder


class EndState(enum.Enum):
    """The lifecycle of a Publisher or a Subscriber (see the module docstring)."""

    NEW = "new"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"


def begin_close(state: EndState) -> tuple[EndState, bool]:
    """The state after an ``aclose()``/``abort()`` call, and whether this call does the closing.

    Only a RUNNING end is closed (once); on a NEW one the call just marks it CLOSED, and a
    second call during or after a close returns at once.
    """
    if state is EndState.RUNNING:
        return EndState.CLOSING, True
    return (EndState.CLOSED if state is EndState.NEW else state), False


def validate_name(what: str, value: object) -> str:
    """A channel name or member id in the safe alphabet (:data:`~weightsync._wire.NAME_PATTERN`);
    ValueError otherwise."""
    problem = name_problem(what, value)
    if problem is not None:
        raise ValueError(problem)
    assert isinstance(value, str)
    return value


class Latch:
    """The first error of an end's threads, kept once and readable from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._error: WeightSyncError | None = None

    def set(self, error: WeightSyncError) -> bool:
        """Keep ``error`` if it is the first; True when it was."""
        with self._lock:
            if self._error is not None:
                return False
            self._error = error
            return True

    @property
    def error(self) -> WeightSyncError | None:
        return self._error


def launch(roles: Sequence[tuple[Callable[[], None], str]], prefix: str) -> list[threading.Thread]:
    """Start one daemon thread per ``(target, role)``, named ``<prefix>-<role>``."""
    threads = []
    for target, role in roles:
        thread = threading.Thread(target=target, name=f"{prefix}-{role}", daemon=True)
        thread.start()
        threads.append(thread)
    return threads


async def join(loop: asyncio.AbstractEventLoop, threads: Sequence[threading.Thread], deadline: float) -> bool:
    """Join ``threads`` in order without blocking the loop, until ``deadline`` (monotonic).

    True when every thread ended in time.
    """
    for thread in threads:
        await loop.run_in_executor(None, thread.join, max(deadline - time.monotonic(), 0.01))
    return not any(thread.is_alive() for thread in threads)


async def finish_close(loop: asyncio.AbstractEventLoop, executor: Executor | None, recorder: FlightRecorder,
                       teardown_timeout: float) -> None:
    """The end of every close: retired groups torn down (bounded), the full story dumped after trouble
    (or always, with ``recorder.dump_at_close``)."""
    if executor is not None:
        executor.shutdown(wait=False)
    await loop.run_in_executor(None, drain_retired, teardown_timeout)
    if recorder.last_dump_path is not None:  # trouble was dumped: leave the full story
        recorder.dump_on_trouble("closed after trouble", force=True)
    elif recorder.dump_at_close:
        recorder.dump_on_trouble("closed", force=True)


def call_soon(loop: asyncio.AbstractEventLoop | None, fn: Callable[..., Any], *args: Any) -> None:
    """Schedule ``fn(*args)`` on ``loop`` from any thread; a closed (or absent) loop is ignored."""
    if loop is None:
        return
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # loop closed: nobody is waiting any more
        pass


def check_version(what: str, value: object, *, low: int = 0) -> int:
    """A version argument: an int in [``low``, 2**63) (what the wire and the recorder hold), else a
    clear error at the call (``get(min_version=2**70)`` once poisoned the recorder instead)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    if not low <= value < 1 << 63:
        raise ValueError(f"{what} must be in [{'0' if low == 0 else low}, 2**63), got {value}")
    return value


def next_version(version: int | None, last: int | None) -> int:
    """The version a put gets: ``version``, checked, or the one after ``last`` (0 first)."""
    if version is None:
        return 0 if last is None else last + 1
    check_version("version", version)
    if last is not None and version <= last:
        raise ValueError(f"versions must strictly increase: {version} after {last}")
    return version
