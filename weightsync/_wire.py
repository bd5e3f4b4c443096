"""Wire formats: every control message that crosses a process boundary.

All of them are frozen msgspec Structs encoded as msgpack; decoding never runs code (no
pickle anywhere). Control messages form tagged unions so one decoder reads any of them and
rejects anything else with a clear error instead of crashing the reader.

The store layout of one channel (all keys under ``ws/<channel>/``)::

    inbox_seq                  counter: subscribers take a ticket with store.add
    inbox/<n>                  Join | Leave, written by subscribers
    admit/<n>                  Admit | Deny, the publisher's reply to Join ticket n
    gen/<g>/cmd/<s>            Announce | Reconfigure | Shutdown, command s of generation g
    gen/<g>/ack/<s>/<rank>     Ack from member `rank` for command s
    gen/<g>/pg/...             the dedicated group's own rendezvous (fresh per generation)
"""

from __future__ import annotations

from typing import Union

import msgspec

PROTOCOL_VERSION = 1


class TensorSpec(msgspec.Struct, frozen=True, array_like=True):
    """One tensor in the packed layout: its bytes live at ``[offset, offset + nbytes)``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class Manifest(msgspec.Struct, frozen=True):
    """Names, dtypes, shapes and byte offsets of one version's tensors."""

    tensors: tuple[TensorSpec, ...]
    total_bytes: int


class Fingerprint(msgspec.Struct, frozen=True):
    """What must agree between publisher and subscriber for the data plane to work."""

    protocol: int
    torch: str
    nccl: str
    backend: str
    device_kind: str
    nccl_env: dict[str, str]


class Join(msgspec.Struct, frozen=True, tag="join"):
    member_id: str
    fingerprint: Fingerprint
    token_mac: str = ""
    pid: int = 0
    host: str = ""


class Leave(msgspec.Struct, frozen=True, tag="leave"):
    member_id: str


class Heartbeat(msgspec.Struct, frozen=True, tag="heartbeat"):
    member_id: str
    time: float


InboxMessage = Union[Join, Leave]


class Admit(msgspec.Struct, frozen=True, tag="admit"):
    member_id: str
    generation: int
    members: tuple[str, ...]  # rank i+1 is members[i]


class Deny(msgspec.Struct, frozen=True, tag="deny"):
    reason: str
    kind: str  # "token" | "handshake" | "closed" | "duplicate"


AdmitReply = Union[Admit, Deny]


class Announce(msgspec.Struct, frozen=True, tag="announce"):
    """Version `version` follows on the data plane as `num_buckets` broadcasts."""

    version: int
    manifest: Manifest
    bucket_bytes: int
    num_buckets: int
    checksum: int = 0  # 0: not computed
    resend: bool = False


class Reconfigure(msgspec.Struct, frozen=True, tag="reconfigure"):
    """Generation `generation` ends; the listed members build `next_generation`."""

    next_generation: int
    members: tuple[str, ...]  # rank i+1 is members[i]; rank 0 is the publisher
    reason: str = ""


class Shutdown(msgspec.Struct, frozen=True, tag="shutdown"):
    reason: str = ""


Command = Union[Announce, Reconfigure, Shutdown]


class Ack(msgspec.Struct, frozen=True):
    member_id: str
    version: int
    ok: bool
    seconds: float = 0.0
    error: str = ""


_encoder = msgspec.msgpack.Encoder()
encode = _encoder.encode

inbox_decoder = msgspec.msgpack.Decoder(InboxMessage)
admit_decoder = msgspec.msgpack.Decoder(AdmitReply)
command_decoder = msgspec.msgpack.Decoder(Command)
ack_decoder = msgspec.msgpack.Decoder(Ack)
heartbeat_decoder = msgspec.msgpack.Decoder(Heartbeat)
