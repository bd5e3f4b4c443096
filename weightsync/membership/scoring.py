"""Who pays after a version: slow members (receive times and link probes) and corrupting relays.

The Sender tells :class:`Scoring` what each version's acknowledgements said; it asks the
membership to evict whom the straggler policy or the relay evidence (:mod:`.blame`) names, and
records why. Only the sender thread uses it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from weightsync.membership.blame import Parent, RelayBlame
from weightsync.membership.membership import Membership, StragglerPolicy

PROBE_FROM = 256 << 10  # versions smaller than this are not worth timing links for
PROBE_MAX = 128 << 10

log = logging.getLogger("weightsync.publisher")


class Scoring:
    """Slow members and corrupting relays, judged for the Sender (see the module docstring).

    Args:
        channel: for the log.
        membership: where evictions are asked for.
        policy: what to do about slow members.
        control: the control server (link probes).
        scope: the publisher's recorder scope.
        sharded: a sharded publisher's lane (its lanes share every link: no probes).
    """

    def __init__(self, channel: str, membership: Membership, policy: StragglerPolicy, control: Any, scope: Any,
                 *, sharded: bool) -> None:
        self.channel, self.membership, self.policy = channel, membership, policy
        self._control, self._rec, self._sharded = control, scope, sharded
        self._probe_round = 0  # the newest round of link probes a verdict was given on
        self._blame = RelayBlame()  # who corrupted bytes in the broadcast tree, on evidence

    def relays(self, version: int, tree: tuple[tuple[str, ...], set[str]], corrupt: set[str],
               parent: Parent) -> tuple[set[str], bool]:
        """What a version corrupted in the broadcast tree says, its point-to-point re-send in
        (``membership.blame``): the members struck (evicted at MAX_STRIKES), and whether the
        group's order changes (an accuser moved right under the publisher)."""
        self._blame.forget_all_but(self.membership.members)
        verdict = self._blame.judge(tree[0], tree[1], corrupt, parent)
        for member, why in sorted(verdict.struck.items()):
            self._rec.record("corrupt", version=version, peers=(member,)).fail(why)
            log.warning("channel %r: %s struck for version %d's corrupted bytes: %s", self.channel, member,
                        version, why)
        for relay, accusers in sorted(verdict.accused.items()):
            if relay not in verdict.struck:
                self._rec.record("accused", version=version, peers=(relay, *accusers)).complete()
        for member in verdict.evict:
            self.membership.request_evict(member, "failed")
        for accuser, other in verdict.swaps:
            self.membership.swap(accuser, other)
        return set(verdict.struck), bool(verdict.swaps)

    def score(self, timings: dict[str, tuple[float, float]], acked: set[str], version: int, nbytes: int,
              part_of: Callable[[str], Any]) -> None:
        """Record receive times and act on members the policy finds slow.

        A member is slow on its own time (what it spent outside the collective) against the
        others', or on its link's time for a version this size: extrapolated from what its
        probe of the newest round took at least, capped at its whole receive time, against what
        the others' took at most (the shortest of their last round trips). The broadcast is a tree, so a slow
        link's wait lands on other members' collective time too: only the probe, which goes
        straight to each member, says whose link it is. Links are compared once per round, and
        only when every member answered it: each verdict stands on a measure of its own. The
        next round goes out now, sized at 1/32 of the version (at most 128 KiB; none below
        256 KiB, where links do not matter).
        """
        own = {m: timings[m][1] for m in acked if m in timings}
        self.membership.note_delivered(acked, version, {m: timings[m][0] for m in own}, own)
        # a sharded publisher's lanes share every link: one lane's probe would time the others'
        # buckets, so its members are scored on their own time alone
        linked = [m for m in own if not part_of(m).moves_alone] if not self._sharded else []
        links = self._links(linked, timings, nbytes)
        if log.isEnabledFor(logging.DEBUG):  # what each verdict below stood on
            log.debug("version %d: own seconds %s, link seconds (least, most) %s", version,
                      {m: round(t, 4) for m, t in own.items()},
                      {m: (round(a, 4), round(b, 4)) for m, (a, b) in links.items()})
        if nbytes >= PROBE_FROM and not self._sharded:
            self._control.probe(min(PROBE_MAX, nbytes // 32))
        # a member is compared with members of its own plane only: copies out of shared memory
        # are an order of magnitude faster than any socket
        flagged: dict[str, float] = {}
        for part in {part_of(m) for m in own}:
            mine = {m: t for m, t in own.items() if part_of(m) is part}
            # links are compared only when every member's was timed (none is judged on a probe
            # against others judged on their own time alone)
            timed = {m: links[m] for m in mine if m in links} if all(m in links for m in mine) else None
            flagged.update(self.membership.slow_members(self.policy, mine, timed))
        for member, ratio in flagged.items():
            self._rec.record("slow", version=version, peers=(member,)).fail(f"{ratio:.1f}x the others' receive time")
            if self.policy.on_slow != "keep":
                log.warning("%s is %.1fx slower than the others: evicting (%s)", member, ratio, self.policy.on_slow)
                self.membership.request_evict(member, "slow")

    def _links(self, linked: list[str], timings: dict[str, tuple[float, float]],
               nbytes: int) -> dict[str, tuple[float, float]]:
        """Each linked member's link time for ``nbytes`` (least, most), from the newest probe round
        not judged yet; that round is judged once every linked member answered it."""
        probed = {m: self._control.link_seconds(m) for m in linked}
        newest = max((p[3] for p in probed.values() if p is not None), default=0)
        links: dict[str, tuple[float, float]] = {}
        for member, times in probed.items():
            if times is not None and times[2] > 0 and times[3] == newest > self._probe_round:
                low, high, probe_bytes, _round = times
                # never more than its whole receive took: on fast links the extrapolation is
                # mostly latency and scheduling noise, which this bounds. A member is judged on
                # what its link took at least against what the others' took at most: a probe whose
                # segments came at once (a shaper's burst) never makes another member's honest
                # measure look slow
                scale, whole = nbytes / probe_bytes, timings[member][0]
                links[member] = (min(low * scale, whole), min(high * scale, whole))
        if links and len(links) == len(linked):
            self._probe_round = newest  # this round has had its verdict
        return links
