"""Counters and distributions of a channel's ends: ``pub.statistics()`` and ``sub.statistics()``.

Each end owns one tally. The threads that decide what happened write it (the sender thread
counts deliveries, failures, re-sends and evictions; the generations code counts rebuilds; a
subscriber's receiver counts versions received and checksum failures; ``put`` times its own
stall), so a figure never waits on the application's event loop. ``statistics()`` returns a
frozen snapshot (trio's ``statistics()`` habit): reading one never blocks a sender.

Distributions are kept over the last :data:`WINDOW` samples, as quantiles: enough to see a stall
creep up, bounded in memory whatever the run's length. The Prometheus exporter
(:mod:`weightsync.prometheus`) reads the same snapshots.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Iterable

import msgspec

WINDOW = 256  # samples each distribution keeps


class Quantiles(msgspec.Struct, frozen=True):
    """A distribution over the last ``window`` samples, in seconds (zeros when there are none).

    ``count`` and ``total`` cover every sample since the start, as a Prometheus summary does.
    """

    count: int = 0
    total: float = 0.0
    p50: float = 0.0
    p90: float = 0.0
    p99: float = 0.0
    max: float = 0.0


class MemberStatistics(msgspec.Struct, frozen=True):
    """One member of a publisher's current generation.

    Attributes:
        member_id: its id.
        transport: ``"group"`` or ``"shm"``.
        last_version: the newest version it acknowledged (None before its first).
        lag: versions behind the newest one put (None before its first).
        last_receive_seconds: how long its last version took it, start to acknowledgement.
    """

    member_id: str
    transport: str
    last_version: int | None
    lag: int | None
    last_receive_seconds: float | None


class PublisherStatistics(msgspec.Struct, frozen=True):
    """A snapshot of a publisher's counters (see the module docstring for who counts what).

    Attributes:
        channel: the channel.
        versions_put: puts that returned a handle.
        versions_delivered: versions that reached at least one member.
        versions_to_nobody: versions sent while the channel had no member.
        versions_superseded: pending puts a newer put replaced before they were sent.
        versions_failed: versions that could not be sent (their handles raised).
        bytes_put: payload bytes of every version sent (once per version).
        bytes_delivered: payload bytes times the members each version reached.
        resends: versions sent again after a failed attempt (a member died, a checksum failed).
        evictions: members dropped so far, by reason (``dead``, ``failed``, ``slow``, ``operator``).
        generations: generations formed (each join, leave or eviction rebuilds one).
        generation: the current generation number.
        put_stall: how long ``put`` held the caller (snapshot included).
        delivery: from the start of sending to the last acknowledgement, per version.
        members: the current members, in rank order.
        bytes_on_wire: what was sent for each version, once per member reached: its encoded size
            for a member sent a delta, else its payload bytes (compare with ``bytes_delivered``).
        delta_fallbacks: versions re-sent full because a member could not apply their delta.
    """

    channel: str
    versions_put: int
    versions_delivered: int
    versions_to_nobody: int
    versions_superseded: int
    versions_failed: int
    bytes_put: int
    bytes_delivered: int
    resends: int
    evictions: dict[str, int]
    generations: int
    generation: int
    put_stall: Quantiles
    delivery: Quantiles
    members: tuple[MemberStatistics, ...]
    bytes_on_wire: int = 0
    delta_fallbacks: int = 0


class SubscriberStatistics(msgspec.Struct, frozen=True):
    """A snapshot of a subscriber's counters.

    Attributes:
        channel, member_id: names.
        transport: ``"group"`` or ``"shm"``.
        version: the latest readable version (None before the first).
        versions_received: versions made readable (a sharded version counts once).
        bytes_received: their payload bytes.
        receive_failures: versions whose receive failed (a peer, a checksum, a cancelled generation).
        checksum_failures: of those, the ones whose bytes did not match the publisher's digests.
        reads: ``get``, ``get_into``, ``stream`` and ``load`` calls that returned a version.
        reads_skipped: ``get_into(only_newer=True)`` calls that copied nothing (already held).
        reads_as_received: ``get_into(as_received=True)`` calls whose version was written into the
            destination as it arrived (nothing copied after it was readable).
        receive: from the Announce to the version being readable, per version.
        evicted: True once the publisher dropped this subscriber.
        decode_seconds: of every receive so far, the time spent rebuilding buckets from their
            encoding (a delta's decode; 0 for full versions).
        verify_seconds: of every receive so far, the time spent taking the buckets' digests.
    """

    channel: str
    member_id: str
    transport: str
    version: int | None
    versions_received: int
    bytes_received: int
    receive_failures: int
    checksum_failures: int
    reads: int
    reads_skipped: int
    receive: Quantiles
    evicted: bool
    reads_as_received: int = 0
    decode_seconds: float = 0.0
    verify_seconds: float = 0.0


class Distribution:
    """Samples in seconds: a bounded window for quantiles, a count and a sum for everything."""

    def __init__(self, window: int = WINDOW) -> None:
        self._window: deque[float] = deque(maxlen=window)
        self.count = 0
        self.total = 0.0

    def add(self, seconds: float) -> None:
        self._window.append(seconds)
        self.count += 1
        self.total += seconds

    def quantiles(self) -> Quantiles:
        data = sorted(self._window)
        if not data:
            return Quantiles(count=self.count, total=self.total)

        def at(q: float) -> float:
            return data[min(len(data) - 1, int(q * len(data)))]

        return Quantiles(count=self.count, total=self.total, p50=at(0.5), p90=at(0.9), p99=at(0.99), max=data[-1])


class PublisherTally:
    """What a publisher's threads count; :meth:`snapshot` makes the frozen record."""

    def __init__(self, channel: str) -> None:
        self.channel = channel
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._evictions: Counter[str] = Counter()
        self._stall = Distribution()
        self._delivery = Distribution()
        self.newest_put: int | None = None

    def count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self._counts[what] += n

    def put_returned(self, version: int, stall: float) -> None:
        with self._lock:
            self._counts["versions_put"] += 1
            self._stall.add(stall)
            self.newest_put = version

    def delivered(self, nbytes: int, members: int, seconds: float, wire: int | None = None) -> None:
        with self._lock:
            self._counts["versions_delivered" if members else "versions_to_nobody"] += 1
            self._counts["bytes_put"] += nbytes
            self._counts["bytes_delivered"] += nbytes * members
            self._counts["bytes_on_wire"] += nbytes * members if wire is None else wire
            self._delivery.add(seconds)

    def evicted(self, reason: str) -> None:
        with self._lock:
            self._evictions[reason] += 1

    def snapshot(self, *, generation: int, members: Iterable[MemberStatistics]) -> PublisherStatistics:
        with self._lock:
            c = self._counts
            return PublisherStatistics(
                channel=self.channel, versions_put=c["versions_put"], versions_delivered=c["versions_delivered"],
                versions_to_nobody=c["versions_to_nobody"], versions_superseded=c["versions_superseded"],
                versions_failed=c["versions_failed"], bytes_put=c["bytes_put"], bytes_delivered=c["bytes_delivered"],
                resends=c["resends"], evictions=dict(self._evictions), generations=c["generations"],
                generation=generation, put_stall=self._stall.quantiles(), delivery=self._delivery.quantiles(),
                members=tuple(members), bytes_on_wire=c["bytes_on_wire"], delta_fallbacks=c["delta_fallbacks"])


class SubscriberTally:
    """What a subscriber's receivers and readers count."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._receive = Distribution()
        self._seconds: dict[str, float] = {"decode": 0.0, "verify": 0.0}

    def count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self._counts[what] += n

    def spent(self, decoding: float, verifying: float) -> None:
        """One bucket's decode and digest time (the receiver thread, as each bucket lands)."""
        with self._lock:
            self._seconds["decode"] += decoding
            self._seconds["verify"] += verifying

    def received(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._counts["versions_received"] += 1
            self._counts["bytes_received"] += nbytes
            self._receive.add(seconds)

    def snapshot(self, *, channel: str, member_id: str, transport: str, version: int | None,
                 evicted: bool) -> SubscriberStatistics:
        with self._lock:
            c = self._counts
            return SubscriberStatistics(
                channel=channel, member_id=member_id, transport=transport, version=version,
                versions_received=c["versions_received"], bytes_received=c["bytes_received"],
                receive_failures=c["receive_failures"], checksum_failures=c["checksum_failures"],
                reads=c["reads"], reads_skipped=c["reads_skipped"], receive=self._receive.quantiles(),
                evicted=evicted, reads_as_received=c["reads_as_received"],
                decode_seconds=self._seconds["decode"], verify_seconds=self._seconds["verify"])
