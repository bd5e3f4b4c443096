"""An expert-parallel trainer of a Qwen3-MoE model, launched by torchrun (gloo, CPU): every rank
puts its own shards on its own lane (issue 58, item 2). Run by tests/vllm_ep.py:

    python -m torch.distributed.run --standalone --nproc-per-node N -m tests.ep_trainer CHECKPOINT SECRET PLACEMENT

Each layer's stacked experts (``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I])
are DTensors sharded by expert over an expert mesh dimension, as torchtitan places them;
everything else is FSDP2 (``fully_shard``) over all ranks. ``PLACEMENT``: ``ep`` (experts
``Shard(0)`` over every rank), or ``dp-ep`` (a 2 x N/2 mesh: experts ``Shard(0)`` over ``ep`` and
``Replicate()`` over ``dp``, so only the ``dp`` = 0 ranks send them).

Rank 0 reads commands on stdin and hands them to every rank over the trainer's own group:
``put V S`` puts the weights of seed ``S`` (the checkpoint's, each moved by noise from seed ``S``;
every rank computes the same full values and keeps its own boxes) as version ``V`` with
``copy=False`` (nothing staged but two buckets: a member that joins after the put waits for the
next one); ``keep V S`` with a snapshot (``copy=True``: a member that joins later gets it);
``die V S`` as ``put``, but rank 1 kills itself with SIGKILL just before its put; ``save V S``
puts nothing: rank 0 saves the weights of seed ``S`` as a checkpoint ``S<seed>`` beside the one it
started from (what an engine started from it must hold) and says ``saved PATH``. Rank 0 answers
each put on stdout with one JSON line (msgspec): the version, the error
if it failed, and per rank the bytes of its lane and the growth of its resident memory (VmRSS)
from just before ``put`` to ``released()``.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import signal
import sys

import msgspec
import torch
import torch.distributed as dist

import weightsync as ws

COMMANDS = {"put": 1, "die": 2, "quit": 3, "keep": 4, "save": 5}
BUCKET_BYTES = 1 << 20


class Answer(msgspec.Struct):
    command: str
    version: int
    error: str
    lane_bytes: list[int]  # per rank: the bytes of its own shards it staged (its lane)
    growth_mib: list[float]  # per rank: VmRSS growth from before put to released()
    shard_bytes: list[int]  # per rank: the bytes of the parameters it holds


def _rss_mib() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _box(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's box of the full ``value``, placed as the DTensor ``like``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tuple(like.shape), like.device_mesh, like.placements)
    return value[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]


def sharded_model(checkpoint: str, placement: str) -> torch.nn.Module:
    """The checkpoint's model, experts placed as ``placement`` says, the rest fully_shard."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from transformers import AutoModelForCausalLM

    world = dist.get_world_size()
    model = AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    if placement == "ep":
        experts_mesh, places = mesh, [Shard(0)]
    elif placement == "dp-ep" and world % 2 == 0 and world >= 4:
        experts_mesh, places = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "ep")), [Replicate(),
                                                                                                      Shard(0)]
    else:
        raise SystemExit(f"placement {placement!r} does not fit {world} ranks")
    experts: set[torch.nn.Parameter] = set()
    for layer in model.model.layers:
        module = layer.mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(module, name).detach()
            param = torch.nn.Parameter(distribute_tensor(full, experts_mesh, places, src_data_rank=None))
            setattr(module, name, param)
            experts.add(param)
        fully_shard(layer, mesh=mesh, ignored_params={p for p in experts if any(p is q for q in layer.parameters())})
    fully_shard(model, mesh=mesh, ignored_params=experts)
    return model


def seeded(model: torch.nn.Module, base: dict[str, torch.Tensor], seed: int) -> None:
    """Every parameter := its checkpoint value moved by noise of ``seed`` (the same full values on
    every rank; each keeps its own box)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = base[name] + torch.randn(base[name].shape, generator=gen) * 0.02
            local = param.to_local() if hasattr(param, "to_local") else param
            local.copy_(_box(full, param) if hasattr(param, "device_mesh") else full)


def save(checkpoint: str, model: torch.nn.Module, base: dict[str, torch.Tensor], seed: int) -> str:
    """The full weights of ``seed`` (as :func:`seeded` makes them) saved as a checkpoint directory."""
    from transformers import AutoModelForCausalLM

    from rl_examples import _llama

    full = AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, _param in model.named_parameters():  # seeded's order: the same noise
            full.get_parameter(name).copy_(base[name] + torch.randn(base[name].shape, generator=gen) * 0.02)
    path = os.path.join(os.path.dirname(os.path.abspath(checkpoint)), f"S{seed}")
    _llama.save(full, path)
    return path


def owned_bytes(state: dict[str, torch.Tensor]) -> int:
    """The bytes this rank sends of ``state``: its boxes of the tensors it is the sender of (rank
    0 of each replica set: coordinate 0 on every ``Replicate()`` mesh dimension)."""
    total = 0
    for value in state.values():
        if not hasattr(value, "device_mesh"):
            total += value.nbytes if dist.get_rank() == 0 else 0
            continue
        coordinate = value.device_mesh.get_coordinate() or []
        if all(c == 0 for c, p in zip(coordinate, value.placements, strict=True) if p.is_replicate()):
            total += value.to_local().nbytes
    return total


async def serve(checkpoint: str, secret: str, placement: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    from transformers import AutoModelForCausalLM

    base = {k: v.detach().clone() for k, v in
            AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32).named_parameters()}
    model = sharded_model(checkpoint, placement)
    shard = sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in model.parameters())
    loop = asyncio.get_running_loop()
    async with ws.Publisher("experts", group=dist.group.WORLD, secret=secret, timeout=5.0,
                            bucket_bytes=BUCKET_BYTES) as pub:
        if rank == 0:
            print("address", pub.address, flush=True)
        while True:
            order = torch.zeros(3, dtype=torch.int64)
            if rank == 0:
                line = (await loop.run_in_executor(None, sys.stdin.readline)).split() or ["quit", "0", "0"]
                order = torch.tensor([COMMANDS[line[0]], int(line[1]), int(line[2])])
            dist.broadcast(order, 0)  # the trainer's own group: every rank runs the same step
            code, version, seed = (int(x) for x in order)
            if code == COMMANDS["quit"]:
                return
            if code == COMMANDS["save"]:
                if rank == 0:
                    print("saved", save(checkpoint, model, base, seed), flush=True)
                continue
            seeded(model, base, seed)
            if code == COMMANDS["die"] and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            error, before = "", _rss_mib()
            try:
                handle = await pub.put(model.state_dict(), version=version, copy=code == COMMANDS["keep"])
                await handle.released(timeout=60)
                growth = _rss_mib() - before
                await handle.delivered(timeout=60)
            except ws.WeightSyncError as err:
                error, growth = f"{type(err).__name__}: {err}", 0.0
            lane = owned_bytes(model.state_dict())
            facts = torch.tensor([lane, shard, int(growth * 1024)], dtype=torch.int64)
            gathered = [torch.zeros_like(facts) for _ in range(world)] if not error else [facts]
            if not error:
                dist.all_gather(gathered, facts)
            if rank == 0:
                command = next(name for name, c in COMMANDS.items() if c == code)
                answer = Answer(command, version, error, [int(f[0]) for f in gathered], [int(f[2]) / 1024 for f in
                                                                                         gathered],
                                [int(f[1]) for f in gathered])
                print(msgspec.json.encode(answer).decode(), flush=True)
            if error:
                return


def main() -> None:
    checkpoint, secret, placement = sys.argv[1:4]
    # a rank waits for rank 0's next command in a collective: as long as the driver takes between two
    dist.init_process_group("gloo", timeout=dt.timedelta(seconds=600))
    try:
        asyncio.run(serve(checkpoint, secret, placement))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
