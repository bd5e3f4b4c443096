"""Sliced members: a generator rank that receives only its boxes of a version.

A sliced member (a tensor-parallel generator rank) names the boxes it wants (``_wire.Want``);
each trainer rank then sends it, point to point in its own group, only the bytes of its
buckets that fall in those boxes: a *route* per bucket, ``(offset in the bucket, offset in
the member's slot, bytes)`` runs in bucket order. The member's slot packs its boxes in the
full manifest's order (``sliced_manifest``); both ends compute the same routes.

Who calls what: :class:`~weightsync.transport.subscriber.Subscriber` turns ``want=`` into boxes
(:func:`wants_of`); the Sender computes each sliced member's routes and gathers its runs of
every bucket; the Receiver computes the same routes and places what arrives (:class:`SlicePlacer`).
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from weightsync import _wire
from weightsync.format import layout
from weightsync.format.sharding import blocks_of, global_manifest, is_dtensor

Run = tuple[int, int, int]  # (offset in the bucket, offset in the member's slot, bytes)


def wants_of(dest: Mapping[str, Any]) -> tuple[_wire.Want, ...]:
    """What a generator holding ``dest`` receives: each DTensor's local box (nothing where this
    rank is not in its mesh), each plain tensor whole, each ``(offset, shape)`` pair that box, each
    ``(offset, shape, of)`` triple that box of a tensor of shape ``of``, each list of such boxes
    (disjoint) all of them, each arriving as a tensor of its own (:func:`box_name`). A tensor, a
    DTensor and a triple say the whole shape: a version whose tensor has another is refused for
    this member."""
    if not isinstance(dest, Mapping) or not dest:
        raise ValueError("want must be a non-empty mapping of names to tensors, DTensors or (offset, shape) boxes")
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = []
    for name, value in dest.items():
        if not isinstance(name, str):
            raise TypeError(f"want's keys must be tensor names, got {type(name).__name__}")
        if is_dtensor(value):
            for placement in value.placements:
                if not (placement.is_shard() or placement.is_replicate()):
                    raise ValueError(f"{name!r}: placement {placement} cannot be received as a slice")
            if value.device_mesh.get_coordinate() is None:
                continue
            shape, offset = compute_local_shape_and_global_offset(tuple(value.shape), value.device_mesh,
                                                                  value.placements)
            out.append(_wire.Want(name, tuple(int(o) for o in offset), tuple(int(n) for n in shape),
                                  tuple(int(n) for n in value.shape)))
        elif isinstance(value, torch.Tensor):
            out.append(_wire.Want(name, (0,) * value.dim(), tuple(value.shape), tuple(value.shape)))
        elif isinstance(value, tuple):
            out.append(_box_want(name, value))
        elif isinstance(value, list) and value and all(isinstance(v, tuple) for v in value):
            out.extend(_box_want(name, v) for v in value)
        else:
            raise TypeError(f"{name!r}: want's values must be tensors, DTensors, (offset, shape[, of]) boxes or "
                            f"lists of boxes, got {type(value).__name__}")
    return tuple(out)


def _box_want(name: str, value: tuple[Any, ...]) -> _wire.Want:
    dims = [tuple(v) for v in value] if all(isinstance(v, (tuple, list)) for v in value) else []
    if len(dims) not in (2, 3) or len({len(d) for d in dims}) != 1 or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for d in dims for n in d):
        raise ValueError(f"{name!r}: a box is (offset, shape) or (offset, shape, of), ints >= 0 of one length each, "
                         f"got {value!r}")
    return _wire.Want(name, dims[0], dims[1], dims[2] if len(dims) == 3 else None)


def box_name(name: str, index: int, count: int) -> str:
    """The name a wanted box arrives under: the tensor's own where it is its only box, else
    ``name[index]`` (the boxes of one tensor in ascending order of their offsets)."""
    return name if count == 1 else f"{name}[{index}]"


def _entries(full: _wire.Manifest, wants: Sequence[_wire.Want]) -> list[tuple[str, int, _wire.Want]]:
    """Each wanted box as ``(its name in the member's slot, the index of its tensor in full, the
    want)``, in ``full``'s order, a tensor's boxes by ascending offset. Raises ValueError for a box
    that does not fit its tensor, boxes of one tensor that overlap, a box wanted twice, or a name
    ``full`` does not hold (a member would otherwise wait for a tensor no version carries)."""
    boxes: dict[str, list[_wire.Want]] = {}
    for want in wants:
        boxes.setdefault(want.name, []).append(want)
    index = {spec.name: i for i, spec in enumerate(full.tensors)}
    unknown = sorted(set(boxes) - set(index))
    if unknown:
        raise ValueError(f"{', '.join(map(repr, unknown[:6]))}{' ...' if len(unknown) > 6 else ''} "
                         f"{'is' if len(unknown) == 1 else 'are'} wanted but not in the version "
                         f"(it holds {len(full.tensors)} tensors)")
    out: list[tuple[str, int, _wire.Want]] = []
    for name in sorted(boxes, key=index.__getitem__):
        spec, mine = full.tensors[index[name]], sorted(boxes[name], key=lambda w: w.offset)
        for want in mine:
            _check_fits(spec, want)
        for a, b in zip(mine, mine[1:], strict=False):
            if a.offset == b.offset and a.shape == b.shape:
                raise ValueError(f"{name!r} is wanted twice")
        for i, a in enumerate(mine):
            for b in mine[i + 1:]:
                if overlap((a.offset, a.shape), (b.offset, b.shape)):
                    raise ValueError(f"{name!r}: the wanted boxes {tuple(a.shape)} at {tuple(a.offset)} and "
                                     f"{tuple(b.shape)} at {tuple(b.offset)} overlap")
        out.extend((box_name(name, i, len(mine)), index[name], want) for i, want in enumerate(mine))
    taken = {entry for entry, _i, _w in out}
    clash = sorted(taken & set(index) - set(boxes))
    if clash:
        raise ValueError(f"{clash[0]!r} names both a tensor of the version and a box of another")
    return out


def overlap(a: tuple[Sequence[int], Sequence[int]], b: tuple[Sequence[int], Sequence[int]]) -> bool:
    """Whether two ``(offset, shape)`` boxes of one tensor share an element."""
    return all(oa < ob + nb and ob < oa + na for oa, na, ob, nb in zip(a[0], a[1], b[0], b[1], strict=True))


def _check_fits(spec: _wire.TensorSpec, want: _wire.Want) -> None:
    if want.of is not None and tuple(want.of) != tuple(spec.shape):
        raise ValueError(f"{spec.name!r}: wanted as a box of a tensor of shape {tuple(want.of)}, but the version's "
                         f"is {tuple(spec.shape)} (a plan made for another model or layout)")
    if len(want.offset) != len(spec.shape) or len(want.shape) != len(spec.shape) or any(
            o < 0 or n < 0 or o + n > g for o, n, g in zip(want.offset, want.shape, spec.shape, strict=True)):
        raise ValueError(f"{spec.name!r}: the wanted box {tuple(want.shape)} at {tuple(want.offset)} does not "
                         f"fit the published shape {tuple(spec.shape)}")


def sliced_manifest(full: _wire.Manifest, wants: Sequence[_wire.Want]) -> _wire.Manifest:
    """A sliced member's slot layout: its boxes of ``full``'s tensors, packed in ``full``'s order
    (several boxes of one tensor by ascending offset, each under :func:`box_name`). Raises
    ValueError for a box that does not fit its tensor, boxes of one tensor that overlap, a box
    wanted twice, or a name ``full`` does not hold."""
    return _slot(full, _entries(full, wants))


def _slot(full: _wire.Manifest, entries: list[tuple[str, int, _wire.Want]]) -> _wire.Manifest:
    return global_manifest([(entry, layout.dtype_from_name(full.tensors[i].dtype), tuple(want.shape))
                            for entry, i, want in entries])


def _runs(blocks: Sequence[tuple[int, int, int, int]]) -> list[tuple[int, int]]:
    """A block list as ``(start, bytes)`` runs in ascending order."""
    return [(offset + k * stride, run) for offset, run, count, stride in blocks for k in range(count)]


def routes(source: _wire.Manifest, pieces: Sequence[_wire.Piece] | None, full: _wire.Manifest,
           wants: Sequence[_wire.Want], ranges: Sequence[tuple[int, int]]) -> list[list[Run]]:
    """Per bucket (``ranges`` of ``source``, the sender's packed layout), the runs a sliced member
    wanting ``wants`` of ``full`` gets. ``pieces``: where ``source``'s tensors lie in ``full`` (a
    sharded lane); None when ``source`` is ``full`` itself. Raises ValueError where a box does not fit."""
    entries = _entries(full, wants)
    mine = _slot(full, entries)
    # per full tensor: the wanted bytes as (global start, global end, slot offset), ascending
    wanted: dict[int, list[tuple[int, int, int]]] = {}
    for spec, (_entry, i, want) in zip(mine.tensors, entries, strict=True):
        whole = full.tensors[i]
        size = layout.dtype_from_name(whole.dtype).itemsize
        at, spans = spec.offset, wanted.setdefault(i, [])
        for start, n in _runs(blocks_of(whole.shape, want.shape, want.offset, size, whole.offset)):
            spans.append((start, start + n, at))
            at += n
    for spans in wanted.values():
        spans.sort()  # a tensor's boxes interleave in its bytes (a fused weight's two halves per expert)
    if pieces is None:
        pieces = [_wire.Piece(i, ((spec.offset, spec.nbytes, 1, spec.nbytes),) if spec.nbytes else ())
                  for i, spec in enumerate(full.tensors)]
    out: list[Run] = []  # (offset in source, offset in slot, bytes)
    for spec, piece in zip(source.tensors, pieces, strict=True):
        if not wanted.get(piece.tensor):
            continue
        spans = wanted[piece.tensor]
        starts = [s for s, _e, _a in spans]
        at = spec.offset
        for start, n in _runs(piece.blocks):
            k = max(bisect.bisect_right(starts, start) - 1, 0)
            while k < len(spans) and spans[k][0] < start + n:
                lo, hi, slot_at = spans[k]
                a, b = max(lo, start), min(hi, start + n)
                if a < b:
                    _extend(out, (at + a - start, slot_at + a - lo, b - a))
                k += 1
            at += n
    out.sort()
    per_bucket: list[list[Run]] = [[] for _ in ranges]
    edges = [lo for lo, _hi in ranges]
    for src, dst, n in out:
        while n:
            i = bisect.bisect_right(edges, src) - 1
            lo, hi = ranges[i]
            take = min(n, hi - src)
            _extend(per_bucket[i], (src - lo, dst, take))
            src, dst, n = src + take, dst + take, n - take
    return per_bucket


@functools.lru_cache(maxsize=64)
def cached_routes(source: _wire.Manifest, pieces: tuple[_wire.Piece, ...] | None, full: _wire.Manifest,
                  wants: tuple[_wire.Want, ...], ranges: tuple[tuple[int, int], ...]) -> list[list[Run]]:
    """:func:`routes`, computed once per layout (every version of a model has the same one).
    The result is shared: never modified."""
    return routes(source, pieces, full, wants, ranges)


def share_segments(mine: _wire.Manifest, runs: Sequence[Run]) -> tuple[layout.Segment, ...]:
    """A sliced member's share of one bucket (its ``runs`` back to back, as :func:`gather` makes
    it) cut into the delta codec's segments: where the member's slot layout ``mine`` cuts it, each
    compared in its tensor's element size (single bytes where a piece does not lie on whole
    elements of the share), neighbours of one size merged. Both ends compute the same."""
    out: list[layout.Segment] = []
    at = 0
    for _src, dst, n in runs:
        for seg in layout.segments.__wrapped__(mine, dst, dst + n):
            lo, hi, size = at + seg.lo, at + seg.hi, seg.size
            if lo % size or (hi - lo) % size:
                size = 1
            if out and out[-1].size == size and out[-1].hi == lo:
                out[-1] = layout.Segment(out[-1].lo, hi, size)
            else:
                out.append(layout.Segment(lo, hi, size))
        at += n
    return tuple(out)


@functools.lru_cache(maxsize=64)
def cached_share_segments(source: _wire.Manifest, pieces: tuple[_wire.Piece, ...] | None, full: _wire.Manifest,
                          wants: tuple[_wire.Want, ...],
                          ranges: tuple[tuple[int, int], ...]) -> tuple[tuple[layout.Segment, ...], ...]:
    """Per bucket, :func:`share_segments` of a sliced member's routes (once per layout)."""
    mine = sliced_manifest(full, wants)
    return tuple(share_segments(mine, runs) for runs in cached_routes(source, pieces, full, wants, ranges))


def _extend(runs: list[Run], run: Run) -> None:
    """Append ``run``, merged into the last one when both sides continue it."""
    if runs:
        src, dst, n = runs[-1]
        if src + n == run[0] and dst + n == run[1]:
            runs[-1] = (src, dst, n + run[2])
            return
    runs.append(run)


def gather(bucket: torch.Tensor, runs: Sequence[Run], out: torch.Tensor | None = None) -> torch.Tensor:
    """What a sliced member is sent of ``bucket``: its runs back to back (a view when one run),
    in ``out`` (at least that long) when given."""
    if len(runs) == 1:
        src, _dst, n = runs[0]
        return bucket[src : src + n]
    if not runs:
        return bucket[:0]
    pieces = [bucket[src : src + n] for src, _dst, n in runs]
    if out is None:
        return torch.cat(pieces)
    return torch.cat(pieces, out=out[: sum(n for _s, _d, n in runs)])


def gathered_bytes(plan: Sequence[Sequence[Run]]) -> int:
    """The largest bucket share of ``plan`` that :func:`gather` copies (several runs)."""
    return max((sum(n for _s, _d, n in runs) for runs in plan if len(runs) > 1), default=0)


class SlicePlacer:
    """A sliced member's receive targets for one version from one trainer rank: per bucket, a view
    of its slot (one run), an empty tensor (nothing wanted), or one of two scratch buffers
    scattered into the slot once the bucket arrived (``place``)."""

    def __init__(self, slot: torch.Tensor, plan: Sequence[Sequence[Run]]) -> None:
        self._slot, self._plan = slot, plan
        self.targets: list[torch.Tensor] = []
        #: a delta version: per bucket, the share's segments (:func:`cached_share_segments`)
        self.segments: Sequence[tuple[layout.Segment, ...]] = ()
        total = slot.numel()
        for runs in plan:
            for _src, dst, n in runs:
                if dst < 0 or n <= 0 or dst + n > total:
                    raise ValueError(f"a run of {n} bytes at {dst} lies outside the {total}-byte slot")
        size = max((sum(n for _s, _d, n in runs) for runs in plan if len(runs) > 1), default=0)
        scratch = [torch.empty(size, dtype=torch.uint8, device=slot.device) for _ in range(2)] if size else []
        turn = 0
        for runs in plan:
            if len(runs) > 1:
                self.targets.append(scratch[turn % 2][: sum(n for _s, _d, n in runs)])
                turn += 1
            elif runs:
                _src, dst, n = runs[0]
                self.targets.append(slot[dst : dst + n])
            else:
                self.targets.append(slot[:0])

    def held(self, i: int, readable: torch.Tensor) -> torch.Tensor:
        """Bucket ``i``'s share as the readable slot ``readable`` holds it (a delta's base): its
        runs' slot bytes back to back (a view when one run)."""
        return gather(readable, [(dst, src, n) for src, dst, n in self._plan[i]])

    def place(self, i: int) -> None:
        """Bucket ``i``'s share arrived: scatter it into the slot (nothing to do for a view)."""
        runs = self._plan[i]
        if len(runs) < 2:
            return
        src, at = self.targets[i], 0
        for _s, dst, n in runs:
            self._slot[dst : dst + n].copy_(src[at : at + n])
            at += n


class Fanout:
    """Rank 0's point-to-point sends of one version (a generation with sliced members): each
    member's share of every bucket, and the digests of what each sliced member was sent.

    ``plans``: per sliced member, its routes (None: its boxes do not fit, it is sent nothing);
    ``buffers``: two gather buffers per sliced member (:class:`GatherBuffers`), used in turns,
    so bucket i+2 is gathered only once bucket i completed (the data plane keeps two in flight);
    ``coders``: per sliced member sent deltas, ``code(i, share)``: the wire form of its share of
    bucket i (the digests stay the share's: what the member rebuilds). Those shares are gathered
    and encoded by :meth:`encode`, which runs as bucket i is packed (before a ``copy=False``
    publisher's kept copy takes the bucket in place of its base bytes).
    """

    def __init__(self, group: Sequence[str], plans: Mapping[str, list[list[Run]] | None],
                 buffers: Mapping[str, list[torch.Tensor]], digest: Any,
                 coders: Mapping[str, Callable[[int, torch.Tensor], torch.Tensor]] | None = None) -> None:
        self._group, self._plans, self._buffers, self._digest = group, plans, buffers, digest
        self._coders = coders or {}
        self._sent: dict[int, list[tuple[str, torch.Tensor]]] = {}
        self._coded: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}  # bucket -> (share, wire)
        self.digests: dict[str, list[int]] = {m: [] for m in plans}  # per sliced member, per bucket
        self.wire: dict[str, int] = dict.fromkeys(plans, 0)  # per sliced member, the bytes sent it

    def _share(self, member: str, i: int, bucket: torch.Tensor) -> torch.Tensor:
        plan = self._plans[member]
        turns = self._buffers.get(member)
        return gather(bucket, plan[i] if plan is not None else (), out=turns[i % 2] if turns is not None else None)

    def encode(self, i: int, bucket: torch.Tensor) -> None:
        """Bucket ``i`` is packed: gather and encode the shares of the members sent deltas."""
        if not self._coders or i in self._coded:
            return
        self._coded[i] = {m: (share, code(i, share)) for m, code in self._coders.items()
                          for share in (self._share(m, i, bucket),)}

    def sends(self, i: int, bucket: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """Bucket ``i``'s ``(rank, bytes)`` pairs: the whole bucket to full members, its runs (or
        their delta) to sliced ones."""
        pairs, sliced = [], []
        coded = self._coded.get(i, {})
        for rank, member in enumerate(self._group, start=1):
            piece = bucket
            if member in self._plans:
                if member in coded:
                    share, piece = coded[member]
                else:
                    share = piece = self._share(member, i, bucket)
                sliced.append((member, share))
                self.wire[member] += piece.numel()
            pairs.append((rank, piece))
        self._sent[i] = sliced
        return pairs

    def done(self, i: int, verify: bool) -> None:
        """Bucket ``i`` completed: digest what each sliced member got (0 where nothing), let it go."""
        self._coded.pop(i, None)
        for member, piece in self._sent.pop(i, []):
            if verify:
                self.digests[member].append(self._digest(piece) if piece.numel() else 0)


class GatherBuffers:
    """Two gather buffers per sliced member, kept across versions (grown when a plan needs more)."""

    def __init__(self) -> None:
        self._buffers: dict[str, list[torch.Tensor]] = {}

    def for_plans(self, plans: Mapping[str, list[list[Run]] | None],
                  device: torch.device) -> dict[str, list[torch.Tensor]]:
        for member in [m for m in self._buffers if m not in plans]:
            del self._buffers[member]
        for member, plan in plans.items():
            need = 0 if plan is None else gathered_bytes(plan)
            have = self._buffers.get(member)
            if need and (have is None or have[0].numel() < need or have[0].device != device):
                self._buffers[member] = [torch.empty(need, dtype=torch.uint8, device=device) for _ in range(2)]
        return self._buffers
