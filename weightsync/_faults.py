"""Fault injection for tests and drills: ``WEIGHTSYNC_FAULTS``, read when a Subscriber starts.

Comma-separated; unset means none, and nothing here runs:

- ``slow=F``: after each bucket, this subscriber sleeps (F - 1) times as long as the bucket
  took (at least 20 ms each), as a member on a busy host would;
- ``corrupt=V``: flip one byte of bucket 0 the first time version V arrives, as a bad link
  would (the checksum must catch it; the re-send must then deliver V intact).
"""

from __future__ import annotations

import os
import time

import torch


class Faults:
    def __init__(self, spec: str) -> None:
        self.slow = 1.0
        self.corrupt: set[int] = set()
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, _, value = part.partition("=")
            if key == "slow":
                self.slow = float(value)
            elif key == "corrupt":
                self.corrupt.add(int(value))
            else:
                raise ValueError(f"WEIGHTSYNC_FAULTS: unknown fault {part!r} (known: slow=F, corrupt=V)")

    def after_bucket(self, version: int, index: int, bucket: torch.Tensor, seconds: float) -> None:
        if index == 0 and version in self.corrupt and bucket.numel():
            self.corrupt.discard(version)
            bucket[0] ^= 0xFF
        if self.slow > 1:
            time.sleep((self.slow - 1) * max(seconds, 0.02))


def from_env() -> Faults | None:
    spec = os.environ.get("WEIGHTSYNC_FAULTS", "")
    return Faults(spec) if spec else None
