"""The data-plane interface: the one seam the Sender and Receiver drive to move bytes.

A *data plane* moves the buckets of one version from the publisher's end to members. It has
two ends, and a name (the transport a member joins with: ``"group"``, ``"shm"``, or one
registered with :func:`register_plane`). The Sender and the Receiver know nothing else about
it: not the backend, not how a generation is formed, not whether bytes cross a socket; they
never branch on which plane it is, only on what it says of itself (``in_group``,
``moves_alone``, ``drives``).

**A member's end** (:class:`DataPlane`), every call made by its receiver thread, in order:

1. ``offer()``: what this end contributes to the next generation's rendezvous, sent to the
   publisher in ``Ready`` (a reconfigure handle; ``""`` when nothing);
2. ``enter(spec)``: form generation ``spec.generation`` with ``spec.members``, bounded by
   ``spec.timeout``; the publisher's ``Go`` carries what every member offered (only planes
   ``in_group``: a member of a plane that is not joins no group);
3. ``move(transfer)``: receive ``transfer.buckets`` (the Announce it reads its own fields from
   is ``transfer.announce``), each bucket bounded by ``transfer.deadline(nbytes)``, calling
   ``transfer.after(i)`` once bucket i is in (the receiver times its own work there: straggler
   scoring counts that, not the wait on peers);
4. ``leave(reason, failed=...)``: end the generation (a hung operation must return); with
   ``failed`` the next ``enter`` starts from fresh resources;
5. ``close()``: for good. ``leave`` and ``close`` are idempotent and never raise.

**The publisher's end** (:class:`SendPart`), driven by the Sender's thread through
:class:`weightsync.planes.sendside.SendSide`, which holds one part per plane and picks each
member's part at admission from the transport in its Join. Per version, the Sender builds an
:class:`Outgoing` and asks every part with members in it to ``prepare`` it (the fields the
Announce carries for them: a segment to read, whether the version goes point to point; a part
may wrap the packing hook, add an after-bucket hook, or name members it proves with digests
of their own), then ``move``: the one part that ``drives`` (the group: it issues the buckets)
runs the hooks; with none, the send side walks the buckets through them itself. The part
whose plane is ``in_group`` owns the generation's group plane (``plane``): Generations forms
the group through it.

Failures are :mod:`weightsync._errors`: ``PeerFailure`` when a peer broke the step,
``Cancelled`` when ``transfer.cancelled()`` said to stop, ``LocalFailure`` when this end's own
``before``/``after`` hook failed (packing a ``copy=False`` tensor, say). Nothing else escapes.

The planes (docs/architecture.md has the picture and how new ones plug in):

- ``"group"`` (:mod:`weightsync.planes.group.plane`, :mod:`weightsync.planes.group.send`): gloo/NCCL broadcast
  of each bucket from rank 0, or, in a generation with sliced members, rank 0 sending each
  member its own share point to point over the same communicator;
- ``"shm"`` (:mod:`weightsync.planes.shm.plane`, :mod:`weightsync.planes.shm.send`): the
  publisher's snapshot lives in shared memory; a same-host member's ``move`` copies each
  bucket out of the segment its Announce names and joins no group;
- sharded trainers ("lanes"): a member holds one receiver (and one plane) per trainer rank,
  each its own channel end with one communicator; a version is readable once every lane's
  ``move`` has returned and verified;
- ``"one-sided"`` (:mod:`weightsync.planes.onesided.plane`, :mod:`weightsync.planes.onesided.send`):
  torch 2.15's ``torch.distributed._transport`` (NIXL); the publisher registers each staging
  buffer once and a member's ``move`` reads each bucket out of it; the publisher issues nothing;
- a plane registered from outside (:func:`register_plane`): tests/mailbox_plane.py is one
  that the Sender and Receiver serve unchanged; a CUDA IPC plane would plug in the same way.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from weightsync import _wire
from weightsync.encodings import registry
from weightsync.encodings.seam import Base, WirePlan


@dataclass(frozen=True)
class GenerationSpec:
    """What ``enter`` needs: who is in generation ``generation``, and this end's rank in it."""

    generation: int
    members: tuple[str, ...]  # rank i+1 is members[i]; rank 0 is the publisher
    rank: int
    timeout: float
    uuid: int = 0  # with ``offers``: re-form in place under this uuid
    offers: tuple[str, ...] = ()  # rank-ordered, what every end offered; empty: build anew
    rendezvous: str = ""  # the generation's random token: its rendezvous keys live under it


@dataclass
class Transfer:
    """One version's buckets on their way, and the hooks around each one."""

    version: int
    buckets: Sequence[torch.Tensor]
    deadline: Callable[[int], float]  # seconds allowed for a bucket of n bytes
    before: Callable[[int], None] | None = None  # runs before bucket i is issued (packing)
    after: Callable[[int], None] | None = None  # runs once bucket i completed (checksums)
    cancelled: Callable[[], bool] | None = None  # polled before each bucket and while waiting: True stops (Cancelled)
    encoding: str = "full"  # how the buckets are encoded, and against which base (-1: none): recorded
    base: int = -1
    #: the version's Announce as sent: a plane reads its own fields there (where a segment is, whether
    #: the version goes point to point); the Sender and Receiver never look at them for it
    announce: Any = None


class DataPlane(Protocol):
    """A member's end of a plane; see the module docstring for who calls what, and when. A plane has
    no kind attribute: nothing may branch on which plane it is, only on what it says of itself."""

    #: a member end takes part in its generation's group (``enter`` forms it); False: it joins
    #: none and reads the version from where the Announce says (shared memory)
    in_group: bool
    #: a member end's ``move`` waits on no peer (a copy): all its time is the member's own work
    #: in straggler scoring; False: time in ``move`` is the collective's
    moves_alone: bool

    def offer(self) -> str: ...

    def rendezvous_prefixes(self, spec: GenerationSpec) -> tuple[str, ...]: ...

    def broadcast_parent(self, rank: int) -> int | None: ...

    def enter(self, spec: GenerationSpec) -> None: ...

    def move(self, transfer: Transfer) -> None: ...

    def view_of(self, announce: Any) -> tuple[torch.Tensor, Callable[[], bool]] | None:
        """A version this end serves where it lies instead of moving it into the slot (a sealed
        same-host snapshot): a read-only view of its bytes and a guard (True while they are
        unchanged); None: ``move`` receives it."""
        ...

    def leave(self, reason: str, *, failed: bool = False) -> None: ...

    def close(self) -> None: ...


def _tell_nobody(_first: int, _sizes: Any, _to: Any = None) -> None:
    """``tell_sizes`` before the Sender sets it, and once the version is closed: nobody to tell."""


@dataclass
class Outgoing:
    """One version leaving the publisher, as the Sender hands it to the send side's parts.

    The Sender fills the first fields; ``prepare`` of each part may wrap ``before`` (with
    :meth:`wrap`) and add to ``afters``; whoever walks the buckets (the driving part, else the
    send side) calls ``before(i)`` before bucket i is issued and every ``afters`` hook once it
    completed.
    """

    version: int
    generation: int
    seq: int
    buckets: Sequence[torch.Tensor]  # what goes on the wire, bucket by bucket
    ranges: Sequence[tuple[int, int]]  # each bucket's bytes in the staged version
    manifest: Any  # the staged version's manifest (a lane's own, for a sharded rank)
    assembly: Any  # a sharded rank's part of the full version, else None
    snapshot: torch.Tensor | None  # the staged bytes; None: copy=False, the buckets are two buffers in turns
    progress: Any  # a pipelined snapshot still being taken (it marks its own progress), else None
    bucket_bytes: int
    checksum: bool
    deadline: Callable[[int], float]
    cancelled: Callable[[], bool]
    #: the sending end's threads an encoder may run its work on (the Sender's: one per CPU this
    #: process may use, at most 8, made as work comes and stopped with the publisher)
    workers: Executor
    before: Callable[[int], None] | None = None
    afters: list[Callable[[int], None]] = field(default_factory=list)
    #: asked for by the Sender: send each member its bytes straight (finding a corrupting relay);
    #: a plane without relays ignores it
    point_to_point: bool = False
    hooked: bool = False  # a part wrapped ``before``: the buckets must be walked even with nobody driving
    encoding: str = "full"  # the version's encoding on the wire, for parts that carry it (:meth:`encoded`)
    digest: str = "crc32c"  # the per-bucket digest's function (format.checksum.KINDS), named in the Announce
    base: Base | None = None  # what a delta may be relative to (the retained version), else None
    keeps_base: bool = False  # copy=False: the publisher keeps a copy of what it sends as the next base
    #: ``"auto"``: full versions reached this channel's group faster than deltas lately (the Sender's
    #: measurement), so the encoder need not make one
    prefer_full: bool = False
    # filled by the encoder's plan: whom it was planned for, why the version went full instead of
    # in ``encoding`` ("" when it did not: the Sender logs it), its encode time
    receivers: tuple[str, ...] = ()
    full_reason: str = ""
    encode_seconds: float = 0.0
    share_sample: str | None = None  # ``"auto"`` to sliced members: the version's sampled verdict, once taken
    #: the staged buckets' digests, when the encoder took them while it read the buckets (the Sender's
    #: after-bucket checksum then reads them instead of the buckets again)
    staged_digests: list[int] | None = None
    #: a version sent before and sealed (a re-send, to a newcomer say): its buckets' digests, which
    #: members may check bytes from elsewhere against before they take them (a peer's); else None
    sealed: tuple[int, ...] | None = None
    #: tells the members of an encoded version wire buckets ``first``, ``first + 1``...'s lengths
    #: (a plan made ``later``: each before its bucket moves), ``tell_sizes(first, sizes, to=None)``:
    #: to ``to`` alone where given (a sliced member's delta), else to ``receivers``; set by the Sender
    tell_sizes: Callable[..., None] = _tell_nobody
    _wire: WirePlan | None = None

    def wrap(self, outer: Callable[[Callable[[int], None]], Callable[[int], None]]) -> None:
        """Wrap the packing hook: ``outer(inner)`` runs in its place (``inner`` may be a no-op)."""
        inner = self.before or (lambda _i: None)
        self.before, self.hooked = outer(inner), True

    def after(self, i: int) -> None:
        for hook in self.afters:
            hook(i)

    def wire_bytes(self) -> int | None:
        """What the encoded version put on the wire per member reached, once moved (None: not encoded)."""
        plan = self._wire
        if plan is None or plan.encoding == "full":
            return None
        return sum(plan.told) if plan.later else sum(plan.sizes) if plan.sizes else None

    def close(self) -> None:
        """The version is done with (moved or given up on): an encoder still at work stops, and the
        hooks go. They close over this object (and it holds them), so without this each version's
        buckets, hooks and encoder state stayed in a reference cycle until the cyclic collector ran,
        on whichever thread it ran: measured on the trainer's event loop, pauses of 100-200 ms
        that also freed the bytes they held. ``wire_bytes`` still answers after it."""
        plan = self._wire
        if plan is not None:
            if plan.close is not None:
                plan.close()
            plan.hook = plan.before = plan.close = None
        self.afters.clear()
        self.before = None
        self.tell_sizes = _tell_nobody

    def encoded(self, receivers: tuple[str, ...]) -> WirePlan:
        """The version in its encoding for ``receivers`` (planned once, by the first part that carries
        it): the wire buckets to move instead of ``buckets``; the encoder's hook runs once bucket i
        is staged. The plan's ``encoding`` is what the Announce names (an encoder may send full)."""
        if self._wire is None:
            self.receivers = receivers
            plan = registry.encoder(self.encoding).plan(self)
            plan.encoding = plan.encoding or self.encoding
            if plan.hook is not None:
                encode = plan.hook

                def outer(inner: Callable[[int], None]) -> Callable[[int], None]:
                    def staged_then_encoded(i: int) -> None:
                        inner(i)
                        encode(i)
                    return staged_then_encoded

                self.wrap(outer)
            self._wire = plan
        return self._wire


@dataclass(frozen=True)
class Prepared:
    """What a part's ``prepare`` returns for its members: what their Announce says beyond what
    every Announce says, and whether they check the Seal's digests."""

    plane: bytes = b""  # the plane's own fields (``Announce.plane``: msgpack its member end reads)
    coding: _wire.Coding = _wire.FULL_CODING  # how the buckets go on the wire for these members
    direct: bool = False  # point to point: each member its own bytes (``Announce.direct``)
    #: members with a coding of their own (a sliced member sent a delta of its share)
    each: Mapping[str, _wire.Coding] = field(default_factory=dict)
    checked: bool = True  # its members check the Seal's digests (False: a sealed same-host snapshot)

    def coding_of(self, member: str) -> _wire.Coding:
        return self.each.get(member, self.coding)

    def codings(self) -> tuple[_wire.Coding, ...]:
        return (self.coding, *self.each.values())


class SendPart(Protocol):
    """The publisher's end of one plane, for the members admitted to it (see the module docstring).

    A part subclasses it to inherit the defaults of its optional members (``reads_in_place``,
    ``wire_of``); the send side checks every member is there when it builds the part."""

    name: str  # the transport a member's Join names to be served by this part
    in_group: bool  # its members are ranks of the generation's group (``plane`` forms it)
    moves_alone: bool  # its members' receive time is all their own (no link to probe, no peer to wait on)
    drives: bool  # its ``move`` issues the buckets (runs the hooks); else it rides along
    plane: Any  # the part ``in_group``: the group plane Generations forms generations through; else None
    #: optional: its members read a whole snapshot where staging keeps it, so staging parks the
    #: buffer of a version they still read
    reads_in_place: bool = False

    def admit(self, member: str, want: Any) -> None: ...

    def refusal(self, want: Any, published: tuple[int, _wire.Manifest]) -> str | None:
        """Optional: why a member joining with ``want`` cannot be served the newest version put
        (``published``: its number and full layout), so it is refused at the door
        (``ManifestMismatch`` on its side), or None; default: None (a version refuses it, if any)."""
        return None

    def forget(self, member: str) -> None: ...

    def prepare(self, out: Outgoing, members: tuple[str, ...]) -> Prepared:
        """Ready ``out`` for ``members`` (this part's, in the version); returns what their Announce says.
        Raises LocalFailure when this end cannot serve them (the put fails, nobody is blamed)."""
        ...

    def move(self, out: Outgoing, members: tuple[str, ...]) -> None: ...

    def digests(self) -> Mapping[str, Sequence[int]]:
        """After ``move``: members this part proves with digests of their own bytes (sliced ones)."""
        ...

    def wire_of(self) -> Mapping[str, int]:
        """Optional, after ``move``: per member it sent bytes of its own (a sliced member's share),
        how many; default: none."""
        return {}

    def close(self) -> None: ...


#: what the send side asks of every part (``SendPart``'s members)
SEND_PART_MEMBERS = ("name", "in_group", "moves_alone", "drives", "plane", "reads_in_place", "admit", "refusal",
                     "forget", "prepare", "move", "digests", "wire_of", "close")


@dataclass(frozen=True)
class MemberContext:
    """What a member's end of a plane is built from, once the publisher admitted the member."""

    channel: str
    member: str
    backend: str
    device: torch.device
    recorder: Any  # the member's FlightRecorder
    scope: Any  # its RecorderScope
    client: Any  # its ControlClient (a plane that answers the publisher sends through it)
    admit: Any  # the publisher's Admit
    rendezvous_timeout: float
    store: Callable[[], Any]  # a new view of the publisher's rendezvous table (a c10d Store) through the client


@dataclass(frozen=True)
class PublisherContext:
    """What the publisher's end of a plane is built from, on the sender thread."""

    channel: str
    control: Any  # the control server (a plane that waits on members' replies uses it)
    recorder: Any
    scope: Any
    deadlines: Any
    buckets: Any  # the Sender's two copy=False bucket buffers (BucketBuffers)
    make_plane: Callable[[], Any]  # the group plane of this end (a group part owns it)
    extra: Mapping[str, Any] = field(default_factory=dict)  # a registered plane's own objects


@dataclass(frozen=True)
class PlaneSpec:
    """A plane the library can serve: its name and how to build each end."""

    name: str
    send_part: Callable[[PublisherContext], SendPart]
    member_plane: Callable[[MemberContext], DataPlane]


#: the built-in planes, imported when first used (nothing is imported or registered at import)
_BUILTIN = {"group": "weightsync.planes.group.send", "shm": "weightsync.planes.shm.send",
            "one-sided": "weightsync.planes.onesided.send"}
_registered: dict[str, PlaneSpec] = {}
_lock = threading.Lock()


def register_plane(spec: PlaneSpec) -> None:
    """Serve ``spec.name`` from now on in this process: a member asking for
    ``Subscriber(transport=spec.name)`` is served by ``spec`` on both ends (both ends must
    have it registered). A built-in name cannot be taken."""
    if spec.name in _BUILTIN or spec.name in ("auto", "rank"):
        raise ValueError(f"transport {spec.name!r} is built in")
    with _lock:
        _registered[spec.name] = spec


def unregister_plane(name: str) -> None:
    with _lock:
        _registered.pop(name, None)


def registered_planes() -> tuple[str, ...]:
    """The planes registered from outside the library (not the built-in ones)."""
    with _lock:
        return tuple(_registered)


def plane_spec(name: str) -> PlaneSpec:
    """The plane serving transport ``name``; KeyError for one nobody registered."""
    if name in _BUILTIN:
        module = importlib.import_module(_BUILTIN[name])
        spec: PlaneSpec = module.PLANE
        return spec
    with _lock:
        return _registered[name]
