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

import torch

from weightsync.format.layout import CastLike, TensorsLike, as_items

#: the names of 2-D weights both formats keep unquantized (substrings of the name)
KEPT = ("embed", "lm_head", "mlp.gate.weight", "shared_expert_gate.weight")
BLOCK = 128
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
FP8_LEAST_AMAX = 1e-4  # per_block_cast_to_fp8's floor on a block's largest magnitude


def _fp8_block(w: torch.Tensor) -> dict[str, torch.Tensor]:
    rows, cols = w.shape
    padded = torch.zeros(((rows + BLOCK - 1) // BLOCK * BLOCK, (cols + BLOCK - 1) // BLOCK * BLOCK),
                         dtype=w.dtype, device=w.device)
    padded[:rows, :cols] = w
    blocks = padded.view(-1, BLOCK, padded.size(1) // BLOCK, BLOCK)
    amax = blocks.abs().float().amax(dim=(1, 3), keepdim=True).clamp(FP8_LEAST_AMAX)
    scale = amax / FP8_MAX
    q = (blocks * (1.0 / scale)).to(torch.float8_e4m3fn)
    return {"weight": q.view_as(padded)[:rows, :cols].contiguous(),
            "weight_scale_inv": scale.view(blocks.size(0), blocks.size(2))}


def _int8_channel(w: torch.Tensor) -> dict[str, torch.Tensor]:
    zero = torch.zeros((w.shape[0], 1), dtype=w.dtype, device=w.device)
    low, high = torch.min(w.amin(dim=1, keepdim=True), zero), torch.max(w.amax(dim=1, keepdim=True), zero)
    scale = torch.max(low.abs(), high.abs()) / (255 / 2)
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(w.dtype).eps, dtype=w.dtype, device=w.device), scale)
    q = torch.round(torch.clamp(w / scale, -128, 127)).to(torch.int8)
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
    names = {name for name, _ in items}
    out: list[tuple[str, torch.Tensor]] = []
    done: set[str] = set()
    for name, tensor in items:
        if not quantized(name, tensor):
            out.append((name, tensor))
            continue
        want = dtype.get(name) if isinstance(dtype, Mapping) else dtype
        w = tensor.detach() if not isinstance(want, torch.dtype) else tensor.detach().to(want)
        if not bool(torch.isfinite(w).all()):
            raise ValueError(f"quantize={fmt!r}: {name!r} holds NaN or infinity; no scale represents it "
                             "(nothing was sent)")
        stem = name.removesuffix(".weight")
        for suffix, value in made(w).items():
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
