"""Merge every rank's flight-recorder dump and say where a weight push stopped.

Input: the ``.wsfr`` files of one run (one per process). Output: an :class:`Analysis` with,
per channel and version, the last state each member reached; the first (version, bucket)
where members diverge; and the likely culprits. A culprit is a member that never finished a
bucket the others finished, that never acknowledged, whose heartbeats stopped, or whose dump
is missing (a stopped or killed process cannot write one), named with version and bucket.
The stalled bucket of a member without a dump is the publisher's first bucket of that
version that never completed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import msgspec

from weightsync.pg.recorder import COMPLETED, DUMP_SUFFIX, STARTED, Dump, Entry, load_dump

PUBLISHER = "publisher"


class Culprit(msgspec.Struct):
    channel: str
    member: str
    version: int
    bucket: int  # -1: after the last bucket (received but never acknowledged) or unknown
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


class Analysis(msgspec.Struct):
    ok: bool
    dumps: list[str]
    ranks: list[str]
    missing_dumps: list[str]
    versions: list[VersionStatus]
    first_divergence: Divergence | None
    culprits: list[Culprit]
    failures: list[str]


def _about(entry: Entry) -> str:
    """Whom a failed entry is about, where it names peers (a trainer rank, a member)."""
    return f" [{', '.join(entry.peers[:4])}]" if entry.peers else ""


def load_dir(directory: str | Path) -> list[Dump]:
    """Every dump in ``directory``; ValueError naming the first unreadable file or an empty dir."""
    path = Path(directory)
    if not path.is_dir():
        raise ValueError(f"{directory}: not a directory")
    files = sorted(path.glob(f"*{DUMP_SUFFIX}"))
    if not files:
        raise ValueError(f"{directory}: no flight-recorder dumps (*{DUMP_SUFFIX}) in it")
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
    return "never started", highest, -1


def analyze(dumps: Iterable[Dump], names: Iterable[str] = ()) -> Analysis:
    dumps = list(dumps)
    entries_by_member: dict[str, list[Entry]] = defaultdict(list)
    for dump in dumps:
        for entry in dump.entries:
            entries_by_member[entry.member].append(entry)
    for entries in entries_by_member.values():
        entries.sort(key=lambda e: (e.t_scheduled, e.seq))
    publisher = entries_by_member.get(PUBLISHER, [])
    announces = [e for e in publisher if e.op == "announce"]
    expected = sorted({p for e in announces for p in e.peers})
    missing = [m for m in expected if m not in entries_by_member]
    if not publisher:
        missing = [PUBLISHER, *missing]
    failures = [f"{e.member}: {e.op}{_about(e)} v{e.version} b{e.bucket} {e.state}: {e.error}"
                for es in entries_by_member.values() for e in es if e.state not in (COMPLETED, STARTED, "scheduled")]
    versions: list[VersionStatus] = []
    culprits: list[Culprit] = []
    divergence: Divergence | None = None
    silent = {p for e in publisher if e.op == "heartbeat" and e.state != COMPLETED for p in e.peers}
    for ann in announces:
        acks = [e for e in publisher if e.op == "ack" and e.version == ann.version and e.generation == ann.generation]
        acked_all = bool(acks) and acks[-1].state == COMPLETED
        sends = [e for e in publisher if e.op == "bucket_send" and e.version == ann.version
                 and e.generation == ann.generation]
        stalled_send = min((e.bucket for e in sends if e.state != COMPLETED), default=-1)
        status: dict[str, str] = {}
        finished_buckets: dict[str, int] = {}
        for member in ann.peers:
            if member not in entries_by_member:
                status[member] = "no dump"
                continue
            mine = [e for e in entries_by_member[member] if e.generation in (ann.generation, -1)]
            words, highest, _ = _member_progress(mine, ann.version)
            status[member] = words
            finished_buckets[member] = highest
        versions.append(VersionStatus(ann.channel, ann.version, ann.generation, status))
        if acked_all:
            continue
        silent_now = _blamed(publisher, ann, "ack_missing") | {m for m in ann.peers if status.get(m) == "no dump"} | (
            silent & set(ann.peers))
        if silent_now:  # whoever went silent is the cause; members that failed waiting are victims
            for member in sorted(silent_now):
                reasons = [r for r, c in (("its dump is missing", status.get(member) == "no dump"),
                                          ("its heartbeats stopped", member in silent),
                                          ("it never acknowledged", member in _blamed(publisher, ann, "ack_missing")
                                           or status.get(member) == "no dump")) if c]
                culprits.append(Culprit(ann.channel, member, ann.version, stalled_send, ann.generation,
                                        "stopped or died: " + ", ".join(reasons)))
        else:  # everyone answered, some with a failure: those are the culprits
            for member in sorted(_blamed(publisher, ann, "nack")):
                nxt = finished_buckets.get(member, -1) + 1
                culprits.append(Culprit(ann.channel, member, ann.version, nxt, ann.generation,
                                        f"{status.get(member, '?')}; acknowledged a failure"))
        if divergence is None:
            divergence = _first_divergence(ann, finished_buckets, status, stalled_send)
    ok = not culprits and not failures and not missing and all(
        any(e.op == "ack" and e.version == a.version and e.state == COMPLETED for e in publisher) for a in announces)
    return Analysis(ok=ok, dumps=list(names), ranks=sorted(entries_by_member), missing_dumps=missing,
                    versions=versions, first_divergence=divergence, culprits=_dedupe(culprits), failures=failures)


def _blamed(publisher: list[Entry], ann: Entry, op: str) -> set[str]:
    """Members the publisher recorded under ``op`` (ack_missing, nack) for this announcement."""
    return {p for e in publisher if e.op == op and e.version == ann.version and e.generation == ann.generation
            for p in e.peers}


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
    behind = sorted(m for m in members if not status[m].startswith(("published", "received")))
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


def render(analysis: Analysis) -> str:
    """The analysis as text for people."""
    lines = [f"dumps: {len(analysis.dumps)}   ranks: {', '.join(analysis.ranks)}"]
    if analysis.missing_dumps:
        lines.append(f"missing dumps: {', '.join(analysis.missing_dumps)} (stopped, killed, or never dumped)")
    for vs in analysis.versions:
        lines.append(f"{vs.channel} v{vs.version} (generation {vs.generation}):")
        for member, words in sorted(vs.members.items()):
            lines.append(f"    {member:<24} {words}")
    if analysis.first_divergence:
        d = analysis.first_divergence
        lines.append(f"first divergence: {d.channel} v{d.version} bucket {d.bucket}: finished by "
                     f"{d.finished or 'nobody'}, not by {d.not_finished}")
    for c in analysis.culprits:
        where = f"bucket {c.bucket}" if c.bucket >= 0 else "after its last bucket"
        lines.append(f"LIKELY CULPRIT: {c.member} at {c.channel} v{c.version} {where} "
                     f"(generation {c.generation}): {c.reason}")
    if analysis.failures and not analysis.culprits:
        lines.append("failures:")
        lines.extend(f"    {f}" for f in analysis.failures[:20])
    lines.append("verdict: " + ("nothing wrong found" if analysis.ok else "stall or failure found"))
    return "\n".join(lines)
