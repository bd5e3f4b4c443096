"""Blame for bytes corrupted in gloo's broadcast tree: evidence, never one member's word.

gloo broadcasts down a binomial tree, so members relay each other's bytes. A version whose bytes
reached some members corrupted through the tree is sent again point to point, in the same
generation (the Sender does that); a member whose copy was corrupt in the tree and intact point to
point was fed bad bytes on the way, and by its own word the relay above it is to blame
(:func:`~weightsync.membership.generations.relay_suspects`). But that word is all there is: an
insider that acks every tree copy "corrupt" and every direct one "ok" framed its healthy parent,
which was evicted after two versions (two honest members of seven within three versions). So:

1. **A relay is struck only on two members' word.** The first accusation moves the accuser right
   under the publisher for the next generation (swapped with a member there that is not the
   accused), so another member takes its place under the accused relay. A relay that really
   corrupts what it forwards corrupts the new child's copy too: a second accuser, and a strike.
2. **Bytes straight from the publisher are the accuser's own.** A member whose parent is the
   publisher and whose tree copy was corrupt while its direct one was intact has nobody above it
   to blame: its word, or its own link. It is struck. A moved liar strikes itself this way.
3. **An accuser pays as much as the accused.** A member that accused two different relays, neither
   of which anyone else accused, is struck.

Strikes are counted apart from the ordinary ones (a relay's own acknowledgements are fine, so
they would reset those); ``MAX_STRIKES`` of them evict the member as "failed". An honest child of
a corrupting relay is never struck (its parent is not the publisher, and its accusation is
corroborated by the next child's), and a relay framed by one liar never is. Two insiders that
accuse the same honest relay together are beyond this rule: they corroborate each other.

The alternative rejected: striking accuser and accused alike on every accusation. It costs a
corrupting relay's honest child its membership with the relay.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import msgspec

from weightsync.membership.membership import MAX_STRIKES

Parent = Callable[[int], "int | None"]  # rank -> the rank that forwards its bytes (0: the publisher)


class Verdict(msgspec.Struct, frozen=True):
    """What one tree-corrupted version says, once its point-to-point re-send is in."""

    struck: dict[str, str]  # member -> why (each gets one strike)
    evict: tuple[str, ...]  # members that reached MAX_STRIKES
    swaps: tuple[tuple[str, str], ...]  # (accuser, member) pairs to swap in the group's order
    accused: dict[str, tuple[str, ...]]  # relay -> who accused it this time (recorded, not yet evidence)


class RelayBlame:
    """Owned by the publisher's sender thread: the accusations and strikes of the broadcast tree."""

    def __init__(self) -> None:
        self._accusers: dict[str, set[str]] = {}  # relay -> the members that ever accused it
        self._accused: dict[str, set[str]] = {}  # accuser -> the relays it accused
        self._strikes: dict[str, int] = {}

    def forget_all_but(self, members: Iterable[str]) -> None:
        """Drop what is known of members no longer in the channel (a newcomer starts clean)."""
        keep = set(members)
        self._strikes = {m: n for m, n in self._strikes.items() if m in keep}
        self._accusers = {m: a & keep for m, a in self._accusers.items() if m in keep}
        self._accused = {m: a & keep for m, a in self._accused.items() if m in keep}

    def strikes(self, member: str) -> int:
        return self._strikes.get(member, 0)

    def judge(self, group: tuple[str, ...], corrupt_in_tree: set[str], corrupt_direct: set[str],
              parent: Parent) -> Verdict:
        """One version's evidence: ``group`` (position i is rank i + 1; 0 is the publisher), who got
        it corrupt through the tree, who got it corrupt again point to point, and the tree."""
        struck: dict[str, str] = {}
        accused: dict[str, set[str]] = {}
        for member in sorted(corrupt_in_tree - corrupt_direct):
            if member not in group:
                continue
            up = parent(group.index(member) + 1)
            if up is None:
                continue  # the tree is not known (NCCL): nobody is judged
            while up > 0 and group[up - 1] in corrupt_in_tree:
                up_next = parent(up)
                if up_next is None:
                    break
                up = up_next
            if up == 0:
                if parent(group.index(member) + 1) == 0:  # straight from the publisher: its own word or link
                    struck[member] = "its copy straight from the publisher was corrupt in the tree and intact " \
                                     "point to point"
                continue  # below a corrupted member fed by the publisher: a victim of that one
            accused.setdefault(group[up - 1], set()).add(member)
        swaps: list[tuple[str, str]] = []
        moved: set[str] = set()
        for relay, accusers in sorted(accused.items()):
            before = self._accusers.setdefault(relay, set())
            if len(before | accusers) >= 2:  # two members' word: evidence
                struck.setdefault(relay, f"accused by {len(before | accusers)} members of forwarding corrupted bytes")
            else:
                for accuser in sorted(accusers):
                    other = {r for r in self._accused.get(accuser, set()) if r != relay
                             and self._accusers.get(r, set()) <= {accuser}}
                    if other:
                        struck.setdefault(accuser, f"accused {len(other) + 1} relays nobody else accused")
                    swap = _root_child(group, parent, avoid={relay, accuser} | moved)
                    if swap is not None:
                        swaps.append((accuser, swap))
                        moved |= {accuser, swap}
            before |= accusers
            for accuser in accusers:
                self._accused.setdefault(accuser, set()).add(relay)
        evict = []
        for member in struck:
            self._strikes[member] = self._strikes.get(member, 0) + 1
            if self._strikes[member] >= MAX_STRIKES:
                evict.append(member)
        return Verdict(struck=struck, evict=tuple(sorted(evict)), swaps=tuple(swaps),
                       accused={r: tuple(sorted(a)) for r, a in accused.items()})


def _root_child(group: tuple[str, ...], parent: Parent, avoid: set[str]) -> str | None:
    """The member of the lowest rank the publisher feeds directly, other than those in ``avoid``."""
    for rank in range(1, len(group) + 1):
        if parent(rank) == 0 and group[rank - 1] not in avoid:
            return group[rank - 1]
    return None
