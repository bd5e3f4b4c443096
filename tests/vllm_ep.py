"""An expert-parallel trainer (torchrun, gloo) into a Qwen3-MoE engine at TP=2 whose workers
receive only their slices, across trainer restarts with other layouts (issue 58, items 2 and 3).

    python -m tests.vllm_driver ep RESULT.json WORKDIR   (run by tests/test_vllm.py)

The engine starts from checkpoint A (8 experts) with ``sliced`` on. The trainer
(tests/ep_trainer.py) is launched by torchrun as users launch one; every version it puts is
the checkpoint's weights moved by the noise of one seed, so two puts of one seed are the same
weights whatever the trainer's layout. In order:

1. two ranks, experts ``Shard(0)`` (``ep``): version 1 (seed 1), retained (``copy=True``). Its
   names (fused experts, as the trainer's state dict has them) are not the checkpoint files' (one
   tensor per expert), so the plan made from the files is refused at the door; each worker loads
   version 1 whole from both lanes (``whole``: the digests and tokens everything after is
   compared with), its load records the plan, and it joins sliced again while the ranks re-send
   the retained version to it (two workers leaving and joining one after the other); joined anew,
   each makes its plan on meta tensors named as version 1;
2. the engine zeroed, version 2 (seed 1) as each worker's boxes from both lanes (``two``);
3. rank 1 killed with -9 as it puts version 3 (seed 2): the update fails within its bound and
   the engine still holds version 2's bytes (``killed``); torchrun's processes are killed;
4. the trainer restarted with one rank: the engine joins it anew, zeroed, version 4 (seed 1)
   from one lane (``one``);
5. killed with -9 again, restarted with four ranks and experts placed ``dp-ep`` (a 2 x 2 mesh:
   ``Shard(0)`` over ``ep``, ``Replicate()`` over ``dp``): zeroed, version 5 (seed 1) (``four``);
6. the engine killed with -9 and started again at TP=1 from checkpoint A: its plan made anew (a
   TP=1 worker reads every byte, so it joins whole), version 6 (seed 1), against an engine started
   from seed 1's checkpoint, saved by the trainer (``restarted``).

After each of 2, 4 and 5 every parameter's digest, the tokens and the logprobs must be the whole
load's; each worker's received bytes about half the version's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import msgspec

from tests import vllm_driver as driver

# 8 experts of 512 (52 MiB float32, 48 of them experts): a rank's shard far above its buckets
EXPERTS = dict(num_experts=8, moe_intermediate_size=512)


class Answer(msgspec.Struct):  # tests/ep_trainer.py's answer to a put
    command: str
    version: int
    error: str
    lane_bytes: list[int]
    growth_mib: list[float]
    shard_bytes: list[int]


class Step(msgspec.Struct):
    info: list[dict]  # engine_info after the update
    served: driver.Generation
    digests: list[dict]  # engine_digests
    answer: Answer | None  # the trainer's account of the put


class Restarted(msgspec.Struct):
    """The engine killed with -9 and started again at TP=1 (issue 58, item 3)."""

    plans: list[dict | None]  # engine_plans on joining: whole (a TP=1 worker reads every byte)
    step: Step  # version 6 (seed 1)
    reference: driver.Generation  # an engine started from seed 1's checkpoint, TP=1
    reference_digests: list[dict]


class EpReport(msgspec.Struct):
    files: list[dict]  # engine_plans on joining: made from the checkpoint files, refused at the door
    baked: list[dict]  # engine_plans on joining sliced after version 1: made on meta tensors named as it
    whole: Step
    two: Step
    killed: driver.Failure | None  # update 3: rank 1 killed as it put
    killed_digests: list[dict]  # engine_digests after that failed update
    one: Step
    four: Step
    restarted: Restarted


class EpTrainer:
    """``torchrun --standalone --nproc-per-node N -m tests.ep_trainer`` in its own process group."""

    def __init__(self, checkpoint: Path, secret: str, ranks: int, placement: str) -> None:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                "-m", "tests.ep_trainer", str(checkpoint), secret, placement]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        self.address = self._line("address").split()[-1]

    def _line(self, prefix: str) -> str:
        """The next line of rank 0's that starts with ``prefix`` (torchrun prints its own lines too)."""
        while line := self.stdout.readline():
            if line.startswith(prefix):
                return line
        raise AssertionError(f"the trainer exited ({self.proc.wait(10)}) before saying {prefix!r}")

    def put(self, version: int, seed: int, command: str = "put") -> Answer | None:
        self.stdin.write(f"{command} {version} {seed}\n")
        self.stdin.flush()
        if command == "die":  # torchrun tears rank 0 down once rank 1 died: it may never answer
            return None
        return msgspec.json.decode(self._line("{"), type=Answer)

    def save(self, seed: int) -> str:
        """The weights of ``seed`` saved as a checkpoint by rank 0; its path."""
        self.stdin.write(f"save 0 {seed}\n")
        self.stdin.flush()
        return self._line("saved").split()[-1]

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


def kill_engine(llm: object) -> None:
    """Kill ``llm``'s engine core and workers with -9 (vLLM's client cleans up after them)."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        if child.name().startswith("VLLM::"):
            child.kill()
    psutil.wait_procs([c for c in psutil.Process().children(recursive=True) if c.name().startswith("VLLM::")],
                      timeout=10)
    del llm
    driver._shutdown()
    return None


def expert_parallel(result: Path, work: Path) -> None:
    from weightsync.integrations.vllm import engine_digests, engine_info, engine_plans, update

    driver.build_moe("qwen3_moe", work / "A", **EXPERTS)
    secret = "s3cret-" + os.urandom(4).hex()
    llm = driver.engine(str(work / "A"), tensor_parallel_size=2, weight_transfer_config={"backend": "weightsync"})

    def join(trainer: EpTrainer, sliced: bool = True) -> None:
        llm.init_weight_transfer_engine({"init_info": {"address": trainer.address, "channel": "experts",
                                                       "secret": secret, "timeout": 30, "sliced": sliced,
                                                       "transport": driver.TRANSPORT}})

    def step(trainer: EpTrainer, version: int, zero: bool = True) -> Step:
        if zero:  # nothing of the last version left to hide a byte that did not arrive
            llm.collective_rpc("weight_transfer_engine", args=("zero",))
        answer = trainer.put(version, 1)
        update(llm, version, timeout=60)
        return Step(engine_info(llm), driver.generate(llm), engine_digests(llm), answer)

    trainer = EpTrainer(work / "A", secret, 2, "ep")
    try:
        trainer.put(1, 1, "keep")  # retained: the workers join after it, and again after their first load
        join(trainer)  # the plan made from the checkpoint files (per-expert names) is refused at the door
        files = engine_plans(llm)
        update(llm, 1, timeout=60)  # whole, from both lanes; the load records the plan, then each joins sliced
        whole = Step(engine_info(llm), driver.generate(llm), engine_digests(llm), None)
        join(trainer)  # anew: the plan made on meta tensors named as version 1
        baked = engine_plans(llm)
        two = step(trainer, 2)
        trainer.put(3, 2, "die")
        killed = driver.failure(lambda: update(llm, 3, timeout=driver.FAIL_TIMEOUT))
        killed_digests = engine_digests(llm)
        trainer.kill()
        trainer = EpTrainer(work / "A", secret, 1, "ep")
        join(trainer)
        one = step(trainer, 4)
        trainer.kill()
        trainer = EpTrainer(work / "A", secret, 4, "dp-ep")
        join(trainer)
        four = step(trainer, 5)
        checkpoint = trainer.save(1)
        llm = kill_engine(llm)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = os.environ["VLLM_CPU_OMP_THREADS_BIND"].split("|")[0]
        llm = driver.engine(str(work / "A"), tensor_parallel_size=1, weight_transfer_config={"backend": "weightsync"})
        join(trainer)
        plans = engine_plans(llm)
        again = step(trainer, 6, zero=False)
        trainer.kill()
        llm = kill_engine(llm)
        ref = driver.reference_engine(checkpoint, weight_transfer_config={"backend": "weightsync"})
        restarted = Restarted(plans, again, driver.generate(ref), engine_digests(ref))
        report = EpReport(files, baked, whole, two, killed, killed_digests, one, four, restarted)
    finally:
        trainer.kill()
    result.write_bytes(msgspec.json.encode(report))
