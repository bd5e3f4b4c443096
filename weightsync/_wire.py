"""Wire formats: every control message that crosses a process boundary.

All of them are frozen msgspec Structs encoded as msgpack; decoding never runs code (no
pickle anywhere). Control messages form tagged unions so one decoder reads any of them and
rejects anything else with a clear error instead of crashing the reader.

The store layout of one channel (all keys under ``ws/<channel>/``). Every wait is a
blocking pop on a store queue; whoever wants a waiter to stop pushes a Wake into its queue,
so waits end when something happens, not by polling::

    q/inbox                    Join | Leave          subscribers -> publisher's inbox thread
    q/replies                  Ready | Ack           subscribers -> publisher's sender thread
    q/member/<id>/<nonce>      Admit | Deny | Go | Announce | Reconfigure | Shutdown
                                                     publisher -> one subscriber incarnation
    hb/<id>                    heartbeat counter (store.add), "publisher" for the publisher
    gen/<g>/pg/...             the dedicated group's own rendezvous (fresh per generation)
"""

from __future__ import annotations

from typing import Union

import msgspec

PROTOCOL_VERSION = 2  # 2: settings travel in Admit; checksums are CRC32C


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
    reply_to: str  # this subscriber incarnation's own queue
    fingerprint: Fingerprint
    token_mac: str = ""
    pid: int = 0
    host: str = ""


class Leave(msgspec.Struct, frozen=True, tag="leave"):
    member_id: str


class Wake(msgspec.Struct, frozen=True, tag="wake"):
    """Pushed by a process into a queue it waits on, to end that wait (close, liveness change)."""

    reason: str = ""


class ChannelSettings(msgspec.Struct, frozen=True):
    """What the publisher tells every member at admission: the one source of these values.

    A subscriber derives every data-plane deadline from these (see ``transport.options.Deadlines``)
    and hard-codes none of them, so a publisher with 1 GiB buckets and its members agree.
    """

    protocol: int
    bucket_bytes: int
    timeout: float  # the floor of every data-plane deadline
    min_bandwidth: float  # bytes/s: a bucket of n bytes may take timeout + n / min_bandwidth
    heartbeat_interval: float  # members beat this often; the publisher judges silence by it
    checksum: bool  # every version is followed by a Seal of per-bucket digests
    in_place: bool  # generations re-form one long-lived backend (Ready carries its handle)


class Admit(msgspec.Struct, frozen=True, tag="admit"):
    member_id: str
    generation: int
    members: tuple[str, ...]  # rank i+1 is members[i]; rank 0 is the publisher
    settings: ChannelSettings
    slot: int = 0  # unique in this channel: the rank a reconfigurable backend is created with


class Deny(msgspec.Struct, frozen=True, tag="deny"):
    reason: str
    kind: str  # "token" | "handshake" | "closed" | "duplicate"


class Go(msgspec.Struct, frozen=True, tag="go"):
    """Every member of `generation` is ready: enter the group's rendezvous now."""

    generation: int
    uuid: int = 0  # with handles: reconfigure the long-lived backend in place under this uuid
    handles: tuple[str, ...] = ()  # rank-ordered reconfigure handles; empty: build a fresh group


class Announce(msgspec.Struct, frozen=True, tag="announce"):
    """Version `version` follows on the data plane as `num_buckets` broadcasts."""

    generation: int
    seq: int
    version: int
    manifest: Manifest
    bucket_bytes: int
    num_buckets: int
    resend: bool = False


class Seal(msgspec.Struct, frozen=True, tag="seal"):
    """Per-bucket digests (``layout.checksum``) of version `version`, sent once its buckets left."""

    generation: int
    seq: int
    version: int
    checksums: tuple[int, ...]
    abandoned: bool = False  # the publisher gave up on this version: no checksums follow


class Reconfigure(msgspec.Struct, frozen=True, tag="reconfigure"):
    """The current generation ends; the listed members build `next_generation`."""

    next_generation: int
    members: tuple[str, ...]  # rank i+1 is members[i]; rank 0 is the publisher
    reason: str = ""
    trouble: bool = False  # a failure ended the generation: members dump their flight recorders
    fresh: bool = False  # an operation failed mid-flight: re-formed backends are replaced, not reused


class Shutdown(msgspec.Struct, frozen=True, tag="shutdown"):
    reason: str = ""


class Ready(msgspec.Struct, frozen=True, tag="ready"):
    generation: int
    member_id: str
    handle: str = ""  # this member's reconfigure handle, read just now ("" when it has none)


class Ack(msgspec.Struct, frozen=True, tag="ack"):
    generation: int
    seq: int
    member_id: str
    version: int
    ok: bool
    seconds: float = 0.0
    own_seconds: float = 0.0  # of `seconds`, the time not spent waiting on the collective
    error: str = ""


InboxMessage = Union[Join, Leave, Wake]
MemberMessage = Union[Admit, Deny, Go, Announce, Reconfigure, Shutdown, Wake]
ReplyMessage = Union[Ack, Ready, Wake]
SealMessage = Union[Seal, Wake]


_encoder = msgspec.msgpack.Encoder()
encode = _encoder.encode

inbox_decoder = msgspec.msgpack.Decoder(InboxMessage)
member_decoder = msgspec.msgpack.Decoder(MemberMessage)
reply_decoder = msgspec.msgpack.Decoder(ReplyMessage)
seal_decoder = msgspec.msgpack.Decoder(SealMessage)
