"""An encoding that lives outside the library: it proves the encoding seam.

``xor-test`` sends every byte XORed with a key, so no wire byte equals a staged one (except
where the staged byte is the key's own complement pattern, which a digest over the wire would
still not prove): the member decodes each bucket into its slot before its digest, and the
digests are the staged bytes'. ``xor-test-broken`` decodes with the wrong key on one byte of
each bucket: a decoder bug that only the digest over the decoded bytes can catch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from weightsync.extend import Decoder, Encoder, EncodingSpec, WirePlan

KEY = 0x5A


class Counts:
    encoded = 0
    decoded = 0


class XorEncoder(Encoder):
    def plan(self, out: Any) -> WirePlan:
        wire = [torch.empty_like(b) for b in out.buckets]

        def encode(i: int) -> None:
            torch.bitwise_xor(out.buckets[i], KEY, out=wire[i])
            Counts.encoded += 1

        return WirePlan(wire, hook=encode)


class XorDecoder(Decoder):
    def __init__(self, broken: bool = False) -> None:
        self.broken = broken

    def plan(self, announce: Any, buckets: Sequence[torch.Tensor], base: Any = None) -> WirePlan:
        wire = [torch.empty_like(b) for b in buckets]

        def decode(i: int) -> None:
            torch.bitwise_xor(wire[i], KEY, out=buckets[i])
            if self.broken and buckets[i].numel():
                buckets[i][0] ^= 1  # a decoder bug: one bit of each bucket wrong
            Counts.decoded += 1

        return WirePlan(wire, hook=decode)


XOR = EncodingSpec("xor-test", XorEncoder(), XorDecoder())
BROKEN = EncodingSpec("xor-test-broken", XorEncoder(), XorDecoder(broken=True))
