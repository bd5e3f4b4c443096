"""A one-sided member's end: ``move`` reads each bucket out of the publisher's registered staging
buffer itself (``transport="one-sided"``); the publisher issues nothing per bucket.

The Announce names where the version lies (:class:`OneSidedFields`): the publisher's endpoint,
the registration of the whole staging buffer (its header page included) and, as for a same-host
member, the buffer's offset, epoch and, for ``copy=False``, its ring of two bucket slots. The
member reads the header's ready count before a bucket the snapshot may not have reached yet and
the epoch with it, and the epoch once more after the last bucket: a buffer the publisher wrote
again meanwhile is refused, never published. Each bucket is then checked against the Seal's
digests (the member's own copy, as on the group path). A ring's slot is told free with ``Copied``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgspec
import torch

from weightsync import _wire
from weightsync._errors import Cancelled, LocalFailure, ProtocolError, own_hook
from weightsync.planes.dataplane import GenerationSpec, Transfer
from weightsync.planes.onesided.catchup import MAX_PEERS, Held, PeerSource, Sources
from weightsync.planes.onesided.endpoints import Exposure, Reader, Registration
from weightsync.planes.shm.plane import HEADER, ShmRef, await_ready
from weightsync.recorder.recorder import RecorderScope


class OneSidedFields(msgspec.Struct, frozen=True):
    """The one-sided plane's fields of an Announce (``Announce.plane``)."""

    url: bytes  # the publisher's endpoint (its agent's metadata)
    buffer: Registration  # the staging buffer, header page first, as registered
    segment: ShmRef  # the version's offset, the buffer's epoch and data bytes, a ring's slot size
    # a version sealed before (a re-send: a newcomer catching up): its buckets' digests, their
    # function, and members that hold it (PeerSource, msgpack each); bytes from anywhere but the
    # publisher are taken only once they match these digests
    sealed: tuple[int, ...] = ()
    digest: str = ""
    peers: tuple[bytes, ...] = ()


def announced(url: bytes, buffer: Registration, segment: ShmRef, sealed: tuple[int, ...] = (), digest: str = "",
              peers: tuple[bytes, ...] = ()) -> bytes:
    return msgspec.msgpack.encode(OneSidedFields(url=url, buffer=buffer, segment=segment, sealed=sealed,
                                                 digest=digest, peers=peers))


def fields_of(announce: Any) -> OneSidedFields:
    try:
        return msgspec.msgpack.decode(announce.plane, type=OneSidedFields)
    except (msgspec.DecodeError, AttributeError) as err:
        raise ProtocolError(f"version {announce.version} was announced without a buffer to read: {err}") from None


class OneSidedPlane:
    """See the module docstring. Owned by the receiver thread."""

    in_group, moves_alone = False, True

    def __init__(self, recorder: RecorderScope | None = None, member: str = "",
                 tell: Callable[[Any], None] | None = None) -> None:
        self._rec, self._member, self._tell = recorder, member, tell
        self.reader = Reader()  # the publisher's endpoint
        self._peers: OrderedDict[bytes, Reader] = OrderedDict()  # peers' endpoints, by url
        self._held: Held | None = None  # the version last received, where it is (offered to peers)
        self._exposure: Exposure | None = None  # this member's own endpoint, for peers catching up
        self._exposed: list[torch.Tensor] = []  # the storages registered there, oldest first
        self.took: dict[str, int] = {}  # bytes received, by source: "publisher", "self", "peer"

    def offer(self) -> str:
        return ""

    def rendezvous_prefixes(self, spec: GenerationSpec) -> tuple[str, ...]:
        return ()

    def broadcast_parent(self, rank: int) -> int | None:
        return None

    def enter(self, spec: GenerationSpec) -> None:
        return None

    def leave(self, reason: str, *, failed: bool = False) -> None:
        return None

    def view_of(self, announce: Any) -> tuple[torch.Tensor, Callable[[], bool]] | None:
        return None  # always read into this member's own memory

    def move(self, transfer: Transfer) -> None:
        fields = fields_of(transfer.announce)
        ref, reg = fields.segment, fields.buffer
        self._check(fields, transfer)
        self.reader.connect(fields.url)
        # a version sealed before: its buckets from this member's own copy or a peer first (catchup)
        others = (Sources(fields, transfer.version, self._member, self._held, self._peer, self._rec, self.took)
                  if fields.sealed and not ref.ring else None)
        ring, done, ready = ref.ring, 0, -1  # ready: the publisher's ready count as last read
        read_any = False  # anything read from the publisher (its epoch is checked at the end)
        for i, bucket in enumerate(transfer.buckets):
            own_hook(transfer.before, i, "preparing")
            n = bucket.numel()
            at = HEADER + ((i % 2) * ring if ring else ref.offset + done)
            deadline = time.monotonic() + transfer.deadline(n)
            entry = None if self._rec is None else self._rec.record(
                "bucket_recv", version=transfer.version, bucket=i, nbytes=n).start()
            try:
                if n and (others is None or not others.take(i, bucket, done, deadline, transfer.cancelled)):
                    if ready < ref.offset + done + n:
                        ready = self._await_ready(reg, ref, ref.offset + done + n, transfer)
                    self.reader.ready_for(bucket, deadline)
                    self.reader.read(bucket, self.reader.remote(reg, at, n), deadline, transfer.cancelled,
                                     f"bucket {i} of version {transfer.version}")
                    self.took["publisher"] = self.took.get("publisher", 0) + n
                    read_any = True
            except BaseException as err:
                if entry is not None:
                    entry.fail(err)
                raise
            if entry is not None:
                entry.complete()
            done += n
            try:
                if ring and self._tell is not None:  # its ring slot is free for bucket i + 2: say so first
                    self._tell(_wire.Copied(transfer.announce.generation, transfer.announce.seq, self._member, i))
                if transfer.after is not None:
                    transfer.after(i)
            except Exception as err:  # noqa: BLE001 - this end's own failure, as the DataPlane says
                raise LocalFailure(f"after bucket {i}: {err}") from err
        # read after the buckets: a publisher that started writing the buffer again bumped it first
        if read_any:
            epoch, _ = self.reader.head(reg, time.monotonic() + transfer.deadline(0), transfer.cancelled)
            if epoch != ref.epoch:
                raise Cancelled(f"version {transfer.version}'s buffer was reused while this member read it")
        self._offer(transfer)

    def _peer(self, url: bytes) -> Reader:
        """The endpoint reading the peer at ``url`` (one per peer, the last few kept)."""
        reader = self._peers.get(url)
        if reader is None:
            reader = self._peers[url] = Reader()
            while len(self._peers) > MAX_PEERS:
                self._peers.popitem(last=False)[1].close()
            reader.connect(url)
        self._peers.move_to_end(url)
        return reader

    def _offer(self, transfer: Transfer) -> None:
        """Offer the version just received to members catching up (``PeerOffer``): where its bytes
        lie in this member's memory, when they lie there in one piece (a full version, not a
        lane's part or a delta's wire buckets). A newcomer checks them against the Seal."""
        buckets = transfer.buckets
        self._held = None
        if not buckets or self._tell is None or transfer.announce.coding.name != "full":
            return
        start, total = buckets[0].data_ptr(), sum(b.numel() for b in buckets)
        if total == 0 or any(b.data_ptr() != start + sum(c.numel() for c in buckets[:k])
                             for k, b in enumerate(buckets)):
            return
        storage = buckets[0].untyped_storage()
        if total != transfer.announce.manifest.total_bytes or start + total > storage.data_ptr() + storage.nbytes():
            return
        whole = torch.empty(0, dtype=torch.uint8, device=buckets[0].device).set_(storage)
        offset = start - storage.data_ptr()
        self._held = Held(transfer.version, whole[offset:offset + total])
        try:
            if self._exposure is None:
                self._exposure = Exposure()
            if not any(t.data_ptr() == whole.data_ptr() for t in self._exposed):
                self._exposed.append(whole)
                while len(self._exposed) > 2:  # this member's two slots
                    self._exposure.withdraw(self._exposed.pop(0))
            reg = self._exposure.expose(whole)
            source = PeerSource(self._member, self._exposure.url(), reg, offset, total)
            self._exposure.announced()
            self._tell(_wire.PeerOffer(self._member, transfer.version, msgspec.msgpack.encode(source)))
        except Exception as err:  # noqa: BLE001 - offering is a courtesy: its failure costs only the offer
            if self._rec is not None:
                self._rec.record("peer_offer", version=transfer.version).fail(err)

    @staticmethod
    def _check(fields: OneSidedFields, transfer: Transfer) -> None:
        """The announced version fits the registration it names (else nothing is read)."""
        ref, reg = fields.segment, fields.buffer
        sizes = [b.numel() for b in transfer.buckets]
        if reg.length != HEADER + ref.nbytes:
            raise ProtocolError(f"version {transfer.version}: a {reg.length}-byte registration for a "
                                f"{ref.nbytes}-byte buffer")
        if ref.ring:
            if ref.offset != 0 or 2 * ref.ring > ref.nbytes or any(n > ref.ring for n in sizes):
                raise ProtocolError(f"version {transfer.version}: a ring of {ref.ring}-byte slots does not fit")
        elif ref.offset < 0 or ref.offset + sum(sizes) > ref.nbytes:
            raise ProtocolError(f"version {transfer.version}: {sum(sizes)} bytes at {ref.offset} overrun the buffer")

    def _await_ready(self, reg: Registration, ref: ShmRef, end: int, transfer: Transfer) -> int:
        """Until the publisher's snapshot has copied the buffer's first ``end`` bytes; its ready count."""
        return await_ready(lambda: self.reader.head(reg, time.monotonic() + transfer.deadline(0), transfer.cancelled),
                           ref.epoch, end, transfer)

    def close(self) -> None:
        self.reader.close()
        for reader in self._peers.values():
            reader.close()
        self._peers.clear()
        self._held = None
        if self._exposure is not None:
            self._exposure.close()
        self._exposed.clear()
