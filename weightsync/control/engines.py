"""The publisher's table of what its members' inference engines hold, per version and layout.

After a vLLM worker loaded a version it reports a digest of its engine-side parameters
(``EngineReport``); engines of one layout (the same model, parallel rank and dtype) that loaded
the same version must agree. The publisher only counts: each member speaks for itself (its own
entries, on its own authenticated connection, forgotten with it), a report names a version and a
layout of bounded length, and each member keeps at most ``KEEP_VERSIONS`` versions, one entry each
(a member that reports again, under any layout, replaces its own; its oldest go first). So the
table is bounded by the connected members however many versions or layouts they claim, and a
member that claims far-ahead versions evicts only its own entries (an earlier shared bound let an
insider push honest members' versions out: found by tests/test_insiders.py).

Who is wrong is decided by the reporting worker from the counts (:func:`disagrees`), not here:
the publisher cannot tell a bad engine from a bad report.
"""

from __future__ import annotations

import threading
from collections import Counter

KEEP_VERSIONS = 4
MAX_FIELD = 256  # characters of a layout or a digest


class EngineTable:
    """``report(member, version, layout, digest)`` -> counts per digest; any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, dict[int, tuple[str, str]]] = {}  # member -> version -> (layout, digest)

    def report(self, member: str, version: int, layout: str, digest: str) -> dict[str, int]:
        """Record ``member``'s digest for ``version`` (replacing its own earlier one, under any
        layout); the counts of every digest reported for ``version`` and ``layout``. ValueError for
        a field over ``MAX_FIELD``."""
        if len(layout) > MAX_FIELD or len(digest) > MAX_FIELD:
            raise ValueError(f"layout and digest are at most {MAX_FIELD} characters")
        with self._lock:
            mine = self._entries.setdefault(member, {})
            mine[version] = (layout, digest)
            while len(mine) > KEEP_VERSIONS:  # its own oldest go: nobody else's
                del mine[min(mine)]
            return dict(Counter(d for entries in self._entries.values() for v, (lay, d) in entries.items()
                                if v == version and lay == layout))

    def forget(self, member: str) -> None:
        """A member's connection is gone: its reports no longer count."""
        with self._lock:
            self._entries.pop(member, None)


def disagrees(counts: dict[str, int], mine: str) -> bool:
    """True when ``mine`` is not the digest most engines of its layout hold: another has more
    reports, or as many (then the one that reports later loads again: with two replicas there is
    no majority, and the earlier one was checked against nothing)."""
    own = counts.get(mine, 0)
    return any(n >= own for digest, n in counts.items() if digest != mine)
