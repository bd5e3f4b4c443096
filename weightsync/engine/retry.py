"""The Sender's retry policy: what one attempt's outcome says to do next (see :func:`verdict`).

Each attempt at a version ends in success or in the members to blame. The policy is a table of
rules, the first that applies wins; the Sender acts on the step it names (re-send in full,
point to point, after a leaver, or rebuild the generation) and stops when the attempts allowed
run out or nothing is left to re-send from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class Attempt:
    """Where one version's attempts stand."""

    budget: int = 3  # attempts allowed; a re-send in full or after a leaver adds one
    tries: int = 0
    direct: bool = False  # point to point: finding who corrupted the last attempt's bytes
    full: bool = False  # in full: the last attempt's delta did not apply for some members
    tree: tuple[tuple[str, ...], set[str]] | None = None  # the broadcast attempt's group and its corrupt
    blamed: set[str] = dataclasses.field(default_factory=set)  # the members the last outcome blames
    reorder: bool = False  # the last outcome changes the group's order (an accuser moved)


def verdict(attempt: Attempt, job: Any, failed: set[str] | None, gens: Any, *, bases: Any, scoring: Any,
            members: Sequence[str], leavers: Callable[[set[str]], set[str]]) -> str:
    """What an attempt's outcome (``failed``: None on success, else whom to blame) says to do
    next; the first rule that applies:

    ========  =====================================================================================
    full      every failure is a member whose delta did not apply (no such base, a corrupted or
              forged delta, a wrong reconstruction): the same version in full, in this generation,
              costing nobody a strike; they hold no base until they acknowledge it ("stop" when
              nothing is left to re-send it from)
    done      success (a point-to-point re-send's relay verdict may still reorder the group)
    direct    only corrupt bytes, through the broadcast tree of 3 or more: the same version
              point to point in this generation; only then is it known whose fault they were
    left      a member left mid-version (its abort()): the others failed waiting on it; no
              strike, no dump, no WARNING, the attempt not counted
    rebuild   the generation is rebuilt without the blamed, and the version re-sent
    ========  =====================================================================================

    ``attempt`` is updated: whom the step blames, what the next attempt is.
    """
    corrupt = set(gens.last_corrupt)
    if failed and not attempt.full and bases.sent_delta and failed <= corrupt:
        bases.forget(*failed)
        attempt.full, attempt.blamed = True, failed
        attempt.budget += 1
        return "full" if bases.resendable(job) else "stop"
    relays: set[str] = set()
    attempt.reorder = False
    if attempt.tree is not None:  # the point-to-point attempt tells a corrupting relay from a bad member
        relays, attempt.reorder = scoring.relays(job.version, attempt.tree, corrupt, gens.plane.broadcast_parent)
        attempt.tree, attempt.direct = None, False
    attempt.blamed = relays
    if failed is None:
        return "done"
    group = gens.group_of(tuple(members))
    if corrupt and corrupt == failed and not relays and len(group) > 2 and bases.resendable(job):
        attempt.tree, attempt.direct, attempt.blamed = (group, corrupt), True, corrupt
        return "direct"
    attempt.blamed = failed | relays
    left = leavers(attempt.blamed)
    if left:
        attempt.blamed = left  # the step names only those that left: the others were their victims
        attempt.budget += 1
        return "left"
    return "rebuild"
