"""Sharded versions: which bytes each trainer rank sends, and where they land on a subscriber.

A version put by ``W`` trainer ranks has one *global* layout (the full tensors, packed as
``layout.build_manifest`` packs them) and ``W`` *lanes*: rank r sends only the bytes it owns,
packed in its own lane layout, over its own group (one communicator per rank). Who owns what:

- a ``DTensor`` value: its local shard, by the rank whose mesh coordinate is 0 on every mesh
  dimension the tensor is ``Replicate()`` on (one rank per replica set, HSDP included);
  ``Shard(d)`` on any dimension, uneven shards as ``torch.chunk`` makes them; ``Partial()``
  is refused (it has no bytes to send until it is reduced);
- a plain tensor: rank 0, unless ``owners`` names another rank for it.

A local shard is a box in its global tensor. In the global row-major layout a box is one or
more *blocks*: ``count`` runs of ``run`` bytes, ``stride`` bytes apart, from ``offset``. A row
shard (``Shard(0)``, FSDP2's) is a single run; a column shard (``Shard(1)``) is one run per row.

The lane layout puts the pieces back to back, largest element size first, so no piece needs
padding; its buckets (``bucket_plan``) break at every large piece's edges, so that on the
subscriber a bucket of a row shard is received straight into its place in the full receive
slot. Only buckets of small pieces (norms, biases) and of column shards go through a bucket-sized
scratch buffer and are scattered from there (``Placer``).
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from weightsync import _wire
from weightsync.transport import layout

LARGE_PIECE_FRACTION = 8  # a piece of at least bucket_bytes / this many bytes gets buckets of its own


def is_dtensor(tensor: object) -> bool:
    return type(tensor).__name__ == "DTensor" and hasattr(tensor, "to_local")


def blocks_of(global_shape: Sequence[int], local_shape: Sequence[int], offset: Sequence[int],
              element_size: int, base: int) -> tuple[tuple[int, int, int, int], ...]:
    """The byte blocks ``(offset, run, count, stride)`` of the box ``local_shape`` at ``offset``
    in a row-major tensor of ``global_shape`` whose bytes start at ``base``."""
    if any(n == 0 for n in local_shape):
        return ()
    if not global_shape:  # a scalar
        return ((base, element_size, 1, element_size),)
    # merge each dimension into the one before it while it is taken whole
    dims: list[list[int]] = []  # [global, local, offset] per merged dimension, outermost first
    for g, n, o in zip(global_shape, local_shape, offset, strict=True):
        if dims and n == g and o == 0:
            prev = dims[-1]
            prev[0], prev[1], prev[2] = prev[0] * g, prev[1] * g, prev[2] * g
        else:
            dims.append([g, n, o])
    # the innermost merged dimension is a run; the one before it strides; any outer ones enumerate
    inner_g, inner_n, inner_o = dims[-1]
    run = inner_n * element_size
    if len(dims) == 1:
        return ((base + inner_o * element_size, run, 1, run),)
    row_g, row_n, row_o = dims[-2]
    stride = inner_g * element_size
    outer = dims[:-2]
    blocks = []
    for index in _indices([d[1] for d in outer]):
        start = 0
        for (g, _n, o), i in zip(outer, index, strict=True):
            start = start * g + o + i
        start = (start * row_g + row_o) * inner_g + inner_o
        blocks.append((base + start * element_size, run, row_n, stride))
    return tuple(blocks)


def _indices(sizes: list[int]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for n in sizes:
        out = [prefix + (i,) for prefix in out for i in range(n)]
    return out


@dataclass
class Split:
    """One rank's share of a version: the global manifest, its lane (pieces) and where they go."""

    manifest: _wire.Manifest  # the full tensors
    items: list[tuple[str, torch.Tensor]]  # this rank's pieces, in lane order (local tensors)
    lane: _wire.Manifest  # their packed layout (no padding)
    pieces: tuple[_wire.Piece, ...]  # per lane tensor: its blocks in the global layout

    @property
    def owned_bytes(self) -> int:
        return self.lane.total_bytes


def split(items: list[tuple[str, Any]], rank: int, world: int, owners: Mapping[str, int] | None = None) -> Split:
    """This rank's pieces of ``items`` (DTensors and plain tensors); raises for what cannot be split."""
    owners = dict(owners or {})
    unknown = sorted(set(owners) - {name for name, _ in items})
    if unknown:
        raise ValueError(f"owners names tensors not in this version: {unknown[:5]}")
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    mine: list[tuple[int, torch.Tensor, tuple[int, ...], tuple[int, ...]]] = []  # (index, local, shape, offset)
    for index, (name, value) in enumerate(items):
        if is_dtensor(value):
            shape, local, offset = _dtensor_share(name, value)
            if name in owners:
                raise ValueError(f"{name!r}: owners is for plain tensors; a DTensor's placements say who sends it")
        else:
            problem = layout._unsendable(value)
            if problem:
                raise TypeError(f"{name!r}: {problem}")
            owner = owners.get(name, 0)
            if not isinstance(owner, int) or not 0 <= owner < world:
                raise ValueError(f"{name!r}: owner {owner!r} is not a rank of {world}")
            shape, local, offset = tuple(value.shape), (value if owner == rank else None), (0,) * value.dim()
        specs.append((name, value.dtype, shape))
        if local is not None and local.numel():
            mine.append((index, local, tuple(local.shape), offset))
    manifest = global_manifest(specs)
    order = sorted(mine, key=lambda m: -m[1].element_size())  # no padding: largest elements first
    lane_items = [(items[index][0], local) for index, local, _, _ in order]
    lane = packed_manifest(lane_items)
    pieces = []
    for index, local, shape, offset in order:
        spec = manifest.tensors[index]
        pieces.append(_wire.Piece(index, blocks_of(spec.shape, shape, offset, local.element_size(), spec.offset)))
    return Split(manifest, lane_items, lane, tuple(pieces))


def _dtensor_share(name: str, value: Any) -> tuple[tuple[int, ...], torch.Tensor | None, tuple[int, ...]]:
    """(global shape, this rank's local shard if it sends it else None, the shard's global offset)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = value.device_mesh, value.placements
    coordinate = mesh.get_coordinate()
    shape = tuple(value.shape)
    if coordinate is None:
        return shape, None, (0,) * len(shape)
    for placement in placements:
        if not (placement.is_shard() or placement.is_replicate()):
            raise ValueError(f"{name!r}: placement {placement} has no bytes to send as it is "
                             "(reduce it first: .redistribute(placements=[Replicate()]) or full_tensor())")
        if placement.is_shard() and type(placement).__name__ != "Shard":
            raise ValueError(f"{name!r}: placement {placement!r} is not supported (plain Shard(d) and Replicate())")
    sender = all(c == 0 for c, p in zip(coordinate, placements, strict=True) if p.is_replicate())
    local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    local = value.to_local()
    if tuple(local.shape) != tuple(local_shape):
        raise ValueError(f"{name!r}: local shard {tuple(local.shape)} is not the {tuple(local_shape)} its placements "
                         "say (padded shards are not supported)")
    return shape, (local if sender else None), tuple(offset)


def global_manifest(specs: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> _wire.Manifest:
    """The full tensors' layout, as a single-rank put of them would pack it."""
    out = []
    offset = 0
    for name, dtype, shape in specs:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        out.append(_wire.TensorSpec(name, layout.dtype_name(dtype), tuple(shape), offset, nbytes))
        offset = layout._aligned(offset + nbytes)
    return _wire.Manifest(tensors=tuple(out), total_bytes=offset)


def packed_manifest(items: list[tuple[str, torch.Tensor]]) -> _wire.Manifest:
    """Back to back, no alignment padding (the items come largest element size first)."""
    out = []
    offset = 0
    for name, tensor in items:
        nbytes = tensor.numel() * tensor.element_size()
        if offset % tensor.element_size():
            raise ValueError(f"{name!r}: lane offset {offset} is not aligned to its element size")
        out.append(_wire.TensorSpec(name, layout.dtype_name(tensor.dtype), tuple(tensor.shape), offset, nbytes))
        offset += nbytes
    return _wire.Manifest(tensors=tuple(out), total_bytes=offset)


def digest(version: int, manifest: _wire.Manifest) -> bytes:
    """What every rank of a put must agree on: the version and the global manifest."""
    return hashlib.sha256(version.to_bytes(8, "little") + _wire.encode(manifest)).digest()[:16]


def bucket_plan(lane: _wire.Manifest, bucket_bytes: int) -> list[tuple[int, int]]:
    """Contiguous ranges covering the lane, at most ``bucket_bytes`` each, breaking at the
    edges of every large piece (so a bucket of it is a slice of that piece alone)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    large = max(bucket_bytes // LARGE_PIECE_FRACTION, 1)
    cuts = {0, lane.total_bytes}
    for spec in lane.tensors:
        if spec.nbytes >= large:
            cuts.update((spec.offset, spec.offset + spec.nbytes))
    edges = sorted(cuts)
    ranges: list[tuple[int, int]] = []
    for lo, hi in zip(edges, edges[1:], strict=False):
        ranges.extend((a, min(a + bucket_bytes, hi)) for a in range(lo, hi, bucket_bytes))
    return ranges


class Placer:
    """A subscriber's receive targets for one lane of one version: per bucket, a view of the
    full slot (a slice of one contiguous piece) or one of two scratch buffers, scattered into
    the full slot as soon as the bucket arrived (``place``), before the next one reuses it."""

    def __init__(self, full: torch.Tensor, lane: _wire.Manifest, pieces: Sequence[_wire.Piece],
                 ranges: list[tuple[int, int]]) -> None:
        if len(pieces) != len(lane.tensors):
            raise ValueError(f"{len(pieces)} placements for {len(lane.tensors)} lane tensors")
        self._full, self._lane, self._pieces, self._ranges = full, lane, pieces, ranges
        self.targets: list[torch.Tensor] = []
        self.scattered: list[bool] = []
        total = full.numel()
        for spec, piece in zip(lane.tensors, pieces, strict=True):
            covered = sum(run * count for _o, run, count, _s in piece.blocks)
            if covered != spec.nbytes:
                raise ValueError(f"{spec.name!r}: placement covers {covered} bytes of its {spec.nbytes}")
            for offset, run, count, stride in piece.blocks:
                if offset < 0 or run < 0 or count < 1 or offset + (count - 1) * stride + run > total:
                    raise ValueError(f"{spec.name!r}: a block lies outside the {total}-byte full layout")
        direct = [self._direct(lo, hi) for lo, hi in ranges]
        # scattered buckets take turns in two scratch buffers: bucket i+1 arrives while i is placed
        size = max((hi - lo for (lo, hi), d in zip(ranges, direct, strict=True) if d is None), default=0)
        scratch = [torch.empty(size, dtype=torch.uint8, device=full.device) for _ in range(2)] if size else []
        turn = 0
        for (lo, hi), view in zip(ranges, direct, strict=True):
            self.scattered.append(view is None)
            if view is None:
                view, turn = scratch[turn % 2][: hi - lo], turn + 1
            self.targets.append(view)

    def _direct(self, lo: int, hi: int) -> torch.Tensor | None:
        for spec, piece in zip(self._lane.tensors, self._pieces, strict=True):
            if spec.offset <= lo and hi <= spec.offset + spec.nbytes:
                if len(piece.blocks) == 1 and piece.blocks[0][2] == 1:
                    start = piece.blocks[0][0] + lo - spec.offset
                    return self._full[start : start + hi - lo]
                return None
        return None

    def place(self, i: int) -> None:
        """Bucket ``i`` has arrived: scatter it into the full slot (nothing to do for a view)."""
        if not self.scattered[i]:
            return
        lo, hi = self._ranges[i]
        src = self.targets[i]
        for spec, piece in zip(self._lane.tensors, self._pieces, strict=True):
            a, b = max(lo, spec.offset), min(hi, spec.offset + spec.nbytes)
            if a < b:
                _scatter(self._full, piece.blocks, a - spec.offset, b - spec.offset, src[a - lo : b - lo])


def _scatter(full: torch.Tensor, blocks: Sequence[tuple[int, int, int, int]], a: int, b: int,
             src: torch.Tensor) -> None:
    """Copy a piece's lane bytes ``[a, b)`` (given in ``src``) to their places in ``full``."""
    base = 0  # the piece's lane offset of the current block
    for offset, run, count, stride in blocks:
        size = run * count
        lo, hi = max(a, base), min(b, base + size)
        while lo < hi:
            row, col = divmod(lo - base, run)
            if col == 0 and hi - lo >= run:  # whole rows at once
                rows = (hi - lo) // run
                dst = full.as_strided((rows, run), (stride, 1), offset + row * stride)
                dst.copy_(src[lo - a : lo - a + rows * run].view(rows, run))
                lo += rows * run
                continue
            n = min(run - col, hi - lo)
            start = offset + row * stride + col
            full[start : start + n].copy_(src[lo - a : lo - a + n])
            lo += n
        base += size



def local_box(value: Any) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """A DTensor destination's local tensor and the box of the full tensor it holds."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for placement in value.placements:
        if not (placement.is_shard() or placement.is_replicate()):
            raise ValueError(f"placement {placement} cannot be written from full tensors")
    if value.device_mesh.get_coordinate() is None:
        return value.to_local(), ()
    shape, offset = compute_local_shape_and_global_offset(tuple(value.shape), value.device_mesh, value.placements)
    return value.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


# sliced members ------------------------------------------------------------------------------
# A sliced member (a tensor-parallel generator rank) names the boxes it wants (``_wire.Want``);
# each trainer rank then sends it, point to point in its own group, only the bytes of its
# buckets that fall in those boxes: a *route* per bucket, ``(offset in the bucket, offset in
# the member's slot, bytes)`` runs in bucket order. The member's slot packs its boxes in the
# full manifest's order (``sliced_manifest``); both ends compute the same routes.

Run = tuple[int, int, int]  # (offset in the bucket, offset in the member's slot, bytes)


def wants_of(dest: Mapping[str, Any]) -> tuple[_wire.Want, ...]:
    """What a generator holding ``dest`` receives: each DTensor's local box (nothing where this
    rank is not in its mesh), each plain tensor whole."""
    if not isinstance(dest, Mapping) or not dest:
        raise ValueError("want must be a non-empty mapping of names to tensors or DTensors (the engine's own)")
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
            out.append(_wire.Want(name, tuple(int(o) for o in offset), tuple(int(n) for n in shape)))
        elif isinstance(value, torch.Tensor):
            out.append(_wire.Want(name, (0,) * value.dim(), tuple(value.shape)))
        else:
            raise TypeError(f"{name!r}: want's values must be tensors or DTensors, got {type(value).__name__}")
    return tuple(out)


def sliced_manifest(full: _wire.Manifest, wants: Sequence[_wire.Want]) -> _wire.Manifest:
    """A sliced member's slot layout: its boxes of ``full``'s tensors, packed in ``full``'s order.
    Raises ValueError for a box that does not fit its tensor; names ``full`` lacks are left out."""
    boxes: dict[str, _wire.Want] = {}
    for want in wants:
        if want.name in boxes:
            raise ValueError(f"{want.name!r} is wanted twice")
        boxes[want.name] = want
    specs = []
    for spec in full.tensors:
        box = boxes.get(spec.name)
        if box is None:
            continue
        want = box
        if len(want.offset) != len(spec.shape) or len(want.shape) != len(spec.shape) or any(
                o < 0 or n < 0 or o + n > g for o, n, g in zip(want.offset, want.shape, spec.shape, strict=True)):
            raise ValueError(f"{spec.name!r}: the wanted box {tuple(want.shape)} at {tuple(want.offset)} does not "
                             f"fit the published shape {tuple(spec.shape)}")
        specs.append((spec.name, layout.dtype_from_name(spec.dtype), tuple(want.shape)))
    return global_manifest(specs)


def _runs(blocks: Sequence[tuple[int, int, int, int]]) -> list[tuple[int, int]]:
    """A block list as ``(start, bytes)`` runs in ascending order."""
    return [(offset + k * stride, run) for offset, run, count, stride in blocks for k in range(count)]


def routes(source: _wire.Manifest, pieces: Sequence[_wire.Piece] | None, full: _wire.Manifest,
           wants: Sequence[_wire.Want], ranges: Sequence[tuple[int, int]]) -> list[list[Run]]:
    """Per bucket (``ranges`` of ``source``, the sender's packed layout), the runs a sliced member
    wanting ``wants`` of ``full`` gets. ``pieces``: where ``source``'s tensors lie in ``full`` (a
    sharded lane); None when ``source`` is ``full`` itself. Raises ValueError where a box does not fit."""
    mine = sliced_manifest(full, wants)
    index = {spec.name: i for i, spec in enumerate(full.tensors)}
    boxes = {want.name: want for want in wants}
    # per full tensor: the wanted bytes as (global start, global end, slot offset), ascending
    wanted: dict[int, list[tuple[int, int, int]]] = {}
    for spec in mine.tensors:
        whole = full.tensors[index[spec.name]]
        want = boxes[spec.name]
        size = layout.dtype_from_name(whole.dtype).itemsize
        at, spans = spec.offset, []
        for start, n in _runs(blocks_of(whole.shape, want.shape, want.offset, size, whole.offset)):
            spans.append((start, start + n, at))
            at += n
        wanted[index[spec.name]] = spans
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

    def place(self, i: int) -> None:
        """Bucket ``i``'s share arrived: scatter it into the slot (nothing to do for a view)."""
        runs = self._plan[i]
        if len(runs) < 2:
            return
        src, at = self.targets[i], 0
        for _s, dst, n in runs:
            self._slot[dst : dst + n].copy_(src[at : at + n])
            at += n
