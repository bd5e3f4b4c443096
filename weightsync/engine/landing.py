"""Where an announced version lands in a member's receive slots: the target the Receiver asks.

One version lands one of four ways, decided by what the member joined as and what the Announce
says (:meth:`Targets.land`):

- **whole**: into the receiving slot, bucket by bucket (a waiting ``get_into(as_received=True)``
  is written as the buckets come: ``Landing.ahead``);
- **in place**: a same-host member reads the publisher's sealed snapshot where it lies
  (:mod:`weightsync.planes.shm.plane`); nothing is copied;
- **a lane's part**: a sharded publisher's rank sends its part, placed straight into its places
  in the full slot (``sharding.Placer``);
- **a sliced share**: a ``want=`` member gets only its boxes, point to point, packed in its own
  slot layout (``slicing.SlicePlacer``).

It also says what the readable slot is worth as a delta's base (:meth:`Targets.base`), from what
the member verified of it (:class:`Held`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from weightsync import _wire
from weightsync._errors import ProtocolError
from weightsync.encodings import seam
from weightsync.engine.into import DestWriter
from weightsync.engine.slots import SlotPair
from weightsync.errors import ManifestMismatch
from weightsync.format import sharding, slicing


class Held(NamedTuple):
    """What this member (a lane: this lane's part of it) verified of a version a delta may be against."""

    version: int
    digest: bytes  # planes.encoding.base_digest over its buckets' digests
    manifest: Any = None  # a lane or a sliced member: the manifest it came under (a lane's own),
    assembly: Any = None  # ...and a lane's Assembly
    sliced: bool = False  # a sliced member's share: its bytes lie in its own slot layout


class Staged(NamedTuple):
    """A verified version in the receiving slot, with what exposing it records."""

    generation: int
    seq: int
    version: int
    nbytes: int
    began: float  # monotonic: when its receive started
    held: Held | None  # what a delta against it names; None: not a base


@dataclass
class Landing:
    """Where one announced version's buckets go."""

    buckets: list[torch.Tensor]  # each bucket's bytes, where the plane (or the decoder) writes them
    placer: sharding.Placer | slicing.SlicePlacer | None = None  # a lane's part or a sliced share
    epoch: int = 0  # the slot's epoch a part is received under
    in_place: tuple[torch.Tensor, Callable[[], bool]] | None = None  # read where it lies: the view, its guard
    ahead: DestWriter | None = None  # a waiting get_into written as the buckets come

    @property
    def part(self) -> bool:
        """A lane's part of a sharded version (not a whole version, not a sliced share)."""
        return isinstance(self.placer, sharding.Placer)


class Targets:
    """A member's landings (see the module docstring). Only its receiver thread uses it."""

    def __init__(self, slots: SlotPair, *, lane: int, want: tuple[_wire.Want, ...] | None, device: torch.device,
                 channel: str, member_id: str) -> None:
        self._slots, self.lane, self.want, self.device = slots, lane, want, device
        self.channel, self.member_id = channel, member_id

    def land(self, announce: _wire.Announce, ranges: list[tuple[int, int]], plane: Any, readers: float, *,
             ahead: bool) -> Landing:
        """Prepare the slot ``announce`` lands in. ``ahead``: a waiting ``get_into(as_received=True)``
        may be written as the buckets come (a whole version received into host memory)."""
        assembly, manifest = announce.assembly, announce.manifest
        if self.want is not None:  # only our boxes, point to point, packed in our own slot layout
            return self._sliced(announce, ranges, readers)
        if assembly is not None:  # this lane's part of a sharded version, straight into its places in the full slot
            full, epoch = self._slots.prepare_part(self.lane, assembly.manifest, readers)
            try:
                placer = sharding.Placer(full, manifest, assembly.pieces, ranges)
            except ValueError as err:
                raise ProtocolError(f"version {announce.version}: {err}") from err
            return Landing(placer.targets, placer, epoch)
        in_place = self._in_place(announce, plane)
        flat = (self._slots.prepare(manifest, readers) if in_place is None
                else self._slots.prepare_in_place(manifest, *in_place, readers))
        landing = Landing([flat[lo:hi] for lo, hi in ranges], in_place=in_place)
        into = self._slots.into  # a get_into(as_received=True) waiting: written as buckets come
        # (host memory only: a device bucket is complete on the plane's stream, not the writer's)
        if into is not None and in_place is None and self.device.type == "cpu" and ahead:
            landing.ahead = into.writer(announce.version, manifest, flat)
        return landing

    def _in_place(self, announce: _wire.Announce, plane: Any) -> tuple[torch.Tensor, Callable[[], bool]] | None:
        """A version this member reads where it lies (its plane's ``view_of``: a sealed same-host
        snapshot, planes.shm), its view and guard; None where it is received into the slot."""
        if self.device.type != "cpu":
            return None
        return plane.view_of(announce)

    def _sliced(self, announce: _wire.Announce, ranges: list[tuple[int, int]], readers: float) -> Landing:
        """A sliced member's slot for ``announce`` and where each bucket's share of it lands."""
        assert self.want is not None
        if not announce.direct:
            raise ProtocolError(f"version {announce.version} was broadcast to a sliced member")
        assembly = announce.assembly
        full = announce.manifest if assembly is None else assembly.manifest
        pieces = None if assembly is None else assembly.pieces
        try:
            mine = slicing.sliced_manifest(full, self.want)
            plan = slicing.cached_routes(announce.manifest, pieces, full, self.want, tuple(ranges))
        except ValueError as err:  # the engine asked for what this channel does not publish: say so, stop
            raise ManifestMismatch(f"want= does not fit version {announce.version}: {err}", channel=self.channel,
                                   member=self.member_id) from err
        epoch = 0
        if assembly is None:
            slot = self._slots.prepare(mine, readers)
        else:
            slot, epoch = self._slots.prepare_part(self.lane, mine, readers)
        try:
            placer = slicing.SlicePlacer(slot, plan)
            if announce.coding.name != seam.FULL:  # a coded share: its decoder is given its segments
                placer.segments = slicing.cached_share_segments(announce.manifest, pieces, full, self.want,
                                                                tuple(ranges))
        except ValueError as err:
            raise ProtocolError(f"version {announce.version}: {err}") from err
        return Landing(placer.targets, placer, epoch)

    def base(self, held: Held | None, placer: sharding.Placer | slicing.SlicePlacer | None) -> seam.Base | None:
        """The readable slot as a delta's base, when this member holds a whole version it verified
        (``held``; a lane, ``placer``: when it verified its own part of the readable version; its
        bytes are gathered from where they lie in the slot; a sliced member: its share of each
        bucket, gathered from its own slot). Only a receiver swaps the slots, and a lane's only once
        every lane is done with the next version, so the base stays put while a delta is decoded
        against it."""
        slot = self._slots.readable
        if held is None or slot.version != held.version or slot.flat is None or slot.manifest is None:
            return None
        whole = slot.flat[: slot.manifest.total_bytes]
        if isinstance(placer, slicing.SlicePlacer):
            if not held.sliced:
                return None
            share = placer
            return seam.Base(slot.version, whole, held.manifest, held.digest, assembly=held.assembly,
                                 part=lambda i: share.held(i, whole))
        if held.sliced:
            return None
        if held.assembly is None:
            return None if placer is not None else seam.Base(slot.version, whole, slot.manifest, held.digest)
        if placer is None or slot.manifest != held.assembly.manifest:
            return None
        lane = placer
        return seam.Base(slot.version, whole, held.manifest, held.digest, assembly=held.assembly,
                             part=lambda i: lane.gather(i, whole))
