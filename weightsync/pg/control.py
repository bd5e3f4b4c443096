"""The control plane: one channel's keys on a torch Store, every wait bounded.

Messages are the msgspec Structs of :mod:`weightsync._wire`. A ``ControlPlane`` wraps one
store *connection*; a torch Store client cannot serve two blocking waits at once, so each
thread that waits clones its own (:meth:`ControlPlane.clone`).
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from weightsync import _wire

StoreError = (RuntimeError, dist.DistError) if hasattr(dist, "DistError") else (RuntimeError,)


class StoreTimeout(TimeoutError):
    """A key did not appear within the deadline."""


class StoreUnreachable(ConnectionError):
    """The store's server stopped answering (its host process is gone)."""


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

    def clone(self) -> ControlPlane:
        return ControlPlane(self.store.clone(), self.channel)

    # keys -----------------------------------------------------------------
    def inbox_key(self, n: int) -> str:
        return f"{self.prefix}inbox/{n}"

    def admit_key(self, n: int) -> str:
        return f"{self.prefix}admit/{n}"

    def cmd_key(self, generation: int, seq: int) -> str:
        return f"{self.prefix}gen/{generation}/cmd/{seq}"

    def ack_key(self, generation: int, seq: int, rank: int) -> str:
        return f"{self.prefix}gen/{generation}/ack/{seq}/{rank}"

    def ready_key(self, generation: int, member_id: str) -> str:
        return f"{self.prefix}gen/{generation}/ready/{member_id}"

    def go_key(self, generation: int) -> str:
        return f"{self.prefix}gen/{generation}/go"

    def heartbeat_key(self, member_id: str) -> str:
        return f"{self.prefix}hb/{member_id}"

    # primitives -----------------------------------------------------------
    def set(self, key: str, value: bytes) -> None:
        self._call(self.store.set, key, value)

    def get(self, key: str) -> bytes:
        return bytes(self._call(self.store.get, key))

    def add(self, key: str, amount: int) -> int:
        return int(self._call(self.store.add, key, amount))

    def check(self, key: str) -> bool:
        return bool(self._call(self.store.check, [key]))

    def delete(self, key: str) -> None:
        try:
            self._call(self.store.delete_key, key)
        except (StoreUnreachable, StoreTimeout):
            pass

    def wait(self, keys: list[str], timeout: float) -> None:
        """Block until every key exists; StoreTimeout after ``timeout`` seconds."""
        self._call(self.store.wait, keys, dt.timedelta(seconds=max(timeout, 0.001)))

    def wait_key(self, key: str, timeout: float, *, cancelled: Callable[[], bool] = lambda: False,
                 slice_s: float = 0.1) -> bytes | None:
        """Wait for ``key`` in slices so ``cancelled()`` is seen promptly; None when cancelled.

        Raises StoreTimeout after ``timeout`` seconds (``float("inf")`` waits while the store
        answers: a dead store server ends it with StoreUnreachable).
        """
        end = time.monotonic() + timeout
        while True:
            if cancelled():
                return None
            left = end - time.monotonic()
            if left <= 0:
                raise StoreTimeout(f"{key} did not appear within {timeout:.1f}s")
            try:
                self.wait([key], min(slice_s, left))
            except StoreTimeout:
                continue
            return self.get(key)

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except StoreError as err:
            if _is_timeout(err):
                raise StoreTimeout(str(err)) from err
            raise StoreUnreachable(f"store of channel {self.channel!r} unreachable: {err}") from err

    # typed messages ---------------------------------------------------------
    def put_message(self, key: str, message: Any) -> None:
        self.set(key, _wire.encode(message))
