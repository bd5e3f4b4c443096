"""A member's waits on its own connection's seal queue, during one version's receive.

- :func:`told_sizes`: an encoder that sizes its wire buckets as it makes them tells each one's
  length (``WireSizes``) just before that bucket moves; the decoder asks for it bucket by bucket;
- :func:`verify`: the publisher's ``Seal`` (the staged buckets' digests) against the member's own.

Words of older versions (given up on) are skipped; a closed connection ends either wait at once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from weightsync import _wire
from weightsync._errors import Cancelled, ChecksumMismatch, PeerFailure, ProtocolError, StoreUnreachable

SIZE_SLICE = 0.25  # seconds between looks for an Abandon while waiting for a wire bucket's length

log = logging.getLogger("weightsync.subscriber")


def told_sizes(client: Any, announce: _wire.Announce, ranges: list[tuple[int, int]],
               bound: Callable[[int], float], aborting: threading.Event) -> Callable[[int], int] | None:
    """For an Announce with ``wire_later``: ``size(i)`` waits (``bound`` of the bucket's staged bytes)
    for wire bucket i's length, told in a WireSizes on ``client``'s connection before that bucket
    moves (the publisher encodes a bucket while the ones before it are on the wire); None otherwise."""
    if not announce.coding.later:
        return None
    told: dict[int, int] = {}
    key = (announce.generation, announce.seq)

    def size(i: int) -> int:
        lo, hi = ranges[i] if i < len(ranges) else (0, 0)
        deadline = time.monotonic() + bound(hi - lo)
        while i not in told:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerFailure(f"version {announce.version}: wire bucket {i}'s length did not come "
                                  f"within {bound(hi - lo):.1f}s")
            if aborting.is_set() or not client.commands.empty():
                raise Cancelled(f"version {announce.version} was given up on")
            try:
                word = client.seals.get(timeout=min(left, SIZE_SLICE))
            except queue.Empty:
                continue
            if isinstance(word, _wire.Wake):
                raise StoreUnreachable(client.close_reason)
            if isinstance(word, _wire.WireSizes) and (word.generation, word.seq) == key:
                told.update(zip(range(word.first, word.first + len(word.sizes)), word.sizes, strict=True))
            elif isinstance(word, _wire.Seal) and (word.generation, word.seq) == key:
                raise ProtocolError(f"version {announce.version}'s Seal came before wire bucket {i}'s length")
            # older versions' words (given up on) are skipped, as verify skips their Seals
        return told[i]

    return size


def verify(client: Any, announce: _wire.Announce, sums: list[int], within: float, scope: Any, member: str) -> None:
    """Compare our buckets' digests with the publisher's Seal (waited for ``within`` seconds);
    raises ChecksumMismatch."""
    deadline = time.monotonic() + within
    while True:
        try:
            seal = client.seals.get(timeout=max(deadline - time.monotonic(), 0.0))
        except queue.Empty:
            raise PeerFailure(f"no checksums for version {announce.version} within {within}s") from None
        if isinstance(seal, _wire.Wake):
            raise StoreUnreachable(client.close_reason)
        if isinstance(seal, _wire.Seal) and (seal.generation, seal.seq) == (announce.generation, announce.seq):
            break  # older seals belong to versions given up on: skipped
    if seal.abandoned:
        raise ProtocolError(f"the publisher gave up on version {announce.version}")
    bad = [i for i, (mine, theirs) in enumerate(zip(sums, seal.checksums, strict=False)) if mine != theirs]
    if bad or len(sums) != len(seal.checksums):
        scope.record("checksum", generation=announce.generation, version=announce.version,
                     bucket=bad[0] if bad else -1).fail(f"buckets {bad} do not match")
        log.warning("%s: version %d: buckets %s arrived corrupted; not made readable (the publisher re-sends)",
                    member, announce.version, bad[:8])
        raise ChecksumMismatch(f"version {announce.version}: buckets {bad} arrived corrupted; not made readable")
