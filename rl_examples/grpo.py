"""GRPO for a tiny transformer language policy, with a generator killed and replaced mid-run.

    python -m rl_examples.grpo                             # kills a generator at step 60
    python -m rl_examples.grpo --kill-generator-at 0       # nobody dies
    python -m rl_examples.grpo --steps 12 --kill-generator-at 4 --no-check   # CI's short mode

The task has a checkable answer: given ``BOS d1 .. d5 SEP`` the policy must write the digits
reversed; the reward is the fraction of positions it gets right. Each generator samples a
group of completions per prompt with the newest policy it has, loading weights the way an
inference engine does (``await sub.load(engine.load_weights)``: name by name, no second copy),
and sends the group back; the trainer computes group-relative advantages (reward minus the
group's mean, over its standard deviation) and takes a clipped policy-gradient step on the
completion tokens, then pushes the policy.

At ``--kill-generator-at STEP`` the trainer SIGKILLs ``gen0``. The publisher drops it, its
``LocalProcessOrchestrator`` starts ``gen-r1``, which joins and receives the latest policy;
the trainer keeps training on the other generators' batches all along, and the log says so.
After a kill the run goes past ``--steps`` until the replacement is in (at most a minute).
Leaves ``grpo.png``, ``grpo.json``, generator logs and flight-recorder dumps in ``runs/grpo-<time>``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import msgspec
import torch

import weightsync as ws
from weightsync.demo.loop import (
    Generators,
    RolloutQueue,
    analyze_summary,
    can_plot,
    dump_recorder,
    example_parser,
    final_delivery,
    generate,
    mean,
    member_rng,
    next_batch,
    run_dir,
    tensor_bytes,
)

CHANNEL = "grpo"
DIGITS, SEP, BOS = 10, 10, 11
VOCAB = 12
N = 5  # digits to reverse
LENGTH = 2 + 2 * N  # BOS, N digits, SEP, N answer digits


class Policy(torch.nn.Module):
    """A 2-layer causal transformer over 12 tokens (about 70k parameters)."""

    def __init__(self, width: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, width)
        self.pos = torch.nn.Embedding(LENGTH, width)
        layer = torch.nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.0, batch_first=True,
                                                 norm_first=True)
        self.body = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(width, VOCAB)
        self.register_buffer("causal", torch.triu(torch.full((LENGTH, LENGTH), float("-inf")), 1), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        h = self.tok(tokens) + self.pos(torch.arange(t))
        return self.head(self.body(h, mask=self.causal[:t, :t], is_causal=True))


class Engine:
    """What an inference engine looks like to weightsync: a model and a ``load_weights``."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = Policy().eval()
        self.params = dict(self.model.state_dict())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in weights:  # views of the received version, one tensor at a time
                self.params[name].copy_(tensor)


class Groups(msgspec.Struct, frozen=True):
    generator: str
    version: int
    prompts: int
    group: int
    tokens: bytes  # int64 [prompts * group, LENGTH]: prompt and completion
    logp: bytes  # float32 [prompts * group, N]: the sampling policy's log-probabilities
    rewards: list[float]  # per completion, in [0, 1]


def make_prompts(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    digits = torch.randint(0, DIGITS, (n, N), generator=generator)
    prompt = torch.cat([torch.full((n, 1), BOS), digits, torch.full((n, 1), SEP)], 1)
    return prompt, digits.flip(1)


def sample_groups(policy: Policy, rng: torch.Generator, member: str, version: int, prompts: int,
                  group: int) -> Groups:
    prompt, answer = make_prompts(prompts, rng)
    tokens = prompt.repeat_interleave(group, 0)
    logps = []
    with torch.no_grad():
        for _ in range(N):
            logp = torch.log_softmax(policy(tokens)[:, -1, :DIGITS], -1)  # answers are digits
            token = torch.multinomial(logp.exp(), 1, generator=rng)
            logps.append(logp.gather(1, token))
            tokens = torch.cat([tokens, token], 1)
    rewards = (tokens[:, -N:] == answer.repeat_interleave(group, 0)).float().mean(1)  # the check
    return Groups(generator=member, version=version, prompts=prompts, group=group,
                  tokens=tensor_bytes(tokens), logp=tensor_bytes(torch.cat(logps, 1)),
                  rewards=rewards.tolist())


def grpo_step(policy: Policy, optimizer: torch.optim.Optimizer, batch: Groups, epochs: int = 2,
              clip: float = 0.2) -> None:
    rows = batch.prompts * batch.group
    tokens = torch.frombuffer(bytearray(batch.tokens), dtype=torch.int64).view(rows, LENGTH)
    old = torch.frombuffer(bytearray(batch.logp), dtype=torch.float32).view(rows, N)
    rewards = torch.tensor(batch.rewards).view(batch.prompts, batch.group)
    advantage = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).view(-1, 1)
    for _ in range(epochs):
        logits = policy(tokens[:, :-1])[:, -N:, :DIGITS]
        logp = torch.log_softmax(logits, -1).gather(2, tokens[:, -N:, None]).squeeze(2)
        ratio = torch.exp(logp - old)
        loss = -torch.min(ratio * advantage, ratio.clamp(1 - clip, 1 + clip) * advantage).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


# generator process ---------------------------------------------------------------------------------------
async def generator(args: argparse.Namespace) -> int:
    engine = Engine()
    rng = member_rng(args.member)
    return await generate(args, CHANNEL, f"rl/{CHANNEL}/groups",
                          load=lambda sub: sub.load(engine.load_weights, timeout=120),  # engine-style
                          sample=lambda version: sample_groups(engine.model, rng, args.member, version,
                                                               args.prompts, args.group))


# trainer -------------------------------------------------------------------------------------------------
class StepRow(msgspec.Struct):
    step: int
    seconds: float
    reward: float
    staleness: int
    push_stall_ms: float
    generator: str
    members: list[str]


class Event(msgspec.Struct):
    step: int
    seconds: float
    what: str


async def trainer(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    out = run_dir(CHANNEL, args.out)
    torch.manual_seed(0)
    policy = Policy()
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr)
    queue = RolloutQueue.host(f"rl/{CHANNEL}/groups")  # rollouts come back on a store of our own
    gens = Generators("rl_examples.grpo", out, queue.address)
    extra = ["--prompts", str(args.prompts), "--group", str(args.group)]
    rows: list[StepRow] = []
    events: list[Event] = []
    print(f"GRPO: reverse {N} digits; 1 trainer + {args.generators} generators, {args.steps} steps, "
          f"{args.prompts} prompts x {args.group} completions per batch; output in {out}", flush=True)
    start = time.monotonic()

    def event(step: int, what: str) -> None:
        events.append(Event(step=step, seconds=time.monotonic() - start, what=what))
        print(f"  ** step {step}: {what}", flush=True)

    async with ws.Publisher(CHANNEL, address="127.0.0.1:0", timeout=4, heartbeat_interval=0.5,
                            flight_recorder_dir=out / "flight-recorder") as pub:
        assert pub.address is not None
        replacements_log = (out / "replacements.log").open("ab")
        pub.orchestrator = ws.LocalProcessOrchestrator(gens.argv(pub.address, "gen-r{n}", extra), env=gens.env(),
                                                       cwd=os.getcwd(), stdout=replacements_log,
                                                       stderr=subprocess.STDOUT)
        try:
            for i in range(args.generators):
                gens.start(pub.address, f"gen{i}", extra)
            await pub.put(policy.state_dict(), version=0)
            await pub.wait_subscribers(args.generators, timeout=120)
            queue.grant(2 * args.generators)  # at most two batches in flight per generator
            print(f"{'step':>5} {'time':>6} {'reward':>7} {'stale':>5} {'push ms':>7}  members", flush=True)
            start = time.monotonic()
            members, dropped, replaced = set(pub.members), 0, False
            kill = 0 < args.kill_generator_at <= args.steps
            overtime, last = None, None
            for step in itertools.count(1):
                if step > args.steps:
                    # after a kill, go on until the replacement is in (at most a minute more)
                    overtime = overtime or time.monotonic() + 60
                    if not kill or replaced or time.monotonic() > overtime:
                        break
                if step == args.kill_generator_at:
                    gens.kill("gen0")
                    event(step, "killed generator gen0 (SIGKILL); training goes on")
                batch = await next_batch(queue, Groups)
                grpo_step(policy, optimizer, batch)
                t0 = time.perf_counter()
                last = await pub.put(policy.state_dict(), version=step)
                stall = (time.perf_counter() - t0) * 1e3
                rows.append(StepRow(step=step, seconds=time.monotonic() - start, reward=mean(batch.rewards),
                                    staleness=step - 1 - batch.version, push_stall_ms=stall,
                                    generator=batch.generator, members=list(pub.members)))
                for info in pub.evicted[dropped:]:
                    event(step, f"publisher dropped {info.member_id} ({info.reason}); asking the orchestrator "
                                f"for a replacement")
                dropped = len(pub.evicted)
                now = set(pub.members)
                for joined in sorted(now - members):
                    event(step, f"{joined} joined; it is sent the latest policy (version {step})")
                    replaced = replaced or (kill and step > args.kill_generator_at)
                members = now
                if step % args.log_every == 0:
                    recent = rows[-args.log_every:]
                    print(f"{step:5d} {rows[-1].seconds:5.1f}s {mean([r.reward for r in recent]):7.3f} "
                          f"{mean([r.staleness for r in recent]):5.2f} {mean([r.push_stall_ms for r in recent]):7.2f}"
                          f"  {','.join(sorted(pub.members))}", flush=True)
            if last is not None:
                print(final_delivery(await last.delivered(timeout=60), len(pub.members)), flush=True)
        finally:
            queue.request_stop()
            killed = await gens.finish(timeout=60)
            if killed and killed != ["gen0"]:
                print(f"killed generators that did not stop: {killed}", file=sys.stderr)
            await pub.aclose()
            orch = pub.orchestrator
            if isinstance(orch, ws.LocalProcessOrchestrator):
                await orch.aclose()
            replacements_log.close()
    dump_recorder(out, reason="trainer finished")
    return report(rows, events, out, args)


def report(rows: list[StepRow], events: list[Event], out: Path, args: argparse.Namespace) -> int:
    (out / "grpo.json").write_bytes(msgspec.json.format(msgspec.json.encode({"steps": rows, "events": events})))
    if can_plot():
        plot(rows, events, out / "grpo.png")
    gaps = [b.seconds - a.seconds for a, b in zip(rows, rows[1:], strict=False)]
    first = mean([r.reward for r in rows[:5]])
    last = mean([r.reward for r in rows[-10:]])
    print(f"\nreward {first:.3f} -> {last:.3f}; longest pause between trainer steps {max(gaps, default=0):.2f} s; "
          f"push stall mean {mean([r.push_stall_ms for r in rows]):.2f} ms")
    print(f"plot: {out / 'grpo.png'}   steps and events: {out / 'grpo.json'}")
    print(analyze_summary(out / "flight-recorder"))
    ok = True
    if args.kill_generator_at and args.kill_generator_at <= args.steps:
        joined = [e for e in events if "joined" in e.what]
        if not joined:
            print("FAIL: no replacement joined after the kill")
            ok = False
    if not args.no_check and last < max(2 * first, 0.6):
        print(f"FAIL: the reward did not improve enough ({first:.3f} -> {last:.3f})")
        ok = False
    return 0 if ok else 1


def plot(rows: list[StepRow], events: list[Event], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r.seconds for r in rows]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    ax1.plot(t, [r.reward for r in rows], ".", alpha=0.5, label="batch mean reward")
    ax1.set_ylabel("reward (fraction of digits right)")
    ax1.set_ylim(0, 1.05)
    ax2.plot(t, [len(r.members) for r in rows], "-", drawstyle="steps-post", label="generators in the channel")
    ax2.plot(t, [r.staleness for r in rows], ".", ms=3, label="batch staleness (versions)")
    ax2.set_xlabel("seconds since training started")
    ax2.legend(loc="upper right", fontsize=8)
    for e in events:
        for ax in (ax1, ax2):
            ax.axvline(e.seconds, color="red" if "killed" in e.what else "grey", lw=0.8, ls="--")
        ax1.annotate(e.what.split(";")[0], (e.seconds, 0.02 + 0.12 * (events.index(e) % 4)), fontsize=7,
                     rotation=0)
    ax1.set_title("GRPO on a tiny transformer over weightsync: one generator killed and replaced")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = example_parser("python -m rl_examples.grpo", __doc__, steps=300, log_every=20)
    parser.add_argument("--prompts", type=int, default=32, help="prompts per batch")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt (GRPO's group)")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--kill-generator-at", type=int, default=60, help="trainer step; 0: nobody dies")
    args = parser.parse_args(argv)
    if min(args.steps, args.generators, args.prompts, args.group, args.log_every) < 1 or args.group < 2:
        parser.error("--steps, --generators, --prompts, --log-every must be >= 1 and --group >= 2")
    if args.kill_generator_at and args.generators < 2:
        parser.error("--kill-generator-at needs at least 2 generators (someone must keep sampling)")
    return asyncio.run(generator(args) if args.role == "generator" else trainer(args))


if __name__ == "__main__":
    raise SystemExit(main())
