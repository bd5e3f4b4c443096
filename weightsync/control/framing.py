"""Frames on a control connection: length prefix, sequence numbers, MACs.

A frame on the socket is a 4-byte big-endian length and the msgpack of a
:class:`~weightsync._wire.Frame` ``(seq, mac, body)``. Each direction numbers its frames 1, 2, 3,
...; a receiver accepts only the next number, so a replayed, reordered or dropped frame is
refused. Once a session key exists, ``mac`` is the first 16 bytes of HMAC-SHA256 over the
direction, the sequence number and the body; a frame that fails it is refused too. Refusals
raise :class:`BadFrame` (the caller drops the frame and records why); they never reach the
protocol.

The length is checked against a bound before anything is read or allocated: an unauthenticated
peer may send at most ``HANDSHAKE_FRAME`` bytes, an admitted one ``MAX_FRAME``.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Any

import msgspec

from weightsync import _wire

HEADER = struct.Struct(">I")
HANDSHAKE_FRAME = 1 << 20  # a Join: a sliced member names its boxes (about 50 bytes a tensor)
MAX_FRAME = 256 << 20  # a manifest of a very large model, with room to spare
MAC_BYTES = 16
TO_SERVER, TO_CLIENT = b"c>s", b"s>c"


class BadFrame(Exception):
    """A frame that must be dropped (and recorded): malformed, replayed, reordered or forged."""


class FrameTooLarge(BadFrame):
    """A length prefix over the bound: the connection cannot be trusted to stay in sync."""


class Session:
    """The framing state of one connection end.

    Args:
        outgoing, incoming: direction tags (``TO_SERVER``/``TO_CLIENT``) this end sends and reads.
        key: the session key, or None (an open channel, or before admission).
    """

    def __init__(self, *, outgoing: bytes, incoming: bytes, key: bytes | None = None) -> None:
        self.outgoing, self.incoming, self.key = outgoing, incoming, key
        self.sent = 0
        self.received = 0

    def _mac(self, direction: bytes, seq: int, body: bytes) -> bytes:
        if self.key is None:
            return b""
        return hmac.new(self.key, direction + seq.to_bytes(8, "big") + body, hashlib.sha256).digest()[:MAC_BYTES]

    def seal(self, message: Any) -> bytes:
        """``message`` as the next frame, length prefix included."""
        body = _wire.encode(message)  # first: a message that cannot be encoded leaves the sequence as it was
        seq = self.sent + 1
        frame = _wire.encode(_wire.Frame(seq, self._mac(self.outgoing, seq, body), body))
        self.sent = seq
        return HEADER.pack(len(frame)) + frame

    def open(self, frame_bytes: bytes, decoder: msgspec.msgpack.Decoder[Any]) -> Any:
        """The message in one received frame (without its length prefix); BadFrame if refused."""
        try:
            frame = _wire.frame_decoder.decode(frame_bytes)
        except msgspec.DecodeError as err:
            raise BadFrame(f"malformed frame: {err}") from None
        if frame.seq != self.received + 1:
            raise BadFrame(f"frame {frame.seq} out of sequence (expected {self.received + 1}): replayed or reordered")
        if self.key is not None and not hmac.compare_digest(frame.mac, self._mac(self.incoming, frame.seq, frame.body)):
            raise BadFrame(f"frame {frame.seq} fails its MAC: forged or corrupted")
        try:
            message = decoder.decode(frame.body)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            raise BadFrame(f"frame {frame.seq}: not a message of this protocol ({err})") from None
        self.received = frame.seq
        return message


def open_refusal(session: Session, frame_bytes: bytes) -> _wire.Deny | None:
    """An unauthenticated Deny answering our Join, or None.

    A publisher that refuses at the door (a wrong secret, say) cannot MAC its answer under a key
    the subscriber derived from its own secret; a Deny is accepted without a MAC, as the next
    frame only, because refusing is all it can do.
    """
    try:
        frame = _wire.frame_decoder.decode(frame_bytes)
        message = _wire.server_decoder.decode(frame.body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if frame.seq != session.received + 1 or frame.mac or not isinstance(message, _wire.Deny):
        return None
    session.received = frame.seq
    return message


def frame_length(header: bytes, limit: int) -> int:
    """The body length a 4-byte header announces; FrameTooLarge over ``limit``."""
    (length,) = HEADER.unpack(header)
    if length > limit:
        raise FrameTooLarge(f"a frame of {length} bytes exceeds the bound of {limit}")
    return length
