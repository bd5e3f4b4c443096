"""The delta codec: one bucket of a version against the same bucket of a base version, bitwise.

A bucket is cut into *segments* where the manifest's tensors begin and end (the gaps between
tensors are segments of single bytes; :func:`weightsync.format.layout.segments`), so each segment
is compared in its own dtype's bits (``int16`` for bf16, ``int32`` for fp32: never float
arithmetic, so ``-0.0``, NaNs and every rounding survive). Each segment is sent in one of four modes:

- ``SAME``: no element changed; nothing on the wire.
- ``SPARSE``: the segment is read as 8-byte *words* (the last one padded with zeros). Three
  payloads, each compressed with zstd: the gaps between the words that changed (a byte each; a
  gap of 255 or more as 255, its length among the long gaps after them), which elements (*lanes*)
  of each such word changed (one bit each; none for 8-byte elements), and the changed elements'
  XOR with the base in byte planes (all first bytes, then all second bytes...). A word is
  compared whole, so the one pass that finds what changed looks at a quarter of bf16's elements,
  and the lanes are read only in the few words that changed. At RL
  learning rates a changed bf16 element differs in its low mantissa bits and the words that
  changed are close together, so the high planes are nearly all zeros (about 1.2 bytes per
  changed element at lr 1e-6: docs/deltas.md).
- ``XOR``: the whole segment's XOR with the base, byte planes, zstd: where many elements
  changed (half of them at lr 1e-4) this still carries about a third of the bytes.
- ``RAW``: the segment's bytes as they are (where nothing above is smaller, or not worth the
  time: ``auto`` never compresses a segment whose sampled change is dense).

The wire form of a bucket is a head (``int64``: a magic number, the segment count, the table's
length), the table (``int64`` per segment: its mode, changed elements, changed words and three
payload lengths; compressed where that is smaller, as it is but for the smallest buckets) and the
payloads. Both ends cut the bucket into the same segments from the manifest, so the table need
not name them; the decoder checks every length, count and position against them, so a forged or
corrupted delta is refused (:class:`DeltaError`) rather than written out of bounds. A decoded
bucket is proven by the member's digest over it, never by the wire's.

Two implementations of the same format: numpy's where it is installed and the bucket is on the
host (its compaction runs several times faster than torch's on a CPU, and each pass runs over a
slice of the segment that stays in cache), torch's otherwise (on a device, or with no numpy:
numpy is not a dependency). Either end may use either: the bytes are the same.
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
MAGIC = 0x5753_4454_0002  # "WSDT", format 2 (format 1: element positions, refused)
HEAD = 3  # int64s before the table: the magic number, the segment count, the table's length on the wire
FIELDS = 6  # per segment in the table: mode, changed elements, changed words, three payload lengths
SAMPLES = 4096  # elements sampled per segment to guess how much of it changed
DENSE = 0.25  # sampled share above which a segment is dense: auto sends it as it is, delta XORs it
SMALL = 1 << 14  # segments under this many bytes are compared outright, never sampled
LEVEL = 1  # zstd level: measured in benchmarks.delta_formats (higher levels gain little, cost much)
CHUNK = 1 << 15  # words a numpy pass takes at once (256 KiB of each side: its temporaries stay in cache)
MAX_WORDS = 1 << 31  # word gaps are int32: a longer segment goes XOR or RAW


class DeltaError(ValueError):
    """A delta that cannot be applied to this bucket (corrupted, forged, or for another layout)."""


def _zstd() -> Any:
    import zstandard  # a declared dependency; imported when a delta is first made

    return zstandard


_numpy: list[Any] = []


def _np() -> Any:
    """numpy where it is installed, else None (looked up once, at first use)."""
    if not _numpy:
        try:
            import numpy

            _numpy.append(numpy)
        except ImportError:
            _numpy.append(None)
    return _numpy[0]


_local = threading.local()
_UNSIGNED = {2: "<u2", 4: "<u4", 8: "<u8"}  # numpy dtypes by element size (names: numpy is imported late)
_SIGNED = {2: "<i2", 4: "<i4", 8: "<i8"}
LONG = 255  # a word gap this long or longer is sent as this byte, its length among the long gaps


def _compressor() -> Any:
    """This thread's compressor (a ZstdCompressor must not be used by two threads at once)."""
    made = getattr(_local, "compressor", None)
    if made is None:
        made = _local.compressor = _zstd().ZstdCompressor(level=LEVEL)
    return made


def _planes(values: torch.Tensor) -> torch.Tensor:
    """``values`` (one element per row of bytes) as byte planes, compressed."""
    size = values.element_size()
    raw = values.contiguous().view(torch.uint8)
    np = _np()
    if size > 1 and np is not None and not raw.is_cuda:
        whole = raw.numpy().view(_UNSIGNED[size])
        planes = np.empty((size, whole.size), np.uint8)
        for i in range(size):  # plane i: each element's byte i (shifts: faster than a transposing copy)
            np.right_shift(whole, 8 * i, out=planes[i], casting="unsafe")
        return _zip(torch.from_numpy(planes).view(-1))
    return _zip(raw.view(-1, size).t() if size > 1 else raw)


def _decompress(data: memoryview, nbytes: int, *, exact: bool = True) -> torch.Tensor:
    """A payload's ``nbytes`` bytes (``exact=False``: at most that many); its frame must say its
    size, so a forged one is refused before anything is allocated for it."""
    try:
        told = _zstd().frame_content_size(data)
        if told < 0 or told > nbytes or (exact and told != nbytes):
            raise DeltaError(f"a payload says it holds {told} bytes, {'' if exact else 'at most '}{nbytes} expected")
        raw = _zstd().ZstdDecompressor().decompress(data, max_output_size=nbytes)
    except _zstd().ZstdError as err:
        raise DeltaError(f"a payload does not decompress: {err}") from None
    if len(raw) != told:
        raise DeltaError(f"a payload holds {len(raw)} bytes, {told} told")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)


def _unplanes(data: memoryview, count: int, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """``count`` elements of ``dtype`` from their compressed byte planes, on ``device`` (default the
    host): the planes are decompressed on the host and moved as they are; a device puts the bytes
    of each element back together itself (a CUDA member: no host pass over them)."""
    size = torch.empty((), dtype=dtype).element_size()
    planes = _decompress(data, count * size)
    np = _np()
    if size > 1 and np is not None and (device is None or device.type == "cpu"):
        rows = planes.numpy().reshape(size, count)
        whole = rows[0].astype(_UNSIGNED[size])
        for i in range(1, size):
            whole |= rows[i].astype(_UNSIGNED[size]) << (8 * i)
        return torch.from_numpy(whole.view(_SIGNED[size])).view(dtype)
    if device is not None and device.type != "cpu":
        planes = planes.to(device)
    if size > 1:
        planes = planes.view(size, count).t().contiguous().reshape(-1)
    return planes.view(dtype)


def estimate(cur: torch.Tensor, base: torch.Tensor, segs: Sequence[Segment]) -> int:
    """About how many bytes ``auto``'s delta of this bucket would be, from samples (no full compare):
    dense segments as they are, sparse ones at about a byte and a quarter per changed element."""
    total = 0
    for seg in segs:
        nbytes = seg.hi - seg.lo
        if nbytes < SMALL:
            total += nbytes // 4  # small tensors (norms, biases): too few to sample, too small to matter
            continue
        dtype = BITS[seg.size]
        share = _sampled_share(cur[seg.lo:seg.hi].view(dtype), base[seg.lo:seg.hi].view(dtype))
        total += nbytes if share > DENSE else int(share * (nbytes // seg.size) * 1.25)
    return total


def _sampled_share(cur: torch.Tensor, base: torch.Tensor) -> float:
    if not cur.numel():
        return 0.0
    stride = max(cur.numel() // SAMPLES, 1)
    np = _np()
    if np is not None and not cur.is_cuda:  # a tenth of torch's time for a strided read this short
        c, b = cur.numpy()[::stride], base.numpy()[::stride]
        return int(np.count_nonzero(np.not_equal(c, b))) / c.size
    return float((cur[::stride] != base[::stride]).float().mean())


# finding what changed ---------------------------------------------------------------------------

def _words(seg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A segment's whole words (``int64``) and its last bytes (under 8) padded into one word (empty
    where there are none). An unaligned segment is copied first (a view needs 8-byte alignment)."""
    n = seg.numel() // 8 * 8
    head = seg[:n] if seg.storage_offset() % 8 == 0 else seg[:n].clone()
    tail = seg.new_zeros(8 if n < seg.numel() else 0)
    tail[: seg.numel() - n] = seg[n:]
    return head.view(torch.int64), tail.view(torch.int64)


def _changed_words(cur: torch.Tensor, base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions (``int64``, ascending; the padded last word is position ``nbytes // 8``) of the
    words where the ``uint8`` segments ``cur`` and ``base`` differ, and those words' XOR."""
    (wc, tc), (wb, tb) = _words(cur), _words(base)
    np = _np()
    if np is not None and not cur.is_cuda and wc.numel() > 0:
        at, xors = _changed_words_numpy(np, wc.numpy(), wb.numpy())
        pos, xor = torch.from_numpy(at), torch.from_numpy(xors)
    else:
        x = torch.bitwise_xor(wc, wb)
        pos = x.nonzero().flatten()
        xor = x[pos]
    if tc.numel():
        xt = torch.bitwise_xor(tc, tb)
        if bool(xt.ne(0).any()):
            pos = torch.cat([pos, pos.new_tensor([wc.numel()])])
            xor = torch.cat([xor, xt])
    return pos, xor


def _changed_words_numpy(np: Any, cur: Any, base: Any) -> tuple[Any, Any]:
    """:func:`_changed_words` in numpy, a cache-sized slice at a time: XOR, compare with zero, the
    positions of the words that are not, and their XOR (the one pass over both versions)."""
    xs = np.empty(min(CHUNK, cur.size), np.int64)
    hits = np.empty(xs.size, np.bool_)
    at, xors = [], []
    for lo in range(0, cur.size, CHUNK):
        hi = min(lo + CHUNK, cur.size)
        x = np.bitwise_xor(cur[lo:hi], base[lo:hi], out=xs[: hi - lo])
        found = np.flatnonzero(np.not_equal(x, 0, out=hits[: hi - lo]))
        if found.size:
            xors.append(x.take(found))
            found += lo
            at.append(found)
    if not at:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    return np.concatenate(at), np.concatenate(xors)


def _lanes(xor: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Of the changed words' XOR: which elements (lanes, ``bool`` per lane) changed, and their XOR."""
    lanes = xor.view(BITS[size]).reshape(-1)
    np = _np()
    if np is not None and not lanes.is_cuda:
        flat = lanes.numpy()
        mask = np.not_equal(flat, 0)
        return torch.from_numpy(mask), torch.from_numpy(flat.take(np.flatnonzero(mask)))
    mask = lanes != 0
    return mask, lanes[mask]


def _packbits(mask: torch.Tensor) -> torch.Tensor:
    """``bool`` -> one bit each, the first in the top bit of its byte (numpy's ``packbits``)."""
    np = _np()
    if np is not None and not mask.is_cuda:
        return torch.from_numpy(np.packbits(mask.numpy()))
    pad = (-mask.numel()) % 8
    bits = torch.cat([mask, mask.new_zeros(pad)]).view(-1, 8).to(torch.int32)
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.int32, device=mask.device)
    return (bits * weights).sum(1).to(torch.uint8)


def _unpackbits(packed: torch.Tensor, count: int) -> torch.Tensor:
    np = _np()
    if np is not None and not packed.is_cuda:
        return torch.from_numpy(np.unpackbits(packed.numpy(), count=count).view(np.bool_))
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=packed.device)
    return ((packed.view(-1, 1) >> shifts) & 1).view(-1)[:count].bool()


@dataclass
class Encoded:
    wire: torch.Tensor  # the bucket's wire bytes (uint8, on the host)
    changed: int  # elements that differ from the base
    elements: int
    modes: tuple[int, ...]


def _sparse(cur: torch.Tensor, base: torch.Tensor, size: int) -> tuple[int, int, list[torch.Tensor]]:
    """A segment's changed elements, changed words, and its SPARSE payloads (none: nothing changed)."""
    pos, xor = _changed_words(cur, base)
    if pos.numel() == 0:
        return 0, 0, []
    parts = [_zip(_gap_bytes(pos))]
    if size == 8:  # one element a word: the word is the element
        values, lanes = xor, torch.empty(0, dtype=torch.uint8)
    else:
        mask, values = _lanes(xor, size)
        lanes = _zip(_packbits(mask))
    parts += [lanes, _planes(values)]
    return values.numel(), pos.numel(), parts


def _gap_bytes(pos: torch.Tensor) -> torch.Tensor:
    """Word positions as gaps between them: a byte each (``LONG`` and more: ``LONG``), then the long
    gaps as they are (``int32``, little-endian); at the densities deltas are sent at nearly every
    gap fits its byte."""
    np = _np()
    if np is not None and not pos.is_cuda:
        at = pos.numpy()
        gaps = np.empty_like(at)
        gaps[0] = at[0]
        np.subtract(at[1:], at[:-1], out=gaps[1:])
        gaps[1:] -= 1
        short = np.minimum(gaps, LONG).astype(np.uint8)
        return torch.from_numpy(np.concatenate([short, gaps[gaps >= LONG].astype("<i4").view(np.uint8)]))
    gaps = torch.diff(pos, prepend=pos.new_tensor([-1])) - 1
    short = gaps.clamp(max=LONG).to(torch.uint8)
    return torch.cat([short, gaps[gaps >= LONG].to(torch.int32).view(torch.uint8)]).cpu()


def _zip(raw: torch.Tensor) -> torch.Tensor:
    """A host ``uint8`` tensor compressed (read in place: ``raw`` is held until the compressor is done)."""
    raw = raw.cpu().contiguous()
    return _bytes(_compressor().compress(_host_view(raw) if raw.numel() else b""))


def _gaps_back(j: int, raw: torch.Tensor, words: int) -> torch.Tensor:
    """The word positions (``int64``, ascending) from :func:`_gap_bytes`' form; DeltaError if the
    long gaps do not add up or a position is negative."""
    np = _np()
    short = raw[:words]
    long_at = (torch.from_numpy(np.flatnonzero(short.numpy() == LONG)) if np is not None
               else (short == LONG).nonzero().flatten())
    if raw.numel() != words + 4 * long_at.numel():
        raise DeltaError(f"segment {j}: {raw.numel() - words} bytes of long gaps for {long_at.numel()} of them")
    gaps = short.to(torch.int64)
    if long_at.numel():
        longs = raw[words:].clone().view(torch.int32).to(torch.int64)
        if int(longs.min()) < LONG:
            raise DeltaError(f"segment {j}: a long gap under {LONG}")
        gaps[long_at] = longs
    return torch.cumsum(gaps + 1, 0) - 1


def encode(cur: torch.Tensor, base: torch.Tensor, segs: Sequence[Segment], *, auto: bool) -> Encoded:
    """Bucket ``cur`` against ``base`` (both ``uint8``, same length). ``auto``: dense segments go as
    they are, uncompressed (the time a compression takes is not worth its bytes there)."""
    table: list[int] = []
    payloads: list[torch.Tensor] = []
    changed = elements = 0
    modes: list[int] = []
    for seg in segs:
        dtype = BITS[seg.size]
        nbytes = seg.hi - seg.lo
        c, b = cur[seg.lo:seg.hi], base[seg.lo:seg.hi]
        n = nbytes // seg.size
        elements += n
        dense = (nbytes >= SMALL and _sampled_share(c.view(dtype), b.view(dtype)) > DENSE) or nbytes // 8 >= MAX_WORDS
        words = 0
        if dense and auto:
            mode, k, parts = RAW, n, [c]
        elif dense:
            xor = torch.bitwise_xor(c.view(dtype), b.view(dtype))
            k = int(torch.count_nonzero(xor))
            mode, parts = XOR, [_planes(xor)]
        else:
            k, words, parts = _sparse(c, b, seg.size)
            mode = SPARSE if k else SAME
        if sum(p.numel() for p in parts) >= nbytes and mode != RAW:
            mode, parts, words = RAW, [c], 0
        changed += k
        modes.append(mode)
        lengths = [p.numel() for p in parts] + [0, 0, 0]
        table += [mode, k, words, *lengths[:3]]
        payloads += parts
    rows = torch.tensor(table, dtype=torch.int64).view(torch.uint8)
    zipped = _zip(rows)  # mostly zeros and small numbers: a tenth of its bytes, or fewer, for small buckets
    rows = zipped if zipped.numel() < rows.numel() else rows
    head = torch.tensor([MAGIC, len(segs), rows.numel()], dtype=torch.int64).view(torch.uint8)
    wire = torch.cat([head, rows] + [p.cpu().view(torch.uint8) for p in payloads])
    return Encoded(wire, changed, elements, tuple(modes))


def longest(segs: Sequence[Segment]) -> int:
    """The most bytes a bucket of ``segs`` takes on the wire: its table and every segment as it is
    (every other mode is kept only where it is smaller). What a member bounds a told size by."""
    return 8 * (HEAD + FIELDS * len(segs)) + sum(seg.hi - seg.lo for seg in segs)


def _bytes(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


# rebuilding ---------------------------------------------------------------------------------------

def decode(wire: torch.Tensor, base: torch.Tensor, out: torch.Tensor, segs: Sequence[Segment]) -> None:
    """Rebuild the bucket into ``out`` from ``base`` and its ``wire`` form; DeltaError if the wire
    does not describe exactly these segments."""
    if wire.numel() < 8 * HEAD:
        raise DeltaError(f"a delta bucket of {wire.numel()} bytes is shorter than its head")
    magic, count, told = wire[: 8 * HEAD].cpu().clone().view(torch.int64).tolist()
    if magic != MAGIC or count != len(segs):
        raise DeltaError(f"a delta bucket's table names {count} segments (magic {magic:#x}), "
                         f"the layout has {len(segs)}")
    host = wire.cpu().contiguous()  # read in place: valid while ``host`` lives
    data = memoryview(_host_view(host)).cast("B") if host.numel() else memoryview(b"")
    size = 8 * FIELDS * len(segs)
    if not 0 <= told <= size or 8 * HEAD + told > wire.numel():
        raise DeltaError(f"a delta bucket's table of {told} bytes does not fit ({size} at most)")
    rows = host[8 * HEAD: 8 * HEAD + told]
    if told < size:  # compressed
        rows = _decompress(data[8 * HEAD: 8 * HEAD + told], size)
    table = rows.clone().view(torch.int64).tolist()
    at = 8 * HEAD + told
    for j, seg in enumerate(segs):
        mode, k, words, la, lb, lc = table[FIELDS * j: FIELDS * (j + 1)]
        nbytes = seg.hi - seg.lo
        n = nbytes // seg.size
        if min(k, words, la, lb, lc) < 0 or k > n or at + la + lb + lc > wire.numel():
            raise DeltaError(f"segment {j}: lengths {la}+{lb}+{lc} or count {k} do not fit")
        dtype = BITS[seg.size]
        o, b = out[seg.lo:seg.hi], base[seg.lo:seg.hi]
        if mode == SAME and la == lb == lc == k == words == 0:
            o.copy_(b)
        elif mode == RAW and la == nbytes and lb == lc == words == 0:
            o.copy_(host[at:at + la])
        elif mode == XOR and lb == lc == words == 0:
            xor = _unplanes(data[at:at + la], n, dtype, o.device)
            torch.bitwise_xor(b.view(dtype), xor, out=o.view(dtype))
        elif mode == SPARSE and 0 < words <= k and k > 0:
            _patch(j, data[at:at + la + lb + lc], (la, lb, lc), k, words, seg.size, b, o)
        else:
            raise DeltaError(f"segment {j}: mode {mode} with lengths {la}, {lb}, {lc} and counts {k}, {words} "
                             f"is not a delta")
        at += la + lb + lc
    if at != wire.numel():
        raise DeltaError(f"a delta bucket of {wire.numel()} bytes holds {wire.numel() - at} bytes past its payloads")


def _patch(j: int, data: memoryview, lengths: tuple[int, int, int], k: int, words: int, size: int,
           base: torch.Tensor, out: torch.Tensor) -> None:
    """A SPARSE segment: ``out`` is ``base`` with the changed words' XOR applied, every count and
    position checked against the segment first (nothing is written where it does not belong)."""
    la, lb, lc = lengths
    nbytes = base.numel()
    last = (nbytes + 7) // 8  # positions 0..last-1; the last one is the padded tail where there is one
    device = out.device
    pos = _gaps_back(j, _decompress(data[:la], 5 * words, exact=False), words).to(device)
    if int(pos[-1]) >= last:
        raise DeltaError(f"segment {j}: a word past its {last} words")
    values = _unplanes(data[la + lb:la + lb + lc], k, BITS[size], device)
    if size == 8:
        if lb or k != words:
            raise DeltaError(f"segment {j}: {k} elements in {words} words of one element each")
        xor = values
    else:
        per = 8 // size
        mask = _unpackbits(_decompress(data[la:la + lb], (words * per + 7) // 8).to(device), words * per)
        xor = _lanes_back(j, mask, values, k, words * per)
    whole = nbytes // 8
    if int(pos[-1]) == whole:  # the padded tail changed
        pos, tail = pos[:-1], xor[-1:].view(torch.uint8)[: nbytes - whole * 8]
        xor = xor[:-1]
        out[whole * 8:] = torch.bitwise_xor(base[whole * 8:], tail)
    else:
        out[whole * 8:] = base[whole * 8:]
    head, held = out[: whole * 8], base[: whole * 8]
    np = _np()
    if np is not None and not out.is_cuda and head.storage_offset() % 8 == 0 and held.storage_offset() % 8 == 0:
        _xor_into_numpy(np, head.view(torch.int64).numpy(), held.view(torch.int64).numpy(), pos.numpy(), xor.numpy())
        return
    head.copy_(held)
    if pos.numel():
        aligned = head if head.storage_offset() % 8 == 0 else head.clone()
        w = aligned.view(torch.int64)
        w.index_put_((pos,), torch.bitwise_xor(w.index_select(0, pos), xor))
        if aligned is not head:
            head.copy_(aligned)


def _lanes_back(j: int, mask: torch.Tensor, values: torch.Tensor, k: int, lanes: int) -> torch.Tensor:
    """The changed words' XOR (``int64``) from which lanes changed and their values."""
    np = _np()
    if np is not None and not mask.is_cuda:
        at = np.flatnonzero(mask.numpy())
        if at.size != k:
            raise DeltaError(f"segment {j}: {at.size} changed lanes, {k} values")
        out = np.zeros(lanes, values.numpy().dtype)
        out.put(at, values.numpy())  # a third of a boolean assignment's time
        return torch.from_numpy(out).view(torch.int64)
    if int(mask.sum()) != k:
        raise DeltaError(f"segment {j}: {int(mask.sum())} changed lanes, {k} values")
    out_t = torch.zeros(lanes, dtype=values.dtype, device=values.device)
    out_t[mask] = values
    return out_t.view(torch.int64)


def _xor_into_numpy(np: Any, out: Any, base: Any, pos: Any, xor: Any) -> None:
    """``out`` = ``base`` with ``xor`` applied at word positions ``pos`` (ascending, in bounds), a
    cache-sized slice at a time: each slice is copied, then its changed words patched while it is
    still in cache."""
    cuts = np.searchsorted(pos, np.arange(0, out.size + CHUNK, CHUNK))
    for i, lo in enumerate(range(0, out.size, CHUNK)):
        hi = min(lo + CHUNK, out.size)
        o = out[lo:hi]
        np.copyto(o, base[lo:hi])
        a, b = cuts[i], cuts[i + 1]
        if a < b:
            at = pos[a:b] - lo
            o.put(at, np.bitwise_xor(o.take(at), xor[a:b]))
