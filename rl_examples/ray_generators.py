"""weightsync in Ray actors: a trainer actor publishes, generator actors subscribe, one generator
is killed with ``ray.kill`` and a :class:`~weightsync.integrations.ray.RayOrchestrator` replaces it
while the trainer keeps training and putting.

Run it with ``python -m rl_examples.ray_generators`` (needs ``pip install 'weightsync[ray]'``). It
starts a local Ray cluster unless ``--address`` names one (``auto`` for the one ``ray start``
made). The trainer's address reaches the generators through Ray (``Trainer.start`` returns it);
the weights go over weightsync, never through Ray's object store. It prints one line per phase
and a verdict, and exits 1 unless every version every generator received is bit-identical to the
trainer's, the replacement joined and received the newest versions, and no ``put`` waited for a
generator.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import weightsync as ws

CHANNEL = "policy"
REPO = Path(__file__).resolve().parents[1]

try:
    import ray
except ImportError:  # the module stays importable (and its docs testable) without Ray
    ray = None  # type: ignore[assignment]


def digest(tensors: Any) -> str:
    """One sha256 over every tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class Policy(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, width), torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class TrainerActor:
    """Trains a small regression policy; after every step puts its weights without waiting."""

    def __init__(self, width: int = 1024, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = Policy(width)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-2)
        self.version = -1
        self.digests: dict[int, str] = {}
        self.put_seconds: list[float] = []
        self.handles: list[Any] = []
        self.pub: ws.Publisher | None = None
        self.orchestrator: Any = None

    async def start(self, generator_class: Any, timeout: float = 4.0) -> str:
        """Start the publisher and its Ray orchestrator; the address goes back through Ray."""
        from weightsync.integrations.ray import RayOrchestrator  # noqa: PLC0415 - Ray is optional

        self.pub = ws.Publisher(CHANNEL, timeout=timeout, heartbeat_interval=0.25)
        await self.pub.start()
        # set once the address is known: each replacement gets it, and its new member id
        self.orchestrator = RayOrchestrator(generator_class, self.pub.address, "{new}", member_id="repl-{n}",
                                            options={"num_cpus": 0})
        self.pub.orchestrator = self.orchestrator
        return self.pub.address

    def adopt(self, generators: dict[str, Any]) -> None:
        """The generator actors the application started: the orchestrator may kill these (a slow one
        it drops), and only these and its own."""
        self.orchestrator.adopt(generators)

    async def wait_generators(self, n: int, timeout: float = 120.0) -> list[str]:
        assert self.pub is not None
        return await self.pub.wait_subscribers(n, timeout=timeout)

    async def train(self, steps: int) -> int:
        """``steps`` optimizer steps, each followed by a put; returns the newest version."""
        assert self.pub is not None
        for _ in range(steps):
            x = torch.randn(64, 16)
            loss = (self.model(x) - x.sum(dim=1, keepdim=True).sin()).pow(2).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            self.version += 1
            state = self.model.state_dict()
            self.digests[self.version] = digest(state)
            t0 = time.perf_counter()
            self.handles.append(await self.pub.put(state, version=self.version))
            self.put_seconds.append(time.perf_counter() - t0)
            self.handles = self.handles[-8:]
            await asyncio.sleep(0)  # let the actor's other calls (members, digests) in between steps
        return self.version

    async def members(self) -> list[str]:
        assert self.pub is not None
        return list(self.pub.members)

    async def flush(self, timeout: float = 60.0) -> list[str]:
        """Wait for the newest version's delivery; returns who has it."""
        assert self.handles
        return list((await self.handles[-1].delivered(timeout=timeout)).members)

    async def report(self) -> dict[str, Any]:
        assert self.pub is not None
        return {"digests": self.digests, "put_seconds": self.put_seconds,
                "evicted": [(m.member_id, m.reason) for m in self.pub.evicted],
                "replacements": [new for _old, new, _handle in self.orchestrator.started]}

    async def close(self) -> None:
        if self.pub is not None:
            await self.pub.aclose()
        if self.orchestrator is not None:
            await self.orchestrator.aclose()


class GeneratorActor:
    """Follows every version it can get and keeps each one's digest."""

    def __init__(self, address: str, member_id: str) -> None:
        self.address, self.member_id = address, member_id
        self.received: dict[int, str] = {}
        self.sub: ws.Subscriber | None = None
        self.task: asyncio.Task[None] | None = None
        self.error = ""
        self.read = asyncio.Event()  # set after each version read (report waits for the newest on it)

    async def ready(self) -> str:
        """Join the channel (returns once admitted) and start following it."""
        if self.sub is None:
            self.sub = ws.Subscriber(CHANNEL, address=self.address, member_id=self.member_id, timeout=20)
            await self.sub.start()
            self.task = asyncio.get_running_loop().create_task(self._follow())
        return self.member_id

    async def _follow(self) -> None:
        assert self.sub is not None
        try:
            async for weights in self.sub.updates(timeout=600):
                self.received[weights.version] = digest(weights)
                self.read.set()
        except (ws.PublisherGone, ws.Evicted, ws.SyncTimeout) as err:
            self.error = type(err).__name__
        self.read.set()

    async def report(self, newest: int = -1, timeout: float = 30.0) -> dict[str, Any]:
        """What it read, once it read ``newest`` (delivered to it: the publisher's report says it is
        readable here, and this actor's loop reads it next) or stopped, or after ``timeout``."""
        deadline = time.monotonic() + timeout
        while newest not in self.received and not self.error and self.task is not None and not self.task.done():
            self.read.clear()
            try:
                await asyncio.wait_for(self.read.wait(), max(deadline - time.monotonic(), 0.0))
            except asyncio.TimeoutError:
                break
        return {"member": self.member_id, "received": self.received, "error": self.error}

    async def close(self) -> None:
        if self.sub is not None:
            await self.sub.aclose()


def remote_classes() -> tuple[Any, Any]:
    """The two actor classes as Ray actors (CPU actors taking no CPU slot: they mostly wait)."""
    if ray is None:
        raise SystemExit("this example needs Ray: pip install 'weightsync[ray]'")
    return ray.remote(num_cpus=0)(TrainerActor), ray.remote(num_cpus=0)(GeneratorActor)


def run(generators: int = 2, steps: int = 3, width: int = 1024, deadline: float = 180.0,
        say: Any = print) -> dict[str, Any]:
    """The whole run on the Ray cluster this process is connected to; returns what it measured."""
    trainer_cls, generator_cls = remote_classes()
    trainer = trainer_cls.options(name="trainer").remote(width=width)
    # the cluster's first actor: a new worker process imports torch and weightsync first, which
    # took more than 60 s with a busy loop beside it on 2 cores
    address = ray.get(trainer.start.remote(generator_cls), timeout=deadline)
    gens = {f"gen{i}": generator_cls.options(name=f"gen{i}").remote(address, f"gen{i}") for i in range(generators)}
    ray.get([g.ready.remote() for g in gens.values()], timeout=120)
    ray.get(trainer.adopt.remote(gens), timeout=60)
    ray.get(trainer.wait_generators.remote(generators), timeout=130)
    say(f"trainer actor publishing at {address}; generators joined: {', '.join(gens)}")
    ray.get(trainer.train.remote(steps), timeout=deadline)
    ray.get(trainer.flush.remote(), timeout=deadline)
    victim = f"gen{generators - 1}"
    ray.kill(gens.pop(victim), no_restart=True)
    t_kill = time.monotonic()
    killed_at = ray.get(trainer.train.remote(1), timeout=deadline)
    say(f"ray.kill({victim}) after version {killed_at - 1}; the trainer keeps putting")
    stop = time.monotonic() + deadline
    while "repl-1" not in ray.get(trainer.members.remote(), timeout=60):
        ray.get(trainer.train.remote(1), timeout=deadline)
        if time.monotonic() > stop:
            raise TimeoutError(f"no replacement joined within {deadline:g} s")
    replace_seconds = time.monotonic() - t_kill
    joined_at = ray.get(trainer.train.remote(steps), timeout=deadline)
    members = ray.get(trainer.flush.remote(), timeout=deadline)
    say(f"repl-1 joined {replace_seconds:.1f} s after the kill; "
        f"version {joined_at} delivered to {', '.join(sorted(members))}")
    gens["repl-1"] = ray.get_actor("repl-1")
    trainer_report = ray.get(trainer.report.remote(), timeout=60)
    reports = ray.get([g.report.remote(joined_at if name in members else -1) for name, g in gens.items()], timeout=60)
    ray.get([g.close.remote() for g in gens.values()], timeout=60)
    ray.get(trainer.close.remote(), timeout=60)
    for handle in [trainer, *gens.values()]:
        ray.kill(handle, no_restart=True)
    truth = trainer_report["digests"]
    mismatched = {r["member"]: [v for v, d in r["received"].items() if truth.get(v) != d] for r in reports}
    result = {
        "address": address, "killed": victim, "versions": len(truth), "killed_at": killed_at,
        "replaced_by": trainer_report["replacements"], "evicted": trainer_report["evicted"],
        "versions_put_while_replacing": joined_at - steps - killed_at, "replace_seconds": replace_seconds,
        "members_of_last_version": sorted(members),
        "received": {r["member"]: sorted(r["received"]) for r in reports},
        "mismatched": {m: v for m, v in mismatched.items() if v},
        "max_put_seconds": max(trainer_report["put_seconds"]),
        "newest": joined_at,
    }
    result["ok"] = (not result["mismatched"] and result["replaced_by"] == ["repl-1"]
                    and sorted(members) == sorted(gens) and joined_at in result["received"]["repl-1"]
                    and all(joined_at in v for v in result["received"].values()))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", help="a running Ray cluster (default: start a local one)")
    parser.add_argument("--generators", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="versions before the kill and after the replacement")
    parser.add_argument("--width", type=int, default=1024, help="hidden width of the policy")
    args = parser.parse_args(argv)
    if ray is None:
        print("this example needs Ray: pip install 'weightsync[ray]'", file=sys.stderr)
        return 2
    temp = None
    if args.address:
        ray.init(address=args.address)
    else:  # a short temp dir: Ray's socket paths must stay under the Unix limit
        temp = tempfile.mkdtemp(prefix="wsray-")
        ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, _temp_dir=temp,
                 runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}}, log_to_driver=True)
    try:
        result = run(args.generators, args.steps, args.width)
    finally:
        ray.shutdown()
        if temp is not None:
            import shutil  # noqa: PLC0415

            shutil.rmtree(temp, ignore_errors=True)
    print(f"{result['versions']} versions; {result['versions_put_while_replacing']} put while {result['killed']} "
          f"was replaced by {', '.join(result['replaced_by'])} ({result['replace_seconds']:.1f} s); "
          f"every received version bit-identical: "
          f"{not result['mismatched']}; slowest put {result['max_put_seconds'] * 1e3:.1f} ms")
    print("OK" if result["ok"] else f"FAILED: {result}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
