"""LoRA adapter channels (docs/lora.md): named adapters with versions of their own on one channel.

Through a real channel in this process; the adapters' own bytes are checked bit for bit. The peft
trainer side and the vLLM engine are in tests/test_vllm.py (``make test-vllm``: peft and vLLM are
installed there).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

import weightsync as ws
from tests.conftest import Procs
from tests.statedicts import digest
from weightsync.format import adapters as fmt

FAST = {"timeout": 5.0, "heartbeat_interval": 0.25}
MODULES = ("q_proj", "v_proj", "down_proj")


def adapter(seed: int, rank: int = 4, layers: int = 2, width: int = 64) -> ws.Adapter:
    """A PEFT-named adapter on ``layers`` layers: every factor random (a trained one, not B = 0)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for module in MODULES:
            key = f"base_model.model.model.layers.{layer}.{'mlp' if module == 'down_proj' else 'self_attn'}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, width, generator=gen)
            tensors[f"{key}.lora_B.weight"] = torch.randn(width, rank, generator=gen)
    return ws.Adapter(tensors, rank=rank, alpha=2 * rank)


def same(got: ws.AdapterVersion, sent: ws.Adapter) -> bool:
    return set(got.tensors) == set(sent.tensors) and all(torch.equal(got.tensors[k], t)
                                                        for k, t in sent.tensors.items())


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_each_adapter_keeps_its_own_versions_and_a_member_holds_the_last_k() -> None:
    """Two adapters, pushed in turn: each has versions of its own, every version a member reads is
    the adapter's bytes, the last ``keep`` stay readable and older ones say they are gone; over the
    group the adapter that did not change costs almost nothing (a delta of nothing)."""
    async with ws.AdapterPublisher("lora", **FAST) as pub, \
            ws.AdapterSubscriber("lora", address=pub.address, keep=2, timeout=5.0, transport="group") as sub:
        await pub.wait_subscribers(1, timeout=10)
        sent: dict[tuple[str, int], ws.Adapter] = {}
        wire = []
        for step in range(3):
            for name, seed in (("math", step), ("code", 100 + step)):
                sent[name, step] = adapter(seed)
                handle = await pub.put(name, sent[name, step], version=step)
                report = await handle.delivered(timeout=10, min_members=1)
                wire.append(report.wire_bytes)
        assert pub.adapters == {"math": 2, "code": 2}
        newest = await sub.get("code", min_version=2, timeout=10)
        assert same(newest, sent["code", 2]) and newest.version == 2
        assert sub.versions("math") == (1, 2) and sub.versions("code") == (1, 2)
        assert same(await sub.get("math", version=1), sent["math", 1])
        with pytest.raises(ws.Superseded, match="version 0 is not held here"):
            await sub.get("math", version=0)
        one = sent["math", 0].nbytes
        # the first put sends math whole; from then on each put is its adapter whole and the
        # other a delta of nothing: far less than both adapters' bytes
        assert all(w < one * 1.2 for w in wire[2:]), (wire, one)
        assert newest.peft_config()["r"] == 4 and newest.peft_config()["lora_alpha"] == 8.0


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_member_that_skips_versions_of_the_channel_still_gets_every_adapters_newest() -> None:
    """Latest wins per adapter: puts of two adapters back to back, not waited for, may supersede one
    another on the channel, and still the member ends holding each adapter's newest version."""
    async with ws.AdapterPublisher("lora", **FAST) as pub, \
            ws.AdapterSubscriber("lora", address=pub.address, timeout=5.0) as sub:
        await pub.wait_subscribers(1, timeout=10)
        last = None
        for step in range(5):
            await pub.put("math", adapter(step))
            last = await pub.put("code", adapter(50 + step))
        assert last is not None
        await last.delivered(timeout=10)
        assert same(await sub.get("math", min_version=4, timeout=10), adapter(4))
        assert same(await sub.get("code", min_version=4, timeout=10), adapter(54))


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_removed_adapter_leaves_the_members_and_a_late_reader_waits_within_its_bound() -> None:
    async with ws.AdapterPublisher("lora", **FAST) as pub, \
            ws.AdapterSubscriber("lora", address=pub.address, timeout=5.0) as sub:
        await pub.wait_subscribers(1, timeout=10)
        await pub.put("math", adapter(1))
        await (await pub.put("code", adapter(2))).delivered(timeout=10)
        await sub.get("math", timeout=10)
        handle = await pub.remove("math")
        await handle.delivered(timeout=10)
        await sub.wait_for(handle.version, timeout=10)
        assert set(sub.adapters) == {"code"} and sub.versions("math") == ()
        with pytest.raises(ws.SyncTimeout, match="adapter 'math'"):
            await sub.get("math", timeout=0.2)
        await pub.put("math", adapter(3))  # its versions go on from where they were
        assert (await sub.get("math", timeout=10)).version == 1


@pytest.mark.parametrize("bad, match", [
    (lambda t: {**t, "base_model.model.x.lora_A.weight": torch.zeros(4, 8)}, "without lora_B"),
    (lambda t: {**t, "base_model.model.model.embed_tokens.weight": torch.zeros(4, 8)}, "is not a LoRA factor"),
    (lambda t: {k: (v[:2] if k.endswith("lora_A.weight") else v) for k, v in t.items()}, "for rank 4"),
    (lambda t: {k: v.to(torch.int32) for k, v in t.items()}, "2-D floating-point"),
    (lambda t: {k: v.clone().fill_(float("nan")) for k, v in t.items()}, "NaN or infinity"),
    (lambda t: {}, "non-empty mapping"),
])
def test_what_no_lora_engine_could_serve_is_refused_at_the_call(bad, match: str) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=match):
        ws.Adapter(bad(adapter(0).tensors), rank=4, alpha=8)


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_bad_puts_are_refused_and_nothing_is_sent() -> None:
    with pytest.raises(ValueError, match="alpha"):
        ws.Adapter(adapter(0).tensors, rank=4, alpha=float("inf"))
    with pytest.raises(ValueError, match="target_modules do not name"):
        ws.Adapter(adapter(0).tensors, rank=4, alpha=8, target_modules=["q_proj"])
    with pytest.raises(ValueError, match="keep"):
        ws.AdapterSubscriber("lora", address="127.0.0.1:1", keep=0)
    async with ws.AdapterPublisher("lora", **FAST) as pub:
        with pytest.raises(TypeError, match="weightsync.Adapter"):
            await pub.put("math", adapter(0).tensors)  # type: ignore[arg-type]
        for name in ("a/b", "math@3", "", "x" * 200):
            with pytest.raises(ValueError, match="adapter names"):
                await pub.put(name, adapter(0))
        await pub.put("math", adapter(0), version=3)
        with pytest.raises(ValueError, match="strictly increase"):
            await pub.put("math", adapter(1), version=3)
        with pytest.raises(KeyError, match="'code' is not on channel"):
            await pub.remove("code")
        with pytest.raises(ValueError, match="empty version"):
            await pub.remove("math")
        assert pub.publisher.version == 0  # one version of the channel: the refused calls sent nothing


def test_an_adapter_set_manifest_round_trips_and_garbage_is_refused() -> None:
    entry = adapter(0).entry("math", 7)
    manifest = fmt.AdapterSet([entry])
    assert fmt.decode_manifest(fmt.encode_manifest(manifest)) == manifest
    assert entry.scaling == 2.0 and entry.peft_config()["target_modules"] == sorted(MODULES)
    with pytest.raises(ValueError, match="does not decode"):
        fmt.decode_manifest(torch.tensor([1, 2, 3], dtype=torch.uint8))


@pytest.mark.timeout(60)
def test_the_blocking_adapter_publisher_pushes_what_the_async_one_does() -> None:
    sent = adapter(9)
    with ws.BlockingAdapterPublisher("lora", **FAST) as pub:
        async def read() -> ws.AdapterVersion:
            async with ws.AdapterSubscriber("lora", address=pub.address, timeout=5.0) as sub:
                return await sub.get("math", timeout=10)

        async def both() -> ws.AdapterVersion:
            task = asyncio.ensure_future(read())
            await asyncio.get_running_loop().run_in_executor(None, pub.wait_subscribers, 1, 10)
            await asyncio.get_running_loop().run_in_executor(None, lambda: pub.put("math", sent).delivered(10))
            return await task

        got = asyncio.run(both())
        assert same(got, sent) and pub.adapters == {"math": 0}


@pytest.mark.vllm  # peft and transformers are installed where vLLM is (make test-vllm)
@pytest.mark.asyncio
@pytest.mark.timeout(240)
async def test_fsdp2_ranks_training_a_peft_adapter_push_their_shards_and_the_member_holds_the_full_factors(
        procs: Procs, tmp_path: Path, run_transport: str) -> None:
    """Two FSDP2 ranks train a peft LoRA adapter; each puts ``ws.from_peft(model)`` (its shards of
    the factors, DTensors: nothing gathered) after every step; the member holds each version's
    factors bit for bit as ``full_tensor()`` gives them."""
    if run_transport != "auto":  # lanes over both transports are test_sharding's; this is from_peft's: once
        pytest.skip("runs once, in the --transport auto pass (make test-vllm runs both)")
    pytest.importorskip("peft")
    import datetime as dt

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=60))
    address_file = tmp_path / "rank0.addr"
    ranks = [procs.spawn("lora_fsdp_trainer", rank=r, world=2, store_port=store.port, steps=3,
                         address_file=str(address_file)) for r in range(2)]
    deadline = asyncio.get_running_loop().time() + 120
    while not address_file.exists():
        assert asyncio.get_running_loop().time() < deadline, "rank 0 never wrote its address:\n" + procs.stacks()
        await asyncio.sleep(0.05)  # polling for a file another process writes
    got: dict[int, dict[str, str]] = {}
    async with ws.AdapterSubscriber("lora-fsdp", address=address_file.read_text(), keep=3, timeout=10.0) as sub:
        for step in (1, 2, 3):
            held = await sub.get("math", min_version=step, timeout=120)
            got[held.version] = {k: digest(t) for k, t in held.tensors.items()}
        results = [await procs.result(i, 120) for i in ranks]
    expected = results[0]["expected"]
    assert results[1]["expected"] == expected and all(all(r["sharded"]) for r in results)
    assert got and all(got[v] == expected[str(v)] for v in got), (sorted(got), sorted(expected))
    assert 3 in got
    del store


def test_merging_an_adapter_gives_the_same_bits_as_the_rule_it_states() -> None:
    """``ws.merge_adapter`` is what a generator in merged mode computes: base + scaling * (B @ A) as
    rank outer products in order, in float32, cast back. The same bits from numpy taking the same
    IEEE steps (no BLAS, no fused multiply-add), and on any thread count; close to float64's
    answer; the base untouched and the weights the adapter does not adapt passed through."""
    import numpy as np

    sent = adapter(7)
    gen = torch.Generator().manual_seed(3)
    base = {fmt.base_name(k): torch.randn(64, 64, generator=gen).to(torch.bfloat16)
            for k in sent.tensors if k.endswith("lora_A.weight")}
    base["model.norm.weight"] = torch.ones(64)
    before = {k: v.clone() for k, v in base.items()}
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ws.merge_adapter(base, sent)
    finally:
        torch.set_num_threads(threads)
    merged = ws.merge_adapter(base, sent)
    assert all(torch.equal(base[k], before[k]) for k in base)
    assert merged["model.norm.weight"] is base["model.norm.weight"]
    scaling = sent.alpha / sent.rank
    for key in (k for k in sent.tensors if k.endswith("lora_A.weight")):
        name = fmt.base_name(key)
        assert merged[name].dtype == torch.bfloat16 and torch.equal(merged[name].view(torch.int16),
                                                                    one[name].view(torch.int16))
        a = sent.tensors[key].numpy()
        b = sent.tensors[key.replace("lora_A", "lora_B")].numpy()
        delta = np.zeros((64, 64), dtype=np.float32)
        for i in range(a.shape[0]):
            delta += np.multiply.outer(b[:, i], a[i, :])
        expected = torch.from_numpy(base[name].float().numpy() + delta * np.float32(scaling)).to(torch.bfloat16)
        assert torch.equal(merged[name].view(torch.int16), expected.view(torch.int16)), name
        exact = base[name].double() + scaling * (sent.tensors[key.replace("lora_A", "lora_B")].double()
                                                  @ sent.tensors[key].double())
        assert torch.allclose(merged[name].double(), exact, rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="which the base does not have"):
        ws.merge_adapter({"model.norm.weight": torch.ones(64)}, sent)
