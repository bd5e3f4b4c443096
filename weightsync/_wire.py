r"""Wire formats: every message that crosses a process boundary.

All of them are frozen msgspec Structs encoded as msgpack; decoding never runs code (no pickle
anywhere). Control messages form tagged unions, so one decoder reads any of them and rejects
anything else with a clear error instead of crashing the reader.

Every subscriber (and nothing else) holds one TCP connection to its publisher's control server
(``weightsync.control``). On it, length-prefixed :class:`Frame`\ s, each carrying a sequence
number and, once admitted, a MAC under the member's session key::

    server -> client   Challenge (first, unauthenticated: a fresh nonce)
    client -> server   Join      (answers it: member id, fingerprint, its own nonce, a proof)
    server -> client   Admit | Deny, then Go, Announce, WireSizes, Seal, Commit, Reconfigure, Shutdown, Beat,
                       StoreResult, Probe, EngineTally
    client -> server   Ready, Ack, Leave, Beat, StoreOp, ProbeReply, EngineReport

``StoreOp``/``StoreResult`` carry the data plane's own rendezvous (gloo and NCCL exchange
addresses through a store): the publisher serves it from memory, to admitted members only.
``Probe``/``ProbeReply`` time each member's own link (the publisher scores slow links with it).
``Wake`` never crosses the wire: a thread puts it into a local queue to end another's wait.
"""

from __future__ import annotations

import re
from typing import Union

import msgspec

#: channel names and member ids: they become store prefixes, file names, log lines and Prometheus
#: labels, so they keep to a safe alphabet (a member id with a newline or an escape code forged
#: lines in the publisher's log and drove the operator's terminal)
NAME_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._:@+=-]{0,255}")


def name_problem(what: str, value: object) -> str | None:
    """Why ``value`` is not a valid channel name or member id (``what`` says which), or None."""
    if isinstance(value, str) and NAME_PATTERN.fullmatch(value):
        return None
    shown = repr(value[:64]) if isinstance(value, str) else type(value).__name__
    return (f"{what} must be 1-256 characters of letters, digits and . _ : @ + = - (starting with a letter, "
            f"digit or _; no '/', spaces or control characters), got {shown}")

PROTOCOL_VERSION = 17  # 2: settings in Admit; CRC32C. 3: link probes. 4: same-host shm. 5: sharded (lanes).
# 6: sliced members (Join.want, point-to-point buckets: Announce.direct)
# 7: tied tensors sent once (Manifest.ties); Challenge.open
# 8: each member's Announce names the version's encoding on the wire (Announce.encoding, .wire)
# 9: deltas: Announce.base, .base_digest (the version a delta is against, and its digest)
# 10: fleet-wide activation: ChannelSettings.activation, Commit, Ack.exposed; EngineReport, EngineTally
# 11: Announce.digest (the Seal's digest function, chosen by the publisher's CPU: format.checksum)
# 12: Announce.wire_later, WireSizes (a delta's wire buckets are sized as they are encoded, while earlier ones move)
# 13: same-host members read snapshots in place; the publisher parks a buffer a member still reads (Ack.still_read)
# 14: ChannelSettings.streams (a gloo group's connections per pair: every end builds as many)
# 15: Commit.settled (activation "all": every member exposed the version; until then a member is in doubt)
# 16: an Announce carries its encoding's fields in Announce.coding and its plane's as opaque Announce.plane
#     (a plane or an encoding added never edits this module); the same-host ShmRef moved to planes.shm
# 17: PeerOffer (a one-sided member offers the buffer holding a version to newcomers catching up)


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
    # (name, source): tensor ``name`` is ``source`` itself (tied weights: an embedding and a head
    # sharing storage), sent once and re-tied on the member
    ties: tuple[tuple[str, str], ...] = ()


class Fingerprint(msgspec.Struct, frozen=True):
    """What must agree between publisher and subscriber for the data plane to work."""

    protocol: int
    torch: str
    nccl: str
    backend: str
    device_kind: str
    nccl_env: dict[str, str]


class Frame(msgspec.Struct, frozen=True, array_like=True):
    """One message on a control connection: ``body`` is the msgpack of the message itself."""

    seq: int  # strictly increasing per direction; anything else is dropped and recorded
    mac: bytes  # HMAC-SHA256 (16 bytes) of direction, seq and body under the session key; b"" when open
    body: bytes


class ShmOffer(msgspec.Struct, frozen=True):
    """Where a same-host member finds the publisher's shared memory (``planes.shm``)."""

    pid: int
    fd: int  # the door: a one-page segment holding ``token``
    token: bytes
    boot_id: str  # the kernel's boot id: another host (or boot) has another


class Piece(msgspec.Struct, frozen=True, array_like=True):
    """Where one tensor of a lane goes in the full layout (``format.sharding``)."""

    tensor: int  # index into the full manifest
    blocks: tuple[tuple[int, int, int, int], ...]  # (offset, run, count, stride) bytes in the full layout


class Assembly(msgspec.Struct, frozen=True):
    """A sharded version: this lane is trainer rank ``rank``'s part of the full ``manifest``."""

    rank: int
    world: int
    manifest: Manifest  # the full tensors
    pieces: tuple[Piece, ...]  # per tensor of the Announce's (lane) manifest


class Want(msgspec.Struct, frozen=True, array_like=True):
    """A sliced member wants only this box of tensor ``name``: ``shape`` elements from ``offset``;
    ``of``, where the member knows it, the tensor's whole shape (a version whose tensor has another
    shape is refused for that member: its box would be of another layout)."""

    name: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    of: tuple[int, ...] | None = None


class Challenge(msgspec.Struct, frozen=True, tag="challenge"):
    """The server's first frame on a new connection: answer with a Join that proves the secret."""

    protocol: int
    channel: str
    nonce: bytes  # fresh per connection: a recorded Join is worthless on another one
    shm: ShmOffer | None = None  # the publisher's shared memory, for members on its host
    open: bool = False  # the channel has no secret: a subscriber holding one is told why it cannot join


class Join(msgspec.Struct, frozen=True, tag="join"):
    member_id: str
    fingerprint: Fingerprint
    nonce: bytes  # the client's own nonce (both nonces make the session key)
    proof: bytes = b""  # HMAC over both nonces, channel, member id and fingerprint; b"" when open
    pid: int = 0
    host: str = ""
    transport: str = "group"  # "group" | "shm" (the member opened the Challenge's door) | "rank" (a trainer rank)
    want: tuple[Want, ...] | None = None  # a sliced member: only these boxes, point to point; None: everything
    accepts: str | None = None  # the checkpoint format its engine loads ("": unquantized); None: any


class Leave(msgspec.Struct, frozen=True, tag="leave"):
    member_id: str


class Wake(msgspec.Struct, frozen=True, tag="wake"):
    """Put by a thread into a local queue another thread waits on, to end that wait."""

    reason: str = ""


class ChannelSettings(msgspec.Struct, frozen=True):
    """What the publisher tells every member at admission: the one source of these values.

    A subscriber derives every data-plane deadline from these (see ``options.Deadlines``)
    and hard-codes none of them, so a publisher with 1 GiB buckets and its members agree.
    """

    protocol: int
    bucket_bytes: int
    timeout: float  # the floor of every data-plane deadline
    min_bandwidth: float  # bytes/s: a bucket of n bytes may take timeout + n / min_bandwidth
    heartbeat_interval: float  # members beat this often; the publisher judges silence by it
    checksum: bool  # the publisher's default: versions are followed by a Seal (each Announce says)
    in_place: bool  # generations re-form one long-lived backend (Ready carries its handle)
    # "each": a member exposes a version once it has verified it; "all": it stages the verified
    # version, acknowledges it, and exposes it only on the publisher's Commit
    activation: str = "each"
    # gloo: connections per pair of ends (one gloo device each; consecutive buckets take turns).
    # Every end of a group must build as many, so the publisher says how many
    streams: int = 1


class Admit(msgspec.Struct, frozen=True, tag="admit"):
    member_id: str
    generation: int
    members: tuple[str, ...]  # rank i+1 is members[i]; rank 0 is the publisher
    settings: ChannelSettings
    slot: int = 0  # unique in this channel: the rank a reconfigurable backend is created with
    lanes: tuple[str, ...] = ()  # a sharded publisher: the addresses of trainer ranks 1..W-1


class Deny(msgspec.Struct, frozen=True, tag="deny"):
    reason: str
    # "token" | "handshake" | "closed" | "duplicate" | "want" | "transport" | "busy" (at the door, before any Challenge)
    kind: str


class Go(msgspec.Struct, frozen=True, tag="go"):
    """Every member of `generation` is ready: enter the group's rendezvous now."""

    generation: int
    uuid: int = 0  # with handles: reconfigure the long-lived backend in place under this uuid
    handles: tuple[str, ...] = ()  # rank-ordered reconfigure handles; empty: build a fresh group
    rendezvous: str = ""  # the generation's unpredictable rendezvous prefix (fresh random token)
    group: tuple[str, ...] = ()  # the members that form the group, in rank order (the others read shm)


class Coding(msgspec.Struct, frozen=True):
    """How an announced version's buckets are encoded on the wire (``weightsync.encodings.seam``)."""

    name: str = "full"  # the encoding ("full": the staged bytes as they are)
    wire: tuple[int, ...] = ()  # each bucket's bytes on the wire; empty: the layout's (as staged)...
    later: bool = False  # ...or told bucket by bucket in WireSizes, each before its bucket moves
    base: int = -1  # a delta: the version it is against (the member's readable one), else -1
    base_digest: bytes = b""  # ...and that version's digest (planes.encoding.base_digest)
    own: bytes = b""  # the encoding's own fields: msgpack it writes and reads itself, opaque here


FULL_CODING = Coding()


class Announce(msgspec.Struct, frozen=True, tag="announce"):
    """Version `version` follows on the data plane as `num_buckets` buckets.

    What is every plane's and every encoding's is here; a plane's own fields (where a same-host
    member finds the segment) travel in ``plane``, which its member end decodes, and an
    encoding's in ``coding``: neither a new plane nor a new encoding edits this module."""

    generation: int
    seq: int
    version: int
    manifest: Manifest
    bucket_bytes: int
    num_buckets: int
    resend: bool = False
    checksum: bool = True  # a Seal with this version's per-bucket digests follows its buckets
    assembly: Assembly | None = None  # a sharded version: where this lane's bytes go in the full one
    direct: bool = False  # the buckets come point to point, each member's own (Join.want) or whole
    digest: str = "crc32c"  # the function of the Seal's per-bucket digests (format.checksum.KINDS)
    coding: Coding = FULL_CODING  # how the buckets are encoded on the wire
    plane: bytes = b""  # the serving plane's own fields: msgpack its two ends write and read, opaque here


class Seal(msgspec.Struct, frozen=True, tag="seal"):
    """Per-bucket digests (``format.checksum``) of version `version`, sent once its buckets left.

    To a sliced member: the digests of what it was sent of each bucket (0 where nothing)."""

    generation: int
    seq: int
    version: int
    checksums: tuple[int, ...]
    abandoned: bool = False  # the publisher gave up on this version: no checksums follow


class WireSizes(msgspec.Struct, frozen=True, tag="wire_sizes"):
    """The lengths of wire buckets ``first``, ``first + 1``, ... of version `version` (an Announce
    with ``wire_later``), each sent before its bucket moves: the publisher encodes a bucket while
    the ones before it are on the wire. Point to point on the control connection, never relayed."""

    generation: int
    seq: int
    version: int
    first: int
    sizes: tuple[int, ...]


class Commit(msgspec.Struct, frozen=True, tag="commit"):
    """Every member of the generation staged version `version` (seq `seq`): expose it now.

    Sent only with ``activation="all"``, to every member that acknowledged the version staged,
    once all of them had; a member answers with an ``Ack(exposed=True)``."""

    generation: int
    seq: int
    version: int
    #: a second Commit, once every member said it exposed the version: none is in doubt about it
    #: (a member whose publisher dies before it, or before its Commit, reports the split: Receiver.end)
    settled: bool = False


class Abandon(msgspec.Struct, frozen=True, tag="abandon"):
    """The publisher gave up on version `version` (seq `seq`): a receiver still in its buckets stops."""

    generation: int
    seq: int
    version: int


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
    corrupt: bool = False  # not ok because the bytes arrived but did not match the Seal
    exposed: bool = False  # activation "all": the answer to a Commit (the version is now readable here)
    # a same-host member: the older version it still reads in place (a reader holds it), -1 none
    still_read: int = -1
    # not ok because this member is leaving (its abort()): its Leave follows, and the publisher
    # takes it at its word (a member that says so is dropped at the next generation)
    leaving: bool = False


class Beat(msgspec.Struct, frozen=True, tag="beat"):
    """Liveness, both ways, every heartbeat interval."""


class Probe(msgspec.Struct, frozen=True, tag="probe"):
    """Publisher -> member: ``pad`` times this member's own link, which the broadcast tree
    hides (a relay waits as long as its slow child)."""

    seq: int
    pad: bytes


class ProbeReply(msgspec.Struct, frozen=True, tag="probe_reply"):
    member_id: str
    seq: int
    seconds: float  # from the probe's first byte to its last, as the member's reader saw them


class StoreOp(msgspec.Struct, frozen=True, tag="store"):
    """A data-plane rendezvous call (``set``/``get``/``wait``/``add``/``check``/``delete``/``compare_set``)."""

    rid: int
    op: str
    keys: tuple[str, ...]
    value: bytes = b""
    amount: int = 0
    timeout: float = 0.0
    desired: bytes = b""  # compare_set: the new value (``value`` is the expected one)


class StoreResult(msgspec.Struct, frozen=True, tag="store_result"):
    rid: int
    ok: bool
    value: bytes = b""
    number: int = 0
    error: str = ""


class Copied(msgspec.Struct, frozen=True, tag="copied"):
    """A same-host member copied bucket ``bucket`` of a ring version out of shared memory."""

    generation: int
    seq: int
    member_id: str
    bucket: int


class PeerOffer(msgspec.Struct, frozen=True, tag="peer_offer"):
    """A member holds ``version``'s bytes where other members may read them (a newcomer catching up
    from a peer); ``source`` is its plane's own description of where, passed on unread."""

    member_id: str
    version: int
    source: bytes


class EngineReport(msgspec.Struct, frozen=True, tag="engine_report"):
    """A member's inference engine loaded ``version``: the digest of what it holds, for engines of the
    same ``layout`` (model, parallel rank, dtype) to be compared through the publisher."""

    rid: int
    version: int
    layout: str
    digest: str


class EngineTally(msgspec.Struct, frozen=True, tag="engine_tally"):
    """The answer to an EngineReport: how many members reported each digest for that version and layout."""

    rid: int
    counts: dict[str, int]
    error: str = ""


ClientMessage = Union[Join, Ready, Ack, Leave, Beat, StoreOp, ProbeReply, Copied, PeerOffer, EngineReport]
ServerMessage = Union[Challenge, Admit, Deny, Go, Announce, Abandon, Seal, WireSizes, Reconfigure, Shutdown, Beat,
                      StoreResult, Probe, Commit, EngineTally]


_encoder = msgspec.msgpack.Encoder()
encode = _encoder.encode

frame_decoder = msgspec.msgpack.Decoder(Frame)
client_decoder = msgspec.msgpack.Decoder(ClientMessage)
server_decoder = msgspec.msgpack.Decoder(ServerMessage)
