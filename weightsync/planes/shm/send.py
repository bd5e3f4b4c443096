"""The ``"shm"`` plane's ends: the publisher's part (same-host members read its shared memory) and
how a member builds its :class:`~weightsync.planes.shm.plane.ShmPlane`.

The publisher's part moves nothing itself (``drives`` is False): a same-host member reads the
version where it lies in the segment its Announce names (or copies it out) while the group is
sent. A sealed snapshot is not digested for these members (see ``prepare``); with nobody in the
group the publisher then takes no pass over the version at all. A ``copy=False``
version goes through the two bucket buffers, which live in a segment of their own: a ring,
where bucket i is packed into slot i % 2 only once every same-host member said it copied
bucket i - 2 out of it.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import msgspec

from weightsync._errors import LocalFailure, PeerFailure
from weightsync.planes.dataplane import MemberContext, Outgoing, PlaneSpec, Prepared, PublisherContext, SendPart
from weightsync.planes.shm.plane import SegmentPool, ShmPlane, ShmRef, announced

#: x86 keeps one thread's stores in order for every other reader (TSO): a member that sees the
#: pipelined snapshot's ready count sees the bytes written before it
STORES_IN_ORDER = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


class ShmSend(SendPart):
    """The publisher's end for same-host members (see the module docstring)."""

    name = "shm"
    in_group, moves_alone, drives = False, True, False
    plane = None  # joins no group
    reads_in_place = True  # a snapshot's segment is the member's readable version (planes.shm)

    def __init__(self, context: PublisherContext) -> None:
        self._ctx = context
        self._segments: SegmentPool | None = context.extra.get("segments")

    def admit(self, member: str, want: Any) -> None:
        """Nothing per member: every same-host member reads the same segment."""

    def forget(self, member: str) -> None:
        """Nothing kept per member."""

    def prepare(self, out: Outgoing, members: tuple[str, ...]) -> Prepared:
        ref = self._announced(out, members)
        if ref.ring:
            return Prepared(plane=announced(ref))
        # A sealed snapshot needs no digest on either side: no other process can write it (the
        # seal), the members read or copy the very pages the publisher staged, and its epoch says
        # whether staging took the buffer back (an in-place read is then refused, never served).
        # Both digests would be taken of the same memory. Kept: the ring's (it is written under
        # the members as they copy), and a snapshot still being taken as it is announced where
        # the CPU may reorder stores (the digest catches a read that ran ahead of the data).
        proved = ref.sealed and (out.progress is None or STORES_IN_ORDER)
        return Prepared(plane=announced(ref), checked=not proved)

    def _announced(self, out: Outgoing, members: tuple[str, ...]) -> ShmRef:
        """Where ``members`` read ``out``: its snapshot's segment, or (``copy=False``) the ring, whose
        turns then wait for them."""
        if out.snapshot is None and self._segments is not None:  # copy=False: through the ring
            ref = self._ring(min(out.bucket_bytes, out.manifest.total_bytes), (out.generation, out.seq))
            out.wrap(lambda pack: self._turns(pack, members, out))
            return ref
        return self._segment_for(out)

    def move(self, out: Outgoing, members: tuple[str, ...]) -> None:
        """Nothing to move: the members copy out of the segment themselves."""

    def digests(self) -> Mapping[str, Sequence[int]]:
        return {}

    def close(self) -> None:
        """The segments belong to the publisher, which closes them after its sender thread."""

    def _ring(self, size: int, turn: Any) -> ShmRef:
        """The two bucket buffers' segment, its epoch bumped once per ``turn`` (a member still reading the
        last version stops)."""
        assert self._segments is not None
        bufs = self._ctx.buckets.get(size)
        self._segments.reuse(bufs[0], turn)
        ref = self._segments.ref(bufs[0])
        if ref is None:
            raise LocalFailure("the bucket buffers are not in shared memory")
        return msgspec.structs.replace(ref, ring=bufs[0].numel())

    def _turns(self, pack: Callable[[int], None], members: tuple[str, ...], out: Outgoing) -> Callable[[int], None]:
        """Before bucket i goes into slot i % 2: every same-host member has copied bucket i - 2 out of it
        (bounded by that bucket's deadline; PeerFailure names the late ones), then it is packed and marked."""
        assert self._segments is not None
        mark = self._segments.marker(self._ctx.buckets.get(1)[0])
        ranges = out.ranges

        def turn(i: int) -> None:
            if i >= 2:
                lo, hi = ranges[i - 2]
                late = self._ctx.control.wait_copied(members, out.generation, out.seq, i - 2,
                                                     self._ctx.deadlines.bucket(hi - lo), out.cancelled)
                if late:
                    raise PeerFailure(f"same-host members {sorted(late)} did not copy bucket {i - 2} in time")
            pack(i)
            mark(ranges[i][1])  # what members wait for: the version's bytes through bucket i are in

        return turn

    def _segment_for(self, out: Outgoing) -> ShmRef:
        """Where same-host members read the version's snapshot."""
        if self._segments is None or out.snapshot is None:
            raise LocalFailure("same-host members, but no shared memory to serve them")
        if out.progress is None:  # taken in full before it was committed (the Sender waited for it)
            self._segments.marker(out.snapshot)(out.manifest.total_bytes)
        ref = self._segments.ref(out.snapshot)
        if ref is None:
            raise LocalFailure(f"version {out.version}'s snapshot is not in shared memory")
        return ref


def member_plane(ctx: MemberContext) -> ShmPlane:
    return ShmPlane(ctx.client.shm_pid, ctx.scope, member=ctx.member, tell=ctx.client.send)


PLANE = PlaneSpec("shm", send_part=ShmSend, member_plane=member_plane)


#: versions a same-host member that stopped acknowledging may still read in place
IN_PLACE_KEPT = 3


class InPlaceLeases:
    """The versions each same-host member may read in place now: the one it acknowledged last, and
    one it was sent but did not acknowledge. Staging parks their buffers (``held``) and, over its
    bound, has the readers of a version it must write again evicted (``overdue``). The sender
    thread writes it; staging reads it under its own lock from any thread (a dict replaced per
    member, read as a copy).

    Args:
        members: the channel's members now (leases of others do not count).
        evict: has a member evicted as slow (handed to the sender thread).
        scope: the publisher's flight-recorder scope.
    """

    def __init__(self, members: Callable[[], Iterable[str]], evict: Callable[[str], None], scope: Any) -> None:
        self._leases: dict[str, frozenset[int]] = {}
        self._members, self._evict, self._rec = members, evict, scope

    def forget(self, member: str) -> None:
        self._leases.pop(member, None)

    def held(self) -> frozenset[int]:
        """Any thread (staging, under its lock): the versions the channel's members read in place now."""
        members = set(self._members())
        return frozenset(v for m, versions in list(self._leases.items()) if m in members for v in versions)

    def overdue(self, version: int) -> None:
        """Any thread (staging, over its bound): evict the members that read ``version`` in place; its
        buffer is written again now (their reads of it fail on its epoch)."""
        members = set(self._members())
        for member in [m for m, versions in list(self._leases.items()) if version in versions and m in members]:
            self._rec.record("evict", version=version, peers=(member,)).fail(
                "read a same-host snapshot past staging's bound")
            self._evict(member)

    def acknowledged(self, job: Any, members: Sequence[str], acked: set[str], still_read: Mapping[str, int],
                     reads_in_place: Callable[[str], bool], *, staged: bool = False) -> None:
        """After a version's acknowledgements: which versions its in-place readers may read now.

        Acknowledged: this version, and the older one a reader of theirs still holds (``Ack.still_read``:
        such a reader keeps that slot, so nothing newer is received into it before the next Ack
        says again). Not acknowledged, or only staged (activation "all"): any version they may
        read, this one included (the most recent :data:`IN_PLACE_KEPT`; staging bounds the rest)."""
        if job.flat is None or job.assembly is not None:
            for member in members:  # a copy into the member's own slot (a ring, a lane's part)
                if member in acked and not staged:
                    # its reader may still copy an older in-place version: that one stays still
                    kept = self._leases.pop(member, frozenset()) & {still_read.get(member, -1)}
                    if kept:
                        self._leases[member] = kept
            return
        for member in members:
            if not reads_in_place(member):
                continue
            if member in acked and not staged:
                older = still_read.get(member, -1)
                self._leases[member] = frozenset((job.version, older) if older >= 0 else (job.version,))
            else:
                known = self._leases.get(member, frozenset()) | {job.version}
                self._leases[member] = frozenset(sorted(known)[-IN_PLACE_KEPT:])

    def committed(self, version: int, members: Sequence[str]) -> None:
        """Activation "all", after the Commit: a member reads ``version``, and its readers may still
        hold the one it exposed before."""
        for member in members:
            known = self._leases.get(member)
            if known is not None and version in known:
                older = [v for v in known if v < version]
                self._leases[member] = frozenset([version, *older[-1:]])
