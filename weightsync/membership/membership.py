"""Membership of one channel: generations, joins, leaves, liveness.

The publisher's sender owns it. Who writes what:

- the sender thread applies every request (join, leave, evict) and turns them into the next
  generation with :meth:`plan_next` and :meth:`commit`;
- liveness comes from the control server (``heard``): when each member last spoke, and
  whether its connection is still open;
- any thread may read (every method takes the lock).

A member is *dead* when its connection closed, or when it has not spoken for ``dead_after``
seconds (see ``Deadlines.member_silence``); a joiner that dies before it is planned is dropped from the
joining set. A member that failed a version is kept while alive, and dropped after two failed
versions in a row (a slow member cannot hold the others back forever).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from weightsync.recorder.recorder import FlightRecorder
from weightsync.statistics import MemberStatistics

MAX_STRIKES = 2
LINK_HISTORY = 3  # probes a link is judged on (its best of them)


@dataclass
class MemberInfo:
    """Who a member was, for an orchestrator replacing it: id, host, pid and why it left."""

    member_id: str
    host: str = ""
    pid: int = 0
    reason: str = ""  # dead | failed | slow | operator
    generation: int = -1  # the generation formed without it


ACTIONS = ("keep", "evict", "replace")


@dataclass(frozen=True)
class StragglerPolicy:
    """What the publisher does about a member that is slow but alive, and one that died.

    A member is *slow* on a version when the time it spent on its own (receiving minus waiting
    on the collective and on the publisher's Seal: copies, checks, a busy host) exceeds
    ``slow_factor`` times the median of the other members' (of its own transport) plus
    ``slow_floor`` seconds. Flagged on ``window`` versions in a row, ``on_slow`` applies:
    ``"keep"`` (recorded only; it holds every push back), ``"evict"``, or ``"replace"`` (evict,
    then ask the orchestrator for a new member; without an orchestrator the same as evict).
    ``on_dead`` is ``"evict"`` or ``"replace"``.
    """

    slow_factor: float = 3.0
    slow_floor: float = 0.05
    window: int = 3
    on_slow: str = "replace"
    on_dead: str = "replace"

    def __post_init__(self) -> None:
        if self.on_slow not in ACTIONS:
            raise ValueError(f"on_slow must be one of {ACTIONS}, got {self.on_slow!r}")
        if self.on_dead not in ("evict", "replace"):
            raise ValueError(f"on_dead must be 'evict' or 'replace', got {self.on_dead!r}")
        if self.slow_factor <= 1 or self.window < 1 or self.slow_floor < 0:
            raise ValueError("need slow_factor > 1, window >= 1 and slow_floor >= 0")


@dataclass(frozen=True)
class Plan:
    old_generation: int
    generation: int
    members: tuple[str, ...]
    admitted: tuple[str, ...]
    evicted: tuple[str, ...]
    notify: bool
    reasons: dict[str, str] = field(default_factory=dict)  # evicted member -> dead | failed | slow
    dropped_joiners: tuple[str, ...] = ()  # joiners that died before they were planned
    left: tuple[str, ...] = ()  # members that asked to leave


class Membership:
    def __init__(self, channel: str, recorder: FlightRecorder, heartbeat_interval: float = 1.0,
                 dead_after: float = 2.0, heard: Callable[[str], tuple[float | None, bool]] | None = None,
                 stale: Callable[[], bool] = lambda: False) -> None:
        self.channel = channel
        self.generation = 0
        self.members: list[str] = []
        self.heartbeat_interval = heartbeat_interval
        self.dead_after = dead_after
        self._heard, self._stale = heard, stale  # liveness, from the control server (None: all alive)
        self._recorder = recorder
        self._rec = recorder.scope(channel, "publisher")
        self._lock = threading.Lock()
        self._joining: list[str] = []
        self._leaving: set[str] = set()
        self._strikes: dict[str, int] = {}
        self._versions: dict[str, int] = {}
        self._evicting: dict[str, str] = {}  # member -> why (slow)
        self.receive_seconds: dict[str, deque[float]] = {}
        self._own: dict[str, deque[float]] = {}  # member -> recent own (non-waiting) receive seconds
        self._slow_streak: dict[str, int] = {}
        self._links: dict[str, deque[tuple[float, float]]] = {}  # member -> its last probes' (least, most)

    # requests (inbox thread) -------------------------------------------------------------
    def request_join(self, member_id: str) -> bool:
        """Add a joiner; False (nothing changed) when the id is already a member or joining."""
        with self._lock:
            if member_id in self.members or member_id in self._joining:
                return False
            self._joining.append(member_id)
            # a joiner holds nothing, whatever it held under this id before (a worker that left and
            # joined again): it gets the retained version like any newcomer
            self._versions.pop(member_id, None)
            return True

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
        return bool(self._joining or self._leaving or self._evicting)

    def swap(self, a: str, b: str) -> None:
        """Exchange two members' places in the order the next generation is formed in (their ranks
        in the broadcast tree: ``membership.blame`` moves an accuser under the publisher)."""
        with self._lock:
            if a in self.members and b in self.members:
                i, j = self.members.index(a), self.members.index(b)
                self.members[i], self.members[j] = b, a

    def request_evict(self, member_id: str, reason: str) -> None:
        with self._lock:
            if member_id in self.members:
                self._evicting[member_id] = reason

    def is_alive(self, member: str) -> bool:
        """A member (or joiner) is alive while its connection is open and it spoke within ``dead_after``.

        A closed connection is death at once. When the control loop itself has not run lately
        (this process stalled), nobody could be heard: no verdicts from that stale view.
        """
        if self._heard is None or self._stale():
            return True
        last, connected = self._heard(member)
        if last is None or not connected:
            return False
        return time.monotonic() - last < self.dead_after

    def has_dead_members(self) -> bool:
        return any(not self.is_alive(m) for m in self.members)

    def unresponsive(self) -> set[str]:
        with self._lock:
            return {m for m in self.members + self._joining if not self.is_alive(m)}

    # generations (sender thread) ---------------------------------------------------------
    def down(self) -> set[str]:
        """The members not alive now (see :meth:`plan_next`'s ``down``)."""
        with self._lock:
            return {m for m in self.members if not self.is_alive(m)}

    def plan_next(self, failed: Iterable[str] = (), down: set[str] | None = None) -> Plan:
        """The next generation: members that left, died or struck out are dropped.

        ``down``: the members found not alive *before* the caller applied the queued requests.
        A member says Leave and then hangs up, so one whose closed connection was seen first has
        its Leave applied by then: it left, it did not die. Judged here instead (None), a member
        that hung up after its Leave was queued, but before it was applied, counts as dead."""
        failed = set(failed)
        down = self.down() if down is None else down
        with self._lock:
            evicted = []
            keep = []
            reasons: dict[str, str] = {}
            for member in self.members:
                if member in self._leaving:
                    continue
                if member in down:
                    reasons[member] = "dead"
                elif member in self._evicting:
                    reasons[member] = self._evicting[member]
                else:
                    strikes = self._strikes.get(member, 0) + (1 if member in failed else 0)
                    self._strikes[member] = strikes
                    if strikes >= MAX_STRIKES:
                        reasons[member] = "failed"
                if member in reasons:
                    evicted.append(member)
                else:
                    keep.append(member)
            dropped = [m for m in self._joining if not self.is_alive(m)]  # died before they were planned
            self._joining = [m for m in self._joining if m not in dropped]
            admitted = tuple(m for m in self._joining if m not in failed)
            return Plan(old_generation=self.generation, generation=self.generation + 1,
                        members=tuple(keep) + admitted, admitted=admitted,
                        evicted=tuple(evicted), notify=bool(self.members), reasons=reasons,
                        dropped_joiners=tuple(dropped), left=tuple(m for m in self.members if m in self._leaving))

    def commit(self, plan: Plan, ok: bool) -> None:
        """Adopt ``plan`` (``ok``) or record that its rendezvous failed."""
        with self._lock:
            admitted = set(plan.admitted)
            self._joining = [m for m in self._joining if m not in admitted]
            if ok:
                self._leaving.clear()
                for member in plan.evicted:
                    self._evicting.pop(member, None)
            self.generation = plan.generation
            # on failure the planned members (newcomers too) wait on this generation's command
            # stream; the next plan reaches them with a Reconfigure there
            self.members = list(plan.members)
            for member in plan.evicted:
                self._strikes.pop(member, None)
                self._versions.pop(member, None)
                self._slow_streak.pop(member, None)
                self._links.pop(member, None)
                self.receive_seconds.pop(member, None)
                self._own.pop(member, None)
                self._rec.record("evict", generation=plan.generation,
                                      peers=(member,), error=plan.reasons.get(member, "")).complete()
            for member in admitted:
                self._rec.record("admit", generation=plan.generation,
                                      peers=(member,)).complete() if ok else None

    def note_delivered(self, acked: set[str], version: int, seconds: dict[str, float],
                       own: dict[str, float]) -> None:
        with self._lock:
            for member in self.members:
                if member in acked:
                    self._strikes[member] = 0
                    self._versions[member] = version
                    self.receive_seconds.setdefault(member, deque(maxlen=32)).append(seconds.get(member, 0.0))
                    self._own.setdefault(member, deque(maxlen=32)).append(own.get(member, 0.0))

    def slow_members(self, policy: StragglerPolicy, own: dict[str, float],
                     link: dict[str, tuple[float, float]] | None = None) -> dict[str, float]:
        """Members flagged slow on the last ``policy.window`` versions; member -> its ratio now.

        ``own`` is this version's own time per member, scored against the *upper* median of the
        others', so a uniformly slow network flags nobody, and a member that reports less than it
        took (an insider claiming 0 s) cannot make an honest one look slow: with at least two
        others, the reference is one of theirs at or above the middle, never the liar's. With a
        single other member there is no majority to tell a slow member from a lying one, so
        nobody is scored (docs/security.md).

        ``link`` (when every member's link was timed): per member what its link took at least and
        at most for this version, each judged on its best of the last ``LINK_HISTORY`` probes (a
        loaded machine only ever delays a probe). A member is also slow when its link's least is
        past the upper median of the others' most: it surely took longer than they surely did. The two are
        compared apart, so others' loose upper bounds on their links never hide a slow own time.
        """
        flagged: dict[str, float] = {}
        with self._lock:
            for member, bounds in (link or {}).items():
                self._links.setdefault(member, deque(maxlen=LINK_HISTORY)).append(bounds)
            for member, mine in own.items():
                others = [m for m in own if m != member]
                if len(others) < 2 or member not in self.members:
                    continue
                ratio, slow = 0.0, False
                criteria = [(mine, [own[m] for m in others])]
                if link is not None and all(m in link for m in own):
                    criteria.append((self._link_least(member), [self._link_most(m) for m in others]))
                for score, theirs in criteria:
                    typical = sorted(theirs)[len(theirs) // 2]  # the upper median: one low report cannot pull it down
                    if score > policy.slow_factor * typical + policy.slow_floor:
                        slow, ratio = True, max(ratio, score / max(typical, 1e-6))
                self._slow_streak[member] = self._slow_streak.get(member, 0) + 1 if slow else 0
                if self._slow_streak[member] >= policy.window:
                    flagged[member] = ratio
        return flagged

    # a link's time is judged on its best of the last LINK_HISTORY probes: on a loaded machine a
    # probe is only ever delayed (the receiving process was not scheduled), never sped up, so one
    # late probe of a healthy member no longer hides a slow one (it broke the streak: under a
    # busy loop the member behind a 10x slower link went unflagged for 12 versions), nor makes
    # a healthy one look slow
    def _link_least(self, member: str) -> float:
        return min(least for least, _most in self._links[member])

    def _link_most(self, member: str) -> float:
        return min(most for _least, most in self._links[member])

    def last_versions(self) -> dict[str, tuple[int | None, float | None]]:
        """Per current member: the newest version it acknowledged and its last receive time."""
        with self._lock:
            return {m: (self._versions.get(m), self.receive_seconds[m][-1] if self.receive_seconds.get(m) else None)
                    for m in self.members}

    def member_statistics(self, newest: int | None, transport_of: Callable[[str], str]) -> list[MemberStatistics]:
        """Per current member, what ``Publisher.statistics()`` reports of it (lag behind ``newest``)."""
        return [MemberStatistics(member_id=m, transport=transport_of(m), last_version=v,
                                 lag=None if v is None or newest is None else max(newest - v, 0),
                                 last_receive_seconds=s) for m, (v, s) in self.last_versions().items()]

    def lacking(self, version: int) -> bool:
        """True when some current member does not have ``version`` yet."""
        with self._lock:
            return any(self._versions.get(m, -1) < version for m in self.members)
