"""The demo: an asynchronous actor-learner loop that learns CartPole, on CPU, in about a minute.

    weightsync demo                        # from any install; in a checkout: make demo
    weightsync demo --steps 6 --no-check   # the short mode CI runs

One trainer process and three generator processes. The trainer hosts a weightsync channel,
starts the generators, and after every optimizer step pushes the policy with ``await
pub.put(...)``, which returns as soon as the snapshot is taken. Each generator samples episodes
of CartPole (its dynamics written in torch, vectorized) with the newest policy it has, tags the
batch with that version and sends it back on a queue of the publisher's store. The trainer
learns from whatever batch comes next (PPO's clipped ratio absorbs the staleness) and reports
how stale each batch was and how long each push stalled it.

It leaves, in ``runs/cartpole-<time>/`` (or ``--out``): ``cartpole.png`` (return and staleness
over time), ``cartpole.json`` (every step), the logs of the generators, and every process's
flight-recorder dump under ``flight-recorder/``. It exits 1 if the policy did not improve.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
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

CHANNEL = "cartpole"
MAX_STEPS = 500  # an episode's cap: the best return
HIDDEN = 64


# CartPole (Barto, Sutton & Anderson 1983; the classic control constants), batched in torch ----------
class CartPole:
    GRAVITY, CART, POLE, HALF_LENGTH, FORCE, TAU = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
    X_LIMIT, THETA_LIMIT = 2.4, 12 * math.pi / 180

    def __init__(self, n: int, generator: torch.Generator) -> None:
        self.n, self.generator = n, generator
        self.state = torch.zeros(n, 4)

    def reset(self) -> torch.Tensor:
        self.state = (torch.rand(self.n, 4, generator=self.generator) - 0.5) * 0.1
        return self.state.clone()

    def step(self, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Advance every environment by one tick; returns (observation, done)."""
        x, x_dot, theta, theta_dot = self.state.unbind(1)
        total = self.CART + self.POLE
        force = (action.float() * 2 - 1) * self.FORCE
        cos, sin = torch.cos(theta), torch.sin(theta)
        temp = (force + self.POLE * self.HALF_LENGTH * theta_dot**2 * sin) / total
        theta_acc = (self.GRAVITY * sin - cos * temp) / (
            self.HALF_LENGTH * (4.0 / 3.0 - self.POLE * cos**2 / total))
        x_acc = temp - self.POLE * self.HALF_LENGTH * theta_acc * cos / total
        self.state = torch.stack([x + self.TAU * x_dot, x_dot + self.TAU * x_acc,
                                  theta + self.TAU * theta_dot, theta_dot + self.TAU * theta_acc], 1)
        done = (self.state[:, 0].abs() > self.X_LIMIT) | (self.state[:, 2].abs() > self.THETA_LIMIT)
        return self.state.clone(), done


def make_policy(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, HIDDEN),
                               torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 2))


# the wire format of a batch of episodes ----------------------------------------------------------------
class Batch(msgspec.Struct, frozen=True):
    generator: str
    version: int  # the policy version that sampled every step of it
    steps: int  # rows below
    obs: bytes  # float32 [steps, 4]
    actions: bytes  # int64 [steps]
    logp: bytes  # float32 [steps]: the sampling policy's log-probability
    advantages: bytes  # float32 [steps]: discounted return-to-go minus a per-timestep baseline
    episode_returns: list[float]
    sample_seconds: float


def sample_batch(policy: torch.nn.Module, env: CartPole, generator: torch.Generator, member: str,
                 version: int, gamma: float = 0.99) -> Batch:
    t0 = time.perf_counter()
    obs = env.reset()
    alive = torch.ones(env.n, dtype=torch.bool)
    rows_obs, rows_act, rows_logp, rows_alive = [], [], [], []
    with torch.no_grad():
        for _ in range(MAX_STEPS):
            logp_all = torch.log_softmax(policy(obs), 1)
            action = torch.multinomial(logp_all.exp(), 1, generator=generator).squeeze(1)
            rows_obs.append(obs)
            rows_act.append(action)
            rows_logp.append(logp_all.gather(1, action[:, None]).squeeze(1))
            rows_alive.append(alive.clone())
            obs, done = env.step(action)
            alive = alive & ~done
            if not alive.any():
                break
    mask = torch.stack(rows_alive).float()  # [T, E]: 1 while the episode runs (reward 1 per step)
    to_go = torch.zeros_like(mask)
    running = torch.zeros(env.n)
    for t in reversed(range(mask.shape[0])):
        running = mask[t] + gamma * running * mask[t]
        to_go[t] = running
    baseline = (to_go * mask).sum(1) / mask.sum(1).clamp(min=1)  # the mean return-to-go at each tick
    keep = mask.bool()
    advantages = (to_go - baseline[:, None])[keep]
    def rows(tensors: list[torch.Tensor]) -> bytes:
        return tensor_bytes(torch.stack(tensors)[keep])

    return Batch(generator=member, version=version, steps=int(keep.sum()), obs=rows(rows_obs),
                 actions=rows(rows_act), logp=rows(rows_logp), advantages=tensor_bytes(advantages),
                 episode_returns=mask.sum(0).tolist(), sample_seconds=time.perf_counter() - t0)


# generator process ---------------------------------------------------------------------------------------
async def generator(args: argparse.Namespace) -> int:
    policy = make_policy()
    rng = member_rng(args.member)
    env = CartPole(args.episodes, rng)
    return await generate(args, CHANNEL, f"rl/{CHANNEL}/batches",
                          load=lambda sub: sub.get_into(policy.state_dict(), timeout=120),
                          sample=lambda version: sample_batch(policy, env, rng, args.member, version))


# trainer -------------------------------------------------------------------------------------------------
class StepRow(msgspec.Struct):
    step: int
    seconds: float  # since training started
    mean_return: float
    staleness: int  # policy versions between the batch's and the one it updates
    push_stall_ms: float  # how long `await pub.put(...)` held the trainer
    generator: str


def ppo_update(policy: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, epochs: int,
               clip: float = 0.2) -> None:
    obs = torch.frombuffer(bytearray(batch.obs), dtype=torch.float32).view(batch.steps, 4)
    actions = torch.frombuffer(bytearray(batch.actions), dtype=torch.int64)
    old_logp = torch.frombuffer(bytearray(batch.logp), dtype=torch.float32)
    adv = torch.frombuffer(bytearray(batch.advantages), dtype=torch.float32)
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    for _ in range(epochs):
        logp = torch.log_softmax(policy(obs), 1).gather(1, actions[:, None]).squeeze(1)
        ratio = torch.exp(logp - old_logp)  # corrects for the batch's (stale) sampling policy
        loss = -torch.min(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


async def trainer(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    out = run_dir(CHANNEL, args.out)
    policy = make_policy()
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr)
    rows: list[StepRow] = []
    queue = RolloutQueue.host(f"rl/{CHANNEL}/batches")  # rollouts come back on a store of our own
    gens = Generators("weightsync.demo.cartpole", out, queue.address)
    print(f"demo: CartPole, 1 trainer + {args.generators} generators, {args.steps} steps; "
          f"output in {out}", flush=True)
    async with ws.Publisher(CHANNEL, address="127.0.0.1:0", timeout=30, heartbeat_interval=0.5,
                            flight_recorder_dir=out / "flight-recorder") as pub:
        assert pub.address is not None
        try:
            for i in range(args.generators):
                gens.start(pub.address, f"gen{i}", ["--episodes", str(args.episodes)])
            await pub.put(policy.state_dict(), version=0)
            await pub.wait_subscribers(args.generators, timeout=120)
            queue.grant(2 * args.generators)  # at most two batches in flight per generator
            print(f"{'step':>5} {'time':>6} {'return':>7} {'stale':>5} {'push ms':>7}  from", flush=True)
            start = time.monotonic()
            last = None
            for step in range(1, args.steps + 1):
                batch = await next_batch(queue, Batch)
                ppo_update(policy, optimizer, batch, args.epochs)
                t0 = time.perf_counter()
                last = await pub.put(policy.state_dict(), version=step)  # returns after the snapshot
                stall = (time.perf_counter() - t0) * 1e3
                rows.append(StepRow(step=step, seconds=time.monotonic() - start,
                                    mean_return=mean(batch.episode_returns), staleness=step - 1 - batch.version,
                                    push_stall_ms=stall, generator=batch.generator))
                if step % args.log_every == 0 or step == args.steps:
                    recent = rows[-args.log_every:]
                    print(f"{step:5d} {rows[-1].seconds:5.1f}s {mean([r.mean_return for r in recent]):7.1f} "
                          f"{mean([r.staleness for r in recent]):5.2f} {mean([r.push_stall_ms for r in recent]):7.2f}"
                          f"  {batch.generator}", flush=True)
            if last is not None:
                print(final_delivery(await last.delivered(timeout=60), args.generators), flush=True)
        finally:
            queue.request_stop()
            killed = await gens.finish(timeout=60)
            if killed:
                print(f"killed generators that did not stop: {killed}", file=sys.stderr)
    dump_recorder(out, reason="trainer finished")
    return report(rows, out, check=not args.no_check)


def report(rows: list[StepRow], out: Path, *, check: bool) -> int:
    (out / "cartpole.json").write_bytes(msgspec.json.format(msgspec.json.encode(rows)))
    if can_plot():
        plot(rows, out / "cartpole.png")
    head = rows[: max(1, min(5, len(rows) // 4))]
    tail = rows[-max(1, min(10, len(rows) // 4)):]
    first, last = mean([r.mean_return for r in head]), mean([r.mean_return for r in tail])
    stale = [r.staleness for r in rows]
    print(f"\nreturn {first:.1f} -> {last:.1f} (best possible {MAX_STEPS}); staleness mean {mean(stale):.2f}, "
          f"max {max(stale) if stale else 0} versions; push stall mean {mean([r.push_stall_ms for r in rows]):.2f} ms, "
          f"max {max((r.push_stall_ms for r in rows), default=0):.2f} ms")
    print(f"plot: {out / 'cartpole.png'}   steps: {out / 'cartpole.json'}")
    print(analyze_summary(out / "flight-recorder"))
    improved = last >= max(3 * first, 150.0)
    if check and not improved:
        print(f"FAIL: the policy did not improve enough ({first:.1f} -> {last:.1f}; wanted >= 3x and >= 150)")
        return 1
    return 0


def plot(rows: list[StepRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r.seconds for r in rows]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    ax1.plot(t, [r.mean_return for r in rows], ".", alpha=0.35, label="batch mean return")
    window = 10
    smooth = [mean([r.mean_return for r in rows[max(0, i - window + 1): i + 1]]) for i in range(len(rows))]
    ax1.plot(t, smooth, "-", label=f"mean of the last {window}")
    ax1.axhline(MAX_STEPS, color="grey", lw=0.8, ls="--")
    ax1.set_ylabel("episode return")
    ax1.legend(loc="lower right")
    ax1.set_title("CartPole, asynchronous actor-learner over weightsync (CPU)")
    ax2.plot(t, [r.staleness for r in rows], ".", label="batch staleness (versions)")
    ax2.set_ylabel("staleness (versions)")
    ax3 = ax2.twinx()
    ax3.plot(t, [r.push_stall_ms for r in rows], "r.", alpha=0.5, ms=3, label="push stall (ms)")
    ax3.set_ylabel("push stall (ms)", color="r")
    ax2.set_xlabel("seconds since training started")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = example_parser("weightsync demo", __doc__, steps=150, log_every=10)
    parser.add_argument("--episodes", type=int, default=16, help="episodes per batch")
    parser.add_argument("--epochs", type=int, default=4, help="PPO epochs per batch")
    parser.add_argument("--lr", type=float, default=5e-4)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.generators < 1 or args.episodes < 1 or args.log_every < 1:
        parser.error("--steps, --generators, --episodes and --log-every must be >= 1")
    return asyncio.run(generator(args) if args.role == "generator" else trainer(args))


if __name__ == "__main__":
    raise SystemExit(main())
