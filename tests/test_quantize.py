"""Quantized versions (docs/quantization.md): ``put(quantize=)`` sends a checkpoint format's bytes.

The formats' bytes are held to their reference quantizers (vLLM's ``per_block_cast_to_fp8``,
compressed-tensors' ``calculate_qparams`` and ``quantize``) where those are installed
(``make test-vllm``); everything else runs here, through a real channel.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import weightsync as ws
from weightsync.format import quantize as q

FAST = {"timeout": 5.0, "heartbeat_interval": 0.25, "bucket_bytes": 1 << 20}


def moe_state_dict(seed: int = 0, scale: float = 0.02) -> dict[str, torch.Tensor]:
    """A small Qwen-MoE-shaped state dict in fp32 (a trainer's masters): shapes the 128-blocks do
    and do not divide, the tensors both formats keep, and a router."""
    gen = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    return {"model.embed_tokens.weight": r(320, 256),
            "model.layers.0.input_layernorm.weight": torch.ones(256),
            "model.layers.0.self_attn.q_proj.weight": r(256, 256),
            "model.layers.0.self_attn.q_proj.bias": r(256),
            "model.layers.0.self_attn.o_proj.weight": r(256, 200),  # 200 columns: a partial block
            "model.layers.0.mlp.gate.weight": r(4, 256),  # the router
            "model.layers.0.mlp.experts.0.gate_proj.weight": r(300, 256),  # 300 rows: a partial block
            "model.layers.0.mlp.experts.0.down_proj.weight": r(256, 300),
            "model.norm.weight": torch.ones(256),
            "lm_head.weight": r(320, 256)}


QUANTIZED = {"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj",
             "model.layers.0.mlp.experts.0.gate_proj", "model.layers.0.mlp.experts.0.down_proj"}


@pytest.mark.parametrize("fmt", ["fp8-block", "int8-channel"])
def test_the_linear_weights_are_quantized_and_the_rest_kept_as_the_format_keeps_them(fmt: str) -> None:
    sd = moe_state_dict()
    out = ws.quantize(sd, fmt, dtype=torch.bfloat16)
    scale = "weight_scale_inv" if fmt == "fp8-block" else "weight_scale"
    want = {f"{m}.{s}" for m in QUANTIZED for s in ("weight", scale)} | {n for n in sd if n.rsplit(".", 1)[0]
                                                                         not in QUANTIZED or n.endswith("bias")}
    assert set(out) == want
    for name, tensor in sd.items():
        if name.rsplit(".", 1)[0] not in QUANTIZED or name.endswith("bias"):  # kept, cast as dtype= says
            assert out[name].dtype == torch.bfloat16 and torch.equal(out[name], tensor.bfloat16()), name
    for module in QUANTIZED:
        w, s = sd[f"{module}.weight"].bfloat16().float(), out[f"{module}.{scale}"]
        got = out[f"{module}.weight"]
        if fmt == "fp8-block":
            assert got.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
            assert s.shape == (-(-w.shape[0] // 128), -(-w.shape[1] // 128))
            per = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
            # e4m3 keeps 3 mantissa bits: at most half a step, 1/16 of the value, off (plus subnormals)
            assert torch.all((got.float() * per - w).abs() <= w.abs() / 16 + per * 2.0**-9)
        else:
            assert got.dtype == torch.int8 and s.dtype == torch.bfloat16 and s.shape == (w.shape[0], 1)
            # one step of the row's scale at most (w / scale is rounded to bf16 before to an integer)
            assert torch.all((got.float() * s.float() - w).abs() <= s.float() * 1.01)
    quantized_bytes = sum(t.numel() * t.element_size() for t in out.values())
    bf16_bytes = sum(t.numel() * 2 for t in sd.values())
    assert quantized_bytes < 0.75 * bf16_bytes  # the kept embeddings and head weigh in this small model


@pytest.mark.asyncio
@pytest.mark.parametrize("fmt", ["fp8-block", "int8-channel"])
async def test_a_quantized_version_arrives_as_the_format_holds_it_and_so_does_its_delta(fmt: str) -> None:
    """Through a real channel (``encoding="auto"``): the member's tensors are exactly what
    ``ws.quantize`` makes; the next version goes as a delta against the last quantized one and
    arrives exactly too; a bf16 version of the same weights is about twice the bytes."""
    async with ws.Publisher("quant", **FAST) as pub:
        async with ws.Subscriber("quant", address=pub.address, member_id="g", timeout=5.0) as sub:
            await pub.wait_subscribers(1, timeout=20)
            sd = moe_state_dict()
            plain = await (await pub.put(sd, version=1, dtype=torch.bfloat16))
            report = await (await pub.put(sd, version=2, dtype=torch.bfloat16, quantize=fmt, encoding="full"))
            got = await sub.get(min_version=2, timeout=10)
            want = ws.quantize(sd, fmt, dtype=torch.bfloat16)
            assert set(got) == set(want)
            assert all(got[n].dtype == want[n].dtype for n in want)
            assert all(torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8)) for n in want)
            assert report.nbytes < 0.75 * plain.nbytes
            for name in sd:  # an RL step: every weight moves a little
                sd[name] = sd[name] + torch.randn_like(sd[name]) * 1e-4
            # a delta, asked for: "auto" may well send it full (a block whose largest element moved
            # has a new scale, so every byte of it changes)
            report = await (await pub.put(sd, version=3, dtype=torch.bfloat16, quantize=fmt, encoding="delta"))
            got = await sub.get(min_version=3, timeout=10)
            want = ws.quantize(sd, fmt, dtype=torch.bfloat16)
            assert all(torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8)) for n in want)
            assert report.encodings == {"g": "delta"} and report.base == 2


@pytest.mark.asyncio
async def test_a_weight_holding_nan_or_an_unknown_format_is_refused_at_put_and_nothing_is_sent() -> None:
    async with ws.Publisher("quant-bad", **FAST) as pub:
        async with ws.Subscriber("quant-bad", address=pub.address, member_id="g", timeout=5.0) as sub:
            await pub.wait_subscribers(1, timeout=20)
            sd = moe_state_dict()
            await (await pub.put(sd, version=1, quantize="fp8-block"))
            bad = dict(sd)
            bad["model.layers.0.self_attn.o_proj.weight"] = bad["model.layers.0.self_attn.o_proj.weight"].clone()
            bad["model.layers.0.self_attn.o_proj.weight"][3, 7] = float("inf")
            with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.o_proj\.weight' holds NaN or inf"):
                await pub.put(bad, version=2, quantize="fp8-block")
            with pytest.raises(ValueError, match=r"quantize='fp4': not a format weightsync writes \(known: "):
                await pub.put(sd, version=2, quantize="fp4")
            already = ws.quantize(sd, "fp8-block")
            with pytest.raises(ValueError, match="is it quantized already"):
                await pub.put({**already, "model.layers.0.self_attn.q_proj.weight": sd[
                    "model.layers.0.self_attn.q_proj.weight"]}, version=2, quantize="fp8-block")
            await (await pub.put(sd, version=5, quantize="int8-channel"))  # the channel still works
            assert (await sub.get(min_version=2, timeout=10)).version == 5


@pytest.mark.asyncio
async def test_a_format_a_members_engine_does_not_load_is_refused_at_put_naming_it() -> None:
    """A member says, when it joins, which checkpoint format its engine loads (the vLLM backend
    takes it from the engine's model); a put in another one is refused before anything is made or
    sent, naming that member, where its engine would otherwise refuse it after the wire."""
    with pytest.raises(ValueError, match="not a format weightsync writes"):
        ws.Subscriber("quant-accepts", address="127.0.0.1:1", accepts="fp4")
    async with ws.Publisher("quant-accepts", **FAST) as pub:
        engine = ws.Subscriber("quant-accepts", address=pub.address, member_id="int8-engine", timeout=5.0,
                               accepts="int8-channel")
        plain = ws.Subscriber("quant-accepts", address=pub.address, member_id="any", timeout=5.0)
        async with engine, plain:
            await pub.wait_subscribers(2, timeout=20)
            sd = moe_state_dict()
            for fmt in (None, "fp8-block"):  # a bf16 version, another format
                with pytest.raises(ValueError, match=rf"put\(quantize={fmt!r}\): member 'int8-engine' loads "
                                                     r"'int8-channel' checkpoints: nothing was sent"):
                    await pub.put(sd, version=1, quantize=fmt)
            assert pub.statistics().versions_put == 0
            await (await pub.put(sd, version=2, quantize="int8-channel")).delivered(timeout=30, min_members=2)
            got = await engine.get(min_version=2, timeout=10)
            assert got["model.layers.0.self_attn.q_proj.weight"].dtype == torch.int8
        async with ws.Subscriber("quant-accepts", address=pub.address, member_id="bf16-engine", timeout=5.0,
                                 accepts=""):
            await pub.wait_subscribers(1, timeout=20)
            with pytest.raises(ValueError, match="member 'bf16-engine' loads unquantized weights"):
                await pub.put(sd, version=3, quantize="int8-channel")
            await (await pub.put(sd, version=4)).delivered(timeout=30, min_members=1)


def test_the_formats_say_what_a_checkpoint_of_them_declares() -> None:
    assert ws.quantization_config("fp8-block") == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                                   "weight_block_size": [128, 128]}
    config = ws.quantization_config("int8-channel")
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "int-quantized"
    with pytest.raises(ValueError, match="not a format"):
        ws.quantization_config("nf4")


needs_references = pytest.mark.skipif(importlib.util.find_spec("vllm") is None or
                                      importlib.util.find_spec("compressed_tensors") is None,
                                      reason="the reference quantizers come with vLLM (make test-vllm)")


@pytest.mark.vllm
@needs_references
def test_fp8_block_bytes_are_vllms_per_block_cast_to_fp8s() -> None:
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # the reference is torch.compiled for devices; run it eagerly
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    reference = getattr(per_block_cast_to_fp8, "_torchdynamo_orig_callable", per_block_cast_to_fp8)
    sd = moe_state_dict(seed=3, scale=0.05)
    out = ws.quantize(sd, "fp8-block", dtype=torch.bfloat16)
    for module in QUANTIZED:
        weight, scale = reference(sd[f"{module}.weight"].bfloat16(), [128, 128])
        assert torch.equal(out[f"{module}.weight"].view(torch.uint8), weight.view(torch.uint8)), module
        assert torch.equal(out[f"{module}.weight_scale_inv"], scale), module


@pytest.mark.vllm
@needs_references
def test_int8_channel_bytes_are_compressed_tensors_own() -> None:
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize as reference_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    sd = moe_state_dict(seed=4, scale=0.05)
    sd["model.layers.0.self_attn.q_proj.weight"][5] = 0.0  # a row of zeros: the smallest scale
    out = ws.quantize(sd, "int8-channel", dtype=torch.bfloat16)
    for module in QUANTIZED:
        w = sd[f"{module}.weight"].bfloat16()
        scale, zero = calculate_qparams(w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True), args)
        weight = reference_quantize(w, scale, zero, args, dtype=torch.int8)
        assert torch.equal(out[f"{module}.weight_scale"], scale), module
        assert torch.equal(out[f"{module}.weight"], weight), module


def test_dtype_casts_only_the_tensors_kept_as_they_were() -> None:
    """``dtype=`` is what a quantized weight is cast to first; after quantizing, the casts left
    name only the tensors kept (a float8 weight or an fp32 scale cast to bf16 would break the format)."""
    sd = moe_state_dict()
    items, casts = q.quantize_items(list(sd.items()), "fp8-block", torch.bfloat16)
    assert isinstance(casts, dict) and casts["lm_head.weight"] == torch.bfloat16
    assert not any(name.endswith(("q_proj.weight", "weight_scale_inv")) for name in casts)
    half = {"lm_head.weight": torch.float16, "model.layers.0.self_attn.q_proj.weight": torch.float16}
    _, casts = q.quantize_items(list(sd.items()), "int8-channel", half)
    assert casts == {"lm_head.weight": torch.float16}
