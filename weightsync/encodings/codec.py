"""The delta codec: one bucket of a version against the same bucket of a base version, bitwise.

A bucket is cut into *segments* where the manifest's tensors begin and end (the gaps between
tensors are segments of single bytes; :func:`weightsync.format.layout.segments`), so each segment
is compared in its own dtype's bits (``int16`` for bf16, ``int32`` for fp32: never float
arithmetic, so ``-0.0``, NaNs and every rounding survive). Each segment is sent in one of four modes:

- ``SAME``: no element changed; nothing on the wire.
- ``SPARSE``: the changed elements' positions, as gaps between them (``int32``), and their
  XOR with the base, each split into byte planes (all first bytes, then all second bytes...)
  and compressed with zstd. At RL learning rates a changed bf16 element differs in its low
  mantissa bits and gaps are short, so the high planes are nearly all zeros
  (docs/benchmarks.md, "Delta formats": 1.3-1.5 bytes per changed element).
- ``XOR``: the whole segment's XOR with the base, byte planes, zstd: where many elements
  changed (half of them at lr 1e-4) this still carries about a third of the bytes.
- ``RAW``: the segment's bytes as they are (where nothing above is smaller, or not worth the
  time: ``auto`` never compresses a segment whose sampled change is dense).

The wire form of a bucket is a table (``int64``: a magic number, the segment count, then per
segment its mode, changed count and two payload lengths) followed by the payloads. Both ends
cut the bucket into the same segments from the manifest, so the table need not name them; the
decoder checks every length, count and position against them, so a forged or corrupted delta
is refused (:class:`DeltaError`) rather than written out of bounds. A decoded bucket is proven
by the member's digest over it, never by the wire's.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.format.checksum import _host_view
from weightsync.format.layout import BITS, Segment

SAME, SPARSE, XOR, RAW = 0, 1, 2, 3
MAGIC = 0x5753_4454_0001  # "WSDT", format 1
SAMPLES = 4096  # elements sampled per segment to guess how much of it changed
DENSE = 0.25  # sampled share above which a segment is dense: auto sends it as it is, delta XORs it
SMALL = 1 << 14  # segments under this many bytes are compared outright, never sampled
LEVEL = 1  # zstd level: measured in benchmarks.delta_formats (higher levels gain little, cost much)


class DeltaError(ValueError):
    """A delta that cannot be applied to this bucket (corrupted, forged, or for another layout)."""


def _zstd() -> Any:
    import zstandard  # a declared dependency; imported when a delta is first made

    return zstandard


_local = threading.local()


def _compressor() -> Any:
    """This thread's compressor (a ZstdCompressor must not be used by two threads at once)."""
    made = getattr(_local, "compressor", None)
    if made is None:
        made = _local.compressor = _zstd().ZstdCompressor(level=LEVEL)
    return made


def _planes(values: torch.Tensor) -> bytes:
    """``values`` (one element per row of bytes) as byte planes, compressed."""
    size = values.element_size()
    raw = values.contiguous().view(torch.uint8)
    if size > 1:
        raw = raw.view(-1, size).t().contiguous()
    host = raw.cpu()  # contiguous already: read in place (numpy is not a dependency)
    return _compressor().compress(_host_view(host) if host.numel() else b"")


def _unplanes(data: memoryview, count: int, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """``count`` elements of ``dtype`` from their compressed byte planes, on ``device`` (default the
    host): the planes are decompressed on the host and moved as they are; a device puts the bytes
    of each element back together itself (a CUDA member: no host pass over them)."""
    size = torch.empty((), dtype=dtype).element_size()
    try:
        raw = _zstd().ZstdDecompressor().decompress(data, max_output_size=count * size)
    except _zstd().ZstdError as err:
        raise DeltaError(f"a payload does not decompress: {err}") from None
    if len(raw) != count * size:
        raise DeltaError(f"a payload holds {len(raw)} bytes, {count * size} expected")
    planes = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    if device is not None and device.type != "cpu":
        planes = planes.to(device)
    if size > 1:
        planes = planes.view(size, count).t().contiguous().reshape(-1)
    return planes.view(dtype)


def estimate(cur: torch.Tensor, base: torch.Tensor, segs: Sequence[Segment]) -> int:
    """About how many bytes ``auto``'s delta of this bucket would be, from samples (no full compare):
    dense segments as they are, sparse ones at about a byte and a half per changed element."""
    total = 0
    for seg in segs:
        nbytes = seg.hi - seg.lo
        if nbytes < SMALL:
            total += nbytes // 4  # small tensors (norms, biases): too few to sample, too small to matter
            continue
        dtype = BITS[seg.size]
        share = _sampled_share(cur[seg.lo:seg.hi].view(dtype), base[seg.lo:seg.hi].view(dtype))
        total += nbytes if share > DENSE else int(share * (nbytes // seg.size) * 1.5)
    return total


def _sampled_share(cur: torch.Tensor, base: torch.Tensor) -> float:
    stride = max(cur.numel() // SAMPLES, 1)
    return float((cur[::stride] != base[::stride]).float().mean()) if cur.numel() else 0.0


def changed_positions(cur: torch.Tensor, base: torch.Tensor, size: int) -> torch.Tensor:
    """The positions (``int64``, ascending) of the ``size``-byte elements where ``cur`` and ``base``
    (``uint8``, one segment) differ. Compared eight bytes at a time first: at RL learning rates most
    words hold no change, so the element-wise compare runs on the few that do."""
    dtype = BITS[size]
    nbytes = cur.numel()
    words = nbytes // 8
    aligned = cur.storage_offset() % 8 == 0 and base.storage_offset() % 8 == 0
    if size == 8 or words < 64 or not aligned:
        return (cur.view(dtype) != base.view(dtype)).nonzero().flatten()
    per = 8 // size
    wc, wb = cur[: words * 8].view(torch.int64), base[: words * 8].view(torch.int64)
    hit = (wc != wb).nonzero().flatten()
    lanes = wc[hit].view(dtype).view(-1, per) != wb[hit].view(dtype).view(-1, per)
    rows, lane = lanes.nonzero(as_tuple=True)
    idx = hit[rows] * per + lane
    if words * 8 < nbytes:  # the tail past the last whole word
        tail = (cur[words * 8:].view(dtype) != base[words * 8:].view(dtype)).nonzero().flatten()
        idx = torch.cat([idx, tail + words * per])
    return idx


@dataclass
class Encoded:
    wire: torch.Tensor  # the bucket's wire bytes (uint8, on the host)
    changed: int  # elements that differ from the base
    elements: int
    modes: tuple[int, ...]


def encode(cur: torch.Tensor, base: torch.Tensor, segs: Sequence[Segment], *, auto: bool) -> Encoded:
    """Bucket ``cur`` against ``base`` (both ``uint8``, same length). ``auto``: dense segments go as
    they are, uncompressed (the time a compression takes is not worth its bytes there)."""
    table: list[int] = [MAGIC, len(segs)]
    payloads: list[torch.Tensor] = []
    changed = elements = 0
    modes: list[int] = []
    for seg in segs:
        dtype = BITS[seg.size]
        c, b = cur[seg.lo:seg.hi].view(dtype), base[seg.lo:seg.hi].view(dtype)
        n = c.numel()
        elements += n
        dense = seg.hi - seg.lo >= SMALL and _sampled_share(c, b) > DENSE
        if dense and auto:
            mode, k, parts = RAW, n, [cur[seg.lo:seg.hi]]
        elif dense:
            xor = torch.bitwise_xor(c, b)
            k = int(torch.count_nonzero(xor))
            parts = [_bytes(_planes(xor))]
            mode = XOR
            if parts[0].numel() >= seg.hi - seg.lo:
                mode, parts = RAW, [cur[seg.lo:seg.hi]]
        else:
            idx = changed_positions(cur[seg.lo:seg.hi], base[seg.lo:seg.hi], seg.size)
            k = idx.numel()
            if k == 0:
                mode, parts = SAME, []
            else:
                gaps = torch.diff(idx, prepend=idx.new_tensor([-1])) - 1
                values = torch.bitwise_xor(c[idx], b[idx])
                parts = [_bytes(_planes(gaps.to(torch.int32))), _bytes(_planes(values))]
                mode = SPARSE
                if sum(p.numel() for p in parts) >= seg.hi - seg.lo:
                    mode, parts = RAW, [cur[seg.lo:seg.hi]]
        changed += k
        modes.append(mode)
        lengths = [p.numel() for p in parts] + [0, 0]
        table += [mode, k, lengths[0], lengths[1]]
        payloads += parts
    head = torch.tensor(table, dtype=torch.int64).view(torch.uint8)
    wire = torch.cat([head] + [p.cpu().view(torch.uint8) for p in payloads])
    return Encoded(wire, changed, elements, tuple(modes))


def longest(segs: Sequence[Segment]) -> int:
    """The most bytes a bucket of ``segs`` takes on the wire: its table and every segment as it is
    (every other mode is kept only where it is smaller). What a member bounds a told size by."""
    return 8 * (2 + 4 * len(segs)) + sum(seg.hi - seg.lo for seg in segs)


def _bytes(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def decode(wire: torch.Tensor, base: torch.Tensor, out: torch.Tensor, segs: Sequence[Segment]) -> None:
    """Rebuild the bucket into ``out`` from ``base`` and its ``wire`` form; DeltaError if the wire
    does not describe exactly these segments."""
    n_head = 2 + 4 * len(segs)
    if wire.numel() < 8 * n_head:
        raise DeltaError(f"a delta bucket of {wire.numel()} bytes is shorter than its table")
    table = wire[: 8 * n_head].cpu().clone().view(torch.int64).tolist()
    if table[0] != MAGIC or table[1] != len(segs):
        raise DeltaError(f"a delta bucket's table names {table[1]} segments (magic {table[0]:#x}), "
                         f"the layout has {len(segs)}")
    host = wire.cpu().contiguous()  # read in place (numpy is not a dependency): valid while ``host`` lives
    data = memoryview(_host_view(host)).cast("B") if host.numel() else memoryview(b"")
    at = 8 * n_head
    for j, seg in enumerate(segs):
        mode, k, la, lb = table[2 + 4 * j: 6 + 4 * j]
        nbytes = seg.hi - seg.lo
        n = nbytes // seg.size
        if min(k, la, lb) < 0 or k > n or at + la + lb > wire.numel():
            raise DeltaError(f"segment {j}: lengths {la}+{lb} or count {k} do not fit")
        dtype = BITS[seg.size]
        o, b = out[seg.lo:seg.hi], base[seg.lo:seg.hi]
        if mode == SAME and la == lb == 0 and k == 0:
            o.copy_(b)
        elif mode == RAW and la == nbytes and lb == 0:
            o.copy_(host[at:at + la])
        elif mode == XOR and lb == 0:
            xor = _unplanes(data[at:at + la], n, dtype, o.device)
            torch.bitwise_xor(b.view(dtype), xor, out=o.view(dtype))
        elif mode == SPARSE and k > 0:
            # positions are summed where the bucket is (int32 gaps cross to a device, not int64s)
            gaps = _unplanes(data[at:at + la], k, torch.int32, o.device).to(torch.int64)
            values = _unplanes(data[at + la:at + la + lb], k, dtype, o.device)
            if int(gaps.min()) < 0:
                raise DeltaError(f"segment {j}: a negative gap")
            idx = torch.cumsum(gaps + 1, 0) - 1
            if int(idx[-1]) >= n:
                raise DeltaError(f"segment {j}: a position past its {n} elements")
            o.copy_(b)
            ov = o.view(dtype)
            ov[idx] = torch.bitwise_xor(ov[idx], values)
        else:
            raise DeltaError(f"segment {j}: mode {mode} with lengths {la}, {lb} and count {k} is not a delta")
        at += la + lb
    if at != wire.numel():
        raise DeltaError(f"a delta bucket of {wire.numel()} bytes holds {wire.numel() - at} bytes past its payloads")
