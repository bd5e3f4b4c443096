"""Catching up from a peer: a one-sided member takes a sealed version's buckets from where they
already are before it reads the publisher's memory.

When the publisher sends a version again that it sealed before (a newcomer or a replacement
joined, and every member is sent the retained version), the Announce carries the version's Seal
digests and the members that offered it (``PeerOffer``: each one-sided member offers the buffer
it last received into, right after). A member then takes each bucket, in order, from:

1. its own copy, when it holds that version already (a copy in memory: the publisher's link
   carries nothing for it);
2. the peers that offered it, one after the other (one-sided reads of their buffer, each given
   half of what is left of the bucket's deadline, so the publisher's read still fits);
3. the publisher, as always.

A bucket from 1 or 2 is taken only once its digest equals the Seal's: a peer that lies, died,
was frozen past the bucket's deadline, or wrote its buffer again meanwhile (it went on to
receive newer versions) costs this member a read from the next source, never a wrong byte; a
source that failed once is not asked again in this version. The publisher lists peers only for
a version it sealed, so no peer's bytes are taken for a version the publisher never proved.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec
import torch

from weightsync._errors import Cancelled, LocalFailure, PeerFailure, ProtocolError
from weightsync.format.checksum import checksum
from weightsync.planes.onesided.endpoints import Reader, Registration

MAX_PEERS = 4  # peers an Announce lists (each member starts at another one)


class PeerSource(msgspec.Struct, frozen=True):
    """Where a member holds a version others may read (``PeerOffer.source``): its endpoint, the
    registration of the buffer, and the version's bytes in it."""

    member: str
    url: bytes
    buffer: Registration
    offset: int
    nbytes: int


class Held(NamedTuple):
    """The version a member last received, and the memory it is in (its slot's bytes, contiguous)."""

    version: int
    flat: torch.Tensor


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() < b.data_ptr() + b.numel() and b.data_ptr() < a.data_ptr() + a.numel()


class Sources:
    """Where this member takes a sealed version's buckets before the publisher (module docstring).

    Args:
        fields: the Announce's one-sided fields (its ``sealed`` digests, ``digest``, ``peers``).
        member: this member's id (its own offer is skipped).
        held: the version this member last received, if any.
        reader: the endpoint reading a peer at a url (made and kept by the plane).
        scope: the member's flight-recorder scope (each source given up is recorded).
        took: bytes taken per source ("self", "peer"), added to as buckets are taken.
    """

    def __init__(self, fields: Any, version: int, member: str, held: Held | None,
                 reader: Callable[[bytes], Reader], scope: Any, took: dict[str, int]) -> None:
        self._sealed, self._kind, self._version = fields.sealed, fields.digest, version
        self._reader, self._rec, self.took = reader, scope, took
        self._queue: list[tuple[str, Any]] = []
        if held is not None and held.version == version:
            self._queue.append(("self", held.flat))
        peers = []
        for raw in fields.peers[:MAX_PEERS]:
            try:
                peer = msgspec.msgpack.decode(raw, type=PeerSource)
            except msgspec.DecodeError:
                continue  # a member's offer the publisher passed on unread: one that does not parse is skipped
            if peer.member != member:
                peers.append(peer)
        if peers:  # each member starts at another peer, so newcomers spread over the holders
            first = sum(member.encode()) % len(peers)
            self._queue += [("peer", p) for p in peers[first:] + peers[:first]]

    def take(self, i: int, bucket: torch.Tensor, at: int, deadline: float,
             cancelled: Callable[[], bool] | None) -> bool:
        """Bucket ``i`` (the version's bytes from ``at``) from the first source whose bytes match the
        Seal; False when none is left (the publisher's turn). Cancelled propagates."""
        if i >= len(self._sealed):
            return False
        while self._queue:
            kind, source = self._queue[0]
            try:
                self._read(kind, source, bucket, at, deadline, cancelled)
                if checksum(bucket, self._kind) != self._sealed[i]:
                    raise PeerFailure(f"bucket {i} from {self._name(kind, source)} does not match the Seal")
            except Cancelled:
                raise
            except (PeerFailure, ProtocolError, LocalFailure) as err:
                if self._rec is not None:
                    self._rec.record("catch_up", version=self._version, bucket=i, peers=(self._name(kind, source),)
                                     ).fail(err)
                self._queue.pop(0)
                continue
            self.took[kind] = self.took.get(kind, 0) + bucket.numel()
            return True
        return False

    @staticmethod
    def _name(kind: str, source: Any) -> str:
        return "itself" if kind == "self" else f"peer {source.member}"

    def _read(self, kind: str, source: Any, bucket: torch.Tensor, at: int, deadline: float,
              cancelled: Callable[[], bool] | None) -> None:
        n = bucket.numel()
        if kind == "self":
            flat: torch.Tensor = source
            if at + n > flat.numel() or _overlaps(flat, bucket):
                raise LocalFailure("this member's copy does not hold that bucket apart from where it goes")
            bucket.copy_(flat[at:at + n])
            return
        if at + n > source.nbytes:
            raise ProtocolError(f"peer {source.member} offered {source.nbytes} bytes, not {at + n}")
        # half the bucket's time: a peer that never answers leaves the other half to read it elsewhere
        deadline = time.monotonic() + (deadline - time.monotonic()) / 2
        reader = self._reader(source.url)
        reader.ready_for(bucket, deadline)
        reader.read(bucket, reader.remote(source.buffer, source.offset + at, n), deadline, cancelled,
                    f"{n} bytes of version {self._version} from peer {source.member}")
