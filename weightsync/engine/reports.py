"""What a version's attempts add up to: per member, the encoding it got and the bytes that moved
for it (``forms``), the :class:`~weightsync.engine.handles.DeliveryReport` its put resolves
with (``delivered``), and the put resolved (:class:`Outcomes`). The Sender calls them; none
touches the wire."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from weightsync.engine.handles import DeliveryReport
from weightsync.engine.staging import Job, Staging
from weightsync.errors import WeightSyncError

log = logging.getLogger("weightsync.publisher")

FULL = "full"


def forms(job: Job, by: Mapping[Any, tuple[str, ...]], prepared: Mapping[Any, Any],
          encoded: int | None, own: Mapping[str, int]) -> dict[str, tuple[str, int]]:
    """Per member in an attempt: the encoding it was sent in, and the bytes that put on the wire
    (``encoded``: an encoded version's, once moved; ``own``: members sent their own bytes, a
    sliced member's share or its delta)."""
    out: dict[str, tuple[str, int]] = {}
    whole_snapshot = job.flat is not None and job.assembly is None
    for part, to in by.items():
        got = prepared[part]
        # a same-host member reading the snapshot in place: nothing moved for it
        in_place = whole_snapshot and part.reads_in_place
        for member in to:
            name = got.coding_of(member).name
            size = encoded if name != FULL and encoded is not None else job.manifest.total_bytes
            out[member] = (name, 0 if in_place else own.get(member, size))
    return out


def delivered(job: Job, members: tuple[str, ...], t0: float) -> DeliveryReport:
    """The report of ``job`` delivered to ``members`` (their forms as its attempts recorded them)."""
    got = {m: job.forms.get(m, (FULL, job.manifest.total_bytes)) for m in members}
    return DeliveryReport(version=job.version, members=members, nbytes=job.manifest.total_bytes,
                          seconds=time.monotonic() - (job.started or t0), delivered_at=time.time(),
                          wire_bytes=sum(size for _name, size in got.values()),
                          encodings={m: name for m, (name, _size) in got.items()},
                          base=job.base if any(name != FULL for name, _s in got.values()) else -1,
                          encode_seconds=job.encode_seconds, committed_at=job.committed_at,
                          exposure_spread=job.exposure_spread)


class Outcomes:
    """Each version's end: staging told, the put resolved with its report or its error, counted."""

    def __init__(self, channel: str, staging: Staging, membership: Any, tally: Any) -> None:
        self.channel, self.staging, self.membership, self.tally = channel, staging, membership, tally
        self._nobody_streak = False  # the last version reached nobody (its warning was logged)

    def finish(self, job: Job, t0: float, error: BaseException | None = None) -> None:
        self.staging.finish(job, retain=error is None)  # a failed version is never re-sent
        if error is not None:
            self.tally.count("versions_failed")
            job.handle.resolve_threadsafe(error=WeightSyncError(
                f"version {job.version} could not be sent: {error}", channel=self.channel, version=job.version))
            return
        # a member that acknowledged the version has it, whether it is still here or left since (a
        # subscriber that gets its last version and closes may be gone before the attempt ends)
        current = tuple(self.membership.members)
        members = tuple(m for m in current if m in job.members_done) + tuple(sorted(job.members_done - set(current)))
        report = delivered(job, members, t0)
        if not members:  # once per streak: a trainer that starts first puts to nobody for a while
            (log.debug if self._nobody_streak else log.warning)(
                "version %d delivered to nobody: channel %r has no members", job.version, self.channel)
        self._nobody_streak = not members
        self.tally.delivered(job.manifest.total_bytes, len(members), report.seconds, report.wire_bytes)
        log.debug("channel %r: version %d delivered to %d members in %.3fs", self.channel, job.version,
                  len(members), report.seconds)
        job.handle.resolve_threadsafe(report)
