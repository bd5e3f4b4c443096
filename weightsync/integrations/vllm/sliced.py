"""A vLLM worker that receives only what its own loaders read (``init_info`` ``sliced``, issue 58).

The moves on the worker's membership, each called by the worker at one point of its lifecycle:
:func:`bake` when it joins (its plan before any version, ``plan.bake``), :func:`first_join` (as
``<member>-sliced`` wanting those boxes, whole where the channel refuses them at the door),
:func:`join` after a whole load recorded the plan (leave, join again sliced), and
:func:`unslice` when a version refuses a plan made on meta tensors (join whole within the same
update). ``worker`` is the worker's ``WeightsyncEngine`` (not imported here: it imports this
module). docs/vllm.md, "What each worker reads".
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from weightsync.errors import ManifestMismatch, WeightSyncError
from weightsync.integrations.vllm import plan
from weightsync.integrations.vllm.replica import GRACE
from weightsync.options import Deadlines

log = logging.getLogger("weightsync.vllm")


def bake(worker: Any) -> dict[str, Any] | None:
    """This worker's plan before any version: its own loaders run on meta tensors named and
    shaped as the plan it holds (made from the last version it loaded, or from the names a plan
    before that was made from), or before any plan as the engine's checkpoint files
    (``plan.bake``). None where it cannot be made, or where it does not write every engine
    parameter exactly once or needs every byte (logged): the worker then joins whole, and its
    first load records the plan."""
    try:
        held = worker.plan  # made from the names of the last version it loaded, or the files' before any
        specs = plan.specs(held) if held is not None else plan.checkpoint_specs(worker.model_config.model)
        made = plan.bake(worker.model, specs)
    except Exception as err:  # noqa: BLE001 - whatever a loader does on meta tensors: fall back
        log.warning("vLLM worker: no plan before the first version (%s: %s); the first load records it",
                    type(err).__name__, err)
        return None
    worker.plan, cover = made, made["coverage"]
    if cover["exact"] != cover["parameters"] or made["needed_bytes"] >= made["version_bytes"]:
        log.warning("vLLM worker: the plan made before the first version is not used (%d of %d parameters "
                    "written exactly once; %d of %d bytes needed); the first load records it", cover["exact"],
                    cover["parameters"], made["needed_bytes"], made["version_bytes"])
        return None
    return made


def first_join(worker: Any, member: str, made: dict[str, Any] | None) -> tuple[Any, str, dict[str, Any] | None]:
    """Join the channel as ``member``, or with a plan ``made`` as ``<member>-sliced`` wanting its
    boxes; where the channel refuses those at the door (its last version lacks a wanted tensor or
    shapes one otherwise: ``ManifestMismatch``), join whole (logged): the first load records the
    plan from the version's own names. (subscriber, member, the plan joined with or None)."""
    timeout = Deadlines.joining(worker._timeout) + GRACE
    if made is not None:
        sub = worker._subscriber(f"{member}-sliced", plan.boxes(made))
        try:
            worker._bridge.run(sub.start(), timeout, f"joining channel {worker._init.channel!r} as {member}-sliced")
            return sub, f"{member}-sliced", made
        except ManifestMismatch as err:
            log.warning("vLLM worker %s: the channel refuses the plan made before its first version (%s); joining "
                        "whole, its first load records the plan", member, err)
    sub = worker._subscriber(member)
    worker._bridge.run(sub.start(), timeout, f"joining channel {worker._init.channel!r}")
    return sub, member, None


def join(worker: Any) -> None:
    """Leave as a whole member, then join again wanting only the boxes the last full load's
    loaders read (leaving first: a whole member of the group that stayed would be asked to the
    generation its own sliced member joins while it waits on that join). Where the sliced join
    fails, join whole again (logged); where that fails too, the next update says so."""
    assert worker._bridge is not None and worker._sub is not None and worker.plan is not None
    if worker.plan["needed_bytes"] >= worker.plan["version_bytes"]:
        return  # this worker reads every byte: nothing to slice
    whole, member = worker._member or "", f"{worker._member}-sliced"
    old, worker._sub = worker._sub, None
    try:
        worker._bridge.run(old.aclose(), old.timeout + GRACE, "leaving as a whole member")
    except (WeightSyncError, OSError, RuntimeError):
        pass  # best effort: the publisher evicts a silent member on its own
    for name, want in ((member, plan.boxes(worker.plan)), (whole, None)):
        sub = worker._subscriber(name, want)
        try:
            worker._bridge.run(sub.start(), Deadlines.joining(worker._timeout) + GRACE, f"joining as {name}")
        except (WeightSyncError, OSError) as err:
            log.warning("vLLM worker %s: joining as %s failed: %s", whole, name, err)
            continue
        worker._sub, worker._member = sub, name
        if want is not None:
            worker._sliced, worker.patches = worker.plan, False  # a patch would be of the box, not the tensor
            log.info("vLLM worker %s receives %d of each version's %d bytes", name, worker.plan["needed_bytes"],
                     worker.plan["version_bytes"])
        return


def unslice(worker: Any, err: ManifestMismatch) -> bool:
    """A plan that the version refuses, before any byte of it moved: its names or shapes are not
    those the plan was made from (a plan made on meta tensors from the checkpoint files while the
    trainer names fused experts otherwise; a plan recorded from a trainer since restarted with
    another model). Join whole within the same update: its load records the plan anew, and the
    worker joins sliced again after it. False where the worker had no plan."""
    if worker._sliced is None or worker._bridge is None:
        return False
    log.warning("vLLM worker %s: the version does not fit the plan made before it (%s); joining whole, "
                "its load records the plan", worker._member, err)
    old, whole = worker._sub, (worker._member or "").removesuffix("-sliced")
    with contextlib.suppress(WeightSyncError, OSError, RuntimeError):
        if old is not None:
            worker._bridge.run(old.aclose(), old.timeout + GRACE, "leaving as a sliced member")
    sub = worker._subscriber(whole)
    worker._bridge.run(sub.start(), Deadlines.joining(worker._timeout) + GRACE, f"joining as {whole}")
    worker._sub, worker._member, worker._sliced, worker.plan = sub, whole, None, None
    return True
