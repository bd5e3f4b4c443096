"""Flight recorder: a bounded ring of every transport and group operation in this process.

Why: when a weight push stalls, a generic timeout says nothing about *who* stopped *where*.
Each process keeps its last ``capacity`` operations (put, announce, bucket send/receive,
ack, publish, abort, rebuild, evict, admit) with their state transitions and timestamps;
dumps of all ranks, merged by ``weightsync fr analyze``, name the member, version and bucket
where progress stopped.

Recording is a few attribute writes under no lock (a ``deque`` append is atomic), so it stays
on by default. ``capacity=0`` turns it off: ``record`` then returns a shared inert entry.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from typing import Any

import msgspec

SCHEDULED, STARTED, COMPLETED, FAILED, ABORTED = "scheduled", "started", "completed", "failed", "aborted"
DEFAULT_CAPACITY = 2000


class Entry(msgspec.Struct, kw_only=True):
    """One operation. Times are ``time.time()`` seconds, comparable across ranks on one host."""

    seq: int
    op: str
    channel: str
    member: str
    generation: int = -1
    version: int = -1
    bucket: int = -1
    nbytes: int = 0
    peers: tuple[str, ...] = ()
    state: str = SCHEDULED
    t_scheduled: float = 0.0
    t_started: float = 0.0
    t_ended: float = 0.0
    duration: float = 0.0
    error: str = ""

    def start(self) -> Entry:
        self.t_started = time.time()
        self.state = STARTED
        return self

    def complete(self) -> Entry:
        return self._end(COMPLETED, "")

    def fail(self, error: BaseException | str, *, aborted: bool = False) -> Entry:
        return self._end(ABORTED if aborted else FAILED, str(error)[:500])

    def _end(self, state: str, error: str) -> Entry:
        self.t_ended = time.time()
        self.duration = self.t_ended - (self.t_started or self.t_scheduled)
        self.state = state
        self.error = error
        return self


class FlightRecorder:
    """A ring buffer of :class:`Entry`, one per process (see :func:`process_recorder`).

    Example::

        rec = FlightRecorder(capacity=100)
        entry = rec.record("bucket_send", channel="policy", member="publisher", version=3, bucket=0)
        entry.start()
        ...
        entry.complete()
        rec.snapshot()[-1].state  # "completed"
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0 (0 turns recording off), got {capacity}")
        self.capacity = capacity
        self._ring: deque[Entry] = deque(maxlen=capacity or 1)
        self._seq = itertools.count()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def record(self, op: str, *, channel: str, member: str, **fields: Any) -> Entry:
        """Add an entry in state ``scheduled`` and return it for the caller to advance."""
        entry = Entry(seq=next(self._seq), op=op, channel=channel, member=member, t_scheduled=time.time(), **fields)
        if self.capacity:
            self._ring.append(entry)
        return entry

    def snapshot(self) -> list[Entry]:
        """A copy of the ring, oldest first (entries still in flight keep their state)."""
        with self._lock:
            return [msgspec.structs.replace(e) for e in list(self._ring)]

    def resize(self, capacity: int) -> None:
        with self._lock:
            self.capacity = capacity
            self._ring = deque(self._ring, maxlen=capacity or 1)


_process_recorder: FlightRecorder | None = None
_process_lock = threading.Lock()


def process_recorder() -> FlightRecorder:
    """The recorder shared by every channel in this process, created on first use."""
    global _process_recorder
    with _process_lock:
        if _process_recorder is None:
            _process_recorder = FlightRecorder()
        return _process_recorder
