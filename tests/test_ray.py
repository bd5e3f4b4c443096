"""weightsync in a real local Ray cluster (CPU actors): a generator actor killed with ``ray.kill``
and replaced through Ray by RayOrchestrator while the trainer actor keeps putting."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed here (the test extra installs it)")

from rl_examples import ray_generators  # noqa: E402 - after the skip
from weightsync.integrations.ray import RayOrchestrator  # noqa: E402
from weightsync.membership.membership import MemberInfo  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A local Ray cluster for this module; every process it started is gone afterwards."""
    temp = tempfile.mkdtemp(prefix="wsray-")  # short: Ray's socket paths must stay under the Unix limit
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    try:
        yield temp
    finally:
        ray.shutdown()
        left = subprocess.run(["pgrep", "-f", temp], capture_output=True, text=True).stdout.split()
        for pid in left:  # anything of this cluster ray.shutdown left behind
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_generator_actor_is_replaced_through_ray_while_the_trainer_keeps_putting(cluster: str) -> None:
    """ray.kill on a generator actor: the publisher in the trainer actor evicts it as dead, the
    RayOrchestrator starts repl-1 as a new actor, which joins and receives the newest versions;
    every version any generator received is bit-identical to the trainer's; the trainer's puts
    went on while the replacement was being made."""
    result = ray_generators.run(generators=2, steps=3, width=256, deadline=150, say=lambda _line: None)
    assert result["evicted"] == [("gen1", "dead")]
    assert result["replaced_by"] == ["repl-1"]
    assert result["mismatched"] == {}
    assert result["members_of_last_version"] == ["gen0", "repl-1"]
    newest = result["newest"]
    assert newest in result["received"]["gen0"] and newest in result["received"]["repl-1"]
    assert min(result["received"]["repl-1"]) > result["killed_at"] - 1  # it joined after the kill
    assert result["versions_put_while_replacing"] >= 1  # the trainer was never held by the dead actor
    assert result["max_put_seconds"] < 4.0  # the publisher's deadline: no put waited for a member
    assert result["ok"]


@ray.remote(num_cpus=0)
class Pinger:
    def __init__(self, member_id: str, tag: str) -> None:
        self.member_id, self.tag = member_id, tag

    def ready(self) -> tuple[str, str, int]:
        return self.member_id, self.tag, os.getpid()


@pytest.mark.timeout(120)
def test_ray_orchestrator_kills_a_live_dropped_actor_and_reuses_its_name(cluster: str) -> None:
    """A slow member still runs: kill_old kills its actor (found by name), the replacement takes the
    same id and name once Ray freed it, gets its fields filled in, and answers ready()."""
    old = Pinger.options(name="slowgen").remote("slowgen", "original")
    _member, _tag, old_pid = ray.get(old.ready.remote(), timeout=60)
    orch = RayOrchestrator(Pinger, "{new}", tag="replaces {member}: {reason} #{n} {not-a-field}",
                           member_id="{member}", actors={"slowgen": old})
    asyncio.run(orch.replace(MemberInfo("slowgen", reason="slow")))
    new = ray.get_actor("slowgen")
    member, tag, pid = ray.get(new.ready.remote(), timeout=60)
    assert (member, tag) == ("slowgen", "replaces slowgen: slow #1 {not-a-field}") and pid != old_pid
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(old.ready.remote(), timeout=60)
    assert [(m.member_id, new_id) for m, new_id, _h in orch.started] == [("slowgen", "slowgen")]
    asyncio.run(orch.aclose())  # returns once Ray has it dead: ray.kill alone only asks
    with pytest.raises(ValueError):
        ray.get_actor("slowgen")
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(new.ready.remote(), timeout=60)


@pytest.mark.timeout(120)
def test_an_insider_named_like_an_application_actor_never_gets_it_killed(cluster: str) -> None:
    """A member that joins with the id of a named actor of the application ("reward_model") and goes
    silent is dropped; kill_old looked the id up as a Ray name and killed the application's actor.
    Only handles the orchestrator holds are killed now: the actor still answers, and the
    replacement is a new actor under its own id, its fields meaning what they mean for
    LocalProcessOrchestrator ({member}: the dropped id)."""
    bystander = Pinger.options(name="reward_model").remote("reward_model", "the application's")
    _m, _t, pid = ray.get(bystander.ready.remote(), timeout=60)
    orch = RayOrchestrator(Pinger, "{new}", tag="replaces {member}")
    asyncio.run(orch.replace(MemberInfo("reward_model", reason="dead")))
    assert ray.get(bystander.ready.remote(), timeout=60) == ("reward_model", "the application's", pid)
    assert ray.get(ray.get_actor("repl-1").ready.remote(), timeout=60)[:2] == ("repl-1", "replaces reward_model")
    asyncio.run(orch.aclose())
    assert ray.get(bystander.ready.remote(), timeout=60)[2] == pid  # aclose killed only its own
    ray.kill(bystander, no_restart=True)


def test_ray_orchestrator_refuses_what_is_not_an_actor_class(cluster: str) -> None:
    with pytest.raises(TypeError, match="@ray.remote class"):
        RayOrchestrator(Pinger.__ray_actor_class__)  # the plain class, not the actor
    with pytest.raises(ValueError, match="ready_timeout"):
        RayOrchestrator(Pinger, ready_timeout=0)
