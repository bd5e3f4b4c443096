"""Quantized versions: a version's linear weights in an engine's checkpoint format, made where they are.

``put(..., quantize=NAME)`` sends what a quantized checkpoint in format ``NAME`` would hold: each
quantized weight as its quantized tensor under its own name and its scales beside it, every other
tensor as it was (cast by ``dtype=`` as usual). It is done on the tensors' own device, before the
snapshot, so the staging buffers, the wire, every member's slot, a delta (against the last
quantized version) and the digests all hold the quantized bytes. The formats:

``"fp8-block"``
    Block fp8, as DeepSeek-V3 and the Qwen3 FP8 checkpoints store it (``quant_method: fp8``,
    ``weight_block_size: [128, 128]``): ``W.weight`` in ``float8_e4m3fn`` and ``W.weight_scale_inv``
    (``float32``, one per 128x128 block, ``ceil(rows / 128) x ceil(cols / 128)``): the block's
    largest magnitude (at least 1e-4) over 448, and ``weight = weight_scale_inv * fp8``. The bytes
    are those of vLLM's ``per_block_cast_to_fp8`` (DeepGEMM's reference quantizer), the same
    operations in the same order.
``"int8-channel"``
    compressed-tensors W8A8 int8 (``format: int-quantized``; weights symmetric per output channel,
    activations quantized per token by the engine): ``W.weight`` in ``int8`` and ``W.weight_scale``
    (``[rows, 1]`` in the weight's dtype): the row's largest magnitude over 127.5 (the smallest
    positive normal value where a row is all zero), ``weight = round(w / scale)`` clamped to
    [-128, 127]. The bytes are those of compressed-tensors' ``calculate_qparams`` and ``quantize``
    (what llm-compressor writes).

Which tensors: the weights of linear layers, every 2-D floating ``*.weight`` except the
embeddings (``embed``), the LM head (``lm_head``) and MoE routers (``mlp.gate.weight``,
``shared_expert_gate.weight``), which both formats keep as the model has them. A weight holding
NaN or infinity is refused (no scale represents it), naming the tensor, before anything is sent.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.format.layout import CastLike, TensorsLike, all_finite, as_items

#: the names of 2-D weights both formats keep unquantized (substrings of the name)
KEPT = ("embed", "lm_head", "mlp.gate.weight", "shared_expert_gate.weight")
BLOCK = 128
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
FP8_LEAST_AMAX = 1e-4  # per_block_cast_to_fp8's floor on a block's largest magnitude


STRIPE_BYTES = 2 << 20  # rows are quantized a stripe of about this many bytes at a time, in cache


def _stripe_rows(cols: int, itemsize: int, multiple: int = 1) -> int:
    """Rows per stripe: about STRIPE_BYTES of the weight, a multiple of ``multiple``."""
    return max(1, STRIPE_BYTES // max(cols * itemsize * multiple, 1)) * multiple


def _fp8_amax(frame: torch.Tensor) -> torch.Tensor:
    """The largest magnitude of each 128x128 block of a block-aligned ``frame`` (zeros beyond the
    weight), ``[block rows, 1, block columns, 1]`` in float32 (taken in the weight's dtype first:
    both exact)."""
    blocks = frame.view(-1, BLOCK, frame.size(1) // BLOCK, BLOCK)
    return blocks.abs().amax(dim=(1, 3), keepdim=True).float()


def _fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """Each block's scale from its largest magnitude: at least 1e-4, over 448."""
    return amax.clamp(FP8_LEAST_AMAX) / FP8_MAX


def _fp8_values(frame: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``frame`` (block-aligned) in e4m3 with its blocks' scales ``[block rows, 1, block columns,
    1]``: vLLM's ``per_block_cast_to_fp8`` operations, each element times its block's reciprocal."""
    blocks = frame.view(-1, BLOCK, frame.size(1) // BLOCK, BLOCK)
    return blocks.mul(1.0 / scale).to(torch.float8_e4m3fn).view_as(frame)


def _int8_scale(magnitude: torch.Tensor) -> torch.Tensor:
    """Each row's scale from its largest magnitude (``[rows, 1]``, in the weight's dtype): over
    127.5, the dtype's epsilon for a row of zeros (compressed-tensors' ``calculate_qparams``)."""
    scale = magnitude / (255 / 2)
    eps = torch.tensor(torch.finfo(scale.dtype).eps, dtype=scale.dtype, device=scale.device)
    return torch.where(scale == 0, eps, scale)


def _int8_values(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Rows ``x`` over their scales, clamped to [-128, 127], rounded (compressed-tensors'
    ``quantize``), still in ``x``'s dtype: the caller casts."""
    return (x / scale).clamp_(-128, 127).round_()


def _fp8_block(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per 128x128 block (zeros beyond the edges): its largest magnitude, at least 1e-4, over 448
    is its scale; the block times its reciprocal, cast to e4m3. A stripe of whole block rows at a
    time, each element through the same operations as vLLM's ``per_block_cast_to_fp8`` on the
    padded weight (the largest magnitude taken before the cast to float32: both exact)."""
    rows, cols = w.shape
    w = w.contiguous()
    grid_rows, grid_cols = -(-rows // BLOCK), -(-cols // BLOCK)
    width = grid_cols * BLOCK
    q = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty((grid_rows, grid_cols), dtype=torch.float32, device=w.device)
    step = _stripe_rows(width, w.element_size(), BLOCK)
    frame = torch.zeros((min(step, grid_rows * BLOCK), width), dtype=w.dtype, device=w.device) \
        if cols % BLOCK or rows % BLOCK else None
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        high = -(-hi // BLOCK) * BLOCK  # the stripe's rows, up to its last block's edge
        if frame is None:
            part = w[lo:hi]
        else:
            part = frame[:high - lo]
            part[hi - lo:].zero_()
            part[:hi - lo, :cols] = w[lo:hi]
            part[:hi - lo, cols:].zero_()
        s = _fp8_scale(_fp8_amax(part))
        q[lo:hi] = _fp8_values(part, s)[:hi - lo, :cols]
        scale[lo // BLOCK:high // BLOCK] = s.view(-1, grid_cols)
    return {"weight": q, "weight_scale_inv": scale}


def _int8_channel(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per row: the larger of its most negative and most positive element's magnitudes (0 taken
    into both), over 127.5, in the weight's dtype (its dtype's epsilon for a row of zeros); the
    row over it, clamped to [-128, 127], rounded. A stripe of rows at a time, each element
    through compressed-tensors' operations."""
    rows, cols = w.shape
    q = torch.empty((rows, cols), dtype=torch.int8, device=w.device)
    scale = torch.empty((rows, 1), dtype=w.dtype, device=w.device)
    step = _stripe_rows(cols, w.element_size())
    zero = torch.zeros((min(step, rows), 1), dtype=w.dtype, device=w.device)
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        x, z = w[lo:hi], zero[:hi - lo]
        smallest, largest = torch.aminmax(x, dim=1, keepdim=True)  # one read; 0 taken into both, as theirs
        s = _int8_scale(torch.max(torch.min(smallest, z).abs(), torch.max(largest, z).abs()))
        q[lo:hi], scale[lo:hi] = _int8_values(x, s), s
    return {"weight": q, "weight_scale": scale}


@dataclass(frozen=True)
class Format:
    name: str
    make: Callable[[torch.Tensor], dict[str, torch.Tensor]]
    #: what a checkpoint of this format declares (its config.json's ``quantization_config``)
    config: Mapping[str, object]


FORMATS = {
    "fp8-block": Format("fp8-block", _fp8_block, {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}),
    "int8-channel": Format("int8-channel", _int8_channel, {
        "quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                  "dynamic": True}}}}),
}


def format_of(name: object) -> Format:
    """The format named ``name``; ValueError naming the known ones otherwise."""
    if not isinstance(name, str) or name not in FORMATS:
        raise ValueError(f"quantize={name!r}: not a format weightsync writes (known: {sorted(FORMATS)})")
    return FORMATS[name]


def linear_weight(name: str, tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` named ``name`` is a linear layer's weight, which a format holds quantized
    (the module docstring's rule), whatever its dtype now."""
    return name.endswith(".weight") and tensor.dim() == 2 and not any(k in name for k in KEPT)


def quantized(name: str, tensor: torch.Tensor) -> bool:
    """Whether a format quantizes ``tensor`` named ``name``: a linear weight, not quantized yet."""
    return linear_weight(name, tensor) and tensor.dtype.is_floating_point and tensor.dtype.itemsize > 1


def quantize_items(items: list[tuple[str, torch.Tensor]], fmt: str, dtype: CastLike = None
                   ) -> tuple[list[tuple[str, torch.Tensor]], CastLike]:
    """``items`` as format ``fmt`` holds them, and the ``dtype=`` left for the tensors it keeps.

    A quantized weight is first cast to ``dtype`` (one floating dtype, or the mapping's entry for
    it; the format quantizes what the engine would otherwise be sent). ValueError names a weight
    holding NaN or infinity, a name the format's output would take twice, or an unknown format.
    """
    made = format_of(fmt).make
    return _assemble(items, fmt, dtype, lambda index, name, tensor, want: made(_finite(tensor, want, name, fmt)))


def _finite(tensor: torch.Tensor, want: object, name: str, fmt: str) -> torch.Tensor:
    """``tensor`` cast as the format quantizes it (to ``want``, a dtype, if one); ValueError if it
    holds NaN or infinity."""
    w = tensor.detach() if not isinstance(want, torch.dtype) else tensor.detach().to(want)
    if not all_finite(w):
        raise ValueError(f"quantize={fmt!r}: {name!r} holds NaN or infinity; no scale represents it "
                         "(nothing was sent)")
    return w


def _assemble(items: list[tuple[str, Any]], fmt: str, dtype: CastLike,
              make: Callable[[int, str, Any, object], dict[str, Any]]) -> tuple[list[tuple[str, Any]], CastLike]:
    """Each item a format quantizes replaced by ``make(index, name, weight, dtype for it)``'s
    tensors under the format's names, in the items' order; the casts left for the others."""
    names = {name for name, _ in items}
    out: list[tuple[str, Any]] = []
    done: set[str] = set()
    for index, (name, tensor) in enumerate(items):
        if not quantized(name, tensor):
            out.append((name, tensor))
            continue
        want = dtype.get(name) if isinstance(dtype, Mapping) else dtype
        stem = name.removesuffix(".weight")
        for suffix, value in make(index, name, tensor, want).items():
            full = f"{stem}.{suffix}"
            if full != name and full in names:
                raise ValueError(f"quantize={fmt!r}: {name!r}'s {suffix} would be {full!r}, which this "
                                 "version already holds (is it quantized already?)")
            out.append((full, value))
        done.add(name)
    # the casts left are those of the tensors kept as they were (never a quantized weight or its scales)
    if isinstance(dtype, Mapping):
        return out, {n: d for n, d in dtype.items() if n not in done}
    if dtype is None:
        return out, None
    return out, {n: dtype for n, t in items if n not in done and t.dtype.is_floating_point}


@dataclass
class _Shard:
    """One sharded weight to quantize: this rank's box of it and its part of the scales."""

    index: int
    name: str
    value: Any  # the DTensor
    local: torch.Tensor  # this rank's box, cast as the format quantizes it
    start: tuple[int, int]  # the box's first row and column in the full weight
    frame: torch.Tensor  # fp8: the box in the zeros of the blocks it touches (made once); int8: the box
    corner: tuple[int, int]  # the frame's first row and column in the full weight
    partial: torch.Tensor  # float32: the largest magnitude per block (fp8) or per row (int8) in the box
    finite: bool


def _share(index: int, name: str, value: Any, fmt: str, want: object) -> _Shard:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = value.device_mesh, value.placements
    if mesh.get_coordinate() is None:
        raise ValueError(f"quantize={fmt!r}: {name!r} is a DTensor on a mesh without this rank")
    if not all(p.is_shard() or p.is_replicate() for p in placements):
        raise ValueError(f"quantize={fmt!r}: {name!r} has placements {placements}: reduce it first "
                         "(Shard(d) and Replicate() are quantized where they are)")
    local = value.to_local().detach()
    local = local.to(want) if isinstance(want, torch.dtype) else local
    rows, cols = value.shape
    shape, offset = compute_local_shape_and_global_offset(tuple(value.shape), mesh, placements)
    if tuple(local.shape) != tuple(shape):
        raise ValueError(f"quantize={fmt!r}: {name!r}'s local shard {tuple(local.shape)} is not the {tuple(shape)} "
                         "its placements say (padded shards are not supported)")
    (r0, c0), (n, m) = offset, shape
    if fmt != "fp8-block":
        grid = torch.zeros(rows, dtype=torch.float32, device=local.device)
        if n and m:
            grid[r0:r0 + n] = local.abs().amax(dim=1).float()  # a bf16, fp16 or fp32 magnitude is exact in float32
        return _Shard(index, name, value, local, (r0, c0), local, (r0, c0), grid, all_finite(local))
    fr, fc = r0 // BLOCK * BLOCK, c0 // BLOCK * BLOCK
    frame = torch.zeros((-(-(r0 + n) // BLOCK) * BLOCK - fr, -(-(c0 + m) // BLOCK) * BLOCK - fc),
                        dtype=local.dtype, device=local.device)
    frame[r0 - fr:r0 - fr + n, c0 - fc:c0 - fc + m] = local
    grid = torch.zeros((-(-rows // BLOCK), 1, -(-cols // BLOCK), 1), dtype=torch.float32, device=local.device)
    if n and m:
        part = _fp8_amax(frame)
        grid[fr // BLOCK:fr // BLOCK + part.size(0), :, fc // BLOCK:fc // BLOCK + part.size(2)] = part
    return _Shard(index, name, value, local, (r0, c0), frame, (fr, fc), grid, all_finite(local))


def _reduce_max(shards: list[_Shard], timeout: float) -> None:
    """Every rank's parts of the grids, and whether each rank's box was finite, combined (MAX) over
    each weight's mesh, one all-reduce per mesh dimension for all the weights on that mesh."""
    import datetime as dt

    import torch.distributed as dist

    groups: list[tuple[Any, list[_Shard]]] = []
    for shard in shards:
        for mesh, members in groups:
            if mesh == shard.value.device_mesh:
                members.append(shard)
                break
        else:
            groups.append((shard.value.device_mesh, [shard]))
    for mesh, members in groups:
        device = members[0].partial.device
        flags = torch.tensor([0.0 if m.finite else 1.0 for m in members], device=device)
        flat = torch.cat([m.partial.flatten() for m in members] + [flags])
        for dim in range(mesh.ndim):
            work = dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=mesh.get_group(dim), async_op=True)
            work.wait(timeout=dt.timedelta(seconds=timeout))
        at = 0
        for m in members:
            m.partial = flat[at:at + m.partial.numel()].view_as(m.partial)
            at += m.partial.numel()
        for m, flag in zip(members, flat[at:].tolist(), strict=True):
            m.finite = flag == 0.0


def _quantize_shard(shard: _Shard, fmt: str) -> dict[str, torch.Tensor]:
    """This rank's box quantized with the whole weight's largest magnitudes (the same operations on
    each element as :func:`_fp8_block` and :func:`_int8_channel`), as a DTensor placed as the
    weight is, and the scales, whole on every rank (rank 0 sends them)."""
    from torch.distributed.tensor import DTensor

    value, frame, (r0, c0), (fr, fc) = shard.value, shard.frame, shard.start, shard.corner
    n, m = shard.local.shape
    if fmt == "fp8-block":
        scale = _fp8_scale(shard.partial)  # the whole weight's: [block rows, 1, block columns, 1]
        mine = scale[fr // BLOCK:(fr + frame.size(0)) // BLOCK, :, fc // BLOCK:(fc + frame.size(1)) // BLOCK]
        q_local = _fp8_values(frame, mine)[r0 - fr:r0 - fr + n, c0 - fc:c0 - fc + m].contiguous()
        scales = {"weight_scale_inv": scale.view(scale.size(0), scale.size(2))}
    else:
        scale = _int8_scale(shard.partial.to(frame.dtype).view(-1, 1))  # a magnitude is exact in its dtype
        q_local = _int8_values(frame, scale[r0:r0 + n]).to(torch.int8)
        scales = {"weight_scale": scale}
    weight = DTensor.from_local(q_local, value.device_mesh, value.placements, run_check=False,
                                shape=value.shape, stride=value.stride())
    return {"weight": weight, **scales}


def quantize_sharded_items(items: list[tuple[str, Any]], fmt: str, dtype: CastLike = None, *,
                           timeout: float = 60.0) -> tuple[list[tuple[str, Any]], CastLike]:
    """:func:`quantize_items` for one rank of a sharded trainer, whose weights are DTensors: each
    rank quantizes the rows and columns it holds, with the scales of the whole weight, which every
    rank of a weight's mesh learns with one all-reduce (MAX) per mesh dimension over every
    weight's part of them (a 128x128 block or a row may span two ranks' shards). The quantized
    bytes are those of the whole weight quantized in one place; the scales go whole, from rank 0.
    Every rank must call it with the same items in the same order (as every rank puts the same
    version); ``timeout`` bounds each all-reduce. A weight not finite on any rank is refused on
    every rank, naming it. Plain tensors are quantized whole where they are."""
    made = format_of(fmt).make
    shards = []
    for index, (name, tensor) in enumerate(items):
        if type(tensor).__name__ == "DTensor" and quantized(name, tensor):
            want = dtype.get(name) if isinstance(dtype, Mapping) else dtype
            shards.append(_share(index, name, tensor, fmt, want))
    if shards:
        _reduce_max(shards, timeout)
    bad = [s.name for s in shards if not s.finite]
    if bad:
        raise ValueError(f"quantize={fmt!r}: {bad[0]!r} holds NaN or infinity on some rank; no scale represents it "
                         "(nothing was sent)")
    by_index = {s.index: s for s in shards}
    return _assemble(items, fmt, dtype, lambda index, name, tensor, want: _quantize_shard(by_index[index], fmt)
                     if index in by_index else made(_finite(tensor, want, name, fmt)))


def quantize(tensors: TensorsLike, format: str, *, dtype: CastLike = None) -> dict[str, torch.Tensor]:  # noqa: A002
    """``tensors`` (a state dict) as a checkpoint of ``format`` holds them: what
    ``put(tensors, quantize=format, dtype=dtype)`` sends, here to save or compare (public as
    ``weightsync.quantize``)."""
    items, casts = quantize_items(as_items(tensors), format, dtype)
    assert not isinstance(casts, torch.dtype)
    return {n: t.to(casts[n]) if casts and n in casts else t for n, t in items}


def quantization_config(format: str) -> dict[str, object]:  # noqa: A002
    """What a checkpoint of ``format`` declares in its config.json (``quantization_config``), for an
    engine started from one (public as ``weightsync.quantization_config``)."""
    return dict(format_of(format).config)
