"""A member's way in: reaching the publisher's door, and what its answer to the Join means.

- :func:`connect`: open the control connection. A publisher not listening yet (this subscriber
  was started first, as launchers do) is tried again with backoff until the join deadline; one
  that answered once and is gone now is PublisherGone at once;
- :func:`admitted`: the publisher's reply to the Join as an Admit, or the error it means (a
  denial, a handshake mismatch, a publisher closing);
- :func:`enter`: into each generation the publisher plans: Ready with the plane's offer, then its
  Go (the rendezvous) or the plan that replaced it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from weightsync import _wire
from weightsync._errors import ControlFailure, NotListening, PeerFailure, ProtocolError, PublisherBusy
from weightsync.errors import (
    AdmissionDenied,
    Closed,
    HandshakeMismatch,
    ManifestMismatch,
    PublisherGone,
    SyncTimeout,
    TransportUnavailable,
    WeightSyncError,
)
from weightsync.planes.dataplane import GenerationSpec

CONNECT_BACKOFF = (0.05, 1.0)  # first and longest pause between tries to reach a publisher not up yet

log = logging.getLogger("weightsync.subscriber")


def connect(client: Any, deadline: float, entry: Any, *, wait: bool, closing: threading.Event, where: str,
            within: float, channel: str, member: str) -> None:
    """Open ``client``'s connection by ``deadline`` (``wait``: a publisher not listening may still be
    starting). SyncTimeout when it never answered (nothing is worth a dump then), PublisherGone when
    it cannot be reached, Closed when ``closing`` was set meanwhile."""
    pause, tries, last, busy = CONNECT_BACKOFF[0], 0, "", False
    while True:
        tries += 1
        try:
            client.connect(max(deadline - time.monotonic(), 0.01))
            return
        except PublisherBusy as err:  # a flood at the door: a place frees up soon, whoever we are
            last, busy = str(err), True
        except NotListening as err:
            last, busy = str(err), False
            if not wait:
                entry.fail(err)
                raise PublisherGone(f"cannot reach the publisher: {err}", channel=channel, member=member) from err
        except ControlFailure as err:
            entry.fail(err)
            raise PublisherGone(f"cannot reach the publisher: {err}", channel=channel, member=member) from err
        if tries == 1:
            log.info("%s: no publisher at %s yet; trying again until it answers (%.3gs)", member, where,
                     max(deadline - time.monotonic(), 0.0))
        left = deadline - time.monotonic()
        if left <= 0:
            entry.fail(f"never answered: {last}")
            what = "was too busy to admit us" if busy else "never answered"
            raise SyncTimeout(f"the publisher {what} at {where} within {within:.3g}s ({tries} tries; last: {last})",
                              channel=channel, member=member)
        if closing.wait(min(pause, left)):  # closed meanwhile: the caller stops waiting
            entry.fail("closed while waiting for the publisher")
            raise Closed("closed while waiting for the publisher", channel=channel, member=member)
        pause = min(pause * 2, CONNECT_BACKOFF[1])


def admitted(reply: Any, entry: Any, channel: str, member: str) -> _wire.Admit:
    """``reply`` to the Join (None: closed while joining) as an Admit, or raised as what it means."""
    if reply is None:
        entry.fail("closed while joining")
        raise Closed("closed while joining", channel=channel, member=member)
    if isinstance(reply, _wire.Deny):
        entry.fail(reply.reason)
        kinds: dict[str, type[WeightSyncError]] = {"handshake": HandshakeMismatch, "closed": PublisherGone,
                                                   "want": ManifestMismatch, "transport": TransportUnavailable}
        raise kinds.get(reply.kind, AdmissionDenied)(f"join refused: {reply.reason}", channel=channel, member=member)
    if not isinstance(reply, _wire.Admit):
        entry.fail(f"unexpected {type(reply).__name__}")
        raise WeightSyncError(f"unexpected reply to join: {type(reply).__name__}", channel=channel)
    return reply


def enter(plane: Any, client: Any, generation: int, member: str, *, timeout: float, next_message: Any,
          scope: Any, recorder: Any) -> tuple[bool, Any, int | None]:
    """Enter ``generation`` on ``plane``: (entered, the message that replaced the plan or None, this
    member's rank in the group or None).

    The publisher says Go once every member is ready; until then it may abandon the generation
    with a Reconfigure (someone left or died), which is returned instead. A rendezvous that fails
    (a peer died while the group formed) is not this member's end: it stays, not entered, answers
    this generation's announcements with a failure at once, and waits for the publisher's next
    plan. ``next_message()`` waits as long as the publisher lives (the heartbeat thread wakes it
    if it goes), not by a guess at how long the other members take to get ready: having said
    Ready, a closing subscriber still goes through with the rendezvous (the publisher may already
    be in it); only abort() walks away.
    """

    def failed(err: PeerFailure) -> None:
        scope.record("rendezvous", generation=generation).fail(err)
        recorder.dump_on_trouble(f"generation {generation}: {err}")
        plane.leave(f"rendezvous failed: {err}", failed=True)

    try:
        offer = plane.offer()
    except PeerFailure as err:
        failed(err)
        offer = ""
    client.send(_wire.Ready(generation=generation, member_id=member, handle=offer))
    while True:
        message = next_message()
        if message is None or not isinstance(message, _wire.Go):
            return False, message, None
        if message.generation != generation:
            continue
        if not plane.in_group:
            return True, None, None  # nothing to enter (shared memory: versions are read from the segment)
        if member not in message.group:
            raise ProtocolError(f"generation {generation}'s group leaves out this member")
        rank = message.group.index(member) + 1
        try:
            plane.enter(GenerationSpec(generation, message.group, rank=rank, timeout=timeout, uuid=message.uuid,
                                       offers=message.handles, rendezvous=message.rendezvous))
        except PeerFailure as err:
            failed(err)
            return False, None, rank
        return True, None, rank
