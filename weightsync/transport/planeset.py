"""The planes a publisher serves, and what they share with its staging.

A CPU publisher's staging buffers are shared-memory segments (same-host members read them in
place) and its ``copy=False`` bucket buffers live in one too; the group plane's end forms its
groups on the publisher's own rendezvous table and binds the control server's interface. The
Publisher holds one :class:`PlaneSet` and hands its pieces to the Sender (the parts' names and
objects, the group plane's factory), staging and the control server (the door's offer).
"""

from __future__ import annotations

import torch

from weightsync import _wire
from weightsync.control.rendezvous import KeyValue, LocalStore
from weightsync.engine.staging import BucketBuffers, Staging
from weightsync.options import Deadlines
from weightsync.planes.dataplane import registered_planes
from weightsync.planes.group.plane import GroupPlane
from weightsync.planes.onesided import endpoints
from weightsync.planes.shm import plane as shm
from weightsync.recorder.recorder import FlightRecorder


class PlaneSet:
    """Built with the Publisher; ``open`` at start, ``close`` once the sender thread stopped."""

    def __init__(self, channel: str, *, backend: str, slot_device: torch.device, settings: _wire.ChannelSettings,
                 table: KeyValue, recorder: FlightRecorder, bind_host: str, max_snapshots: int,
                 keep_base: bool = False) -> None:
        self.channel, self.backend, self.slot_device, self.settings = channel, backend, slot_device, settings
        self._table, self._recorder, self._bind_host = table, recorder, bind_host
        # on a CPU publisher staging lives in shared memory: same-host members copy from it
        self.segments = shm.SegmentPool(channel) if slot_device.type == "cpu" and shm.available() else None
        seg = self.segments
        # keep_base: deltas are made against the retained version, kept while the next one is in flight
        self.staging = (Staging(max_snapshots, allocate=seg.allocate, drop=seg.drop, reuse=seg.reuse,
                                keep_base=keep_base)
                        if seg is not None else Staging(max_snapshots, keep_base=keep_base))
        # copy=False's two bucket buffers: in one segment too, so same-host members read them (the ring)
        self.buckets = (BucketBuffers(slot_device, allocate=seg.allocate, drop=seg.drop) if seg is not None
                        else BucketBuffers(slot_device))
        self.registered = registered_planes()  # served beyond the group and shared memory (both ends register)
        # one-sided reads (torch 2.15 with nixl) of host staging buffers; else why not, for the refusal
        why = endpoints.problem() if seg is not None else (
            f"it stages on {slot_device} (one-sided members read host staging buffers)")
        self.unserved = {} if why is None else {"one-sided": why}
        self.served = (*self.registered, *(() if why else ("one-sided",)))  # beyond the group and shm
        self.names = ("group", "shm", *self.served)
        self.objects = {"segments": seg}  # what the parts are built with beyond the Sender's own

    def offer(self) -> _wire.ShmOffer | None:
        """What the Challenge tells connecting members about the door (None: no same-host path)."""
        return self.segments.offer() if self.segments is not None else None

    def make_group_plane(self) -> GroupPlane:
        """The sender thread's group plane (rank 0 of every generation), on the in-memory rendezvous."""
        timeout = Deadlines(self.settings).rendezvous()
        host = None if self._bind_host in ("0.0.0.0", "::", "") else self._bind_host  # gloo binds the control's
        return GroupPlane(LocalStore(self._table, timeout), channel=self.channel, member="publisher",
                          backend=self.backend, device=self.slot_device, recorder=self._recorder,
                          in_place=self.settings.in_place, slot=0, timeout=timeout, host=host,
                          streams=self.settings.streams)

    def open(self) -> None:
        if self.segments is not None:
            self.segments.open()

    def close(self) -> None:
        """Members that still map a segment keep it until they unmap."""
        if self.segments is not None:
            self.segments.close()
