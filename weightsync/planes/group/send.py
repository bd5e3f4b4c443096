"""The ``"group"`` plane's ends: the publisher's part (broadcast, or point to point for sliced members)
and how a member builds its :class:`~weightsync.planes.group.plane.GroupPlane`.

Broadcast members and point-to-point members (sliced receive) are one part, not two: they share
the generation's one communicator, and while a sliced member is in a generation every member of
it is sent its bytes point to point (docs/sharding.md says why not a broadcast then), so which
of the two a version takes is decided per version by who is in it, not per member. Point to
point, each sliced member's encoding is its own (where the version's encoding codes shares, its
encoder's ``share``: the built-in deltas send a delta of its share where it holds its share of the
base), named in an Announce of its own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from weightsync import _wire
from weightsync._errors import ProtocolError
from weightsync.encodings import registry
from weightsync.format import slicing
from weightsync.format.checksum import checksum
from weightsync.options import MAX_STREAMS, valid_streams
from weightsync.planes.dataplane import (
    MemberContext,
    Outgoing,
    PlaneSpec,
    Prepared,
    PublisherContext,
    SendPart,
    Transfer,
)
from weightsync.planes.group.plane import GroupPlane


class GroupSend(SendPart):
    """The publisher's end of the group: rank 0 of every generation (see the module docstring)."""

    name = "group"
    in_group, moves_alone, drives = True, False, True

    def __init__(self, context: PublisherContext) -> None:
        self._ctx = context
        self.plane = context.make_plane()
        self.wants: dict[str, tuple[_wire.Want, ...]] = {}  # sliced members' boxes, from their Join
        self._gathers = slicing.GatherBuffers()  # per sliced member: two buffers its runs are gathered into
        self._fanout: slicing.Fanout | None = None
        self._wire: Sequence[torch.Tensor] = ()
        self._form: tuple[str, int] = ("full", -1)  # the version's encoding and base, for the recorder

    def admit(self, member: str, want: Any) -> None:
        if want is None:
            self.wants.pop(member, None)
        else:
            self.wants[member] = want

    def forget(self, member: str) -> None:
        self.wants.pop(member, None)

    def refusal(self, want: Any, published: tuple[int, _wire.Manifest]) -> str | None:
        """A sliced member's boxes that do not fit the newest version put (a tensor it lacks,
        another shape, boxes that overlap): refused at the door, before it waits for a version."""
        version, full = published
        try:
            slicing.sliced_manifest(full, want)
        except ValueError as err:
            return f"want= does not fit version {version}: {err}"
        return None

    def prepare(self, out: Outgoing, members: tuple[str, ...]) -> Prepared:
        plans = {m: self._plan(m, out) for m in members if m in self.wants}
        self._fanout = None
        if not (plans or out.point_to_point):  # one broadcast, in the version's encoding
            wire = out.encoded(members)
            self._wire, self._form = wire.wire, (wire.encoding, wire.base)
            return Prepared(coding=wire.coding(out.encoding))
        # point to point: each member is sent its gathered share of the staged bytes ("full"), or
        # coded by the encoding's own share coder (the deltas: a delta of its share of the base)
        self._wire, self._form = out.buckets, ("full", -1)
        device = out.buckets[0].device if out.buckets else self._ctx.buckets.device
        coders, each = {}, {}
        share = registry.encoder(out.encoding).share
        for member, plan in plans.items():
            made = None if plan is None else share(out, member, plan, self.wants[member])
            if made is not None:
                coders[member], each[member] = made
        fanout = slicing.Fanout(members, plans, self._gathers.for_plans(plans, device),
                                functools.partial(checksum, kind=out.digest), coders)
        self._fanout = fanout
        if coders:
            coding = next(iter(each.values()))
            self._form = (coding.name, coding.base)

            def outer(inner: Callable[[int], None]) -> Callable[[int], None]:
                def packed_then_encoded(i: int) -> None:
                    inner(i)
                    fanout.encode(i, out.buckets[i])
                return packed_then_encoded

            out.wrap(outer)
        out.afters.append(lambda i: fanout.done(i, out.checksum))
        return Prepared(direct=True, each=each)

    def move(self, out: Outgoing, members: tuple[str, ...]) -> None:
        transfer = Transfer(out.version, self._wire, out.deadline, before=out.before, after=out.after,
                            cancelled=out.cancelled, encoding=self._form[0], base=self._form[1])
        fanout = self._fanout
        try:
            if fanout is None:
                self.plane.move(transfer)
            else:
                self.plane.send_each(transfer, lambda i: fanout.sends(i, out.buckets[i]))
        finally:
            self._wire = ()  # the staged bytes are not held past the version (their segment unmaps with them)

    def digests(self) -> Mapping[str, Sequence[int]]:
        return {} if self._fanout is None else self._fanout.digests

    def wire_of(self) -> Mapping[str, int]:
        """Per member sent its share point to point: the bytes that put on the wire for it."""
        return {} if self._fanout is None else self._fanout.wire

    def close(self) -> None:
        """The plane is closed by Generations, which formed its groups."""

    def _plan(self, member: str, out: Outgoing) -> list[list[slicing.Run]] | None:
        """A sliced member's runs of each bucket; None (nothing sent) when its boxes do not fit this
        version: the member finds that out itself and stops with a clear error."""
        full = out.manifest if out.assembly is None else out.assembly.manifest
        try:
            return slicing.cached_routes(out.manifest, None if out.assembly is None else out.assembly.pieces,
                                          full, self.wants[member], tuple(out.ranges))
        except ValueError as err:
            self._ctx.scope.record("send", version=out.version, peers=(member,)).fail(
                f"its want= does not fit: {err}")
            return None


def member_plane(ctx: MemberContext) -> GroupPlane:
    streams = ctx.admit.settings.streams
    if not valid_streams(streams):
        raise ProtocolError(f"the publisher asks for {streams!r} gloo connections per pair; at most {MAX_STREAMS}")
    return GroupPlane(ctx.store(), channel=ctx.channel, member=ctx.member, backend=ctx.backend, device=ctx.device,
                      recorder=ctx.recorder, in_place=ctx.admit.settings.in_place, slot=ctx.admit.slot,
                      timeout=ctx.rendezvous_timeout, host=ctx.client.local_host, streams=streams)


PLANE = PlaneSpec("group", send_part=GroupSend, member_plane=member_plane)
