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

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from weightsync import _wire
from weightsync.format import layout

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


def split(items: list[tuple[str, Any]], rank: int, world: int, owners: Mapping[str, int] | None = None,
          wire: Mapping[str, torch.dtype] | None = None) -> Split:
    """This rank's pieces of ``items`` (DTensors and plain tensors), each in its ``wire`` dtype where
    ``put(dtype=)`` casts it; raises for what cannot be split."""
    owners = dict(owners or {})
    wire = dict(wire or {})
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
        specs.append((name, wire.get(name, value.dtype), shape))
        if local is not None and local.numel():
            mine.append((index, local, tuple(local.shape), offset))
    manifest = global_manifest(specs)
    size = {name: _element_size(wire.get(name, value.dtype)) for name, value in items}
    order = sorted(mine, key=lambda m: -size[items[m[0]][0]])  # no padding: largest elements first
    lane_items = [(items[index][0], local) for index, local, _, _ in order]
    lane = packed_manifest(lane_items, wire)
    pieces = []
    for index, _local, shape, offset in order:
        spec = manifest.tensors[index]
        pieces.append(_wire.Piece(index, blocks_of(spec.shape, shape, offset, size[spec.name], spec.offset)))
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


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def packed_manifest(items: list[tuple[str, torch.Tensor]], wire: Mapping[str, torch.dtype] | None = None
                    ) -> _wire.Manifest:
    """Back to back, no alignment padding (the items come largest element size first), each in
    its ``wire`` dtype where it is cast."""
    out = []
    offset = 0
    wire = wire or {}
    for name, tensor in items:
        dtype = wire.get(name, tensor.dtype)
        size = _element_size(dtype)
        nbytes = tensor.numel() * size
        if offset % size:
            raise ValueError(f"{name!r}: lane offset {offset} is not aligned to its element size")
        out.append(_wire.TensorSpec(name, layout.dtype_name(dtype), tuple(tensor.shape), offset, nbytes))
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


    def gather(self, i: int, other: torch.Tensor) -> torch.Tensor:
        """Bucket ``i``'s lane bytes as they lie in ``other``, another full version in the same
        layout (a member's readable one: what a lane's delta is against). A view where bucket i
        lies in one run of the full layout, else a copy."""
        lo, hi = self._ranges[i]
        if not self.scattered[i]:
            target = self.targets[i]
            start = target.storage_offset() - self._full.storage_offset()
            return other[start : start + hi - lo]
        out = torch.empty(hi - lo, dtype=torch.uint8, device=other.device)
        for spec, piece in zip(self._lane.tensors, self._pieces, strict=True):
            a, b = max(lo, spec.offset), min(hi, spec.offset + spec.nbytes)
            if a < b:
                _scatter(other, piece.blocks, a - spec.offset, b - spec.offset, out[a - lo : b - lo], gather=True)
        return out


def _scatter(full: torch.Tensor, blocks: Sequence[tuple[int, int, int, int]], a: int, b: int,
             src: torch.Tensor, gather: bool = False) -> None:
    """Copy a piece's lane bytes ``[a, b)`` (given in ``src``) to their places in ``full``;
    ``gather``: the other way, from their places in ``full`` into ``src``."""
    base = 0  # the piece's lane offset of the current block
    for offset, run, count, stride in blocks:
        size = run * count
        lo, hi = max(a, base), min(b, base + size)
        while lo < hi:
            row, col = divmod(lo - base, run)
            if col == 0 and hi - lo >= run:  # whole rows at once
                rows = (hi - lo) // run
                placed = full.as_strided((rows, run), (stride, 1), offset + row * stride)
                lane = src[lo - a : lo - a + rows * run].view(rows, run)
                _move(placed, lane, gather)
                lo += rows * run
                continue
            n = min(run - col, hi - lo)
            start = offset + row * stride + col
            placed, lane = full[start : start + n], src[lo - a : lo - a + n]
            _move(placed, lane, gather)
            lo += n
        base += size



def _move(placed: torch.Tensor, lane: torch.Tensor, gather: bool) -> None:
    if gather:
        lane.copy_(placed)
    else:
        placed.copy_(lane)


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
