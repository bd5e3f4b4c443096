"""``activation="all"``: the Commit that has every member expose a version together.

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
from typing import Any

from weightsync import _wire

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
