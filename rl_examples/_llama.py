"""A tiny random Llama saved as a Hugging Face checkpoint: vLLM loads it with no download."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# head_dim 64: a size every vLLM CPU attention backend takes
SIZES: dict[str, Any] = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def build(path: str | Path, *, seed: int = 0, **sizes: Any) -> torch.nn.Module:
    """Create a random ``LlamaForCausalLM`` (float32), save it to ``path`` and return it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**SIZES, **sizes}, torch_dtype="float32")
    model = LlamaForCausalLM(config).float()
    save(model, path)
    return model


def save(model: torch.nn.Module, path: str | Path) -> None:
    """Save ``model`` as a checkpoint directory vLLM can start from."""
    Path(path).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)  # type: ignore[operator]
