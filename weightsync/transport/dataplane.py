"""The data-plane interface: the one seam the Sender and Receiver drive to move bytes.

A *data plane* moves the buckets of one version from the publisher's end to the members of a
generation. The Sender and the Receiver know nothing else about it: not the backend, not how
a generation is formed, not whether bytes cross a socket. Lifecycle, every call made by the
owning thread (the publisher's sender thread, or a subscriber's receiver thread), in order:

1. ``offer()``: what this end contributes to the next generation's rendezvous, sent to the
   publisher in ``Ready`` (a reconfigure handle, a segment name; ``""`` when nothing);
2. ``enter(spec)``: form generation ``spec.generation`` with ``spec.members``, bounded by
   ``spec.timeout``; the publisher's ``Go`` carries what every member offered;
3. ``move(transfer)``: rank 0 sends ``transfer.buckets``, everyone else receives into them
   (``transfer.direct``: point to point, rank 0 sending each member its own ``sends(i)``),
   each bucket bounded by ``transfer.deadline(nbytes)`` (the receiver times its own work in
   ``transfer.after``: straggler scoring counts that, not the wait on peers);
4. ``leave(reason, failed=...)``: end the generation (a hung operation must return); with
   ``failed`` the next ``enter`` starts from fresh resources;
5. ``close()``: for good. ``leave`` and ``close`` are idempotent and never raise.

Failures are :mod:`weightsync._errors`: ``PeerFailure`` when a peer broke the step,
``Cancelled`` when ``transfer.cancelled()`` said to stop, ``LocalFailure`` when this end's own
``before``/``after`` hook failed (packing a ``copy=False`` tensor, say). Nothing else escapes.

How the planned planes plug in (docs/architecture.md has the picture):

- the dedicated group (:class:`weightsync.pg.group.GroupPlane`): gloo/NCCL broadcast of each
  bucket from rank 0; ``offer`` is the reconfigure handle on torch 2.14+;
- same host (:class:`weightsync.transport.shm.ShmPlane`, built): the publisher's snapshot lives
  in shared memory; a same-host member's ``move`` copies each bucket out of the segment its
  Announce names (``transfer.source``) and joins no group; the publisher's group plane serves
  the other members of the same generation;
- sharded trainers: one plane per trainer rank ("lanes"), each its own group with one
  communicator; a version is readable when every lane's ``move`` has returned and verified;
- one-sided (``torch.distributed._transport``, torch 2.15): ``offer`` publishes a memory
  registration, ``move`` on a member is a read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch


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
    cancelled: Callable[[], bool] | None = None  # polled while waiting: True gives up (Cancelled)
    source: Any = None  # where a plane that reads (not receives) finds the bytes: an Announce's segment
    direct: bool = False  # point to point instead of a broadcast (a generation with sliced members)
    # rank 0 of a direct transfer: bucket i's (member rank, bytes for it) pairs, gathered after ``before(i)``
    sends: Callable[[int], Sequence[tuple[int, torch.Tensor]]] | None = None


class DataPlane(Protocol):
    """See the module docstring for who calls what, and when. A plane has no kind attribute: nothing
    may branch on which plane it drives, only on what it says of itself."""

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

    def leave(self, reason: str, *, failed: bool = False) -> None: ...

    def close(self) -> None: ...
