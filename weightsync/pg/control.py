"""The control plane: one channel's keys on a torch Store, every wait bounded.

Messages are the msgspec Structs of :mod:`weightsync._wire`. A ``ControlPlane`` wraps one
store *connection*; a torch Store client cannot serve two blocking waits at once, so each
thread that waits clones its own (:meth:`ControlPlane.clone`). Store errors are translated here,
once, into ``StoreTimeout`` and ``StoreUnreachable`` (see :mod:`weightsync._errors`).
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from weightsync import _wire
from weightsync._errors import StoreTimeout, StoreUnreachable
from weightsync.pg import _torch_compat as compat

StoreError = (RuntimeError, dist.DistError) if hasattr(dist, "DistError") else (RuntimeError,)
__all__ = ["ControlPlane", "StoreTimeout", "StoreUnreachable"]


def _is_timeout(err: BaseException) -> bool:
    name = type(err).__name__
    text = str(err).lower()
    return name == "DistStoreError" and "timeout" in text or "wait timeout" in text or "timed out" in text


class ControlPlane:
    """Keys of channel ``name`` on ``store``; see the layout in :mod:`weightsync._wire`."""

    def __init__(self, store: Any, channel: str) -> None:
        self.store = store
        self.channel = channel
        self.prefix = f"ws/{channel}/"

    def clone(self, timeout: float = 30.0) -> ControlPlane:
        return ControlPlane(compat.clone_store(self.store, timeout), self.channel)

    # queues and keys ---------------------------------------------------------------------
    @property
    def inbox(self) -> str:
        return f"{self.prefix}q/inbox"

    @property
    def replies(self) -> str:
        return f"{self.prefix}q/replies"

    def member_queue(self, member_id: str, nonce: str) -> str:
        return f"{self.prefix}q/member/{member_id}/{nonce}"

    def heartbeat_key(self, member_id: str) -> str:
        return f"{self.prefix}hb/{member_id}"

    # primitives ---------------------------------------------------------------------------
    def add(self, key: str, amount: int) -> int:
        return int(self._call(self.store.add, key, amount))

    def push(self, queue: str, message: Any) -> None:
        self._call(self.store.queue_push, queue, _wire.encode(message))

    def pending(self, queue: str) -> int:
        return int(self._call(self.store.queue_len, queue))

    def pop(self, queue: str, timeout: float) -> bytes:
        """The next item of ``queue``; StoreTimeout when none comes within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                self.store.set_timeout(dt.timedelta(seconds=max(min(left, 86_400.0), 0.001)))
                return bytes(self.store.queue_pop(queue, True))
            except StoreError as err:
                # measured (2.13, under churn): a blocking pop can wake on an empty queue and
                # fail with "queue is empty"; that is a spurious wake-up, not a dead store
                if "queue is empty" in str(err) and left > 0:
                    continue
                raise self._classify(err) from err

    def delete(self, key: str) -> None:
        try:
            self._call(self.store.delete_key, key)
        except (StoreUnreachable, StoreTimeout):
            pass

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except StoreError as err:
            raise self._classify(err) from err

    def _classify(self, err: BaseException) -> StoreTimeout | StoreUnreachable:
        if _is_timeout(err):
            return StoreTimeout(str(err))
        return StoreUnreachable(f"store of channel {self.channel!r} unreachable: {err}")

