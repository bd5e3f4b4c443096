"""The ``"one-sided"`` plane's publisher end: it registers each staging buffer once and announces
where a version lies; members read the buckets themselves (``drives`` is False: nothing is issued
per bucket, and with nobody in the group the send side only walks the buckets through the
digests, and for ``copy=False`` through the packing and the ring's turns).

It serves what the same-host part serves, from the same segments (staging's buffers on a CPU
publisher): a snapshot where it lies, or a ``copy=False`` version through the ring of two bucket
slots, each packed again once every reader said it copied the bucket before (``Copied``). Unlike
a same-host member, a one-sided member always reads into its own memory, so it always checks the
Seal's digests. A buffer staging drops is unregistered with it.
"""

from __future__ import annotations

from typing import Any

from weightsync._errors import LocalFailure
from weightsync.planes.dataplane import MemberContext, Outgoing, PlaneSpec, Prepared, PublisherContext
from weightsync.planes.onesided.catchup import MAX_PEERS
from weightsync.planes.onesided.endpoints import Exposure
from weightsync.planes.onesided.plane import OneSidedPlane, announced
from weightsync.planes.shm.send import ShmSend


class OneSidedSend(ShmSend):
    """The publisher's end for one-sided members (see the module docstring)."""

    name = "one-sided"
    reads_in_place = False  # members read into their own memory: staging never parks a buffer for them

    def __init__(self, context: PublisherContext) -> None:
        super().__init__(context)
        self.exposure = Exposure()
        if self._segments is not None:
            self._segments.on_drop(self.exposure.withdraw)

    def refusal(self, want: Any, published: Any) -> str | None:
        return "a member receiving slices (want=) receives over the group, not one-sided"

    def prepare(self, out: Outgoing, members: tuple[str, ...]) -> Prepared:
        if self._segments is None:
            raise LocalFailure("one-sided members read host staging buffers, and this publisher has none")
        ref = self._announced(out, members)
        buf = self._ctx.buckets.get(1)[0] if ref.ring else out.snapshot
        whole = None if buf is None else self._segments.whole(buf)
        if whole is None:
            raise LocalFailure(f"version {out.version}'s buffer is not a staging segment")
        try:
            reg = self.exposure.expose(whole)
            url = self.exposure.url()
            self.exposure.announced()
        except Exception as err:  # noqa: BLE001 - the backend's own failure to register
            raise LocalFailure(f"cannot register version {out.version}'s buffer for one-sided reads: {err}") from err
        # a version sealed before (sent again: a newcomer joined): members take it from their own
        # copy or a peer that offered it, checked against these digests, before this memory
        sealed = out.sealed if out.sealed is not None and not ref.ring else None
        peers = () if sealed is None else tuple(self._ctx.control.offers(members, out.version).values())[:MAX_PEERS]
        return Prepared(plane=announced(url, reg, ref, sealed or (), out.digest, peers))

    def close(self) -> None:
        self.exposure.close()


def member_plane(ctx: MemberContext) -> OneSidedPlane:
    return OneSidedPlane(ctx.scope, member=ctx.member, tell=ctx.client.send)


PLANE = PlaneSpec("one-sided", send_part=OneSidedSend, member_plane=member_plane)
