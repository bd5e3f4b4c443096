"""What the control server's callbacks become, on its thread: Sender events, or the trainer ranks'.

A connection that passed the door is a member joining (the Sender decides the rest) or, on rank 0
of a sharded publisher, another trainer rank's link (:class:`~weightsync.transport.trainers.TrainerRanks`
owns those, and holds members' joins until every lane is known). A closed or silent connection
is a member that died, or a trainer rank lost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from weightsync.control.server import Link
from weightsync.engine.events import Join, Leave, MemberDied
from weightsync.engine.sender import Sender


class Door:
    """Routes the control server's events (``sender`` and ``trainers`` are set once built)."""

    def __init__(self, *, rec: Any, recorder: Any, running: Callable[[], bool]) -> None:
        self._rec, self._recorder, self._running = rec, recorder, running
        self.sender: Sender | None = None
        self.trainers: Any = None  # TrainerRanks on a sharded publisher

    def joined(self, link: Link) -> None:
        if link.transport == "rank":  # another trainer rank: admitted there, never a member
            assert self.trainers is not None
            self.trainers.on_rank_link(link)
        elif self.trainers is None or not self.trainers.hold(link):  # rank 0 holds joins until every lane is known
            self.admit(link)

    def admit(self, link: Link) -> None:
        assert self.sender is not None
        self.sender.submit(Join(link.member_id, link.incarnation, host=link.host, pid=link.pid,
                                transport=link.transport, want=link.want))

    def left(self, link: Link) -> None:
        if link.transport == "rank":
            assert self.trainers is not None
            self.trainers.rank_left(link.member_id)
        else:
            assert self.sender is not None
            self.sender.submit(Leave(link.member_id))

    def died(self, member_id: str, reason: str) -> None:
        """A member's connection closed, or it fell silent."""
        if self.trainers is not None and self.trainers.lost(member_id, reason):
            return  # a trainer rank: every wait for it ends now
        if self._running():  # members going while the channel closes are not trouble
            self._rec.record("heartbeat", peers=(member_id,)).fail(reason)
            self._recorder.dump_on_trouble(f"{member_id}: {reason}")
        assert self.sender is not None
        self.sender.submit(MemberDied((member_id,)))
