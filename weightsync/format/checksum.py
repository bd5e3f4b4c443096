"""Per-bucket digests: what a subscriber checks before a version becomes readable.

Two digests, named on the wire (each Announce says which one its Seal holds, ``KINDS``):

- ``"crc32c"``: CRC32C (the ``crc32c`` package: the SSE4.2 / ARMv8 CRC instructions, with a
  software fallback on CPUs without them), 32 bits;
- ``"xxh3"``: xxHash's XXH3-64 (the ``xxhash`` package, vectorised with SSE2/AVX2/NEON), 64 bits.

Neither is faster everywhere (``python -m benchmarks.checksums``, 64 MiB, one thread): on the
2-core Intel Xeon the first digests were measured on, CRC32C 20.5 GB/s and XXH3 14.6; on the
2-core AMD EPYC of later sessions, CRC32C 5.9-15 and XXH3 13-35.5 (2.0-2.4x). So a publisher
measures both once per process (:func:`choose`, a few milliseconds over a buffer in cache) and
names its choice in every Announce; the members compute what it names. ``WEIGHTSYNC_DIGEST``
(or ``Publisher(digest=)``) pins one.

Both read the bucket in place through a ``ctypes`` view of the tensor's memory (no copy, no
numpy) and release the GIL for large inputs, so the control threads keep running while a bucket
is checked.

CUDA buckets reduce on the device (stripe sums) and bring only the sums over, digested with the
named function: a device-to-host copy of every bucket would cost more than the transfer it guards.
Both ends of a channel hold their buckets on the same kind of device, so both compute the same.

Rejected: CRC32 (zlib), XXH64 and the protocol-1 striped sums (2-5x slower than the better of
the two); a torch reduction on the host, whose OpenMP workers spin after the reduction and
starve gloo's threads on a 2-core machine.
"""

from __future__ import annotations

import ctypes
import functools
import os
import time
from collections.abc import Callable

import crc32c
import torch
import xxhash

STRIPES = 16  # a CUDA bucket is read as this many equal stripes of 8-byte words
DEFAULT = "crc32c"  # what an Announce without a name means (protocol 2 to 10)
ENV = "WEIGHTSYNC_DIGEST"
_PROBE_BYTES = 4 << 20


def _crc32c(view: ctypes.Array[ctypes.c_char], seed: int = 0) -> int:
    return int(crc32c.crc32c(view, seed))


def _xxh3(view: ctypes.Array[ctypes.c_char], seed: int = 0) -> int:
    return int(xxhash.xxh3_64_intdigest(view, seed))


#: name on the wire -> fn(bytes-like, seed) -> int
KINDS: dict[str, Callable[..., int]] = {"crc32c": _crc32c, "xxh3": _xxh3}


def _host_view(buf: torch.Tensor) -> ctypes.Array[ctypes.c_char]:
    """The bytes of a contiguous host uint8 tensor, in place (valid while ``buf`` lives)."""
    return (ctypes.c_char * buf.numel()).from_address(buf.data_ptr())


def checksum(buf: torch.Tensor, kind: str = DEFAULT) -> int:
    """The digest ``kind`` (a name in ``KINDS``) of a flat, contiguous uint8 bucket."""
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError(f"checksum takes a flat contiguous uint8 bucket, got {buf.dtype} {tuple(buf.shape)}")
    fn = KINDS.get(kind)
    if fn is None:
        raise ValueError(f"unknown digest {kind[:32]!r}; known: {sorted(KINDS)}")
    if not buf.is_cuda:
        return fn(_host_view(buf))
    grid = STRIPES * 8
    n = buf.numel() // grid * grid
    head = buf[:n] if buf.data_ptr() % 8 == 0 else buf[:n].clone()
    words = head.view(torch.int64).view(STRIPES, -1)
    sums = torch.cat([words.sum(1), words.sum(0)]).cpu()
    tail = buf[n:].cpu()
    # the tail's digest is seeded with the sums' (both functions take a 64-bit seed)
    return fn(_host_view(tail), fn(_host_view(sums.view(torch.uint8))))


class Running:
    """The digest ``kind`` of a host bucket taken piece by piece, in order: :meth:`value` is what
    :func:`checksum` gives for the pieces joined. A receiver digests each piece while it is in
    the CPU's cache, just before it copies the same bytes on (``get_into(as_received=True)``)."""

    def __init__(self, kind: str) -> None:
        # CRC32C continues from the value so far (its seed); XXH3's seed is not a continuation,
        # so it keeps xxhash's streaming state. A kind added to KINDS needs its way here too.
        if kind not in ("crc32c", "xxh3"):
            raise ValueError(f"unknown digest {kind[:32]!r}; known: {sorted(KINDS)}")
        self.kind = kind
        self._crc = 0
        self._xxh = xxhash.xxh3_64() if kind == "xxh3" else None

    def update(self, piece: torch.Tensor) -> None:
        """Add the next bytes (a flat, contiguous uint8 host tensor); both release the GIL."""
        if piece.dtype != torch.uint8 or piece.dim() != 1 or not piece.is_contiguous() or piece.is_cuda:
            raise ValueError(f"a running digest takes flat contiguous uint8 host bytes, got {piece.dtype} "
                             f"{tuple(piece.shape)} on {piece.device}")
        if not piece.numel():
            return
        if self._xxh is not None:
            self._xxh.update(_host_view(piece))
        else:
            self._crc = _crc32c(_host_view(piece), self._crc)

    def value(self) -> int:
        return int(self._xxh.intdigest()) if self._xxh is not None else self._crc


def resolve(kind: str) -> str:
    """A publisher's digest setting as a name in ``KINDS``: ``"auto"`` is :func:`choose`'s."""
    if kind == "auto":
        return choose()
    if kind not in KINDS:
        raise ValueError(f"digest must be 'auto' or one of {sorted(KINDS)}, got {kind!r}")
    return kind


def rates(nbytes: int = _PROBE_BYTES, reps: int = 3) -> dict[str, float]:
    """Each digest's bytes per second over one buffer of ``nbytes`` (best of ``reps``)."""
    buf = bytearray(os.urandom(1 << 12)) * (nbytes >> 12)
    view = (ctypes.c_char * len(buf)).from_buffer(buf)
    out = {}
    for name, fn in KINDS.items():
        fn(view)
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn(view)
            best = min(best, time.perf_counter() - t0)
        out[name] = len(buf) / max(best, 1e-9)
    return out


@functools.lru_cache(maxsize=1)
def choose() -> str:
    """The faster digest on this CPU, measured once per process (``WEIGHTSYNC_DIGEST`` pins one)."""
    pinned = os.environ.get(ENV, "")
    if pinned:
        if pinned not in KINDS:
            raise ValueError(f"{ENV}={pinned!r}: not one of {sorted(KINDS)}")
        return pinned
    measured = rates()
    return max(measured, key=measured.__getitem__)
