"""Merge every rank's flight-recorder dump and say where a weight push stopped.

Input: the ``.wsfr`` files of one run (one per process). Output: an :class:`Analysis` with,
per channel and version, the last state each member reached; the first (version, bucket)
where members diverge; and the likely culprits. A culprit is a member that never finished a
bucket the others finished, that never acknowledged, whose heartbeats stopped, or whose dump
is missing (a stopped or killed process cannot write one), named with version and bucket.
The stalled bucket of a member without a dump is the publisher's first bucket of that
version that never completed.

Healthy processes dump nothing (dumps are written on trouble, on demand, or at a close when
asked), so a member without a dump that the publisher saw acknowledge a version is fine there,
not missing. A member id used by several processes (a replacement given the dead member's id, a
rejoin) is one incarnation per dump: each version is read from the dump that took part in its
generation. The cause of a death is the one the publisher observed (its connection closed, or
it fell silent).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import msgspec

from weightsync.recorder.recorder import COMPLETED, DUMP_SUFFIX, STARTED, Dump, Entry, load_dump

PUBLISHER = "publisher"
MAX_DUMPS = 4096  # dumps in one folder: one per process of a run


class Culprit(msgspec.Struct):
    channel: str
    member: str
    version: int
    bucket: int | None  # None: after its last bucket (received, never acknowledged) or not known
    generation: int
    reason: str


class Divergence(msgspec.Struct):
    channel: str
    version: int
    bucket: int
    finished: list[str]
    not_finished: list[str]


class VersionStatus(msgspec.Struct):
    channel: str
    version: int
    generation: int
    members: dict[str, str]  # member -> last state reached, in words
    delivered: bool = True  # every member acknowledged it


class Death(msgspec.Struct):
    """A member the publisher saw go: its connection closed, or it fell silent."""

    channel: str
    member: str
    time: float
    cause: str


class Analysis(msgspec.Struct):
    ok: bool
    dumps: list[str]
    ranks: list[str]
    missing_dumps: list[str]
    versions: list[VersionStatus]
    first_divergence: Divergence | None
    culprits: list[Culprit]
    failures: list[str]
    deaths: list[Death] = []
    #: members that said goodbye while a version was on the wire (``Subscriber.abort()``): not culprits
    departures: list[str] = []
    incarnations: dict[str, int] = {}  # member -> how many processes (dumps) spoke for it, where more than one


def _about(entry: Entry) -> str:
    """Whom a failed entry is about, where it names peers (a trainer rank, a member)."""
    return f" [{', '.join(entry.peers[:4])}]" if entry.peers else ""


def _where(entry: Entry) -> str:
    """`` v3 bucket 1`` as far as the entry names a version and a bucket (they are -1 when it does not)."""
    version = f" v{entry.version}" if entry.version >= 0 else ""
    return version + (f" bucket {entry.bucket}" if entry.bucket >= 0 else "")


def load_dir(directory: str | Path) -> list[Dump]:
    """Every dump in ``directory``; ValueError naming the first unreadable file or an empty dir."""
    path = Path(directory)
    if not path.is_dir():
        raise ValueError(f"{directory}: not a directory")
    files = sorted(path.glob(f"*{DUMP_SUFFIX}"))
    if not files:
        raise ValueError(f"{directory}: no flight-recorder dumps (*{DUMP_SUFFIX}) in it")
    if len(files) > MAX_DUMPS:
        raise ValueError(f"{directory}: {len(files)} dumps, more than one run writes (at most {MAX_DUMPS}); "
                         "point at one run's folder")
    return [load_dump(f) for f in files]


def _member_progress(entries: list[Entry], version: int) -> tuple[str, int, int]:
    """(words, highest completed bucket, first unfinished bucket or -1) for one member."""
    buckets = [e for e in entries if e.op == "bucket_recv" and e.version == version]
    done = [e.bucket for e in buckets if e.state == COMPLETED]
    unfinished = sorted(e.bucket for e in buckets if e.state != COMPLETED)
    highest = max(done, default=-1)
    if any(e.op == "publish" and e.version == version for e in entries):
        return "published", highest, -1
    receive = [e for e in entries if e.op == "receive" and e.version == version]
    if receive and receive[-1].state == COMPLETED:
        return "received (already had it)", highest, -1
    if unfinished:
        first = unfinished[0]
        state = next(e.state for e in buckets if e.bucket == first and e.state != COMPLETED)
        what = "waiting in" if state == STARTED else state + " at"
        return f"{what} bucket {first}", highest, first
    if receive:
        return f"receive {receive[-1].state}", highest, -1
    if highest >= 0:
        return f"received through bucket {highest}, never readable", highest, -1
    return "never started", highest, -1


def _cause(error: str) -> str:
    """The publisher's heartbeat failure, in words: how it saw the member go."""
    if error.startswith("connection closed"):
        return "its connection closed (it exited or was killed)"
    if error.startswith("silent"):
        return f"its heartbeats stopped ({error})"
    return f"its connection failed ({error})"


def analyze(dumps: Iterable[Dump], names: Iterable[str] = ()) -> Analysis:
    dumps = list(dumps)
    entries_by_member: dict[str, list[Entry]] = defaultdict(list)
    incarnations: dict[str, list[list[Entry]]] = defaultdict(list)  # member -> one entry list per dump
    for dump in dumps:
        own: dict[str, list[Entry]] = defaultdict(list)
        for entry in dump.entries:
            entries_by_member[entry.member].append(entry)
            own[entry.member].append(entry)
        for member, entries in own.items():
            incarnations[member].append(entries)
    for entries in entries_by_member.values():
        entries.sort(key=lambda e: (e.t_scheduled, e.seq))
    publisher = entries_by_member.get(PUBLISHER, [])
    announces = [e for e in publisher if e.op == "announce"]
    by_key, indexed = _index(publisher, incarnations)
    failures = [f"{e.member}: {e.op}{_about(e)}{_where(e)} {e.state}: {e.error}"
                for es in entries_by_member.values() for e in es
                if e.state not in (COMPLETED, STARTED, "scheduled")
                and not (e.op == "heartbeat" and e.member == PUBLISHER)]  # those are the deaths
    versions: list[VersionStatus] = []
    culprits: list[Culprit] = []
    divergence: Divergence | None = None
    deaths = [Death(e.channel, p, e.t_scheduled, _cause(e.error))  # recorded as it failed
              for e in publisher if e.op == "heartbeat" and e.state != COMPLETED for p in e.peers]
    cause = {d.member: d.cause for d in reversed(deaths)}  # the first one observed
    died_at = {d.member: d.time for d in reversed(deaths)}
    left_at: dict[str, list[float]] = defaultdict(list)  # the publisher applied their Leave then
    for e in publisher:
        if e.op == "leave":
            for p in e.peers:
                left_at[p].append(e.t_scheduled)
    departures: list[str] = []
    unaccounted: set[str] = set()  # members without a dump that did not acknowledge some version
    for i, ann in enumerate(announces):
        # a death concerns the versions announced around it (from the one before to the one after)
        window = (announces[i - 1].t_scheduled if i else float("-inf"),
                  announces[i + 1].t_scheduled if i + 1 < len(announces) else float("inf"))
        dying = {m for m in ann.peers if m in died_at and window[0] <= died_at[m] <= window[1]}
        leaving = {m for m in ann.peers if any(ann.t_scheduled <= t <= window[1] for t in left_at.get(m, ()))}
        acks = by_key.get(("ack", ann.version, ann.generation), [])
        acked_all = bool(acks) and acks[-1].state == COMPLETED
        missing_ack, nacked = _blamed(by_key, ann, "ack_missing"), _blamed(by_key, ann, "nack")
        blamed = missing_ack | nacked
        sends = by_key.get(("bucket_send", ann.version, ann.generation), [])
        stalled_send = min((e.bucket for e in sends if e.state != COMPLETED), default=-1)
        status: dict[str, str] = {}
        finished_buckets: dict[str, int] = {}
        for member in ann.peers:
            if member in leaving and not acked_all:
                status[member] = "left while the version was on the wire (said goodbye)"
                departures.append(f"{member} at {ann.channel} v{ann.version} (generation {ann.generation})")
                continue
            mine = _incarnation(indexed.get(member, []), ann)
            if mine is None:
                if acks and member not in blamed and (acked_all or member not in dying):
                    status[member] = "acknowledged (no dump of its own)"
                else:
                    status[member] = "no dump"
                    unaccounted.add(member)
                continue
            words, highest, _ = _member_progress(mine, ann.version)
            status[member] = words
            finished_buckets[member] = highest
        versions.append(VersionStatus(ann.channel, ann.version, ann.generation, status, delivered=acked_all))
        if acked_all:
            continue
        silent_now = (missing_ack | dying
                      | {m for m in ann.peers if status.get(m) == "no dump"}) - leaving
        stalled = stalled_send if stalled_send >= 0 else None
        if silent_now:  # whoever went silent is the cause; members that failed waiting are victims
            for member in sorted(silent_now):
                reasons = [r for r, c in ((cause.get(member, ""), member in dying),
                                          ("its dump is missing", status.get(member) == "no dump"),
                                          ("it never acknowledged", member in missing_ack
                                           or status.get(member) == "no dump")) if c]
                culprits.append(Culprit(ann.channel, member, ann.version, stalled, ann.generation,
                                        "stopped or died: " + ", ".join(reasons)))
        elif not leaving:  # everyone answered, some with a failure: those are the culprits (else the
            # members that left broke the version for the others: nobody is to blame)
            for member in sorted(nacked):
                nxt = finished_buckets.get(member, -1) + 1
                culprits.append(Culprit(ann.channel, member, ann.version, nxt, ann.generation,
                                        f"{status.get(member, '?')}; acknowledged a failure"))
        if divergence is None:
            divergence = _first_divergence(ann, finished_buckets, status, stalled_send)
    missing = sorted(unaccounted) if publisher else [PUBLISHER, *sorted({p for e in announces for p in e.peers}
                                                                        - set(entries_by_member))]
    ok = not culprits and not failures and not missing and not deaths and all(v.delivered for v in versions)
    return Analysis(ok=ok, dumps=list(names), ranks=sorted(entries_by_member), missing_dumps=missing,
                    versions=versions, first_divergence=divergence, culprits=_dedupe(culprits), failures=failures,
                    departures=departures,
                    deaths=deaths, incarnations={m: len(i) for m, i in sorted(incarnations.items()) if len(i) > 1})


def _index(publisher: list[Entry], incarnations: dict[str, list[list[Entry]]]) -> tuple[
        dict[tuple[str, int, int], list[Entry]], dict[str, list[_Incarnation]]]:
    """The publisher's entries by (op, version, generation), and each member's incarnations indexed:
    each version's analysis then reads only its own entries."""
    by_key: dict[tuple[str, int, int], list[Entry]] = defaultdict(list)
    for e in publisher:
        by_key[(e.op, e.version, e.generation)].append(e)
    return by_key, {member: [_Incarnation(entries) for entries in lists] for member, lists in incarnations.items()}


class _Incarnation:
    """One process's entries for one member, indexed by (generation, version) once: the analysis
    of each version then reads only its own entries (200k entries analyze in seconds)."""

    def __init__(self, entries: list[Entry]) -> None:
        self.by: dict[tuple[int, int], list[Entry]] = defaultdict(list)
        for e in entries:
            self.by[(e.generation, e.version)].append(e)
        self.generations = {g for g, _ in self.by}

    def of(self, generation: int, version: int) -> list[Entry]:
        both = self.by.get((generation, version), []) + self.by.get((-1, version), [])
        return sorted(both, key=lambda e: e.seq)


def _incarnation(dumps: list[_Incarnation], ann: Entry) -> list[Entry] | None:
    """The entries about ``ann``'s version of the process that spoke for a member in its generation
    (None: none did).

    Same-host members record their copies without a generation (-1): those count where the
    process has nothing of another generation for that version."""
    for inc in dumps:
        if ann.generation in inc.generations:
            return inc.of(ann.generation, ann.version)
    for inc in dumps:
        if (-1, ann.version) in inc.by:
            return list(inc.by[(-1, ann.version)])
    return None


def _blamed(by_key: dict[tuple[str, int, int], list[Entry]], ann: Entry, op: str) -> set[str]:
    """Members the publisher recorded under ``op`` (ack_missing, nack) for this announcement."""
    return {p for e in by_key.get((op, ann.version, ann.generation), ()) for p in e.peers}


def _first_divergence(ann: Entry, finished: dict[str, int], status: dict[str, str],
                      stalled_send: int) -> Divergence | None:
    members = list(ann.peers)
    if not members:
        return None
    # a member without a dump is taken to have stopped where the publisher's send stalled
    reach = {m: finished.get(m, (stalled_send - 1) if status.get(m) == "no dump" else -1) for m in members}
    top = max(reach.values())
    for bucket in range(top + 1):
        done = sorted(m for m in members if reach[m] >= bucket)
        if len(done) != len(members):
            return Divergence(ann.channel, ann.version, bucket, done, sorted(set(members) - set(done)))
    behind = sorted(m for m in members if not status[m].startswith(("published", "received (already", "acknowledged")))
    if behind:
        return Divergence(ann.channel, ann.version, top + 1, sorted(set(members) - set(behind)), behind)
    return None


def _dedupe(culprits: list[Culprit]) -> list[Culprit]:
    seen: set[tuple[str, str]] = set()
    out = []
    for c in culprits:  # the first version where a member got stuck is the one that matters
        if (c.channel, c.member) not in seen:
            seen.add((c.channel, c.member))
            out.append(c)
    return out


def render(analysis: Analysis, *, details: bool = False, limit: int = 8) -> str:
    """The analysis as text for people: a summary first (the run, deaths, culprits, where members
    diverged), then the versions that had trouble (at most ``limit``; every version with
    ``details``), the verdict last."""
    lines = [f"dumps: {len(analysis.dumps)}   ranks: {', '.join(analysis.ranks)}"]
    if analysis.incarnations:
        lines.append("member ids used by several processes (a replacement or a rejoin): " + ", ".join(
            f"{m} ({n})" for m, n in analysis.incarnations.items()))
    if analysis.missing_dumps:
        lines.append(f"missing dumps: {', '.join(analysis.missing_dumps)} (stopped, killed, or never dumped)")
    if analysis.versions:
        troubled = [v for v in analysis.versions if not v.delivered]
        numbers = sorted({v.version for v in analysis.versions})
        delivered = {v.version for v in analysis.versions if v.delivered}
        resent = len(analysis.versions) - len(numbers)
        lines.append(f"versions {numbers[0]}-{numbers[-1]}: {len(numbers)} sent"
                     + (f" ({resent} re-sent)" if resent else "") + f", {len(delivered)} delivered to every member"
                     + (", not at first: " + ", ".join(f"v{v.version} (generation {v.generation})"
                                                       for v in troubled[:limit])
                        + (" ..." if len(troubled) > limit else "") if troubled else ""))
    for death in analysis.deaths:
        lines.append(f"died: {death.member} ({death.channel}): {death.cause}")
    for departure in analysis.departures:
        lines.append(f"left mid-version: {departure} (said goodbye; re-sent to the others)")
    for c in analysis.culprits:
        where = f"bucket {c.bucket}" if c.bucket is not None else "after its last bucket"
        lines.append(f"LIKELY CULPRIT: {c.member} at {c.channel} v{c.version} {where} "
                     f"(generation {c.generation}): {c.reason}")
    if analysis.first_divergence:
        d = analysis.first_divergence
        lines.append(f"first divergence: {d.channel} v{d.version} bucket {d.bucket}: finished by "
                     f"{d.finished or 'nobody'}, not by {d.not_finished}")
    shown = analysis.versions if details else [v for v in analysis.versions if not v.delivered][:limit]
    for vs in shown:
        lines.append(f"{vs.channel} v{vs.version} (generation {vs.generation}):")
        for member, words in sorted(vs.members.items()):
            lines.append(f"    {member:<24} {words}")
    if not details and len(shown) < len(analysis.versions):
        lines.append("(every version, member by member: --details)")
    if analysis.failures and not analysis.culprits:
        lines.append("failures:")
        lines.extend(f"    {f}" for f in analysis.failures[:20])
    lines.append("verdict: " + ("nothing wrong found" if analysis.ok else "stall or failure found"))
    return "\n".join(lines)
