"""``activation="all"``: the Commit that has every member expose a version together; the
publisher's end (:func:`commit`) and a member's (:class:`MemberCommit`).

Once every member of a version acknowledged it staged (not yet readable), the Sender calls
:func:`commit`: it tells them to expose it, waits for each one's word that it did, tells those the
version is settled (until then a member whose publisher dies reports the split it may be in), and
has a member that is alive but did not answer evicted ("commit unanswered"): it would hold every
later version's delivery up for the whole deadline (a dead or frozen one is its heartbeats'
business). The version is committed either way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from weightsync import _wire
from weightsync._errors import ControlFailure

log = logging.getLogger("weightsync.publisher")


def commit(gens: Any, job: Any, gen: int, seq: int, members: tuple[str, ...], *, deadline: float,
           membership: Any, scope: Any, channel: str) -> dict[str, float]:
    """Commit ``job`` at ``members``; returns when each exposed it (those that said so in time)."""
    entry = scope.record("commit", generation=gen, version=job.version, peers=members).start()
    job.committed_at = time.time()
    gens.tell(members, _wire.Commit(generation=gen, seq=seq, version=job.version))
    exposed = gens.collect_exposed(gen, seq, members, deadline)
    gens.tell(sorted(exposed), _wire.Commit(generation=gen, seq=seq, version=job.version, settled=True))
    quiet = sorted(set(members) - set(exposed))
    if not quiet:
        entry.complete()
        return exposed
    entry.fail(f"committed; no word of it exposed from {quiet}")
    for member in quiet:
        if membership.is_alive(member):
            log.warning("channel %r: %s did not answer version %d's Commit within %.3gs: evicting it",
                        channel, member, job.version, deadline)
            membership.request_evict(member, "commit unanswered")
    return exposed


class MemberCommit:
    """A member's end of the Commit: the verified version waiting in its receiving slot, and the
    version it exposed on a Commit that nobody has yet said every member exposed. Written by the
    receiver thread; :meth:`in_doubt` is read from any thread (a publisher gone)."""

    def __init__(self) -> None:
        self.staged: Any = None  # the verified version waiting for its Commit (transport.landing.Staged)
        self.unsettled: int | None = None  # exposed on a Commit; not yet told every member did

    def on_commit(self, commit: _wire.Commit, expose: Callable[[Any], None], serving: Callable[[], int | None],
                  client: Any, member: str, scope: Any) -> None:
        """``commit`` arrived: a settled one ends the doubt about its version; otherwise the staged
        version it names is exposed (``expose``), and the publisher told whether this member now
        reads it or a newer one (``serving()``: the readable version)."""
        if commit.settled:  # every member exposed it: nobody is in doubt about it any more
            if self.unsettled is not None and self.unsettled <= commit.version:
                self.unsettled = None
            return
        staged = self.staged
        if staged is not None and (staged.generation, staged.seq, staged.version) == \
                (commit.generation, commit.seq, commit.version):
            self.staged = None
            expose(staged)
            self.unsettled = staged.version
        have = serving()
        ok = have is not None and have >= commit.version
        if not ok:
            scope.record("commit", generation=commit.generation, version=commit.version).fail(
                "committed, but not staged here")
        try:
            client.send(_wire.Ack(generation=commit.generation, seq=commit.seq, member_id=member,
                                  version=commit.version, ok=ok, exposed=True))
        except ControlFailure:
            pass

    def in_doubt(self, serving: int | None) -> str:
        """What a member serving ``serving`` cannot know of the fleet if its publisher is gone now
        (the split it may be in), or "" when nothing is in doubt."""
        staged, unsettled = self.staged, self.unsettled
        if staged is not None and (serving is None or staged.version > serving):
            return (f"the publisher was committing version {staged.version}: this member serves version {serving} "
                    f"(it staged {staged.version} and was never told to expose it); other members may serve "
                    f"{staged.version}")
        if unsettled is not None:
            return (f"the publisher was committing version {unsettled}: this member serves version {serving} "
                    f"(exposed on its Commit, never told that every member did); other members may serve "
                    f"an older version")
        return ""
