"""The Sender's retry policy: what one attempt's outcome says to do next (see :func:`verdict`).

Each attempt at a version ends in success or in the members to blame. The policy is a table of
rules, the first that applies wins; :func:`prepare_next` readies the attempt the step names
(re-send in full, point to point, after a leaver, or rebuild the generation: counted, logged)
and the Sender stops when the attempts allowed run out or nothing is left to re-send from.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("weightsync.publisher")


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


def done(attempt: Attempt, job: Any, gens: Any) -> None:
    """A success: a new tree where a relay was struck (its children) or an accuser moved."""
    if attempt.blamed or attempt.reorder:
        gens.advance(reason=f"version {job.version}: corrupted in the broadcast tree", failed=attempt.blamed)


def prepare_next(step: str, attempt: Attempt, job: Any, gens: Any, *, bases: Any, tally: Any, rec: Any,
                 channel: str) -> bool:
    """Ready the next attempt the step names (counted, logged, the generation rebuilt where it
    says so); False when there is nothing to re-send from (``copy=False`` tensors let go)."""
    who, version = sorted(attempt.blamed), job.version
    if step == "direct":
        tally.count("resends")
        log.warning("channel %r: version %d arrived corrupted at %s; re-sending it point to point",
                    channel, version, who)
        return True
    if step == "full":
        tally.count("delta_fallbacks")
        rec.record("delta", version=version, peers=tuple(who)).fail("the delta did not apply: re-sent in full")
        log.warning("channel %r: version %d's delta did not apply at %s; re-sending it in full", channel, version, who)
    elif step == "left":
        tally.count("resends")
        log.info("channel %r: %s left while version %d was on the wire; re-sending it to the others",
                 channel, who, version)
        gens.advance(reason=f"version {version}: {who} left mid-version", failed=())
    else:  # "rebuild": the group is broken; rebuilt with the live members, the version re-sent
        tally.count("resends")
        log.warning("channel %r: version %d failed for %s; re-sending it to the others (attempt %d); "
                    "flight recorder: %s", channel, version, who, attempt.tries + 2,
                    rec.recorder.last_dump_path or "no dump")
        gens.advance(reason=f"version {version} failed", failed=attempt.blamed)
    return bool(bases.resendable(job))
