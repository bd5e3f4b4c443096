"""The encoding seam: what a version looks like on the wire, between staging and the plane.

A version is staged as the bytes a member will hold (its manifest's layout). On its way it may
be *encoded* (built in: ``"full"``, the identity, here; ``"delta"`` and ``"auto"``, against a base
version, in :mod:`weightsync.encodings.delta`; quantized forms plug in the same way), and a member
*decodes* each bucket between the plane and its slot. The digests in the Seal are the staged
bytes' and each member checks its decoded bytes against them: the checksum proves what the
member holds after decoding (a wrong base, a corrupted wire, a bug in either end), never only
the wire's bytes.

Publisher side, per version and per part that carries the encoding (the group's broadcast; the
same-host segment holds the staged bytes and its members read them as they are, and members sent
point to point are sent gathered staged bytes, or, with the built-in deltas, a sliced member a
delta of its share: :func:`weightsync.encodings.delta.share_coder`), the Sender asks
``encoder(name).plan(out)``:

- ``wire``: the tensors the plane moves, one per bucket (the staged buckets for ``"full"``);
- ``sizes``: each wire bucket's length, told in the Announce before any byte moves (empty when
  they are the staged buckets' lengths), so a member can size what it receives into; or
  ``later``: the lengths are told bucket by bucket as the encoder makes them (``tell_sizes`` of
  the Outgoing: WireSizes messages, each before its bucket moves), so bucket i is encoded while
  the ones before it are on the wire;
- ``encode(i)``: fills wire bucket i (``wire[i]`` is read after it); it runs after bucket i is
  staged (packed, or copied by a pipelined snapshot) and before the plane issues it, on the
  sender thread; ``close()``: the version is done with (sent or given up), stop encoding.

Member side, ``decoder(name).plan(announce, buckets, base)``, where ``buckets`` are the slot's
(where the decoded bytes belong), and for an Announce with ``wire_later`` a fourth argument,
``sizes``: ``sizes(i)`` waits for wire bucket i's told length; a sliced member (only the
built-in deltas go to one) also passes ``segments``: ``segments(i)``, its share of bucket i cut
into the delta codec's segments. It returns
``wire`` (what the plane receives into; the slot's buckets for ``"full"``), ``before(i)``: sizes
wire bucket i before it is received (``later``), and ``decode(i)``: runs once wire bucket i is
in, before the member's digest of bucket i.

What an encoding may assume: the manifest (names, dtypes, offsets; every dtype's element size
is whole bytes), the staged bytes of this version on the publisher's device, and, on the member,
the slot's buckets on the member's device, and a base version where the Sender's bases name one
(``out.base``; the member's copy of it is the decoder's ``base``). Encodings are looked up by
name in :mod:`weightsync.encodings.registry`; one registered from outside
(``weightsync.extend.register_encoding``) must be registered on both ends.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from weightsync import _wire

FULL = "full"
DELTA = "delta"
AUTO = "auto"


@dataclass
class WirePlan:
    """One version's (or one member's) wire form: the tensors moved and the per-bucket hook."""

    wire: Sequence[torch.Tensor]
    sizes: tuple[int, ...] = ()  # the wire buckets' lengths when they differ from the staged ones
    hook: Callable[[int], None] | None = None  # encode(i) on the publisher, decode(i) on a member
    #: publisher: the encoding the Announce names (an encoder may choose ``"full"`` for a version);
    #: empty: the one asked for
    encoding: str = ""
    base: int = -1  # publisher: the base version the wire form is relative to (-1: none)
    base_digest: bytes = b""  # ...and that base's digest, which a member must hold exactly
    #: member: runs once every bucket is in; raises ChecksumMismatch for a version that could not
    #: be decoded (a decode hook never raises mid-transfer: the collective must complete)
    check: Callable[[], None] | None = None
    #: the wire buckets' lengths are told as they are made (see the module docstring), not in ``sizes``
    later: bool = False
    told: list[int] = field(default_factory=list)  # publisher, ``later``: the lengths told so far
    before: Callable[[int], None] | None = None  # member, ``later``: sizes wire bucket i before it moves
    close: Callable[[], None] | None = None  # publisher: the version is done with; stop encoding
    own: bytes = b""  # publisher: the encoding's own Announce fields (msgpack its decoder reads)

    def coding(self, asked: str = FULL) -> _wire.Coding:
        """What the Announce says of this wire form (``asked``: the encoding named when the plan names none)."""
        return _wire.Coding(name=self.encoding or asked, wire=self.sizes, later=self.later, base=self.base,
                            base_digest=self.base_digest, own=self.own)


@dataclass(frozen=True)
class Base:
    """A version both ends may hold, that a delta is relative to.

    On the publisher: the retained version's staged bytes and the members known to hold it; on a
    member: its readable slot. ``digest`` is over that version's per-bucket checksums
    (:func:`base_digest`), so a base is named by its bytes, not only its number."""

    version: int
    flat: torch.Tensor
    manifest: Any
    digest: bytes
    holders: frozenset[str] = frozenset()  # publisher: the members that acknowledged it whole
    #: a sharded lane's base: the Assembly it was sent under (its full layout, where the lane's
    #: bytes lie in it), which the version must share; ``manifest`` is then the lane's
    assembly: Any = None
    #: member, a sharded lane: wire bucket i's base bytes, gathered from ``flat`` (the whole
    #: readable version); None: ``flat[lo:hi]``
    part: Callable[[int], torch.Tensor] | None = None
    #: publisher: per sliced member known to hold its share of this version, that share's digest
    #: (over its per-bucket checksums, as the member names it)
    shares: Mapping[str, bytes] = field(default_factory=dict)


def base_digest(version: int, checksums: Sequence[int]) -> bytes:
    """What names a base version: its number and the digests of every bucket of it."""
    import hashlib

    h = hashlib.sha256(version.to_bytes(8, "little", signed=True))
    for value in checksums:
        h.update(int(value).to_bytes(8, "little"))
    return h.digest()[:16]


class Encoder(Protocol):
    """The publisher's end of an encoding. An encoder subclasses it to inherit the default of its
    optional member, ``share``; registering one checks every member is there."""

    def plan(self, out: Any) -> WirePlan: ...

    def share(self, out: Any, member: str, plan: Sequence[Sequence[Any]], want: Any
              ) -> tuple[Callable[[int, torch.Tensor], torch.Tensor], Any] | None:
        """Optional: a sliced member's share of each bucket in this encoding (``plan``: its routes of
        each bucket, ``want``: its boxes), as ``(code(i, share) -> wire, the Coding its Announce
        names)``, or None where that member is sent its share as staged (``"full"``): the default."""
        return None


class Decoder(Protocol):
    def plan(self, announce: Any, buckets: Sequence[torch.Tensor], base: Base | None = None,
             sizes: Callable[[int], int] | None = None,
             segments: Callable[[int], Sequence[Any]] | None = None) -> WirePlan: ...


@dataclass(frozen=True)
class EncodingSpec:
    name: str
    encoder: Encoder
    decoder: Decoder


class _FullEncoder(Encoder):
    """The identity: the wire carries the staged bytes..."""

    def plan(self, out: Any) -> WirePlan:
        return WirePlan(out.buckets)


class _FullDecoder(Decoder):
    """...straight into the member's slot."""

    def plan(self, announce: Any, buckets: Sequence[torch.Tensor], base: Base | None = None,
             sizes: Callable[[int], int] | None = None,
             segments: Callable[[int], Sequence[Any]] | None = None) -> WirePlan:
        return WirePlan(buckets)


FULL_SPEC = EncodingSpec(FULL, _FullEncoder(), _FullDecoder())
