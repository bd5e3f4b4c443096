"""In-memory stand-ins for unit tests without processes: a control store and a data plane.

``FakeStore`` implements the part of the torch Store API that ``ControlPlane`` uses (queues,
counters, keys, clones, timeouts), with the same failure shapes: a blocking pop that times out
raises ``RuntimeError("... wait timeout ...")``, which ``ControlPlane`` turns into
``StoreTimeout``. ``FakePlane`` records what the Sender/Generations asked of the data plane.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections import defaultdict, deque

from weightsync.transport.dataplane import GenerationSpec, Transfer


class _Shared:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.queues: dict[str, deque[bytes]] = defaultdict(deque)
        self.keys: dict[str, bytes] = {}


class FakeStore:
    def __init__(self, shared: _Shared | None = None) -> None:
        self._shared = shared or _Shared()
        self.timeout = dt.timedelta(seconds=30)

    def clone(self) -> FakeStore:
        return FakeStore(self._shared)

    def set_timeout(self, timeout: dt.timedelta) -> None:
        self.timeout = timeout

    def check(self, keys: list[str]) -> bool:
        with self._shared.cond:
            return all(k in self._shared.keys for k in keys)

    def add(self, key: str, amount: int) -> int:
        with self._shared.cond:
            value = int(self._shared.keys.get(key, b"0")) + amount
            self._shared.keys[key] = str(value).encode()
            return value

    def delete_key(self, key: str) -> bool:
        with self._shared.cond:
            return self._shared.keys.pop(key, None) is not None or self._shared.queues.pop(key, None) is not None

    def queue_push(self, key: str, value: bytes) -> None:
        with self._shared.cond:
            self._shared.queues[key].append(bytes(value))
            self._shared.cond.notify_all()

    def queue_len(self, key: str) -> int:
        with self._shared.cond:
            return len(self._shared.queues[key])

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        with self._shared.cond:
            if not self._shared.cond.wait_for(lambda: bool(self._shared.queues[key]),
                                              self.timeout.total_seconds() if block else 0):
                raise RuntimeError(f"Wait timeout for key {key}")
            return self._shared.queues[key].popleft()


class FakePlane:
    """A data plane that moves nothing and remembers every call."""

    kind = "fake"

    def __init__(self, *, fail_enter: BaseException | None = None) -> None:
        self.calls: list[tuple[str, object]] = []
        self.fail_enter = fail_enter
        self.entered: list[GenerationSpec] = []

    def offer(self) -> str:
        self.calls.append(("offer", None))
        return "publisher-handle"

    def enter(self, spec: GenerationSpec) -> None:
        self.calls.append(("enter", spec.generation))
        if self.fail_enter is not None:
            raise self.fail_enter
        self.entered.append(spec)

    def move(self, transfer: Transfer) -> float:
        self.calls.append(("move", transfer.version))
        for i in range(len(transfer.buckets)):
            if transfer.before is not None:
                transfer.before(i)
            if transfer.after is not None:
                transfer.after(i)
        return 0.0

    def leave(self, reason: str, *, failed: bool = False) -> None:
        self.calls.append(("leave", failed))

    def close(self) -> None:
        self.calls.append(("close", None))
