"""Refused connections in the flight recorder, counted instead of listed.

A flood of junk connections (about 1,900 in 3 s, in an audit) left nothing but refusals in a
2,000-entry recorder: every entry about real work was gone. So the control server records the
first refusal of each source and reason per :data:`WINDOW` seconds in full, counts the rest, and
records one entry with the count when the window closes (its housekeeping calls :meth:`count`).
At most :data:`MAX_KEYS` (source, reason) pairs are counted at once; beyond that they count as
``("other", "refused")``, so the table is bounded too. Only the control thread calls it.
"""

from __future__ import annotations

import time

from weightsync.recorder.recorder import RecorderScope

WINDOW = 10.0  # seconds over which refused connections of one source and reason are counted, not listed
MAX_KEYS = 256  # distinct (source, reason) pairs counted at once; the rest count as "other"


class Refusals:
    """The control server's count of refused connections (see the module docstring)."""

    def __init__(self, recorder: RecorderScope) -> None:
        self._rec = recorder
        self._counted: dict[tuple[str, str], list[float]] = {}  # (source, reason) -> [window start, count]

    def refuse(self, source: str, reason: str, *, who: str | None = None, detail: str = "") -> None:
        """A connection from ``source`` was refused for ``reason`` (``who``: the member id it gave)."""
        key = (source, reason[:80])
        if key not in self._counted and len(self._counted) >= MAX_KEYS:
            key = ("other", "refused")
        counted = self._counted.get(key)
        if counted is None:
            self._counted[key] = [time.monotonic(), 0]
            self._rec.record("admit", peers=(who or source,)).fail(f"{reason}{': ' + detail if detail else ''}"[:400])
        else:
            counted[1] += 1

    def count(self, now: float, *, everything: bool = False) -> None:
        """Record one entry per closed window that counted more (``everything``: every window, at close)."""
        for key, (began, n) in list(self._counted.items()):
            if everything or now - began >= WINDOW:
                del self._counted[key]
                if n:
                    self._rec.record("admit", peers=(key[0],)).fail(
                        f"{int(n)} more connections refused in {now - began:.0f}s ({key[1]})")
