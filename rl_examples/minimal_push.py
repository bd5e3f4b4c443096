"""The minimal example: one trainer pushes a few versions to two generator processes on CPU.

Run it with ``python -m rl_examples.minimal_push``. The trainer
hosts the channel, starts two generator processes, "trains" (changes its weights) and pushes
after every step without waiting for the transfer; each generator reads the newest version
it has and reports what it saw. Everything runs on this machine, no servers to start.

Both sides are plain synchronous code, as most training loops are: ``ws.BlockingPublisher`` and
``ws.BlockingSubscriber`` run weightsync's event loop in a thread of their own.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import msgspec
import torch

import weightsync as ws


class GeneratorReport(msgspec.Struct):
    member: str
    versions: list[int]
    exact: list[bool]  # per version seen: every tensor bit-identical to the trainer's at that step


def make_policy(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(4096, 512, generator=gen).to(torch.bfloat16),
        "mlp.fc1.weight": torch.randn(2048, 512, generator=gen),
        "mlp.fc1.bias": torch.zeros(2048),
        "mlp.fc2.weight": torch.randn(512, 2048, generator=gen),
        "head.weight": torch.randn(16, 512, generator=gen),
        "step": torch.tensor(0, dtype=torch.int64),
    }


def train_step(policy: dict[str, torch.Tensor], step: int) -> None:
    """A stand-in optimizer step: deterministic, so a generator can recompute any version."""
    with torch.no_grad():
        policy["mlp.fc1.weight"].mul_(0.99).add_(0.01)
        policy["step"].fill_(step)


def policy_at(version: int) -> dict[str, torch.Tensor]:
    policy = make_policy()
    for step in range(version + 1):
        train_step(policy, step)
    return policy


def generator(address: str, member: str, last_version: int) -> None:
    with ws.BlockingSubscriber("policy", address=address, member_id=member, timeout=20) as sub:
        versions, exact = [], []
        for weights in sub.updates(timeout=60):
            versions.append(weights.version)
            expected = policy_at(weights.version)  # what the trainer put as this version
            exact.append(weights.keys() == expected.keys()
                         and all(torch.equal(weights[k], t) and weights[k].dtype == t.dtype
                                 for k, t in expected.items()))
            if weights.version >= last_version:
                break
    sys.stdout.write(msgspec.json.encode(GeneratorReport(member, versions, exact)).decode() + "\n")


def trainer(steps: int, n_generators: int) -> int:
    policy = make_policy()
    mib = sum(t.numel() * t.element_size() for t in policy.values()) / 2**20
    with ws.BlockingPublisher("policy", address="127.0.0.1:0", timeout=20) as pub:
        print(f"[trainer] channel 'policy' at {pub.address}; policy {mib:.1f} MiB over {len(policy)} tensors")
        procs = [subprocess.Popen([sys.executable, "-m", "rl_examples.minimal_push", "--generator", pub.address,
                                   f"gen{i}", str(steps - 1)], stdout=subprocess.PIPE, text=True)
                 for i in range(n_generators)]
        try:
            pub.wait_subscribers(n_generators, timeout=60)
            print(f"[trainer] generators joined: {', '.join(pub.members)}")
            handles = []
            for step in range(steps):
                train_step(policy, step)  # the weights change every step
                t0 = time.perf_counter()
                handle = pub.put(policy, version=step)
                stall = (time.perf_counter() - t0) * 1e3
                handles.append(handle)
                print(f"[trainer] step {step}: put returned after {stall:.1f} ms (snapshot taken; sending continues)")
            for handle in handles:
                report = handle.delivered(timeout=60)
                state = "superseded by a newer put" if report.superseded else (
                    f"delivered to {len(report.members)} generators in {report.seconds * 1e3:.0f} ms")
                print(f"[trainer] version {report.version}: {state}")
            outputs = [p.communicate(timeout=60)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=10)
    ok = True
    for out in outputs:
        seen = msgspec.json.decode(out.strip().splitlines()[-1], type=GeneratorReport)
        exact = all(seen.exact) and seen.versions[-1] == steps - 1
        ok &= exact and seen.versions == sorted(seen.versions)
        print(f"[{seen.member}] saw versions {seen.versions}; every one "
              f"{'matches the trainer bit for bit' if exact else 'DIFFERS from the trainer'}")
    print("[demo] done: " + ("every generator ended on the trainer's latest weights" if ok else "MISMATCH"))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--generators", type=int, default=2)
    parser.add_argument("--generator", nargs=3, metavar=("ADDRESS", "MEMBER", "LAST_VERSION"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.generator:
        address, member, last = args.generator
        generator(address, member, int(last))
        return 0
    if args.steps < 1 or args.generators < 1:
        parser.error("--steps and --generators must be >= 1")
    from weightsync.fr import install_signal_handler

    install_signal_handler()  # `kill -USR1 <pid>` dumps this trainer's flight recorder
    return trainer(args.steps, args.generators)


if __name__ == "__main__":
    raise SystemExit(main())
