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

from collections.abc import Iterable, Mapping
from typing import Union

import torch

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


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def as_items(tensors: TensorsLike) -> list[tuple[str, torch.Tensor]]:
    """Normalise a mapping or an iterable of pairs, checking names and types."""
    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    seen: set[str] = set()
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise TypeError(f"expected (name, tensor) pairs, got {type(item).__name__}")
        name, tensor = item
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {type(name).__name__}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        if tensor.is_sparse or tensor.layout != torch.strided:
            raise TypeError(f"{name!r}: only strided (dense) tensors can be sent")
        if name in seen:
            raise ValueError(f"duplicate tensor name {name!r}")
        seen.add(name)
    return items


def build_manifest(items: list[tuple[str, torch.Tensor]]) -> Manifest:
    """Lay the tensors out in order, each at a 64-byte aligned offset."""
    specs = []
    offset = 0
    for name, tensor in items:
        nbytes = tensor.numel() * tensor.element_size()
        specs.append(TensorSpec(name, dtype_name(tensor.dtype), tuple(tensor.shape), offset, nbytes))
        offset = _aligned(offset + nbytes)
    return Manifest(tensors=tuple(specs), total_bytes=offset)


def bucket_ranges(total_bytes: int, bucket_bytes: int) -> list[tuple[int, int]]:
    """Contiguous ``[lo, hi)`` ranges of at most ``bucket_bytes`` covering the layout."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    return [(lo, min(lo + bucket_bytes, total_bytes)) for lo in range(0, total_bytes, bucket_bytes)]


def tensor_view(flat: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """The tensor of ``spec`` as a view into the flat uint8 buffer (no copy)."""
    return flat[spec.offset : spec.offset + spec.nbytes].view(dtype_from_name(spec.dtype)).view(spec.shape)


def views(flat: torch.Tensor, manifest: Manifest) -> dict[str, torch.Tensor]:
    return {spec.name: tensor_view(flat, spec) for spec in manifest.tensors}


def pack_into(flat: torch.Tensor, manifest: Manifest, items: list[tuple[str, torch.Tensor]]) -> None:
    """Copy every tensor into its range of ``flat`` (strided sources are fine)."""
    for spec, (_, tensor) in zip(manifest.tensors, items, strict=True):
        if spec.nbytes:
            tensor_view(flat, spec).copy_(tensor, non_blocking=True)


def pack_range(
    out: torch.Tensor, lo: int, hi: int, manifest: Manifest, items: list[tuple[str, torch.Tensor]]
) -> None:
    """Copy the bytes of layout range ``[lo, hi)`` from the source tensors into ``out[: hi - lo]``.

    Used when there is no full snapshot (``copy=False``): two bucket buffers take turns.
    The alignment padding between tensors is left as it is: nobody reads it (a snapshot's
    padding is uninitialised memory too), and zeroing it would add a pass over every byte.
    """
    for spec, (_, tensor) in zip(manifest.tensors, items, strict=True):
        a, b = max(lo, spec.offset), min(hi, spec.offset + spec.nbytes)
        if a >= b:
            continue
        src = tensor if tensor.is_contiguous() else tensor.contiguous()
        src_bytes = src.reshape(-1).view(torch.uint8)
        out[a - lo : b - lo].copy_(src_bytes[a - spec.offset : b - spec.offset], non_blocking=True)


def check_destination(manifest: Manifest, dest: Mapping[str, torch.Tensor]) -> None:
    """Raise ManifestMismatch naming every difference between ``manifest`` and ``dest``."""
    problems = []
    wanted = {spec.name: spec for spec in manifest.tensors}
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
    if problems:
        raise ManifestMismatch("; ".join(problems[:8]))


