"""A data plane that lives outside the library: it proves the send side's seam.

``mailbox`` moves each bucket through an in-process mailbox (publisher and members in one
process): the publisher's part rides along (``drives`` False) and drops a copy of bucket i in
the mailbox once bucket i is ready (an after-bucket hook); a member's ``move`` takes bucket i
out of it, bounded by the bucket's deadline and given up when the transfer is cancelled. It
joins no group. Registered with :func:`weightsync.extend.register_plane`, it is
served by the library's Sender and Receiver as they are: announcements, seals, checksums,
acknowledgements, re-sends and scoring are theirs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tests.fakes import GrouplessPlane
from weightsync.extend import (
    Cancelled,
    LocalFailure,
    MemberContext,
    Outgoing,
    PeerFailure,
    PlaneSpec,
    Prepared,
    PublisherContext,
    SendPart,
    Transfer,
)

NAME = "mailbox"
WAIT_SLICE = 0.05


class Mailbox:
    """Buckets by (channel, generation, seq, bucket), and how many each end moved."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.buckets: dict[tuple[str, int, int, int], torch.Tensor] = {}
        self.posted = 0
        self.taken = 0


BOX = Mailbox()


class MailboxSend(SendPart):
    name = NAME
    in_group, moves_alone, drives = False, True, False
    plane = None

    def __init__(self, context: PublisherContext) -> None:
        self.channel = context.channel
        self.members: set[str] = set()

    def admit(self, member: str, want: Any) -> None:
        self.members.add(member)

    def forget(self, member: str) -> None:
        self.members.discard(member)

    def prepare(self, out: Outgoing, members: tuple[str, ...]) -> Prepared:
        def post(i: int) -> None:
            with BOX.cond:
                BOX.buckets[(self.channel, out.generation, out.seq, i)] = out.buckets[i].clone()
                BOX.posted += 1
                BOX.cond.notify_all()

        out.afters.append(post)
        return Prepared()  # nothing more in the Announce: a member finds the buckets by generation and seq

    def move(self, out: Outgoing, members: tuple[str, ...]) -> None:
        """Nothing: ``post`` ran as each bucket became ready."""

    def digests(self) -> Mapping[str, Sequence[int]]:
        return {}

    def close(self) -> None:
        with BOX.cond:
            for key in [k for k in BOX.buckets if k[0] == self.channel]:
                del BOX.buckets[key]


class MailboxPlane(GrouplessPlane):
    moves_alone = True

    def __init__(self, context: MemberContext) -> None:
        self.channel = context.channel

    def move(self, transfer: Transfer) -> None:
        announce = transfer.announce
        for i, bucket in enumerate(transfer.buckets):
            key = (self.channel, announce.generation, announce.seq, i)
            deadline = time.monotonic() + transfer.deadline(bucket.numel())
            with BOX.cond:
                while key not in BOX.buckets:
                    if transfer.cancelled is not None and transfer.cancelled():
                        raise Cancelled("the publisher gave up on this version")
                    if time.monotonic() > deadline:
                        raise PeerFailure(f"bucket {i} of version {transfer.version} never came")
                    BOX.cond.wait(WAIT_SLICE)
                bucket.copy_(BOX.buckets[key])  # left in the box: every member of the version reads it
                BOX.taken += 1
            if transfer.after is not None:
                try:
                    transfer.after(i)
                except Exception as err:  # noqa: BLE001 - this end's own failure, as the DataPlane says
                    raise LocalFailure(f"after bucket {i}: {err}") from err


SPEC = PlaneSpec(NAME, send_part=MailboxSend, member_plane=MailboxPlane)
