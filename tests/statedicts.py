"""Deterministic mixed-dtype state dicts and digests, shared by tests and their workers."""

from __future__ import annotations

import hashlib

import torch

MIXED_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.uint8, torch.bool,
                torch.complex64, torch.float64]
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        MIXED_DTYPES.append(getattr(torch, _name))


def mixed_state_dict(version: int, mib: float = 1.0, seed: int = 0) -> dict[str, torch.Tensor]:
    """~``mib`` MiB over every dtype, plus 0-dim, empty and non-contiguous tensors."""
    gen = torch.Generator().manual_seed(seed * 100_003 + version)
    per = max(int(mib * (1 << 20) / len(MIXED_DTYPES)), 64)
    sd: dict[str, torch.Tensor] = {}
    for i, dtype in enumerate(MIXED_DTYPES):
        raw = torch.randint(0, 256, (per,), dtype=torch.uint8, generator=gen)
        if dtype == torch.bool:
            t = raw % 2 == 1
        else:
            size = torch.empty((), dtype=dtype).element_size()
            t = raw[: per // size * size].view(dtype)  # arbitrary bit patterns, NaNs included
        sd[f"layer{i}.{str(dtype).removeprefix('torch.')}"] = t
    sd["scalar"] = torch.tensor(float(version))
    sd["empty"] = torch.empty(0, 4)
    sd["noncontig"] = torch.arange(48, dtype=torch.float32).reshape(6, 8).t() + version
    sd["version"] = torch.tensor([version], dtype=torch.int64)
    return sd


def digest(t: torch.Tensor) -> str:
    data = t.detach().contiguous().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    return hashlib.sha256(data.cpu().numpy().tobytes()).hexdigest()[:16] + f":{t.dtype}:{tuple(t.shape)}"


def digests(sd) -> dict[str, str]:
    return {name: digest(t) for name, t in sd.items()}


# a tensor-parallel generator's share of fsdp_model's tensors (plus the trainer's replicated one):
# name -> (full shape, dtype, the dimension it is sharded on, None for replicated); names left
# out (biases, buffers) it does not take at all
TP_OF_FSDP = {"0.weight": ((13, 11), torch.float32, 1), "1.weight": ((7, 13), torch.bfloat16, 0),
              "2.weight": ((37, 9), torch.float16, 0), "shared.replicated": ((10,), torch.float64, None)}


def tp_box(full: torch.Tensor, dim: int | None, rank: int, world: int) -> torch.Tensor:
    """Generator rank ``rank``'s box of ``full`` (``torch.chunk``'s split, as DTensor makes it)."""
    return full if dim is None else full.chunk(world, dim=dim)[rank]


def pp_tp_full(layers: int = 2) -> dict[str, tuple[torch.Tensor, int | None]]:
    """The full tensors of a Megatron-style model (the TP + PP recipe in docs/sharding.md): per
    layer a column-parallel weight (Shard(0)), a row-parallel one (Shard(1)) and a replicated
    norm, with the TP dimension each is split on (None: replicated); the same in every process."""
    gen = torch.Generator().manual_seed(11)
    out: dict[str, tuple[torch.Tensor, int | None]] = {}
    for i in range(layers):
        out[f"layers.{i}.qkv.weight"] = (torch.randn(7 + i, 5, generator=gen), 0)
        out[f"layers.{i}.proj.weight"] = (torch.randn(5, 9, generator=gen).to(torch.bfloat16), 1)
        out[f"layers.{i}.norm.weight"] = (torch.randn(5, generator=gen), None)
    return out


def fsdp_model(mesh: object) -> torch.nn.Module:
    """A small model FSDP2 shards unevenly on 2 and 4 ranks (13, 7, 37 rows), in float32,
    bfloat16 and float16, with a plain (unsharded) buffer; the same on every rank (seeded)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(11, 13), torch.nn.Linear(13, 7, bias=False),
                                torch.nn.Embedding(37, 9))
    model[1].to(torch.bfloat16)
    model[2].to(torch.float16)
    model.register_buffer("counts", torch.arange(5, dtype=torch.int64))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
