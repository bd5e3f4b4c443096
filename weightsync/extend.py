"""What a plane or an encoding written outside the library imports: the seams and their errors.

A *plane* moves a version's buckets from the publisher to the members that joined with its name
(``Subscriber(transport=NAME)``): its publisher part (:class:`SendPart`, given an
:class:`Outgoing` per version) and its member end (:class:`DataPlane`, given a :class:`Transfer`),
made from a :class:`PlaneSpec` registered on both ends with :func:`register_plane`
(docs/architecture.md, "Data planes"). An *encoding* is what a version looks like on the wire
(:class:`EncodingSpec`: an encoder plans each version's :class:`WirePlan`, a decoder rebuilds the
staged bytes), registered on both ends with :func:`register_encoding` and named by
``Publisher(encoding=)``.

The errors a plane raises say whose fault a failure was, which decides who pays:
:class:`PeerFailure` (a peer died, corrupted or was too slow: the member is blamed, the version
re-sent to the others), :class:`ChecksumMismatch` (a peer's bytes arrived corrupted),
:class:`Cancelled` (the version was given up on: nobody is blamed), :class:`LocalFailure` (this end
cannot serve: the put fails, nobody is blamed) and :class:`ProtocolError` (a message that does not
fit: the member refuses the version). ``tests/mailbox_plane.py`` and ``tests/xor_encoding.py`` are
a plane and an encoding written against this module alone.
"""

from __future__ import annotations

from weightsync._errors import Cancelled, ChecksumMismatch, LocalFailure, PeerFailure, ProtocolError
from weightsync._wire import Coding
from weightsync.encodings.registry import register_encoding, unregister_encoding
from weightsync.encodings.seam import Base, Decoder, Encoder, EncodingSpec, WirePlan, base_digest
from weightsync.planes.dataplane import (
    DataPlane,
    GenerationSpec,
    MemberContext,
    Outgoing,
    PlaneSpec,
    Prepared,
    PublisherContext,
    SendPart,
    Transfer,
    register_plane,
    registered_planes,
    unregister_plane,
)

__all__ = [
    "Base",
    "Cancelled",
    "ChecksumMismatch",
    "Coding",
    "DataPlane",
    "Decoder",
    "Encoder",
    "EncodingSpec",
    "GenerationSpec",
    "LocalFailure",
    "MemberContext",
    "Outgoing",
    "PeerFailure",
    "PlaneSpec",
    "Prepared",
    "ProtocolError",
    "PublisherContext",
    "SendPart",
    "Transfer",
    "WirePlan",
    "base_digest",
    "register_encoding",
    "register_plane",
    "registered_planes",
    "unregister_encoding",
    "unregister_plane",
]
