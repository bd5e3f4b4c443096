"""What reaches the publisher's sender thread, on its one queue (:meth:`Sender.submit`):

    PutCommitted   a snapshot is pending in staging            (Publisher.put, event loop)
    Join / Leave   a member passed the door / asked to leave    (control thread)
    Evict          the operator or the policy drops a member    (Publisher.evict, scoring)
    MemberDied     a member's connection closed, or it went silent (control thread)
    Drain          send what is pending, then stop              (Publisher.aclose)
    Abort          stop now (also sets ``aborting``, seen mid-transfer)  (Publisher.abort)
"""

from __future__ import annotations

from dataclasses import dataclass

from weightsync import _wire


@dataclass(frozen=True)
class PutCommitted:
    version: int


@dataclass(frozen=True)
class Join:
    member_id: str
    incarnation: str  # the member's control connection
    host: str = ""
    pid: int = 0
    transport: str = "group"
    want: tuple[_wire.Want, ...] | None = None  # a sliced member: only these boxes, point to point


@dataclass(frozen=True)
class Leave:
    member_id: str


@dataclass(frozen=True)
class Evict:
    member_id: str
    reason: str


@dataclass(frozen=True)
class MemberDied:
    members: tuple[str, ...]


@dataclass(frozen=True)
class Drain:
    pass


@dataclass(frozen=True)
class Abort:
    pass


Event = PutCommitted | Join | Leave | Evict | MemberDied | Drain | Abort
