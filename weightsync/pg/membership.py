"""Membership of one channel: generations, joins, leaves, liveness.

The publisher owns it. The inbox thread records requests (join, leave) and samples heartbeat
counters; the sender thread turns them into the next generation with :meth:`plan_next` and
:meth:`commit`. A member is *dead* when its heartbeat counter has not moved for five
intervals (and at least two seconds); a member that failed a version is kept while alive, and dropped after two failed
versions in a row (a slow member cannot hold the others back forever).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from weightsync.pg.control import ControlPlane, StoreTimeout, StoreUnreachable
from weightsync.pg.recorder import FlightRecorder

DEAD_AFTER_BEATS = 5
DEAD_AFTER_SECONDS = 2.0  # never sooner: a loaded machine delays beats, and eviction is costly
MAX_STRIKES = 2


@dataclass(frozen=True)
class Plan:
    old_generation: int
    generation: int
    members: tuple[str, ...]
    admitted: tuple[str, ...]
    evicted: tuple[str, ...]
    notify: bool


class Membership:
    def __init__(self, channel: str, recorder: FlightRecorder, heartbeat_interval: float = 1.0) -> None:
        self.channel = channel
        self.generation = 0
        self.members: list[str] = []
        self.heartbeat_interval = heartbeat_interval
        self._recorder = recorder
        self._lock = threading.Lock()
        self._joining: list[str] = []
        self._leaving: set[str] = set()
        self._beats: dict[str, tuple[int, float]] = {}  # member -> (counter, monotonic when it last moved)
        self._strikes: dict[str, int] = {}
        self._versions: dict[str, int] = {}
        self.receive_seconds: dict[str, list[float]] = {}

    # requests (inbox thread) -------------------------------------------------------------
    def request_join(self, member_id: str) -> None:
        with self._lock:
            self._joining.append(member_id)
            self._beats[member_id] = (-1, time.monotonic())

    def request_leave(self, member_id: str) -> None:
        with self._lock:
            if member_id in self.members:
                self._leaving.add(member_id)

    def is_member_or_joining(self, member_id: str) -> bool:
        with self._lock:
            return member_id in self.members or member_id in self._joining

    def joining(self) -> list[str]:
        with self._lock:
            return list(self._joining)

    def is_leaving(self, member_id: str) -> bool:
        with self._lock:
            return member_id in self._leaving

    def has_requests(self) -> bool:
        return bool(self._joining or self._leaving)

    def sample_heartbeats(self, ctl: ControlPlane) -> set[str]:
        """Read every watched member's beat counter; returns members that just went silent."""
        was_alive = {m for m in self.members if self.is_alive(m)}
        with self._lock:
            watched = list(self.members) + list(self._joining)
        now = time.monotonic()
        for member in watched:
            try:
                count = ctl.add(ctl.heartbeat_key(member), 0)
            except (StoreTimeout, StoreUnreachable):
                return set()
            with self._lock:
                last, since = self._beats.get(member, (-1, now))
                if count != last:
                    self._beats[member] = (count, now)
        return {m for m in was_alive if not self.is_alive(m)}

    def is_alive(self, member: str) -> bool:
        _, since = self._beats.get(member, (-1, time.monotonic()))
        return time.monotonic() - since < max(DEAD_AFTER_BEATS * self.heartbeat_interval, DEAD_AFTER_SECONDS)

    def has_dead_members(self) -> bool:
        return any(not self.is_alive(m) for m in self.members)

    def unresponsive(self) -> set[str]:
        with self._lock:
            return {m for m in self.members + self._joining if not self.is_alive(m)}

    # generations (sender thread) ---------------------------------------------------------
    def plan_next(self, failed: Iterable[str] = ()) -> Plan:
        """The next generation: members that left, died or struck out are dropped."""
        failed = set(failed)
        with self._lock:
            evicted = []
            keep = []
            for member in self.members:
                if member in self._leaving or (member in failed and not self.is_alive(member)):
                    continue
                strikes = self._strikes.get(member, 0) + (1 if member in failed else 0)
                self._strikes[member] = strikes
                if not self.is_alive(member) or strikes >= MAX_STRIKES:
                    evicted.append(member)
                else:
                    keep.append(member)
            admitted = tuple(m for m in self._joining if self.is_alive(m) and m not in failed)
            return Plan(old_generation=self.generation, generation=self.generation + 1,
                        members=tuple(keep) + admitted, admitted=admitted,
                        evicted=tuple(evicted), notify=bool(self.members))

    def commit(self, plan: Plan, ok: bool) -> None:
        """Adopt ``plan`` (``ok``) or record that its rendezvous failed."""
        with self._lock:
            admitted = set(plan.admitted)
            self._joining = [m for m in self._joining if m not in admitted]
            if ok:
                self._leaving.clear()
            self.generation = plan.generation
            # on failure the planned members (newcomers too) wait on this generation's command
            # stream; the next plan reaches them with a Reconfigure there
            self.members = list(plan.members)
            for member in plan.evicted:
                self._strikes.pop(member, None)
                self._versions.pop(member, None)
                self._recorder.record("evict", channel=self.channel, member="publisher", generation=plan.generation,
                                      peers=(member,)).complete()
            for member in admitted:
                self._recorder.record("admit", channel=self.channel, member="publisher", generation=plan.generation,
                                      peers=(member,)).complete() if ok else None

    def note_delivered(self, acked: set[str], version: int, seconds: float) -> None:
        with self._lock:
            for member in self.members:
                if member in acked:
                    self._strikes[member] = 0
                    self._versions[member] = version
                    self.receive_seconds.setdefault(member, []).append(seconds)

    def lacking(self, version: int) -> bool:
        """True when some current member does not have ``version`` yet."""
        with self._lock:
            return any(self._versions.get(m, -1) < version for m in self.members)
