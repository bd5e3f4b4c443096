"""How small a delta between two bf16 versions can be, by format: the measurement a delta encoding's
format is chosen by (issue 23: "choose the format by measurement").

    python -m benchmarks.delta_formats [--lrs 1e-6,3e-6,1e-4] [--steps 3] [--layers 4] [--hidden 512]

A random-init Hugging Face Llama (built locally, no download) with fp32 master weights is trained
with AdamW on random tokens; after each step its bf16 copy is compared bit for bit (as int16) with
the previous step's. Per step: the share of elements that changed, and the bytes per changed
element of each candidate format:

- ``int32+value``: each changed element's position (4 bytes) and new value (2 bytes);
- ``gap8+value``: the gap to the previous changed position in one byte (255 escapes to four
  more), and the value;
- ``zstd(xor)``: the whole version XORed with the base, compressed (zstd level 1);
- ``zstd(gaps)+zstd(xor values)``: the one-byte gaps and the changed elements' XOR, each
  compressed;
- ``zstd(bitmap)+zstd(xor values)``: one bit per element, and the changed elements' XOR.

Needs ``transformers`` and ``zstandard`` (neither is a weightsync dependency). Writes
``delta_formats.json`` and a plot.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch

from benchmarks.report import pyplot, write_json

FORMATS = ("int32+value", "gap8+value", "zstd(xor)", "zstd(gaps)+zstd(xor values)", "zstd(bitmap)+zstd(xor values)")


class Step(msgspec.Struct):
    lr: float
    step: int
    elements: int
    changed: float  # share of bf16 elements whose bits changed
    bytes_per_changed: dict[str, float]
    of_full: dict[str, float]  # each format's bytes over the full version's (2 bytes per element)
    zstd_xor_gbps: float  # compressing the whole XOR, this CPU


class Report(msgspec.Struct):
    when: str
    torch: str
    params: int
    steps: list[Step]


def _bf16_bits(model: Any) -> torch.Tensor:
    return torch.cat([p.detach().to(torch.bfloat16).view(torch.int16).flatten() for p in model.parameters()])


def sizes(prev: torch.Tensor, cur: torch.Tensor, zc: Any) -> tuple[dict[str, int], float]:
    """Each format's bytes for ``cur`` against ``prev`` (int16 bit patterns), and zstd(xor)'s GB/s."""
    changed = cur != prev
    k = int(changed.sum())
    idx = changed.nonzero().flatten()
    gaps = torch.diff(idx, prepend=torch.tensor([-1])) - 1
    escapes = int((gaps >= 255).sum())
    xor = torch.bitwise_xor(cur, prev)
    values = xor[idx].numpy().tobytes()
    began = time.perf_counter()
    whole = len(zc.compress(xor.numpy().tobytes()))
    seconds = time.perf_counter() - began
    gap_bytes = gaps.clamp(max=255).to(torch.uint8).numpy().tobytes()
    return {
        "int32+value": 6 * k,
        "gap8+value": k + 4 * escapes + 2 * k,
        "zstd(xor)": whole,
        "zstd(gaps)+zstd(xor values)": len(zc.compress(gap_bytes)) + 4 * escapes + len(zc.compress(values)),
        "zstd(bitmap)+zstd(xor values)": len(zc.compress(np.packbits(changed.numpy()).tobytes()))
        + len(zc.compress(values)),
    }, 2 * cur.numel() / max(seconds, 1e-9) / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lrs", default="1e-6,3e-6,1e-4")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    try:
        import zstandard
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as err:
        raise SystemExit(f"benchmarks.delta_formats needs transformers and zstandard: {err}") from None
    cfg = LlamaConfig(vocab_size=4096, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                      num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8,
                      max_position_embeddings=256)
    zc = zstandard.ZstdCompressor(level=1)
    steps: list[Step] = []
    params = 0
    for lr in (float(x) for x in args.lrs.split(",")):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        params = sum(p.numel() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        prev = _bf16_bits(model)
        for step in range(1, args.steps + 1):
            tokens = torch.randint(0, cfg.vocab_size, (4, 128))
            model(input_ids=tokens, labels=tokens).loss.backward()
            opt.step()
            opt.zero_grad()
            cur = _bf16_bits(model)
            got, gbps = sizes(prev, cur, zc)
            k = max(int((cur != prev).sum()), 1)
            steps.append(Step(lr, step, cur.numel(), k / cur.numel(), {f: got[f] / k for f in FORMATS},
                              {f: got[f] / (2 * cur.numel()) for f in FORMATS}, gbps))
            row = "  ".join(f"{f} {got[f] / k:.2f}" for f in FORMATS)
            print(f"lr {lr:g} step {step}: {k / cur.numel():6.2%} changed; bytes per changed element: {row}; "
                  f"zstd(xor) {gbps:.2f} GB/s", flush=True)
            prev = cur
    report = Report(time.strftime("%Y-%m-%d %H:%M"), str(torch.__version__), params, steps)
    path = write_json(args.out, "delta_formats", report)
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(9, 4.5))
        for fmt in FORMATS:
            ax.plot([s.changed * 100 for s in steps], [s.bytes_per_changed[fmt] for s in steps], "o", label=fmt)
        ax.axhline(2.5, color="grey", linestyle="--", linewidth=0.8, label="2.5 B (issue 23's target at lr 1e-6)")
        ax.set_xscale("log")
        ax.set_xlabel("% of bf16 elements changed in the step")
        ax.set_ylabel("bytes per changed element")
        ax.set_title(f"delta formats, {params / 1e6:.0f}M-parameter Llama, AdamW, fp32 masters -> bf16")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(Path(args.out) / "delta_formats.png", dpi=120)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
