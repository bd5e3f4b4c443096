"""In-memory stand-ins for unit tests without processes: the control server and a data plane.

``FakeControl`` is the publisher's control server as Generations and the Sender use it: a
replies queue members put Ready and Ack into, and one outbox per member connection.
``FakePlane`` records what the Sender/Generations asked of the data plane.
"""

from __future__ import annotations

import queue
from collections import defaultdict
from typing import Any

from weightsync.planes.dataplane import GenerationSpec, Transfer


class FakeControl:
    """The publisher's control server as Generations sees it: replies in, messages out per member."""

    def __init__(self) -> None:
        self.replies: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.outbox: dict[str, queue.SimpleQueue[Any]] = defaultdict(queue.SimpleQueue)
        self.bound: set[str] = set()
        self.released: list[tuple[str, str]] = []
        self.scopes: dict[str, Any] = {}  # member -> the rendezvous keys it may touch (its last grant)
        self.probes: list[int] = []  # the sizes of the probe rounds asked for
        self.links: dict[str, tuple[float, float, int, int]] = {}  # member -> what link_seconds answers

    def send(self, incarnation: str, message: Any) -> bool:
        self.outbox[incarnation].put(message)
        return True

    def bind(self, incarnation: str) -> bool:
        self.bound.add(incarnation)
        return True

    def release(self, member_id: str, reason: str) -> None:
        self.released.append((member_id, reason))

    def probe(self, nbytes: int) -> None:
        """No links here to time: the round is only noted."""
        self.probes.append(nbytes)

    def settle_probes(self, timeout: float) -> bool:
        return True

    def begin_transfer(self) -> None:
        """No probes to void."""

    def link_seconds(self, member_id: str) -> tuple[float, float, int, int] | None:
        return self.links.get(member_id)

    def grant(self, member_id: str, scope: Any) -> None:
        self.scopes[member_id] = scope

    def wait_copied(self, members: tuple[str, ...], generation: int, seq: int, bucket: int, timeout: float,
                    cancelled: Any) -> set[str]:
        return set()  # no same-host members here


class FakeTable:
    def __init__(self) -> None:
        self.generations: list[int] = []

    def begin_generation(self, generation: int) -> None:
        self.generations.append(generation)


class FakePlane:
    """A data plane that moves nothing and remembers every call."""

    in_group, moves_alone = True, False

    def __init__(self, *, fail_enter: BaseException | None = None) -> None:
        self.calls: list[tuple[str, object]] = []
        self.fail_enter = fail_enter
        self.entered: list[GenerationSpec] = []

    def offer(self) -> str:
        self.calls.append(("offer", None))
        return "publisher-handle"

    def rendezvous_prefixes(self, spec: GenerationSpec) -> tuple[str, ...]:
        return (f"fake/{spec.generation}/",)

    def broadcast_parent(self, rank: int) -> int | None:
        return rank - (1 << (rank.bit_length() - 1)) if rank > 0 else None  # gloo's binomial tree

    def enter(self, spec: GenerationSpec) -> None:
        self.calls.append(("enter", spec.generation))
        if self.fail_enter is not None:
            raise self.fail_enter
        self.entered.append(spec)

    def move(self, transfer: Transfer) -> None:
        self.calls.append(("move", transfer.version))
        for i in range(len(transfer.buckets)):
            if transfer.before is not None:
                transfer.before(i)
            if transfer.after is not None:
                transfer.after(i)

    def send_each(self, transfer: Transfer, sends: Any) -> None:
        """Rank 0 of a point-to-point version: like ``move``, and asks for each bucket's sends."""
        self.calls.append(("send_each", transfer.version))
        for i in range(len(transfer.buckets)):
            if transfer.before is not None:
                transfer.before(i)
            sends(i)
            if transfer.after is not None:
                transfer.after(i)

    def leave(self, reason: str, *, failed: bool = False) -> None:
        self.calls.append(("leave", failed))

    def close(self) -> None:
        self.calls.append(("close", None))


class GrouplessPlane:
    """What a member plane that joins no group answers to everything but ``move`` (subclasses move)."""

    in_group = False

    def offer(self) -> str:
        return ""

    def rendezvous_prefixes(self, spec: GenerationSpec) -> tuple[str, ...]:
        return ()

    def broadcast_parent(self, rank: int) -> int | None:
        return None

    def enter(self, spec: GenerationSpec) -> None:
        return None

    def view_of(self, announce: Any) -> None:
        return None

    def leave(self, reason: str, *, failed: bool = False) -> None:
        return None

    def close(self) -> None:
        return None
