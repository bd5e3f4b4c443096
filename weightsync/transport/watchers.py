"""The publisher's two watcher threads; each turns what it sees into events for the Sender.

- :class:`Inbox` pops the channel's inbox: a ``Join`` is checked at the door (token, environment
  fingerprint, closing) and, if admissible, handed to the Sender (which alone decides about
  duplicate ids and membership); a ``Leave`` is handed over as it is. A refused join is answered
  with ``Deny`` here, and only ever into the channel's own queues.
- :class:`Monitor` beats the publisher's heartbeat and samples every member's; a member whose
  beats stopped becomes a ``MemberDied`` event.

After each event both push a ``Wake`` into the replies queue, so a Sender waiting there for
Ready or Ack applies it at once. Neither thread ever blocks the Sender or the event loop.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from weightsync import _wire
from weightsync._errors import ControlFailure, StoreUnreachable
from weightsync.pg import handshake
from weightsync.pg.control import ControlPlane
from weightsync.pg.membership import Membership
from weightsync.pg.recorder import FlightRecorder
from weightsync.transport import sender as events

PUBLISHER = "publisher"


class Inbox:
    """Owns the inbox thread (see the module docstring)."""

    def __init__(self, channel: str, *, sender: events.Sender, secret: bytes | None, mine: _wire.Fingerprint,
                 recorder: FlightRecorder, stop: threading.Event, closing: Callable[[], bool]) -> None:
        self.channel = channel
        self._sender, self._secret, self._mine = sender, secret, mine
        self._recorder, self._stop, self._closing = recorder, stop, closing
        self._rec = recorder.scope(channel, PUBLISHER)

    def main(self, ctl: ControlPlane) -> None:
        while not self._stop.is_set():
            try:
                raw = ctl.pop(ctl.inbox, 3600.0)
                self._handle(ctl, raw)
            except StoreUnreachable:
                return
            except ControlFailure:
                continue

    def _handle(self, ctl: ControlPlane, raw: bytes) -> None:
        try:
            message = _wire.inbox_decoder.decode(raw)
        except Exception as err:  # noqa: BLE001 - malformed input must never stop the publisher
            self._rec.record("inbox").fail(f"malformed message: {err}")
            return
        if isinstance(message, _wire.Wake):
            return
        if isinstance(message, _wire.Leave):
            self._sender.submit(events.Leave(message.member_id))
            ctl.push(ctl.replies, _wire.Wake(reason="leave"))
            return
        deny = handshake.admission_problem(
            message, channel=self.channel, queue_prefix=ctl.prefix + "q/member/", secret=self._secret,
            mine=self._mine, closing=self._closing() or self._stop.is_set(), taken=message.member_id == PUBLISHER)
        if deny is not None:
            if message.reply_to.startswith(ctl.prefix + "q/member/"):  # never write outside the channel
                ctl.push(message.reply_to, deny)
            self._rec.record("admit",
                             peers=(message.member_id,)).fail(deny.reason)
            return
        self._sender.submit(events.Join(message.member_id, message.reply_to, host=message.host, pid=message.pid))
        ctl.push(ctl.replies, _wire.Wake(reason="join"))


class Monitor:
    """Owns the monitor thread: our heartbeat, theirs sampled (see the module docstring)."""

    def __init__(self, channel: str, *, sender: events.Sender, membership: Membership, interval: float,
                 recorder: FlightRecorder, stop: threading.Event) -> None:
        self.channel = channel
        self._sender, self._membership, self._interval = sender, membership, interval
        self._recorder, self._stop = recorder, stop
        self._rec = recorder.scope(channel, PUBLISHER)

    def main(self, ctl: ControlPlane) -> None:
        while not self._stop.wait(self._interval / 2):
            try:
                ctl.add(ctl.heartbeat_key(PUBLISHER), 1)  # subscribers watch this
                newly_dead = self._membership.sample_heartbeats(ctl)
                if newly_dead:
                    self._report(ctl, newly_dead)
            except ControlFailure:
                continue

    def _report(self, ctl: ControlPlane, dead: set[str]) -> None:
        self._rec.record("heartbeat",
                         peers=tuple(sorted(dead))).fail("heartbeats stopped")
        self._recorder.dump_on_trouble(f"heartbeats stopped: {sorted(dead)}")
        self._sender.submit(events.MemberDied(tuple(sorted(dead))))
        ctl.push(ctl.replies, _wire.Wake(reason="member died"))
