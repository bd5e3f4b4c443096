"""The publisher's send side: one part per plane, each member served by the part its Join asked for.

The Sender drives this and nothing below it: it names no plane. Per version (``Sender._send_once``):
``split`` the members by part, ``prepare`` (the Announce's fields: each part's), tell the
Announce, ``move`` (the one driving part issues the buckets and runs the hooks; with none, the
buckets are walked through the hooks here: packing, a ring's turns, the digests), then
``digests`` (members proven with digests of their own bytes). Owned by the sender thread.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec

from weightsync import _wire
from weightsync._errors import InternalError, own_hook
from weightsync.planes.dataplane import SEND_PART_MEMBERS, Outgoing, Prepared, PublisherContext, SendPart, plane_spec


class SendSide:
    """The parts of the send side, by the transport members join with (see the module docstring)."""

    def __init__(self, names: Sequence[str], context: PublisherContext) -> None:
        self.parts: dict[str, SendPart] = {name: plane_spec(name).send_part(context) for name in names}
        for name, part in self.parts.items():
            missing = [m for m in SEND_PART_MEMBERS if not hasattr(part, m)]
            if missing:
                raise TypeError(f"plane {name!r}: its send part {type(part).__name__} has no {missing} "
                                "(subclass weightsync.extend.SendPart for the optional ones' defaults)")
        grouped = [p for p in self.parts.values() if p.in_group]
        if len(grouped) != 1:
            raise ValueError(f"exactly one plane forms the generation's group, not {len(grouped)}")
        self.group_part = grouped[0]
        self._of: dict[str, SendPart] = {}

    @property
    def plane(self) -> Any:
        """The generation's group plane (Generations forms the group through it)."""
        return self.group_part.plane

    def admit(self, member: str, transport: str, want: Any = None) -> None:
        part = self.parts.get(transport)
        if part is None:  # the door checks the transport first: this is a bug
            raise InternalError(f"{member} was admitted on transport {transport!r}, which nothing serves")
        old = self._of.get(member)
        if old is not None and old is not part:
            old.forget(member)
        self._of[member] = part
        part.admit(member, want)

    def refusal(self, transport: str, want: Any, published: tuple[int, _wire.Manifest] | None) -> str | None:
        """Why a member joining on ``transport`` with ``want`` is refused at the door, given the
        newest version put (its number and full layout), or None."""
        part = self.parts.get(transport)
        return None if part is None or want is None or published is None else part.refusal(want, published)

    def forget(self, member: str) -> None:
        part = self._of.pop(member, None)
        if part is not None:
            part.forget(member)

    def retain(self, keep: Callable[[str], bool]) -> None:
        """Forget every member ``keep`` says is gone, so the parts hold at most the channel's members."""
        for member in [m for m in self._of if not keep(m)]:
            self.forget(member)

    def part_of(self, member: str) -> SendPart:
        return self._of.get(member, self.group_part)

    def in_group(self, member: str) -> bool:
        return self.part_of(member).in_group

    def split(self, members: Sequence[str]) -> dict[SendPart, tuple[str, ...]]:
        """Each part with members in ``members``, and its members (in order)."""
        by: dict[SendPart, list[str]] = {}
        for member in members:
            by.setdefault(self.part_of(member), []).append(member)
        return {part: tuple(ms) for part, ms in by.items()}

    def prepare(self, out: Outgoing, by: Mapping[SendPart, tuple[str, ...]]) -> dict[SendPart, Prepared]:
        """What each part's members' Announce says (:class:`~weightsync.planes.dataplane.Prepared`)."""
        got: dict[SendPart, Prepared] = {}
        for part, members in by.items():
            prepared = part.prepare(out, members)
            if not isinstance(prepared, Prepared):
                raise InternalError(f"the {part.name!r} plane's prepare returned {type(prepared).__name__}, "
                                    "not a weightsync.extend.Prepared")
            got[part] = prepared
        return got

    def move(self, out: Outgoing, by: Mapping[SendPart, tuple[str, ...]]) -> None:
        drivers = [part for part in by if part.drives]
        for part in drivers:
            part.move(out, by[part])
        for part in by:
            if not part.drives:
                part.move(out, by[part])
        # nobody issues the buckets: walk them through the hooks here (a snapshot still being
        # taken, ``before``, is waited for bucket by bucket: a put cancelled half-way is abandoned)
        if not drivers and (out.checksum or out.afters or out.hooked or out.before is not None):
            for i in range(len(out.buckets)):
                own_hook(out.before, i, "packing")
                out.after(i)

    @staticmethod
    def announce(tell: Callable[[tuple[str, ...], Any], None], announce: Any,
                 by: Mapping[SendPart, tuple[str, ...]], prepared: Mapping[SendPart, Prepared]) -> None:
        """Tell each part's members ``announce`` with what their part prepared; a member with a
        coding of its own (a sliced member's delta) gets that."""
        for part, to in by.items():
            got = prepared[part]
            mine = msgspec.structs.replace(announce, plane=got.plane, coding=got.coding, direct=got.direct,
                                           checksum=announce.checksum and got.checked)
            rest = tuple(m for m in to if m not in got.each)
            if rest:
                tell(rest, mine)
            for member, coding in got.each.items():
                tell((member,), msgspec.structs.replace(mine, coding=coding))

    def seal(self, tell: Callable[[tuple[str, ...], Any], None], seal: Any, by: Mapping[SendPart, tuple[str, ...]],
             unchecked: set[SendPart], sums: Sequence[int]) -> None:
        """After ``move``: a sliced member checks exactly what it was sent (its part's digests);
        every other member of a checked part the staged buckets' ``sums``."""
        own = self.digests(by)
        whole = tuple(m for part, ms in by.items() if part not in unchecked for m in ms if m not in own)
        for to, digests in ([(whole, sums)] if whole else []) + [((m,), d) for m, d in own.items()]:
            tell(to, msgspec.structs.replace(seal, checksums=tuple(digests)))

    @staticmethod
    def digests(by: Mapping[SendPart, tuple[str, ...]]) -> dict[str, Sequence[int]]:
        own: dict[str, Sequence[int]] = {}
        for part in by:
            own.update(part.digests())
        return own

    @staticmethod
    def wire_of(by: Mapping[SendPart, tuple[str, ...]]) -> dict[str, int]:
        """Per member a part sent bytes of its own (a sliced member's share, or its delta): how many."""
        sent: dict[str, int] = {}
        for part in by:
            sent.update(part.wire_of())
        return sent

    def close(self) -> None:
        for part in self.parts.values():
            part.close()
