"""What the workers of one vLLM replica share: their names, what they join a channel with, and agreeing
on one version to load."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from weightsync.errors import SyncTimeout, WeightSyncError

log = logging.getLogger("weightsync.vllm")

# extra seconds a host-side call may take beyond the weightsync deadline it carries
GRACE = 5.0
ERROR = "weightsync_error"  # the key of a worker's answer that stands for the error it did not raise


def replied(worker: Any, call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)`` on a worker so that vLLM's executor reads every worker's reply.

    vLLM 0.32's executor reads the workers' replies to a collective RPC in rank order and raises at
    the first error, leaving the replies of the ranks after it queued: the next RPC reads those
    (another call's answers, silently), and every one after it is off by one (vllm-project/vllm
    #58242, #57846). So a weightsync call that fails raises only on the executor's last worker;
    any other keeps the error (``worker.error``, in ``engine_info``) and answers ``{ERROR: ...}``,
    which the driver's helpers turn back into the error (``weightsync.integrations.vllm``)."""
    try:
        return call(*args)
    except Exception as err:
        worker.error = f"{type(err).__name__}: {err}"
        if last_rank():
            raise
        log.error("vLLM worker %s: %s (its error goes back in engine_info: only the last rank raises)",
                  getattr(worker, "_member", None), worker.error)
        return {ERROR: worker.error}


def last_rank() -> bool:
    """Whether this worker's reply is the last one vLLM's executor reads (its world's last rank)."""
    try:
        from vllm.distributed.parallel_state import get_world_group

        world = get_world_group()
    except (ImportError, AssertionError):
        return True
    return bool(world.rank_in_group == world.world_size - 1)


def check_join(address: object, channel: object, timeout: object) -> None:
    """ValueError naming what is wrong with what a worker joins a channel with (either channel)."""
    if not isinstance(address, str) or ":" not in address:
        raise ValueError(f"address must be the publisher's 'host:port', got {address!r}")
    if not isinstance(channel, str) or not channel:
        raise ValueError(f"channel must be a non-empty string, got {channel!r}")
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")


def ranks(vllm_config: Any) -> tuple[int, int]:
    """(rank in this replica's world, data-parallel index)."""
    dp = int(getattr(vllm_config.parallel_config, "data_parallel_index", 0) or 0)
    try:
        from vllm.distributed.parallel_state import get_world_group

        return get_world_group().rank_in_group, dp
    except (ImportError, AssertionError, AttributeError):
        return 0, dp


def agree(version: int) -> tuple[int, int]:
    """(max, min) of ``version`` over this replica's workers; -1 stands for "failed"."""
    try:
        from vllm.distributed.parallel_state import get_world_group

        world = get_world_group()
    except (ImportError, AssertionError):
        return version, version
    if world.world_size == 1:
        return version, version
    both = torch.tensor([version, -version], dtype=torch.int64)
    torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX, group=world.cpu_group)
    return int(both[0]), -int(both[1])


def pin_agreed(pin: Callable[[int, float], int], release: Callable[[], object], min_version: int,
               timeout: float) -> None:
    """Pin a version >= ``min_version`` that every worker of this replica pins too: ``pin(target,
    seconds)`` pins one >= ``target`` and returns it (or raises), ``release()`` unpins. A worker
    that is behind waits for the newest one a peer pinned; one that failed fails them all."""
    deadline = time.monotonic() + timeout
    target = min_version
    while True:
        error: BaseException | None = None
        have = -1
        try:
            have = pin(target, max(deadline - time.monotonic(), 0.001))
        except WeightSyncError as exc:
            error = exc
        high, low = agree(have)
        if low < 0:
            release()
            if error is not None:
                raise error
            raise SyncTimeout(f"another worker of this vLLM replica has no version >= {target} "
                              f"within {timeout:.3g}s; this one had {have}")
        if high == low:
            return
        release()  # a peer already has a newer one: wait for it too
        target = high
