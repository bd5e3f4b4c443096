"""A synthetic LLM-shaped state dict and the packed-bucket layout the vLLM-style baseline uses."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch


def make_state_dict(mib: int, *, seed: int | None = None) -> dict[str, torch.Tensor]:
    """About ``mib`` MiB: an embedding, per-layer attention/MLP matrices (bf16) and small norms (fp32).

    With ``seed`` the values are the same in every process (a receiver can check what arrived).
    From 64 MiB up the hidden size is 1024 (an embedding of 16 MiB, 32 MiB per layer); smaller
    sizes take narrower layers so that they come out near what was asked."""
    hidden = 1024 if mib >= 64 else 256 if mib >= 8 else 64
    sd: dict[str, torch.Tensor] = {"embed.weight": torch.zeros(8192, hidden, dtype=torch.bfloat16)}
    layer_bytes = (4 * hidden * hidden + 3 * hidden * 4 * hidden) * 2
    layers = max(1, (mib * 2**20 - sd["embed.weight"].numel() * 2) // layer_bytes)
    for i in range(layers):
        for name in ("q", "k", "v", "o"):
            sd[f"layers.{i}.attn.{name}.weight"] = torch.zeros(hidden, hidden, dtype=torch.bfloat16)
        sd[f"layers.{i}.mlp.up.weight"] = torch.zeros(4 * hidden, hidden, dtype=torch.bfloat16)
        sd[f"layers.{i}.mlp.gate.weight"] = torch.zeros(4 * hidden, hidden, dtype=torch.bfloat16)
        sd[f"layers.{i}.mlp.down.weight"] = torch.zeros(hidden, 4 * hidden, dtype=torch.bfloat16)
        sd[f"layers.{i}.norm1.weight"] = torch.ones(hidden)
        sd[f"layers.{i}.norm2.weight"] = torch.ones(hidden)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    for t in sd.values():
        if t.dtype == torch.bfloat16:
            t.normal_(generator=gen)
    return sd


def make_module(sd: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module whose parameters are ``sd``'s tensors under the same dotted names (a generator's
    model: ``module.state_dict()`` has ``sd``'s keys), none of them trained."""
    root = torch.nn.Module()
    for name, tensor in sd.items():
        *path, leaf = name.split(".")
        owner = root
        for part in path:
            if part not in owner._modules:
                owner.add_module(part, torch.nn.Module())
            owner = owner._modules[part]  # type: ignore[assignment]
        owner.register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=False))
    return root


def nbytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


@dataclass
class Chunk:
    """One packed bucket: a run of whole tensors laid end to end (vLLM's packed broadcast)."""

    tensors: list[torch.Tensor]
    nbytes: int

    def pack(self, buf: torch.Tensor) -> None:
        offset = 0
        for t in self.tensors:
            n = t.numel() * t.element_size()
            buf[offset : offset + n].copy_(t.reshape(-1).view(torch.uint8))
            offset += n

    def unpack(self, buf: torch.Tensor) -> None:
        offset = 0
        for t in self.tensors:
            n = t.numel() * t.element_size()
            t.reshape(-1).view(torch.uint8).copy_(buf[offset : offset + n])
            offset += n


def packed_chunks(sd: dict[str, torch.Tensor], bucket_bytes: int) -> Iterator[Chunk]:
    current: list[torch.Tensor] = []
    size = 0
    for t in sd.values():
        n = t.numel() * t.element_size()
        if current and size + n > bucket_bytes:
            yield Chunk(current, size)
            current, size = [], 0
        current.append(t)
        size += n
    if current:
        yield Chunk(current, size)
