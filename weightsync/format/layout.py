"""Packed layout: how a state dict becomes one flat byte buffer, and buckets of it.

Every tensor gets a 64-byte aligned range of a flat ``uint8`` buffer, so any dtype can be
viewed in place (``flat[a:b].view(dtype).view(shape)``) on either side. Buckets are plain
contiguous byte ranges of that buffer; a tensor may span buckets. This lets both ends move
data with no extra copy: the publisher broadcasts slices of its snapshot, the subscriber
receives straight into slices of its receive slot.

The rejected alternative, one broadcast per tensor, costs a collective per tensor (thousands
for an LLM) and cannot be pipelined; packing per bucket (vLLM style) costs a second copy.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Union

import torch

from weightsync import _wire
from weightsync._wire import Manifest, TensorSpec
from weightsync.errors import ManifestMismatch

ALIGN = 64
TensorsLike = Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]


def dtype_from_name(name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``; raises ManifestMismatch for unknown names."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ManifestMismatch(f"unknown dtype {name!r} (this torch has no such dtype)")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN and no infinity in ``tensor`` (floating). One read: a sum holds NaN or infinity when
    an element does (in float64 no sum of float32 or narrower elements overflows); only a sum that
    is not finite is checked element by element."""
    return not tensor.numel() or math.isfinite(tensor.sum(dtype=torch.float64)) or bool(torch.isfinite(tensor).all())


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


MAX_NAME = 4096  # bytes of a tensor name
MAX_MANIFEST_TENSORS = 1 << 20


def as_items(tensors: TensorsLike, *, sharded: bool = False) -> list[tuple[str, torch.Tensor]]:
    """Normalise a mapping or an iterable of pairs, refusing at the door what cannot be sent.

    TypeError/ValueError name the tensor: not a tensor, a DTensor on a mesh of several ranks
    (unless ``sharded``: a sharded publisher splits those), sparse or other non-strided layouts,
    meta tensors (no data), quantized or nested tensors, conjugate or negative-bit views
    (``resolve_conj()``/``resolve_neg()`` them first), names that are not str, too long, or repeated.
    """
    if isinstance(tensors, (str, bytes, torch.Tensor)) or not isinstance(tensors, (Mapping, Iterable)):
        raise TypeError(f"tensors must be a Mapping[str, Tensor] (a state_dict) or (name, tensor) pairs, "
                        f"got {type(tensors).__name__}")
    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    if len(items) > MAX_MANIFEST_TENSORS:
        raise ValueError(f"{len(items)} tensors in one version: at most {MAX_MANIFEST_TENSORS}")
    seen: set[str] = set()
    for index, item in enumerate(items):
        if not (isinstance(item, tuple) and len(item) == 2):
            raise TypeError(f"expected (name, tensor) pairs, got {type(item).__name__}")
        name, tensor = item
        if not sharded and type(tensor).__name__ == "DTensor" and tensor.device_mesh.size() == 1:
            tensor = tensor.to_local()  # a one-rank mesh: the local tensor is the whole one
            items[index] = (name, tensor)
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {type(name).__name__}")
        if len(name.encode()) > MAX_NAME:
            raise ValueError(f"tensor name {name[:40]!r}... is {len(name.encode())} bytes: at most {MAX_NAME}")
        problem = "" if sharded and type(tensor).__name__ == "DTensor" else _unsendable(tensor)
        if problem:
            raise TypeError(f"{name!r}: {problem}")
        if name in seen:
            raise ValueError(f"duplicate tensor name {name!r}")
        seen.add(name)
    return items


def _unsendable(tensor: object) -> str:
    """Why ``tensor`` cannot be put as it is, or "" when it can."""
    if not isinstance(tensor, torch.Tensor):
        return f"a {type(tensor).__name__}, not a torch.Tensor"
    if type(tensor).__name__ == "DTensor":
        return ("a DTensor: give every trainer rank a Publisher with rank= and world_size= (docs/sharding.md), "
                "or put tensor.full_tensor()")
    if tensor.is_sparse or tensor.layout != torch.strided:
        return f"layout {tensor.layout}: only strided (dense) tensors can be sent"
    if tensor.is_meta:
        return "a meta tensor has no data to send"
    if tensor.is_quantized:
        return "quantized tensors cannot be sent; dequantize() it or send its int_repr() and scales"
    if tensor.is_nested:
        return "nested tensors cannot be sent; send their components"
    if tensor.is_conj():
        return "a conjugate view: send tensor.resolve_conj()"
    if tensor.is_neg():
        return "a negative-bit view: send tensor.resolve_neg()"
    if tensor.numel():
        steps = zip(tensor.shape, tensor.stride(), strict=True)
        extent = tensor.storage_offset() + sum((n - 1) * st for n, st in steps)
        if (extent + 1) * tensor.element_size() > tensor.untyped_storage().nbytes():
            return "its storage is smaller than its shape needs (freed or resized?)"
    return ""


CastLike = Union[torch.dtype, Mapping[str, torch.dtype], None]


def wire_dtypes(items: list[tuple[str, torch.Tensor]], dtype: CastLike) -> dict[str, torch.dtype]:
    """The tensors ``put(..., dtype=)`` casts, name -> the dtype they are sent (and held) in.

    ``dtype`` is one floating dtype for every floating-point tensor (integer and bool tensors keep
    theirs: a step counter stays exact), or a mapping naming the tensors to cast. Only tensors whose
    dtype differs are listed. TypeError / ValueError name what is wrong.
    """
    if dtype is None:
        return {}
    if isinstance(dtype, torch.dtype):
        target = _cast_target(dtype, "dtype")
        return {name: target for name, t in items if t.dtype.is_floating_point and t.dtype != target}
    if not isinstance(dtype, Mapping):
        raise TypeError(f"dtype must be a torch.dtype or a mapping of names to dtypes, got {type(dtype).__name__}")
    dtypes = {name: t.dtype for name, t in items}
    unknown = sorted(set(dtype) - set(dtypes))
    if unknown:
        raise ValueError(f"dtype names tensors not in this version: {unknown[:5]}")
    out = {}
    for name, want in dtype.items():
        target = _cast_target(want, f"dtype[{name!r}]")
        if not dtypes[name].is_floating_point:
            raise ValueError(f"dtype[{name!r}]: {dtypes[name]} is not a floating-point tensor; only those are cast")
        if dtypes[name] != target:
            out[name] = target
    return out


def _cast_target(dtype: object, what: str) -> torch.dtype:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{what} must be a torch.dtype, got {type(dtype).__name__}")
    if not dtype.is_floating_point:
        raise ValueError(f"{what}: a cast is to a floating-point dtype (torch.bfloat16, torch.float16, ...), "
                         f"not {dtype}")
    return dtype


def untie(items: list[tuple[str, torch.Tensor]]) -> tuple[list[tuple[str, torch.Tensor]], tuple[tuple[str, str], ...]]:
    """Tensors that are the same memory under two names (tied weights) are sent once.

    Returns the items with every repeat left out, and ``(name, source)`` for each repeat: the
    same device, dtype, address, shape and strides as an earlier item. Overlapping but
    different views are not ties: they are sent as they are.
    """
    first: dict[tuple[object, ...], str] = {}
    kept: list[tuple[str, torch.Tensor]] = []
    ties: list[tuple[str, str]] = []
    for name, tensor in items:
        if tensor.numel():
            key = (tensor.device, tensor.dtype, tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
            source = first.setdefault(key, name)
            if source != name:
                ties.append((name, source))
                continue
        kept.append((name, tensor))
    return kept, tuple(ties)


def build_manifest(items: list[tuple[str, torch.Tensor]], ties: tuple[tuple[str, str], ...] = (),
                   wire: Mapping[str, torch.dtype] | None = None) -> Manifest:
    """Lay the tensors out in order, each at a 64-byte aligned offset (``ties``: see :func:`untie`),
    each in its ``wire`` dtype where it is cast (:func:`wire_dtypes`)."""
    specs = []
    offset = 0
    wire = wire or {}
    for name, tensor in items:
        dtype = wire.get(name, tensor.dtype)
        nbytes = tensor.numel() * _element_size(dtype)
        specs.append(TensorSpec(name, dtype_name(dtype), tuple(tensor.shape), offset, nbytes))
        offset = _aligned(offset + nbytes)
    return Manifest(tensors=tuple(specs), total_bytes=offset, ties=ties)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def bucket_ranges(total_bytes: int, bucket_bytes: int) -> list[tuple[int, int]]:
    """Contiguous ``[lo, hi)`` ranges of at most ``bucket_bytes`` covering the layout."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    return [(lo, min(lo + bucket_bytes, total_bytes)) for lo in range(0, total_bytes, bucket_bytes)]


def tensor_view(flat: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """The tensor of ``spec`` as a view into the flat uint8 buffer (no copy)."""
    return flat[spec.offset : spec.offset + spec.nbytes].view(dtype_from_name(spec.dtype)).view(spec.shape)


def views(flat: torch.Tensor, manifest: Manifest) -> dict[str, torch.Tensor]:
    """Every tensor of the version as a view of ``flat``; a tied name is the same view as its source."""
    out = {spec.name: tensor_view(flat, spec) for spec in manifest.tensors}
    for name, source in manifest.ties:
        if source in out:
            out[name] = out[source]
    return out


def spec_map(manifest: Manifest) -> dict[str, TensorSpec]:
    """Name -> spec, tied names included (they share their source's spec)."""
    specs = {spec.name: spec for spec in manifest.tensors}
    for name, source in manifest.ties:
        if source in specs:
            specs[name] = specs[source]
    return specs


Ranges = list[tuple[int, int, int]]  # (destination address, source address, bytes)


def pack_into(flat: torch.Tensor, manifest: Manifest, items: list[tuple[str, torch.Tensor]],
              copy_ranges: Callable[[Ranges], None] | None = None) -> None:
    """Copy every tensor into its range of ``flat`` (strided sources are fine).

    Each source is checked again first: a ``copy=False`` tensor the caller freed or resized
    since ``put`` would be read through a dangling pointer (a crash, not an exception). A tensor
    whose spec has another (floating) dtype is cast in the same pass as the copy.

    With ``copy_ranges``, the plain copies (a contiguous host tensor of the spec's dtype into host
    memory) are handed to it as address ranges once every source is checked, to copy as it
    likes (the publisher's: on several threads at once); the rest are copied here with torch.
    """
    host = flat.device.type == "cpu"
    plain: Ranges = []
    for spec, (name, tensor) in zip(manifest.tensors, items, strict=True):
        problem = _unsendable(tensor)
        if problem or tuple(tensor.shape) != spec.shape or not _same_or_cast(tensor.dtype, spec.dtype):
            raise ValueError(f"{name!r} changed since it was put: {problem or 'its shape or dtype differs'}")
        if not spec.nbytes:
            continue
        if copy_ranges is not None and host and tensor.device.type == "cpu" and tensor.is_contiguous() \
                and dtype_name(tensor.dtype) == spec.dtype:
            plain.append((flat.data_ptr() + spec.offset, tensor.data_ptr(), spec.nbytes))
        else:
            tensor_view(flat, spec).copy_(tensor, non_blocking=True)
    if plain:
        assert copy_ranges is not None
        copy_ranges(plain)


def split_ranges(ranges: Ranges, parts: int) -> list[Ranges]:
    """``ranges`` cut into ``parts`` runs of (nearly) equal bytes, in order; a range may be cut."""
    total = sum(n for _, _, n in ranges)
    share = -(-total // max(parts, 1)) if total else 1
    out: list[Ranges] = [[]]
    room = share
    for dst, src, n in ranges:
        done = 0
        while done < n:
            if room == 0:
                out.append([])
                room = share
            take = min(n - done, room)
            out[-1].append((dst + done, src + done, take))
            done, room = done + take, room - take
    return out


def _same_or_cast(dtype: torch.dtype, wire: str) -> bool:
    """The source's dtype is the spec's, or both are floating (put's ``dtype=`` cast). The copy reads
    the source by its own dtype, so a cast cannot read past its storage."""
    return dtype_name(dtype) == wire or (dtype.is_floating_point and dtype_from_name(wire).is_floating_point)


def pack_range(
    out: torch.Tensor, lo: int, hi: int, manifest: Manifest, items: list[tuple[str, torch.Tensor]]
) -> None:
    """Copy the bytes of layout range ``[lo, hi)`` from the source tensors into ``out[: hi - lo]``.

    Used when there is no full snapshot (``copy=False``): two bucket buffers take turns.
    The alignment padding between tensors is left as it is: nobody reads it (a snapshot's
    padding is uninitialised memory too), and zeroing it would add a pass over every byte.
    """
    for spec, (name, tensor) in zip(manifest.tensors, items, strict=True):
        a, b = max(lo, spec.offset), min(hi, spec.offset + spec.nbytes)
        if a >= b:
            continue
        src = tensor if tensor.is_contiguous() else tensor.contiguous()
        if dtype_name(src.dtype) != spec.dtype:  # put(dtype=): cast the elements this range covers
            if not _same_or_cast(src.dtype, spec.dtype):
                raise ValueError(f"{name!r} changed since it was put: its dtype differs")
            wire = dtype_from_name(spec.dtype)
            size = _element_size(wire)
            first, last = (a - spec.offset) // size, -(-(b - spec.offset) // size)
            part = src.reshape(-1)[first:last].to(wire).view(torch.uint8)
            skip = a - spec.offset - first * size
            out[a - lo : b - lo].copy_(part[skip : skip + b - a], non_blocking=True)
            continue
        src_bytes = src.reshape(-1).view(torch.uint8)
        out[a - lo : b - lo].copy_(src_bytes[a - spec.offset : b - spec.offset], non_blocking=True)


def write_ties(flat: torch.Tensor, manifest: Manifest, dest: Mapping[str, torch.Tensor]) -> None:
    """Write each tied name of ``manifest`` into ``dest`` from ``flat``, unless ``dest`` ties it to
    its source too (then writing the source wrote it)."""
    specs = spec_map(manifest) if manifest.ties else {}
    for name, source in manifest.ties:
        if specs[name].nbytes and dest[name].data_ptr() != dest[source].data_ptr():
            dest[name].copy_(tensor_view(flat, specs[name]))


def check_destination(manifest: Manifest, dest: Mapping[str, torch.Tensor]) -> None:
    """Raise ManifestMismatch naming every difference between ``manifest`` and ``dest``.

    Everything is checked before anything is written, writability too (inference tensors,
    meta tensors, expanded views), so a refused ``get_into`` leaves ``dest`` untouched.
    """
    problems = []
    wanted = spec_map(manifest)
    missing = sorted(set(wanted) - set(dest))
    extra = sorted(set(dest) - set(wanted))
    if missing:
        problems.append(f"missing in destination: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if extra:
        problems.append(f"not in the published version: {extra[:5]}{' ...' if len(extra) > 5 else ''}")
    for name, spec in wanted.items():
        tensor = dest.get(name)
        if tensor is None:
            continue
        if dtype_name(tensor.dtype) != spec.dtype:
            problems.append(f"{name}: dtype {dtype_name(tensor.dtype)} != published {spec.dtype}")
        elif tuple(tensor.shape) != spec.shape:
            problems.append(f"{name}: shape {tuple(tensor.shape)} != published {spec.shape}")
        elif type(tensor).__name__ == "DTensor":  # written shard by shard: its own box of the full tensor
            bad = [p for p in getattr(tensor, "placements", ()) if not (p.is_shard() or p.is_replicate())]
            if bad:
                problems.append(f"{name}: placement {bad[0]} cannot be written from the full tensor")
        elif tensor.is_inference() and not torch.is_inference_mode_enabled():
            problems.append(f"{name}: an inference tensor cannot be written outside inference mode")
        elif tensor.is_meta or not tensor.is_contiguous() and tensor.stride() and 0 in tensor.stride() \
                and tensor.numel() > 1:
            problems.append(f"{name}: not writable in place (a meta tensor, or an expanded view)")
    if problems:
        raise ManifestMismatch("; ".join(problems[:8]))




def untied_manifest(items: list[tuple[str, torch.Tensor]],
                    wire: Mapping[str, torch.dtype] | None = None) -> tuple[list[tuple[str, torch.Tensor]], Manifest]:
    """A version's items with tied tensors (one tensor under two names) sent once, and its manifest."""
    untied, ties = untie(items)
    return untied, build_manifest(untied, ties, wire)


def check_encoded_size(manifest: Manifest, assembly: object, limit: int) -> None:
    """ValueError when the Announce's manifest (and a lane's assembly) would not fit a control frame."""
    if len(_wire.encode(manifest)) + len(_wire.encode(assembly)) > limit:
        raise ValueError(f"the manifest of {len(manifest.tensors)} tensors is over {limit} bytes encoded: "
                         "shorter names, or fewer tensors per channel")


#: element size -> the dtype its bits compare as (a delta compares bits, never floats)
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class Segment:
    lo: int  # byte offsets within the bucket
    hi: int
    size: int  # element size in bytes: the unit compared


@functools.lru_cache(maxsize=64)
def _tensor_ranges(manifest: Manifest) -> tuple[tuple[int, int, int], ...]:
    out = []
    for spec in manifest.tensors:
        if spec.nbytes:
            size = dtype_from_name(spec.dtype).itemsize
            out.append((spec.offset, spec.offset + spec.nbytes, size if size in BITS else 1))
    return tuple(sorted(out))


@functools.lru_cache(maxsize=4096)
def segments(manifest: Manifest, lo: int, hi: int) -> tuple[Segment, ...]:
    """Bucket ``[lo, hi)`` of ``manifest``'s layout cut at tensor boundaries (offsets within it)."""
    out: list[Segment] = []
    at = lo
    for start, end, size in _tensor_ranges(manifest):
        if end <= lo or start >= hi:
            continue
        a, b = max(start, lo), min(end, hi)
        if a > at:
            out.append(Segment(at - lo, a - lo, 1))
        whole = (a - start) % size == 0 and (b - a) % size == 0
        out.append(Segment(a - lo, b - lo, size if whole else 1))
        at = b
    if at < hi:
        out.append(Segment(at - lo, hi - lo, 1))
    return tuple(out)
