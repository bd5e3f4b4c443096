"""Worker processes for multi-process tests: ``python -m tests.workers '<json spec>'``.

The spec and the result are msgspec JSON (never pickle). Every wait has a deadline; the
test that spawned the worker kills it if it outlives the test's own deadline.
"""

from __future__ import annotations

import asyncio
import faulthandler
import os
import signal
import sys
import threading
import time

import msgspec
import torch

import weightsync as ws
from tests.statedicts import digests
from weightsync.recorder.recorder import process_recorder
from weightsync.testing import Faults, inject, set_default_pipeline, set_default_transport


async def subscriber(spec: dict) -> dict:
    """Join, collect versions until ``until_version``, digest each one seen."""
    seen: dict[int, dict[str, str]] = {}
    order: list[int] = []
    error = error_message = ""
    mode = spec.get("mode", "get")
    want = None
    if spec.get("want"):  # a sliced member taking these tensors (name -> [shape, dtype]) whole
        want = {name: torch.empty(shape, dtype=getattr(torch, dtype)) for name, (shape, dtype) in spec["want"].items()}
    sub = ws.Subscriber(spec["channel"], address=spec["address"], member_id=spec["member"],
                        timeout=spec.get("timeout", 10.0), flight_recorder_dir=spec.get("fr_dir"),
                        transport=spec.get("transport"), want=want, backend=spec.get("backend", "auto"),
                        device=spec.get("device"))
    if spec.get("faults"):  # a fault plan for this worker (see weightsync.testing)
        inject(sub, Faults(**spec["faults"]))
    async with sub:
        baseline = _status_mib("VmRSS")  # joined, nothing received yet
        if spec.get("ready_file"):
            open(spec["ready_file"], "w").close()
        deadline = time.monotonic() + spec.get("deadline", 60)
        if mode == "follow":  # every version we can get, until the publisher shuts down
            last = -1
            while time.monotonic() < deadline:
                try:
                    w = await sub.get(min_version=last + 1, timeout=deadline - time.monotonic())
                except (ws.PublisherGone, ws.Evicted) as err:
                    error, error_message = type(err).__name__, str(err)
                    break
                order.append(w.version)
                seen[w.version] = digests(w)
                last = w.version
        elif mode == "readme":  # the README's generator loop: rejoin when evicted, stop when the trainer is gone
            last, errors = -1, []
            model = {name: torch.zeros(shape) for name, shape in spec["shapes"].items()}
            while time.monotonic() < deadline:
                try:
                    last = await sub.get_into(model, min_version=last + 1, only_newer=True,
                                              timeout=deadline - time.monotonic())
                except ws.Evicted:
                    errors.append("Evicted")
                    await sub.rejoin()
                    continue
                except ws.PublisherGone:
                    errors.append("PublisherGone")
                    break
                order.append(last)
                seen[last] = digests(model)
            error = ",".join(errors)
        elif mode == "updates":
            async for w in sub.updates(timeout=deadline - time.monotonic()):
                order.append(w.version)
                seen[w.version] = digests(w)
                if spec.get("progress_file"):  # what it read so far, for a test that must not outrun it
                    with open(spec["progress_file"], "a") as f:
                        f.write(f"{w.version}\n")
                if spec.get("sleep"):
                    await asyncio.sleep(spec["sleep"])  # a slow consumer, on purpose
                if w.version >= spec["until_version"]:
                    break
        else:
            last = -1
            while last < spec["until_version"]:
                w = await sub.get(min_version=last + 1, timeout=deadline - time.monotonic())
                order.append(w.version)
                seen[w.version] = digests(w)
                last = w.version
    return {"member": spec["member"], "order": order, "digests": {str(k): v for k, v in seen.items()},
            "transport": sub.transport, "error": error, "error_message": error_message,
            "checksum_failures": sub.statistics().checksum_failures,
            # the kernel's own count, not the library's: the most memory this process ever held
            "rss_baseline_mib": baseline, "rss_peak_mib": _status_mib("VmHWM")}


def _status_mib(field: str) -> float:
    """A memory figure of this process from /proc/self/status, in MiB (0 where there is none)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


async def coexist(spec: dict) -> dict:
    """A user's own init_process_group world keeps working beside a weightsync channel."""
    import datetime as dt

    import torch.distributed as dist

    rank = spec["rank"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['world_port']}", rank=rank, world_size=2,
                            timeout=dt.timedelta(seconds=30))
    t = torch.ones(4) * (rank + 1)
    dist.all_reduce(t)
    before = t.tolist()
    sub_result = await subscriber(spec)
    t = torch.ones(4) * (rank + 1)
    dist.all_reduce(t)
    after = t.tolist()
    dist.barrier()
    dist.destroy_process_group()
    return {**sub_result, "before": before, "after": after}


async def publisher(spec: dict) -> dict:
    """Host a channel, write its address to a file, push a version every 50 ms until killed."""
    async with ws.Publisher(spec["channel"], timeout=spec.get("timeout", 10.0), heartbeat_interval=0.25) as pub:
        tmp = spec["address_file"] + ".tmp"
        with open(tmp, "w") as fh:
            fh.write(pub.address or "")
        os.replace(tmp, spec["address_file"])
        await pub.wait_subscribers(spec.get("subscribers", 1), timeout=60)
        version = 0
        deadline = time.monotonic() + spec.get("deadline", 60)
        while time.monotonic() < deadline:
            await (await pub.put({"w": torch.full((1000,), float(version))}, version=version)).delivered(timeout=30)
            version += 1
            await asyncio.sleep(0.05)
    return {"versions": version}


async def dies_mid_commit(spec: dict) -> dict:
    """An ``activation="all"`` publisher that dies (SIGKILL, from its own sender thread) while it
    commits version ``die_at``: the Commit reaches the first member and nobody else, as when a
    trainer is OOM-killed inside the commit loop."""
    from weightsync import _wire
    from weightsync.membership.generations import Generations

    tell = Generations.tell

    def dying_tell(self: Generations, members: object, message: object) -> None:
        if isinstance(message, _wire.Commit) and message.version == spec["die_at"] and not message.settled:
            tell(self, sorted(members)[:1], message)  # type: ignore[call-overload]
            # the control thread writes that Commit, then (its next callback, in order) kills us
            self.control._loop.call_soon_threadsafe(os.kill, os.getpid(), signal.SIGKILL)  # type: ignore[attr-defined]
            threading.Event().wait(30)  # nobody else is told meanwhile; the process is gone long before
        tell(self, members, message)  # type: ignore[arg-type]

    Generations.tell = dying_tell  # type: ignore[method-assign]
    async with ws.Publisher(spec["channel"], timeout=spec.get("timeout", 5.0), heartbeat_interval=0.25,
                            activation="all", encoding="full") as pub:
        tmp = spec["address_file"] + ".tmp"
        with open(tmp, "w") as fh:
            fh.write(pub.address or "")
        os.replace(tmp, spec["address_file"])
        await pub.wait_subscribers(spec.get("subscribers", 2), timeout=60)
        for version in range(spec["die_at"] + 1):
            await (await pub.put({"w": torch.full((1000,), float(version))}, version=version)).delivered(timeout=30)
    return {"versions": spec["die_at"]}


async def sharded_trainer(spec: dict) -> dict:
    """One rank of an FSDP2 trainer (gloo, CPU): every rank puts ``model.state_dict()`` itself.

    The model has uneven shards (dims not divisible by the world), mixed dtypes, a replicated
    DTensor and a plain buffer; with ``mesh=[R, S]`` it is HSDP (Replicate, Shard(0)). The
    full tensors each version should be are digested (``full_tensor()``) before it is put.
    """
    import datetime as dt

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from tests.statedicts import TP_OF_FSDP, digest, fsdp_model, tp_box

    rank, world = spec["rank"], spec["world"]
    store = dist.TCPStore("127.0.0.1", spec["store_port"], is_master=False, timeout=dt.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=dt.timedelta(seconds=60))
    shape = tuple(spec.get("mesh") or (world,))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard") if len(shape) == 2 else ("shard",))
    model = fsdp_model(mesh)
    flat_mesh = init_device_mesh("cpu", (world,))
    replicated = distribute_tensor(torch.arange(10, dtype=torch.float64), flat_mesh, [Replicate()])
    # "big": weights whose 128x128 blocks and rows span two ranks' shards (rows 300 and columns 300
    # split in two at 150), one sharded by rows and one by columns, for put(quantize=)
    gen = torch.Generator().manual_seed(5)
    big = {"big.rows.weight": distribute_tensor(torch.randn(300, 260, generator=gen), flat_mesh, [Shard(0)]),
           "big.cols.weight": distribute_tensor(torch.randn(130, 300, generator=gen), flat_mesh, [Shard(1)])}
    address = spec.get("address")
    if rank and not address and not spec.get("use_group"):  # rank 0's pub.address, handed over as users do
        deadline = time.monotonic() + 60
        while not os.path.exists(spec["address_file"]) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        with open(spec["address_file"]) as fh:
            address = fh.read()
    kwargs = {"group": dist.group.WORLD} if spec.get("use_group") else {
        "rank": rank, "world_size": world, "address": address if rank else "127.0.0.1:0"}
    expected: dict[str, dict[str, str]] = {}
    error = ""
    sent_full = 0
    async with ws.Publisher(spec["channel"], timeout=spec.get("timeout", 10.0), heartbeat_interval=0.25,
                            bucket_bytes=spec.get("bucket_bytes", 64 << 10), pipeline=spec.get("pipeline"),
                            **kwargs) as pub:
        if rank == 0 and not spec.get("use_group") and spec.get("address_file"):
            tmp = spec["address_file"] + ".tmp"
            with open(tmp, "w") as fh:
                fh.write(pub.address or "")
            os.replace(tmp, spec["address_file"])
        if rank == 0 and spec.get("use_group") and spec.get("address_file"):
            with open(spec["address_file"] + ".tmp", "w") as fh:
                fh.write(pub.address or "")
            os.replace(spec["address_file"] + ".tmp", spec["address_file"])
        await pub.wait_subscribers(spec.get("subscribers", 1), timeout=60)
        encodings: dict[str, dict[str, str]] = {}  # per version: what each member got of this rank's lane
        for version in range(spec["versions"]):
            with torch.no_grad():
                for p in model.parameters():
                    local = p.to_local().view(-1)
                    # "nudge": one element in 17 of each shard moves (an RL step: deltas apply), else every one
                    (local[version % 17::17] if spec.get("nudge") else local).add_(1)
            sd = dict(model.state_dict())
            sd["shared.replicated"] = replicated + version
            sd["plain.step"] = torch.tensor([version, rank * 0], dtype=torch.int32)
            if spec.get("big"):
                sd.update({k: v * (1 + version) for k, v in big.items()})
            poisoned = spec.get("nan_at") == version  # one element of one rank's shard: no scale represents it
            if poisoned and rank == spec.get("nan_rank"):
                sd["big.rows.weight"].to_local()[0, 0] = float("nan")
            full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in sd.items()}
            cast = getattr(torch, spec["cast"]) if spec.get("cast") else None  # put(dtype=): what members hold
            if spec.get("quantize") and not poisoned:  # what the whole version quantized in one place would be
                full = ws.quantize(full, spec["quantize"], dtype=cast)
            elif cast is not None:
                full = {k: (v.to(cast) if v.is_floating_point() else v) for k, v in full.items()}
            expected[str(version)] = {k: digest(v) for k, v in full.items()}
            for r in range(spec.get("tp", 0)):  # what tensor-parallel generator rank r should hold
                expected[f"{version}/tp{r}"] = {k: digest(tp_box(full[k], dim, r, spec["tp"]))
                                                for k, (_shape, _dtype, dim) in TP_OF_FSDP.items()}
            sent_full = max(sent_full, sum(v.numel() * v.element_size() for v in full.values()))
            if spec.get("die_at") == version and rank == spec.get("die_rank"):
                os.kill(os.getpid(), signal.SIGSTOP if spec.get("die_by") == "stop" else signal.SIGKILL)
            try:
                handle = await pub.put(sd, version=version, dtype=cast, copy=not spec.get("nocopy"),
                                       encoding=spec.get("encoding"), quantize=spec.get("quantize"))
                report = await handle.delivered(timeout=60)
                encodings[str(version)] = dict(report.encodings)
            except (ws.WeightSyncError, ValueError) as err:  # ValueError: a put refused at the call
                error = f"{type(err).__name__}: {err}"
                break
        if spec.get("dump_at_end"):
            process_recorder().dump(reason="trainer finished")
    dist.destroy_process_group()
    return {"rank": rank, "expected": expected, "error": error, "full_bytes": sent_full, "encodings": encodings}


async def pp_trainer(spec: dict) -> dict:
    """One rank of a PP=2 x TP=2 trainer following docs/sharding.md's Megatron recipe: every rank
    builds every stage's entries, each on that stage's TP mesh, from its own slices only."""
    import datetime as dt

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from tests.statedicts import pp_tp_full

    rank = spec["rank"]
    store = dist.TCPStore("127.0.0.1", spec["store_port"], is_master=False, timeout=dt.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=4, timeout=dt.timedelta(seconds=60))
    stage_meshes = [DeviceMesh("cpu", [2 * s, 2 * s + 1]) for s in range(2)]  # every rank, same order
    my_stage, tp_rank = divmod(rank, 2)
    sd = {}
    for name, (full, dim) in pp_tp_full().items():
        stage = int(name.split(".")[1])  # layer i lives on stage i
        local = full if dim is None else full.chunk(2, dim=dim)[tp_rank]
        if stage != my_stage:
            local = torch.empty(0, dtype=full.dtype)  # another stage's entry: no slice here
        sd[name] = DTensor.from_local(local.clone(), stage_meshes[stage], [Replicate() if dim is None else Shard(dim)],
                                      shape=full.shape, stride=full.stride(), run_check=False)
    async with ws.Publisher(spec["channel"], timeout=10.0, heartbeat_interval=0.25, group=dist.group.WORLD,
                            address="127.0.0.1:0") as pub:
        if rank == 0:
            with open(spec["address_file"] + ".tmp", "w") as fh:
                fh.write(pub.address or "")
            os.replace(spec["address_file"] + ".tmp", spec["address_file"])
        await pub.wait_subscribers(1, timeout=60)
        report = await (await pub.put(sd, version=1)).delivered(timeout=60)
    dist.destroy_process_group()
    return {"rank": rank, "sent": report.nbytes}


async def tp_generator(spec: dict) -> dict:
    """One rank of a tensor-parallel generator: get_into DTensors on its own mesh (Shard(0),
    Shard(1), Replicate()); reports each local shard's digest. ``sliced``: the subscriber is made
    with ``want=`` (only its boxes arrive); it also reports the bytes it received and what get() gave."""
    import datetime as dt

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from tests.statedicts import digest

    rank, world = spec["rank"], spec["world"]
    store = dist.TCPStore("127.0.0.1", spec["store_port"], is_master=False, timeout=dt.timedelta(seconds=60))
    # the engine's own world only gives its DTensors a mesh; nothing is sent over it, so it is
    # built lazily: torch 2.13's eager gloo constructor (connecting the full mesh) crashed with
    # SIGSEGV here about 1 run in 4 on a loaded 2-core machine (faulthandler: inside
    # ProcessGroupGloo's constructor, before any weightsync object existed)
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    try:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=dt.timedelta(seconds=60))
    finally:
        del os.environ["TORCH_GLOO_LAZY_INIT"]  # weightsync's own groups are the library's business
    mesh = init_device_mesh("cpu", (world,))
    from tests.statedicts import TP_OF_FSDP

    dest = {}
    shares = {"w0": ((301, 6), torch.float32, Shard(0)), "w1": ((50, 91), torch.bfloat16, Shard(1)),
              "b": ((7,), torch.int64, Replicate())}
    if spec.get("of_fsdp"):  # the FSDP2 trainer's tensors (some of them), split its own way
        shares = {name: (shape, dtype, Replicate() if dim is None else Shard(dim))
                  for name, (shape, dtype, dim) in TP_OF_FSDP.items()}
    for name, (shape, dtype, placement) in shares.items():
        full = torch.zeros(shape, dtype=dtype)
        local = full.chunk(world, dim=placement.dim)[rank].clone() if placement.is_shard() else full.clone()
        dest[name] = DTensor.from_local(local, mesh, [placement], shape=torch.Size(shape), stride=full.stride(),
                                        run_check=False)
    sliced = spec.get("sliced", False)
    sub = ws.Subscriber(spec["channel"], address=spec["address"], member_id=f"tp{rank}", timeout=10.0,
                        want=dest if sliced else None)
    if spec.get("corrupt"):  # flip a byte of these versions' first wire bucket, once each
        from weightsync.testing import Faults, inject

        inject(sub, Faults(corrupt=set(spec["corrupt"])))
    every: dict[str, dict[str, int]] = {}  # ``last``: each version's local shards, got in turn
    async with sub:
        for wanted in range(spec["version"], spec.get("last", spec["version"]) + 1):
            version = await sub.get_into(dest, min_version=wanted, timeout=60)
            every[str(version)] = {k: digest(v.to_local()) for k, v in dest.items()}
        got = await sub.get(min_version=version, timeout=10)
        checksum_failures = sub.statistics().checksum_failures
    dist.destroy_process_group()
    done = [e for e in process_recorder().snapshot() if e.op == "bucket_recv" and e.state == "completed"]
    received = sum(e.nbytes for e in done)
    per_version: dict[str, int] = {}
    for e in done:
        per_version[str(e.version)] = per_version.get(str(e.version), 0) + e.nbytes
    return {"version": version, "digests": {k: digest(v.to_local()) for k, v in dest.items()},
            "received": received, "got": {k: [list(t.shape), digest(t)] for k, t in got.items()},
            "every": every, "per_version": per_version, "checksum_failures": checksum_failures}


async def sharded_no_copy(spec: dict) -> dict:
    """One rank of an FSDP2 trainer of about ``mib`` MiB (float32) putting with ``copy=False``: the
    kernel's VmRSS just before each put and just after its ``released()``; the largest growth."""
    import datetime as dt

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, world = spec["rank"], spec["world"]
    store = dist.TCPStore("127.0.0.1", spec["store_port"], is_master=False, timeout=dt.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=dt.timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    side = 2048
    layers = max(1, round(spec["mib"] * (1 << 20) / (side * side * 4)))
    model = torch.nn.Sequential(*(torch.nn.Linear(side, side, bias=False) for _ in range(layers)))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    shard = sum(p.to_local().numel() * p.to_local().element_size() for p in model.parameters())
    growth, expected = [], {}
    async with ws.Publisher(spec["channel"], timeout=10.0, heartbeat_interval=0.25, group=dist.group.WORLD,
                            bucket_bytes=spec["bucket_bytes"]) as pub:
        if rank == 0:
            with open(spec["address_file"] + ".tmp", "w") as fh:
                fh.write(pub.address)
            os.replace(spec["address_file"] + ".tmp", spec["address_file"])
        await pub.wait_subscribers(1, timeout=60)
        for version in range(spec["versions"]):
            with torch.no_grad():
                for p in model.parameters():
                    p.to_local().add_(1)
            sd = model.state_dict()
            expected[str(version)] = digests({k: v.full_tensor() for k, v in sd.items()})
            before = _status_mib("VmRSS")
            handle = await pub.put(sd, version=version, copy=False)
            await handle.released(timeout=60)
            growth.append(_status_mib("VmRSS") - before)
            await handle.delivered(timeout=60)
    dist.destroy_process_group()
    return {"rank": rank, "growth_mib": growth, "shard_mib": shard / 2**20, "expected": expected}


async def lora_fsdp_trainer(spec: dict) -> dict:
    """One FSDP2 rank (gloo, CPU) training a peft LoRA adapter on a tiny Llama: every rank puts the
    adapter ``ws.from_peft`` gives (its factors DTensors, this rank's shards) on its own
    AdapterPublisher, after each of ``steps`` optimizer steps. The full factors each version should
    be (``full_tensor()``) are digested before the put."""
    import datetime as dt

    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.statedicts import digest

    rank, world = spec["rank"], spec["world"]
    store = dist.TCPStore("127.0.0.1", spec["store_port"], is_master=False, timeout=dt.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=dt.timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)  # the same model and adapter on every rank, as a trainer starts them
    base = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    expected: dict[str, dict[str, str]] = {}
    sharded = []
    address = "127.0.0.1:0"
    if rank:
        deadline = time.monotonic() + 60
        while not os.path.exists(spec["address_file"]) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # polling for a file rank 0 writes
        with open(spec["address_file"]) as fh:
            address = fh.read()
    async with ws.AdapterPublisher("lora-fsdp", rank=rank, world_size=world, address=address,
                                   lane_address="127.0.0.1:0", timeout=10.0, heartbeat_interval=0.25) as pub:
        if rank == 0:
            with open(spec["address_file"] + ".tmp", "w") as fh:
                fh.write(pub.address)
            os.replace(spec["address_file"] + ".tmp", spec["address_file"])
        await pub.wait_subscribers(1, timeout=60)
        for step in range(1, spec["steps"] + 1):
            model(input_ids=tokens, labels=tokens).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            adapter = ws.from_peft(model)
            sharded.append(all(hasattr(t, "to_local") for t in adapter.tensors.values()))
            expected[str(step)] = {k: digest(t.full_tensor()) for k, t in adapter.tensors.items()}
            await (await pub.put("math", adapter, version=step)).delivered(timeout=60)
    dist.destroy_process_group()
    return {"rank": rank, "expected": expected, "sharded": sharded}


async def exposer(spec: dict) -> dict:
    """A one-sided endpoint that registers ``mib`` MiB of 7s (and holds a 64 KiB secret it never
    registers); writes its url, the registration and where the secret lies, then waits to be killed."""
    from weightsync.planes.onesided.endpoints import Exposure
    exposure = Exposure()
    exposed = torch.full((spec["mib"] << 20,), 7, dtype=torch.uint8)
    secret = torch.full((64 << 10,), 0x5A, dtype=torch.uint8)
    reg = exposure.expose(exposed)
    tmp = spec["file"] + ".tmp"
    with open(tmp, "wb") as fh:
        fh.write(msgspec.msgpack.encode([exposure.url(), reg, secret.data_ptr()]))
    os.replace(tmp, spec["file"])
    await asyncio.sleep(spec.get("deadline", 120))
    return {"secret": int(secret[0])}


async def main(spec: dict) -> dict:
    if spec["role"] == "subscriber":
        try:
            return await subscriber(spec)
        finally:
            if spec.get("dump_at_end"):
                process_recorder().dump(reason="worker finished")
    if spec["role"] == "coexist":
        return await coexist(spec)
    if spec["role"] == "publisher":
        return await publisher(spec)
    if spec["role"] == "dies_mid_commit":
        return await dies_mid_commit(spec)
    if spec["role"] == "sharded_trainer":
        return await sharded_trainer(spec)
    if spec["role"] == "tp_generator":
        return await tp_generator(spec)
    if spec["role"] == "pp_trainer":
        return await pp_trainer(spec)
    if spec["role"] == "sharded_no_copy":
        return await sharded_no_copy(spec)
    if spec["role"] == "lora_fsdp_trainer":
        return await lora_fsdp_trainer(spec)
    if spec["role"] == "exposer":
        return await exposer(spec)
    raise SystemExit(f"unknown role {spec['role']!r}")


def load_spec(arg: str) -> dict:
    """The spec inline, or ``@path`` to a JSON file (an orchestrator's command line); ``{n}`` in
    ``member`` and ``result`` becomes ``$WEIGHTSYNC_REPLACEMENT`` (which replacement this is)."""
    if arg.startswith("@"):
        with open(arg[1:], "rb") as fh:
            arg = fh.read().decode()
    spec = msgspec.json.decode(arg)
    n = os.environ.get("WEIGHTSYNC_REPLACEMENT", "0")
    for key in ("member", "result"):
        if isinstance(spec.get(key), str):
            spec[key] = spec[key].replace("{n}", n)
    return spec


def run(arg: str) -> int:
    """Run the worker ``arg`` describes (an exec'd interpreter, or a child of tests/forkserver.py)."""
    # a hung worker tells where it hangs: every thread's stack on SIGUSR2, and on the SIGTERM an
    # orchestrator's aclose() sends before its SIGKILL; a crashed one, where it crashed
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    faulthandler.enable(all_threads=True)  # a crash (SIGSEGV, SIGABRT) prints where it happened
    # the test run's transport for subscribers that name none (tests/conftest.py's fixture sets it)
    set_default_transport(os.environ.get("WS_TEST_TRANSPORT", "auto"))
    set_default_pipeline(True if os.environ.get("WS_TEST_PIPELINE") == "on" else None)  # and its --pipeline
    spec = load_spec(arg)
    if spec.get("loop") == "uvloop":
        import uvloop

        result = uvloop.run(main(spec))
    else:
        result = asyncio.run(main(spec))
    with open(spec["result"] + ".tmp", "wb") as fh:
        fh.write(msgspec.json.encode(result))
    os.replace(spec["result"] + ".tmp", spec["result"])
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1]))
