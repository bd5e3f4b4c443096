"""A member's heartbeat thread: it beats to the publisher and watches the control connection.

A closed connection ends the member with PublisherGone at once; a silent one (a frozen
publisher) once it has been silent for ``Deadlines.publisher_silence`` while this process itself
kept running. A member the publisher dropped (frozen past its eviction, then woken) finds the
notice and the close together: the reader reads what came before the close first, and the end
is Evicted (``rejoin()`` works), not PublisherGone. It makes no call that can block on the
publisher beyond the send deadline.
"""

from __future__ import annotations

import time
from typing import Any

from weightsync import _wire
from weightsync._errors import ControlFailure
from weightsync.control.client import READ_SLICE
from weightsync.errors import Evicted, PublisherGone, WeightSyncError

PRE_ADMISSION_BEAT = 0.25  # seconds between beats until the publisher's interval is known


def dropped(client: Any, channel: str, member: str) -> Evicted:
    """The end of a member whose connection closed after the publisher's word that it dropped it."""
    return Evicted(f"evicted from the channel ({client.dropped}); the publisher closed the connection",
                   channel=channel, member=member)


class Heartbeat:
    """The heartbeat thread of one member (see the module docstring).

    Args:
        receiver: the member's Receiver: its client, deadlines (None until admitted), ``closing``,
            ``over``, ``end`` and ``wake``.
        scope: its recorder scope.
    """

    def __init__(self, receiver: Any, scope: Any) -> None:
        self._r, self._rec = receiver, scope

    def main(self) -> None:
        r = self._r
        try:
            self._beat()
        except Exception as err:  # noqa: BLE001 - a failed heartbeat thread must never be silent
            failure = WeightSyncError(f"heartbeat stopped: {type(err).__name__}: {err}", channel=r.channel,
                                      member=r.member_id)
            self._rec.record("heartbeat").fail(failure)
            r.end(failure)
            r.wake("heartbeat failed")

    def _beat(self) -> None:
        r = self._r
        while not r.closing.is_set() and not r.over:
            # a member whose receiver stopped (evicted, failed) stops beating, so the
            # publisher drops it in a few beats instead of waiting for it
            deadlines = r.deadlines
            if deadlines is None:  # not admitted yet: the receiver's join wait is bounded itself
                r.closing.wait(PRE_ADMISSION_BEAT)
                continue
            interval = deadlines.settings.heartbeat_interval
            client = r.client
            if client.closed.is_set():
                self.publisher_gone(f"control connection closed: {client.close_reason}")
                return
            try:
                client.send(_wire.Beat())
            except ControlFailure as err:
                self.publisher_gone(f"cannot reach the publisher: {err}")
                return
            now = time.monotonic()
            silent = now - client.last_heard
            reader_running = now - client.tick < 2 * READ_SLICE + interval  # else this process stalled
            if silent > deadlines.publisher_silence(r.own_timeout) and reader_running:
                self.publisher_gone(f"publisher silent for {silent:.1f}s")
                return
            r.closing.wait(interval)
        r.wake("closing")

    def publisher_gone(self, reason: str) -> None:
        """The connection closed, broke or fell silent: the member ends (Evicted if it was dropped)."""
        r = self._r
        client: Any = r.client
        if not reason.startswith("publisher silent"):  # a close or a failed send: the reader ends soon
            client.drained(4 * READ_SLICE)
        if client.dropped:
            self._rec.record("evict").complete()
            r.end(dropped(client, r.channel, r.member_id))
        else:
            r.end(PublisherGone(reason, channel=r.channel, member=r.member_id))
        r.wake(reason)

